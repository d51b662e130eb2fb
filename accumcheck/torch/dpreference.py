"""The data-parallel runner's single-process reference, computed by the ranks together.

The reference is what one process gets by accumulating the W*N global micro-batches natively
(``.grad`` in the parameters' dtype, in the global order 0, 1, ..., W*N - 1), divided by W. Its
micro-gradients do not depend on which process computes them (the same model, weights, kernels
and threads), only its additions do, and those are in order. So the micro-gradients are the ones
the ranks' own pass computes anyway (rank r: global micro-batches k*W + r; the hooks see each
before any fault or all-reduce touches it): after each micro-step every rank hands its flat
micro-gradient to rank 0 (in shared memory where it can), which adds them in the global order
(``StreamedReference``): the same
float additions, in the same order, as one process's ``.grad`` (a parameter that received no
gradient in a micro-step adds zeros, which leave it as it was), so the same reference bit for bit,
with no pass of its own. From the same micro-gradients rank 0 sums manual: each micro-step's
mean over the ranks, as an all-reduce of it gives, added in step order. The losses are summed in
the same order from each rank's list.

The float64 oracle runs a float64 model of its own: each rank computes the micro-gradients of its
own micro-batches in it and sends them to rank 0 (``oracle_reference``), in the time
of N micro-steps instead of W*N on one rank while the others wait.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import platform
import socket
import time
from collections import deque
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..case.definition import Case
from ..judge.hostsums import add_ranks
from ..run.backend import Progress
from .builtin import CaseSubject
from .casemodel import to_numpy
from .passes import ROWS, STEP_ROWS

# Micro-gradients a rank has handed to rank 0 and may still be sending: two, so that computing
# the next one overlaps with the send.
_IN_FLIGHT = 2
# The shared rows' file starts with a page that holds the token rank 0 checks it by.
_HEADER = mmap.PAGESIZE


class StreamedReference:
    """The reference and manual summed on rank 0 as the ranks' pass goes: ``add`` each micro-step's
    flat micro-gradient (of ``width`` elements, every rank in the same micro-step), ``finish``
    for the sum in the global order and manual (rank 0; None and None on the others).

    Manual is what hand-written accumulation under DDP adds at each micro-step: the step's mean
    over ranks (float32, summed in rank order and divided by W, as an all-reduce of it), added into
    a buffer of ``accum_dtype``. Rank 0 adds step k once step k + 1 is handed to it, so that the
    other ranks' step k is there while it computes: the steps it is handed must stay as they are
    for two further steps (``passes.StepRecorder``'s rows do).

    How the other ranks' steps reach rank 0 (``shared`` tells which): where every rank runs on
    this machine's x86-64 CPU, each other rank's recorder writes its steps into ``rows``, memory
    rank 0 maps too (a memfd, which rank 0 opens through /proc). The rank then writes, in the
    page before its rows, which row holds its step k and that k steps are there; rank 0 adds from
    that row and writes there that it is done with it; the rank writes no step into a row rank 0
    may still read; its E and S are kept there too, for rank 0 to read once the pass is over
    (``sums``, ``peer_sums``). (x86-64 keeps one core's stores in order for the others, which that
    relies on.) Otherwise (GPUs, other hosts, other CPUs, no memfds) a rank sends each step to rank 0
    over the process group, up to _IN_FLIGHT at a time, without a copy (and so with ``share``
    False). Either way the same additions in the same order."""

    def __init__(self, width: int, world_size: int, rank: int, dtype: Any, accum_dtype: Any, dev: Any,
                 share: bool = True) -> None:
        self.rank = rank
        self.world_size = world_size
        self.sending: deque = deque()
        self.pending: tuple | None = None  # rank 0: (its step, the receives, their buffers) not yet added
        self.total = self.manual = None
        self.others: list = []
        self.rows = None  # a rank other than 0 sharing its steps: the recorder's rows
        self.sums = None  # such a rank: the recorder's E and S, which rank 0 reads from there
        self.peer_sums: list = []  # rank 0: every other rank's E and S, mapped
        self.pages: list = []  # the counters: this rank's (sharing), every other rank's (rank 0)
        self.peer_rows: list = []  # rank 0: every other rank's rows, mapped
        host_sums = dev.type == "cpu" and dtype == torch.float32 and accum_dtype in (torch.float32, torch.float64)
        self.shared = (share and host_sums and platform.machine().lower() in ("x86_64", "amd64")
                       and self._share(width, dtype))
        if rank == 0:
            self.total = torch.zeros(width, dtype=dtype, device=dev)
            self.manual = torch.zeros(width, dtype=accum_dtype, device=dev)
            # The ranks' mean, but for two (whose sums take one pass)
            self.mean = torch.empty(width if world_size > 2 or not self.shared else 0, dtype=dtype, device=dev)
            if not self.shared:  # step k + 1 arrives while step k is added: two sets of buffers, in turn
                self.others = [[torch.empty(width, dtype=dtype, device=dev) for _ in range(1, world_size)]
                               for _ in range(_IN_FLIGHT)]
        self.steps = 0

    def _share(self, width: int, dtype: Any) -> bool:
        """Map every other rank's rows on rank 0 (True on every rank), or leave it (False)."""
        size = _HEADER + ROWS * width * dtype.itemsize + 2 * width * 8
        # What rank 0 needs to map a rank's rows: (its process, the memfd's number there, the token
        # its file starts with, this machine), as int64s; a process 0 where there is none.
        offer = torch.zeros(5, dtype=torch.int64)
        mapping = fd = None
        if self.rank:
            try:
                fd = os.memfd_create(f"accumcheck-rank-{self.rank}-steps", os.MFD_CLOEXEC)
                os.ftruncate(fd, size)
                mapping = mmap.mmap(fd, size)
                token = np.frombuffer(os.urandom(16), np.int64)
                _page_of(mapping)[_TOKEN:_TOKEN + 2] = token
                offer[:] = torch.tensor([os.getpid(), fd, *token.tolist(), _machine()])
            except (AttributeError, OSError):  # no memfd here, or no memory for it
                mapping = None
        offers = [torch.empty_like(offer) for _ in range(self.world_size)]
        dist.all_gather(offers, offer)  # tensors, not pickled objects: one collective
        mapped: list | None = []
        if self.rank == 0:
            try:
                for peer in offers[1:]:
                    pid, peer_fd, token_a, token_b, machine = peer.tolist()
                    if pid == 0 or machine != _machine():
                        raise OSError("not on this machine")
                    with open(f"/proc/{pid}/fd/{peer_fd}", "r+b") as handle:
                        peer_mapping = mmap.mmap(handle.fileno(), size)
                    if _page_of(peer_mapping)[_TOKEN:_TOKEN + 2].tolist() != [token_a, token_b]:
                        raise OSError("another process's file, not the rank's rows")
                    mapped.append(peer_mapping)
            except (OSError, ValueError):  # unreadable, or another (shorter) file than the rank's
                mapped = None
        shared = torch.tensor([mapped is not None], dtype=torch.int64)
        dist.broadcast(shared, src=0)
        if fd is not None:
            os.close(fd)  # rank 0 has opened it, or will not: the mapping stays
        if not shared.item():
            return False
        if self.rank:
            self.rows, self.pages = _rows_of(mapping, width, dtype), [_page_of(mapping)]
            self.sums = _sums_of(mapping, width, dtype)
        else:
            self.peer_rows = [_rows_of(m, width, dtype).numpy() for m in mapped]
            self.peer_sums = [_sums_of(m, width, dtype) for m in mapped]
            self.pages = [_page_of(m) for m in mapped]
            self.addresses = np.zeros(len(mapped), np.int64)
        return True

    def add(self, step: Any) -> None:
        k = self.steps
        self.steps += 1
        if self.rank and self.shared:
            row = (step.data_ptr() - self.rows.data_ptr()) // (self.rows.shape[1] * self.rows.element_size())
            if not (0 <= row < ROWS and step.data_ptr() == self.rows[row].data_ptr()):
                raise RuntimeError("a step handed on outside the shared rows")
            page = self.pages[0]
            page[_ROW_OF + k % _ROW_SLOTS] = row
            page[_HANDED] = k + 1  # stored after the row and its number
            # The next step goes into the row of the step STEP_ROWS - 1 before this one at the
            # earliest: rank 0 is done with that one first.
            _wait_for(page, _DONE, k + 2 - STEP_ROWS, "rank 0 to add a step")
            return
        if self.rank:
            if len(self.sending) == _IN_FLIGHT:
                self.sending.popleft().wait()
            self.sending.append(dist.isend(step, dst=0))
            return
        works = others = None
        if not self.shared:
            others = self.others[k % _IN_FLIGHT]
            works = [dist.irecv(buffer, src=r) for r, buffer in enumerate(others, start=1)]
        self._add_pending()
        self.pending = (k, step, works, others)

    def _add_pending(self) -> None:
        if self.pending is None:
            return
        k, step, works, others = self.pending
        self.pending = None
        if not self.shared:
            self.total.add_(step)  # global micro-batch k*W, then k*W + 1, ...
            self.mean.copy_(step)
            for work, buffer in zip(works, others):
                work.wait()
                self.total.add_(buffer)
                self.mean.add_(buffer)
            self.manual.add_(self.mean.div_(self.world_size))
            return
        for r, page in enumerate(self.pages):
            _wait_for(page, _HANDED, k + 1, f"rank {r + 1}'s micro-step {k}")
            self.addresses[r] = self.peer_rows[r][page[_ROW_OF + k % _ROW_SLOTS]].ctypes.data
        add_ranks(step.numpy(), self.addresses, self.total.numpy(), self.mean.numpy(), self.manual.numpy(),
                  self.world_size)
        for page in self.pages:
            page[_DONE] = k + 1  # the rank may write into the row again

    def finish(self) -> tuple[Any, Any]:
        """(the reference's sum, manual) on rank 0, (None, None) on the others, every step added
        and every send done."""
        self._add_pending()
        for work in self.sending:
            work.wait()
        self.sending.clear()
        return self.total, self.manual


# The page before a sharing rank's rows, as int64s: its token, the steps it has handed on, the steps
# rank 0 is done with, and the row of step k at _ROW_OF + k % _ROW_SLOTS (a rank runs at most
# STEP_ROWS - 1 steps ahead of rank 0's adding).
_TOKEN, _HANDED, _DONE, _ROW_OF, _ROW_SLOTS = 0, 2, 3, 4, 16
# Waiting for the other side: a few checks at once, then sleeps (a rank that is gone never
# writes, and one slower than this by a micro-step is waited for without spinning a core).
_SPINS, _SLEEP_S, _GIVE_UP_S = 64, 50e-6, 30 * 60.0


def _rows_of(mapping: mmap.mmap, width: int, dtype: Any) -> Any:
    """The (ROWS, width) tensor in ``mapping`` after its header (which keeps it mapped)."""
    return torch.frombuffer(mapping, dtype=dtype, count=ROWS * width, offset=_HEADER).view(ROWS, width)


def _sums_of(mapping: mmap.mmap, width: int, dtype: Any) -> tuple[Any, Any]:
    """The two float64 arrays of ``width`` (E, S) in ``mapping`` after the rows."""
    at = _HEADER + ROWS * width * dtype.itemsize
    return tuple(torch.frombuffer(mapping, dtype=torch.float64, count=width, offset=at + 8 * width * j)
                 for j in range(2))


def _machine() -> int:
    """This machine's host name as an int64."""
    return int.from_bytes(hashlib.blake2b(socket.gethostname().encode(), digest_size=8).digest(), "little",
                          signed=True)


def _page_of(mapping: mmap.mmap) -> np.ndarray:
    return np.frombuffer(mapping, dtype=np.int64, count=_ROW_OF + _ROW_SLOTS)


def _wait_for(page: np.ndarray, index: int, value: int, what: str) -> None:
    """Until ``page[index]`` reaches ``value``."""
    spins = 0
    deadline = None
    while page[index] < value:
        spins += 1
        if spins < _SPINS:
            continue
        if deadline is None:
            deadline = time.monotonic() + _GIVE_UP_S
        elif time.monotonic() > deadline:
            raise RuntimeError(f"waited {_GIVE_UP_S:.0f} s for {what}")
        time.sleep(_SLEEP_S)


def in_global_order(losses: list[list[float]]) -> float:
    """The mean of the ranks' micro-step losses (``losses[r][k]``) summed in float64 in the global
    order k*W + r, as one process sums them."""
    total = 0.0
    for k in range(len(losses[0])):
        for per_rank in losses:
            total += per_rank[k]
    return total / (len(losses) * len(losses[0]))


def oracle_reference(case: Case, weights: dict[str, np.ndarray], steps: int, world_size: int, rank: int, dev: Any,
                     progress: Progress | None) -> dict | None:
    """On every rank of the group at once: rank 0 gets the float64 model's accumulation of the
    W*N global micro-batches, divided by W, by name; every other rank None."""
    exact, _ = _accumulated(case, weights, torch.float64, dev, steps, world_size, rank, progress, "float64 oracle")
    return exact


def _accumulated(case: Case, weights: dict[str, np.ndarray], dtype: Any, dev: Any, steps: int, world_size: int,
                 rank: int, progress: Progress | None, phase: str) -> tuple[dict | None, float]:
    total = world_size * steps
    subject = CaseSubject(case, weights, dtype, dev, total)
    params = subject.params
    loss_of = subject.step_loss(subject.model)
    sizes = [p.numel() for p in params.values()]
    spans = np.cumsum([0] + sizes).tolist()
    width = spans[-1]
    # One message per micro-step: the flat micro-gradient, then the loss, then a 1 for each
    # parameter that received a gradient in it.
    length = width + 1 + len(params)

    def micro_step(index: int, out: Any) -> None:
        for p in params.values():
            p.grad = None
        loss = loss_of(index)
        loss.backward()
        for j, p in enumerate(params.values()):
            got = p.grad is not None
            if got:
                out[spans[j]:spans[j + 1]].copy_(p.grad.reshape(-1))
            out[width + 1 + j] = 1.0 if got else 0.0
        out[width] = loss.detach()

    if rank:
        pending: deque = deque()
        for k in range(steps):
            if len(pending) == _IN_FLIGHT:
                out, work = pending.popleft()
                work.wait()
            else:
                out = torch.empty(length, dtype=dtype, device=dev)
            micro_step(k * world_size + rank, out)
            pending.append((out, dist.isend(out, dst=0)))
        for _, work in pending:
            work.wait()
        for p in params.values():
            p.grad = None
        return None, 0.0

    acc = torch.zeros(width, dtype=dtype, device=dev)
    started = [False] * len(params)
    loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
    own = torch.empty(length, dtype=dtype, device=dev)
    others = [torch.empty(length, dtype=dtype, device=dev) for _ in range(1, world_size)]

    def add(step: Any) -> None:
        nonlocal loss_sum
        got = step[width + 1:].tolist()
        if all(started) and all(got):
            acc.add_(step[:width])
        else:
            for j, flag in enumerate(got):
                if not flag:
                    continue  # no gradient: .grad stays as it is
                part, piece = acc[spans[j]:spans[j + 1]], step[spans[j]:spans[j + 1]]
                part.add_(piece) if started[j] else part.copy_(piece)
                started[j] = True
        loss_sum += step[width]

    for k in range(steps):
        works = [dist.irecv(buffer, src=r) for r, buffer in enumerate(others, start=1)]
        micro_step(k * world_size, own)
        add(own)
        for work, buffer in zip(works, others):
            work.wait()
            add(buffer)
        if progress is not None:
            progress(phase, (k + 1) * world_size, total)
    for p in params.values():
        p.grad = None
    reference = {name: to_numpy((acc[spans[j]:spans[j + 1]] if started[j] else torch.zeros(sizes[j], dtype=dtype,
                                 device=dev)).view(p.shape) / world_size)
                 for j, (name, p) in enumerate(params.items())}
    return reference, float(loss_sum) / total
