"""What an optimizer step did with its gradient, judged: one optimizer step and at most one
scheduler step and one clipping per window, parameters still between the window's micro-batches,
and the update equal to the optimizer applied once, from its state before the window, to the
gradient it was handed (replayed in float64 by the stack's check).

The replay and the stack's step run the same operations on the same inputs, so what separates
them is the stack's own rounding: a few roundings of one update per element, each at most u x
(|parameter| + |update|), u the unit round-off of the dtype the stack's optimizer ran in. An
update beyond that allowance is tried against the causes the check replayed (``hypotheses``:
weight decay applied at every micro-step, Adam's bias correction counting micro-steps), and the
one it matches is named.
"""

from __future__ import annotations

import math

import numpy as np

from ..bounds import UNIT_ROUNDOFF
from ..report.stack import StepUpdateResult
from ..run.results import StepUpdate

# Roundings of one optimizer update per element, allowed against u x (|p| + |update|): Adam's is
# about ten operations (two moments, a square root, a division, the bias corrections, the
# decoupled decay and the subtraction), each rounding once.
UPDATE_ROUNDINGS = 16


def update_error(applied: dict[str, np.ndarray], expected: dict[str, np.ndarray], scale: dict[str, np.ndarray],
                 dtype: str) -> float:
    """max |applied - expected| over UPDATE_ROUNDINGS x u x scale, over every element (inf where
    they differ where the scale is 0, or either is not finite); <= 1 is the same update to the
    optimizer's round-off."""
    allowance = UPDATE_ROUNDINGS * UNIT_ROUNDOFF.get(dtype, UNIT_ROUNDOFF["float32"])
    worst = 0.0
    for name, want in expected.items():
        got = applied.get(name)
        if got is None:
            continue
        gap = np.abs(np.asarray(got, dtype=np.float64) - want)
        if not np.isfinite(gap).all():
            return math.inf
        room = allowance * np.asarray(scale[name], dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(gap > 0, gap / room, 0.0)
        worst = max(worst, float(ratio.max(initial=0.0)))
    return worst


def judge_update(update: StepUpdate, micro_batches: int) -> StepUpdateResult:
    """The findings of one optimizer step's update (``micro_batches``: the window's, on one rank)."""
    findings: list[str] = []
    k = update.optimizer_steps
    micro_batches = update.gradient_micro_batches or micro_batches
    if k > 1:
        findings.append(f"the optimizer stepped {k} times in this window of {micro_batches} micro-batch"
                        f"{'es' * (micro_batches != 1)} (the gradient was zeroed once for them): the window was "
                        f"applied as {k} updates, not one; call optimizer.step() once per window, after its last "
                        "micro-batch")
    if update.scheduler_steps is not None and update.scheduler_steps > 1:
        s = update.scheduler_steps
        findings.append(f"the scheduler stepped {s} times in this window: the learning rate decays {s}x too fast; "
                        "call scheduler.step() once per optimizer step")
    if update.clip_calls is not None and update.clip_calls > 1:
        c = update.clip_calls
        findings.append(f"gradient clipping ran {c} times in this window: the micro-batches' partial sums were "
                        "clipped, not the window's gradient; clip once, after the window's last micro-batch")
    if update.moved:
        names = ", ".join(update.moved[:3]) + (" ..." if len(update.moved) > 3 else "")
        findings.append(f"{len(update.moved)} parameter tensor{'s' * (len(update.moved) != 1)} ({names}) moved "
                        "between the window's micro-batches, before its step: something updates them inside the "
                        "window (weight decay or an optimizer step at every micro-batch)")
    error, matches = update.error, ""
    if error is None and update.expected is not None and update.applied is not None and update.scale is not None:
        error = update_error(update.applied, update.expected, update.scale, update.dtype)
    if error is not None and error > 1:
        tried = dict(update.tried) or {cause: update_error(update.applied, want, update.scale, update.dtype)
                                       for cause, want in update.hypotheses.items()}
        fits = sorted((e, cause) for cause, e in tried.items() if e <= 1)
        matches = fits[0][1] if fits else ""
        figure = "where one update leaves a parameter as it was, it moved" if math.isinf(error) else \
            f"{error:.3g}x its round-off"
        if matches:
            findings.append(f"the update is not the optimizer applied once to the window's gradient ({figure}): "
                            f"it matches {matches}")
        else:
            others = f"; nor {', '.join(tried)}" if tried else ""
            findings.append(f"the update is not the optimizer applied once to the window's gradient "
                            f"({figure}){others}")
    return StepUpdateResult(optimizer_steps=k, scheduler_steps=update.scheduler_steps, clip_calls=update.clip_calls,
                            moved=list(update.moved), error=error, matches=matches, lr=update.lr, findings=findings,
                            note=update.replay_note)
