"""The second pass (accumcheck.judge.attribution): each fault's pattern found in the error, at its
micro-step; round-off never explained as a fault; the statistical tier and the severity."""

import numpy as np
import pytest

from accumcheck.judge import build_report
from accumcheck.judge.attribution import FALSE_ALARM, describe
from accumcheck.judge.secondpass import severity
from accumcheck.report import Cause
from accumcheck.run.faults import round_to_bfloat16
from accumcheck.run.results import ParamAccumulation, RunResult

F32 = np.float32
N, K = 16, 8


def micro(seed=0, steps=N, shape=(64, 64)):
    return np.random.default_rng(seed).standard_normal((steps, *shape)).astype(F32)


def running(grads, contribution=lambda k, g, total: g, after=lambda total: total):
    total = np.zeros(grads.shape[1:], F32)
    for k, g in enumerate(grads):
        total = after((total + contribution(k, g, total)).astype(F32))
    return total


def report_of(native, grads, manual=None, replay=True, steps=None):
    """The judge's Report of one tensor, with a replay of ``grads`` (or none)."""
    wide = grads.astype(np.float64)
    manual = running(grads) if manual is None else manual
    param = ParamAccumulation("w", "weight", native, manual, wide.sum(0), np.abs(wide).sum(0))
    run = RunResult([param], "numpy", {}, "cpu", "float32", "float32")
    stream = (lambda names: ({"w": g} for g in grads)) if replay else None
    return build_report(None, run, steps or len(grads), None, False, 0.0, {"model": "m"}, stream)


def tensor_of(native, grads, **kw):
    return report_of(native, grads, **kw).tensors[0]


FAULTS = {
    "drop-step": (lambda k, g, t: g * 0 if k == K else g, ("drop-step", K, -1.0)),
    "repeat-step": (lambda k, g, t: g + g if k == K else g, ("repeat-step", K, 1.0)),
    "repeat-step 3 times": (lambda k, g, t: g * 4 if k == K else g, ("repeat-step", K, 3.0)),
    "scale": (lambda k, g, t: g * F32(1.001) if k == K else g, ("scale-step", K, 1e-3)),
    "running total": (lambda k, g, t: g + t if k == K else g, ("running-total", K, 1.0)),
}


@pytest.mark.parametrize("name", FAULTS)
def test_each_one_step_fault_is_found_at_its_micro_step(name):
    contribution, (kind, step, factor) = FAULTS[name]
    grads = micro()
    t = tensor_of(running(grads, contribution), grads)
    assert t.verdict == "diverged" and t.severity == "diverged"
    assert (t.cause.kind, t.cause.step, t.cause.mode) == (kind, step, "native")
    assert t.cause.factor == pytest.approx(factor, rel=1e-3) and t.cause.fit > 0.999 and t.cause.residual_ratio <= 1
    assert f"micro-step {K}" in t.cause.detail and "(fit 1.000)" in t.cause.detail


def test_a_total_kept_in_bfloat16_is_found_with_its_dtype():
    grads = micro()
    t = tensor_of(running(grads, after=round_to_bfloat16), grads)
    assert (t.cause.kind, t.cause.dtype) == ("narrow-dtype", "bfloat16") and t.cause.words == "sum kept in bfloat16"


def test_a_total_kept_in_float16_is_found_with_its_dtype():
    grads = micro(shape=(32, 32)) * F32(0.01)
    t = tensor_of(running(grads, after=lambda x: x.astype(np.float16).astype(F32)), grads)
    assert (t.cause.kind, t.cause.dtype) == ("narrow-dtype", "float16")


def mean_kept_in(grads, rounding):
    """N times a running mean M + (g_k - M) / (k + 1), every operation (the count too) rounded by
    ``rounding`` (optax.MultiSteps' default accumulator on parameters of that dtype)."""
    mean = np.zeros(grads.shape[1:], F32)
    for k, g in enumerate(grads):
        count = rounding(np.array(k + 1, F32))
        mean = rounding((mean + rounding((rounding((g - mean).astype(F32)) / count).astype(F32))).astype(F32))
    return (mean * F32(len(grads))).astype(F32)


def test_a_mean_kept_in_bfloat16_is_found_with_its_dtype():
    grads = micro()
    t = tensor_of(mean_kept_in(grads, round_to_bfloat16), grads)
    assert (t.cause.kind, t.cause.dtype) == ("narrow-mean", "bfloat16") and t.cause.words == "mean kept in bfloat16"
    assert t.cause.fit > 0.999 and t.cause.residual_ratio <= 1 and t.cause.factor == pytest.approx(1.0, abs=1e-3)


