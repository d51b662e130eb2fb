"""The trajectory's verdict (``accumcheck train``), framework-free: native's gap from manual judged
against the control's (manual's micro-batches summed last to first, a second valid order); a
report from before the control judged by the one-ulp band as it was; inf or nan told apart by
whether a valid order went there too."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from accumcheck.errors import AccumcheckError
from accumcheck.report import TrajectoryReport, report_from_data
from accumcheck.run.trajectory import MARGIN, Trajectory, judge


def _run(native_gaps: list[float], control_gaps: list[float], losses=None) -> TrajectoryReport:
    """Two steps of one tensor whose parameters are 1.0 in manual, 1 + native gap in native and
    1 + control gap in the control."""
    trace = Trajectory({"w": "weight"})
    for step, (gap, control) in enumerate(zip(native_gaps, control_gaps)):
        for mode in ("native", "manual", "control"):
            trace.loss(mode, step, (losses or {}).get((mode, step), 0.5))
        trace.record(step, {"w": np.array([1.0 + gap])}, {"w": np.array([1.0])}, {"w": np.array([1.0 + control])})
    return trace.report("toy", "adam", 1e-3, 4, len(native_gaps), None, {})


def test_a_gap_as_wide_as_the_controls_is_amplified_round_off():
    report = _run([1e-6, 3e-5], [2e-6, 1e-5])  # both far past one ulp (1.2e-7), within the control's band
    assert report.exit_code == 0 and report.first_out_of_band == {"w": 0} and not report.first_out_of_control
    assert report.summary().startswith("OK: amplified round-off, as two valid orders differ")
    assert report.control_ratio["weight"] == pytest.approx([0.5, 3.0])
    assert report.control_diff["weight"] == pytest.approx([2e-6, 1e-5])


def test_a_gap_past_the_margin_is_flagged_at_its_first_step():
    report = _run([1e-6, 1e-6 * MARGIN * 2], [1e-6, 1e-6])
    assert report.exit_code == 1 and report.first_out_of_control == {"w": 1}
    assert report.summary().startswith(f"FLAGGED at step 1 (w): native is {2 * MARGIN:g}x further from manual than "
                                       "the control")


def test_the_one_ulp_band_is_the_floor_where_the_control_agrees_with_manual():
    ulp = float(np.spacing(np.float32(1.0)))
    assert judge(3 * ulp, 0.0, ulp) == pytest.approx(3.0) and judge(0.0, 0.0, 0.0) == 0.0
    report = _run([ulp, MARGIN * ulp / 2], [0.0, 0.0])
    assert report.exit_code == 0 and report.summary().startswith("OK: amplified round-off")
    assert _run([0.0, 2 * MARGIN * ulp], [0.0, 0.0]).exit_code == 1


def test_identical_and_in_band_runs_say_so():
    assert _run([0.0, 0.0], [1e-6, 1e-6]).summary() == "OK: native and manual identical for all 2 adam steps"
    ulp = float(np.spacing(np.float32(1.0)))
    assert "within one float32 ulp" in _run([ulp, 0.0], [0.0, 0.0]).summary()


def test_non_finite_in_native_alone_is_the_accumulation_and_in_the_control_too_the_training():
    alone = _run([0.0, 0.0], [0.0, 0.0], losses={("native", 1): float("nan")})
    assert alone.exit_code == 1 and alone.non_finite_modes == {"native": 1}
    assert "native went inf or nan while manual and the control" in alone.summary()
    every = _run([0.0, 0.0], [0.0, 0.0], losses={(mode, 1): float("inf") for mode in ("native", "manual", "control")})
    assert every.exit_code == 1 and every.summary().startswith("NON-FINITE at step 1 (loss (native), loss (manual), "
                                                               "loss (control))")
    assert "manual and control, valid summation orders, went inf or nan at that step too" in every.summary()
    assert "lower --lr" in every.summary()


def test_the_report_round_trips_and_a_report_from_before_the_control_keeps_its_band_verdict():
    report = _run([1e-6, 1e-6 * MARGIN * 2], [1e-6, 1e-6])
    text = report.to_json()
    again = report_from_data(json.loads(text))
    assert again.to_json() == text and again.margin == MARGIN and again.summary() == report.summary()
    old = json.loads(text)
    for name in ("control_diff", "control_ratio", "margin", "first_out_of_control", "non_finite_modes"):
        del old[name]
    old["losses"].pop("control")
    before = report_from_data(old)
    assert before.margin is None and before.exit_code == 1
    assert before.summary() == "LEFT THE ROUND-OFF BAND at step 0 (w); 1 tensor(s) by step 1"


@pytest.mark.parametrize("edit, problem", [
    (lambda d: d["first_out_of_control"].clear(), "control_ratio['weight']: past the margin at step 1, but "
                                                  "first_out_of_control names no tensor by then"),
    (lambda d: d["control_ratio"]["weight"].pop(), "control_ratio['weight']: 1 values for 2 steps"),
    (lambda d: d.update(margin=None), "margin: none, but the report has a control"),
    (lambda d: d.update(margin=0.5), "margin: 0.5 is less than 1.0"),
    (lambda d: d["non_finite_modes"].update(bogus=0), "non_finite_modes['bogus']: 'bogus' is not a mode of losses"),
])
def test_a_control_that_disagrees_with_itself_is_refused_naming_the_field(edit, problem):
    data = json.loads(_run([1e-6, 1e-6 * MARGIN * 2], [1e-6, 1e-6]).to_json())
    edit(data)
    with pytest.raises(AccumcheckError) as caught:
        report_from_data(data)
    assert str(caught.value).startswith(f"<report>: {problem}")


def test_the_margin_is_the_one_the_committed_measurement_justifies():
    """benchmarks/bench_trajectory_margin.py's last run (docs/trajectory.md quotes it): every
    faithful run passes with room to spare (on both kernel sets), and nearly every fault is flagged."""
    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("bench", root / "benchmarks" / "bench_trajectory_margin.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    data = json.loads((root / "benchmarks" / "results" / "bench_trajectory_margin.json").read_text())
    assert data["margin"] == MARGIN
    found = bench.summarise(data["rows"], MARGIN)
    assert found["faithful_runs"] >= 80 and found["faithful_flagged"] == 0
    assert found["faithful_max"] * 3 <= MARGIN
    assert found["faults_flagged"] >= 0.9 * found["fault_runs"]
    assert {r["framework"].split()[0] for r in data["rows"]} == {"torch", "mxnet", "jax"}
    assert {r["kernels"] for r in data["rows"] if bench.kind_of(r) == "faithful"} == {"baseline", "own"}
