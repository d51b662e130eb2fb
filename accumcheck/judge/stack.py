"""A training stack's optimizer steps judged: each step's applied gradient against its window as
one batch (``accumcheck.judge.fullbatch``'s verdict and fingerprint), and the run's counts.

A stack adapter (``accumcheck.integrations``) runs the stack in float64, so the two
gradients are two summation orders of one sum and agree to ~1e-15 of their scale when the stack
computes what one batch would; how the stack normalises and which micro-batches it steps on are
what is left to differ.

Nothing passes that was not judged: a run in which no optimizer step was checked and no micro-batch
was seen is refused (NothingJudgedError), and a run whose stack stepped where the check recorded no
micro-batch (``Coverage.unrecorded``) never exits 0.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

from ..bounds import UNIT_ROUNDOFF, gamma
from ..errors import AccumcheckError, NothingJudgedError
from ..report import FullBatchResult, StackReport, StackStep
from ..report.stack import StepPrecisionFit
from ..run.results import FullBatchGap, StackWindow, StepPrecision
from .fullbatch import (
    FACTOR_TOLERANCE,
    SEMANTIC_TOLERANCE,
    FactorFit,
    full_batch_verdict,
    tensor_sums,
    varying_sentence,
)
from .pieces import PairSums, sum_of_squares
from .update import judge_update

# The micro-batches' own gradients, computed in a dtype of unit round-off u, are allowed
# COMPUTE_ROUNDINGS x u of ||S|| each: a gradient is a few chained matmuls and reductions, each
# rounding once per output element (measured: float32 Linear/Embedding/cross-entropy stacks land
# at 1e-7 of ||S||, under 2 u).
COMPUTE_ROUNDINGS = 8

# The full-batch judge's sentences call A "accumulated" and F "full batch"; a stack's step applied A,
# and F is its window as one batch.
STEP_WORDS = (("accumulated = full batch", "applied = the window's gradient"), ("accumulated = ", "applied = "),
              (" x full batch ", " x the window's gradient "), ("unlike the full batch", "unlike one batch"))


@dataclass(frozen=True)
class Coverage:
    """What a stack's check counted beside its windows, and how to say what it did not judge.

    ``who`` names the check ("accelerate.AccumulationCheck"); ``optimizer_steps`` is the stack's real
    optimizer steps while it ran (None where not counted) and ``unrecorded`` those of them (from 0)
    with no micro-batch recorded since the step before; ``feed`` is where micro-batches must go to be
    recorded ("check.batches(loader)") and ``fix`` how ("iterate `for batch in check.batches(loader):`");
    ``idle`` is what ran no optimizer step ("the with block"), ``idle_fix`` its likely cause and fix."""

    who: str
    feed: str
    fix: str
    idle: str
    idle_fix: str
    optimizer_steps: int | None = None
    unrecorded: list[int] = field(default_factory=list)


def step_words(sentence: str) -> str:
    """A full-batch explanation said of a stack's optimizer step."""
    for old, new in STEP_WORDS:
        sentence = sentence.replace(old, new)
    return sentence


