"""Micro-batches as the stack fed them, joined into the window as one batch: sequences padded to
the longest, preference pairs kept paired; and the labels a causal LM predicts in a batch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...errors import AccumcheckError
from ..userbatch import IGNORE_INDEX, join


def predicted_count(batch: Any) -> int | None:
    """The labels of a Hugging Face batch a causal LM predicts: ``labels[..., 1:]`` that are not
    -100 (its loss shifts the labels by one, so each sequence's first label is never a target)."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if isinstance(labels, torch.Tensor) and not labels.is_floating_point() and labels.dim() == 2:
        return int((labels[:, 1:] != IGNORE_INDEX).sum())
    return None


def join_padded(batches: list[Any]) -> Any:
    """The micro-batches as one batch: mappings of sequences padded on the right to the longest
    (``labels`` with -100, which every loss here ignores, anything else with 0: an attention mask
    of 0 hides the padding), then concatenated along dim 0."""
    if all(isinstance(b, Mapping) for b in batches):
        width = {}
        for b in batches:
            for key, value in b.items():
                if isinstance(value, torch.Tensor) and value.dim() >= 2:
                    width[key] = max(width.get(key, 0), value.shape[1])
        batches = [{k: _pad(v, width[k], IGNORE_INDEX if k == "labels" else 0) if k in width else v
                    for k, v in b.items()} for b in batches]
    return join(batches, None)


def join_paired(batches: list[Any]) -> Any:
    """Preference micro-batches (TRL's DPO collator: 2B rows, the B chosen sequences then the B
    rejected ones, which the loss pairs by halves) as one batch whose halves stay paired: the
    chosen rows of every micro-batch, then their rejected rows, padded as ``join_padded`` pads;
    values of one row a pair (precomputed reference log-probabilities) concatenated."""
    chosen, rejected, per_pair = [], [], []
    for batch in batches:
        rows = batch["input_ids"].shape[0]
        if rows % 2:
            raise AccumcheckError(f"stack check: a preference micro-batch has {rows} rows, not a chosen and a rejected "
                                  "sequence per pair")
        halves = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows}
        chosen.append({k: v[:rows // 2] for k, v in halves.items()})
        rejected.append({k: v[rows // 2:] for k, v in halves.items()})
        per_pair.append({k: v for k, v in batch.items() if k not in halves})
    both = join_padded(chosen + rejected)
    rest = join(per_pair, None) if per_pair[0] else {}
    return {**rest, **both}


def _pad(value: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    if value.shape[1] == width:
        return value
    pad = value.new_full((value.shape[0], width - value.shape[1], *value.shape[2:]), fill)
    return torch.cat([value, pad], dim=1)
