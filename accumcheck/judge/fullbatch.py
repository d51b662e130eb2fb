"""The full-batch check's verdict: is the accumulated gradient A the whole batch's F, and where it
is not, what it is instead.

A normalisation bug scales every gradient by one constant (a loss divided by N once too often
gives A = F/N); micro-batches weighted unlike the full batch (per-micro-batch means over
different numbers of items) give each tensor its own factor. The least-squares factor
c = <A,F>/<F,F>, over all tensors and per tensor, tells the two apart, and a constant c is named
when it is one of the run's own numbers (N, the world size, the item counts).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

import numpy as np

from ..report import FullBatchResult, TermFit
from ..report.single import factor_text
from ..run.results import FullBatchGap, Hypotheses
from .candidates import Candidate, factor_candidates, run_figures
from .hypotheses import micro_sum_fit, missing_micro_batches, missing_sentence, rank_fit, term_fits
from .pieces import PairSums, pair_sums, squared_distance

# float64 evaluations of the same gradient agree to ~1e-15 of its scale; a semantic difference
# (how the loss is normalised) is of order one.
SEMANTIC_TOLERANCE = 1e-9
# A = cF "within FACTOR_TOLERANCE": the per-tensor factors' spread and the residual |A - cF|/|A|.
# A true constant leaves only float64 evaluation noise (~1e-15 of the scale, 1e-13 after long
# sums); micro-batches weighted differently move the factors by their item counts' relative
# differences, 1e-3 at the least for counts in the hundreds. 1e-6 sits orders of magnitude from
# both, and also decides whether c equals a candidate such as 1/N.
FACTOR_TOLERANCE = 1e-6
# A tensor whose gradient is round-off against the largest carries no factor: BERT's attention key
# bias has a gradient that is zero in exact arithmetic (softmax ignores a constant per query) and
# about 1e-21 of the largest element in float64, so its <A,F>/<F,F> is noise. A factor is known to
# FACTOR_TOLERANCE only where the tensor stands above float64's evaluation noise (1e-13 of the
# scale after long sums) by that much: 1e-13 / 1e-6. Below it, in A and in F, a tensor is left out
# of the factor, its spread and the residual, and named.
SIGNAL_FLOOR = 1e-7


@dataclass
class FactorFit:
    """A = cF in least squares: c over all tensors, per tensor, and how far A is from cF."""

    factor: float | None  # None where F is zero everywhere
    tensor_factors: dict[str, float] = field(default_factory=dict)
    furthest: str = ""  # the tensor furthest from c: a zero F under a non-zero A is infinitely far
    spread: float = math.inf
    residual: float = math.inf
    furthest_residual: float | None = None
    accumulated_zero: bool = False
    finite: bool = True
    silent: list[str] = field(default_factory=list)  # round-off in A and F: left out of the fit

    @property
    def constant(self) -> bool:
        """A = cF within FACTOR_TOLERANCE: every tensor's factor and the residual."""
        return self.spread <= FACTOR_TOLERANCE and self.residual <= FACTOR_TOLERANCE  # both infinite without c


