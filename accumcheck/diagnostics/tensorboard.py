"""A TensorBoard scalar writer that needs neither torch nor mxnet (tensorboard's own event
writer, the one torch.utils.tensorboard.SummaryWriter wraps)."""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

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


class WriterOwner:
    """What the monitors share about their writer: one given as a log directory is made here and
    closed by ``close()`` (or the end of a ``with`` block), after the subclass's ``flush()``."""

    writer: Any = None
    _owns_writer = False

    def _take_writer(self, writer: Any) -> None:
        self._owns_writer = isinstance(writer, (str, os.PathLike))
        self.writer = ScalarWriter(os.fspath(writer)) if self._owns_writer else writer

    def flush(self) -> Any:
        raise NotImplementedError

    def close(self) -> Any:
        """``flush()``, then close the writer if the monitor made it (from a log directory)."""
        result = self.flush()
        if self._owns_writer:
            self.writer.close()
        return result

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
