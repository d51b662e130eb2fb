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


@dataclass
class RunResult:
    params: list[ParamAccumulation]
    framework: str
    versions: dict[str, str]
    device: str
    param_dtype: str
    accum_dtype: str
    # Extra roundings per micro-step in the native path where a kernel fuses the add (0: none).
    native_fused_roundings: int = 0
    losses: dict[str, float] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)


class Backend(ABC):
    """A framework that can build a Case and accumulate its gradients natively and by hand."""

    framework_name: str = ""

    @abstractmethod
    def versions(self) -> dict[str, str]:
        """Versions of the framework and its accelerator runtime."""

    @abstractmethod
    def run(self, case: Case, accum_steps: int, device: str, fault: Fault | None = None,
            oracle: bool = False, progress: Progress | None = None) -> RunResult:
        """Run ``accum_steps`` micro-steps of ``case`` on ``device`` ("cpu" or "gpu"/"cuda[:i]").

        Raises AccumcheckError when the device is not available."""
