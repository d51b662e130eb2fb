"""The report of a training stack's check (``accumcheck stack``, ``accumcheck.integrations``): at
each optimizer step, the gradient the stack was about to apply against its window's micro-batches
as one batch, and which micro-batches the run saw but never stepped on."""

from __future__ import annotations

from dataclasses import dataclass, field

from .single import FullBatchResult
from .values import SCHEMA_VERSION, Serialised

STEP_VERDICTS = ("faithful", "batch-level", "precision-loss", "constant-factor", "mismatch", "non-finite", "update")
# How a step's reference, its window's gradient, was computed: on the window's micro-batches joined as
# one batch, or micro-batch by micro-batch under the window's normalisation (one micro-batch's
# activations at a time: ``accumcheck.torch.stacks.reference``)
JOINED = "window as one batch"
SPLIT = "micro-batch by micro-batch, the window's normalisation"
REFERENCES = (JOINED, SPLIT)


@dataclass
class StepPrecisionFit:
    """A step of a stack that does not apply its gradient in float64 (FSDP2, DeepSpeed): how far
    the applied gradient A is from the window's float64 F, against the round-off of the sums the
    stack ran. All relative to ||S||, S the sum over the window's micro-batches of |each one's
    gradient| (``accumcheck.judge.stack.precision_fit``)."""

    accumulation: str  # dtype of each rank's sum over its micro-batches
    reduction: str  # dtype of the sum over the ranks
    computed: str  # dtype the micro-batches' gradients are computed in
    error: float  # ||A - F|| / ||S||
    bound: float  # the round-off of the stack's dtypes, relative to ||S||
    float32_bound: float  # the same sums all in float32
    lost_in: str  # "", "the local sum", "the reduction", "the gradients' compute dtype", or a combination


@dataclass
class StepUpdateResult:
    """What an optimizer step did with its gradient (``accumcheck.judge.update``): the counts of
    the window (optimizer, scheduler and clipping calls since the step before), the parameters
    that moved between its micro-batches, and the update against the optimizer applied once, in
    float64, to the gradient it was handed. ``findings`` say what is not one update per window,
    each with its cause; empty, the step made one update of its window."""

    optimizer_steps: int
    scheduler_steps: int | None
    clip_calls: int | None
    moved: list[str]
    error: float | None  # max |update - the optimizer once| over its round-off allowance; None: not replayed
    matches: str  # what the update is instead, where one of the tried causes explains it
    lr: float | None
    findings: list[str] = field(default_factory=list)
    note: str = ""  # why the update was not replayed, where it was not
    split: bool = False  # the optimizer stepped again on this window's gradient before it was zeroed

    @property
    def explains_gradient(self) -> bool:
        """Whether what the step did also explains a gradient unlike the window's: parameters that
        moved inside the window, or a window applied in several steps."""
        return bool(self.moved) or self.split or self.optimizer_steps > 1

    @property
    def one_update(self) -> bool:
        return not self.findings


@dataclass
class StackStep:
    """One optimizer step: its window and what its applied gradient is."""

    step: int  # counted from 0
    micro_batches: list[int]  # the run's micro-batch indices in the window
    result: FullBatchResult  # applied gradient (A) against the window as one batch (F)
    precision: StepPrecisionFit | None = None  # where the stack runs below float64
    update: StepUpdateResult | None = None  # what the step did with the gradient, where watched
    reference: str = JOINED  # how F was computed (REFERENCES); reports saved before it was said: joined
    reference_note: str = ""  # why that reference, or how it weighted the micro-batches

    @property
    def explanation(self) -> str:
        """What the applied gradient is, then what the step did with it where that was not one
        update of the window."""
        if self.update is None or self.update.one_update:
            return self.result.explanation
        found = "; ".join(self.update.findings)
        if self.gradient_verdict in ("faithful", "batch-level"):
            return found
        if self.update.explains_gradient:  # the cause of the gradient too: said first
            return f"{found}; the gradient: {self.result.explanation}"
        return f"{self.result.explanation}; {found}"

    @property
    def verdict(self) -> str:
        """The gradient's verdict (``gradient_verdict``), or "update" where the gradient is the
        window's but the step did not apply it as one update."""
        found = self.gradient_verdict
        if found in ("faithful", "batch-level") and self.update is not None and not self.update.one_update:
            return "update"
        return found

    @property
    def gradient_verdict(self) -> str:
        """faithful (A = F within the tolerance, or below float64 within float32's round-off),
        precision-loss (A = F within the round-off of the stack's reduced dtypes only), batch-level (A = F but for what the model
        computes over the batch by design, which no accumulation can equal), constant-factor
        (A = cF, c not 1), mismatch (no single factor: the micro-batches are weighted unlike one
        batch) or non-finite."""
        if self.result.equivalent:
            return "faithful"
        if self.precision is not None and self.precision.error <= self.precision.float32_bound:
            return "faithful"
        if self.precision is not None and self.precision.error <= self.precision.bound:
            return "precision-loss"
        if self.result.faithful:
            return "batch-level"
        if self.result.constant:
            return "constant-factor"
        return "non-finite" if "not finite" in self.result.explanation else "mismatch"

    @property
    def window_text(self) -> str:
        """The window's micro-batches, e.g. "0-3" or "8, 9" or "12"."""
        first, last = self.micro_batches[0], self.micro_batches[-1]
        if self.micro_batches == list(range(first, last + 1)):
            return str(first) if first == last else f"{first}-{last}"
        return ", ".join(map(str, self.micro_batches))


