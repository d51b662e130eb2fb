"""Saved reports, altered anywhere: ``accumcheck show`` either renders them with their verdict (exit
0 or 1) or refuses them in one line (exit 2). Never an internal error, never a traceback; and a
flagged report never reads as faithful, whatever its flagged tensor's verdict is changed to.

Each example takes a real report (the 0.1.0 fixtures and a fresh one of every kind), walks to a
random place in it and puts a random JSON value there, or deletes the key. Unaltered, every one of
them is read back strictly to the same bits.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from conftest import needs_torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accumcheck.cli import main
from accumcheck.report import FLAGGED_VERDICTS, VERDICTS, report_from_data

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "reports-0.1.0"

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["", "nan", "inf", "-inf", "diverged", "weight", "x" * 300]) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    found = [json.loads(path.read_text()) for path in sorted(FIXTURES.glob("*.json"))]
    folder = tmp_path_factory.mktemp("fresh")
    for name, argv in (("report", ["compare", "--case", "tiny-grads", "--accum-steps", "2", "--full-batch"]),
                       ("flagged", ["compare", "--case", "tiny-grads", "--accum-steps", "2", "--inject", "scale"]),
                       ("sweep", ["sweep", "--case", "tiny-grads", "--accum-steps", "1,2"]),
                       ("trajectory", ["train", "--case", "tiny-grads", "--accum-steps", "2", "--steps", "2"])):
        path = folder / f"{name}.json"
        if name == "trajectory":
            assert main([*argv, "--output", str(path)]) == 0
        else:
            assert main([*argv, "--format", "json", "--output", str(path)]) == (name == "flagged")
        found.append(json.loads(path.read_text()))
    return found


def _alter(data: dict, draw) -> dict:
    """``data`` with one place (chosen by ``draw``) replaced by a random value or deleted."""
    data = json.loads(json.dumps(data))
    holder, key = None, None
    node = data
    while isinstance(node, (dict, list)) and node and draw(st.booleans()):
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        holder, key = node, draw(st.sampled_from(keys))
        node = node[key]
    if holder is None:
        keys = list(data)
        holder, key = data, draw(st.sampled_from(keys))
    if isinstance(holder, dict) and draw(st.booleans()):
        del holder[key]
    else:
        holder[key] = draw(JSON_VALUES)
    return data


@needs_torch
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_an_altered_report_is_shown_or_refused_never_crashes(reports, data, capsys):
    original = data.draw(st.sampled_from(reports))
    altered = _alter(original, data.draw)
    fmt = data.draw(st.sampled_from(["table", "json", "markdown", "csv", "html"]))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "r.json"
        path.write_text(json.dumps(altered))
        code = main(["show", str(path), "--format", fmt])
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "internal error" not in err, err
    assert code in (0, 1, 2), (code, err)
    if code == 2:
        assert len(err.strip().splitlines()) == 1, err


@needs_torch
def test_every_report_as_written_is_read_back_strictly_to_the_same_bits(reports):
    for data in reports:
        text = report_from_data(json.loads(json.dumps(data))).to_json()
        if data["schema_version"] == 2:  # this version's, as written; version 1's, as upgraded
            assert json.loads(text) == data
        assert report_from_data(json.loads(text)).to_json() == text


def _flagged_tensors(data: dict) -> list[dict]:
    """The flagged tensors of a report's data, in every report it holds."""
    held = data.get("reports", [data]) if data.get("kind") in ("cross", "sweep") else [data]
    return [t for r in held for t in r.get("tensors", []) if t.get("verdict") in FLAGGED_VERDICTS]


@needs_torch
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_a_flagged_tensor_changed_to_any_verdict_never_reads_as_faithful(reports, data, capsys):
    flagged = [r for r in reports if _flagged_tensors(r)]
    altered = json.loads(json.dumps(data.draw(st.sampled_from(flagged))))
    for tensor in _flagged_tensors(altered):  # every flagged tensor, so that none is left to flag the report
        tensor["verdict"] = data.draw(st.sampled_from(VERDICTS) | JSON_VALUES)
        if data.draw(st.booleans()):
            tensor["severity"] = None
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "r.json"
        path.write_text(json.dumps(altered))
        code = main(["show", str(path), "--format", "json"])
    out, err = capsys.readouterr()
    assert code in (1, 2), (code, err)
    assert "Traceback" not in err and "internal error" not in err, err
