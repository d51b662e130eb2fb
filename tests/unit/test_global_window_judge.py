"""A data-parallel step judged against its global window, on plain numpy arrays: each rank's
micro-batches weighted by its own item count (transformers#34242), a rank that scales its loss
alone, a micro-batch whose backward never reached the step, and a step below float64 against
the round-off of its dtypes. Each finding has its correct setup beside it, which must not be
flagged."""

import numpy as np
import pytest

from accumcheck.judge import FACTOR_TOLERANCE
from accumcheck.judge.stack import judge_window, precision_fit
from accumcheck.run.results import Hypotheses, StackWindow, StepPrecision

RNG = np.random.default_rng(11)
SHAPES = {"embed.weight": (6, 4), "fc.weight": (4, 4), "fc.bias": (4,)}
W, K = 2, 4  # ranks, micro-batches per rank
ITEMS = [5, 9, 3, 7, 8, 2, 6, 1]  # the window's micro-batches i x W + r
# each micro-batch's own gradient, normalised over its own items
OWN = [{n: RNG.standard_normal(s) for n, s in SHAPES.items()} for _ in ITEMS]


def weighted(weights):
    return {n: sum(w * g[n] for w, g in zip(weights, OWN)) for n in SHAPES}


TOTAL = sum(ITEMS)
WINDOW = weighted([n / TOTAL for n in ITEMS])  # one batch: each micro-batch by its share of the items
RANK_ITEMS = [sum(ITEMS[r::W]) for r in range(W)]
# each rank's micro-batches as a batch of their own
RANK_WINDOWS = [weighted([n / RANK_ITEMS[r] if i % W == r else 0.0 for i, n in enumerate(ITEMS)]) for r in range(W)]


def window(applied, **extra) -> StackWindow:
    h = Hypotheses(micro_sum=weighted([1.0] * len(ITEMS)), rank_windows=RANK_WINDOWS, micro_batches=OWN)
    return StackWindow(step=0, micro_batches=list(range(len(ITEMS))), applied=applied, window=WINDOW,
                       item_counts=ITEMS, hypotheses=h, world_size=W, **extra)


def test_the_global_window_applied_is_faithful_and_nothing_else_is_claimed():
    step = judge_window(window(WINDOW), K)
    assert step.result.equivalent and step.result.explanation.startswith("equivalent")


def test_each_rank_normalising_over_its_own_items_is_transformers_34242():
    # DDP averages the ranks: (1/W) x each rank's own window
    step = judge_window(window({n: sum(g[n] for g in RANK_WINDOWS) / W for n in SHAPES}), K)
    assert not step.result.equivalent
    assert "transformers#34242" in step.result.explanation
    assert step.result.rank_factors == pytest.approx([1 / W] * W, abs=FACTOR_TOLERANCE)
    assert f"{TOTAL} items" in step.result.explanation


def test_one_rank_scaling_its_loss_alone_is_named_by_rank_and_factor():
    weights = [n / TOTAL * (2.0 if i % W == 1 else 1.0) for i, n in enumerate(ITEMS)]
    step = judge_window(window(weighted(weights)), K)
    assert "rank 1 2.00 x" in step.result.explanation and "34242" not in step.result.explanation


def test_a_micro_batch_that_never_reached_the_step_is_named_with_its_rank():
    weights = [0.0 if i == 5 else n / TOTAL for i, n in enumerate(ITEMS)]
    step = judge_window(window(weighted(weights)), K)
    assert not step.result.equivalent
    assert "without micro-batch 5 (rank 1) of its 8" in step.result.explanation
    two = [0.0 if i in (2, 3) else n / TOTAL for i, n in enumerate(ITEMS)]
    assert "without micro-batches 2 (rank 0), 3 (rank 1)" in judge_window(window(weighted(two)), K).result.explanation


def test_a_window_weighted_otherwise_is_not_called_a_dropped_micro_batch():
    # every micro-batch at its share but one at half of it: nobody's backward was lost
    weights = [n / TOTAL * (0.5 if i == 5 else 1.0) for i, n in enumerate(ITEMS)]
    assert "never reached" not in judge_window(window(weighted(weights)), K).result.explanation


def test_float32_sums_are_within_their_bound_and_bfloat16_reduction_is_named_as_lost_there():
    absum = weighted([n / TOTAL for n in ITEMS])
    absum = {n: np.abs(g) * 3 for n, g in absum.items()}  # a scale S above |F|
    scale = np.sqrt(sum(float(np.sum(g * g)) for g in absum.values()))
    direction = {n: RNG.standard_normal(s) for n, s in SHAPES.items()}
    norm = np.sqrt(sum(float(np.sum(g * g)) for g in direction.values()))

    def off(relative):  # A = F + an error of |A - F| = relative x |S|
        return {n: WINDOW[n] + direction[n] / norm * relative * scale for n in SHAPES}

    float32 = StepPrecision(accumulation="float32", reduction="float32", computed="float32")
    bf16 = StepPrecision(accumulation="float32", reduction="bfloat16", computed="float32")
    fine = precision_fit(window(off(1e-7), precision=float32, absum=absum), K)
    assert fine.error == pytest.approx(1e-7) and fine.error <= fine.float32_bound and fine.lost_in == ""
    lost = precision_fit(window(off(2e-3), precision=bf16, absum=absum), K)
    assert lost.float32_bound < lost.error <= lost.bound and lost.lost_in == "the reduction"
    step = judge_window(window(off(2e-3), precision=bf16, absum=absum), K)
    assert step.precision is not None and "precision lost in the reduction" in step.result.explanation
    beyond = judge_window(window(off(0.5), precision=bf16, absum=absum), K)
    assert "precision lost" not in beyond.result.explanation  # past every bound: not round-off
