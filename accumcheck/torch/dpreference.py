"""The data-parallel runner's single-process reference, computed by the ranks together.

The reference is what one process gets by accumulating the W*N global micro-batches natively
(``.grad`` in the parameters' dtype, in the global order 0, 1, ..., W*N - 1), divided by W. Its
micro-gradients do not depend on which process computes them (the same model, weights, kernels
and threads), only its additions do, and those are in order. So the micro-gradients are the ones
the ranks' own pass computes anyway (rank r: global micro-batches k*W + r; the hooks see each
before any fault or all-reduce touches it): after each micro-step every rank hands its flat
micro-gradient to rank 0, which adds them in the global order (``StreamedReference``): the same
float additions, in the same order, as one process's ``.grad`` (a parameter that received no
gradient in a micro-step adds zeros, which leave it as it was), so the same reference bit for bit,
with no pass of its own. From the same micro-gradients rank 0 sums manual: each micro-step's
mean over the ranks, as an all-reduce of it gives, added in step order. The losses are summed in the same order from each rank's list.

The float64 oracle runs a float64 model of its own: each rank computes the micro-gradients of its
own micro-batches in it and hands them to rank 0 the same way (``oracle_reference``), in the time
of N micro-steps instead of W*N on one rank while the others wait.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..case.definition import Case
from ..run.backend import Progress
from .builtin import CaseSubject
from .casemodel import to_numpy

# Micro-gradients a rank has handed to rank 0 and may still be sending: two, so that computing
# the next one overlaps with the send.
_IN_FLIGHT = 2


class StreamedReference:
    """The reference and manual summed on rank 0 as the ranks' pass goes: ``add`` each micro-step's
    flat micro-gradient (of ``width`` elements, every rank in the same micro-step), ``finish``
    for the sum in the global order and manual (rank 0; None and None on the others).

    Manual is what hand-written accumulation under DDP adds at each micro-step: the step's mean
    over ranks (float32, summed in rank order and divided by W, as an all-reduce of it), added into
    a buffer of ``accum_dtype``. Rank 0 adds step k once step k + 1 is handed to it, so that the
    other ranks' step k arrives while it computes: the steps it is handed must stay as they are
    for two further steps (``passes.StepRecorder``'s rows do), and a rank other than 0 sends its
    step itself, up to _IN_FLIGHT at a time, without a copy."""

    def __init__(self, width: int, world_size: int, rank: int, dtype: Any, accum_dtype: Any, dev: Any) -> None:
        self.rank = rank
        self.world_size = world_size
        self.sending: deque = deque()
        self.pending: tuple | None = None  # rank 0: (its step, the receives, their buffers) not yet added
        self.total = self.manual = self.mean = None
        self.others: list = []
        if rank == 0:
            self.total = torch.zeros(width, dtype=dtype, device=dev)
            self.manual = torch.zeros(width, dtype=accum_dtype, device=dev)
            self.mean = torch.empty(width, dtype=dtype, device=dev)
            # Step k + 1 arrives while step k is added: two sets of buffers, used in turn.
            self.others = [[torch.empty(width, dtype=dtype, device=dev) for _ in range(1, world_size)]
                           for _ in range(_IN_FLIGHT)]
        self.steps = 0

    def add(self, step: Any) -> None:
        if self.rank:
            if len(self.sending) == _IN_FLIGHT:
                self.sending.popleft().wait()
            self.sending.append(dist.isend(step, dst=0))
            return
        others = self.others[self.steps % _IN_FLIGHT]
        self.steps += 1
        works = [dist.irecv(buffer, src=r) for r, buffer in enumerate(others, start=1)]
        self._add_pending()
        self.pending = (step, works, others)

    def _add_pending(self) -> None:
        if self.pending is None:
            return
        step, works, others = self.pending
        self.pending = None
        self.total.add_(step)  # global micro-batch k*W, then k*W + 1, ...
        self.mean.copy_(step)
        for work, buffer in zip(works, others):
            work.wait()
            self.total.add_(buffer)
            self.mean.add_(buffer)
        self.manual.add_(self.mean.div_(self.world_size))

    def finish(self) -> tuple[Any, Any]:
        """(the reference's sum, manual) on rank 0, (None, None) on the others, every send done."""
        self._add_pending()
        for work in self.sending:
            work.wait()
        self.sending.clear()
        return self.total, self.manual


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
