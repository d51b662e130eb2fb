"""A training stack's optimizer steps judged: each step's applied gradient against its window as
one batch (``accumcheck.judge.fullbatch``'s verdict and fingerprint), and the run's counts.

A stack adapter (``accumcheck.frameworks.<name>.stacks``) runs the stack in float64, so the two
gradients are two summation orders of one sum and agree to ~1e-15 of their scale when the stack
computes what one batch would; how the stack normalises and which micro-batches it steps on are
what is left to differ.
"""

from __future__ import annotations

import dataclasses

from ..backend import FullBatchGap, StackWindow
from ..report import StackReport, StackStep
from .fullbatch import SEMANTIC_TOLERANCE, full_batch_verdict

# The full-batch judge's sentences call A "accumulated" and F "full batch"; a stack's step applied A,
# and F is its window as one batch.
STEP_WORDS = (("accumulated = full batch", "applied = the window's gradient"), ("accumulated = ", "applied = "),
              (" x full batch ", " x the window's gradient "), ("unlike the full batch", "unlike one batch"))


def step_words(sentence: str) -> str:
    """A full-batch explanation said of a stack's optimizer step."""
    for old, new in STEP_WORDS:
        sentence = sentence.replace(old, new)
    return sentence


def judge_window(window: StackWindow, accum_steps: int) -> StackStep:
    """The verdict of one optimizer step: its applied gradient A against its window's F."""
    gap = FullBatchGap(normalisation="the window as one batch", accumulated_scaled_by="1",
                       accumulated=window.applied, full=window.window, item_counts=window.item_counts,
                       predicted_counts=window.predicted_counts)
    result = full_batch_verdict(gap, accum_steps, micro_batches=len(window.micro_batches))
    result = dataclasses.replace(result, explanation=step_words(result.explanation))
    return StackStep(step=window.step, micro_batches=list(window.micro_batches), result=result)


def stack_report(stack: str, model: str, accum_steps: int, windows: list[StackWindow], micro_batches_seen: int,
                 versions: dict[str, str], notes: list[str] | None = None, reproduce: str = "",
                 precision: str = "float64", micro_batches_expected: int | None = None) -> StackReport:
    """The report of a stack's run: every window judged; the micro-batches that ran but are in no
    window are the ones never stepped on."""
    stepped = {i for w in windows for i in w.micro_batches}
    return StackReport(stack=stack, model=model, accum_steps=accum_steps,
                       steps=[judge_window(w, accum_steps) for w in windows], micro_batches_seen=micro_batches_seen,
                       unstepped=[i for i in range(micro_batches_seen) if i not in stepped], precision=precision,
                       versions=versions, tolerance=SEMANTIC_TOLERANCE, notes=list(notes or []), reproduce=reproduce,
                       micro_batches_expected=micro_batches_expected)