def test_a_mean_kept_in_float16_is_found_and_a_sum_is_not_taken_for_one():
    grads = micro(shape=(32, 32)) * F32(0.01)
    t = tensor_of(mean_kept_in(grads, lambda x: x.astype(np.float16).astype(F32)), grads)
    assert (t.cause.kind, t.cause.dtype) == ("narrow-mean", "float16")
    t = tensor_of(running(grads, after=round_to_bfloat16), grads)
    assert t.cause.kind == "narrow-dtype" and "mean kept in bfloat16" not in (t.cause.alternatives or [])


def test_the_whole_sum_scaled_is_a_constant_factor():
    grads = micro()
    t = tensor_of((running(grads) * F32(0.5)).astype(F32), grads)
    assert t.cause.kind == "scale-sum" and t.cause.factor == pytest.approx(-0.5, rel=1e-6)
    assert t.cause.words == "sum scaled 0.5" and "the whole sum scaled by 0.5 (fit 1.000)" in t.cause.detail


def test_a_running_total_multiplied_at_every_step_is_growth_with_its_factor():
    # MXNet 1.6.0 with five contributions: T_k = 16 T_{k-1} + (8/9) g_k.
    grads = micro(shape=(16, 16))
    total = np.zeros(grads.shape[1:], F32)
    for g in grads:
        total = (total * F32(16) + g * F32(8 / 9)).astype(F32)
    t = tensor_of(total, grads)
    assert (t.cause.kind, t.cause.factor) == ("growth", 16.0) and t.cause.grad_scale == pytest.approx(8 / 9, rel=1e-5)
    assert "added again 15 times at every micro-step" in t.cause.detail


def test_micro_gradients_computed_differently_are_not_a_single_step_fault():
    grads = micro()
    other = (grads * (1 + 1e-3 * np.random.default_rng(1).standard_normal(grads.shape))).astype(F32)
    t = tensor_of(running(other), grads)
    assert t.verdict == "diverged" and t.cause.kind == "unexplained" and t.cause.words == "not a single-step fault"
    assert "cannot explain" in t.cause.detail and t.severity == "diverged"  # far past the bound


