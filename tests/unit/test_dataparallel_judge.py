"""The data-parallel bounds and verdicts, framework-free: simulated all-reduces must sit inside the
bounds (positive control), and a wrong rank, a rank holding another gradient, or a reference that
differs must be flagged (negative controls)."""

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from accumcheck.bounds import ModeBound, gamma
from accumcheck.case.reading import builtin_case
from accumcheck.judge import build_report
from accumcheck.judge.dataparallel import DataParallelBounds, RankChecks, bounds_for, check_tensor, summarise
from accumcheck.report import DataParallelSetup, SingleProcessAgreement
from accumcheck.run.faults import round_to_bfloat16
from accumcheck.run.results import ParamAccumulation, RankAccumulation, RunResult

F32 = np.float32


def test_one_stage_is_the_plain_sum_bound():
    staged = ModeBound.for_stages([("float32", 31)])
    plain = ModeBound.for_sum("float32", 32)
    assert staged.roundings == plain.roundings == 31
    assert staged.relative == pytest.approx(plain.relative, rel=1e-9)


def test_stages_in_one_dtype_add_their_roundings_and_mixed_dtypes_multiply():
    same = ModeBound.for_stages([("float32", 15), ("float32", 1)])
    assert same.relative == pytest.approx(gamma(16, 2.0**-24) + gamma(16, 2.0**-53), rel=1e-9)
    mixed = ModeBound.for_stages([("float32", 15), ("bfloat16", 2)])
    g32, g16 = gamma(15, 2.0**-24), gamma(2, 2.0**-8)
    assert mixed.relative == pytest.approx(g32 + g16 + g32 * g16, rel=1e-9)
    assert mixed.dtype == "float32" and mixed.roundings == 17


def test_data_parallel_bounds_count_the_all_reduce():
    two = bounds_for("float32", "float32", 16, 2, "float32")
    assert two.native.roundings == 16  # 15 on the rank, 1 in the all-reduce; halving is exact
    assert two.manual.roundings == 16
    assert two.single_process.roundings == 31
    assert two.rank.roundings == 15
    assert two.reference is None
    three = bounds_for("float32", "float32", 16, 3, "float32")
    assert three.native.roundings == 15 + 2 + 1  # and one to divide by 3
    reduced = bounds_for("float32", "float32", 16, 2, "bfloat16")
    assert reduced.native.relative > 100 * two.native.relative  # bfloat16's u is 2^16 times float32's
    assert reduced.reference.relative == pytest.approx(two.native.relative)


def _sum32(terms, order):
    """Sequential float32 sum of terms[i] (arrays) in ``order``."""
    total = np.zeros_like(terms[0], F32)
    for i in order:
        total = (total + terms[i]).astype(F32)
    return total


def _sum_bf16(terms, order):
    """The same with every addition rounded to bfloat16."""
    total = np.zeros_like(terms[0], F32)
    for i in order:
        total = round_to_bfloat16((total + terms[i]).astype(F32))
    return total


@given(st.integers(1, 8), st.integers(1, 48), st.integers(0, 2**32 - 1), st.sampled_from(["float32", "bfloat16"]),
       st.sampled_from(["plain", "cancelling", "tiny"]))
def test_simulated_data_parallel_sums_are_inside_the_bounds(world, steps, seed, reduce_dtype, style):
    rng = np.random.default_rng(seed)
    g = rng.standard_normal((world, steps, 64))
    if style == "cancelling":
        g[:, 1::2] = -g[:, 0::2][:, : g[:, 1::2].shape[1]] * (1 + 1e-4 * rng.standard_normal())
    if style == "tiny":
        g *= 1e-38  # near float32's smallest normal: the floor term matters
    g = g.astype(F32)
    wide = g.astype(np.float64)
    exact, absum = wide.sum((0, 1)) / world, np.abs(wide).sum((0, 1)) / world
    b = bounds_for("float32", "float32", steps, world, reduce_dtype)
    ranks_order = rng.permutation(world)
    w = F32(world)
    # native: each rank sums its own micro-steps; the all-reduce divides and sums the ranks' totals
    totals = [_sum32(g[r], range(steps)) for r in range(world)]
    if reduce_dtype == "float32":
        native = _sum32([(t / w).astype(F32) for t in totals], ranks_order)
    else:  # DDP's bf16 hook: cast, divide in bfloat16, all-reduce in bfloat16
        native = _sum_bf16([round_to_bfloat16((round_to_bfloat16(t) / w).astype(F32)) for t in totals], ranks_order)
    # manual: every micro-step all-reduced (mean), then added up
    manual = _sum32([(_sum32(g[:, k], ranks_order) / w).astype(F32) for k in range(steps)], range(steps))
    # one process: every micro-batch in turn, then divided
    single = (_sum32(g.transpose(1, 0, 2).reshape(-1, 64), range(world * steps)) / w).astype(F32)
    for values, bound in ((native, b.native), (manual, b.manual), (single, b.single_process)):
        err = np.abs(values.astype(np.float64) - exact)
        assert np.all(err <= bound.relative * absum + bound.absolute), (bound, float((err / absum).max()))