def judge_window(window: StackWindow, accum_steps: int) -> StackStep:
    """The verdict of one optimizer step: its applied gradient A against its window's F (in a
    data-parallel run, F of every rank's micro-batches of the step); below float64, also A's
    distance from F against the round-off of the stack's dtypes (``precision_fit``)."""
    if window.judged is not None:  # judged in groups of tensors as it was captured (a memory budget)
        return dataclasses.replace(window.judged, step=window.step)
    world = window.world_size
    h = window.hypotheses
    if world > 1 and window.item_counts is not None and h.rank_items is None:
        h = dataclasses.replace(h, rank_items=_per_rank(window.micro_batches, window.item_counts, world),
                                rank_predicted=None if window.predicted_counts is None else
                                _per_rank(window.micro_batches, window.predicted_counts, world))
    gap = FullBatchGap(normalisation="the window as one batch", accumulated_scaled_by="1",
                       accumulated=window.applied, full=window.window, item_counts=window.item_counts,
                       predicted_counts=window.predicted_counts, hypotheses=h)
    sums = tensor_sums(window.applied, window.window)  # one pass over each tensor's A and F for both judgements
    # a window of k micro-batches over W ranks is N per rank where full: N = k / W
    result = full_batch_verdict(gap, accum_steps, world, micro_batches=len(window.micro_batches) // world or None,
                                contexts=window.contexts, sums=sums)
    precision = None
    if window.precision is not None and (window.absum is not None or window.scale_norm is not None):
        precision = precision_fit(window, accum_steps, sums)
    explanation = step_words(result.explanation)
    # below float64 the round-off is the reason A and F differ: said so, also where the factor reads as 1
    below = window.precision is not None and window.precision.reference != "float64"
    if precision is not None and (not result.equivalent or below) and precision.error <= precision.bound:
        explanation = precision_sentence(precision)
    result = dataclasses.replace(result, explanation=explanation)
    update = None if window.update is None else judge_update(window.update, max(1, len(window.micro_batches) // world))
    return StackStep(step=window.step, micro_batches=list(window.micro_batches), result=result, precision=precision,
                     update=update, reference=window.reference, reference_note=window.reference_note)


def _per_rank(micro_batches: list[int], counts: list[int], world: int) -> list[int]:
    """Counts of the window's micro-batches summed by rank (micro-batch i came from rank i % W)."""
    return [sum(c for i, c in zip(micro_batches, counts) if i % world == r) for r in range(world)]


def precision_fit(window: StackWindow, accum_steps: int, sums: dict[str, PairSums] | None = None) -> StepPrecisionFit:
    """||A - F|| / ||S|| against the round-off of the sums the stack ran, norm-wise (Higham's
    bound of a recursive sum, per element ``gamma_n u`` x S, holds for the 2-norm too): each
    rank's sum over its n micro-batches in the accumulation dtype, the sum over the W ranks in
    the reduction dtype (its inputs rounded to it first where it is lower), the micro-batches'
    own gradients in their compute dtype; and the same sums all in float32. ``sums``: each
    tensor's ``pair_sums(A, F)`` where the caller has them."""
    p: StepPrecision = window.precision
    world = window.world_size
    local = max(1, math.ceil(len(window.micro_batches) / world))

    # a reference computed below float64 (a memory budget, a sampled check) rounds like the stack's own
    u_ref = UNIT_ROUNDOFF[p.reference] if p.reference != "float64" else 0.0

    def bound(accumulation: str, reduction: str, computed: str) -> float:
        u_acc, u_red, u_comp = (UNIT_ROUNDOFF[d] for d in (accumulation, reduction, computed))
        rounded = u_red if u_red > u_acc else 0.0
        return gamma(local, u_acc) + gamma(world, u_red) + rounded + COMPUTE_ROUNDINGS * (u_comp + u_ref) + \
            2 * UNIT_ROUNDOFF["float32"]

    top = window_scale(window)
    sums = sums if sums is not None else tensor_sums(window.applied, window.window)
    gap = math.sqrt(sum(s.dd for s in sums.values()))
    error = gap / top if top > 0 else (0.0 if gap == 0 else math.inf)
    float32 = bound("float32", "float32", "float32")
    lost = [where for where, dtype in (("the local sum", p.accumulation), ("the reduction", p.reduction),
                                       ("the gradients' compute dtype", p.computed))
            if UNIT_ROUNDOFF[dtype] > UNIT_ROUNDOFF["float32"]]
    # where the error is beyond float32's, the stage whose own lower precision alone explains it
    if error > float32 and len(lost) > 1:
        alone = [where for where, args in (("the local sum", (p.accumulation, "float32", "float32")),
                                           ("the reduction", ("float32", p.reduction, "float32")),
                                           ("the gradients' compute dtype", ("float32", "float32", p.computed)))
                 if where in lost and error <= bound(*args)]
        lost = alone or lost
    return StepPrecisionFit(accumulation=p.accumulation, reduction=p.reduction, computed=p.computed, error=error,
                            bound=bound(p.accumulation, p.reduction, p.computed), float32_bound=float32,
                            lost_in=" and ".join(lost) if error > float32 else "")


def window_scale(window: StackWindow) -> float:
    """||S||: the 2-norm of the sum over the window's micro-batches of their gradients' magnitudes
    (where only a bound on it was kept, the sum over the micro-batches of their gradients' norms)."""
    if window.absum is None:
        return window.scale_norm or 0.0
    return math.sqrt(sum(sum_of_squares(s) for s in window.absum.values()))


def judge_groups(steps: list[StackStep], note: str) -> StackStep:
    """One step judged in groups of its tensors (``steps``: each group's verdict, ``judge_window``
    of a window holding that group's A, F and S): faithful where every group is, and read as the
    group furthest from it (its largest difference, or its round-off error), with every group's
    per-tensor factors; ``note`` is added to how the reference was computed."""
    flagged = [s for s in steps if s.gradient_verdict not in ("faithful", "batch-level")]
    worst = max(flagged or steps, key=lambda s: (s.result.max_relative_difference,
                                                s.precision.error if s.precision is not None else 0.0))
    if not flagged and any(s.precision is not None for s in steps):
        worst = max(steps, key=lambda s: s.precision.error if s.precision is not None else 0.0)
    factors = {name: f for s in steps for name, f in s.result.tensor_factors.items()}
    silent = [name for s in steps for name in s.result.silent_tensors]
    result = dataclasses.replace(worst.result, tensor_factors=factors, silent_tensors=silent)
    if flagged and result.factor and factors:
        # a tensor with a gradient where the full batch has none is as far from any factor as can be
        unmatched = [s.result.factor_worst_tensor for s in steps
                     if s.result.factor_worst_tensor and s.result.factor_worst_tensor not in s.result.tensor_factors]
        result = _factor_over_groups(result, unmatched, worst.gradient_verdict in ("constant-factor", "mismatch"))
    return dataclasses.replace(worst, result=result, reference_note=f"{worst.reference_note}; {note}".strip("; "))


def _factor_over_groups(result: FullBatchResult, unmatched: list[str], says_factor: bool) -> FullBatchResult:
    """The worst group's factor fit read over every group's tensor factors (``result.tensor_factors``
    holds them all): a constant factor only where every tensor's factor is the worst group's c
    within FACTOR_TOLERANCE (a group scaled next to a group that is right is no constant factor, as
    the window judged whole is not); the range, the tensor furthest from c and the count of tensors
    are the window's. The residual of a tensor is known only where it was its group's furthest;
    ``unmatched``: tensors with a gradient where the full batch has none, the furthest of all.
    ``says_factor``: the step's sentence is about the factor (a constant factor or a mismatch), not
    about round-off, and is said again over the window."""
    c, factors = result.factor, result.tensor_factors
    spread = max(abs(f - c) for f in factors.values()) / abs(c)
    furthest = unmatched[0] if unmatched else max(factors, key=lambda name: abs(factors[name] - c))
    constant = result.constant and spread <= FACTOR_TOLERANCE
    residual = result.worst_tensor_residual if furthest == result.factor_worst_tensor else None
    explanation = result.explanation
    if says_factor and constant:
        explanation = re.sub(r"on all \d+ tensors", f"on all {len(factors)} tensors", explanation, count=1)
    elif says_factor and (result.constant or explanation.startswith("not a constant factor: per-tensor factors")):
        fit = FactorFit(c, dict(factors), furthest, spread, furthest_residual=residual, silent=result.silent_tensors)
        explanation = step_words(varying_sentence(fit, result.item_counts))
    return dataclasses.replace(result, factor_min=min(factors.values()), factor_max=max(factors.values()),
                               factor_worst_tensor=furthest, spread=spread, worst_tensor_residual=residual,
                               constant=constant, matches=result.matches if constant else None,
                               explanation=explanation)


def precision_sentence(fit: StepPrecisionFit) -> str:
    """What a step below float64 applied, against its round-off."""
    figures = f"|A - F| = {fit.error:.2g} of |S|"
    if fit.error <= fit.float32_bound:
        return f"the window's gradient to float32 round-off ({figures}, float32's bound {fit.float32_bound:.2g})"
    dtypes = ", ".join(f"{what} in {dtype}" for what, dtype in (("summed", fit.accumulation),
                                                               ("reduced", fit.reduction),
                                                               ("computed", fit.computed)) if dtype != "float32")
    return (f"precision lost in {fit.lost_in}: the window's gradient within the round-off of its dtypes ({dtypes}; "
            f"{figures}, bound {fit.bound:.2g}), beyond float32's ({fit.float32_bound:.2g})")


def stack_report(stack: str, model: str, accum_steps: int, windows: list[StackWindow], micro_batches_seen: int,
                 versions: dict[str, str], notes: list[str] | None = None, reproduce: str = "",
                 precision: str = "float64", micro_batches_expected: int | None = None,
                 coverage: Coverage | None = None, world_size: int = 1,
                 reference_dtype: str = "float64", stepped: set[int] | None = None,
                 let_go: dict[int, str] | None = None) -> StackReport:
    """The report of a stack's run: every window judged; the micro-batches that ran but are in no
    window are the ones never stepped on.

    Raises NothingJudgedError where no window was judged and no micro-batch seen (saying, from
    ``coverage``, whether the stack stepped without the check seeing its micro-batches or took no
    step at all), and AccumcheckError where optimizer steps with no recorded micro-batch would leave
    a report that passes; a report flagged anyway keeps its findings and says which steps were not
    judged. So no StackReport made here has exit code 0 with nothing judged. ``stepped``: the
    micro-batches that reached a step where not every window was judged (a sampled check); ``let_go``:
    the steps whose window was let go unjudged, and why (``let_go_text``)."""
    coverage = coverage or Coverage(who=f"{stack} check", feed="the check", fix="feed every micro-batch through "
                                    "the check", idle="the run", idle_fix="run at least one optimizer step")
    if not windows and not micro_batches_seen:
        raise NothingJudgedError(_nothing_judged(coverage))
    if not windows and stepped:  # the run stepped, and none of its windows could be judged (all let go)
        raise NothingJudgedError(f"{coverage.who}: no optimizer step could be judged"
                                 f"{f' (not judged: {let_go_text(let_go)})' if let_go else ''}; check a few steps "
                                 "with the stack's own check, which joins a window that cannot be split")
    stepped = {i for w in windows for i in w.micro_batches} | (stepped or set())
    if reference_dtype != "float64" and precision == "float64":  # the run and its reference in the model's dtype
        precision = reference_dtype
    steps = [judge_window(w, accum_steps) for w in windows]
    _split_windows(steps)
    report = StackReport(stack=stack, model=model, accum_steps=accum_steps,
                         steps=steps, micro_batches_seen=micro_batches_seen,
                         unstepped=[i for i in range(micro_batches_seen) if i not in stepped], precision=precision,
                         versions=versions, tolerance=SEMANTIC_TOLERANCE, notes=list(notes or []),
                         reproduce=reproduce, micro_batches_expected=micro_batches_expected, world_size=world_size,
                         reference_dtype=reference_dtype)
    if coverage.unrecorded:
        unjudged = _unjudged(coverage)
        if report.exit_code == 0:
            raise AccumcheckError(f"{coverage.who}: {unjudged}; {coverage.fix}, and step once per window")
        report.notes.append(unjudged)
    return report


def let_go_text(let_go: dict[int, str]) -> str:
    """The steps whose window was let go, and the first one's reason: "steps 0, 2 (why)"."""
    return f"step{'s' * (len(let_go) != 1)} {', '.join(map(str, let_go))} ({next(iter(let_go.values()))})"


def _split_windows(steps: list[StackStep]) -> None:
    """A step the next one continues without the gradient zeroed between them (the next counts
    two optimizer steps in its window) applied only the first part of a window: said there too."""
    for step, following in zip(steps, steps[1:]):
        now, then = step.update, following.update
        if now is not None and then is not None and now.optimizer_steps == 1 and then.optimizer_steps == 2:
            now.split = True
            now.findings.insert(0, "the optimizer stepped again before the gradient was zeroed: this step applied the "
                                   "first part of a window, not all of it; call optimizer.step() once per window, after "
                                   "its last micro-batch")


def _nothing_judged(coverage: Coverage) -> str:
    """Why nothing was judged, in one line: steps the check never saw a micro-batch of, or no step."""
    taken = coverage.optimizer_steps or 0
    if taken:
        return (f"{coverage.who}: the optimizer stepped {taken} time{'s' * (taken != 1)} but no micro-batch went "
                f"through {coverage.feed}, so nothing was judged; {coverage.fix}")
    return f"{coverage.who}: {coverage.idle} ran no optimizer step (0 micro-batches seen); {coverage.idle_fix}"


def _unjudged(coverage: Coverage) -> str:
    """The optimizer steps taken with no micro-batch recorded since the step before."""
    steps, taken = coverage.unrecorded, coverage.optimizer_steps
    listed = ", ".join(map(str, steps[:8])) + (" ..." if len(steps) > 8 else "")
    return (f"{len(steps)} of the {taken} optimizer steps (step{'s' * (len(steps) != 1)} {listed}, counted from 0) "
            f"had no micro-batch recorded since the step before and {'was' if len(steps) == 1 else 'were'} not "
            f"judged: micro-batches fed around "
            f"{coverage.feed}, or a second step on one window")
