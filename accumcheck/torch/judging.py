"""Judging where the gradients are: the per-tensor reduction (``accumcheck.judge.kernel``'s
figures) in torch operations on the tensors' own device, and host arrays copied only when a figure
needs them.

On a GPU the four arrays of a run never leave it to be judged: each tensor is reduced in slices of
at most ``SLICE`` elements (float64 temporaries of a bounded size), the slices' scalars stay on the
device, and one transfer per tensor brings back a few dozen numbers. Every figure is the one the
host kernel computes, bit for bit, but the sums' last bits (torch sums in its own order).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from ..judge.kernel import Reduction, combine
from .casemodel import to_numpy

SLICE = 1 << 24  # elements reduced at once: a few float64 temporaries of 128 MiB at most
_BITS = {torch.float32: (torch.int32, -(2 ** 31)), torch.float64: (torch.int64, -(2 ** 63))}


def judged_on_device(device: Any) -> bool:
    """Whether a run on ``device`` is judged there: on a GPU, yes; on the CPU the compiled host
    kernel is faster (``benchmarks/bench_core.py`` measures both)."""
    return torch.device(device).type != "cpu"


def _ordered(bits: torch.Tensor, low: int) -> torch.Tensor:
    """Bit patterns on a monotonic integer line: negative floats mirrored below zero (int64)."""
    wide = bits.to(torch.int64)
    return torch.where(wide < 0, low - wide, wide)


def _first_max(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest value of a non-empty slice and the first index holding it (argmax: its first)."""
    return values.max(), values.argmax()


def _reduce_slice(a: torch.Tensor, b: torch.Tensor, e: torch.Tensor, s: torch.Tensor, rel_a: float, abs_a: float,
                  rel_b: float, abs_b: float, rtol: float, atol: float) -> tuple[torch.Tensor, ...]:
    """One slice's counts, maxima, their indices and sums, as device tensors (kernel's columns)."""
    x, y = a.to(torch.float64), b.to(torch.float64)
    fx, fy, fe = torch.isfinite(x), torch.isfinite(y), torch.isfinite(e)
    finite = fx & fy & fe
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    both_nan = torch.isnan(x) & torch.isnan(y)
    differ = finite & (x != y)
    mismatched = differ.sum() + (~finite & ~((x == y) | both_nan)).sum()
    da = torch.where(finite, (x - e).abs(), zero)
    db = torch.where(finite, (y - e).abs(), zero)
    ef = torch.where(finite, e, zero)
    sf = torch.where(finite, s, zero)
    bound_a, bound_b = rel_a * sf + abs_a, rel_b * sf + abs_b
    ratio_a, index_a = _first_max(torch.where(da > 0, da / bound_a, zero))
    ratio_b, index_b = _first_max(torch.where(db > 0, db / bound_b, zero))
    d = torch.where(differ, (x - y).abs(), zero)
    ay = y.abs()
    max_diff, index_diff = _first_max(d)
    infinite = torch.full((), torch.inf, dtype=torch.float64, device=x.device)
    max_rel = torch.where(differ, torch.where(ay > 0, d / ay, infinite), zero).max()
    diff_ratio = torch.where(differ, d / (bound_a + bound_b), zero).max()
    bits, low = _BITS[a.dtype]
    oa, ob = _ordered(a.view(bits), low), _ordered(b.view(bits), low)
    same_sign = (oa >= 0) == (ob >= 0)
    # One sign: the exact integer gap; opposite signs: the float formula (cannot overflow).
    gap = torch.where(same_sign, (oa - torch.where(same_sign, ob, oa)).abs().to(torch.float64),
                      (oa.to(torch.float64) - ob.to(torch.float64)).abs())
    max_ulps = torch.where(differ, gap, zero).max()
    counts = torch.stack([(~fx).sum(), (~fy).sum(), (~fe).sum(), mismatched,
                          (differ & (d > atol + rtol * ay)).sum(), (da > bound_a).sum(), (db > bound_b).sum()])
    peaks = torch.stack([ef.abs().max(), da.max(), db.max(), ratio_a, ratio_b, max_diff, max_rel, max_ulps,
                         diff_ratio])
    where = torch.stack([index_diff, index_a, index_b])
    sums = torch.stack([sf.sum(), ef.abs().sum(), (ef * ef).sum(), (da * da).sum(), (db * db).sum(), (sf * sf).sum()])
    return counts, peaks, where, sums


