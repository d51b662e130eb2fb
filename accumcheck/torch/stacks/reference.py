"""The window's reference gradient without the window at once: where a stack's loss is a mean over
the window's items, the window's gradient is the sum over its micro-batches of each one's own
mean loss's gradient weighted by its share of the window's items (mean_b x n_b / N), so it can be
computed micro-batch by micro-batch, accumulated in float64, with one micro-batch's activations.

Whether the loss is such a mean is not taken on trust: the micro-batches' item counts must be
known, no module may compute over the batch (BatchNorm in train mode), the loss may have no
additive terms of its own (a mixture of experts' router loss is computed over the batch), and a
probe of two of the window's rows says how the loss combines rows: their loss together must be
their losses weighted by their items (the labelled ones, or for a causal LM those predicted after
its shift), and unlike what a summed loss, a mean over rows or the other count would give.
Anything else, or a probe that cannot tell them apart, keeps the window as one batch. A run's
windows are probed until one decides; its finding (the count) holds for the later windows, whose
other conditions are checked at each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ...errors import AccumcheckError, first_line
from ...report.stack import JOINED, SPLIT
from ...run.usermodel import map_leaves
from ..userbatch import IGNORE_INDEX, labels_of
from .batches import join_padded

CHOICES = ("auto", "joined", "micro-batches")
# The probe's two rows together against their losses weighted by their items: a mean over items
# agrees to float64 round-off, or to float32's (~1e-7) where a model computes a norm in float32
# whatever its dtype (Llama's RMSNorm); 1e-6 of the losses' scale allows both.
PROBE_TOLERANCE = 1e-6
# What the other readings of the loss (summed, a mean over rows, the other count) would give must
# stand this far from the mean over items, else the probe cannot tell them apart: 100 x the tolerance.
PROBE_MARGIN = 1e-4
# The pairs of rows probed before a probe that cannot tell the readings apart gives up (joined).
PROBE_PAIRS = 3

Gradients = dict[str, np.ndarray]


@dataclass(frozen=True)
class ReferencePlan:
    """How a window's reference is computed: ``split`` (micro-batch by micro-batch, each one's own
    loss's gradient times ``weights[b]``) or the window as one batch; ``note`` says why, or how."""

    split: bool
    note: str
    weights: tuple[float, ...] = ()
    # not split because the probe could not tell two readings of the loss apart on this window's rows
    # (a fresh model's rows lose about alike): another window may decide
    undecided: bool = False
    # split: the count the loss was shown to be a mean over ("labelled items", "predicted labels")
    count: str = ""

    @property
    def reference(self) -> str:
        return SPLIT if self.split else JOINED


def reference_choice(value: Any, who: str) -> str:
    """``value`` checked as a stack check's ``reference`` keyword."""
    if value not in CHOICES:
        raise AccumcheckError(f"{who}: reference must be one of {', '.join(map(repr, CHOICES))}, got {value!r}")
    return value


def reference_keyword(choice: str) -> str:
    """``choice`` as a reproduce line writes it: nothing for the default."""
    return "" if choice == "auto" else f", reference={choice!r}"


def plan_reference(choice: str, module: torch.nn.Module, batches: list[Any], labelled: bool,
                   window_loss: Callable[[Any, Any], Any], join_window: Callable[[list[Any]], Any],
                   by_design: list[str], probed: str = "") -> ReferencePlan:
    """The window's reference: micro-batch by micro-batch where ``choice`` allows it and the loss is
    shown to be a mean over the window's items, else the window as one batch. With ``choice``
    "micro-batches", a window that cannot be split raises AccumcheckError (one micro-batch is its
    own window, and never raises). ``probed``: the count an earlier window of the same run showed
    its loss to be a mean over (``ReferencePlan.count``); the loss is the same function in every
    window, so this one is not probed again (the rest is checked as ever: its counts, its rows,
    the modules that compute over the batch)."""
    if choice == "joined":
        return ReferencePlan(False, "reference='joined' asked")
    if len(batches) < 2:
        return ReferencePlan(False, "one micro-batch")
    why = _split_plan(module, batches, labelled, window_loss, join_window, by_design, probed)
    if isinstance(why, ReferencePlan) and why.split:
        return why
    undecided = isinstance(why, ReferencePlan)
    why = why.note if isinstance(why, ReferencePlan) else why
    if choice == "micro-batches":
        raise AccumcheckError(f"stack check: reference='micro-batches', but this window's loss cannot be computed "
                              f"micro-batch by micro-batch: {why}; use reference='auto' (the window as one batch "
                              "where it cannot be split)")
    return ReferencePlan(False, why, undecided=undecided)


