"""``accumcheck check FILE.py`` under hostile user code, as a hostile tester drives it.

Every row is one command on a setup file written by the test. The user's own code raising (its
batches, model, loss, ``step``, gradient hooks, the setup file itself, ``sys.exit()`` and argparse
included) ends in exit code 2 with one line on stderr naming the micro-batch or the function and
the exception, never in exit 3 ("an accumcheck bug"). A run that would judge nothing (no gradient,
a loss that depends on no parameter, a loss scale that is not positive and finite, a loss that
``backward()`` was already called on) is exit 2 too, never 0. The positive controls end in their
verdicts. The rows run in-process through ``accumcheck.cli.main``.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from conftest import needs_torch
from hostile import Refused, Verdict, assert_outcome

from accumcheck.cli import main

pytestmark = needs_torch

MODEL = '''
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 3)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen = self.seen + 1  # a buffer the forward rebinds
        return self.fc(x)


def batches(n=8):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(2, 4, generator=gen), torch.randn(2, 3, generator=gen)) for _ in range(n)]


def mse(output, target):
    return ((output - target) ** 2).mean()
'''

SETUPS = '''
import sys

import torch
from user_model import Net, batches, mse


def accumcheck_setup():
    return {"model": Net(), "loss_fn": mse, "batches": batches()}


def with_step(step, **extra):
    return {"model": Net(), "step": step, "batches": batches(), **extra}


def leaf_loss():
    return with_step(lambda model, batch: torch.tensor(1.0, requires_grad=True))


def meta_leaf_loss():
    return with_step(lambda model, batch: torch.tensor(1.0, device="meta", requires_grad=True))


def meta_loss():
    return with_step(lambda model, batch: mse(model(batch[0]), batch[1]).to("meta"))


def constant_loss():
    return with_step(lambda model, batch: torch.ones((), requires_grad=True) * 2.0)


def zero_loss():
    return with_step(lambda model, batch: mse(model(batch[0]), batch[1]) * 0.0)


def no_grad_loss():
    def step(model, batch):
        with torch.no_grad():
            return mse(model(batch[0]), batch[1])
    return with_step(step)


def scale_zero():
    return {**accumcheck_setup(), "grad_scaler": torch.amp.GradScaler("cpu", init_scale=0.0)}


def scale_nan():
    return {**accumcheck_setup(), "grad_scaler": torch.amp.GradScaler("cpu", init_scale=float("nan"))}


def scale_inf():
    return {**accumcheck_setup(), "grad_scaler": torch.amp.GradScaler("cpu", init_scale=float("inf"))}


def generator_raising():
    def read():
        for index, batch in enumerate(batches()):
            if index == 3:
                raise RuntimeError("the shard is gone")
            yield batch
    return {**accumcheck_setup(), "batches": read(), "accum_steps": 8}


def function_raising():
    four = batches(4)
    return {**accumcheck_setup(), "batches": lambda index: four[index], "accum_steps": 8}


def hook_raising():
    model = Net()
    calls = []

    def hook(grad):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("hook says no")
    model.fc.weight.register_hook(hook)
    return {**accumcheck_setup(), "model": model}


def post_hook_raising():
    model = Net()

    def hook(param):
        raise KeyError("post-accumulate hook")
    model.fc.bias.register_post_accumulate_grad_hook(hook)
    return {**accumcheck_setup(), "model": model}


def meta_model():
    return {**accumcheck_setup(), "model": Net().to("meta")}


def meta_batches():
    return {**accumcheck_setup(), "batches": [(torch.randn(2, 4, device="meta"), torch.randn(2, 3))] * 8}


def backward_in_loss():
    def loss(output, target):
        value = mse(output, target)
        value.backward(retain_graph=True)
        return value
    return {**accumcheck_setup(), "loss_fn": loss}


def backward_in_step():
    def step(model, batch):
        mse(model(batch[0]), batch[1]).backward()
        return mse(model(batch[0]), batch[1])
    return with_step(step)


def zero_grad_in_step():
    def step(model, batch):
        model.zero_grad()
        return mse(model(batch[0]), batch[1])
    return with_step(step)


def step_raising():
    def step(model, batch):
        if float(model.seen) >= 5:
            raise KeyError("no such column")
        return mse(model(batch[0]), batch[1])
    return with_step(step)


def forward_exiting():
    def loss(output, target):
        sys.exit(3)
    return {**accumcheck_setup(), "loss_fn": loss}


def edits_weights():
    def step(model, batch):
        with torch.no_grad():
            model.fc.weight.mul_(1.5)
            model.fc.bias.data.add_(1.0)
        return mse(model(batch[0]), batch[1])
    return with_step(step)


def exit_0():
    sys.exit(0)


def exit_7():
    sys.exit(7)


def exit_text():
    sys.exit("no GPU here")


def raises():
    raise FileNotFoundError("data/train.bin")
'''

FILES = {
    "user_model.py": MODEL,
    "setups.py": SETUPS,
    "exits.py": "import sys\nsys.exit(0)\n",
    "exits7.py": "import sys\nsys.exit(7)\n",
    "required_flag.py": ("import argparse\nparser = argparse.ArgumentParser()\n"
                         "parser.add_argument('--data', required=True)\nargs = parser.parse_args()\n"
                         "from setups import accumcheck_setup\n"),
    "optional_flags.py": ("import argparse\nparser = argparse.ArgumentParser()\n"
                          "parser.add_argument('--lr', type=float, default=0.1)\nargs = parser.parse_args()\n"
                          "from setups import accumcheck_setup\n"),
    "import_raising.py": "import torch\nraise RuntimeError('checkpoint missing')\n",
    "printing.py": "print('loading the model')\nfrom setups import accumcheck_setup\n",
}

S = "{d}/setups.py"

# (argv with {d} for the test's folder, the expected outcome). Grouped by what they try.
ROWS: list[tuple[str, Refused | Verdict]] = [
    # positive controls: a good setup is judged, and a fault is found
    (f"check {S}", Verdict(0, "OK: all 2 tensors faithful")),
    (f"check {S} --inject scale", Verdict(1, "FLAGGED")),
    (f"check {S}:edits_weights", Verdict(0, "OK: all 2 tensors faithful")),
    ("check {d}/optional_flags.py --accum-steps 4", Verdict(0, "OK: all 2 tensors faithful")),
    ("check {d}/printing.py", Verdict(0, "OK: all 2 tensors faithful")),
    # a loss that depends on no parameter, a gradient of zero: nothing judged
    (f"check {S}:leaf_loss", Refused("the loss of micro-batch 0 is a leaf tensor")),
    (f"check {S}:meta_leaf_loss", Refused("the loss of micro-batch 0 is a leaf tensor")),
    (f"check {S}:meta_loss", Refused("the loss of micro-batch 0 is on meta, the model on cpu")),
    (f"check {S}:constant_loss", Refused("nothing was judged: none of the 2 parameter tensors received")),
    (f"check {S}:zero_loss", Refused("nothing was judged: none of the 2 parameter tensors received")),
    (f"check {S}:no_grad_loss", Refused("the loss of micro-batch 0 does not depend on any parameter")),
    # a loss scale that is not positive and finite
    (f"check {S}:scale_zero", Refused("the GradScaler's scale is 0.0, and a loss scale must be positive")),
    (f"check {S}:scale_nan", Refused("the GradScaler's scale is nan, and a loss scale must be positive")),
    (f"check {S}:scale_inf", Refused("the GradScaler's scale is inf, and a loss scale must be positive")),
    # the user's batches raising
    (f"check {S}:generator_raising", Refused("iterating batches raised RuntimeError while reading micro-batch 3")),
    (f"check {S}:function_raising", Refused("batches raised IndexError on micro-batch 4")),
    (f"check {S}:meta_batches", Refused("moving micro-batch 0 to cpu raised NotImplementedError")),
    # the user's model, loss, step and hooks raising
    (f"check {S}:hook_raising", Refused("the backward pass raised ValueError on micro-batch 2: hook says no")),
    (f"check {S}:post_hook_raising", Refused("the backward pass raised KeyError on micro-batch 0")),
    (f"check {S}:meta_model", Refused("the model's parameters are on the meta device")),
    (f"check {S}:step_raising", Refused("step raised KeyError on micro-batch 5: 'no such column'")),
    (f"check {S}:forward_exiting", Refused("the model or loss_fn raised SystemExit on micro-batch 0: exit code 3")),
    # a loss or step that calls backward() (or zero_grad()) itself
    (f"check {S}:backward_in_loss", Refused("loss_fn changed the parameters' .grad on micro-batch 0 (it called "
                                            "backward()")),
    (f"check {S}:backward_in_step", Refused("step changed the parameters' .grad on micro-batch 0")),
    (f"check {S}:zero_grad_in_step", Refused("step changed the parameters' .grad on micro-batch 1")),
    # the setup file exiting or raising
    (f"check {S}:exit_0", Refused("exit_0() exited (SystemExit, exit code 0)")),
    (f"check {S}:exit_7", Refused("exit_7() exited (SystemExit, exit code 7)")),
    (f"check {S}:exit_text", Refused("exit_text() exited (SystemExit, exit code 'no GPU here')")),
    (f"check {S}:raises", Refused("raises() raised FileNotFoundError: data/train.bin")),
    ("check {d}/exits.py", Refused("exits.py: importing it exited (SystemExit, exit code 0)")),
    ("check {d}/exits7.py", Refused("exits7.py: importing it exited (SystemExit, exit code 7)")),
    ("check {d}/required_flag.py", Refused("importing it exited (SystemExit, exit code 2) after printing "
                                           "'required_flag.py: error: the following arguments are required: --data'")),
    ("check {d}/import_raising.py", Refused("importing it raised RuntimeError: checkpoint missing")),
]


@pytest.fixture(scope="module")
def place(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("hostile-user-code")
    for name, text in FILES.items():
        (tmp / name).write_text(text)
    return tmp


def run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit_:  # argparse's own errors
        return exit_.code


def test_the_table_lists_each_row_once():
    assert len({row for row, _ in ROWS}) == len(ROWS), "a row is listed twice"


@pytest.mark.parametrize("row, expected", ROWS, ids=[row.replace("{d}/", "") for row, _ in ROWS])
def test_user_code_is_refused_in_one_line_or_gets_its_verdict(row, expected, place, capsys, monkeypatch):
    monkeypatch.chdir(place)
    code = run(shlex.split(row.replace("{d}", str(place))))
    out, err = capsys.readouterr()
    assert_outcome(expected, code, out, err)
    if code == 0:  # a pass is a judgement: every tensor received a gradient
        assert "no gradient" not in out and "no-gradient" not in out, out


def test_what_the_setup_file_prints_goes_to_stderr_and_stdout_holds_the_report(place, capsys, monkeypatch):
    monkeypatch.chdir(place)
    code = run(["check", str(place / "printing.py"), "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["config"]["model"] == "Net"
    assert "loading the model" in err


def test_an_interrupt_in_the_setup_stays_an_interrupt(place, capsys, monkeypatch):
    (place / "interrupted.py").write_text("def accumcheck_setup():\n    raise KeyboardInterrupt\n")
    monkeypatch.chdir(place)
    assert run(["check", str(place / "interrupted.py")]) == 130
    assert "interrupted" in capsys.readouterr().err


def test_the_command_line_is_as_it_was_after_a_setup_file_ran(place, monkeypatch):
    import sys

    monkeypatch.setattr(sys, "argv", ["accumcheck", "check", "x.py"])
    run(["check", str(place / "required_flag.py")])
    assert sys.argv == ["accumcheck", "check", "x.py"]


PLUGIN_TESTS = '''
import sys

import accumcheck
import torch


def model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(2, 4, generator=g), torch.randn(2, 3, generator=g)) for _ in range(n)]


def test_judged(accum_check):
    accumcheck.assert_faithful(accum_check(model(), lambda out, target: ((out - target) ** 2).mean(), batches(4)))


def test_nothing_judged(accum_check):
    accumcheck.assert_faithful(accum_check(model(), batches=batches(4), step=lambda m, b: m(b[0]).sum() * 0.0))


def test_exiting_step(accum_check):
    accumcheck.assert_faithful(accum_check(model(), batches=batches(4), step=lambda m, b: sys.exit(0)))
'''


def test_accum_check_that_judged_nothing_or_whose_code_exited_is_an_error_never_a_pass(pytester):
    pytester.makepyfile(PLUGIN_TESTS)
    result = pytester.runpytest_subprocess("--accum-steps", "4", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=2)
    result.stdout.fnmatch_lines([
        "accumcheck raised NothingJudgedError: nothing was judged: none of the 2 parameter tensors received a "
        "non-zero gradient in the 4 micro-batches; * this is an error in running the check, not an accumulation "
        "finding",
        "accumcheck raised UserCodeError: check: step raised SystemExit on micro-batch 0: exit code 0; *",
    ])
