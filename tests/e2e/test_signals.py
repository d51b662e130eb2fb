"""Signals end everything a run started, and a background writer that fails is one line.

The installed ``accumcheck`` command runs in its own session, so that every process of the run
(the main process, multiprocessing's resource tracker and fork server, the data-parallel ranks)
can be listed through /proc and, whatever the test finds, killed at its end. Its output goes to a
pseudo-terminal, where the progress bar shows what the run is doing: the signal comes once the
bar shows the ranks' micro-steps, so that it finds them at work, past their start. Only the main
process is signalled: what it started must end because it ends.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
from conftest import needs_torch

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists() or not hasattr(os, "setsid"),
                                reason="lists a run's processes through /proc (Linux)")

EXE = os.path.join(os.path.dirname(sys.executable), "accumcheck")
# Runs still busy when the signal comes, however fast the machine: they are at work within
# seconds, and their micro-steps take minutes.
DATA_PARALLEL = ["compare", "--world-size", "2", "--case", "shared-weight", "--accum-steps", "100000"]
SINGLE = ["compare", "--case", "shared-weight", "--accum-steps", "1000000"]
RANKS_AT_WORK = b"DDP no_sync"  # the progress bar's phase while rank 0 runs its micro-steps
HIDE, SHOW = b"\x1b[?25l", b"\x1b[?25h"  # the cursor, hidden while the bar shows
GONE_WITHIN_S = 10.0
START_WITHIN_S = 120.0  # a loaded machine imports PyTorch slowly


def session(sid: int) -> dict[int, tuple[int, str]]:
    """The live processes of session ``sid``: pid -> (parent pid, state). A zombie has ended."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended while being read
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
        state, ppid, session_id = fields[0], int(fields[1]), int(fields[3])
        if session_id == sid and state not in ("Z", "X"):
            found[int(entry.name)] = (ppid, state)
    return found


def ranks(main: int) -> list[int]:
    """The main process's grandchildren: the ranks, forked by the fork server it started."""
    processes = session(main)
    children = {pid for pid, (ppid, _) in processes.items() if ppid == main}
    return [pid for pid, (ppid, _) in processes.items() if ppid in children]


