"""Cross-framework agreement: torch and MXNet on the same weights and data."""

import json

import numpy as np
import pytest
from conftest import run_cli

import accumcheck
from accumcheck.case.reading import builtin_case, builtin_case_names

pytest.importorskip("torch")
mx = pytest.importorskip("mxnet")
FIXED = tuple(int(x) for x in mx.__version__.split(".")[:2]) >= (1, 7)


@pytest.mark.parametrize("case", builtin_case_names())
def test_frameworks_agree_on_every_case(case):
    cross = accumcheck.compare_frameworks(case, frameworks=("torch", "mxnet"), accum_steps=16)
    assert [a.verdict for a in cross.agreement if a.flagged] == []
    assert all(a.ratio <= 1 for a in cross.agreement)
    assert any(a.verdict == "agree" for a in cross.agreement)  # different kernels, different bits
    assert cross.forward.in_float32_units < 64  # logits agree to a few float32 round-offs
    assert cross.exit_code == (0 if FIXED or case != "shared-weight" else 1)


@pytest.mark.parametrize("relative", [1e-3, 1e-5])
def test_a_weight_changed_in_one_framework_is_caught(relative):
    weights = builtin_case("embed-attention").weights()
    weights["block0.ffn.weight"] = (weights["block0.ffn.weight"] * np.float32(1 + relative)).astype(np.float32)
    cross = accumcheck.compare_frameworks("embed-attention", accum_steps=16, weights={"mxnet": weights})
    flagged = {a.name for a in cross.flagged}
    assert "block0.ffn.weight" in flagged and cross.exit_code == 1
    # each framework on its own is still faithful: only the comparison sees it
    assert all(r.exit_code == 0 for r in cross.reports)


def test_one_framework_is_not_a_comparison():
    with pytest.raises(accumcheck.AccumcheckError, match="name two frameworks"):
        accumcheck.compare_frameworks("tiny-grads", frameworks=("torch", "torch"))


def test_cli_cross_report_round_trips(tmp_path):
    out = tmp_path / "cross.json"
    result = run_cli("compare", "--framework", "torch,mxnet", "--case", "tiny-grads", "--accum-steps", "8",
                     "--format", "json", "--output", str(out))
    assert result.returncode == 0, result.stderr
    assert "torch vs mxnet: all 4 tensors agree within the bound" in result.stdout
    data = json.loads(out.read_text())
    assert data["kind"] == "cross" and [r["framework"] for r in data["reports"]] == ["torch", "mxnet"]
    shown = run_cli("show", str(out))
    assert shown.returncode == 0
    assert "manual accumulation: torch vs mxnet" in shown.stdout and "forward (logits of micro-batch 0)" in shown.stdout
    again = run_cli("show", str(out), "--format", "json")
    assert json.loads(again.stdout) == data
    md = run_cli("show", str(out), "--format", "markdown")
    assert "## torch vs mxnet: manual accumulations" in md.stdout


def test_cli_mxnet_imperative_and_its_reproduce_line():
    result = run_cli("compare", "--framework", "mxnet", "--case", "tiny-grads", "--accum-steps", "4", "--no-hybridize")
    assert result.returncode == 0, result.stderr
    assert "imperative" in result.stdout
    assert "--no-hybridize" in result.stdout  # the reproduce line
    assert result.stderr == ""  # MXNet's storage-fallback chatter stays out of the terminal
