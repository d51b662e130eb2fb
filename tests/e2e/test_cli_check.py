"""``accumcheck check FILE.py[:FUNCTION]``: your own model from the command line, its exit codes,
and one line for every mistake in the setup file."""

import json
import shlex

import pytest
from conftest import needs_torch, run_cli, unwrapped

from accumcheck.cli import main
from accumcheck.report import load_report

pytestmark = needs_torch

SETUP = '''
import torch


class LM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(30, 16)
        self.head = torch.nn.Linear(16, 30)

    def forward(self, input_ids, labels):
        logits = self.head(self.embed(input_ids))
        return {"loss": torch.nn.functional.cross_entropy(logits.reshape(-1, 30), labels.reshape(-1))}


def batches(n):
    gen = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 30, (4, 8), generator=gen),
             "labels": torch.randint(0, 30, (4, 8), generator=gen)} for _ in range(n)]


def accumcheck_setup():
    return {"model": LM(), "batches": batches(16), "accum_steps": 16}


def raises():
    raise ValueError("the data folder is missing")


def not_a_dict():
    return [LM()]


def unknown_argument():
    return {"model": LM(), "batches": batches(4), "lr": 0.1}


def strings():
    return {"model": LM(), "batches": [("a", "b")] * 4}


def not_a_model():
    return {"model": "gpt2", "batches": batches(4)}
'''


@pytest.fixture
def setup_file(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(SETUP)
    return path


def test_a_faithful_model_exits_0_and_says_how_to_rerun_it(setup_file):
    result = run_cli("check", str(setup_file), cwd=setup_file.parent)  # the console script, as a user runs it
    assert result.returncode == 0, result.stderr
    assert "model LM · torch on cpu · N = 16 micro-steps" in result.stdout
    assert f"reproduce: accumcheck check {setup_file} --accum-steps 16" in unwrapped(result.stdout)
    assert "embed.weight   embedding" in result.stdout


def test_a_fault_exits_1_and_its_reproduce_line_reruns_it(setup_file, tmp_path, capsys):
    out = tmp_path / "report.json"
    result = run_cli("check", f"{setup_file}:accumcheck_setup", "--accum-steps", "8", "--inject", "scale",
                     "--full-batch", "--format", "json", "--output", str(out))
    assert result.returncode == 1, result.stderr
    report = json.loads(out.read_text())
    assert [t["name"] for t in report["tensors"] if t["verdict"] == "diverged"] == ["embed.weight"]
    assert report["full_batch"]["equivalent"] is True
    command = load_report(out).reproduce_command()
    assert command == f"accumcheck check {setup_file}:accumcheck_setup --accum-steps 8 --inject scale --full-batch"
    assert run_main(*shlex.split(command)[1:]) == 1  # in-process: the same main() the console script runs
    assert "FLAGGED 1 of 3 tensors: embed.weight" in capsys.readouterr().out


def run_main(*args):
    try:
        return main(list(args))
    except SystemExit as exit:  # argparse's usage errors
        return exit.code


@pytest.mark.parametrize("target, args, message", [
    ("missing.py", [], "missing.py is not a Python file here; give FILE.py or FILE.py:FUNCTION"),
    ("{file}:nothing", [], "defines no function 'nothing'"),
    ("{file}:raises", [], "raises() raised ValueError: the data folder is missing"),
    ("{file}:not_a_dict", [], "must return a dict of check's arguments with at least 'model' (JAX: 'params' and 'loss_fn') and 'batches', got list"),
    ("{file}:unknown_argument", [], "'lr' is not an argument of accumcheck.torch.check"),
    ("{file}:strings", [], "the model raised TypeError on micro-batch 0"),
    ("{file}:not_a_model", [], "str is not a model of a framework accumcheck checks here (jax, mxnet, torch)"),
    ("{file}", ["--inject", "melt"], "--inject: unknown fault 'melt'"),
    ("{file}", ["--accum-steps", "99"], "accum_steps=99 but only 16 batches were given"),
    ("{file}", ["--accum-steps", "0"], "'0' is not a positive integer"),
    ("{file}", ["--output", "/nonexistent/dir/r.json"], "--output"),
])
def test_every_mistake_is_one_line_and_exit_2(setup_file, target, args, message, capsys, monkeypatch):
    monkeypatch.chdir(setup_file.parent)  # in-process: the same main() the console script runs
    code = run_main("check", target.format(file=setup_file), *args)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_a_file_that_fails_to_import_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("import no_such_module_here\n")
    code = run_main("check", str(bad))
    assert code == 2 and "importing it raised ModuleNotFoundError" in capsys.readouterr().err
