"""accumcheck.judge.verdicts: each verdict at its boundary, and everything build_report records
from a run (framework-free: RunResults made by hand)."""

import dataclasses
import datetime as dt
import hashlib

import numpy as np

from accumcheck.bounds import ModeBound
from accumcheck.case.reading import builtin_case
from accumcheck.judge import build_report, compare_tensor, full_batch_verdict
from accumcheck.judge.dataparallel import Candidate, RankChecks
from accumcheck.report import FullBatchResult
from accumcheck.run.faults import Fault
from accumcheck.run.results import FullBatchGap, ParamAccumulation, RunResult
from accumcheck.version import __version__

F32 = np.float32
QUARTER = ModeBound("float32", 1, 0.25, 0.0)  # |x - E| <= S / 4: ratios come out exact


def judge(native, exact, absum, manual=None, bound=QUARTER, **kw):
    native = np.asarray(native, F32)
    manual = native.copy() if manual is None else np.asarray(manual, F32)
    return compare_tensor("t", "bias", native, manual, np.asarray(exact, float), np.asarray(absum, float), bound,
                          bound, **kw)


def test_a_ratio_of_exactly_one_is_round_off_and_above_it_diverged():
    at = judge([9.0], [8.0], [4.0], manual=[8.0])  # 1 from E, the bound S/4 = 1
    assert (at.ratio, at.verdict, at.kind, at.worst_mode) == (1.0, "round-off", "bias", "native")
    assert at.bound_at_worst == 1.0 and at.over_bound_native == 0
    past = judge([9.5], [8.0], [4.0], manual=[8.0])
    assert (past.ratio, past.verdict, past.over_bound_native) == (1.5, "diverged", 1)


def test_precision_loss_is_native_within_its_bound_beyond_the_reference_one():
    reference = ModeBound("float32", 1, 2.0**-4, 0.0)
    # Both modes 1/8 from E = 8 at S = 1: within S/4, twice S/16.
    lost = judge([8.125], [8.0], [1.0], reference_bound=reference)
    assert (lost.ratio, lost.precision_ratio, lost.verdict) == (0.5, 2.0, "precision-loss")  # identical, but lost
    # Exactly at the reference bound, and 1.5 times it.
    assert judge([8.0625], [8.0], [1.0], reference_bound=reference).verdict == "identical"
    assert judge([8.09375], [8.0], [1.0], reference_bound=reference).verdict == "precision-loss"
    # Without a reference bound nothing is a loss of precision, and no precision figures are made.
    plain = judge([8.125], [8.0], [1.0])
    assert plain.verdict == "identical" and plain.precision_ratio is None and plain.err_ulps_native is None


def test_ill_conditioned_from_a_condition_of_exactly_100_and_never_for_non_finite():
    assert judge([1.0], [1.0], [100.0]).ill_conditioned
    assert not judge([1.0], [1.0], [99.0]).ill_conditioned
    # The condition of the finite elements is 100, but a non-finite tensor is just non-finite.
    bad = judge([1.0, np.inf], [1.0, 1.0], [100.0, 1.0])
    assert bad.verdict == "non-finite" and not bad.ill_conditioned


def checks(*candidates, flagged=()):
    return RankChecks({"flagged_ranks": list(flagged)}, list(candidates))


def test_a_data_parallel_check_past_its_bound_makes_the_tensor_diverge_and_is_pointed_at():
    absum = np.array([[4.0, 8.0], [12.0, 16.0]])
    bound = ModeBound("float32", 3, 2.0**-3, 2.0**-10)
    fine = judge(np.full((2, 2), 8.0), np.full((2, 2), 8.0), absum, parallel=checks())
    assert (fine.verdict, fine.worst_mode, fine.flagged_ranks) == ("identical", "native", [])
    at_one = judge(np.full((2, 2), 8.0), np.full((2, 2), 8.0), absum,
                   parallel=checks(Candidate(1.0, "rank 1", 2, absum, bound)))
    assert at_one.verdict == "identical" and at_one.ratio == 1.0 and at_one.worst_mode == "rank 1"
    past = judge(np.full((2, 2), 8.0), np.full((2, 2), 8.0), absum,
                 parallel=checks(Candidate(0.5, "rank 0", 0, absum, bound), Candidate(1.5, "rank 1", 2, absum, bound)))
    assert (past.verdict, past.ratio, past.worst_mode, past.worst_index) == ("diverged", 1.5, "rank 1", [1, 0])
    assert past.bound_at_worst == 2.0**-3 * 12.0 + 2.0**-10


