"""accumcheck.run.faults: parsing and aiming a fault, what the injector adds at each micro-step, and
bfloat16 rounding, on hand-computed values."""

import math

import numpy as np
import pytest

from accumcheck.errors import AccumcheckError
from accumcheck.run.faults import SCALE_FACTOR, Fault, FaultInjector, parse_fault, resolve_fault, round_to_bfloat16

F32 = np.float32
PARAMS = [("norm.gamma", "norm"), ("embed.weight", "embedding"), ("fc.weight", "weight"), ("fc.bias", "bias")]


def test_parse_kind_and_optional_parameter():
    assert parse_fault("scale") == Fault("scale", None, None)
    assert parse_fault("drop-step:fc.weight") == Fault("drop-step", "fc.weight")
    assert parse_fault("bf16:") == Fault("bf16", None)  # an empty PARAM is none
    with pytest.raises(AccumcheckError) as error:
        parse_fault("flip:fc.weight")
    assert str(error.value) == ("--inject: unknown fault 'flip'; choose one of drop-step, repeat-step, double-step, scale, bf16, "
                                "roundoff (optionally KIND:PARAM to pick the tensor)")


def test_str_and_target_name_the_step_only_for_one_step_faults():
    assert str(Fault("scale", "fc.weight", 2)) == "scale:fc.weight@2"
    assert str(Fault("double-step", None, 0)) == "double-step@0"
    assert str(Fault("drop-step", "w")) == "drop-step:w"  # not resolved yet: no step
    assert str(Fault("bf16", "w", 3)) == "bf16:w"
    assert Fault("scale", "fc.weight", 2).target == "scale:fc.weight"


def test_resolve_aims_at_the_first_embedding_then_the_first_weight_then_the_first_tensor():
    assert resolve_fault(Fault("scale"), PARAMS, 8) == Fault("scale", "embed.weight", 4)
    assert resolve_fault(Fault("scale"), [p for p in PARAMS if p[1] != "embedding"], 8).param == "fc.weight"
    assert resolve_fault(Fault("scale"), [("a.gamma", "norm"), ("b.beta", "norm")], 8).param == "a.gamma"
    assert resolve_fault(Fault("scale", "fc.bias"), PARAMS, 8).param == "fc.bias"  # a named one stays


def test_one_step_faults_hit_step_n_over_2_and_the_others_none():
    assert [resolve_fault(Fault(k), PARAMS, 7).step for k in ("drop-step", "repeat-step", "double-step", "scale")] \
        == [3, 3, 3, 3]
    assert resolve_fault(Fault("scale"), PARAMS, 1).step == 0
    assert resolve_fault(Fault("bf16"), PARAMS, 8) == Fault("bf16", "embed.weight", None)
    assert resolve_fault(Fault("roundoff"), PARAMS, 8).step is None


def test_double_step_needs_two_micro_steps():
    assert resolve_fault(Fault("double-step"), PARAMS, 2).step == 1
    with pytest.raises(AccumcheckError) as error:
        resolve_fault(Fault("double-step"), PARAMS, 1)
    assert str(error.value) == ("--inject double-step needs --accum-steps 2 or more: with one micro-step there is "
                                "no running total to count twice")


def test_an_unknown_parameter_is_refused_with_the_names_there_are():
    with pytest.raises(AccumcheckError) as error:
        resolve_fault(Fault("scale", "head.weight"), PARAMS, 8)
    assert str(error.value) == ("--inject scale:head.weight: no parameter named 'head.weight'; this case has "
                                "norm.gamma, embed.weight, fc.weight, fc.bias")


def contributions(kind, grads, step=None, totals=None):
    injector = FaultInjector(Fault(kind, "w", step), len(grads), lambda x: ("bf16", x))
    totals = totals or [None] * len(grads)
    return [injector.contribution(k, g, t) for k, (g, t) in enumerate(zip(grads, totals))]


def test_one_step_faults_change_only_their_step():
    grads = [1.0, 2.0, 3.0, 4.0]
    assert contributions("drop-step", grads, step=2) == [1.0, 2.0, 0.0, 4.0]
    assert contributions("repeat-step", grads, step=2) == [1.0, 2.0, 6.0, 4.0]
    assert contributions("double-step", grads, step=2, totals=[None, 1.0, 3.0, 6.0]) == [1.0, 2.0, 6.0, 4.0]
    assert contributions("scale", grads, step=1) == [1.0, 2.0 * SCALE_FACTOR, 3.0, 4.0]
    assert SCALE_FACTOR == 1.001
    assert contributions("bf16", grads, step=None) == grads  # bf16 acts on the total, after the add


def test_double_step_without_a_running_total_adds_the_gradient_once():
    assert contributions("double-step", [5.0, 1.0], step=0) == [5.0, 1.0]


def test_roundoff_adds_blocks_of_four_micro_steps_and_the_rest_at_the_end():
    assert contributions("roundoff", [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) == [0.0, 0.0, 0.0, 10.0, 0.0, 11.0]
    assert contributions("roundoff", [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])[-1] == 9.0
    assert contributions("roundoff", [7.0]) == [7.0]


def test_after_add_replaces_the_total_only_for_bf16():
    assert FaultInjector(Fault("bf16", "w"), 4, lambda x: ("bf16", x)).after_add(0, 3.0) == ("bf16", 3.0)
    for kind in ("drop-step", "repeat-step", "double-step", "scale", "roundoff"):
        assert FaultInjector(Fault(kind, "w", 1), 4, lambda x: ("bf16", x)).after_add(1, 3.0) is None


def bits(values):
    return np.asarray(values, F32).view(np.uint32).tolist()


def from_bits(*patterns):
    return np.array(patterns, np.uint32).view(F32)


def test_bfloat16_rounds_to_nearest_with_ties_to_even():
    rounded = round_to_bfloat16(from_bits(0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x3F800002, 0xBF818000))
    assert rounded.dtype == F32
    # a tie down to the even 0x3F80, a tie up to the even 0x3F82, just above and just below a tie,
    # a low bit that must not survive the mask, and a negative tie
    assert bits(rounded) == [0x3F800000, 0x3F820000, 0x3F810000, 0x3F800000, 0x3F800000, 0xBF820000]
    assert round_to_bfloat16(np.array([1.0 + 2.0**-8, 3.0], F32)).tolist() == [1.0, 3.0]


def test_bfloat16_rounding_takes_float64_values_and_keeps_non_finite_ones():
    assert round_to_bfloat16(np.array([1.0 + 3 * 2.0**-8, 0.1])).tolist() == [1.0 + 2.0**-6, 0.10009765625]
    out = round_to_bfloat16(np.array([np.inf, -np.inf, np.nan, 2.0], F32))
    assert out[0] == math.inf and out[1] == -math.inf and math.isnan(out[2]) and out[3] == 2.0
    assert out.dtype == F32
