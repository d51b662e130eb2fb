"""What a framework backend is to the rest of accumcheck: what it declares it can do, the run it
performs, and the plain arrays it hands back.

Rules: a backend module imports its framework inside its methods, never at module top, so that
finding and listing backends stays cheap and a missing framework is one AccumcheckError saying how
to install it. A backend declares its Capabilities once; every option a backend cannot honour is
refused centrally (``accumcheck.validation.configure``) before it runs, naming the backend and the option.
Backends are found through the ``accumcheck.backends`` entry-point group (``accumcheck.registry``).
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from .budget import TensorNeed
from .cases import LAYER_TYPES
from .config import RunConfig
from .errors import AccumcheckError
from .options import ACCUM_DTYPES, Option
from .report import DataParallelSetup, TrajectoryReport

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
    # A user's own model: the parameter's dtype where it is not the run's ``param_dtype`` (its
    # native bound is then its own), its other names when tied, and in how many micro-steps it
    # received a gradient (None: all).
    dtype: str | None = None
    aliases: tuple[str, ...] = ()
    steps_with_grad: int | None = None
    # Arrays judged where they live (a GPU): the backend's reduction of the four, ``statistics.Reducer``;
    # the array fields are then read only for the figures it does not give.
    reducer: Any = None


@dataclass
class RankAccumulation:
    """One rank of a data-parallel run, every dict keyed by parameter name.

    local_native  the rank's own native total (N micro-steps, no synchronisation) just before
                  the all-reduce
    exact, absum  the rank's E and S (float64 sums of its micro-gradients and their magnitudes)
    native        the rank's gradient after the all-reduce (every rank should hold the same)
    """

    rank: int
    host: str
    local_native: dict[str, np.ndarray]
    exact: dict[str, np.ndarray]
    absum: dict[str, np.ndarray]
    native: dict[str, np.ndarray]


def window_scale(normalisation: str, accum_steps: int) -> tuple[float, str]:
    """What training code multiplies the accumulated sum by, as a number and as the report says it:
    1/N for a "mean" loss (each micro-batch's mean loss divided by N); 1 for "sum" and "token_count"."""
    return (1.0 / accum_steps, "1/N") if normalisation == "mean" else (1.0, "1")


@dataclass
class FullBatchGap:
    """The accumulated gradient and the whole batch's in one backward pass, both in float64, per
    parameter name: the judge (``accumcheck.judge.fullbatch``) says how they differ."""

    normalisation: str
    accumulated_scaled_by: str  # "1/N" for a mean loss, else "1"
    accumulated: dict[str, np.ndarray]  # already scaled
    full: dict[str, np.ndarray]
    item_counts: list[int] | None = None  # items (labelled tokens) per micro-batch, where known
    predicted_counts: list[int] | None = None  # of those, the ones a causal LM predicts (after its shift)


@dataclass
class RunResult:
    """What a backend hands back: per-parameter accumulations as numpy arrays, and the facts of
    the run. ``settings`` are the backend's own facts (kept in the report), ``notes`` the ones a
    reader is told in the header."""

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
    notes: list[str] = field(default_factory=list)
    # Logits of micro-batch 0 in the manual pass, to compare forward passes across frameworks.
    first_logits: np.ndarray | None = None
    full_batch: FullBatchGap | None = None
    # Data parallel: each rank's own view (rank order), and how the run was set up.
    ranks: list[RankAccumulation] | None = None
    data_parallel: DataParallelSetup | None = None
    # With a loss scaler (GradScaler), the scale the micro-gradients were computed with (the
    # arrays above are already divided by it): a tensor whose micro-gradients overflowed is then
    # a skipped optimizer step, not a fault.
    grad_scale: float | None = None


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
        is judged (``accumcheck.budget``), in canonical order, where ``capabilities.memory_budget``
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
        ``data_name`` beside it (``accumcheck.repro.case_arrays``); ``report`` is the run's
        Report, whose verdicts it quotes. ``shrunk_from`` names the case a shrunk one came from."""
        raise AccumcheckError(f"--repro: the {self.name} backend writes no reproduction scripts")


@dataclass
class StackWindow:
    """One optimizer step of a training stack: the gradient its optimizer was about to apply and
    the gradient of the same window's micro-batches as one batch, both in float64, per parameter
    name (``accumcheck.judge.stack`` says how they differ)."""

    step: int  # the optimizer step, counted from 0
    micro_batches: list[int]  # the run's micro-batch indices (from 0) in this window, in order
    applied: dict[str, np.ndarray]
    window: dict[str, np.ndarray]
    item_counts: list[int] | None = None  # items (labelled tokens) per micro-batch, where known
    predicted_counts: list[int] | None = None  # of those, the ones a causal LM predicts (after its shift)


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
