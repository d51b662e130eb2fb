"""Every report kind through the one JSON codec: this schema round-trips exactly, schema version 1
(accumcheck 0.1.0) is upgraded, other versions are refused in one line."""

import json
from pathlib import Path

import pytest

from accumcheck.errors import AccumcheckError
from accumcheck.report import CrossReport, Report, SweepReport, load_report, report_from_data

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
    for changed, message in (({"schema_version": 99}, "report schema_version 99 is not supported"),
                             ({"kind": "poem"}, "unknown report kind 'poem'"),
                             ({"tensors": "many"}, "not an accumcheck report")):
        path = tmp_path / "r.json"
        path.write_text(json.dumps({**data, **changed}))
        with pytest.raises(AccumcheckError, match=message) as info:
            load_report(path)
        assert "\n" not in str(info.value)
