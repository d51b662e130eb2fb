"""A TensorBoard scalar writer that needs neither torch nor mxnet (tensorboard's own event
writer, the one torch.utils.tensorboard.SummaryWriter wraps)."""

from __future__ import annotations

import time
from typing import Sequence

from ..errors import AccumcheckError


class ScalarWriter:
    """``add_scalar(tag, value, step)`` into event files under ``logdir``."""

    def __init__(self, logdir: str) -> None:
        try:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise AccumcheckError("TensorBoard logging needs tensorboard: pip install 'accumcheck[diagnostics]'") from None
        self._event, self._summary = Event, Summary
        self._writer = EventFileWriter(logdir)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=float(value))])
        self._writer.add_event(self._event(wall_time=time.time(), step=int(step), summary=summary))

    def add_step(self, step: int, tags: Sequence[str], values: Sequence[float]) -> None:
        """``add_scalar(tag, value, step)`` for each tag, as one event (one value per tag)."""
        value = self._summary.Value
        summary = self._summary(value=[value(tag=t, simple_value=float(v)) for t, v in zip(tags, values)])
        self._writer.add_event(self._event(wall_time=time.time(), step=int(step), summary=summary))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
