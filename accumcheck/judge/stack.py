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
from dataclasses import dataclass, field

from ..errors import AccumcheckError, NothingJudgedError
from ..report import StackReport, StackStep
from ..run.results import FullBatchGap, StackWindow
from .fullbatch import SEMANTIC_TOLERANCE, full_batch_verdict

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
    """The verdict of one optimizer step: its applied gradient A against its window's F."""
    gap = FullBatchGap(normalisation="the window as one batch", accumulated_scaled_by="1",
                       accumulated=window.applied, full=window.window, item_counts=window.item_counts,
                       predicted_counts=window.predicted_counts, hypotheses=window.hypotheses)
    result = full_batch_verdict(gap, accum_steps, micro_batches=len(window.micro_batches))
    result = dataclasses.replace(result, explanation=step_words(result.explanation))
    return StackStep(step=window.step, micro_batches=list(window.micro_batches), result=result)


def stack_report(stack: str, model: str, accum_steps: int, windows: list[StackWindow], micro_batches_seen: int,
                 versions: dict[str, str], notes: list[str] | None = None, reproduce: str = "",
                 precision: str = "float64", micro_batches_expected: int | None = None,
                 coverage: Coverage | None = None) -> StackReport:
    """The report of a stack's run: every window judged; the micro-batches that ran but are in no
    window are the ones never stepped on.

    Raises NothingJudgedError where no window was judged and no micro-batch seen (saying, from
    ``coverage``, whether the stack stepped without the check seeing its micro-batches or took no
    step at all), and AccumcheckError where optimizer steps with no recorded micro-batch would leave
    a report that passes; a report flagged anyway keeps its findings and says which steps were not
    judged. So no StackReport made here has exit code 0 with nothing judged."""
    coverage = coverage or Coverage(who=f"{stack} check", feed="the check", fix="feed every micro-batch through "
                                    "the check", idle="the run", idle_fix="run at least one optimizer step")
    if not windows and not micro_batches_seen:
        raise NothingJudgedError(_nothing_judged(coverage))
    stepped = {i for w in windows for i in w.micro_batches}
    report = StackReport(stack=stack, model=model, accum_steps=accum_steps,
                         steps=[judge_window(w, accum_steps) for w in windows], micro_batches_seen=micro_batches_seen,
                         unstepped=[i for i in range(micro_batches_seen) if i not in stepped], precision=precision,
                         versions=versions, tolerance=SEMANTIC_TOLERANCE, notes=list(notes or []),
                         reproduce=reproduce, micro_batches_expected=micro_batches_expected)
    if coverage.unrecorded:
        unjudged = _unjudged(coverage)
        if report.exit_code == 0:
            raise AccumcheckError(f"{coverage.who}: {unjudged}; {coverage.fix}, and step once per window")
        report.notes.append(unjudged)
    return report


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
