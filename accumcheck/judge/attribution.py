"""Why a mode left its bound, and whether a mode inside it looks like a fault: a second pass over
the clean micro-gradients g_0 .. g_{N-1} of the tensors that matter, streamed (a few copies of
one tensor, whatever N).

Each mode's error e = X - E (X its accumulated total, E the float64 sum) is fitted by one
candidate at a time, e ~ c * v, in least squares weighted by 1/S^2 (every element in units of its
own round-off scale):

  micro-step k        v = g_k              c = 1, 2, ..: counted c extra times; c = -1: lost;
                                           otherwise scaled by 1 + c
  running total       v = g_0 + .. + g_{k-1}   c = 1, 2, ..: the total so far added again at step k
  the whole sum       v = E                scaled by 1 + c
  growth              e ~ a T + b E, T_k = r T_{k-1} + g_k (r = 2, 3, 4, 8, .., 64): the running total
                      multiplied by r at every micro-step, each micro-gradient scaled by a (MXNet
                      1.6.0's grad_req='add' with five gradient contributions: r = 16)
  narrower dtype      v = R - E, R the running total rounded to bfloat16 (float16) after every step
  narrower mean       v = N M - E, M the running mean M + (g_k - M) / (k + 1) kept in bfloat16
                      (float16), every operation rounded (optax.MultiSteps' default on bfloat16
                      parameters)

An explanation holds when what it leaves over, e - c v, is within the round-off bound in every
element; of those that hold the best fit wins (fit = 1 - |e - c v|^2 / |e|^2), the simpler on a
tie. None holding: "a difference the accumulation of the same micro-gradients cannot explain".

The statistical tier (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019). To first order a sum's
error is sum_j delta_j s_j over its N - 1 additions, s_j the partial sums (|s_j| <= S) and
|delta_j| <= u. If the delta_j are independent with mean zero, the error projected on any fixed
pattern v, z = <e, v>_w / sqrt(sum_i w_i^2 v_i^2 sigma_i^2) with sigma_i = u S_i sqrt(N - 1), is
a sum of independent bounded terms, so P(|z| >= t) <= 2 exp(-t^2 / 2) (Hoeffding) whatever the
order of the sum: sequential, pairwise, blocked or compensated. A mode inside the worst-case bound
whose error projects on one of the candidates' patterns with |z| beyond the threshold of all of
them together (``FALSE_ALARM`` per tensor, Bonferroni over the candidates) is ``suspicious``.
Where the model does not hold, the test leaves the elements out: elements whose term is too small
to leave a mark on the sum (|v_i| <= 2 u S_i: round-to-nearest then drops it whole, the error is
-v_i, not random — stagnation), elements whose terms repeat from step to step (k x rounds the
same way every time: systematic, not random), elements that repeat another's (E, S) (their errors
are the same, not independent) and elements in the subnormal range (absolute, not relative, errors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from ..bounds import SMALLEST_NORMAL, ModeBound, gamma
from ..report import Cause, TensorResult
from ..run.faults import round_to_bfloat16

# Per tensor, the chance that a correct accumulation is called suspicious under the model.
FALSE_ALARM = 1e-6
NARROW_DTYPES = ("bfloat16", "float16")
# An explanation must account for this share of the difference (and leave round-off).
MIN_FIT = 0.9
# Fits within this of the best are a tie, won by the simpler explanation.
FIT_TIE = 1e-3
ALTERNATIVES_SHOWN = 3
# An element whose terms repeat one of the two before them in more than 1/REPEATED_SHARE of the
# micro-steps is left out of the statistical score.
REPEATED_SHARE = 4
# Explanations in order of simplicity, for ties.
_SIMPLICITY = ("drop-step", "repeat-step", "scale-step", "running-total", "scale-sum", "narrow-dtype", "narrow-mean",
               "growth")
GROWTH = (2, 3, 4, 8, 16, 32, 64)
# The growth family keeps two tensors per factor: only for tensors up to this many elements.
GROWTH_ELEMENTS = 1 << 22

# A replay: the names of the tensors to replay in, each micro-step's clean gradients out.
Replay = Callable[[list[str]], Iterable[dict[str, np.ndarray]]]


@dataclass
class _Best:
    """The best candidate of one family so far: by explained share (for the fit) or by score."""

    step: int = -1
    coef: float = 0.0
    explained: float = -1.0
    vector: np.ndarray | None = None
    # Other steps whose pattern is this one's times a factor: (step, coefficient, factor).
    same: list[tuple[int, float, float]] = field(default_factory=list)


class _ModeFit:
    """One mode's error against the candidates streamed past it."""

    def __init__(self, error: np.ndarray, weight: np.ndarray, sigma2: np.ndarray, stat: np.ndarray, u: float,
                 absum: np.ndarray):
        self.error, self.weight = error, weight
        self.we = weight * error
        self.energy = float(self.we @ error)  # <e, e>_w
        self.q = np.where(stat, weight * weight * sigma2, 0.0)  # the score's variance proxy per element
        self.small = 2.0 * u * absum  # |v_i| at or below this: stagnation, left out of the score
        self.fits = {"step": _Best(), "prefix": _Best(), "total": _Best()}
        self.scores = {"step": _Best(), "prefix": _Best(), "total": _Best()}
        self.score, self.score_family = 0.0, ""

    def offer(self, family: str, step: int, v: np.ndarray) -> None:
        wv = self.weight * v
        vv = float(wv @ v)
        if vv <= 0.0:
            return
        num = float(self.we @ v)
        explained = num * num / vv
        best = self.fits[family]
        if best.vector is not None and abs(explained - best.explained) <= 1e-9 * best.explained:
            ratio = float(v @ best.vector) / float(best.vector @ best.vector)  # v = ratio * best.vector
            if np.allclose(v, ratio * best.vector, rtol=1e-12, atol=0.0):
                best.same.append((step, num / vv, ratio))
                return
        if explained > best.explained:
            self.fits[family] = _Best(step, num / vv, explained, v.copy())
        z = self.z(v)
        if z > self.scores[family].explained:
            self.scores[family] = _Best(step, num / vv, z, v.copy())
        if z > self.score:
            self.score, self.score_family = z, family

    def z(self, v: np.ndarray) -> float:
        """|<e, v>_w| over its standard deviation under the model, on the elements the model covers."""
        keep = (np.abs(v) > self.small) & (self.q > 0.0)  # the same elements above and below the line
        proxy = float((self.q * keep) @ (v * v))
        return abs(float((self.we * keep) @ v)) / math.sqrt(proxy) if proxy > 0.0 else 0.0

    def coefficient(self, v: np.ndarray) -> tuple[float, float]:
        """(c, fit) of e ~ c v."""
        vv = float((self.weight * v) @ v)
        if vv <= 0.0 or self.energy <= 0.0:
            return 0.0, 0.0
        num = float(self.we @ v)
        return num / vv, num * num / vv / self.energy

    def fit_of(self, c: float, v: np.ndarray) -> float:
        if self.energy <= 0.0:
            return 0.0
        r = self.error - c * v
        return 1.0 - float((self.weight * r) @ r) / self.energy


