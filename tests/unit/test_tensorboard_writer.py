"""The TensorBoard writer: events TensorBoard reads, written by a background thread that never
prints; a write that fails there (a full disk) is one AccumcheckError from the next call, in the
writer and in both GradMonitors that make one from a log directory."""

from __future__ import annotations

import errno
import os
import threading

import pytest

from accumcheck.errors import AccumcheckError

pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'accumcheck[diagnostics]')")
from accumcheck.diagnostics import tensorboard  # noqa: E402
from accumcheck.diagnostics.tensorboard import ScalarWriter  # noqa: E402

NO_SPACE = os.strerror(errno.ENOSPC)


class FullDisk:
    """The writer's file on a disk with ``room`` bytes left: a write past them fails with ENOSPC,
    as a full disk's does. Notes the threads that write."""

    def __init__(self, real, room: int) -> None:
        self.real, self.room, self.written, self.threads = real, room, 0, set()

    def write(self, data: bytes) -> int:
        self.threads.add(threading.current_thread())
        if self.written + len(data) > self.room:
            raise OSError(errno.ENOSPC, NO_SPACE)
        self.written += len(data)
        return self.real.write(data)

    def flush(self) -> None:
        self.real.flush()

    def close(self) -> None:
        self.real.close()

    @property
    def closed(self) -> bool:
        return self.real.closed


@pytest.fixture
def full_disk(monkeypatch):
    """``room(n)``: from now on the writer's files have n bytes of disk; returns the files made."""
    made: list[FullDisk] = []
    thread_errors: list = []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)

    def room(n: int) -> list[FullDisk]:
        def opener(path, mode="r", *args, **kwargs):
            made.append(FullDisk(open(path, mode, *args, **kwargs), n))
            return made[-1]

        monkeypatch.setattr(tensorboard, "open", opener, raising=False)
        return made

    yield room
    assert not thread_errors, f"a thread printed its exception: {thread_errors}"


def writer_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "accumcheck TensorBoard writer" and t.is_alive()}


def scalars(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir))
    events.Reload()
    return events


def test_tensorboard_reads_what_the_writer_wrote(tmp_path):
    writer = ScalarWriter(str(tmp_path))
    writer.add_scalar("loss", 0.5, 3)
    writer.add_step(4, ["a/x", "b/x"], [1.0, 2.0])
    writer.close()
    events = scalars(tmp_path)
    assert set(events.Tags()["scalars"]) == {"loss", "a/x", "b/x"}
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(3, 0.5)]
    assert [(e.step, e.value) for e in events.Scalars("b/x")] == [(4, 2.0)]
    assert not writer._thread.is_alive()
    with pytest.raises(AccumcheckError, match="the TensorBoard writer is closed"):
        writer.add_scalar("loss", 1.0, 5)
    writer.flush()  # after close: nothing more
    writer.close()


def test_a_disk_that_fills_during_the_run_is_one_error_from_the_next_call(tmp_path, full_disk):
    files = full_disk(100)  # the first event (40 bytes) fits; the steps' do not
    writer = ScalarWriter(str(tmp_path))
    with pytest.raises(AccumcheckError) as raised:
        for step in range(1000):
            writer.add_step(step, [f"grad_norm/layer{i}" for i in range(8)], [float(i) for i in range(8)])
        writer.flush()
    message = f"--grad-norms {tmp_path}: writing TensorBoard events failed ({NO_SPACE})"
    assert str(raised.value) == message
    (file,) = files
    assert threading.main_thread() not in file.threads and len(file.threads) == 1  # the writer's own thread
    with pytest.raises(AccumcheckError, match="writing TensorBoard events failed"):
        writer.add_scalar("loss", 1.0, 0)
    with pytest.raises(AccumcheckError, match="writing TensorBoard events failed"):
        writer.close()
    assert not writer._thread.is_alive() and file.closed


def test_a_folder_that_takes_nothing_fails_when_the_writer_is_made(tmp_path, full_disk):
    full_disk(0)
    before = writer_threads()
    with pytest.raises(AccumcheckError, match=f"^--grad-norms {tmp_path}: writing TensorBoard events failed"):
        ScalarWriter(str(tmp_path))
    assert writer_threads() <= before  # the writer's thread ended with it


def _torch_steps(folder, steps):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from accumcheck.torch import GradMonitor

    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))
    with GradMonitor(model, writer=folder, log_every=1) as monitor:
        for step in range(steps):
            model.zero_grad()
            model(torch.ones(2, 8)).square().sum().backward()
            monitor.clip_grad_norm_(1.0)


def _mxnet_steps(folder, steps):
    mx = pytest.importorskip("mxnet", reason="mxnet is not installed")
    import accumcheck.mxnet  # noqa: F401
    from accumcheck.mxnet import GradMonitor

    net = mx.gluon.nn.HybridSequential()
    for _ in range(4):
        net.add(mx.gluon.nn.Dense(8, in_units=8))
    net.initialize()
    with GradMonitor(net, writer=folder, log_every=1) as monitor:
        for step in range(steps):
            with mx.autograd.record():
                loss = net(mx.nd.ones((2, 8))).square().sum()
            loss.backward()
            monitor.clip_global_norm(1.0)


@pytest.mark.parametrize("steps", [_torch_steps, _mxnet_steps], ids=["torch", "mxnet"])
def test_a_monitors_log_directory_on_a_full_disk_is_one_error(tmp_path, full_disk, steps):
    files = full_disk(100)
    folder = tmp_path / "runs"
    before = writer_threads()
    with pytest.raises(AccumcheckError) as raised:
        steps(folder, 40)
    assert str(raised.value) == f"GradMonitor writer {folder}: writing TensorBoard events failed ({NO_SPACE})"
    assert all(threading.main_thread() not in file.threads for file in files)
    assert writer_threads() <= before  # the monitor closed its writer on the way out
