"""What every backend returns: per-parameter accumulations as numpy arrays."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..cases import Case
from ..faults import Fault

# Called after each micro-step with (phase, steps done, steps in this phase).
Progress = Callable[[str, int, int], None]


@dataclass
class ParamAccumulation:
    """One parameter after N micro-steps.

    native  A: the framework's own accumulation      manual  B: zero/write + add into a buffer
    exact   E: float64 sum of the same micro-grads    absum   S: float64 sum of their magnitudes
    oracle  O: the same accumulation with the whole model in float64 (optional)
    """

    name: str
    kind: str
    native: np.ndarray
    manual: np.ndarray
    exact: np.ndarray
    absum: np.ndarray
    oracle: np.ndarray | None = None
    # Data parallel: the same accumulation in one process over the same global micro-batches
    # (divided by the number of ranks, as DistributedDataParallel averages).
    reference: np.ndarray | None = None


@dataclass
class RankAccumulation:
    """One rank of a data-parallel run, every dict keyed by parameter name.

    local_native  the rank's own native total (N micro-steps under no_sync) just before the
                  all-reduce, as DistributedDataParallel hands it to the communication hook
    exact, absum  the rank's E and S (float64 sums of its micro-gradients and their magnitudes)
    native        the rank's gradient after the all-reduce (every rank should hold the same)
    """

    rank: int
    host: str
    local_native: dict[str, np.ndarray]
    exact: dict[str, np.ndarray]
    absum: dict[str, np.ndarray]
    native: dict[str, np.ndarray]


@dataclass
class RunResult:
    params: list[ParamAccumulation]
    framework: str
    versions: dict[str, str]
    device: str
    param_dtype: str
    accum_dtype: str
    # Allowance (in units of u, see bounds.ModeBound) where the native path's kernels add into the
    # running total themselves and so compute micro-gradients differently from the manual path.
    native_kernel_allowance: float = 0.0
    losses: dict[str, float] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    # Logits of micro-batch 0 in the manual pass, to compare forward passes across frameworks.
    first_logits: np.ndarray | None = None
    # Data parallel: each rank's own view (rank order), and how the run was set up
    # (world_size, reduce_dtype, ...); None for a single-process run.
    ranks: list[RankAccumulation] | None = None
    data_parallel: dict[str, Any] | None = None


class Backend(ABC):
    """A framework that can build a Case and accumulate its gradients natively and by hand."""

    framework_name: str = ""

    @abstractmethod
    def versions(self) -> dict[str, str]:
        """Versions of the framework and its accelerator runtime."""

    @abstractmethod
    def run(self, case: Case, accum_steps: int, device: str, fault: Fault | None = None,
            oracle: bool = False, progress: Progress | None = None,
            options: dict[str, Any] | None = None, weights: dict[str, np.ndarray] | None = None) -> RunResult:
        """Run ``accum_steps`` micro-steps of ``case`` on ``device`` ("cpu" or "gpu"/"cuda[:i]").
        ``options`` holds framework-specific settings (MXNet: ``hybridize``); others ignore them.
        ``weights`` replaces the case's initial weights (same names and shapes).

        Raises AccumcheckError when the device is not available."""
