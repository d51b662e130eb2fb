"""Floating-point error bounds for accumulated sums (no framework, no numpy arrays).

Recursive summation of N terms x_1..x_N in a format with unit round-off u satisfies
(Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. 4.4)

    |fl(sum x_i) - sum x_i| <= gamma_{N-1} * sum |x_i|,   gamma_k = k*u / (1 - k*u).

The same holds for any summation order (a tree of depth <= N-1), so every correct accumulation
of the same micro-gradients is inside it. Floating-point addition stays exact under gradual
underflow, but flush-to-zero hardware may drop a subnormal result, so each rounding also gets an
absolute allowance of the smallest normal number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Unit round-off u (half an ulp of 1) and smallest positive normal number, per dtype name.
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
SMALLEST_NORMAL = {"float64": 2.0**-1022, "float32": 2.0**-126, "bfloat16": 2.0**-126, "float16": 2.0**-14}

# torch.testing's float32 defaults, shown beside our verdicts for contrast.
CLASSIC_TOLERANCES = {
    "float64": (1e-7, 1e-7),
    "float32": (1.3e-6, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "float16": (1e-3, 1e-5),
}


def gamma(k: int, u: float) -> float:
    """gamma_k = k*u/(1-k*u); infinite once k*u >= 1 (the worst-case bound says nothing then)."""
    if k <= 0:
        return 0.0
    ku = k * u
    return ku / (1.0 - ku) if ku < 1.0 else math.inf


@dataclass(frozen=True)
class ModeBound:
    """Per-element bound for one accumulation mode:

        |mode_i - E_i| <= relative * S_i + absolute + tensor * S_rms

    ``roundings`` = N - 1 for a running sum; ``relative`` also covers the float64 error of E itself
    (gamma_{N-1} in double precision). ``kernel_allowance`` (in units of u) is for a mode whose
    micro-gradients come from other kernels than E's: MXNet's ``grad_req='add'`` backward writes
    into the running total (kAddTo), summing a micro-step's inner terms (per-token rows of an
    embedding, say) straight into it, so it may round differently at the scale of those terms.
    It adds c*u*(S_i + S_rms), S_rms being the root-mean-square of S over the tensor.
    """

    dtype: str
    roundings: int
    relative: float
    absolute: float
    kernel_allowance: float = 0.0
    tensor: float = 0.0

    @classmethod
    def for_sum(cls, dtype: str, accum_steps: int, kernel_allowance: float = 0.0) -> "ModeBound":
        if dtype not in UNIT_ROUNDOFF:
            raise ValueError(f"no unit round-off known for dtype {dtype!r}")
        u = UNIT_ROUNDOFF[dtype]
        k = max(accum_steps - 1, 0)
        relative = gamma(k, u) + gamma(k, UNIT_ROUNDOFF["float64"]) + kernel_allowance * u
        return cls(dtype, k, relative, k * SMALLEST_NORMAL[dtype], kernel_allowance, kernel_allowance * u)

    @classmethod
    def for_stages(cls, stages: list[tuple[str, int]]) -> "ModeBound":
        """A sum computed in stages, such as a data-parallel gradient: each rank sums its N
        micro-gradients (N-1 roundings), then an all-reduce sums the ranks' totals (W-1 roundings
        in the reduce dtype, one more to cast into it, one more to divide by W unless W is a power
        of two). ``stages`` lists (dtype, roundings) for each stage; every term goes through each.

        A term's relative error is then at most prod(1 + gamma_{k_d}(u_d)) - 1 over the dtypes d,
        k_d being the roundings spent in d (Higham, Lemma 3.3: (1+gamma_j)(1+gamma_k) <= 1+gamma_{j+k}).
        The bound's dtype is the first stage's."""
        per_dtype: dict[str, int] = {}
        for dtype, roundings in stages:
            if dtype not in UNIT_ROUNDOFF:
                raise ValueError(f"no unit round-off known for dtype {dtype!r}")
            per_dtype[dtype] = per_dtype.get(dtype, 0) + max(roundings, 0)
        growth = 1.0
        for dtype, k in per_dtype.items():
            growth *= 1.0 + gamma(k, UNIT_ROUNDOFF[dtype])
        total = sum(per_dtype.values())
        relative = growth - 1.0 + gamma(total, UNIT_ROUNDOFF["float64"])
        absolute = sum(k * SMALLEST_NORMAL[d] for d, k in per_dtype.items())
        return cls(stages[0][0], total, relative, absolute)

    def plus(self, other: "ModeBound") -> "ModeBound":
        """The bound on the difference of two sums, each within its own bound of the same E:
        the two bounds added (the first one's dtype)."""
        return ModeBound(self.dtype, 0, self.relative + other.relative, self.absolute + other.absolute,
                         tensor=self.tensor + other.tensor)

    def floor(self, absum_rms: float) -> float:
        """The absolute part of the bound, for a tensor whose S has root-mean-square ``absum_rms``."""
        return self.absolute + self.tensor * absum_rms

    def at(self, absum: float, absum_rms: float = 0.0) -> float:
        """The bound for one element whose sum of absolute micro-gradients is ``absum``."""
        return self.relative * absum + self.floor(absum_rms)
