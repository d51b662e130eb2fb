"""The judge's second pass over a finished report: which tensors get it, running it over the
replayed micro-gradients (``attribution.TensorExamination`` per tensor), and what it leaves on
each tensor: its cause, its fault score, ``suspicious`` where the score passes its threshold
inside the bound, and a flagged tensor's severity. (The statistical tier's spreads are figures
of the first pass: ``statistics.tensor_figures``.)"""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np

from ..report import MARGINAL_RATIO, TensorResult
from .attribution import Examined, Replay, TensorExamination


def wanted(result: TensorResult) -> bool:
    """Whether a tensor gets the second pass: flagged (to say why), or inside its bound while the two
    modes differ (the statistical tier; where they agree bit for bit neither has a fault the other lacks)."""
    if result.verdict in ("non-finite", "overflow", "no-gradient"):
        return False
    return result.flagged or result.mismatched > 0


def flagged_modes(result: TensorResult) -> list[str]:
    """The modes out of their bound, worst first."""
    ratios = {"native": max(result.ratio_native, result.precision_ratio or 0.0), "manual": result.ratio_manual}
    return [m for m, r in sorted(ratios.items(), key=lambda kv: -kv[1]) if r > 1.0]


def examine(items: list[Examined], accum_steps: int, replay: Replay) -> str | None:
    """Run the second pass over ``items`` and fill in each result's cause, fault score and (inside
    the bound, a score past the threshold) the verdict ``suspicious``. Returns a note for the
    report when the pass could not be used, else None."""
    if not items:
        return None
    exams = {it.result.name: TensorExamination(it, accum_steps, ("native", "manual"), it.result.flagged)
             for it in items}
    for grads in _checked(replay(list(exams)), exams):
        for name, grad in grads.items():
            exams[name].add(grad)
    if not all(e.reproduced for e in exams.values()):
        return "no causes: the second pass did not reproduce the micro-gradients bit for bit"
    for name, exam in exams.items():
        result = exam.item.result
        threshold = exam.threshold()
        causes = {mode: exam.finish(mode) for mode in exam.modes}
        result.fault_score = max(score for _, score in causes.values())
        result.fault_score_threshold = threshold
        if result.flagged:
            modes = flagged_modes(result)
            result.cause = causes[modes[0]][0] if modes else None
        elif result.fault_score >= threshold:
            mode = max(causes, key=lambda m: causes[m][1])
            result.verdict = "suspicious"
            result.cause = exam.suspicious_cause(mode)
    return None


def _checked(stream: Iterable[dict[str, np.ndarray]], exams: dict) -> Iterator[dict[str, np.ndarray]]:
    for grads in stream:
        yield {name: grads[name] for name in exams if name in grads}


def severity(result: TensorResult) -> str | None:
    """``marginal`` for a flagged tensor within MARGINAL_RATIO times its bound and with no
    single-step explanation, ``diverged`` for any other flagged tensor, None when not flagged."""
    if not result.flagged:
        return None
    worst = max(result.ratio, result.precision_ratio or 0.0) if result.verdict == "precision-loss" else result.ratio
    single = result.cause is not None and result.cause.single_step
    return "marginal" if worst <= MARGINAL_RATIO and not single and result.verdict != "non-finite" else "diverged"