class Terminal:
    """A pseudo-terminal, 100 columns wide, for the command's input and output; ``seen`` holds
    everything the command wrote to it."""

    def __init__(self) -> None:
        import fcntl
        import pty
        import struct
        import termios

        self.leader, self.follower = pty.openpty()
        fcntl.ioctl(self.follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        self.seen = b""

    def read(self) -> bytes:
        """What has come, without waiting (the command never blocks on a full terminal)."""
        import select

        while select.select([self.leader], [], [], 0)[0]:
            try:
                chunk = os.read(self.leader, 65536)
            except OSError:  # EIO: no process holds the terminal any more
                break
            if not chunk:
                break
            self.seen += chunk
        return self.seen

    def close(self) -> None:
        for fd in (self.leader, self.follower):
            with contextlib.suppress(OSError):
                os.close(fd)


def _default_sigint() -> None:
    """In the child: Ctrl-C and hang-up at their defaults, even where the test runs as a background
    job (whose shell ignores SIGINT) or under nohup (which ignores SIGHUP): an ignoring the child
    would otherwise inherit, and rightly keep."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


@contextlib.contextmanager
def started(args: list[str]) -> Iterator[tuple[subprocess.Popen, Terminal]]:
    """The command in a session of its own on a pseudo-terminal; on the way out every process of
    its session is killed, whatever the test found."""
    terminal = Terminal()
    env = {k: v for k, v in os.environ.items()
           if k not in ("NO_COLOR", "TTY_INTERACTIVE", "TTY_COMPATIBLE", "COLUMNS", "LINES", "TERM")}
    env["TERM"] = "xterm-256color"
    try:
        proc = subprocess.Popen([EXE, *args], stdin=terminal.follower, stdout=terminal.follower,
                                stderr=terminal.follower, env=env, start_new_session=True,
                                preexec_fn=_default_sigint)
        os.close(terminal.follower)  # the command's now: the terminal ends when the command does
        terminal.follower = -1
        try:
            yield proc, terminal
        finally:
            for pid in [proc.pid, *session(proc.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    finally:
        terminal.close()


def wait_for(condition: Callable[[], bool], what: str, proc: subprocess.Popen, terminal: Terminal) -> None:
    deadline = time.monotonic() + START_WITHIN_S
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) before {what}: {terminal.read()[-2000:]!r}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {START_WITHIN_S:.0f} s: {terminal.read()[-2000:]!r}")
        time.sleep(0.05)


def signal_at_work(args: list[str], signum: int, at_work: bytes) -> tuple[subprocess.Popen, Terminal, float, dict]:
    """Start ``args``, send ``signum`` to its main process once the progress bar shows
    ``at_work``, and wait until none of its processes is left (or GONE_WITHIN_S passed): the
    run, its terminal, the seconds it took, and what was still alive."""
    with started(args) as (proc, terminal):
        wait_for(lambda: at_work in terminal.read(), at_work.decode(), proc, terminal)
        sent = time.monotonic()
        os.kill(proc.pid, signum)
        deadline = sent + GONE_WITHIN_S
        while session(proc.pid) and time.monotonic() < deadline:
            terminal.read()
            time.sleep(0.05)
        left, took = session(proc.pid), time.monotonic() - sent
        if not left:
            proc.wait(timeout=5)
            terminal.read()
        return proc, terminal, took, left


def assert_ended_well(terminal: Terminal) -> None:
    """After the bar: the cursor shown again and the one line that says why the run ended."""
    after = terminal.seen[terminal.seen.rindex(HIDE):]
    assert SHOW in after, f"the cursor stayed hidden: {after[-500:]!r}"
    assert b"accumcheck: interrupted" in after, terminal.seen[-2000:]
    traceback = terminal.seen.find(b"Traceback")
    assert traceback < 0, terminal.seen[max(0, traceback - 300):traceback + 3000]  # the traceback itself


@needs_torch
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)],
                         ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_signal_to_the_main_process_ends_the_ranks_and_the_fork_server(signum, code):
    proc, terminal, took, left = signal_at_work(DATA_PARALLEL, signum, RANKS_AT_WORK)
    assert not left, f"still alive {GONE_WITHIN_S:.0f} s after {signal.Signals(signum).name}: {left}"
    assert proc.returncode == code, terminal.seen[-2000:]
    assert_ended_well(terminal)
    print(f"{signal.Signals(signum).name}: every process of the run gone after {took:.1f} s")


@needs_torch
def test_ranks_end_when_the_main_process_is_killed():
    """SIGKILL leaves the main process no say: each rank sees it gone and ends itself, and the
    fork server ends with its last client."""
    proc, _, took, left = signal_at_work(DATA_PARALLEL, signal.SIGKILL, RANKS_AT_WORK)
    assert not left, f"still alive {GONE_WITHIN_S:.0f} s after SIGKILL: {left}"
    assert proc.returncode == -signal.SIGKILL
    print(f"SIGKILL: every process of the run gone after {took:.1f} s")


@needs_torch
@pytest.mark.parametrize("signum, code", [(signal.SIGHUP, 129), (signal.SIGTERM, 143)], ids=["SIGHUP", "SIGTERM"])
def test_a_signal_during_the_progress_bar_of_one_process_shows_the_cursor_again(signum, code):
    proc, terminal, _, left = signal_at_work(SINGLE, signum, HIDE)
    assert not left and proc.returncode == code, terminal.seen[-2000:]
    assert_ended_well(terminal)


@needs_torch
def test_a_grad_norms_folder_that_fills_up_is_one_line_and_exit_two(tmp_path):
    """The disk fills while the run writes its TensorBoard events (a file size limit, which makes
    the writer thread's write fail with EFBIG as a full disk makes it fail with ENOSPC): one
    line naming the option, the folder and the OS error; no thread traceback."""
    import resource

    limit = 100  # bytes: the file's first event (40) fits, the gradient norms (about 100 each) do not

    def limited() -> None:
        _default_sigint()
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    folder = tmp_path / "norms"
    result = subprocess.run([EXE, "compare", "--case", "shared-weight", "--grad-norms", str(folder)],
                            capture_output=True, text=True, timeout=300, preexec_fn=limited)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"accumcheck: error: --grad-norms {folder}: writing TensorBoard events failed (")
    assert f"({os.strerror(errno.EFBIG)})" in result.stderr  # "File too large"
    events = list(folder.glob("events.out.tfevents.*"))
    assert len(events) == 1 and 0 < events[0].stat().st_size <= limit  # it failed part way, not at the start
