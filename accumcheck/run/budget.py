"""``--memory-budget``: what the check holds beside the model, tensor by tensor, and the groups of
tensors that fit a budget.

Without a budget a run holds, for every tensor at once, the manual buffer and the float64 sums E
and S (and the micro-step's flat copy while it is added), and judges them all when the run ends:
about 28 bytes per float32 parameter beside the model. With one, the tensors (in canonical
order) are split into groups whose needs fit the budget, the N micro-steps run once per group with
buffers for that group's tensors only, and each group is judged and freed before the next runs.
The runs are deterministic, so every group sees the same micro-gradients; the judge's figures are
bit for bit those of a run without groups.

A tensor of ``n`` elements needs ``n`` times its bytes per element (``element_bytes``, and
``ALLOCATOR`` times that for the memory allocator's own growth) for as long as its group runs, and
while it is judged ``n * JUDGE_BYTES`` more for the judge's temporaries (one tensor at a time).
``FIXED_BYTES`` is kept back for accumcheck's own code and compiled kernels, loaded on the first
check (107 MB measured with PyTorch 2.13 on Linux). The
second pass of the judge, made only for flagged tensors and tensors whose two modes differ, and
MXNet's float64 oracle are not budgeted (docs/performance.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import AccumcheckError
from ..files import size_text
from ..options.values import byte_count

FIXED_BYTES = 128 * 2**20
# What a group holds, counted a quarter above what is live: glibc raises its mmap threshold to the
# largest block freed, so the buffers of later groups come from its heap, which grows past what is
# live (12% and more measured on groups of 1 MiB tensors).
ALLOCATOR = 1.25
# The judge's temporaries per element of the tensor being judged: the ratio map's S * S for its RMS
# (the map itself is one compiled pass); the kernel allocates nothing per element. 8.0
# measured (tests/unit/test_budget.py holds it to this).
JUDGE_BYTES = 12
# Parameters below float32 are also judged against float32's bound: the precision check's float64
# temporaries (ulps of E, each mode's error, its ratios). 81 measured.
PRECISION_JUDGE_BYTES = 96

@dataclass(frozen=True)
class TensorNeed:
    """What one tensor needs beside the model: ``held`` bytes while its group runs and is judged,
    ``judging`` bytes more while it is judged itself."""

    name: str
    held: int
    judging: int

    @property
    def alone(self) -> int:
        """Its group's needs were it alone in it."""
        return self.held + self.judging


def element_bytes(param_bytes: int, accum_bytes: int, step_bytes: int, host_bytes: int = 0) -> int:
    """Bytes per element a tensor's group holds: the manual buffer (``accum_bytes``), E and S
    (float64), the micro-step's flat copy (``step_bytes``), the micro-gradient kept from the
    backward pass until the step is added (``param_bytes``), and ``host_bytes`` of host copies
    where the arrays are judged from copies (a GPU, a dtype numpy lacks, a loss scale)."""
    return accum_bytes + 16 + step_bytes + param_bytes + host_bytes


def need(name: str, numel: int, per_element: int, reduced_precision: bool = False) -> TensorNeed:
    """A tensor of ``numel`` elements holding ``per_element`` bytes each (``element_bytes``);
    ``reduced_precision``: its parameters are below float32 (the judge's precision check)."""
    judging = PRECISION_JUDGE_BYTES if reduced_precision else JUDGE_BYTES
    return TensorNeed(name, math.ceil(numel * per_element * ALLOCATOR), numel * judging)


def minimum(needs: Sequence[TensorNeed]) -> int:
    """The smallest budget any grouping fits: the code's share and the largest tensor alone."""
    return FIXED_BYTES + max((n.alone for n in needs), default=0)


def plan(needs: Sequence[TensorNeed], budget: int | None, what: str = "--memory-budget") -> list[list[str]]:
    """The tensors in groups (canonical order kept) whose held bytes together and the largest one's
    judging bytes fit ``budget`` less FIXED_BYTES; one group without a budget. Raises
    AccumcheckError (one line, ``what`` names the option) where a single tensor does not fit."""
    if budget is None:
        return [[n.name for n in needs]]
    room = budget - FIXED_BYTES
    largest = max(needs, key=lambda n: n.alone, default=None)
    if largest is not None and largest.alone > room:
        least = minimum(needs)
        raise AccumcheckError(
            f"{what} {size_text(budget)}: tensor {largest.name} alone needs {size_text(largest.alone)} beside the "
            f"model, and {size_text(FIXED_BYTES)} is kept for accumcheck's own code; give at least {least} "
            f"({size_text(least)})")
    groups: list[list[str]] = []
    held = judging = 0
    for n in needs:
        if groups and held + n.held + max(judging, n.judging) <= room:
            groups[-1].append(n.name)
            held, judging = held + n.held, max(judging, n.judging)
        else:
            groups.append([n.name])
            held, judging = n.held, n.judging
    return groups


# What a budget cannot hold: each holds the whole model again beside the grouped runs.
UNBUDGETED = {
    "oracle": "the float64 oracle runs a float64 copy of the whole model",
    "full_batch": "the full-batch reference runs the whole model in float64",
    "world_size": "each data-parallel rank all-reduces every tensor at once",
    "grad_norms": "the per-layer norms read every tensor at once",
}


def checked_budget(value: Any, oracle: bool = False, full_batch: bool = False) -> int | None:
    """A user's-model check's ``memory_budget`` in bytes (None: none). Raises AccumcheckError for a
    value that is not a number of bytes, or with ``oracle`` or ``full_batch``."""
    if value is None:
        return None
    try:
        budget = byte_count(value)
    except ValueError as exc:
        raise AccumcheckError(f"check: memory_budget: {exc}") from None
    for name, given in (("oracle", oracle), ("full_batch", full_batch)):
        if given:
            raise AccumcheckError(f"check: memory_budget={value!r} cannot be combined with {name}=True "
                                  f"({UNBUDGETED[name]}, beyond any budget); drop one of the two")
    return budget


def budget_note(groups: int, budget: int | None) -> str:
    """How a report says it was judged in groups."""
    size = f" of {size_text(budget)}" if budget is not None else ""
    return f"judged in {groups} groups to stay within the memory budget{size}"