def _run(native, manual, reference, locals_, finals, exact_ranks, absum_ranks):
    exact = sum(exact_ranks) / len(exact_ranks)
    absum = sum(absum_ranks) / len(absum_ranks)
    params = [ParamAccumulation("shared.weight", "weight", native, manual, exact, absum, reference=reference)]
    ranks = [RankAccumulation(r, "host", {"shared.weight": lo}, {"shared.weight": e}, {"shared.weight": s},
                              {"shared.weight": fi})
             for r, (lo, fi, e, s) in enumerate(zip(locals_, finals, exact_ranks, absum_ranks))]
    return RunResult(params=params, framework="torch", versions={}, device="cpu", param_dtype="float32",
                     accum_dtype="float32", ranks=ranks,
                     data_parallel=DataParallelSetup(world_size=len(ranks), backend="gloo", launcher="test",
                                                     reduce_dtype="float32", find_unused_parameters=False,
                                                     hosts=["host"], fault_rank=None, native="-", manual="-",
                                                     reference="-", micro_batches="-"))


def _two_ranks(steps=8, seed=0):
    rng = np.random.default_rng(seed)
    g = rng.standard_normal((2, steps, 16, 16)).astype(F32)
    locals_ = [_stream(g[r]) for r in range(2)]
    final = ((locals_[0] / F32(2)) + (locals_[1] / F32(2))).astype(F32)
    manual = _stream(((g[0] + g[1]) / F32(2)).astype(F32))
    reference = (_stream(g.transpose(1, 0, 2, 3).reshape(-1, 16, 16)) / F32(2)).astype(F32)
    wide = g.astype(np.float64)
    return g, locals_, final, manual, reference, [wide[r].sum(0) for r in range(2)], [np.abs(wide[r]).sum(0) for r in range(2)]


def _stream(micro):
    total = np.zeros(micro.shape[1:], F32)
    for m in micro:
        total = (total + m).astype(F32)
    return total


CASE = builtin_case("shared-weight")


def test_a_correct_data_parallel_run_is_faithful():
    g, locals_, final, manual, reference, e, s = _two_ranks()
    report = build_report(CASE, _run(final, manual, reference, locals_, [final, final.copy()], e, s), 8, None, False, 0)
    assert report.exit_code == 0
    assert report.data_parallel.ranks_agree and report.data_parallel.single_process.agree


def test_a_rank_whose_own_total_is_wrong_is_named():
    g, locals_, final, manual, reference, e, s = _two_ranks()
    locals_[1] = (locals_[1] - g[1, 3]).astype(F32)  # rank 1 dropped a micro-step before the all-reduce
    final = ((locals_[0] / F32(2)) + (locals_[1] / F32(2))).astype(F32)
    report = build_report(CASE, _run(final, manual, reference, locals_, [final, final], e, s), 8, None, False, 0)
    t = report.tensors[0]
    assert t.verdict == "diverged" and t.flagged_ranks == [1]
    assert [r.flagged for r in report.data_parallel.ranks] == [[], ["shared.weight"]]
    assert t.worst_mode == "rank 1"


def test_ranks_holding_different_gradients_after_the_all_reduce_disagree():
    g, locals_, final, manual, reference, e, s = _two_ranks()
    wrong = final.copy()
    wrong[0, 0] += 1.0
    report = build_report(CASE, _run(final, manual, reference, locals_, [final, wrong], e, s), 8, None, False, 0)
    assert not report.data_parallel.final_identical and not report.data_parallel.ranks_agree
    assert report.tensors[0].flagged_ranks == [1] and report.exit_code == 1


