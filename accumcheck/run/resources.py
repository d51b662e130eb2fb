"""What a run will need, estimated before it starts, against what this machine has.

A case with a 30000 × 30000 layer or a batch of 10^8 samples would grow for minutes and then fail
deep in numpy; ``--world-size 100000`` would start processes until the kernel kills something.
``check_resources`` refuses such a run up front, in one line with the estimate, unless the user
says ``--force``.

The estimate is deliberately on the high side and simple enough to state:

- every parameter costs ``BYTES_PER_PARAMETER``: its float64 initial weight drawn from the seed,
  the model's float32 parameter and ``.grad``, the native and manual float32 copies, the
  harness's float64 sums E and S, and the judge's copies; the float64 oracle (and the float64
  whole-batch reference of ``--full-batch``) adds a float64 model with its gradient;
- every activation element costs ``BYTES_PER_ACTIVATION`` (the output, the copy autograd saves,
  its gradient, and float64 in the oracle), counted as one micro-batch's rows × the widest layer
  × the number of layers, plus each attention layer's score matrices; the full-batch check holds
  all N micro-batches at once;
- each data-parallel rank is a process holding all of that;
- with ``--memory-budget`` the harness holds the budget at most beside the model
  (``BYTES_PER_MODEL_PARAMETER`` per parameter and the activations).

For a user's own model only what the check adds is estimated (``estimate_model``): its
activations are the model's own and unknown in advance.

A training stack's check (``accumcheck stack``, ``estimate_stack``) holds what grows with its
length: the run's M micro-batches, drawn before it starts (``BYTES_PER_BATCH_ELEMENT`` per token
id, label or feature); the model in float32 and float64 with its window of N micro-batches recorded
(``RECORDED_COPIES``) and run as one batch, as the full-batch check holds it; and, for the report,
each of its ceil(M / N) optimizer steps' applied and window gradients in float64
(``BYTES_PER_STEP_PARAMETER`` per parameter). Its time is stated as a floor:
``MIN_SECONDS_PER_MICRO_BATCH``, what a stack's Python loop takes per micro-batch at the least.
"""

from __future__ import annotations

import math
import os
import resource
from dataclasses import dataclass
from pathlib import Path

from ..case.definition import Case
from ..errors import AccumcheckError
from ..files import size_text

BYTES_PER_PARAMETER = 64
BYTES_PER_ORACLE_PARAMETER = 24  # a float64 copy of the model, its gradient, and its result
BYTES_PER_ACTIVATION = 16
BYTES_PER_MODEL_PARAMETER = 16  # with --memory-budget: the float64 initial weight, the parameter and .grad
BYTES_PER_FLOAT64_COPY = 56  # a user model's float64 copy: weight, gradient, buffer, E, S, step, host copy
BYTES_PER_BATCH_ELEMENT = 8  # a micro-batch's token ids, labels or features, as int64 or float64
RECORDED_COPIES = 3  # a window's micro-batch: the recorded copy, its float64 copy, its part of the joined window
BYTES_PER_STEP_PARAMETER = 16  # a stack's optimizer step: its applied and window gradients, float64, kept
# A floor, not a measurement: a training stack's loop in Python (forward, backward, the check's
# recording and its share of the window's reference) takes at least this per micro-batch.
MIN_SECONDS_PER_MICRO_BATCH = 1e-3


@dataclass(frozen=True)
class Estimate:
    """A run's needs: ``parameters`` elements, ``bytes`` of memory in all, ``processes``."""

    parameters: int
    activations: int  # elements alive at once in one process
    bytes: int
    processes: int

    def describe(self) -> str:
        ranks = f" on each of {self.processes} ranks" if self.processes > 1 else ""
        if not self.activations:  # a user's model: its own activations are not known in advance
            return f"about {size_text(self.bytes)} beside the model ({self.parameters:,} parameters)"
        return (f"about {size_text(self.bytes)} ({self.parameters:,} parameters and {self.activations:,} "
                f"activation elements{ranks})")


def estimate(case: Case, accum_steps: int, oracle: bool = False, full_batch: bool = False,
             world_size: int | None = None, memory_budget: int | None = None) -> Estimate:
    """What running ``case`` over ``accum_steps`` micro-steps will need (see the module); with a
    ``memory_budget``, the model itself and the budget beside it at most."""
    specs = case.parameters()
    parameters = sum(spec.numel for spec in specs)
    inp = case.input
    positions = inp.seq_len if inp.kind == "tokens" else 1
    rows = inp.batch_size * positions
    # an embedding's rows are looked up, not computed: its width is its dimension
    widest = max([inp.features, case.num_classes,
                  *(spec.shape[-1] if spec.kind == "embedding" else max(spec.shape) for spec in specs)])
    layers = case.all_layers()
    activations = rows * widest * (len(layers) + 2)
    activations += sum(inp.batch_size * layer.options["heads"] * positions * positions
                       for layer in layers if layer.type == "attention")
    if full_batch:
        activations *= accum_steps + 1
    per_parameter = BYTES_PER_PARAMETER + (BYTES_PER_ORACLE_PARAMETER if oracle or full_batch else 0)
    ranks = world_size or 1
    total = ranks * (parameters * per_parameter + activations * BYTES_PER_ACTIVATION)
    if memory_budget is not None:
        total = min(total, parameters * BYTES_PER_MODEL_PARAMETER + activations * BYTES_PER_ACTIVATION + memory_budget)
    return Estimate(parameters, activations, total, ranks)


def estimate_model(parameters: int, float64_copy: bool, memory_budget: int | None = None) -> Estimate:
    """What checking a user's model of ``parameters`` elements adds to the model itself: the
    buffers, sums and host copies per parameter, and a float64 copy of the model with its
    gradient and sums where the oracle or the full-batch check needs one; ``memory_budget`` at most."""
    per_parameter = BYTES_PER_PARAMETER + (BYTES_PER_FLOAT64_COPY if float64_copy else 0)
    return Estimate(parameters, 0, min(parameters * per_parameter, memory_budget or parameters * per_parameter), 1)


