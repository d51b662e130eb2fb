"""Starting and ending processes: what the environment says about a job launcher (torchrun), read
without importing torch, and the signals that end a run (SIGTERM, SIGHUP and Ctrl-C raised in the
main thread as one KeyboardInterrupt, so that one path ends whatever the run started)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any, Iterator

from ..errors import AccumcheckError

# torchrun sets these for every rank; together they are what env:// rendezvous needs.
_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# What a terminal, a job scheduler or a service manager sends to end a process, besides Ctrl-C.
_ENDING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


def launched_world_size() -> int | None:
    """WORLD_SIZE when this process was started by torchrun (or a launcher that sets the same
    environment), else None."""
    if all(name in os.environ for name in _TORCHRUN_VARIABLES):
        try:
            return int(os.environ["WORLD_SIZE"])
        except ValueError:
            raise AccumcheckError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} in the environment is not an "
                                  "integer; unset it or start the job with torchrun") from None
    return None


def launched_rank() -> int:
    """This process's rank in a job started by torchrun; 0 outside one (or where the environment
    is malformed, which ``launched_world_size`` reports)."""
    try:
        return int(os.environ.get("RANK", "0")) if launched_world_size() is not None else 0
    except (AccumcheckError, ValueError):
        return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM, SIGHUP or Ctrl-C, raised where the main thread is, as a KeyboardInterrupt: the
    ``finally`` blocks and ``with`` exits on the way out (data-parallel ranks, a progress bar, a
    file half written) run for all three alike."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def signal_number(exc: KeyboardInterrupt) -> int:
    """The signal behind ``exc``: its own for Terminated, SIGINT for Ctrl-C."""
    return exc.signum if isinstance(exc, Terminated) else int(signal.SIGINT)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@contextlib.contextmanager
def ending_signals() -> Iterator[None]:
    """Inside the block, SIGTERM, SIGHUP and Ctrl-C raise Terminated in the main thread; the
    handlers before are put back after. Only signals left at their default (death without cleanup,
    or Python's own KeyboardInterrupt) are taken: one ignored (``nohup``) or handled by the host
    program stays as it is. Outside the main thread (where Python cannot set handlers) nothing
    changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved: dict[int, Any] = {}
    for signum in _ENDING:
        if signal.getsignal(signum) == signal.SIG_DFL:
            saved[signum] = signal.signal(signum, _raise_terminated)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        saved[signal.SIGINT] = signal.signal(signal.SIGINT, _raise_terminated)
    unraisable = sys.unraisablehook
    sys.unraisablehook = _quiet_terminated(unraisable)
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
        sys.unraisablehook = unraisable
        _pending.clear()


def _quiet_terminated(hook: Any) -> Any:
    """``hook``, except for our own Terminated swallowed by a ctypes callback or a finalizer:
    that one is kept in ``_pending`` and raised again at the run's next step, so its "Exception
    ignored ... Traceback" would only put a traceback on the user's terminal."""
    def unraisable(info: Any) -> None:
        if not isinstance(info.exc_value, Terminated):
            hook(info)
    return unraisable


# Signals raised as Terminated since ending_signals began (cleared when it ends).
_pending: list[int] = []


def _raise_terminated(signum: int, frame: Any) -> None:
    # Raised wherever the main thread is, the exception can land in code that swallows it: a
    # ctypes callback (numba compiling or loading a kernel) or a finalizer prints "Exception
    # ignored" and goes on. The signal is kept, and raise_pending raises it again at the run's
    # next step.
    _pending.append(signum)
    raise Terminated(signum)


def raise_pending() -> None:
    """Raise Terminated again for a signal whose first Terminated was swallowed (see
    ``_raise_terminated``); nothing when none is waiting. Called at each step of a run."""
    if _pending:
        raise Terminated(_pending[0])
