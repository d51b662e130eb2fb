"""The pytest plugin, exercised on fresh test files with pytester."""

import importlib
import importlib.util
import json

import pytest
from conftest import needs_torch

# Import the frameworks here, once: pytester's in-process runs drop modules first imported inside
# them, and a C extension such as torch cannot be imported a second time. Runs that compute with
# torch go to a subprocess.
for _framework in ("torch", "mxnet", "jax"):
    if importlib.util.find_spec(_framework):
        importlib.import_module(_framework)

USER_TESTS = """
import accumcheck

def test_faithful_model(accum_steps, accum_framework, accum_device):
    report = accumcheck.compare("shared-weight", framework=accum_framework, device=accum_device,
                                accum_steps=accum_steps)
    accumcheck.assert_faithful(report)

def test_faulty_model(accum_steps, accum_framework, accum_device):
    report = accumcheck.compare("shared-weight", framework=accum_framework, device=accum_device,
                                accum_steps=accum_steps, inject="scale")
    accumcheck.assert_faithful(report)
"""


@needs_torch
def test_fixtures_and_assertion_on_a_fresh_test_file(pytester):
    pytester.makepyfile(USER_TESTS)
    # In a subprocess: torch imports parts of itself lazily, which an in-process run would drop.
    result = pytester.runpytest_subprocess("--accum-steps", "4,8", "--accum-framework", "torch")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines([
        "accumcheck: --accum-steps 4,8 --accum-framework torch --accum-device cpu*",
        "*test_faulty_model*N4-torch-cpu*",
        "*Gradient accumulation is not faithful (case shared-weight, torch on cpu, N = 4)*",
        "*shared.weight (weight, 16x16, float32): diverged*",
        "*Mismatched elements: 256 / 256 (100.0%)*",
        "*Greatest absolute difference: * at index (*",
        "*Worst element (*): native is *x its round-off bound*",
        "*manual is nearer*",
        "*Reproduce: accumcheck compare --framework torch --device cpu --case shared-weight --accum-steps 4*",
    ])
    text = result.stdout.str()
    assert "raise AccumulationMismatch" not in text  # __tracebackhide__: the user's line is shown
    assert "accumcheck.assert_faithful(report)" in text


@pytest.mark.parametrize("args, message", [
    (["--accum-steps", "0"], "argument --accum-steps: '0' is not a positive integer"),
    (["--accum-steps", "16,x"], "argument --accum-steps: 'x' is not a positive integer"),
    (["--accum-framework", "tensorflow"], "argument --accum-framework: 'tensorflow' is not a framework here (known: "),
    (["--accum-device", "tpu"], "argument --accum-device: unknown device 'tpu'; use cpu, gpu, cuda or cuda:N"),
    (["--accum-case", "nope"], "argument --accum-case: unknown case 'nope'; built-in cases:"),
])
def test_bad_option_values_are_usage_errors(pytester, args, message):
    pytester.makepyfile("def test_nothing(): pass")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}*"])


def test_parametrisation_covers_every_combination(pytester):
    pytester.makepyfile("""
        def test_combo(accum_steps, accum_framework, accum_device, accum_case):
            pass
    """)
    result = pytester.runpytest("--accum-steps", "16,32", "--accum-framework", "torch,mxnet",
                                "--accum-case", "tiny-grads,shared-weight", "--collect-only", "-q")
    ids = [line for line in result.stdout.lines if "test_combo[" in line]
    assert len(ids) == 2 * 2 * 2
    assert any("N16-torch-cpu-tiny-grads" in line for line in ids)


def test_default_runs_every_builtin_case_at_its_own_steps(pytester):
    pytester.makepyfile("""
        def test_case(accum_case, accum_steps):
            assert accum_steps is None
    """)
    from accumcheck.case.reading import builtin_case_names

    result = pytester.runpytest("-q")
    assert len(builtin_case_names()) == 6
    result.assert_outcomes(passed=6)  # one per built-in case