@dataclass
class Examined:
    """One tensor to examine: its arrays and the bound each mode is held to."""

    result: TensorResult
    native: np.ndarray
    manual: np.ndarray
    exact: np.ndarray
    absum: np.ndarray
    bounds: dict[str, ModeBound]  # "native", "manual": the bound an explanation's residual must keep
    units: dict[str, float]  # unit round-off of each mode's running total


class TensorExamination:
    """The second pass over one tensor: ``add`` each clean micro-gradient in order, then ``finish``."""

    def __init__(self, item: Examined, accum_steps: int, modes: tuple[str, ...], explain: bool):
        self.item, self.n = item, accum_steps
        exact = np.asarray(item.exact, np.float64).reshape(-1)
        absum = np.asarray(item.absum, np.float64).reshape(-1)
        self.exact, self.absum = exact, absum
        weight = np.zeros_like(absum)
        np.divide(1.0, absum * absum, out=weight, where=absum > 0)
        self.absum_rms = math.sqrt(float(np.mean(absum * absum))) if absum.size else 0.0
        self.modes: dict[str, _ModeFit] = {}
        independent = _independent(exact, absum)
        for mode in modes:
            values = np.asarray(getattr(item, mode), np.float64).reshape(-1)
            u = item.units[mode]
            stat = independent & (absum * u >= SMALLEST_NORMAL["float32"])
            sigma2 = _variance_proxy(absum, accum_steps, u, item.bounds[mode], self.absum_rms)
            self.modes[mode] = _ModeFit(values - exact, weight, sigma2, stat, u, absum)
        self.prefix = np.zeros_like(exact)
        # Only a flagged tensor is explained: the statistical tier needs none of these.
        growth = explain and exact.size <= GROWTH_ELEMENTS
        self.growth = {r: np.zeros_like(exact) for r in GROWTH} if growth else {}
        # sum_k r^(N-1-k) |T_k|: what the growth's own roundings are at most amplified to
        self.growth_scale = {r: np.zeros_like(exact) for r in GROWTH} if growth else {}
        self.narrow = {d: np.zeros(exact.shape, np.float32) for d in NARROW_DTYPES} if explain else {}
        self.narrow_mean = {d: np.zeros(exact.shape, np.float32) for d in NARROW_DTYPES} if explain else {}
        self.replayed = np.zeros_like(exact)  # the replay's own E: it must equal the first pass's
        self.steps = 0
        # Terms that repeat one of the two before them, per element: their roundings are not random.
        self.recent = [np.full(exact.shape, np.nan), np.full(exact.shape, np.nan)]
        self.repeats = np.zeros(exact.shape, np.int32)

    def add(self, grad: np.ndarray) -> None:
        g32 = np.asarray(grad).reshape(-1)
        g = g32.astype(np.float64)
        k = self.steps
        for fit in self.modes.values():
            fit.offer("step", k, g)
            if k > 0:
                fit.offer("prefix", k, self.prefix)
        self.prefix += g
        with np.errstate(over="ignore", invalid="ignore"):
            for r, total in self.growth.items():
                total *= r
                total += g
                scale = self.growth_scale[r]
                scale *= r
                scale += np.abs(total)
        for dtype, total in self.narrow.items():
            total += g32.astype(np.float32)
            self.narrow[dtype] = _round_to(dtype, total)
        for dtype, mean in self.narrow_mean.items():
            # each operation in the dtype, the count too (in bfloat16, 257 is 256)
            count = _round_to(dtype, np.array([k + 1], np.float32))
            with np.errstate(over="ignore", invalid="ignore"):
                step = _round_to(dtype, _round_to(dtype, g32.astype(np.float32) - mean) / count)
                self.narrow_mean[dtype] = _round_to(dtype, mean + step)
        self.replayed += g
        self.repeats += (g == self.recent[0]) | (g == self.recent[1])
        self.recent = [g, self.recent[0]]
        self.steps += 1

    @property
    def reproduced(self) -> bool:
        """Whether the replay gave the first pass's micro-gradients (its float64 sum is E's)."""
        return self.steps == self.n and np.array_equal(self.replayed, self.exact)

    def threshold(self) -> float:
        """The score a correct sum passes with probability FALSE_ALARM at most, over every candidate."""
        candidates = len(self.modes) * (2 * self.n + 1)
        return math.sqrt(2.0 * math.log(2.0 * candidates / FALSE_ALARM))

    def finish(self, mode: str) -> tuple[Cause | None, float]:
        """The cause of ``mode``'s error (None when nothing is to be explained) and its largest score."""
        fit = self.modes[mode]
        fit.offer("total", self.n, self.exact)  # the whole sum: a candidate once E is complete
        # The score again, of each family's strongest candidate, now that it is known which elements
        # repeat their terms (left out: constant terms round the same way at every step).
        fit.q = np.where(self.repeats * REPEATED_SHARE > self.n, 0.0, fit.q)
        scores = {family: fit.z(best.vector) for family, best in fit.scores.items() if best.vector is not None}
        fit.score_family = max(scores, key=scores.get, default="")
        fit.score = scores.get(fit.score_family, 0.0)
        if fit.energy <= 0.0:
            return None, fit.score
        return self._explain(mode, fit), fit.score

    def suspicious_cause(self, mode: str) -> Cause:
        """The candidate ``mode``'s error projects on most strongly, as a Cause."""
        fit = self.modes[mode]
        family = fit.score_family
        best = fit.scores[family]
        kind = {"step": "drop-step" if round(best.coef) == -1 else "scale-step", "prefix": "running-total",
                "total": "scale-sum"}[family]
        step = None if family == "total" else best.step
        return self._cause(mode, kind, step, best.coef, fit.fit_of(best.coef, best.vector),
                           self._residual(mode, best.coef, best.vector))

    # ------------------------------------------------------------------ explanations

    def _explain(self, mode: str, fit: _ModeFit) -> Cause:
        found: list[tuple[float, int, Cause]] = []

        def consider(cause: Cause) -> None:
            if cause.residual_ratio <= 1.0 and cause.fit >= MIN_FIT:
                found.append((cause.fit, -_SIMPLICITY.index(cause.kind), cause))

        for family in ("step", "prefix"):
            best = fit.fits[family]
            if best.vector is None:
                continue
            # Steps whose pattern is the primary's times a factor (equal micro-gradients, periodic
            # batches) fit exactly as well: each is a reading of its own, with its own coefficient.
            for step, coef, ratio in [(best.step, best.coef, 1.0), *best.same]:
                v = best.vector
                whole = round(coef)
                held = len(found)
                if whole != 0 and whole >= -1 and (family == "step" or whole >= 1):
                    kind = "drop-step" if whole == -1 else ("repeat-step" if family == "step" else "running-total")
                    scaled = whole * ratio  # this reading as a coefficient of the primary's pattern
                    consider(self._cause(mode, kind, step, float(whole), fit.fit_of(scaled, v),
                                         self._residual(mode, scaled, v)))
                if family == "step" and len(found) == held:  # a whole count that holds says it better
                    consider(self._cause(mode, "scale-step", step, coef, fit.fit_of(best.coef, v),
                                         self._residual(mode, best.coef, v)))
        c, share = fit.coefficient(self.exact)
        consider(self._cause(mode, "scale-sum", None, c, share, self._residual(mode, c, self.exact)))
        for r, total in self.growth.items():
            if np.isfinite(total).all():
                cause = self._growth(mode, fit, r, total)
                if cause is not None and abs(cause.grad_scale or 0.0) >= 0.01:  # else the sum scaled, said simply
                    consider(cause)
        for dtype, total in self.narrow.items():
            predicted = total.astype(np.float64) - self.exact
            c, share = fit.coefficient(predicted)
            consider(self._cause(mode, "narrow-dtype", None, c, share, self._residual(mode, c, predicted), dtype))
        for dtype, mean in self.narrow_mean.items():
            predicted = self.n * mean.astype(np.float64) - self.exact
            if np.isfinite(predicted).all():
                c, share = fit.coefficient(predicted)
                consider(self._cause(mode, "narrow-mean", None, c, share, self._residual(mode, c, predicted), dtype))
        if found:  # the simplest of those that fit about as well as the best; the others as alternatives
            top = max(f[0] for f in found)
            tied = sorted((f for f in found if f[0] >= top - FIT_TIE), key=lambda f: -f[1])
            chosen = tied[0][2]
            others = list(dict.fromkeys(f[2].words for f in tied[1:] if f[2].words != chosen.words))
            if others:
                chosen.alternatives = others
                shown = ", ".join(others[:ALTERNATIVES_SHOWN])
                more = f" and {len(others) - ALTERNATIVES_SHOWN} more" if len(others) > ALTERNATIVES_SHOWN else ""
                chosen.detail += f"; as well: {shown}{more}"
            return chosen
        best = max((fit.fits[f] for f in ("step", "prefix")), key=lambda b: b.explained)
        share = best.explained / fit.energy if fit.energy > 0 and best.vector is not None else 0.0
        nearest = ""
        if best.vector is not None:
            nearest = f"; the nearest, micro-step {best.step}, fits {share:.3f}"
        return Cause("unexplained", mode, "not a single-step fault",
                     f"{mode}: a difference the accumulation of the same micro-gradients cannot explain, "
                     f"not a single-step fault{nearest}", share, math.inf)

    def _growth(self, mode: str, fit: _ModeFit, r: int, total: np.ndarray) -> Cause | None:
        """e ~ a T + b E, weighted least squares in two unknowns; None where T has outgrown float64."""
        peak = float(np.max(np.abs(total))) if total.size else 0.0
        amplified = self.growth_scale[r]
        if not 0.0 < peak < math.inf or not np.isfinite(amplified).all():
            return None
        t = total / peak  # T in units of its largest element: its squares stay finite
        w = fit.weight
        wt, we_ = w * t, w * self.exact
        gram = np.array([[wt @ t, wt @ self.exact], [we_ @ t, we_ @ self.exact]])
        rhs = np.array([fit.we @ t, fit.we @ self.exact])
        try:
            a_unit, b = np.linalg.solve(gram, rhs)
        except np.linalg.LinAlgError:
            return None
        v = a_unit * t + b * self.exact
        # Each step rounds its product and its sum (at most 2u |a T_k| each), and later steps
        # multiply those errors by r again.
        u = self.item.units[mode]
        rounded = 2.0 * u * (1.0 + gamma(self.n, u)) * abs(a_unit) * (amplified / peak)
        if not (np.isfinite(v).all() and np.isfinite(rounded).all()):
            return None
        a = float(a_unit / peak)
        return self._cause(mode, "growth", None, float(r), fit.fit_of(1.0, v), self._residual(mode, 1.0, v, rounded),
                           grad_scale=a)

    def _residual(self, mode: str, c: float, v: np.ndarray, rounded: np.ndarray | None = None) -> float:
        """The worst element of e - c v against the round-off bound of the sum the explanation
        describes: the mode's bound with |c v| added to S (what the faulty sum also rounded, the
        kernel allowance included), plus ``rounded`` where the explanation bounds its own roundings."""
        bound = self.item.bounds[mode]
        explained = c * v
        scale = self.absum + np.abs(explained)
        limit = bound.relative * scale + bound.floor(math.sqrt(float(np.mean(scale * scale))))
        if rounded is not None:  # the explained computation's own roundings, where it says them
            limit = limit + rounded
        r = np.abs(self.modes[mode].error - explained)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(r == 0, 0.0, r / limit)
        worst = float(np.max(ratio)) if ratio.size else 0.0
        return worst if math.isfinite(worst) else math.inf

    def _cause(self, mode: str, kind: str, step: int | None, c: float, fit: float, residual: float,
               dtype: str | None = None, grad_scale: float | None = None) -> Cause:
        words, detail = describe(kind, step, c, dtype, 1.0 if grad_scale is None else grad_scale)
        fit = max(fit, 0.0)
        return Cause(kind, mode, words, f"{mode}: {detail} (fit {fit:.3f})", fit, residual, step, c, dtype, grad_scale)