def full_batch_verdict(gap: FullBatchGap, accum_steps: int, world_size: int = 1,
                       micro_batches: int | None = None, contexts: int = 1,
                       sums: dict[str, PairSums] | None = None) -> FullBatchResult:
    """Whether ``gap``'s accumulated gradient is the full batch's (within SEMANTIC_TOLERANCE of its
    largest element), and, where not, the factor between them and what it matches, or what else
    explains it (``gap.hypotheses``: the loss's additive terms, each micro-batch's own loss, the
    modules that compute over the batch). ``micro_batches`` is how many micro-batches the window
    held, where that may be fewer than ``accum_steps`` (a training stack's last window); in a
    data-parallel run of ``world_size`` ranks, per rank. ``contexts``: the devices one process
    split each micro-batch across (``candidates.factor_candidates``). ``sums``: each tensor's
    ``pair_sums(A, F)`` where the caller has them."""
    sums = sums if sums is not None else tensor_sums(gap.accumulated, gap.full)
    difference, worst = largest_difference(gap.accumulated, gap.full, sums)
    fit = fit_factor(gap.accumulated, gap.full, sums)
    # A = F on every tensor within FACTOR_TOLERANCE, not within SEMANTIC_TOLERANCE: parts of the
    # model round in float32 whatever its dtype (Llama's RMSNorm computes in float32), and
    # batches of other shapes round differently. A normalisation is 1e-3 away at the least.
    rounded = fit.constant and abs(fit.factor - 1.0) <= FACTOR_TOLERANCE
    equivalent = difference <= SEMANTIC_TOLERANCE or rounded
    constant = not equivalent and fit.constant
    candidates = factor_candidates(accum_steps, world_size, gap.item_counts, micro_batches, gap.predicted_counts,
                                   contexts)
    match = matching(fit.factor, candidates) if constant else None
    figures = run_figures(accum_steps, world_size, gap.item_counts, contexts)
    factors = list(fit.tensor_factors.values())
    h = gap.hypotheses
    window = (micro_batches or accum_steps) * world_size  # the micro-batches of every rank
    terms = None if equivalent else term_fits(gap.accumulated, h, window, fit.silent)
    micro = None if equivalent or terms is not None else micro_sum_fit(gap.accumulated, h, fit.silent)
    ranks = None if equivalent or terms is not None else rank_fit(gap.accumulated, h, fit.silent)
    rest = None if equivalent or h.rest is None else full_batch_verdict(h.rest, accum_steps, world_size,
                                                                         micro_batches, contexts)
    batch_level = terms is not None and _only_batch_level(*terms)
    result = FullBatchResult(
        normalisation=gap.normalisation, accumulated_scaled_by=gap.accumulated_scaled_by,
        max_relative_difference=difference, worst_tensor=worst, equivalent=equivalent, tolerance=SEMANTIC_TOLERANCE,
        factor=fit.factor, tensor_factors=fit.tensor_factors, factor_min=min(factors, default=None),
        factor_max=max(factors, default=None), factor_worst_tensor=fit.furthest, spread=_finite(fit.spread),
        residual=_finite(fit.residual), worst_tensor_residual=fit.furthest_residual,
        factor_tolerance=FACTOR_TOLERANCE, constant=constant, matches=None if match is None else match.name,
        item_counts=None if gap.item_counts is None else list(gap.item_counts), silent_tensors=fit.silent,
        by_design=[] if equivalent else list(h.by_design), rest=rest,
        terms=[] if terms is None else terms[1], main_factor=None if terms is None else terms[0],
        terms_residual=None if terms is None else _finite(terms[2]),
        micro_sum_factor=None if micro is None else micro.factors[0],
        micro_sum_residual=None if micro is None else _finite(micro.residual), batch_level=batch_level,
        rank_factors=None if ranks is None else ranks.factors,
        rank_residual=None if ranks is None else _finite(ranks.residual), rank_items=h.rank_items)
    if match is not None and h.takes_item_count and match.name in ("N", "k"):
        match = _ignored_item_count(match)
    result.explanation = explain(equivalent, fit, match, candidates, gap.item_counts, figures, difference)
    if not equivalent and fit.finite and fit.factor is not None:
        dropped = None if constant or terms is not None else \
            missing_micro_batches(gap.accumulated, h, gap.item_counts, fit.silent, FACTOR_TOLERANCE)
        result.explanation = _explained_otherwise(result, h, window, accum_steps, candidates, dropped,
                                                  world_size) or result.explanation
    return result


def _only_batch_level(main: float, terms: list[TermFit], residual: float) -> bool:
    """A is the window's gradient but for terms computed over the batch, each the mean of its
    micro-batches' (all accumulation can do): the rest's factor 1, each term's 1/k, nothing left."""
    return (residual <= FACTOR_TOLERANCE and abs(main - 1.0) <= FACTOR_TOLERANCE
            and all(abs(t.factor * t.micro_batches - 1.0) <= FACTOR_TOLERANCE for t in terms)
            and any(t.batch_level for t in terms))


def _ignored_item_count(match: Candidate) -> Candidate:
    """N (k on a short window) where the model takes the window's item count: the stack skipped
    its 1/N for the model to normalise, and the model's loss did not."""
    return dataclasses.replace(match, reason=IGNORED_ITEM_COUNT)


