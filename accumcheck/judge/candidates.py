"""The run's own numbers a constant factor between the applied and the full-batch gradient may
equal (N, the world size, a process's contexts, the item counts), each with what it means."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """A number of the run that a constant factor may equal, and what it means when it does."""

    name: str
    value: float
    where: str  # the run's figures, e.g. "N = 4"
    reason: str



def factor_candidates(accum_steps: int, world_size: int = 1, item_counts: list[int] | None = None,
                      micro_batches: int | None = None, predicted_counts: list[int] | None = None,
                      contexts: int = 1) -> list[Candidate]:
    """The run's numbers a constant factor may be, most common first (a value of 1 says nothing).
    ``predicted_counts`` are the labels a causal language model predicts per micro-batch (after
    its shift, which drops each sequence's first label), where they differ from ``item_counts``.
    ``contexts``: the devices each micro-batch is split across in one process (Gluon contexts,
    whose gradients a kvstore sums), not ranks of their own."""
    n, w, k = accum_steps, world_size, micro_batches
    ns = f"N = {n}"
    short = f"k = {k} micro-batches in a window of N = {n}"  # a window shorter than N, the run's last
    found = [Candidate("k/N", k / n, short, "the short window's losses are divided by N, not by the k micro-batches "
                       "it holds"),
             Candidate("k", k, short, "the short window's micro-batch losses are summed without dividing by k")
             ] if k is not None and k != n else []
    found += [Candidate("N", n, ns, "the micro-batch losses are summed without dividing by N"),
              Candidate("1/N", 1 / n, ns, "the loss is divided by N once more than the loss normalisation needs"),
              Candidate("N^2", n * n, ns, "the loss is multiplied by N where the normalisation divides by N"),
              Candidate("1/N^2", 1 / (n * n), ns, "the loss is divided by N twice more than the loss normalisation "
                        "needs")]
    if w > 1:
        both = f"N = {n}, W = {w}"
        found += [Candidate("W", w, f"W = {w}", "the ranks' gradients are summed where the all-reduce averages them"),
                  Candidate("1/W", 1 / w, f"W = {w}", "the gradient is divided by the world size once more than the "
                            "all-reduce's average needs"),
                  Candidate("N*W", n * w, both, "the losses are summed over the micro-batches and the ranks without "
                            "dividing by either"),
                  Candidate("1/(N*W)", 1 / (n * w), both, "the loss is divided by N x W once more than the loss "
                            "normalisation needs")]
    if contexts > 1:
        on = f"C = {contexts} contexts"
        found += [Candidate("C", contexts, on, "trainer.step's batch_size counts one context's samples, where "
                            "the kvstore sums the gradients of every context"),
                  Candidate("1/C", 1 / contexts, on, "the loss is divided by the number of contexts, where "
                            "trainer.step's batch_size already counts every context's samples")]
    total = sum(item_counts or ())
    if total > 0:
        found += [Candidate("T", total, f"T = {total} items in the window", "the loss sums over the items where the "
                            "full batch averages over them"),
                  Candidate("1/T", 1 / total, f"T = {total} items in the window", "the loss is divided by the "
                            "window's item count where the full batch sums over the items"),
                  # the items of a micro-batch when all hold the same count (their mean otherwise)
                  Candidate("T/N", total / n, f"T = {total} items, N = {n}", "each micro-batch's loss sums over its "
                            "items and the accumulated sum is divided by N, where the full batch averages over the "
                            "items")]
        predicted = sum(predicted_counts or ())
        if predicted > 0:  # equal to the total: a factor of 1, left out below
            found.append(Candidate("predicted/labelled", predicted / total, f"{predicted} predicted of {total} "
                                   "labelled tokens", "the loss is divided by the labelled tokens counted before the "
                                   "causal shift, which leaves each sequence's first label out of the loss "
                                   "(transformers#46204)"))
    if total > 0 and min(item_counts) > 0:
        found.append(Candidate("largest/smallest items", max(item_counts) / min(item_counts),
                               f"items per micro-batch {min(item_counts)} to {max(item_counts)}",
                               "the largest micro-batch's item count over the smallest's"))
    return [c for c in found if c.value != 1]


def run_figures(accum_steps: int, world_size: int = 1, item_counts: list[int] | None = None,
                contexts: int = 1) -> str:
    """The numbers the candidates are made of, e.g. "N = 4, T = 183 items"."""
    return f"N = {accum_steps}" + (f", W = {world_size}" if world_size > 1 else "") + (
        f", {contexts} contexts" if contexts > 1 else "") + (f", T = {sum(item_counts)} items" if item_counts else "")