def test_a_run_that_differs_from_one_process_is_flagged():
    g, locals_, final, manual, reference, e, s = _two_ranks()
    # Native, manual, E and S all agree, but one process over the same batches got another sum:
    # as if the ranks had been fed other micro-batches than the job's.
    other = (reference + F32(1e-3)).astype(F32)
    report = build_report(CASE, _run(final, manual, other, locals_, [final, final], e, s), 8, None, False, 0)
    t = report.tensors[0]
    assert t.verdict == "diverged" and t.single_agreement > 1
    assert not report.data_parallel.single_process.agree
    assert t.flagged_ranks == []


def test_the_bounds_are_tight_enough_to_catch_a_coarse_all_reduce_and_a_lost_micro_step():
    rng = np.random.default_rng(1)
    g = rng.standard_normal((2, 16, 256)).astype(F32)
    wide = g.astype(np.float64)
    exact, absum = wide.sum((0, 1)) / 2, np.abs(wide).sum((0, 1)) / 2
    b = bounds_for("float32", "float32", 16, 2, "bfloat16")
    totals = [_sum32(g[r], range(16)) for r in range(2)]
    coarse = _sum_bf16([round_to_bfloat16((round_to_bfloat16(t) / F32(2)).astype(F32)) for t in totals], [0, 1])
    err = np.abs(coarse - exact)
    assert np.all(err <= b.native.relative * absum + b.native.absolute)
    assert np.any(err > b.reference.relative * absum + b.reference.absolute)  # a float32 all-reduce would not
    lost = _sum32([(_sum32(g[r, 1:], range(15)) / F32(2)).astype(F32) for r in range(2)], [0, 1])
    assert np.any(np.abs(lost - exact) > b.native.relative * absum + b.native.absolute)


# ----------------------------------------------------------------------------- by hand: exact ratios

QUARTER = ModeBound("float32", 1, 0.25, 0.0)  # |x - E| <= S / 4
EXACT = DataParallelBounds(native=QUARTER, manual=QUARTER, single_process=QUARTER, rank=QUARTER, reference=None)


def test_the_power_of_two_test_and_the_cast_into_a_narrower_reduce_dtype():
    one = bounds_for("float32", "float32", 16, 1, "float32")
    assert one.native.roundings == 15 and one.single_process.roundings == 15  # one rank: nothing to reduce
    narrow = bounds_for("float32", "float32", 16, 3, "bfloat16")
    assert narrow.native.roundings == 15 + 2 + 1 + 1  # the all-reduce, the cast to bfloat16, the division
    assert narrow.reference.roundings == 15 + 2 + 1  # the same all-reduce in float32: no cast
    assert narrow.manual.roundings == 2 + 1 + 15


def rank(r, local, exact, absum, final):
    return RankAccumulation(r, f"host{r}", {"w": np.asarray(local, F32)}, {"w": np.asarray(exact, float)},
                            {"w": np.asarray(absum, float)}, {"w": np.asarray(final, F32)})


def test_check_tensor_figures_and_candidates():
    exact, absum = np.array([8.0, 8.0]), np.array([4.0, 8.0])
    # native 1 from E at S = 4: ratio 1 against the native bound; one process 1.5 from E at S = 4.
    p = ParamAccumulation("w", "weight", np.array([9.0, 8.0], F32), np.array([8.0, 8.0], F32), exact, absum,
                          reference=np.array([6.5, 8.0], F32))
    ranks = [rank(0, [9.0, 8.0], exact, absum, [9.0, 8.0]),  # its own total: ratio 1 at element 0
             rank(1, [8.0, 8.0], exact, absum, [9.0, 8.0])]
    c = check_tensor(p, ranks, EXACT)
    assert c.figures["single_ratio"] == 1.5
    assert c.figures["single_agreement"] == 2.5 / 2.0  # |9 - 6.5| over the two bounds together, S/2
    assert c.figures["rank_local_ratios"] == [1.0, 0.0] and c.figures["rank_final_ratios"] == [1.0, 1.0]
    assert c.flagged_ranks == [] and c.ranks_identical
    assert [(k.mode, k.ratio, k.flat_index) for k in c.candidates] == [
        ("single-process", 1.5, 0), ("native vs single-process", 1.25, 0), ("rank 0", 1.0, 0), ("rank 1", 0.0, 0)]
    agree = c.candidates[1]
    assert agree.absum is p.absum and agree.bound == QUARTER.plus(QUARTER)
    assert c.candidates[0].bound == QUARTER and c.candidates[2].absum is ranks[0].absum["w"]