IGNORED_ITEM_COUNT = ("the model accepts num_items_in_batch, so the Trainer does not divide by N, but its loss "
                      "ignores it and averages each micro-batch on its own (transformers#47688); pass "
                      "num_items_in_batch to the loss, or set model_accepts_loss_kwargs = False on the Trainer")


def _explained_otherwise(result: FullBatchResult, h: Hypotheses, window: int, accum_steps: int,
                         candidates: list[Candidate], dropped: list[int] | None, world_size: int) -> str | None:
    """The sentence of what else explains A where F alone does not, or None."""
    if result.terms:
        return terms_sentence(result, window, candidates)
    if result.by_design:
        return by_design_sentence(result)
    if result.constant:
        return None
    if dropped:
        return missing_sentence(dropped, window, world_size)
    if result.rank_factors is not None and result.rank_residual is not None \
            and result.rank_residual <= FACTOR_TOLERANCE:
        return rank_sentence(result.rank_factors, h.rank_items, h.rank_predicted)
    if result.micro_sum_factor is not None and result.micro_sum_residual is not None \
            and result.micro_sum_residual <= FACTOR_TOLERANCE:
        return micro_sum_sentence(result.micro_sum_factor, h.takes_item_count, window, accum_steps) + (
            f"; items per micro-batch: {min(result.item_counts)} to {max(result.item_counts)}"
            if result.item_counts and len(set(result.item_counts)) > 1 else "")
    return None


def terms_sentence(result: FullBatchResult, window: int, candidates: list[Candidate]) -> str:
    """A as the rest of the window's loss and the loss's additive terms, each named; the rest's
    factor matched against the run's numbers as a constant factor of the whole would be."""
    if result.terms_residual is None or result.terms_residual > FACTOR_TOLERANCE:
        factors = ", ".join(f"{t.name} {factor_text(t.factor)}" for t in result.terms)
        return (f"not the window's gradient, nor its rest of the loss plus its terms summed over the micro-batches "
                f"(factors: rest {factor_text(result.main_factor)}, {factors}; residual "
                f"{brief(result.terms_residual)}): the micro-batches are weighted unlike one batch")
    main = result.main_factor
    if abs(main - 1.0) <= FACTOR_TOLERANCE:
        rest = "the rest of the loss is the window's"
    else:
        match = matching(main, candidates)
        rest = f"the rest of the loss is {factor_text(main)} x the window's" + (
            f" (matches {match.name}, {match.where}: {match.reason})" if match else "")
    parts = [rest]
    for t in result.terms:
        share = t.factor * window
        if abs(share - 1.0) <= FACTOR_TOLERANCE:
            said = f"the {t.name} is the mean of the {window} micro-batches' (as accumulation should)"
        elif abs(share - window) <= FACTOR_TOLERANCE * window:
            said = (f"the {t.name} is added once per micro-batch, not divided by the {window} micro-batches "
                    f"({window}x its share)")
        else:
            said = f"the {t.name} is {factor_text(share)} x the mean of the {window} micro-batches'"
            match = next((c for c in candidates if c.name == "W" and abs(share - c.value) <= FACTOR_TOLERANCE * c.value),
                         None)
            if match is not None:
                said += (f": multiplied by the world size ({match.where}), which only the loss normalised over the "
                         "global window's items should be (transformers#48690)")
        if t.batch_level:
            said += (f"; it is computed over the batch by design (one batch's differs from the micro-batches' mean "
                     f"by {brief(t.batch_gap)}), so no accumulation equals one batch there")
        parts.append(said)
    head = "the window's gradient but for batch-level terms" if result.batch_level else "not the window's gradient"
    return f"{head}: " + "; ".join(parts)