def describe(kind: str, step: int | None, c: float, dtype: str | None, grad_scale: float = 1.0) -> tuple[str, str]:
    """(short words, sentence) of an explanation."""
    if kind == "repeat-step":
        times = "twice" if c == 1 else f"{int(c) + 1} times"
        return f"step {step} counted {times}", f"micro-step {step} counted {times}"
    if kind == "drop-step":
        return f"step {step} lost", f"micro-step {step} lost"
    if kind == "scale-step":
        return f"step {step} scaled {_factor(c, 2)}", f"micro-step {step} scaled by {_factor(c, 3)}"
    if kind == "running-total":
        extra = "again" if c == 1 else f"{c:.3g} more times"
        short = "" if c == 1 else f" {c:.3g}x"
        return f"total re-added{short} at step {step}", f"the running total before micro-step {step} added {extra}"
    if kind == "scale-sum":
        return f"sum scaled {_factor(c, 2)}", f"the whole sum scaled by {_factor(c, 3)}"
    if kind == "growth":
        again = "again" if c == 2 else f"again {c - 1:g} times"
        scaled = "" if abs(grad_scale - 1.0) < 1e-3 else f", each micro-gradient scaled by {grad_scale:.3g}"
        short = "total re-added every step" if c == 2 else f"total x{c:g} every step"
        return short, f"the running total added {again} at every micro-step (x{c:g} per step){scaled}"
    if kind == "narrow-dtype":
        return f"sum kept in {dtype}", f"the running total kept in {dtype}"
    if kind == "narrow-mean":
        return (f"mean kept in {dtype}",
                f"the running mean kept in {dtype} (acc + (g - acc)/(k+1), each operation rounded)")
    raise ValueError(f"no words for an explanation of kind {kind!r}")