def reduce_tensors(a: torch.Tensor, b: torch.Tensor, e: torch.Tensor, s: torch.Tensor, rel_a: float, abs_a: float,
                   rel_b: float, abs_b: float, rtol: float, atol: float) -> Reduction:
    """The Reduction of one tensor's A, B (any float dtype; float16 and bfloat16 judged as float32,
    as on the host), E and S (float64), on their device; one transfer to the host."""
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    e, s = e.detach().reshape(-1).to(torch.float64), s.detach().reshape(-1).to(torch.float64)
    if a.dtype not in _BITS:
        a = a.float()
    if b.dtype not in _BITS:
        b = b.float()
    if a.dtype != b.dtype:
        a, b = a.double(), b.double()
    if not a.numel():
        return combine(np.zeros((1, 7), np.int64), np.zeros((1, 9)), np.full((1, 3), -1), np.zeros((1, 6)))
    rows = []
    for lo in range(0, a.numel(), SLICE):
        hi = min(a.numel(), lo + SLICE)
        counts, peaks, where, sums = _reduce_slice(a[lo:hi], b[lo:hi], e[lo:hi], s[lo:hi], rel_a, abs_a, rel_b,
                                                   abs_b, rtol, atol)
        rows.append((counts, peaks, torch.where(peaks[[5, 3, 4]] > 0, where + lo, -1), sums))
    counts, peaks, where, sums = (torch.stack(column).cpu().numpy() for column in zip(*rows))
    return combine(counts, peaks, where, sums)


def reducer(native: torch.Tensor, manual: torch.Tensor, exact: torch.Tensor,
            absum: torch.Tensor) -> Callable[..., tuple[Reduction, Callable[[int], float]]]:
    """``accumcheck.judge.statistics``'s Reducer over one tensor's device arrays."""
    flat = absum.detach().reshape(-1)

    def reduce(rel_a: float, abs_a: float, rel_b: float, abs_b: float, rtol: float,
               atol: float) -> tuple[Reduction, Callable[[int], float]]:
        return (reduce_tensors(native, manual, exact, absum, rel_a, abs_a, rel_b, abs_b, rtol, atol),
                lambda index: float(flat[index]))

    return reduce


class HostCopy:
    """A device tensor that becomes a host array only when a figure reads it (``np.asarray``, or
    any numpy attribute); its shape and dtype are known without a copy."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()
        self.shape = tuple(self.tensor.shape)
        self.size = self.tensor.numel()
        self.ndim = self.tensor.dim()
        self._host: np.ndarray | None = None

    @property
    def dtype(self) -> np.dtype:
        judged = torch.float32 if self.tensor.dtype in (torch.bfloat16, torch.float16) else self.tensor.dtype
        return np.dtype(str(judged).removeprefix("torch."))

    def host(self) -> np.ndarray:
        if self._host is None:
            self._host = to_numpy(self.tensor)
        return self._host

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        host = self.host()
        return host if dtype is None else host.astype(dtype, copy=False)

    def __len__(self) -> int:
        return len(self.host())

    def __getitem__(self, index: Any) -> Any:
        return self.host()[index]

    def __getattr__(self, name: str) -> Any:  # astype, reshape, ravel, view, ...
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.host(), name)


def device_arrays(native: torch.Tensor, manual: torch.Tensor, exact: torch.Tensor,
                  absum: torch.Tensor) -> dict[str, Any]:
    """ParamAccumulation's array fields for a tensor judged on its device, and its reducer."""
    return dict(native=HostCopy(native), manual=HostCopy(manual), exact=HostCopy(exact), absum=HostCopy(absum),
                reducer=reducer(native, manual, exact, absum))