def test_a_rank_is_named_past_its_bound_or_alone_past_the_final_one():
    exact, absum = np.array([8.0]), np.array([4.0])
    p = ParamAccumulation("w", "weight", np.array([8.0], F32), np.array([8.0], F32), exact, absum)
    own = [rank(0, [9.5], exact, absum, [8.0]), rank(1, [9.0], exact, absum, [8.0])]  # ratios 1.5 and 1
    assert check_tensor(p, own, EXACT).flagged_ranks == [0]
    alone = [rank(0, [8.0], exact, absum, [9.5]), rank(1, [8.0], exact, absum, [9.0])]  # final: 1.5 and 1
    checked = check_tensor(p, alone, EXACT)
    assert checked.flagged_ranks == [0] and not checked.ranks_identical
    everyone = [rank(0, [8.0], exact, absum, [9.5]), rank(1, [8.0], exact, absum, [9.5])]
    assert check_tensor(p, everyone, EXACT).flagged_ranks == []  # a wrong average is no one rank's


def test_ranks_holding_the_same_nan_hold_the_same_gradient():
    exact, absum = np.array([8.0, 8.0]), np.array([4.0, 4.0])
    p = ParamAccumulation("w", "weight", np.array([8.0, 8.0], F32), np.array([8.0, 8.0], F32), exact, absum)
    ranks = [rank(r, [8.0, 8.0], exact, absum, [np.nan, 8.0]) for r in range(2)]
    assert check_tensor(p, ranks, EXACT).ranks_identical


def tensor(name, flagged_ranks, single_agreement=None):
    return SimpleNamespace(name=name, flagged_ranks=flagged_ranks, single_agreement=single_agreement)


def test_summarise_names_each_rank_and_the_worst_single_process_agreement():
    setup = DataParallelSetup(world_size=2, backend="gloo", launcher="test", reduce_dtype="float32",
                              find_unused_parameters=False, hosts=["host0", "host1"], fault_rank=None, native="-",
                              manual="-", reference="-", micro_batches="-")
    ranks = [rank(0, [0.0], [0.0], [0.0], [0.0]), rank(1, [0.0], [0.0], [0.0], [0.0])]
    same = RankChecks({"flagged_ranks": []})
    result = summarise(setup, ranks, [tensor("a", [1], 0.5), tensor("b", [], 1.0), tensor("c", None)], [same] * 3)
    assert result.setup is setup
    assert [(v.rank, v.host, v.flagged) for v in result.ranks] == [(0, "host0", []), (1, "host1", ["a"])]
    assert not result.ranks_agree and result.final_identical
    assert result.single_process == SingleProcessAgreement(worst_agreement=1.0, worst_tensor="b", agree=True)
    result = summarise(setup, ranks, [tensor("a", [0, 1], 1.5)], [RankChecks({}, ranks_identical=False)])
    assert result.ranks_agree is False and result.final_identical is False
    assert result.single_process == SingleProcessAgreement(1.5, "a", False)
    result = summarise(setup, ranks, [tensor("a", [])], [same])
    assert result.ranks_agree and result.single_process == SingleProcessAgreement(0.0, "", True)


def test_a_data_parallel_report_records_every_bound_and_the_setup():
    g, locals_, final, manual, reference, e, s = _two_ranks()
    run = _run(final, manual, reference, locals_, [final, final.copy()], e, s)
    report = build_report(CASE, run, 8, None, False, 0)
    b = bounds_for("float32", "float32", 8, 2, "float32")
    assert report.bound == {"native": vars(b.native), "manual": vars(b.manual),
                            "single_process": vars(b.single_process), "rank": vars(b.rank)}
    assert report.data_parallel.setup is run.data_parallel
    t = report.tensors[0]
    assert len(t.rank_local_ratios) == len(t.rank_final_ratios) == 2 and t.flagged_ranks == []
