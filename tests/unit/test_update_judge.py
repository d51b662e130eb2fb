"""The judge of what an optimizer step did (accumcheck.judge.update), on plain arrays: the update
against the optimizer applied once within the optimizer's round-off, the cause named where a
replayed cause matches, and each count that is not one per window named."""

from __future__ import annotations

import math

import numpy as np
import pytest

from accumcheck.bounds import UNIT_ROUNDOFF
from accumcheck.judge.update import UPDATE_ROUNDINGS, judge_update, update_error
from accumcheck.run.results import StepUpdate

P = {"w": np.array([1.0, -2.0, 0.5])}
ONCE = {"w": np.array([-1e-3, 1e-3, -1e-3])}
SCALE = {"w": np.abs(P["w"]) + np.abs(ONCE["w"])}


def update(applied, hypotheses=None, dtype="float32", **counts):
    return StepUpdate(applied=applied, expected=ONCE, scale=SCALE, dtype=dtype, hypotheses=hypotheses or {}, **counts)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_an_update_within_the_optimizers_round_off_is_one_update(dtype):
    room = UPDATE_ROUNDINGS * UNIT_ROUNDOFF[dtype] * SCALE["w"]
    result = judge_update(update({"w": ONCE["w"] + 0.9 * room}, dtype=dtype), 4)
    assert result.one_update and result.error == pytest.approx(0.9, rel=1e-3)


def test_an_update_beyond_it_is_named_by_the_cause_it_matches():
    decayed = {"w": ONCE["w"] - 3e-4 * P["w"]}
    result = judge_update(update(decayed, {"weight decay applied at every micro-step": decayed,
                                           "something else": ONCE}), 4)
    assert not result.one_update and result.matches == "weight decay applied at every micro-step"
    assert "it matches weight decay applied at every micro-step" in result.findings[0]


def test_an_update_no_cause_explains_says_so_and_names_what_was_tried():
    result = judge_update(update({"w": 2 * ONCE["w"]}, {"weight decay applied at every micro-step": ONCE}), 4)
    assert result.matches == "" and result.error > 1
    assert "nor weight decay applied at every micro-step" in result.findings[0]


def test_a_non_finite_update_is_beyond_any_round_off():
    assert math.isinf(update_error({"w": np.array([np.nan, 0.0, 0.0])}, ONCE, SCALE, "float32"))


def test_counts_beyond_one_per_window_are_each_named_and_one_each_is_not():
    fine = judge_update(StepUpdate(optimizer_steps=1, scheduler_steps=1, clip_calls=1), 4)
    assert fine.one_update and fine.error is None
    result = judge_update(StepUpdate(optimizer_steps=2, scheduler_steps=4, clip_calls=4, moved=["a", "b"],
                                     gradient_micro_batches=2), 1)
    text = " | ".join(result.findings)
    assert "the optimizer stepped 2 times in this window of 2 micro-batches" in text
    assert "the scheduler stepped 4 times in this window: the learning rate decays 4x too fast" in text
    assert "gradient clipping ran 4 times" in text and "2 parameter tensors (a, b) moved" in text