def _split_plan(module: torch.nn.Module, batches: list[Any], labelled: bool, window_loss: Callable[[Any, Any], Any],
                join_window: Callable[[list[Any]], Any], by_design: list[str], probed: str) -> ReferencePlan | str:
    """The split plan, or why the window's loss cannot be split (a sentence)."""
    if by_design:
        return f"{by_design[0]} computes over the batch"
    if join_window is not join_padded:
        return "the micro-batches are joined by the stack's own rule (preference pairs)"
    counts = _candidates(batches, labelled)
    if not counts:
        return "the micro-batches' item counts are unknown"
    if any(0 in c for c in counts.values()):
        return "a micro-batch has no labelled item"
    rows = [_rows(b) for b in batches]
    if None in rows or not all(rows):
        return "the micro-batches' tensors share no batch dimension"
    row_counts = {name: [_row_counts(b, labelled, name) for b in batches] for name in counts}
    if any(r is None or len(r) != n for per in row_counts.values() for r, n in zip(per, rows)):
        return "the rows' item counts are unknown"
    if probed in counts:
        return _split(probed, counts[probed])
    why: str | ReferencePlan = "no two rows to probe"
    for a, b in _probe_pairs(row_counts[next(iter(counts))]):
        found = _probe(a, b, module, batches, window_loss, join_window, counts, row_counts, rows)
        if not isinstance(found, tuple):
            return found  # the loss is no mean over the items, or cannot be probed
        name, undecided = found
        if not undecided:
            return _split(name, counts[name])
        why = ReferencePlan(False, undecided, undecided=True)
    return why


def _split(name: str, counts: list[int]) -> ReferencePlan:
    """The plan of a loss that is a mean over its ``name``: each micro-batch weighted by its share."""
    total = sum(counts)
    return ReferencePlan(True, f"each micro-batch's own loss weighted by its share of the window's {name}, "
                               "summed in float64", tuple(c / total for c in counts), count=name)


def _probe(a: tuple[int, int], b: tuple[int, int], module: Any, batches: list[Any],
           window_loss: Callable[[Any, Any], Any], join_window: Callable[[list[Any]], Any],
           counts: dict[str, list[int]], row_counts: dict[str, list[list[int]]],
           rows: list[int]) -> str | tuple[str, str]:
    """Rows ``a`` and ``b`` (micro-batch, row) alone and together: a sentence where the loss is
    not a mean over the items; else (the count it is a mean over, "") where nothing else the loss
    might be gives their loss together, or (that count, why not decided) where something does."""
    try:
        with torch.enable_grad():
            (la, ta), (lb, tb) = (_value(window_loss, module, join_window([_row(batches[m], i)])) for m, i in (a, b))
            pair, tp = _value(window_loss, module, join_window([_row(batches[a[0]], a[1]), _row(batches[b[0]], b[1])]))
    except Exception as exc:  # noqa: BLE001  (a loss that fails on a row or two: the window as one batch)
        return f"its loss could not be computed on two rows ({type(exc).__name__}: {first_line(exc)})"
    if ta or tb or tp:
        return f"the loss has additive terms of its own ({', '.join(ta or tb or tp)}), computed over the batch"
    values = np.array([la, lb, pair])
    scale = float(np.max(np.abs(values)))
    if not np.all(np.isfinite(values)) or scale == 0:
        return "the probe's losses are zero or not finite"
    predicted = {name: _mean(c[a[0]][a[1]], c[b[0]][b[1]], la, lb) for name, c in row_counts.items()}
    found = next((name for name, p in predicted.items() if abs(pair - p) <= PROBE_TOLERANCE * scale), None)
    if found is None:
        return "the loss of two rows together is not their losses weighted by their items (a summed loss, a mean " \
               "over rows, or a loss that couples the rows)"
    chosen = counts[found]
    rivals = {"a summed loss": la + lb}
    if not _same_weights(chosen, list(rows)):
        rivals["a mean over rows"] = (la + lb) / 2
    rivals.update({f"a mean over {name}": p for name, p in predicted.items()
                   if not _same_weights(chosen, counts[name])})
    close = [what for what, p in rivals.items() if abs(p - predicted[found]) <= PROBE_MARGIN * scale]
    return found, f"the rows probed cannot tell a mean over {found} from {close[0]}" if close else ""