def test_a_data_parallel_check_no_worse_than_the_tensor_leaves_its_worst_alone():
    tied = judge([9.0], [8.0], [4.0], manual=[8.0], parallel=checks(Candidate(1.0, "rank 0", 0, np.array([4.0]),
                                                                              QUARTER)))
    assert (tied.ratio, tied.worst_mode, tied.verdict) == (1.0, "native", "round-off")


def test_data_parallel_flags_do_not_hide_a_worse_verdict():
    flagged = checks(Candidate(1.5, "rank 0", 0, np.array([1.0]), QUARTER), flagged=[0])
    assert judge([np.nan], [8.0], [1.0], parallel=flagged).verdict == "non-finite"
    reference = ModeBound("float32", 1, 2.0**-4, 0.0)
    lost = judge([8.125], [8.0], [1.0], reference_bound=reference, parallel=checks(
        Candidate(1.5, "rank 0", 0, np.array([1.0]), QUARTER)))
    assert lost.verdict == "precision-loss" and lost.worst_mode == "rank 0"
    assert judge([8.0], [8.0], [1.0], parallel=checks(flagged=[1])).verdict == "diverged"


# ----------------------------------------------------------------------------- build_report


def param(name, exact, native=None, kind="weight", absum=None, oracle=None, manual=None):
    exact = np.asarray(exact, float)
    native = exact.astype(F32) if native is None else np.asarray(native, F32)
    manual = native.copy() if manual is None else np.asarray(manual, F32)
    absum = np.abs(exact) if absum is None else np.asarray(absum, float)
    return ParamAccumulation(name, kind, native, manual, exact, absum,
                             oracle=None if oracle is None else np.asarray(oracle, float))


def run_of(*params, dtype="float32", **kw):
    return RunResult(params=list(params), framework="torch", versions={"torch": "2.13.0"}, device="cpu",
                     param_dtype=dtype, accum_dtype="float32", **kw)


def test_the_report_records_the_case_the_run_and_the_options():
    case = builtin_case("shared-weight").with_seed(7)
    run = run_of(param("w", [3.0, 4.0], oracle=[3.0, 4.5]), param("b", [1.0], kind="bias"),
                 native_kernel_allowance=4.0, losses={"native": 0.5}, settings={"threads": 1}, notes=["a note"],
                 full_batch=FullBatchGap("mean", "1/N", {"w": np.array([1e9 + 1, 0.0])}, {"w": np.array([1e9, 0.0])}))
    config = {"case": "shared-weight", "accum_steps": 4}
    before = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    report = build_report(case, run, 4, Fault("scale", "w", 2), True, 1.23456, config)
    assert (report.case, report.case_source, report.case_fingerprint, report.case_toml) == (
        case.name, case.source, case.fingerprint(), case.text)
    assert (report.framework, report.device, report.param_dtype, report.accum_dtype) == ("torch", "cpu", "float32",
                                                                                         "float32")
    assert report.versions == {"accumcheck": __version__, "torch": "2.13.0"}
    assert (report.accum_steps, report.seed, report.oracle, report.inject) == (4, 7, True, "scale:w@2")
    assert report.bound == {"native": vars(ModeBound.for_sum("float32", 4, 4.0)),
                            "manual": vars(ModeBound.for_sum("float32", 4))}
    assert report.bound["native"]["kernel_allowance"] == 4.0
    assert (report.loss_reduction, report.settings, report.losses, report.notes) == (
        "mean", {"threads": 1}, {"native": 0.5}, ["a note"])
    assert report.seconds == 1.235 and report.config == config
    created = dt.datetime.fromisoformat(report.created)
    assert created.utcoffset() == dt.timedelta(0) and created.microsecond == 0
    assert before <= created <= dt.datetime.now(dt.timezone.utc)
    assert report.full_batch == full_batch_verdict(run.full_batch, 4)
    assert head(report.full_batch) == ("mean", "1/N", 1e-9, "w", True, 1e-9)  # at the tolerance: same
    assert report.data_parallel is None
    w, b = report.tensors
    assert (w.name, w.kind, b.name, b.kind) == ("w", "weight", "b", "bias")
    assert (w.flagged_ranks, w.rank_local_ratios, w.single_ratio) == (None, None, None)  # not data-parallel
    assert (w.oracle_err_native, w.oracle_err_exact, b.oracle_err_native) == (0.5, 0.5, None)


