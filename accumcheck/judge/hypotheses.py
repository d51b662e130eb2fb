"""What an accumulated gradient A is where the window's gradient F does not explain it, from the
other gradients a check computed beside F (``accumcheck.run.results.Hypotheses``):

- the loss's additive terms (a router load-balancing loss): A = a x (the window's gradient of the
  rest of the loss) + b x (the term's gradient summed over the micro-batches), fitted in least
  squares. a = 1 and b = 1/k (the mean over the window's k micro-batches) is all accumulation can
  do for a term computed over the batch; b = 1 is the term added once per micro-batch;
- the sum over the micro-batches of each one's own loss, normalised over its own items: A = c x
  that sum with nothing left over is each micro-batch's mean loss accumulated, c = 1 summed
  (a Trainer that skipped its 1/N), c = 1/N averaged;
- each micro-batch's own gradient g_j: A = sum of c_j x g_j, where one batch weights g_j by its
  share of the window's items, n_j / n; a c_j of 0 with the others their share is a micro-batch
  whose backward never reached the step (a rank that skipped it, a loader that lost it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..report import TermFit
from ..run.results import Hypotheses

Gradients = dict[str, np.ndarray]


@dataclass(frozen=True)
class Combination:
    """A = sum of factors[j] x bases[j] in least squares over the tensors fitted, and |A - that| / |A|."""

    factors: list[float]
    residual: float


def combination(target: Gradients, bases: list[Gradients], leave_out: list[str] = ()) -> Combination:
    """The least-squares factors of ``target`` in ``bases`` over every tensor but ``leave_out``
    (round-off tensors), from the bases' inner products, one tensor at a time."""
    names = [name for name in target if name not in set(leave_out)]
    size = len(bases)
    gram, projection, norm = np.zeros((size, size)), np.zeros(size), 0.0
    for name in names:
        a = np.asarray(target[name], np.float64).ravel()
        columns = [np.asarray(b[name], np.float64).ravel() for b in bases]
        for j in range(size):
            projection[j] += columns[j] @ a
            for k in range(j, size):
                gram[j, k] = gram[k, j] = gram[j, k] + columns[j] @ columns[k]
        norm += float(a @ a)
    factors = np.linalg.lstsq(gram, projection, rcond=None)[0]
    left = 0.0
    for name in names:
        a = np.asarray(target[name], np.float64).ravel()
        rest = a - sum(f * np.asarray(b[name], np.float64).ravel() for f, b in zip(factors, bases))
        left += float(rest @ rest)
    residual = math.sqrt(left / norm) if norm > 0 else (0.0 if left == 0 else math.inf)
    return Combination([float(f) for f in factors], residual)


def term_fits(applied: Gradients, hypotheses: Hypotheses, micro_batches: int,
              leave_out: list[str]) -> tuple[float, list[TermFit], float] | None:
    """A against the window's rest of the loss and each term summed over the micro-batches: the
    rest's factor, each term's fit, and the residual; None where the model has no terms."""
    if not hypotheses.terms or hypotheses.main is None:
        return None
    names = list(hypotheses.terms)
    fit = combination(applied, [hypotheses.main] + [hypotheses.terms[n].summed for n in names], leave_out)
    fits = []
    for name, factor in zip(names, fit.factors[1:]):
        term = hypotheses.terms[name]
        gap = _distance(term.window, {t: g / micro_batches for t, g in term.summed.items()})
        fits.append(TermFit(name=name, factor=factor, micro_batches=micro_batches,
                            batch_level=gap > BATCH_LEVEL, batch_gap=gap))
    return fit.factors[0], fits, fit.residual


def micro_sum_fit(applied: Gradients, hypotheses: Hypotheses, leave_out: list[str]) -> Combination | None:
    """A = c x (the micro-batches' own losses' gradients summed), or None where not computed."""
    if hypotheses.micro_sum is None:
        return None
    return combination(applied, [hypotheses.micro_sum], leave_out)


# A term's window gradient against its micro-batches' mean: evaluation noise is 1e-13 of the scale;
# a term computed over the batch (a router's load balance over all the batch's tokens) differs by
# the micro-batches' differing statistics, 1e-3 and more.
BATCH_LEVEL = 1e-6


def _distance(a: Gradients, b: Gradients) -> float:
    """|a - b| / |a| over every tensor."""
    top = math.sqrt(sum(float(np.sum(np.square(g))) for g in a.values()))
    gap = math.sqrt(sum(float(np.sum(np.square(g - b[name]))) for name, g in a.items()))
    return gap / top if top > 0 else (0.0 if gap == 0 else math.inf)


def rank_fit(applied: Gradients, hypotheses: Hypotheses, leave_out: list[str]) -> Combination | None:
    """A = sum over the ranks of c_r x (rank r's micro-batches as a batch of their own), or None
    where not computed (one process, or A was the window's gradient)."""
    if not hypotheses.rank_windows:
        return None
    return combination(applied, hypotheses.rank_windows, leave_out)


def missing_micro_batches(applied: Gradients, hypotheses: Hypotheses, item_counts: list[int] | None,
                          leave_out: list[str], tolerance: float) -> list[int] | None:
    """The positions in the window of the micro-batches A leaves out, where A is the window's
    gradient but for them (each other micro-batch at its share of the items, within the factor
    ``tolerance``, nothing left over); None where that does not explain A."""
    found = hypotheses.micro_batches
    if not found or len(found) < 2:
        return None
    counts = item_counts if item_counts and len(item_counts) == len(found) and sum(item_counts) else [1] * len(found)
    fit = combination(applied, found, leave_out)
    if fit.residual > tolerance:
        return None
    weights = [c / (n / sum(counts)) if n else None for c, n in zip(fit.factors, counts)]
    dropped = [j for j, w in enumerate(weights) if w is not None and abs(w) <= tolerance]
    kept = [w for j, w in enumerate(weights) if w is not None and j not in dropped]
    if not dropped or not kept or any(abs(w - 1.0) > tolerance for w in kept):
        return None
    return dropped


def missing_sentence(dropped: list[int], window: int, world_size: int) -> str:
    """What A is when micro-batches at ``dropped`` (positions in the window, every rank's numbered
    i x W + r) never reached the step."""
    where = ", ".join(f"{j}" + (f" (rank {j % world_size})" if world_size > 1 else "") for j in dropped)
    some, those = ("micro-batch", "it") if len(dropped) == 1 else ("micro-batches", "them")
    return (f"not a constant factor: the window's gradient without {some} {where} of its {window}, every other "
            f"micro-batch weighted as one batch weights it: {some} {where} never reached this optimizer step (the "
            f"backward of {those} skipped, or the gradient zeroed before the step)")