def weighted_sum(each: list[Gradients], weights: tuple[float, ...]) -> Gradients:
    """sum_b weights[b] x each[b], in float64: the window's gradient from its micro-batches' own."""
    total: Gradients = {}
    for w, gradient in zip(weights, each):
        add_gradients(total, {name: w * g for name, g in gradient.items()})
    return total


def add_gradients(total: Gradients, gradient: Gradients) -> None:
    for name, g in gradient.items():
        total[name] = total[name] + g if name in total else g.copy()


def weighted_absum(absolute: list[Gradients], counts: list[int] | None) -> Gradients:
    """The sum over the window's micro-batches of |each one's gradient| under the window's
    normalisation (its own mean loss's weighted by its share of the window's items, or 1/k), the
    scale of the round-off of any sum of them."""
    total = sum(counts) if counts else 0
    weights = [c / total for c in counts] if total else [1.0 / len(absolute)] * len(absolute)
    return weighted_sum(absolute, tuple(weights))


def _value(window_loss: Callable[[Any, Any], Any], module: Any, batch: Any) -> tuple[float, list[str]]:
    """The loss of ``batch`` as a number (its graph dropped), and the names of its additive terms."""
    found = window_loss(module, batch)
    loss, terms = found if isinstance(found, tuple) else (found, {})
    named = [name for name, t in terms.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    return float(loss.detach()), named


def _mean(ca: int, cb: int, la: float, lb: float) -> float:
    return (ca * la + cb * lb) / (ca + cb) if ca + cb else float("nan")


def _same_weights(one: list[int], other: list[int]) -> bool:
    """Whether two counts of the micro-batches give them the same shares of the window."""
    a, b = sum(one), sum(other)
    return all(x * b == y * a for x, y in zip(one, other))


def _candidates(batches: list[Any], labelled: bool) -> dict[str, list[int]]:
    """The counts a mean loss may divide each micro-batch by: its labelled items, and for a causal
    LM's 2-D ``labels`` those it predicts after its shift."""
    found = {}
    labels = [labels_of(b, labelled) for b in batches]
    if all(t is not None for t in labels):
        found["labelled items"] = [int((t != IGNORE_INDEX).sum()) for t in labels]
        if all(t.dim() == 2 for t in labels):
            found["predicted labels"] = [int((t[:, 1:] != IGNORE_INDEX).sum()) for t in labels]
    return found


def _row_counts(batch: Any, labelled: bool, name: str) -> list[int] | None:
    """Each row's count of the kind ``name`` (``_candidates``)."""
    labels = labels_of(batch, labelled)
    if labels is None:
        return None
    kept = labels[:, 1:] if name == "predicted labels" else labels
    return [int(n) for n in (kept != IGNORE_INDEX).reshape(labels.shape[0], -1).sum(1)]


def _rows(batch: Any) -> int | None:
    """The batch's rows: the one first dimension all its tensors share, or None."""
    sizes: set[int] = set()
    map_leaves(batch, lambda t: sizes.add(t.shape[0]) if isinstance(t, torch.Tensor) and t.dim() else None)
    return sizes.pop() if len(sizes) == 1 else None


def _row(batch: Any, i: int) -> Any:
    return map_leaves(batch, lambda t: t[i:i + 1] if isinstance(t, torch.Tensor) and t.dim() else t)


def _probe_pairs(counts: list[list[int]]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Up to PROBE_PAIRS pairs of rows (micro-batch, row) with items, each as far apart in items as
    the window has: the fewest with the most, the next fewest with the next most; where all rows
    count alike, the first rows of consecutive micro-batches."""
    rows = sorted((c, m, i) for m, per in enumerate(counts) for i, c in enumerate(per) if c > 0)
    if not rows:
        return []
    if rows[0][0] == rows[-1][0]:
        firsts = [next(r for r in rows if r[1] == m) for m in sorted({r[1] for r in rows})]
        ends = list(zip(firsts, firsts[1:]))
    else:
        ends = [(rows[k], rows[-1 - k]) for k in range(len(rows) // 2) if rows[k][0] != rows[-1 - k][0]]
    return [((lo[1], lo[2]), (hi[1], hi[2])) for lo, hi in ends[:PROBE_PAIRS]]