def _factor(c: float, digits: int) -> str:
    """1 + c in words: "1+0.001" near 1, where the deviation is what matters, else "0.5"."""
    return f"1{c:+.{digits}g}" if abs(c) < 0.01 else f"{1 + c:.{digits}g}"


def _round_to(dtype: str, total: np.ndarray) -> np.ndarray:
    if dtype == "bfloat16":
        return round_to_bfloat16(total)
    with np.errstate(over="ignore"):
        return total.astype(np.float16).astype(np.float32)


def _independent(exact: np.ndarray, absum: np.ndarray) -> np.ndarray:
    """True at the first element of each distinct (E, S) pair: repeats round the same way."""
    keep = np.zeros(exact.shape, bool)
    if exact.size:
        _, first = np.unique(np.stack([exact, absum], axis=1), axis=0, return_index=True)
        keep[first] = True
    return keep


def _variance_proxy(absum: np.ndarray, accum_steps: int, u: float, bound: ModeBound, absum_rms: float) -> np.ndarray:
    """Per element, the variance proxy of one mode's error under the model: (N - 1) terms of at most
    u S each (second order: times 1 + gamma_N), plus a kernel allowance a u (S + S_rms) where the
    mode has one."""
    growth = (1.0 + gamma(accum_steps, u)) ** 2
    terms = max(accum_steps - 1, 1) * growth * (u * absum) ** 2
    if bound.kernel_allowance:
        terms = terms + (bound.kernel_allowance * u * (absum + absum_rms)) ** 2
    return terms
