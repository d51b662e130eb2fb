"""Cross-framework agreement: the same case, weights and data in two frameworks.

The frameworks compute each micro-gradient with different kernels, so their float32 manual sums
B_a and B_b differ by more than accumulation round-off. Each framework also runs the whole model
in float64 (O_a, O_b), which measures its own float32 error e_f = |B_f - O_f| (kernels and
accumulation together). If the two compute the same function of the same weights and data,

    |B_a - B_b| <= e_a + e_b + |O_a - O_b|,   and   |O_a - O_b| <= c * u32 * (S + S_rms,tensor + S_rms,model)

where the second term allows the frameworks' float64 kernels to differ at float32 level (MXNet's
float64 GELU uses a float32-accurate erf). c = FLOAT64_KERNEL_ALLOWANCE, well above the largest
value measured on the built-in cases (docs/frameworks.md). A tensor past that bound was computed
from a different function, weights or data: it "disagrees".

With three or more frameworks every pair is compared, and ``odd_one_out`` says, tensor by tensor,
which framework (if any) disagrees with every other while the others all agree among themselves.
"""

from __future__ import annotations

import numpy as np

from ..bounds import UNIT_ROUNDOFF
from ..report import Agreement, ForwardAgreement, OddOneOut
from ..run.results import RunResult
from .ratio import ratios_to, unravel

FLOAT64_KERNEL_ALLOWANCE = 16.0


def ordered_bits(values: np.ndarray) -> np.ndarray:
    """float32 bit patterns mapped onto a monotonic integer line (for ulp distances)."""
    bits = np.ascontiguousarray(values, np.float32).view(np.int32).astype(np.int64)
    return np.where(bits < 0, np.int64(-(2**31)) - bits, bits)


def agreement(run_a: RunResult, run_b: RunResult, pair: list[str] | None = None) -> list[Agreement]:
    """Compare the manual sums of two runs of the same case (both run with the float64 oracle);
    each record labelled with ``pair``, the two frameworks' names."""
    u = UNIT_ROUNDOFF["float32"]
    b_params = {p.name: p for p in run_b.params}
    scales = np.concatenate([np.maximum(p.absum, b_params[p.name].absum).ravel() for p in run_a.params])
    model_rms = float(np.sqrt(np.mean(scales**2))) if scales.size else 0.0
    results = []
    for pa in run_a.params:
        pb = b_params[pa.name]
        if pa.oracle is None or pb.oracle is None:
            raise ValueError("agreement needs both runs made with the float64 oracle")
        ba, bb = pa.manual.astype(np.float64), pb.manual.astype(np.float64)
        shape = list(pa.manual.shape)
        diff = np.abs(ba - bb)
        s = np.maximum(pa.absum, pb.absum)
        err_a, err_b = np.abs(ba - pa.oracle), np.abs(bb - pb.oracle)
        floor = FLOAT64_KERNEL_ALLOWANCE * u * (s + float(np.sqrt(np.mean(s**2))) + model_rms)
        bound = err_a + err_b + np.maximum(floor, np.finfo(np.float64).tiny)
        ratio = ratios_to(diff, bound)
        worst = int(np.argmax(ratio)) if ratio.size else -1
        biggest = int(np.argmax(diff)) if diff.size else -1
        if not (np.isfinite(ba).all() and np.isfinite(bb).all()):
            verdict = "non-finite"
        elif not diff.any():
            verdict = "identical"
        else:
            verdict = "agree" if ratio.max() <= 1.0 else "disagree"
        results.append(Agreement(
            name=pa.name, kind=pa.kind, shape=shape, verdict=verdict,
            max_abs_diff=float(diff.max(initial=0.0)), max_abs_diff_index=unravel(biggest, shape),
            max_ulps=float(np.abs(ordered_bits(pa.manual) - ordered_bits(pb.manual)).max(initial=0)),
            ratio=float(ratio.max(initial=0.0)), worst_index=unravel(worst, shape),
            bound_at_worst=float(bound.reshape(-1)[worst]) if worst >= 0 else 0.0,
            float32_err_a=float(err_a.max(initial=0.0)), float32_err_b=float(err_b.max(initial=0.0)),
            frameworks=None if pair is None else list(pair)))
    return results


def odd_one_out(frameworks: list[str], records: list[Agreement]) -> list[OddOneOut]:
    """For each tensor some pair of three or more frameworks disagrees on (``records``: every
    pair's agreement, labelled): the framework that disagrees with every other while all the
    others agree among themselves, or None when the disagreements single out no one. Two
    frameworks single out no one, and get no records."""
    if len(frameworks) < 3:
        return []
    by_tensor: dict[str, list[Agreement]] = {}
    for record in records:
        by_tensor.setdefault(record.name, []).append(record)
    found = []
    for name, compared in by_tensor.items():
        flagged = [a for a in compared if a.flagged]
        if not flagged:
            continue
        disagreeing = {frozenset(a.frameworks or ()) for a in flagged}
        odd = [f for f in frameworks if disagreeing == {frozenset((f, g)) for g in frameworks if g != f}]
        found.append(OddOneOut(name=name, kind=flagged[0].kind, framework=odd[0] if len(odd) == 1 else None,
                               disagreeing=[list(a.frameworks or ()) for a in flagged],
                               ratio=max(a.ratio for a in flagged)))
    return found


def forward_agreement(run_a: RunResult, run_b: RunResult, pair: list[str] | None = None) -> ForwardAgreement | None:
    """How closely the frameworks' logits for micro-batch 0 agree (None when either has none),
    labelled with ``pair``, the two frameworks' names."""
    la, lb = run_a.first_logits, run_b.first_logits
    if la is None or lb is None:
        return None
    diff = np.abs(la.astype(np.float64) - lb)
    scale = float(np.abs(la).max(initial=0.0))
    biggest = int(np.argmax(diff))
    return ForwardAgreement(
        max_abs_diff=float(diff.max()), max_abs_logit=scale, relative=float(diff.max() / scale) if scale else 0.0,
        in_float32_units=float(diff.max() / (scale * UNIT_ROUNDOFF["float32"])) if scale else 0.0,
        index=unravel(biggest, list(la.shape)), frameworks=None if pair is None else list(pair))