def by_design_sentence(result: FullBatchResult) -> str:
    """A window differs from one batch because modules compute over the batch: which, and what A
    is with them in eval mode, where that was run."""
    modules = ", ".join(result.by_design[:3]) + (f" and {len(result.by_design) - 3} more" if len(result.by_design) > 3
                                                 else "")
    head = (f"by design: {modules} normalise{'s' * (len(result.by_design) == 1)} each micro-batch by its own "
            "statistics, so a window differs from one batch whatever the accumulation")
    if result.rest is None:
        return (f"{head}; the loss normalisation cannot be judged against one batch here: put "
                f"{'it' if len(result.by_design) == 1 else 'them'} in eval mode for the check to judge the rest")
    if result.rest.equivalent:
        return f"{head}; with {'it' if len(result.by_design) == 1 else 'them'} in eval mode, equivalent: the rest is faithful"
    return f"{head}; with {'it' if len(result.by_design) == 1 else 'them'} in eval mode, still not: {result.rest.explanation}"


def rank_sentence(factors: list[float], rank_items: list[int] | None, rank_predicted: list[int] | None) -> str:
    """A is a weighted sum of each rank's micro-batches as a batch of their own: which weights, and
    what they mean against the ranks' shares of the window's items."""
    size = len(factors)
    weights = ", ".join(f"{factor_text(c)}" for c in factors)
    head = f"each rank's micro-batches weighted as a batch of their own (rank weights {weights})"
    if not rank_items or not sum(rank_items) or min(rank_items) <= 0:
        return f"not a constant factor: {head}: the ranks' micro-batches are weighted unlike one batch"
    total = sum(rank_items)
    shares = ", ".join(f"rank {r}: {n} ({n / total:.3f})" for r, n in enumerate(rank_items))
    said = (f"not a constant factor: {head}: each rank normalised its loss over its own items, not the global "
            f"window's, so micro-batches are weighted by their rank's item count (num_items_in_batch counted per rank, "
            f"transformers#34242); one batch weights each rank by its share of the {total} items ({shares}); count "
            "the items over every rank (the Trainer's average_tokens_across_devices=True)")
    if all(abs(c * size - 1.0) <= FACTOR_TOLERANCE for c in factors):
        return said
    if rank_predicted and all(abs(c * size - p / n) <= FACTOR_TOLERANCE for c, p, n in
                              zip(factors, rank_predicted, rank_items)):
        return said + ("; and each rank's loss is divided by its labelled tokens counted before the causal shift "
                       "(transformers#46204)")
    weighed = [c / (n / total) for c, n in zip(factors, rank_items)]  # one batch: 1 x each rank's share
    odd = [r for r, w in enumerate(weighed) if abs(w - 1.0) > FACTOR_TOLERANCE]
    listed = ", ".join(f"rank {r} {factor_text(weighed[r])}" for r in odd)
    return (f"not a constant factor: {head}: the ranks do not scale their losses alike: against its share of the "
            f"window's items, which one batch weights it by, {listed} x ({shares} items)")


def micro_sum_sentence(factor: float, takes_item_count: bool | None, window: int, accum_steps: int) -> str:
    """A is c x the sum of each micro-batch's own loss's gradient."""
    head = f"each micro-batch's own mean loss, summed over the window x {factor_text(factor)}"
    if abs(factor - 1.0) <= FACTOR_TOLERANCE:
        if takes_item_count:
            return f"not a constant factor: {head}: {IGNORED_ITEM_COUNT}"
        return (f"not a constant factor: {head}: the micro-batches' mean losses are summed without dividing by N "
                "and each is a mean over its own items, not the window's")
    if abs(factor * window - 1.0) <= FACTOR_TOLERANCE or abs(factor * accum_steps - 1.0) <= FACTOR_TOLERANCE:
        why = ("the model does not accept num_items_in_batch, so the Trainer can only divide each micro-batch's mean "
               "loss by N: " if takes_item_count is False else "each micro-batch's mean loss is divided by N: ")
        return (f"not a constant factor: {head}: {why}micro-batches with different numbers of items are weighted "
                "alike (transformers#34191); normalise by the window's item count")
    return f"not a constant factor: {head}: the micro-batches are weighted unlike one batch"


def tensor_sums(accumulated: dict[str, np.ndarray], full: dict[str, np.ndarray]) -> dict[str, PairSums]:
    """Each tensor's A against its F, in one pass over both (``pieces.pair_sums``)."""
    return {name: pair_sums(accumulated[name], f) for name, f in full.items()}