def test_a_user_model_report_names_the_model():
    report = build_report(None, run_of(param("w", [1.0])), 2, None, False, 0.0, {"model": "MyNet"})
    assert (report.case, report.case_source, report.seed, report.case_toml) == ("MyNet", "<user model MyNet>", -1, "")
    assert report.case_fingerprint == hashlib.sha256(b"").hexdigest()[:12]
    assert (report.inject, report.oracle, report.loss_reduction, report.config) == (None, False, "", {"model": "MyNet"})
    anonymous = build_report(None, run_of(param("w", [1.0])), 2, None, False, 0.0)
    assert (anonymous.case, anonymous.case_source, anonymous.config) == ("model", "<user model model>", {})


def test_a_full_batch_gap_past_the_tolerance_is_not_equivalent():
    # 2e-5 apart: past 1e-9, and past the 1e-6 within which a factor of 1 is float32 rounding
    gap = FullBatchGap("sum", "1", {"w": np.array([1e9 + 2e4, 0.0])}, {"w": np.array([1e9, 0.0])})
    report = build_report(builtin_case("shared-weight"), run_of(param("w", [1.0]), full_batch=gap), 2, None, False,
                          0.0)
    assert head(report.full_batch) == ("sum", "1", 2e-5, "w", False, 1e-9)


def head(result: FullBatchResult) -> tuple:
    """The fields a full-batch result had before it named its factor."""
    return dataclasses.astuple(result)[:6]


def test_each_tensor_gets_its_share_of_the_sum_of_squares():
    report = build_report(None, run_of(param("a", [0.5]), param("b", [0.25, 0.25])), 2, None, False, 0.0)
    assert [t.norm_share for t in report.tensors] == [2 / 3, 1 / 3]  # 0.25 and 0.125 of 0.375
    zero = build_report(None, run_of(param("a", [0.0], absum=[1.0]), param("b", [0.0, 0.0])), 2, None, False, 0.0)
    assert [t.norm_share for t in zero.tensors] == [0.0, 0.0]


def test_ratio_maps_for_the_three_tensors_nearest_their_bound():
    # Native 1 against E = 1 + 2^-24 in each tensor: the ratio falls as S grows.
    tensors = [param(f"t{i}", [1.0 + 2.0**-24], native=[1.0], absum=[s]) for i, s in enumerate([16, 2, 8, 4, 32])]
    report = build_report(None, run_of(*tensors), 2, None, False, 0.0)
    assert not any(t.flagged for t in report.tensors)
    assert [t.name for t in report.tensors if t.ratio_map is not None] == ["t1", "t2", "t3"]
    t1 = report.tensors[1]
    assert t1.ratio_map == [[t1.ratio]] and t1.ratio_map_cell == [1, 1]


def test_ratio_maps_for_every_flagged_tensor_but_a_non_finite_one():
    tensors = [param(f"d{i}", [1.0], native=[1.5 + i], manual=[1.0]) for i in range(4)]
    tensors.append(param("inf", [1.0], native=[np.inf], manual=[1.0]))
    report = build_report(None, run_of(*tensors), 2, None, False, 0.0)
    assert all(t.flagged for t in report.tensors)
    assert [t.ratio_map is not None for t in report.tensors] == [True, True, True, True, False]


