"""Every report kind through the one JSON codec: this schema round-trips exactly, schema version 1
(accumcheck 0.1.0) is upgraded, other versions are refused in one line; every report the judge
writes, from any gradients, is read back strictly, and the strict reader's table names real fields."""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from accumcheck.errors import AccumcheckError, NothingJudgedError
from accumcheck.judge import build_report
from accumcheck.report import (
    CROSS_VERDICTS,
    KIND_ORDER,
    SEVERITIES,
    VERDICTS,
    Agreement,
    Cause,
    CrossReport,
    Report,
    SweepReport,
    TensorResult,
    load_report,
    report_from_data,
)
from accumcheck.report.schema import FIELDS, INT_LIMIT, LongInteger, check_data, parse_int
from accumcheck.report.tensor import CAUSE_KINDS
from accumcheck.report.values import FieldError
from accumcheck.run.results import FullBatchGap, ParamAccumulation, RunResult
from accumcheck.run.trajectory import Trajectory

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "reports-0.1.0"


@pytest.mark.parametrize("name, kind", [("torch-double-step", Report), ("cross", CrossReport), ("sweep", SweepReport),
                                        ("data-parallel", Report), ("full-batch", Report)])
def test_version_1_is_upgraded_and_the_upgrade_round_trips_exactly(name, kind):
    data = json.loads((FIXTURES / f"{name}.json").read_text())
    assert data["schema_version"] == 1
    report = kind.from_dict(data)
    assert report.schema_version == 2 and report.kind == data.get("kind", "report")
    text = report.to_json()
    assert json.loads(text)["schema_version"] == 2
    assert kind.from_dict(json.loads(text)).to_json() == text


def test_a_version_1_report_keeps_what_it_said():
    data = json.loads((FIXTURES / "torch-double-step.json").read_text())
    report = report_from_data(data)
    assert [(t.name, t.verdict, t.ratio) for t in report.tensors] == [
        (t["name"], t["verdict"], t["ratio"]) for t in data["tensors"]]
    assert report.config["inject"] == "double-step:shared.weight" and report.config["accum_steps"] == 4
    assert report.reproduce_command() == ("accumcheck compare --framework torch --device cpu --case shared-weight "
                                          "--accum-steps 4 --seed 0 --inject double-step:shared.weight")


def test_other_versions_and_kinds_are_refused_in_one_line(tmp_path):
    data = json.loads((FIXTURES / "torch-double-step.json").read_text())
    with pytest.raises(TypeError, match="schema_version 99 is not one this accumcheck reads"):
        Report.from_dict({**data, "schema_version": 99})
    for changed, message in (({"schema_version": 99}, "report schema_version 99 is not supported by this accumcheck, "
                                                       "which reads up to 2: the report was written by a newer "
                                                       "accumcheck; upgrade accumcheck"),
                             ({"kind": "poem"}, "unknown report kind 'poem'"),
                             ({"tensors": "many"}, "not an accumcheck report")):
        path = tmp_path / "r.json"
        path.write_text(json.dumps({**data, **changed}))
        with pytest.raises(AccumcheckError, match=message) as info:
            load_report(path)
        assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------- strict reading


def test_every_rule_of_the_table_names_a_field_of_its_class_and_takes_the_modules_own_words():
    for cls, rules in FIELDS.items():
        names = {f.name for f in dataclasses.fields(cls)}
        assert set(rules) <= names, (cls.__name__, set(rules) - names)
    for rule, words in ((FIELDS[TensorResult]["verdict"], VERDICTS), (FIELDS[TensorResult]["kind"], KIND_ORDER),
                        (FIELDS[TensorResult]["severity"], SEVERITIES), (FIELDS[Agreement]["verdict"], CROSS_VERDICTS),
                        (FIELDS[Cause]["kind"], CAUSE_KINDS)):
        assert all(rule(word) is None for word in words)
        assert rule("bogus") and rule("") and rule(words[0].upper()) and rule(None)


def test_the_raw_data_is_refused_by_the_field_that_holds_text_not_unicode_or_an_integer_past_64_bits():
    for data, path in (({"tensors": [{"name": "ok"}, {"name": "a\ud800"}]}, "tensors[1].name"),
                       ({"versions": {"\udc80": "1"}}, "versions['\\udc80']"),
                       ({"config": {"seed": INT_LIMIT}}, "config.seed"),
                       ({"tensors": [{"shape": [1, -INT_LIMIT - 1]}]}, "tensors[0].shape[1]"),
                       ({"accum_steps": LongInteger(5000)}, "accum_steps")):
        with pytest.raises(FieldError) as info:
            check_data(data)
        assert info.value.path == path
    check_data({"seed": INT_LIMIT - 1, "name": "caf\u00e9 \u2603", "n": [-INT_LIMIT]})  # fine as they are


