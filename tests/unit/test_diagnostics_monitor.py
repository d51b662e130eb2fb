"""The GradMonitor lifecycle both frameworks share (``accumcheck.diagnostics.monitor``), on a toy
monitor whose "device" is numpy: the arguments and the window, which steps log, the copies read in
order as they arrive, the dominance report, the batches of statistics, and the writer."""

from __future__ import annotations

import numpy as np
import pytest

from accumcheck.diagnostics.monitor import GradMonitorBase
from accumcheck.diagnostics.report import DominanceReport
from accumcheck.diagnostics.tensorboard import ScalarWriter
from accumcheck.errors import AccumcheckError

PAIRS = [(f"layers.{i}.weight", None) for i in range(4)]


class Copy:
    """A step's values, arriving at once or when waited for."""

    def __init__(self, values, payload, arrived):
        self.payload, self._values, self.arrived = payload, values, arrived

    def ready(self):
        return self.arrived

    def wait(self):
        self.arrived = True

    def values(self):
        return self._values


class Plan:
    """Every statistic of every layer is the step's total norm."""

    def __init__(self, layers):
        self.layers = len(layers)

    def layer_stats(self, values):
        return np.repeat(values[:, :1], self.layers * 5, axis=1).reshape(len(values), self.layers, 5)


class Toy(GradMonitorBase):
    late = False  # the values arrive only when waited for

    def clip(self, norms, max_norm=1.0):
        step, logged = self._begin_step()
        norms = np.asarray(norms, np.float64)
        total = np.sqrt(np.square(norms).sum())
        values = np.concatenate([[total, min(1.0, max_norm / (total + 1e-6))], norms])
        self._pending.append(Copy(values, (step, norms, Plan(self.layers) if logged else None), not self.late))
        self._drain()

    def _report(self, norms, values, step, reason, total, coef):
        return DominanceReport(step=step, reason=reason, total_norm=total, clip_coef=coef)


class Recorder:
    def __init__(self):
        self.steps = []

    def add_scalar(self, tag, value, step):
        if not self.steps or self.steps[-1] != step:
            self.steps.append(step)


@pytest.mark.parametrize("arguments, message", [
    ({"log_every": 0}, "GradMonitor: log_every=0 is not a positive integer"),
    ({"top_k": -1}, "GradMonitor: top_k=-1 is not a positive integer"),
    ({"clip_threshold": float("inf")}, "GradMonitor: clip_threshold=inf is not a positive number"),
])
def test_bad_arguments_are_refused_before_a_writer_is_made(arguments, message, tmp_path):
    with pytest.raises(AccumcheckError, match=f"^{message}"):
        Toy(PAIRS, writer=tmp_path / "runs", **arguments)
    assert not (tmp_path / "runs").exists()


def test_no_parameter_to_watch_is_refused_in_the_frameworks_words():
    with pytest.raises(AccumcheckError, match=r"^GradMonitor: no parameter has a gradient; pass the parameters"):
        Toy([])


@pytest.mark.parametrize("steps", [0, -3, 2.5, "many", None])
def test_a_window_of_no_steps_is_refused_and_leaves_the_window_as_it_was(steps):
    monitor = Toy(PAIRS, writer=Recorder(), log_every=100)
    monitor.enable(2)
    with pytest.raises(AccumcheckError, match=f"^GradMonitor: steps={steps!r} is not a positive integer"):
        monitor.enable(steps)
    assert monitor.window_end == 1


def test_a_window_logs_every_step_and_disable_ends_it():
    recorder = Recorder()
    monitor = Toy(PAIRS, writer=recorder, log_every=5)
    for step in range(12):
        if step == 2:
            monitor.enable(3)  # steps 2, 3 and 4
        if step == 7:
            monitor.enable(4)
        if step == 8:
            monitor.disable()  # step 7 only
        monitor.clip([0.1, 0.2, 0.3, 0.4])
    monitor.flush()
    assert recorder.steps == [0, 2, 3, 4, 5, 7, 10]


def test_statistics_reach_the_writer_in_batches_and_at_once_after_a_report():
    recorder = Recorder()
    monitor = Toy(PAIRS, writer=recorder, log_every=1)
    for step in range(Toy.WRITE_EVERY - 1):
        monitor.clip([0.1, 0.2, 0.3, 0.4])
    assert recorder.steps == []  # a batch waits
    monitor.clip([0.1, 0.2, 0.3, 0.4])
    assert recorder.steps == list(range(Toy.WRITE_EVERY))
    monitor.clip([0.1, 0.2, 0.3, 0.4])
    monitor.clip([0.1, 0.2, 30.0, 0.4])  # clipping scale below 0.1: a report, and the waiting steps written
    assert [r.step for r in monitor.reports] == [Toy.WRITE_EVERY + 1] and "clipping scale" in monitor.reports[0].reason
    assert recorder.steps == list(range(Toy.WRITE_EVERY + 2))


def test_a_non_finite_norm_is_reported_without_a_writer():
    monitor = Toy(PAIRS)
    monitor.clip([0.1, np.inf, 0.3, 0.4])
    monitor.clip([0.1, 0.2, 0.3, 0.4])
    assert [(r.step, r.reason) for r in monitor.flush()] == [(0, "non-finite gradient norm")]


def test_late_values_are_read_in_order_when_they_arrive_and_flush_waits_for_them():
    recorder = Recorder()
    monitor = Toy(PAIRS, writer=recorder, log_every=1, clip_threshold=0.5)
    monitor.late = True
    for norms in ([0.1, 0.1, 0.1, 0.1], [9.0, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.1]):
        monitor.clip(norms)
    assert len(monitor._pending) == 3 and monitor.reports == [] and recorder.steps == []
    monitor._pending[1].wait()  # a later step's values, before the earlier ones: still waiting in order
    monitor.clip([0.1, 0.1, 0.1, 0.1])
    assert monitor.reports == [] and len(monitor._pending) == 4
    assert [r.step for r in monitor.flush()] == [1] and recorder.steps == [0, 1, 2, 3] and monitor._pending == []


def test_a_log_directory_is_a_writer_the_monitor_makes_and_closes(tmp_path):
    with Toy(PAIRS, writer=tmp_path / "runs", log_every=1) as monitor:
        assert isinstance(monitor.writer, ScalarWriter)
        for _ in range(3):
            monitor.clip([0.1, 0.2, 0.3, 0.4])
    assert monitor.writer._closed and list((tmp_path / "runs").iterdir())
    own = Recorder()
    own.close = lambda: pytest.fail("a writer of the caller's own is the caller's to close")
    with Toy(PAIRS, writer=own, log_every=1) as monitor:
        monitor.clip([0.1, 0.2, 0.3, 0.4])
    assert own.steps == [0]  # written at the end of the with-block
