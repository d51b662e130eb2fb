"""A built-in case as a training stack meets a model: a module that computes its own loss from
``input_ids`` and ``labels`` (as Hugging Face models do), and the case's micro-batches as dicts."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ...case.definition import Case
from ...errors import AccumcheckError
from ..casemodel import build_model
from ..userbatch import IGNORE_INDEX, item_count

FAULTS = ("micro-batch-mean", "loss-over-n")
# faults of one rank of a data-parallel run: its loss doubled, one of its micro-batches never backwarded
RANK_FAULTS = ("rank-loss-scaled", "rank-drops-micro-batch")


class CaseLM(torch.nn.Module):
    """The case's network with a token-level cross-entropy over the labelled positions, divided
    by ``num_items_in_batch`` (the window's labelled tokens) where the stack passes it, else by the
    micro-batch's own count. ``fault`` breaks it on purpose: "micro-batch-mean" ignores the
    window's count while still taking it (every micro-batch's own mean, which a Trainer no longer
    divides by N: transformers#47688), "loss-over-n" divides the loss by N once more."""

    accepts_loss_kwargs = True  # tells Hugging Face's Trainer to pass num_items_in_batch
    def __init__(self, case: Case, accum_steps: int, fault: str | None = None) -> None:
        super().__init__()
        if fault is not None and fault not in FAULTS:
            raise AccumcheckError(f"--fault {fault}: not a fault of a training stack's case; use one of "
                                  f"{', '.join(FAULTS)}")
        if case.input.kind != "tokens":
            raise AccumcheckError(f"--case {case.name}: a training stack runs token cases (input ids and labels); "
                                  "use padded-tokens or embed-attention")
        self.net = build_model(case, case.weights(), torch.float32, torch.device("cpu"))
        self.accum_steps, self.fault = accum_steps, fault

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                num_items_in_batch: Any = None) -> dict[str, torch.Tensor]:
        logits = self.net(input_ids)
        out = {"logits": logits}
        if labels is None:
            return out
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                                reduction="sum")
        items = num_items_in_batch if num_items_in_batch is not None and self.fault != "micro-batch-mean" \
            else (labels != IGNORE_INDEX).sum()
        loss = total / items
        out["loss"] = loss / self.accum_steps if self.fault == "loss-over-n" else loss
        return out


def case_batches(case: Case, count: int) -> list[dict[str, torch.Tensor]]:
    """The case's first ``count`` micro-batches as ``{"input_ids", "labels"}``."""
    batches = []
    for k in range(count):
        b = case.batch(k)
        batches.append({"input_ids": torch.from_numpy(b.inputs), "labels": torch.from_numpy(b.labels)})
    return batches


def case_examples(case: Case, count: int) -> list[dict[str, torch.Tensor]]:
    """The same micro-batches as one example (row) each, for a stack that collates them itself."""
    return [{"input_ids": b["input_ids"][i], "labels": b["labels"][i]} for b in case_batches(case, count)
            for i in range(b["input_ids"].shape[0])]


def window_items(micro_batches: list[dict[str, torch.Tensor]], accum_steps: int) -> list[int]:
    """For each micro-batch, the labelled tokens of its window (N consecutive micro-batches, the
    last window what is left): what a loop normalising by the window's tokens divides by."""
    counts = [item_count(b, False) for b in micro_batches]
    return [sum(counts[i - i % accum_steps:i - i % accum_steps + accum_steps]) for i in range(len(counts))]
