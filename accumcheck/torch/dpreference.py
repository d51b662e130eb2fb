"""The data-parallel runner's single-process reference, computed on every rank.

The reference is what one process gets by accumulating the W*N global micro-batches natively
(``.grad`` in the parameters' dtype, in the global order 0, 1, ..., W*N - 1), divided by W. Its
micro-gradients do not depend on which process computes them (the same model, weights, kernels
and threads), only its additions do, and those are in order. So each rank computes, in a plain
model of its own (no DDP), the micro-gradients of the global micro-batches it also trains on
(rank r: k*W + r), and hands each to rank 0, which adds them in the global order: the same
float additions, in the same order, as one process's ``.grad`` (a parameter that received no
gradient in a micro-step is left as it was, its first gradient taken as it is), so the same
reference bit for bit, in the time of N micro-steps instead of W*N on one rank while the others
wait. The losses travel with the gradients and are summed in the same order.
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


def shared_reference(case: Case, weights: dict[str, np.ndarray], steps: int, world_size: int, rank: int, dev: Any,
                     oracle: bool, progress: Progress | None) -> tuple[dict, dict | None, float] | None:
    """On every rank of the group at once: rank 0 gets (the reference, divided by W, by name; the
    float64 model's, with ``oracle``; the mean loss), every other rank None."""
    single, loss = _accumulated(case, weights, torch.float32, dev, steps, world_size, rank, progress,
                                "single-process reference")
    exact_oracle = None
    if oracle:
        exact_oracle, _ = _accumulated(case, weights, torch.float64, dev, steps, world_size, rank, progress,
                                       "float64 oracle")
    return None if rank else (single, exact_oracle, loss)


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