def test_periodic_micro_gradients_name_every_step_that_fits_as_well():
    grads = np.concatenate([micro(shape=(8, 8), steps=2)] * (N // 2))
    t = tensor_of(running(grads, FAULTS["drop-step"][0]), grads)
    readings = [t.cause.words, *t.cause.alternatives]
    assert f"step {K} lost" in readings and "step 0 lost" in readings and "as well:" in t.cause.detail


@pytest.mark.parametrize("order", ["reversed", "pairwise", "blocked", "numpy"])
def test_round_off_of_another_order_is_neither_flagged_nor_explained(order):
    grads = micro()
    native = {"reversed": lambda: running(grads[::-1]),
              "pairwise": lambda: pairwise(grads),
              "blocked": lambda: running(np.stack([grads[i:i + 4].sum(0, dtype=F32) for i in range(0, N, 4)])),
              "numpy": lambda: np.ascontiguousarray(grads.reshape(N, -1).T).sum(1).reshape(grads.shape[1:])}[order]()
    t = tensor_of(native, grads)
    assert t.verdict == "round-off" and t.cause is None and t.severity is None
    assert t.fault_score < t.fault_score_threshold


def pairwise(grads):
    if len(grads) == 1:
        return grads[0].copy()
    half = len(grads) // 2
    return (pairwise(grads[:half]) + pairwise(grads[half:])).astype(F32)


def test_a_fault_below_the_worst_case_bound_is_suspicious_not_flagged():
    grads = micro(steps=32)
    alpha = F32(3e-6)
    t = tensor_of(running(grads, lambda k, g, tot: g * (1 + alpha) if k == 16 else g), grads)
    assert t.verdict == "suspicious" and not t.flagged and t.ratio <= 1
    assert (t.cause.kind, t.cause.step) == ("scale-step", 16) and t.fault_score >= t.fault_score_threshold
    assert t.spread_native > t.spread_manual and t.spread_predicted > t.spread_native


def test_the_threshold_keeps_the_false_alarm_rate_of_every_candidate_together():
    grads = micro(steps=32, shape=(4,))
    t = tensor_of(running(grads[::-1]), grads)
    candidates = 2 * (2 * 32 + 1)
    assert t.fault_score_threshold == pytest.approx(np.sqrt(2 * np.log(2 * candidates / FALSE_ALARM)))


def test_identical_modes_get_no_second_pass():
    grads = micro()
    t = tensor_of(running(grads), grads)
    assert t.verdict == "identical" and t.fault_score is None and t.cause is None
    assert t.spread_predicted > 0 and t.spread_native == t.spread_manual


def test_without_a_replay_a_flagged_tensor_has_no_cause_and_is_marginal_near_its_bound():
    grads = micro()
    native = running(grads).copy()
    bound = 15 * 2.0**-24 * np.abs(grads.astype(np.float64)).sum(0)
    native[0, 0] = F32(native[0, 0] + 3 * bound[0, 0])  # about three times its bound, one element
    t = tensor_of(native, grads, replay=False)
    assert t.flagged and t.cause is None and 1 < t.ratio <= 10 and t.severity == "marginal"
    assert t.label == "diverged (marginal)"


def test_a_replay_that_does_not_reproduce_the_run_gives_no_causes_and_says_so():
    grads = micro()
    native = running(grads, FAULTS["drop-step"][0])
    wide = grads.astype(np.float64)
    param = ParamAccumulation("w", "weight", native, running(grads), wide.sum(0), np.abs(wide).sum(0))
    run = RunResult([param], "numpy", {}, "cpu", "float32", "float32")
    report = build_report(None, run, N, None, False, 0.0, {"model": "m"}, lambda names: ({"w": g * 2} for g in grads))
    assert report.tensors[0].cause is None
    assert "did not reproduce the micro-gradients bit for bit" in report.notes[-1]


def test_severity_in_words():
    grads = micro()
    t = tensor_of(running(grads, FAULTS["scale"][0]), grads)
    assert t.severity == "diverged"
    t.cause = Cause("scale-step", "native", "w", "d", 1.0, 0.1, 3, 1e-3)
    t.ratio = 5.0
    assert severity(t) == "diverged"  # a single-step fault is decisive however near its bound
    t.cause = None
    assert severity(t) == "marginal"
    t.ratio = 11.0
    assert severity(t) == "diverged"
    t.verdict = "round-off"
    assert severity(t) is None


def fail_report(verdicts_and_severities, fail_on=None):
    grads = micro(shape=(2,))
    tensors = []
    for verdict, sev in verdicts_and_severities:
        t = tensor_of(running(grads), grads)
        t.verdict, t.severity = verdict, sev
        tensors.append(t)
    base = report_of(running(grads), grads)
    base.tensors = tensors
    base.config = {"model": "m", **({"fail_on": fail_on} if fail_on else {})}
    return base


@pytest.mark.parametrize("fail_on, marginal_only, with_diverged, suspicious_only", [
    (None, 1, 1, 0), ("marginal", 1, 1, 0), ("diverged", 0, 1, 0), ("suspicious", 1, 1, 1)])
def test_fail_on_decides_the_exit_code(fail_on, marginal_only, with_diverged, suspicious_only):
    assert fail_report([("diverged", "marginal"), ("round-off", None)], fail_on).exit_code == marginal_only
    assert fail_report([("diverged", "marginal"), ("diverged", "diverged")], fail_on).exit_code == with_diverged
    assert fail_report([("suspicious", None), ("identical", None)], fail_on).exit_code == suspicious_only


def test_every_explanation_has_words():
    for kind in ("repeat-step", "drop-step", "scale-step", "running-total", "scale-sum", "growth", "narrow-dtype",
                 "narrow-mean"):
        short, sentence = describe(kind, 3, 2.0, "bfloat16")
        assert short and sentence and len(short) <= 30
    assert describe("repeat-step", 8, 1.0, None) == ("step 8 counted twice", "micro-step 8 counted twice")
    with pytest.raises(ValueError):
        describe("magic", None, 0.0, None)


def test_elements_left_out_of_the_score_are_left_out_of_both_its_sides():
    # Found by the property test: the second element repeats its terms (left out), the first does
    # not; a score counting the second element's error above the line but not below it explodes.
    grads = np.array([[0.875, 0.875], [-0.8755588, -0.8755588], [0.0, 0.875], [-0.0, -0.8755588], [0.875, 0.875]],
                     F32)
    t = tensor_of(running(grads[[0, 2, 4, 1, 3]]), grads)
    assert t.verdict == "round-off" and t.fault_score < t.fault_score_threshold


def test_a_whole_count_is_not_repeated_as_a_scale_of_the_same_step():
    grads = micro()
    t = tensor_of(running(grads, FAULTS["repeat-step"][0]), grads)
    assert t.cause.words == "step 8 counted twice" and not t.cause.alternatives


def test_a_failing_suspicious_tensor_is_in_the_assertion_message():
    import accumcheck

    grads = micro(steps=32)
    report = report_of(running(grads, lambda k, g, tot: g * F32(1 + 3e-6) if k == 16 else g), grads)
    assert report.tensors[0].verdict == "suspicious"
    accumcheck.assert_faithful(report)  # not failing by default
    report.config["fail_on"] = "suspicious"
    with pytest.raises(AssertionError, match="micro-step 16 scaled by 1"):
        accumcheck.assert_faithful(report)


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_a_long_accumulation_outgrowing_float64_in_the_growth_patterns_is_still_explained():
    grads = micro(steps=200, shape=(8, 8))  # 64^200 overflows float64; 64^170 squared does too
    t = tensor_of(running(grads, lambda k, g, tot: g * 0 if k == 100 else g), grads)
    assert (t.cause.kind, t.cause.step) == ("drop-step", 100)