@dataclass(frozen=True)
class StackEstimate:
    """A training stack check's needs: bytes by what holds them, its time at the least, and what
    smaller runs of the same case would need (to name the option that makes it too large)."""

    case: str  # the case's name
    micro_batches: int  # M
    accum_steps: int  # N
    batches_given: bool  # M was given (--batches), not 2N + 2
    optimizer_steps: int  # ceil(M / N)
    data: int  # bytes: the run's micro-batches
    window: int  # bytes: the model, its float64 copy, the recorded window and its reference as one batch
    steps: int  # bytes: every optimizer step's two float64 gradients, kept for the report
    seconds: float  # at the least
    one_window: int  # bytes of a run of one window (M = N)
    least: int  # bytes of the smallest run of the case (N = M = 1)

    @property
    def bytes(self) -> int:
        return self.data + self.window + self.steps

    def describe(self) -> str:
        steps = self.optimizer_steps
        time = f" and take at least {duration_text(self.seconds)}" if self.seconds >= 60 else ""
        return (f"about {size_text(self.bytes)} ({size_text(self.data)} for its {self.micro_batches:,} micro-batches, "
                f"{size_text(self.window)} for the model and a window of {min(self.accum_steps, self.micro_batches):,} "
                f"as one batch, {size_text(self.steps)} for the gradients of its {steps:,} optimizer "
                f"step{'s' * (steps != 1)}){time}")

    def blame(self, free: int) -> tuple[str, str]:
        """The option that makes the run need more than ``free`` bytes, as given, and its fix: the
        case where its smallest run does not fit, N where one window does not, else M."""
        if self.least > free:
            return f"--case {self.case}", "use a smaller case"
        if self.one_window > free or not self.batches_given:
            return f"--accum-steps {self.accum_steps}", "use a smaller --accum-steps (each window runs as one batch)"
        return f"--batches {self.micro_batches}", "check fewer micro-batches (--batches)"


def estimate_stack(case: Case, accum_steps: int, batches: int | None = None) -> StackEstimate:
    """What ``accumcheck stack`` needs for ``case`` at N = ``accum_steps`` over ``batches``
    micro-batches (default 2N + 2), from the case's shapes alone (see the module)."""
    m = 2 * accum_steps + 2 if batches is None else batches
    data, window, steps = _stack_bytes(case, accum_steps, m)
    return StackEstimate(case.name, m, accum_steps, batches is not None, math.ceil(m / accum_steps), data, window,
                         steps, m * MIN_SECONDS_PER_MICRO_BATCH, sum(_stack_bytes(case, accum_steps, accum_steps)),
                         sum(_stack_bytes(case, 1, 1)))


def _stack_bytes(case: Case, n: int, m: int) -> tuple[int, int, int]:
    """(the micro-batches, the model with its window as one batch, the steps' gradients) in bytes."""
    inp = case.input
    batch = inp.batch_size * (2 * inp.seq_len if inp.kind == "tokens" else inp.features + 1) * BYTES_PER_BATCH_ELEMENT
    window = min(n, m)
    held = estimate(case, window, full_batch=True).bytes + window * RECORDED_COPIES * batch
    parameters = sum(spec.numel for spec in case.parameters())
    return m * batch, held, math.ceil(m / n) * parameters * BYTES_PER_STEP_PARAMETER


def check_stack_resources(need: StackEstimate, force: bool = False) -> None:
    """Raise AccumcheckError, naming the option that makes the run too large, when a stack check
    needs more memory than is available, unless ``force``."""
    free = None if force else available_memory()
    if free is None or need.bytes <= free:
        return
    option, fix = need.blame(free)
    raise AccumcheckError(f"{option}: the run would hold {need.describe()}; {size_text(free)} of memory is "
                          f"available; {fix}, or add --force to run anyway")


def duration_text(seconds: float) -> str:
    """A duration as people read it: 40 s, 12 minutes, 28 hours, 3.5 days."""
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.0f} s"


def check_resources(need: Estimate, what: str, force: bool = False, launched: bool = False) -> None:
    """Raise AccumcheckError (naming ``what``, the run) when ``need`` has more processes than
    this machine has cores (two at least; unless ``launched``: a launcher already started them)
    or more memory than is available, unless ``force``."""
    if force:
        return
    cores = cpu_count()
    ranks = max(cores, 2)  # two ranks are what a data-parallel check needs, even on one core
    if need.processes > ranks and not launched:
        raise AccumcheckError(f"--world-size {need.processes}: more ranks than the {cores} cores here (each rank "
                              f"is a process); use --world-size {ranks} or fewer, or add --force")
    free = available_memory()
    if free is not None and need.bytes > free:
        fix = ("leave out oracle and full_batch (they copy the model in float64), or pass force=True (--force) "
               "to run anyway") if not need.activations else "use a smaller case or fewer ranks, or add --force to run anyway"
        raise AccumcheckError(f"{what}: needs {need.describe()}, but {size_text(free)} of memory is available; {fix}")


def cpu_count() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def available_memory() -> int | None:
    """Bytes this process can still allocate: the least of the system's available memory, the
    container's (cgroup v2) limit less its use, and the address-space limit; None where none is
    known."""
    found = [_meminfo_available(), _cgroup_room()]
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    if limit != resource.RLIM_INFINITY:
        found.append(limit)
    known = [value for value in found if value is not None]
    return min(known) if known else None


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> int | None:
    folder = Path("/sys/fs/cgroup")
    try:
        limit = (folder / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((folder / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None