def test_an_integer_too_long_for_the_parser_is_kept_as_its_digit_count():
    data = json.loads('{"a": 12, "b": -' + "9" * 5000 + "}", parse_int=parse_int)
    assert data == {"a": 12, "b": LongInteger(5000)}


def test_a_report_read_strictly_names_the_field_in_one_line():
    data = json.loads((FIXTURES / "torch-double-step.json").read_text())
    data["tensors"][2]["verdict"] = "later"
    with pytest.raises(AccumcheckError, match=r"^r\.json: tensors\[2\]\.verdict: 'later' is not one of identical, "
                                              r"round-off, .*; upgrade accumcheck if a newer one wrote the report"):
        report_from_data(data, "r.json")


# Gradients of every kind: ordinary, zero, tiny, huge and non-finite (an inf or nan in the float64
# sum E is one in both modes too: they add the same micro-gradients).
VALUES = st.floats(width=32) | st.sampled_from([0.0, -0.0, 1e-30, 1.0, -1.0, 3e38, math.inf, math.nan])


@st.composite
def accumulations(draw, name):
    shape = tuple(draw(st.lists(st.integers(1, 3), max_size=3)))
    size = math.prod(shape)

    def array():
        return np.array(draw(st.lists(VALUES, min_size=size, max_size=size)), np.float64).reshape(shape)

    exact = array()
    native = (exact if draw(st.booleans()) else array()).astype(np.float32)
    manual = (native if draw(st.booleans()) else array()).astype(np.float32)
    broken = ~np.isfinite(exact)
    native[broken], manual[broken] = exact[broken], exact[broken]
    absum = np.abs(exact) * draw(st.sampled_from([1.0, 3.0, 1e6])) if draw(st.booleans()) else np.abs(array())
    return ParamAccumulation(name, draw(st.sampled_from(KIND_ORDER)), native, manual, exact, absum,
                             oracle=array() if draw(st.booleans()) else None,
                             steps_with_grad=draw(st.none() | st.integers(0, 1)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_every_report_the_judge_writes_is_read_back_strictly_bit_for_bit(data):
    params = [data.draw(accumulations(f"layer{i}.weight")) for i in range(data.draw(st.integers(1, 3)))]
    gap = None
    if data.draw(st.booleans()):
        factor = data.draw(st.sampled_from([1.0, 0.5, 2.0]))
        gap = FullBatchGap("mean", "1/N", {p.name: p.exact * factor for p in params}, {p.name: p.exact for p in params})
    run = RunResult(params=params, framework="torch", versions={"torch": "2"}, device="cpu",
                    param_dtype=data.draw(st.sampled_from(["float32", "bfloat16", "float16"])),
                    accum_dtype=data.draw(st.sampled_from(["float32", "float64"])), full_batch=gap,
                    grad_scale=data.draw(st.none() | st.just(1024.0)))
    try:
        report = build_report(None, run, data.draw(st.integers(1, 64)), None, False, 0.0, {"model": "Net"})
    except NothingJudgedError:
        assume(False)
    for tensor in report.tensors:
        event(tensor.verdict)
    text = report.to_json()
    again = report_from_data(json.loads(text))
    assert again.to_json() == text and again.exit_code == report.exit_code


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(width=32), st.floats(width=32), st.floats(width=32), st.floats(width=32)),
                min_size=1, max_size=4),
       st.integers(0, 2))
def test_every_trajectory_is_read_back_strictly_bit_for_bit(steps, missing):
    trajectory = Trajectory({"w": "weight", "b": "bias"})
    for step, (loss, a, b, c) in enumerate(steps):
        for mode in ("native", "manual", "control"):
            trajectory.loss(mode, step, loss)
        trajectory.record(step, {"w": np.array([a, 1.0]), "b": np.array([b])}, {"w": np.array([1.0, a]), "b": [a]},
                          {"w": np.array([c, a]), "b": [c]})
    if missing:  # the run stopped: the steps not run are nan
        trajectory.diverged("optimizer update (overflow)", len(steps) - 1)
    report = trajectory.report("c", "adam", 1e-3, 2, len(steps) + missing, None, {})
    text = report.to_json()
    again = report_from_data(json.loads(text))
    assert again.to_json() == text and again.exit_code == report.exit_code and again.summary() == report.summary()