@dataclass
class StackReport(Serialised):
    """Every optimizer step a training stack took in the checked run."""

    stack: str  # "transformers", "accelerate", "lightning", "gluon"
    model: str  # what ran: a built-in case's name or the user's model class
    accum_steps: int  # N as the stack was configured
    steps: list[StackStep]
    micro_batches_seen: int  # micro-batches that ran forward and backward
    unstepped: list[int]  # of those, the ones no optimizer step followed
    precision: str  # the dtype the run was checked in
    versions: dict[str, str]
    tolerance: float
    notes: list[str] = field(default_factory=list)  # what the check did to see the stack's gradient
    # micro-batches the run's data holds (its data loader's length times the epochs), where the
    # run was not cut short by the check: more than were seen is batches the stack never ran
    micro_batches_expected: int | None = None
    reproduce: str = ""
    world_size: int = 1  # ranks of a data-parallel run: a window is every rank's micro-batches of its step
    reference_dtype: str = "float64"  # the dtype the window's gradient as one batch was computed in
    kind: str = "stack"
    schema_version: int = SCHEMA_VERSION

    @property
    def flagged(self) -> list[StackStep]:
        return [s for s in self.steps if s.verdict not in ("faithful", "batch-level")]

    @property
    def never_ran(self) -> int:
        """Micro-batches of the run's data the stack never fed (0 where that is not known)."""
        return max(0, (self.micro_batches_expected or 0) - self.micro_batches_seen)

    @property
    def exit_code(self) -> int:
        """1 when an optimizer step applied anything but its window's gradient, or micro-batches
        never ran or never reached an optimizer step; else 0."""
        return 1 if self.flagged or self.unstepped or self.never_ran else 0

    def counts_text(self) -> str:
        """How much of the run was checked: "5 optimizer steps checked, 18 micro-batches seen"."""
        steps = len(self.steps)
        return (f"{steps} optimizer step{'s' * (steps != 1)} checked, {self.micro_batches_seen} micro-batch"
                f"{'es' * (self.micro_batches_seen != 1)} seen" +
                (f" on {self.world_size} ranks" if self.world_size > 1 else "") +
                (f" of the {self.micro_batches_expected} the data holds" if self.micro_batches_expected else ""))

    def summary(self) -> str:
        """One line: the verdict, the first flagged step and what its gradient is."""
        lost = []
        if self.never_ran:
            lost.append(f"{self.never_ran} of the data's {self.micro_batches_expected} micro-batches never ran")
        if self.unstepped:
            lost.append(f"{len(self.unstepped)} micro-batch{'es' * (len(self.unstepped) != 1)} "
                        f"({_indices(self.unstepped)}) never reached an optimizer step")
        dropped = "; ".join(lost)
        if not self.flagged:
            if dropped:
                return f"DROPPED BATCHES: {dropped}; every step that ran applied its window's gradient ({self.counts_text()})"
            batch_level = [s for s in self.steps if s.verdict == "batch-level"]
            if batch_level:
                return (f"FAITHFUL: every optimizer step applied the gradient of its window as one batch, "
                        f"{len(batch_level)} of them but for what the model computes over the batch by design, "
                        f"which they apply as its micro-batches' mean ({self.counts_text()}); step "
                        f"{batch_level[0].step}: {batch_level[0].result.explanation}")
            return (f"FAITHFUL: every optimizer step applied the gradient of its window as one batch "
                    f"({self.counts_text()})")
        first = self.flagged[0]
        return (f"FLAGGED: {len(self.flagged)} of {len(self.steps)} optimizer steps; step {first.step} "
                f"(micro-batches {first.window_text}): {first.explanation}" + (f"; {dropped}" if dropped else ""))


def _indices(values: list[int]) -> str:
    return ", ".join(map(str, values[:8])) + (" ..." if len(values) > 8 else "")
