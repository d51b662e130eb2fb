"""accumcheck.run.launch.ending_signals: SIGTERM, SIGHUP and Ctrl-C end a run through one exception,
and a signal whose exception was swallowed where it landed still ends the run at its next step."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

import pytest

from accumcheck.cli import _LazyProgress
from accumcheck.run.launch import Terminated, ending_signals, raise_pending, signal_number

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")


def _deliver(signum: int) -> None:
    """Send ``signum`` to this process and give Python the moment to run its handler."""
    os.kill(os.getpid(), signum)
    for _ in range(1000):  # the handler runs between two of these bytecodes at the latest
        time.sleep(0)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_each_signal_raises_one_terminated_and_the_handlers_come_back(signum):
    # Python's own handler, as a plain program has it (a handler the host program set instead is
    # kept, as test_an_ignored_signal_stays_ignored shows), and what was there put back after
    before = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
    found = signal.signal(signum, before)
    try:
        with ending_signals():
            with pytest.raises(Terminated) as caught:
                _deliver(signum)
            assert isinstance(caught.value, KeyboardInterrupt) and signal_number(caught.value) == signum
        assert signal.getsignal(signum) is before
        raise_pending()  # the block's end took every signal: nothing is raised again
    finally:
        signal.signal(signum, found)


def test_a_terminated_swallowed_by_a_ctypes_callback_is_raised_again_at_the_next_step(monkeypatch):
    """numba compiles and loads its kernels through ctypes callbacks, which hand an exception
    raised in them to sys.unraisablehook and go on: the signal must not be lost there, and the
    swallowed exception prints no "Exception ignored ... Traceback" on the user's terminal."""
    reported = []
    hook = lambda unraisable: reported.append(unraisable.exc_type)  # noqa: E731
    monkeypatch.setattr(sys, "unraisablehook", hook)
    callback = ctypes.CFUNCTYPE(None)(lambda: _deliver(signal.SIGTERM))
    with ending_signals():
        callback()  # the handler's Terminated lands inside the callback and is swallowed there
        assert reported == []  # kept for the next step, not reported
        with pytest.raises(Terminated):
            raise_pending()
        with pytest.raises(Terminated) as caught:  # the command line's progress, called at each step
            _LazyProgress(enabled=False).update("native + manual", 1, 32)
        assert signal_number(caught.value) == signal.SIGTERM
        ctypes.CFUNCTYPE(None)(lambda: 1 / 0)()  # anyone else's unraisable exception is still reported
        assert reported == [ZeroDivisionError]
    assert sys.unraisablehook is hook


def test_an_ignored_signal_stays_ignored():
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with ending_signals():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            _deliver(signal.SIGHUP)  # nothing happens
            raise_pending()
    finally:
        signal.signal(signal.SIGHUP, before)