def largest_difference(accumulated: dict[str, np.ndarray], full: dict[str, np.ndarray],
                       sums: dict[str, PairSums] | None = None) -> tuple[float, str]:
    """max |A - F| over all tensors, relative to F's largest element (1 where F is all zero), and
    the tensor where it is."""
    sums = sums if sums is not None else tensor_sums(accumulated, full)
    top = max((s.y_max for s in sums.values()), default=0.0) or 1.0
    gaps = {name: s.difference_max / top for name, s in sums.items()}
    gaps = {name: gap if not math.isnan(gap) else math.inf for name, gap in gaps.items()}  # nan: no agreement
    worst = max(gaps, key=gaps.get, default="")
    return gaps.get(worst, 0.0), worst


def fit_factor(accumulated: dict[str, np.ndarray], full: dict[str, np.ndarray],
               sums: dict[str, PairSums] | None = None) -> FactorFit:
    """The least-squares factors of A = cF over the tensors that carry signal (``silent_tensors``
    are left out); non-finite gradients have none."""
    # one tensor at a time, in float64: A may be held in its own dtype, and no float64 copy of it is
    # made (``pieces``); the sums in one pass over A and F, ||A - cF|| in a second once c is known
    sums = sums if sums is not None else tensor_sums(accumulated, full)
    if not all(s.finite for s in sums.values()):
        return FactorFit(None, finite=False)
    silent = silent_tensors(accumulated, full, sums)
    names = [name for name in full if name not in silent]
    af = {name: sums[name].xy for name in names}
    ff = {name: sums[name].yy for name in names}
    norms = {name: math.sqrt(sums[name].xx) for name in names}
    total = math.sqrt(sum(n * n for n in norms.values()))
    if sum(ff.values()) == 0:
        return FactorFit(None, accumulated_zero=total == 0, silent=silent)
    c = sum(af.values()) / sum(ff.values())
    factors = {name: af[name] / ff[name] for name in names if ff[name] > 0}
    # a tensor with a gradient where the full batch has none is as far from c as can be
    distance = {name: abs(factors[name] - c) if name in factors else math.inf
                for name in names if name in factors or norms[name] > 0}
    left = {}
    for name in names:
        left[name] = math.sqrt(sums[name].dd if c == 1.0 else squared_distance(accumulated[name], full[name], c))
    furthest = max(distance, key=distance.get, default="")
    spread = max((abs(x - c) for x in factors.values()), default=0.0) / abs(c) if c else math.inf
    return FactorFit(c, factors, furthest, spread, _ratio(math.sqrt(sum(x * x for x in left.values())), total),
                     _ratio(left[furthest], norms[furthest]) if furthest else None, total == 0, silent=silent)


def silent_tensors(accumulated: dict[str, np.ndarray], full: dict[str, np.ndarray],
                   sums: dict[str, PairSums] | None = None) -> list[str]:
    """The tensors whose gradient is round-off against the largest in both A and F (SIGNAL_FLOOR):
    a tensor zero in exact arithmetic, whose factor would be noise. Not one where A has a gradient
    and F has none: that is a finding."""
    sums = sums if sums is not None else tensor_sums(accumulated, full)
    a_top = {name: s.x_max for name, s in sums.items()}
    f_top = {name: s.y_max for name, s in sums.items()}
    a_max, f_max = max(a_top.values(), default=0.0), max(f_top.values(), default=0.0)
    if f_max == 0:
        return []
    return [name for name in full if f_top[name] <= SIGNAL_FLOOR * f_max and a_top[name] <= SIGNAL_FLOOR * a_max
            and (f_top[name] > 0 or a_top[name] > 0)]


def matching(factor: float | None, candidates: list[Candidate]) -> Candidate | None:
    """The first candidate ``factor`` equals within FACTOR_TOLERANCE (relative), or None."""
    for candidate in candidates:
        if factor is not None and abs(factor - candidate.value) <= FACTOR_TOLERANCE * candidate.value:
            return candidate
    return None