def test_errors_in_ulps_only_for_an_accumulator_mode_or_reduced_parameters():
    def ulps(config=None, dtype="float32"):
        report = build_report(None, run_of(param("w", [1.0]), dtype=dtype), 4, None, False, 0.0, config)
        return report.tensors[0].err_ulps_native, report.tensors[0].precision_ratio

    assert ulps() == ulps({"mode": "native"}) == ulps(dtype="float64") == (None, None)
    assert ulps({"mode": "compensated"}) == (0.0, None)
    assert ulps(dtype="bfloat16") == (0.0, 0.0)


def test_a_parameter_without_gradient_is_no_gradient_and_never_ill_conditioned():
    unused = judge([0.0], [0.0], [0.0], no_gradient=True)
    assert (unused.verdict, unused.flagged, unused.ill_conditioned) == ("no-gradient", False, False)
    # no_gradient wins over whatever the arrays say, and a heavily cancelling sum is not called ill
    assert judge([1.0], [1.0], [100.0], no_gradient=True).verdict == "no-gradient"
    assert not judge([1.0], [1.0], [100.0], no_gradient=True).ill_conditioned


def test_an_overflow_is_a_non_finite_e_of_a_loss_scaled_run_only():
    skipped = judge([np.inf], [np.inf], [np.inf], overflow=True)
    assert (skipped.verdict, skipped.flagged, skipped.ill_conditioned) == ("overflow", False, False)
    # its finite elements cancel a hundredfold, but an overflowed step is not called ill-conditioned
    cancelling = judge([1.0, np.inf], [1.0, np.inf], [100.0, np.inf], overflow=True)
    assert (cancelling.verdict, cancelling.condition, cancelling.ill_conditioned) == ("overflow", 100.0, False)
    # the micro-gradients were finite: an inf in native alone is a finding, scaled or not
    assert judge([np.inf], [1.0], [1.0], manual=[1.0], overflow=True).verdict == "non-finite"
    assert judge([np.inf], [np.inf], [np.inf]).verdict == "non-finite"  # no scaler: a finding
    assert judge([1.0], [1.0], [100.0], overflow=True).ill_conditioned  # finite: judged as ever


def test_a_loss_scaled_run_makes_overflowed_tensors_overflow_and_draws_no_map_for_them():
    tensors = [param("w", [np.inf], native=[np.inf], absum=[np.inf]), param("b", [1.0], native=[2.0], manual=[1.0])]
    scaled = build_report(None, run_of(*tensors, grad_scale=65536.0), 2, None, False, 0.0)
    assert [t.verdict for t in scaled.tensors] == ["overflow", "diverged"]
    assert scaled.tensors[0].ratio_map is None and scaled.tensors[1].ratio_map is not None
    plain = build_report(None, run_of(*tensors), 2, None, False, 0.0)
    assert [t.verdict for t in plain.tensors] == ["non-finite", "diverged"]


def test_a_user_model_run_passes_on_aliases_and_gradient_counts():
    tied = dataclasses.replace(param("wte", [1.0]), aliases=("lm_head.weight",), steps_with_grad=3)
    unused = dataclasses.replace(param("extra", [0.0]), steps_with_grad=0)
    report = build_report(None, run_of(tied, unused, param("b", [1.0], kind="bias")), 4, None, False, 0.0)
    wte, extra, b = report.tensors
    assert (wte.aliases, wte.steps_with_grad, wte.title, wte.verdict) == (
        ["lm_head.weight"], 3, "wte = lm_head.weight", "identical")
    assert (extra.verdict, extra.steps_with_grad, extra.aliases) == ("no-gradient", 0, None)
    assert (b.aliases, b.steps_with_grad, b.title) == (None, None, "b")