def test_missing_framework_is_skipped_with_the_reason(pytester):
    missing = [f for f in ("torch", "mxnet") if importlib.util.find_spec(f) is None]
    if not missing:
        pytest.skip("every framework is installed here")
    pytester.makepyfile("def test_fw(accum_framework): pass")
    result = pytester.runpytest("--accum-framework", missing[0], "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines([f"*{missing[0]} is not installed*"])


@needs_torch
def test_gpu_is_skipped_where_there_is_none(pytester):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    pytester.makepyfile("def test_dev(accum_device): pass")
    result = pytester.runpytest("--accum-framework", "torch", "--accum-device", "cpu,gpu", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*torch sees no GPU*"])


@needs_torch
def test_accum_compare_saves_reports(pytester, tmp_path):
    pytester.makepyfile("""
        import accumcheck
        def test_it(accum_compare):
            accumcheck.assert_faithful(accum_compare("tiny-grads"))
    """)
    folder = tmp_path / "reports"
    result = pytester.runpytest_subprocess("--accum-steps", "4", "--accum-framework", "torch",
                                           "--accum-report", str(folder))
    result.assert_outcomes(passed=1)
    saved = sorted(p.suffix for p in folder.iterdir())
    assert saved == [".json", ".md"]
    data = json.loads(next(folder.glob("*.json")).read_text())
    assert data["case"] == "tiny-grads" and data["accum_steps"] == 4


@pytest.mark.parametrize("body, raised", [
    ('accum_compare("no-such-case")', "CaseError: unknown case 'no-such-case'; built-in cases: *"),
    ('monkeypatch.setattr(accumcheck.api, "run", lambda *a, **k: 1 / 0)\n    accum_compare("tiny-grads")',
     "ZeroDivisionError: division by zero"),
], ids=["bad-case", "internal-bug"])
@needs_torch
def test_accumcheck_raising_is_an_error_not_a_finding(pytester, body, raised):
    pytester.makepyfile(f"""
import accumcheck
import accumcheck.api

def test_it(accum_compare, monkeypatch):
    {body}
""")
    result = pytester.runpytest_subprocess("--accum-steps", "2", "--accum-framework", "torch", "-v")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([
        "*::test_it[[]N2-torch-cpu[]] ERROR*",
        "*= ERRORS =*",
        "*ERROR at call of test_it[[]N2-torch-cpu[]]*",
        f"E *{raised}",  # the traceback is shown
        "*- accumcheck -*",
        f"accumcheck raised {raised}: this is an error in running the check, not an accumulation finding",
        "*short test summary info*",
        "ERROR *::test_it[[]N2-torch-cpu[]]*",
        "*1 error in *",
    ])
    assert "FAILURES" not in result.stdout.str()


@needs_torch
def test_a_finding_stays_a_failure(pytester):
    pytester.makepyfile("""
        import pytest
        import accumcheck
        from accumcheck.errors import AccumcheckError

        def test_finding(accum_compare):
            report = accum_compare("tiny-grads", inject="scale")
            assert report.exit_code == 0

        def test_finding_after_a_caught_error(accum_compare):
            with pytest.raises(AccumcheckError):
                accum_compare("no-such-case")
            accumcheck.assert_faithful(accum_compare("tiny-grads", inject="scale"))
    """)
    result = pytester.runpytest_subprocess("--accum-steps", "2", "--accum-framework", "torch")
    result.assert_outcomes(failed=2, errors=0)
    assert "not an accumulation finding" not in result.stdout.str()


@pytest.mark.parametrize("where", ["under-a-file", "a-file"])
def test_unwritable_report_folder_is_a_usage_error(pytester, tmp_path, where):
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    folder, why = ((afile / "reports", f"{afile} is a file, not a folder; choose another folder")
                   if where == "under-a-file" else (afile, "is a file; give a folder (it is created if missing)"))
    pytester.makepyfile("def test_never_runs(): raise AssertionError('ran')")
    result = pytester.runpytest("--accum-report", str(folder))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: argument --accum-report: --accum-report {folder}: {why}"])
    assert "test_never_runs" not in result.stdout.str()


@needs_torch
def test_the_docs_example_test_file_runs(pytester):
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "pytest.md").read_text()
    example = re.search(r"```python\n(# test_accumulation\.py\n.*?)```", page, flags=re.S).group(1)
    pytester.makepyfile(test_accumulation=example)
    result = pytester.runpytest_subprocess("--accum-steps", "16,32")
    result.assert_outcomes(passed=2)


HF_STYLE_TESTS = """
import torch
import accumcheck


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 16)
        self.head = torch.nn.Linear(16, 50)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.embed(input_ids))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), labels.reshape(-1))
        return {"loss": loss, "logits": logits}


def batches(n):
    gen = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 50, (2, 8), generator=gen),
             "labels": torch.randint(0, 50, (2, 8), generator=gen)} for _ in range(n)]


def test_faithful(accum_check):
    report = accum_check(TinyLM(), batches=batches(32))
    accumcheck.assert_faithful(report)
    assert report.accum_steps in (4, 8)


def test_fault(accum_check):
    accumcheck.assert_faithful(accum_check(TinyLM(), batches=batches(32), inject="scale"))


def test_bad_batches(accum_check):
    accum_check(TinyLM(), batches=[("a", "b")] * 32)


def test_not_a_model(accum_check):
    accum_check(object(), batches=batches(4))
"""


@needs_torch
def test_accum_check_runs_your_own_model_at_each_step_count(pytester, tmp_path):
    pytester.makepyfile(HF_STYLE_TESTS)
    result = pytester.runpytest_subprocess("--accum-steps", "4,8", "--accum-report", str(tmp_path), "-v")
    result.assert_outcomes(passed=2, failed=2, errors=4)
    out = result.stdout.str()
    for line in ("test_fault[N4] FAILED", "test_bad_batches[N8] ERROR", "Gradient accumulation is not faithful (case TinyLM",
                 "accumcheck raised UserCodeError: check: the model raised TypeError on micro-batch 0",
                 "object is not a model of a framework accumcheck checks here"):
        assert line in out, line
    saved = sorted(p.name for p in tmp_path.glob("*.json"))
    assert len(saved) == 4 and all("test_f" in name for name in saved)
    assert json.loads((tmp_path / saved[0]).read_text())["config"]["model"] == "TinyLM"
