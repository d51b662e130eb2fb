"""``accumcheck compare --repro`` on PyTorch: every built-in case's script, run on its own, says what
accumcheck said and computes the very same gradients; ``--shrink`` ends smaller and still flagged."""

from __future__ import annotations

import numpy as np
import pytest
from repro_checks import ODD_CASE, assert_reproduces, run_script, write_case_script

import accumcheck
from accumcheck import api
from accumcheck.case.reading import builtin_case, builtin_case_names, load_case
from accumcheck.options.choices import FAULT_KINDS
from accumcheck.repro.shrink import size
from accumcheck.run.validation import configure

pytest.importorskip("torch")


@pytest.mark.parametrize("inject", [None, "drop-step"])
@pytest.mark.parametrize("case", builtin_case_names())
def test_every_case_reproduces_bit_for_bit(tmp_path, case, inject):
    assert_reproduces(tmp_path, "torch", case, inject, steps=4)



@pytest.mark.parametrize("options", [{"loss_reduction": "token_count"}, {"loss_reduction": "sum", "seed": 5}])
def test_every_loss_normalisation_reproduces(tmp_path, options):
    assert_reproduces(tmp_path, "torch", "padded-tokens", "drop-step", steps=4, **options)


def test_a_case_file_with_odd_names_reproduces(tmp_path):
    (tmp_path / "odd.toml").write_text(ODD_CASE)
    assert_reproduces(tmp_path, "torch", str(tmp_path / "odd.toml"), "scale", steps=4)


@pytest.mark.slow
@pytest.mark.parametrize("inject", [None, *FAULT_KINDS])
@pytest.mark.parametrize("case", builtin_case_names())
def test_every_case_and_fault_reproduces_at_the_cases_own_n(tmp_path, case, inject):
    assert_reproduces(tmp_path, "torch", case, inject, steps=None)


def test_the_faults_lines_are_in_the_script_and_only_there(tmp_path):
    _, _, _, files = write_case_script(tmp_path, "torch", "shared-weight", "scale", steps=4)
    text = files.script.read_text()
    assert "--inject scale:shared.weight" in text and "FAULT_PARAM = 'shared.weight'" in text
    assert "return grad * 1.001" in text
    # without the fault's lines the same script agrees
    files.script.write_text(text.replace("FAULT_PARAM = 'shared.weight'", "FAULT_PARAM = None"))
    run = run_script(files.script)
    assert run.returncode == 0 and "AGREE:" in run.stdout


def test_the_docstring_says_what_is_reproduced_and_how_to_run_it(tmp_path):
    _, _, report, files = write_case_script(tmp_path, "torch", "conditional-branch", "drop-step", steps=4)
    doc = " ".join(files.script.read_text().split('"""')[1].split())
    for words in ("case conditional-branch", "torch " + report.versions["torch"], "N = 4", "seed 0",
                  "inp.weight diverged", "python repro.py", "repro.npz", "--inject drop-step:inp.weight",
                  "micro-step 2's gradient of inp.weight never reaches the native total"):
        assert words in doc, words
    assert f"{report.flagged[0].ratio_native:.3g} x its round-off bound" in doc


def test_compare_writes_the_script_from_the_python_api(tmp_path):
    report = accumcheck.compare("tiny-grads", framework="torch", accum_steps=4, inject="repeat-step",
                                repro=tmp_path / "r.py")
    assert report.exit_code == 1 and (tmp_path / "r.py").is_file() and (tmp_path / "r.npz").is_file()
    run = run_script(tmp_path / "r.py")
    assert run.returncode == 1 and "dense0.weight" in run.stdout
    with pytest.raises(accumcheck.AccumcheckError, match="give the script a .py name"):
        accumcheck.compare("tiny-grads", framework="torch", accum_steps=2, repro=tmp_path / "r.sh")


def test_shrink_ends_smaller_and_still_flagged(tmp_path):
    config = configure({"case": "padded-tokens", "framework": "torch", "inject": "drop-step"})
    report = api.run(config)
    lines: list[str] = []
    files = api.write_repro(report, config, tmp_path / "repro.py", shrink=True, log=lines.append, max_trials=12)
    shrunk = load_case(files.case)
    before, after = size(builtin_case("padded-tokens"), config.accum_steps), size(shrunk, shrunk.accum_steps)
    assert all(after[m] <= before[m] for m in before) and after["parameters"] < before["parameters"]
    assert any(line.startswith("shrink: kept ") for line in lines)
    assert lines[-1].startswith("shrunk padded-tokens: ") and f"N {config.accum_steps} -> " in lines[-1]
    again = accumcheck.compare(files.case, framework="torch", inject="drop-step:embed.weight")
    assert again.exit_code == 1 and "embed.weight" in [t.name for t in again.flagged]
    run = run_script(files.script)
    assert run.returncode == 1 and "embed.weight" in run.stdout
    assert "Shrunk by accumcheck compare --shrink from case padded-tokens" in " ".join(
        files.script.read_text().split('"""')[1].split())
    data = np.load(files.data)
    assert sorted(k for k in data.files if k.startswith("inputs/")) == [f"inputs/{k}" for k in
                                                                        range(shrunk.accum_steps)]


def test_shrink_of_a_run_that_flagged_nothing_says_so_and_writes_the_case_as_it_is(tmp_path):
    config = configure({"case": "shared-weight", "framework": "torch", "accum_steps": 4})
    lines: list[str] = []
    files = api.write_repro(api.run(config), config, tmp_path / "repro.py", shrink=True, log=lines.append)
    assert lines == ["--shrink: case shared-weight flagged nothing, so there is nothing to shrink; the script "
                     "reproduces the case as it is"]
    assert not files.case.exists() and run_script(files.script).returncode == 0