def test_each_parameter_of_a_mixed_dtype_model_is_bounded_by_its_own_dtype():
    # E = 1, S = 1 at N = 4: 1/128 off is within bfloat16's bound (3 * 2^-8) but 2^16 float32 ulps past
    # float32's; a float32 parameter as far off diverges, a bfloat16 one loses precision.
    off = 1.0 + 2.0**-7
    mixed = [dataclasses.replace(param("half", [1.0], native=[off], manual=[1.0]), dtype="bfloat16"),
             param("full", [1.0], native=[off], manual=[1.0]),
             dataclasses.replace(param("same", [1.0], native=[off], manual=[1.0]), dtype="float32"),
             dataclasses.replace(param("wide", [1.0], native=[off], manual=[1.0]), dtype="float64")]
    half, full, same, wide = build_report(None, run_of(*mixed), 4, None, False, 0.0).tensors
    assert (half.verdict, full.verdict, same.verdict, wide.verdict) == ("precision-loss", "diverged", "diverged",
                                                                        "diverged")
    bound = ModeBound.for_sum("bfloat16", 4)
    assert half.bound_at_worst == bound.at(1.0) and half.precision_ratio > 1.0
    assert full.precision_ratio is None and wide.precision_ratio is None
    assert wide.bound_at_worst == ModeBound.for_sum("float64", 4).at(1.0)
    # a float32 parameter in a bfloat16 run keeps no precision a float32 buffer would: no precision ratio
    wide_in_half = build_report(None, run_of(dataclasses.replace(param("w", [1.0]), dtype="float32"),
                                             dtype="bfloat16"), 4, None, False, 0.0).tensors[0]
    assert wide_in_half.precision_ratio is None and wide_in_half.verdict == "identical"
    # the run's own kernel allowance applies to the parameter's own bound too
    allowed = build_report(None, run_of(mixed[0], native_kernel_allowance=4.0), 4, None, False, 0.0).tensors[0]
    assert allowed.bound_at_worst == ModeBound.for_sum("bfloat16", 4, 4.0).at(1.0, 1.0)


def test_a_full_batch_mismatch_alone_is_drawn_as_flagged_in_html():
    from accumcheck.render import render

    gap = FullBatchGap("mean", "1/N", {"w": np.array([2.0, 4.0])}, {"w": np.array([1.0, 2.0])})
    report = build_report(None, run_of(param("w", [1.0, 2.0]), full_batch=gap), 4, None, False, 0.0)
    assert report.flagged == [] and report.exit_code == 1
    assert '<p class="flagged">FLAGGED: the accumulated gradient is not the full batch' in render(report, "html")
    clean = build_report(None, run_of(param("w", [1.0, 2.0])), 4, None, False, 0.0)
    assert '<p class="ok">OK: all 1 tensors faithful' in render(clean, "html")


def test_a_run_in_which_no_tensor_received_a_gradient_judged_nothing_and_is_refused():
    import pytest

    from accumcheck.errors import AccumcheckError, NothingJudgedError

    missing = dataclasses.replace(param("w", [0.0, 0.0]), steps_with_grad=0)
    zero = param("b", [0.0], kind="bias")  # every micro-gradient exactly zero: S = 0
    with pytest.raises(NothingJudgedError, match="none of the 2 parameter tensors received a non-zero gradient in "
                                                 "the 4 micro-batches") as caught:
        build_report(None, run_of(missing, zero), 4, None, False, 0.0)
    assert isinstance(caught.value, AccumcheckError)  # the CLI's exit 2, one line
    # one tensor judged on something is a judgement: a zero sum of cancelling micro-gradients (S > 0),
    # a zero sum that native got wrong, a non-finite gradient
    for judged in (param("c", [0.0], absum=[2.0]), param("d", [0.0], native=[1e-3], manual=[0.0]),
                   param("e", [np.inf], native=[np.inf], absum=[np.inf])):
        report = build_report(None, run_of(missing, zero, judged), 4, None, False, 0.0)
        assert [t.verdict for t in report.tensors][:2] == ["no-gradient", "identical"]
