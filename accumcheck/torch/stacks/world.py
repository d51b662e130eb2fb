"""The data-parallel world a stack's check runs in: its ranks, and the few collectives the check
needs to agree on a window (every rank's micro-batches of it, in one order).

A window in a data-parallel run is every rank's micro-batches of that optimizer step. Ranks are
numbered as ``torch.distributed`` numbers them; rank r's i-th micro-batch is the run's micro-batch
i*W + r, as a ``DistributedSampler`` interleaves a dataset over the ranks. Outside a process group
(or in one of a single rank) the world is one rank, and every collective here is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from ...errors import AccumcheckError
from ...run.usermodel import map_leaves


@dataclass(frozen=True)
class World:
    """``size`` ranks, this process ``rank``; ``backend`` ("gloo", "nccl") where a process group
    is initialised."""

    rank: int = 0
    size: int = 1
    backend: str = ""

    @staticmethod
    def current() -> "World":
        """The process group this process belongs to, or a world of one."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return World()
        return World(dist.get_rank(), dist.get_world_size(), str(dist.get_backend()))

    @property
    def parallel(self) -> bool:
        return self.size > 1

    def global_index(self, local: int, rank: int | None = None) -> int:
        """The run's number of ``rank``'s ``local``-th micro-batch (default: this rank's)."""
        return local * self.size + (self.rank if rank is None else rank)

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, by rank (tensors in it brought to the CPU). A collective: every
        rank calls it, in the same order."""
        if not self.parallel:
            return [value]
        found: list[Any] = [None] * self.size
        torch.distributed.all_gather_object(found, map_leaves(value, _on_cpu))
        return found

    def same(self, value: Any, what: str) -> Any:
        """``value``, which every rank must hold alike (a setting, a count); AccumcheckError naming
        the ranks where it differs."""
        values = self.gather(value)
        if any(v != values[0] for v in values):
            listed = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise AccumcheckError(f"stack check: the ranks disagree on {what} ({listed}); every rank must run the "
                                  "same loop with the same check")
        return values[0]


    def meet(self, who: str, timeout_s: float = 120.0) -> None:
        """Every rank at the check's start, or AccumcheckError naming the ranks that never came
        within ``timeout_s`` (gloo's monitored barrier; other backends wait at a plain barrier): a
        rank without the check would leave the others waiting in its first collective."""
        if not self.parallel:
            return
        if self.backend != "gloo":
            torch.distributed.barrier()
            return
        try:
            torch.distributed.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        except RuntimeError as exc:
            text = " ".join(str(exc).split())[:200]
            raise AccumcheckError(f"{who}: not every rank entered the check within {timeout_s:g} s ({text}); every "
                                  "rank must run the same loop with the same check") from None


def _on_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value
