"""``accumcheck compare --repro`` on MXNet Gluon: every built-in case's script, run on its own, says
what accumcheck said and computes the very same gradients, hybridized or not."""

from __future__ import annotations

import pytest
from repro_checks import ODD_CASE, assert_reproduces, run_script, write_case_script

from accumcheck.case.reading import builtin_case_names
from accumcheck.options.choices import FAULT_KINDS

pytest.importorskip("mxnet")


@pytest.mark.parametrize("inject", [None, "drop-step"])
@pytest.mark.parametrize("case", builtin_case_names())
def test_every_case_reproduces_bit_for_bit(tmp_path, case, inject):
    assert_reproduces(tmp_path, "mxnet", case, inject, steps=4)


@pytest.mark.parametrize("case", ["conditional-branch", "embed-attention"])
def test_an_imperative_run_is_reproduced_imperatively(tmp_path, case):
    assert_reproduces(tmp_path, "mxnet", case, "double-step", steps=4, hybridize=False)
    text = (tmp_path / "repro.py").read_text()
    assert "HYBRIDIZE = False" in text and "imperative" in text



@pytest.mark.parametrize("options", [{"loss_reduction": "token_count"}, {"loss_reduction": "sum", "seed": 5}])
def test_every_loss_normalisation_reproduces(tmp_path, options):
    assert_reproduces(tmp_path, "mxnet", "padded-tokens", "drop-step", steps=4, **options)


def test_a_case_file_with_odd_names_reproduces(tmp_path):
    (tmp_path / "odd.toml").write_text(ODD_CASE)
    assert_reproduces(tmp_path, "mxnet", str(tmp_path / "odd.toml"), "scale", steps=4)


@pytest.mark.slow
@pytest.mark.parametrize("inject", [None, *FAULT_KINDS])
@pytest.mark.parametrize("case", builtin_case_names())
def test_every_case_and_fault_reproduces_at_the_cases_own_n(tmp_path, case, inject):
    assert_reproduces(tmp_path, "mxnet", case, inject, steps=None)


def test_the_script_says_how_mxnet_accumulated_and_what_it_allowed(tmp_path):
    _, _, report, files = write_case_script(tmp_path, "mxnet", "shared-weight", "bf16", steps=4)
    text = files.script.read_text()
    assert "grad_req='add', hybridized with static_alloc=True" in text and "HYBRIDIZE = True" in text
    assert f"KERNEL_ALLOWANCE = {report.bound['native']['kernel_allowance']!r}" in text
    assert "def bfloat16(values):" in text and "--inject bf16:shared.weight" in text
    files.script.write_text(text.replace("FAULT_PARAM = 'shared.weight'", "FAULT_PARAM = None"))
    run = run_script(files.script)
    assert run.returncode == 0 and "AGREE:" in run.stdout
