"""What a framework backend is to the rest of accumcheck: what it declares it can do and the run it
performs (what the run hands back is ``accumcheck.run.results``).

Rules: a backend module imports its framework inside its methods, never at module top, so that
finding and listing backends stays cheap and a missing framework is one AccumcheckError saying how
to install it. A backend declares its Capabilities once; every option a backend cannot honour is
refused centrally (``accumcheck.run.validation.configure``) before it runs, naming the backend and the option.
Backends are found through the ``accumcheck.backends`` entry-point group (``accumcheck.run.registry``).
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from ..case.definition import LAYER_TYPES
from ..errors import AccumcheckError
from ..options.choices import ACCUM_DTYPES
from ..options.spec import Option
from ..report import TrajectoryReport
from .budget import TensorNeed
from .config import RunConfig
from .results import RunResult

# Called after each micro-step with (phase, steps done, steps in this phase).
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class Capabilities:
    """What a backend can run. An option whose Option.capability names a field here may take a
    value other than its default only where the field admits it: a tuple lists the values, a
    bool says yes or no. ``single_process_only`` names options it honours without
    ``world_size`` only; ``options`` are its own (MXNet's ``hybridize``); ``trajectory`` says
    whether it runs ``accumcheck train``; ``layer_types`` which of the case vocabulary's layers
    it builds (a case with others is refused)."""

    dtypes: tuple[str, ...] = ("float32",)
    accum_dtypes: tuple[str, ...] = ACCUM_DTYPES
    modes: tuple[str, ...] = ("native",)
    oracle: bool = True
    full_batch: bool = False
    data_parallel: bool = False
    reduce_dtypes: tuple[str, ...] = ("float32",)
    single_process_only: tuple[str, ...] = ()
    trajectory: bool = False
    trajectory_dtypes: tuple[str, ...] = ("float32",)  # the parameter dtypes ``accumcheck train`` runs
    replay: bool = False  # streams a run's micro-gradients again (micro_gradients): causes, statistical tier
    memory_budget: bool = False  # runs the tensors in groups (run_groups, tensor_needs): --memory-budget
    layer_types: tuple[str, ...] = LAYER_TYPES  # the layer types it builds a case from
    options: tuple[Option, ...] = ()
    why_not: dict[str, str] = field(default_factory=dict)  # option name -> why it is limited here

    def admits(self, option: Option, value: Any) -> bool:
        """Whether ``option`` may take ``value`` here."""
        allowed = getattr(self, option.capability) if option.capability else True
        if isinstance(allowed, tuple):
            return value in allowed
        return bool(allowed) or value == option.default


class Backend(ABC):
    """A framework that can build a Case and accumulate its gradients natively and by hand."""

    name: str = ""  # what --framework calls it
    package: str = ""  # the framework's import name: whether it is installed, without importing it
    install: str = ""  # how to install it
    preference: int = 100  # the default framework is the installed backend with the lowest
    capabilities: Capabilities = Capabilities()

    def available(self) -> bool:
        """Whether the framework is installed (found without importing it)."""
        return not self.package or importlib.util.find_spec(self.package) is not None

    @abstractmethod
    def has_device(self, kind: str) -> bool:
        """Whether the framework sees a device of ``kind`` ("cpu" or "gpu") here."""

    @abstractmethod
    def versions(self) -> dict[str, str]:
        """Versions of the framework and its accelerator runtime."""

    @abstractmethod
    def run(self, config: RunConfig, progress: Progress | None = None,
            weights: dict[str, np.ndarray] | None = None) -> RunResult:
        """Run ``config`` (one framework: this one): N micro-steps natively and by hand.
        ``weights`` replaces the case's initial weights (same names and shapes). Raises
        AccumcheckError when the device is not available."""

    def tensor_needs(self, config: RunConfig) -> list[TensorNeed]:
        """What each tensor of ``config``'s case needs beside the model while its group runs and
        is judged (``accumcheck.run.budget``), in canonical order, where ``capabilities.memory_budget``
        says the backend runs groups."""
        raise AccumcheckError(f"--memory-budget: the {self.name} backend runs no groups of tensors")

    def run_groups(self, config: RunConfig, groups: list[list[str]], progress: Progress | None = None
                   ) -> Iterator[RunResult]:
        """``run`` once per group of tensor names: each yielded RunResult holds that group's tensors
        only (bit for bit what ``run`` gives them), the run's facts on each. The caller drops each
        before asking for the next, so that one group's buffers are held at a time."""
        raise AccumcheckError(f"--memory-budget: the {self.name} backend runs no groups of tensors")

    def owns(self, model: Any) -> bool:
        """Whether ``model`` is one of this framework's (told by its classes' modules, without
        importing anything)."""
        return bool(self.package) and any(c.__module__.split(".")[0] == self.package for c in type(model).__mro__)

    # The packages whose arrays make a loss function's parameters this framework's, for a backend
    # whose check takes a loss function and its parameters instead of a model object.
    array_packages: tuple[str, ...] = ()

    def owns_parameters(self, params: Any) -> bool:
        """Whether ``params`` (nested mappings, lists and tuples of arrays) hold this framework's
        arrays, told by the first array's class, without importing anything."""
        leaf = _first_leaf(params)
        return leaf is not None and type(leaf).__module__.split(".")[0] in self.array_packages

    def model_check(self) -> Callable[..., Any] | None:
        """The check of a user's own model (``accumcheck.<name>.check``), where the backend has one."""
        return None

    def micro_gradients(self, config: RunConfig, names: list[str], progress: Progress | None = None,
                        weights: dict[str, np.ndarray] | None = None) -> Iterator[dict[str, np.ndarray]]:
        """A single-process run's clean micro-gradients (no fault: what the manual buffer adds) of
        the tensors ``names`` again, one dict per micro-step, in order, bit for bit those of ``run``,
        where ``capabilities.replay`` says the backend can (``accumcheck.judge.attribution``)."""
        raise AccumcheckError(f"the {self.name} backend cannot replay a run's micro-gradients")

    def train(self, config: RunConfig, steps: int, optimizer: str, lr: float,
              progress: Progress | None = None) -> TrajectoryReport:
        """``steps`` optimizer steps with native and manual accumulation (``accumcheck train``),
        where ``capabilities.trajectory`` says the backend can."""
        raise AccumcheckError(f"train: the {self.name} backend cannot run training trajectories")

    def repro_source(self, config: RunConfig, report: Any, script_name: str = "repro.py",
                     data_name: str = "repro.npz", shrunk_from: str | None = None) -> str:
        """The source of a standalone script that reproduces ``config``'s run of a case with this
        framework and numpy alone (``accumcheck compare --repro``), reading its data from
        ``data_name`` beside it (``accumcheck.repro.request.case_arrays``); ``report`` is the run's
        Report, whose verdicts it quotes. ``shrunk_from`` names the case a shrunk one came from."""
        raise AccumcheckError(f"--repro: the {self.name} backend writes no reproduction scripts")


def _first_leaf(tree: Any, depth: int = 0) -> Any:
    """The first value of ``tree`` that is no mapping, list or tuple (None when there is none)."""
    if depth > 32:
        return None
    items = tree.values() if isinstance(tree, Mapping) else tree if isinstance(tree, (list, tuple)) else None
    if items is None:
        return tree
    for item in items:
        leaf = _first_leaf(item, depth + 1)
        if leaf is not None:
            return leaf
    return None
