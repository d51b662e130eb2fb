"""A TensorBoard scalar writer that needs neither torch nor mxnet: events in TensorBoard's own
format (tensorboard's protocol buffers and record framing, in a file named as its loaders look for
it), written by a background thread as TensorBoard's writer does, which never prints: a failed
write is one AccumcheckError, raised by the next call from the program's own thread."""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import socket
import threading
import time
from typing import Any, Sequence

from ..errors import AccumcheckError

# Events waiting for the thread; past this, adding one waits for the disk (memory stays bounded).
_QUEUED = 1024
_FLUSH, _CLOSE = object(), object()
_SERIAL = itertools.count()  # two writers of one process in the same second never share a file


class ScalarWriter:
    """``add_scalar(tag, value, step)`` into an event file under ``logdir``.

    The thread frames and writes the events and flushes whenever it has caught up, so a training
    step never waits for the disk. A write that fails there (a full disk, a folder removed) ends
    the writing, silently; the next ``add_scalar``, ``add_step``, ``flush`` or ``close`` raises
    AccumcheckError, one line naming ``option`` (what gave the folder), the folder and the OS
    error. The constructor writes the file's first event and waits for it, so a folder that
    takes no data fails there, before any work."""

    def __init__(self, logdir: str, option: str = "--grad-norms") -> None:
        try:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.record_writer import RecordWriter
        except ImportError:
            raise AccumcheckError("TensorBoard logging needs tensorboard: pip install 'accumcheck[diagnostics]'") from None
        self.logdir, self.option = logdir, option
        self._event, self._summary = Event, Summary
        self._error: BaseException | None = None  # what the thread failed with
        self._closed = False
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_SERIAL)}"
        try:
            os.makedirs(logdir, exist_ok=True)
            self._file = open(os.path.join(logdir, name), "xb")  # noqa: SIM115 - the thread closes it
        except OSError as exc:
            raise self._failure(exc) from None
        self._records = RecordWriter(self._file)
        self._queue: queue.Queue = queue.Queue(_QUEUED)
        self._thread = threading.Thread(target=self._run, name="accumcheck TensorBoard writer", daemon=True)
        self._thread.start()
        try:
            self._put(Event(wall_time=time.time(), file_version="brain.Event:2"))
            self.flush()
        except AccumcheckError:
            self._end_thread()
            raise

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=float(value))])
        self._put(self._event(wall_time=time.time(), step=int(step), summary=summary))

    def add_step(self, step: int, tags: Sequence[str], values: Sequence[float]) -> None:
        """``add_scalar(tag, value, step)`` for each tag, as one event (one value per tag)."""
        value = self._summary.Value
        summary = self._summary(value=[value(tag=t, simple_value=float(v)) for t, v in zip(tags, values)])
        self._put(self._event(wall_time=time.time(), step=int(step), summary=summary))

    def flush(self) -> None:
        """Wait until every event added so far is in the file (handed to the operating system);
        nothing to do once closed."""
        self._check(closing=self._closed)
        if self._closed:
            return
        self._queue.put(_FLUSH)
        self._queue.join()
        self._check()

    def close(self) -> None:
        """Write what is waiting, close the file and end the thread; then raise a failure, if any."""
        self._end_thread()
        self._check(closing=True)

    # -------------------------------------------------------------- between the two threads

    def _put(self, event: Any) -> None:
        self._check()
        self._queue.put(event.SerializeToString())

    def _end_thread(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(_CLOSE)
            self._thread.join()

    def _check(self, closing: bool = False) -> None:
        """Raise what the thread failed with, as the caller's own error."""
        if isinstance(self._error, OSError):
            raise self._failure(self._error) from None
        if self._error is not None:  # not the disk: a bug
            raise RuntimeError(f"the TensorBoard writer's thread failed: {self._error!r}") from self._error
        if self._closed and not closing:
            raise AccumcheckError(f"{self.option} {self.logdir}: the TensorBoard writer is closed")

    def _failure(self, exc: OSError) -> AccumcheckError:
        reason = exc.strerror or str(exc) or type(exc).__name__
        return AccumcheckError(f"{self.option} {self.logdir}: writing TensorBoard events failed ({reason})")

    def _run(self) -> None:
        """The thread: write each event, and flush once caught up. After a failure it takes what
        comes (no caller waits for it forever) and writes nothing; it never prints."""
        while True:
            item = self._queue.get()
            try:
                if self._error is None:
                    if item is _CLOSE:
                        self._file.close()
                    else:
                        if item is not _FLUSH:
                            self._records.write(item)
                        if self._queue.empty():
                            self._file.flush()
            except Exception as exc:  # noqa: BLE001 - raised by the caller's next call instead
                self._error = exc
                with contextlib.suppress(Exception):
                    self._file.close()  # what the buffer held is dropped: no second failure at exit
            finally:
                self._queue.task_done()
            if item is _CLOSE:
                return


class WriterOwner:
    """What the monitors share about their writer: one given as a log directory is made here and
    closed by ``close()`` (or the end of a ``with`` block), after the subclass's ``flush()``."""

    writer: Any = None
    _owns_writer = False

    def _take_writer(self, writer: Any) -> None:
        self._owns_writer = isinstance(writer, (str, os.PathLike))
        named = f"{type(self).__name__} writer"  # "GradMonitor writer DIR: writing ... failed (...)"
        self.writer = ScalarWriter(os.fspath(writer), named) if self._owns_writer else writer

    def flush(self) -> Any:
        raise NotImplementedError

    def close(self) -> Any:
        """``flush()``, then close the writer if the monitor made it (from a log directory), also
        where the flush failed (its error is the one raised)."""
        try:
            result = self.flush()
        except BaseException:
            if self._owns_writer:
                with contextlib.suppress(AccumcheckError):
                    self.writer.close()
            raise
        if self._owns_writer:
            self.writer.close()
        return result

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