def explain(equivalent: bool, fit: FactorFit, match: Candidate | None, candidates: list[Candidate],
            item_counts: list[int] | None, figures: str, difference: float = 0.0) -> str:
    """One sentence for the user: what the accumulated gradient is."""
    if equivalent and difference > SEMANTIC_TOLERANCE:
        return (f"equivalent: accumulated = full batch within {brief(FACTOR_TOLERANCE)} on every tensor, "
                f"{brief(difference)} apart at most: more than float64 evaluation leaves, as where parts of the "
                "model compute in float32 whatever its dtype (Llama's RMSNorm does), rounding batches of other "
                "shapes differently")
    if equivalent:
        return f"equivalent: accumulated = full batch within {brief(SEMANTIC_TOLERANCE)}"
    if not fit.finite:
        return "not a constant factor: the gradients are not finite (inf or nan)"
    if fit.factor is None:
        return "not a constant factor: the full batch's gradient is zero everywhere, the accumulated one is not"
    if fit.accumulated_zero:
        return "not a constant factor: the accumulated gradient is zero where the full batch's is not"
    if fit.constant:
        return constant_sentence(fit, match, candidates, figures)
    return varying_sentence(fit, item_counts)


def constant_sentence(fit: FactorFit, match: Candidate | None, candidates: list[Candidate], figures: str) -> str:
    """A = cF on every tensor: c, and what it matches."""
    head = (f"accumulated = {factor_text(fit.factor)} x full batch on all {len(fit.tensor_factors)} tensors"
            f"{silent_text(fit.silent)} (spread {brief(fit.spread)})")
    if match is not None:
        # another of the run's numbers of the same value (N = C = 2): both causes are said, the first as the likelier
        same = [c for c in candidates if c.name != match.name and matching(fit.factor, [c]) is c]
        return f"{head}: matches {match.name} ({match.where}): {match.reason}" + "".join(
            f"; or {c.name} ({c.where}), the same number here: {c.reason}" for c in same)
    names = ", ".join(c.name for c in candidates)
    return f"{head}: matches none of {names} ({figures}): the loss is scaled by a constant its normalisation does not have"


def varying_sentence(fit: FactorFit, item_counts: list[int] | None) -> str:
    """Tensors with factors of their own: their range, the worst, and the likely cause."""
    factors = fit.tensor_factors.values()
    worst = fit.furthest
    if worst and worst not in fit.tensor_factors:
        where = f"worst {worst}, a gradient where the full batch's is zero"
    elif fit.furthest_residual is None:  # known per group only, where a window was judged in groups
        where = f"worst {worst}"
    else:
        where = f"worst {worst}, residual {brief(fit.furthest_residual)}"
    text = (f"not a constant factor: per-tensor factors {factor_text(min(factors))} to "
            f"{factor_text(max(factors))}{silent_text(fit.silent)} ({where}): the micro-batches are weighted unlike "
            "the full batch")
    if item_counts and len(set(item_counts)) == 1:
        return text + f"; every micro-batch holds {item_counts[0]} items, so not by their item counts"
    text += (", as per-micro-batch mean losses over micro-batches with different numbers of items do "
             "(transformers#34191); normalise by the window's item count")
    return text + (f"; items per micro-batch: {min(item_counts)} to {max(item_counts)}" if item_counts else "")


def silent_text(silent: list[str]) -> str:
    """The tensors left out of the factor as round-off, e.g. " with signal (2 more are round-off, no
    factor: a.bias, b.bias)"; "" for none."""
    if not silent:
        return ""
    names = ", ".join(silent[:3]) + (" ..." if len(silent) > 3 else "")
    return f" with signal ({len(silent)} more {'is' if len(silent) == 1 else 'are'} round-off, no factor: {names})"


def brief(x: float | None) -> str:
    """A small figure in 2 significant digits, short exponents ("2.2e-16", "0.12", "1e-9")."""
    if x is None:
        return "-"
    return re.sub(r"e([+-])0*(\d)", lambda m: "e" + m.group(1).replace("+", "") + m.group(2), f"{x:.2g}")


def _ratio(x: float, y: float) -> float:
    """x / y, 0 for 0 / 0, infinite for anything else over 0."""
    return x / y if y > 0 else (0.0 if x == 0 else math.inf)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
