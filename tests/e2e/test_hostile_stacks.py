"""The training-stack checks under hostile use: a run that judged nothing is never a pass, and
``accumcheck stack`` is bounded before any work.

A stack check in which no optimizer step was checked and no micro-batch seen (a loop that iterates
its loader itself, an empty ``with check:``, a Trainer or a fit with nothing to train, a Gluon loop
that never records) raises NothingJudgedError with one line saying what was not judged and the fix,
after putting the model, its optimizer and the random states back; optimizer steps the check did
not see never leave a pass, and never hide a finding. ``accumcheck stack`` estimates the run's
memory and time from the case's shapes and refuses what cannot fit, in one line with the estimate,
before it builds the model or draws a micro-batch. The positive controls are real loops: faithful
is still exit 0, a known fault still exit 1.
"""

from __future__ import annotations

import importlib.util
import logging
import random
import warnings

import numpy as np
import pytest
from hostile import Refused, Verdict, assert_outcome

import accumcheck.run.resources
from accumcheck.case.definition import Case
from accumcheck.cli import main
from accumcheck.errors import AccumcheckError, NothingJudgedError

HAS = {name: importlib.util.find_spec(name) is not None for name in ("torch", "accelerate", "transformers",
                                                                       "lightning", "mxnet")}
N = 2
GIB = 2**30
# The memory the refusal rows hold the estimate against, the same on every machine.
AVAILABLE = 16 * GIB


def needs(*names: str) -> pytest.MarkDecorator:
    missing = [name for name in names if not HAS[name]]
    return pytest.mark.skipif(bool(missing), reason=f"{', '.join(missing)} not installed")


def token_case(name: str, batch_size: int = 2, vocab: int = 10, seq_len: int = 4, attention: bool = False) -> str:
    attend = '[[layers]]\ntype = "attention"\nname = "a"\nheads = 2\n' if attention else ""
    return (f'name = "{name}"\n[input]\nkind = "tokens"\nbatch_size = {batch_size}\nvocab = {vocab}\n'
            f'seq_len = {seq_len}\n[[layers]]\ntype = "embedding"\nname = "e"\ndim = 8\n{attend}'
            '[[layers]]\ntype = "dense"\nname = "d"\nunits = 3\n')


CASE_FILES = {
    "huge-seq.toml": token_case("s", seq_len=10_000_000, attention=True),
    "huge-batch.toml": token_case("b", batch_size=10_000_000_000),
    "huge-vocab.toml": token_case("v", vocab=1_000_000_000_000),
}


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile-stacks")
    for name, text in CASE_FILES.items():
        (tmp / name).write_text(text)
    return tmp


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


# ----------------------------------------------------------------------------- accumcheck stack, bounded


# (argv with {d} for the folder of case files, the refusal)
TOO_LARGE = [
    *[(f"stack --stack {stack} --batches 100000000", Refused("--batches 100000000: the run would hold about"))
      for stack in ("accelerate", "transformers", "lightning", "gluon")],
    ("stack --stack accelerate --accum-steps 1000000 --batches 1000000",
     Refused("--accum-steps 1000000: the run would hold about")),
    ("stack --stack accelerate --accum-steps 1000000", Refused("--accum-steps 1000000: the run would hold about")),
    ("stack --stack accelerate --batches 3000000", Refused("--batches 3000000: the run would hold about")),
    ("stack --stack lightning --case {d}/huge-seq.toml", Refused("--case s: the run would hold about")),
    ("stack --stack gluon --case {d}/huge-batch.toml", Refused("--case b: the run would hold about")),
    ("stack --stack transformers --case {d}/huge-vocab.toml --accum-steps 2", Refused("--case v: the run would hold")),
]


@pytest.mark.parametrize("row, expected", TOO_LARGE, ids=[row for row, _ in TOO_LARGE])
def test_a_stack_run_that_cannot_fit_is_refused_in_one_line_with_its_estimate_before_any_work(
        row, expected, place, capsys, monkeypatch):
    monkeypatch.setattr(accumcheck.run.resources, "available_memory", lambda: AVAILABLE)

    def no_work(*args, **kwargs):
        raise AssertionError("the run began: the case's model was built or a micro-batch drawn")

    monkeypatch.setattr(Case, "weights", no_work)
    monkeypatch.setattr(Case, "batch", no_work)
    code, out, err = run(row.format(d=place).split(), capsys)
    assert_outcome(expected, code, out, err)
    assert out == ""
    assert "micro-batches, " in err and "as one batch, " in err and "optimizer step" in err  # the estimate's parts
    assert "16.0 GiB of memory is available" in err and "or add --force to run anyway" in err
    if "--case" not in expected.fragment:  # a long run says how long, at the least
        assert "and take at least " in err


def test_the_estimate_grows_with_what_the_run_holds():
    """The stack's estimate, beside compare's: more micro-batches hold more data and more steps'
    gradients, a larger N a larger window as one batch; the time floor grows with M."""
    from accumcheck.case.reading import resolve_case
    from accumcheck.run.resources import estimate_stack

    case = resolve_case("padded-tokens")
    small, long, wide = estimate_stack(case, 4, 10), estimate_stack(case, 4, 1000), estimate_stack(case, 400, 1000)
    assert long.data == 100 * small.data and long.steps > 50 * small.steps and long.window == small.window
    assert wide.window > 50 * long.window and wide.data == long.data and wide.steps < long.steps
    assert long.seconds == 100 * small.seconds > 0
    assert estimate_stack(case, 4).micro_batches == 10  # the default M: 2N + 2


@needs("mxnet")
def test_force_runs_what_the_estimate_refuses(capsys, monkeypatch):
    monkeypatch.setattr(accumcheck.run.resources, "available_memory", lambda: 1024)
    argv = ["stack", "--stack", "gluon", "--accum-steps", "2", "--batches", "4"]
    assert_outcome(Refused("--case padded-tokens: the run would hold about"), *run(argv, capsys))
    assert_outcome(Verdict(0, "FAITHFUL"), *run([*argv, "--force"], capsys))


# Positive controls: a run that fits still gets its verdict.
FITTING = [
    pytest.param("stack --stack accelerate --accum-steps 2 --batches 4", Verdict(0, "FAITHFUL: every optimizer step"),
                 marks=needs("torch", "accelerate")),
    pytest.param("stack --stack accelerate --accum-steps 2 --batches 4 --fault loss-over-n",
                 Verdict(1, "FLAGGED: 2 of 2 optimizer steps"), marks=needs("torch", "accelerate")),
    pytest.param("stack --stack gluon --accum-steps 2 --batches 4 --fault step-per-micro-batch",
                 Verdict(1, "FLAGGED: 2 of 2 optimizer steps"), marks=needs("mxnet")),
]


@pytest.mark.parametrize("row, expected", FITTING)
def test_a_stack_run_that_fits_gets_its_verdict(row, expected, capsys, monkeypatch):
    monkeypatch.setattr(accumcheck.run.resources, "available_memory", lambda: AVAILABLE)
    assert_outcome(expected, *run(row.split(), capsys))


def test_the_fixture_reports_a_refused_stack_run_as_an_error(pytester):
    pytester.makeconftest("""
        import accumcheck.run.resources
        accumcheck.run.resources.available_memory = lambda: 16 * 2**30
    """)
    pytester.makepyfile("""
        def test_long_run(accum_stack):
            accum_stack("accelerate", batches=100000000)
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*--batches 100000000: the run would hold about*"])


# ----------------------------------------------------------------------------- torch stacks judging nothing


def random_states() -> tuple:
    import torch

    return random.getstate(), np.random.get_state()[1].tobytes(), torch.get_rng_state().numpy().tobytes()


def draw() -> None:
    """The user's loop drawing from every generator, as augmentation does."""
    import torch

    random.random(), np.random.rand(), torch.rand(1)


def model_state(model, optimizer=None) -> tuple:
    tensors = [(id(p), p.dtype, p.detach().numpy().tobytes()) for p in model.parameters()]
    state = None if optimizer is None else repr(optimizer.state_dict())
    return tensors, state


def lm_batches(count: int) -> list:
    import torch

    gen = torch.Generator().manual_seed(1)
    return [{"input_ids": (ids := torch.randint(0, 11, (2, 4), generator=gen)), "labels": ids.clone()}
            for _ in range(count)]


def lm():
    """A tiny language model with its own token-mean loss, as Hugging Face models compute it."""
    import torch
    import torch.nn.functional as F

    class LM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.head = torch.nn.Embedding(11, 6), torch.nn.Linear(6, 11)

        def forward(self, input_ids, labels=None):
            logits = self.head(self.emb(input_ids))
            return {"logits": logits, "loss": F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1))}

    return LM()


def accelerated(count: int = 3 * N):
    import accelerate
    import torch

    accelerator = accelerate.Accelerator(gradient_accumulation_steps=N)
    model = lm()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = torch.utils.data.DataLoader(lm_batches(count), batch_size=None)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return accelerator, model, optimizer, loader


def micro_step(accelerator, model, optimizer, batch, scale=1.0, steps_per_window=1) -> None:
    with accelerator.accumulate(model):
        draw()
        accelerator.backward(model(**batch)["loss"] * scale)
        for _ in range(steps_per_window):
            optimizer.step()
        optimizer.zero_grad()


@needs("torch", "accelerate")
@pytest.mark.parametrize("steps", [None, 2])
def test_accelerate_a_loop_that_iterates_its_loader_itself_judged_nothing(steps):
    from accumcheck.integrations.accelerate import AccumulationCheck

    accelerator, model, optimizer, loader = accelerated()
    before, states = model_state(model, optimizer), random_states()
    check = AccumulationCheck(accelerator, model, optimizer, steps=steps)
    with check:
        for batch in loader:
            micro_step(accelerator, model, optimizer, batch)
    with pytest.raises(NothingJudgedError) as refused:
        check.report
    assert str(refused.value) == (
        "accelerate.AccumulationCheck: the optimizer stepped 3 times but no micro-batch went through "
        "check.batches(loader), so nothing was judged; iterate `for batch in check.batches(loader):` inside "
        "`with check:`")
    assert model_state(model, optimizer) == before and random_states() == states


@needs("torch", "accelerate")
def test_accelerate_an_empty_with_block_or_an_empty_loader_judged_nothing():
    import torch

    from accumcheck.integrations.accelerate import AccumulationCheck

    accelerator, model, optimizer, _ = accelerated()
    check = AccumulationCheck(accelerator, model, optimizer)
    with pytest.raises(NothingJudgedError, match="no report yet; run the loop inside `with check:`"):
        check.report
    with check:
        pass
    with pytest.raises(NothingJudgedError) as empty:
        check.report
    assert str(empty.value) == (
        "accelerate.AccumulationCheck: the with block ran no optimizer step (0 micro-batches seen); run the "
        "training loop inside `with check:`, iterating `for batch in check.batches(loader):`")
    with check:
        for batch in check.batches(torch.utils.data.DataLoader([], batch_size=None)):
            micro_step(accelerator, model, optimizer, batch)
    with pytest.raises(NothingJudgedError, match=r"ran no optimizer step \(0 micro-batches seen\); "
                                                 r"check.batches\(loader\) gave no micro-batch: is the data loader "):
        check.report


@needs("torch", "accelerate")
def test_accelerate_steps_the_check_did_not_see_never_pass_and_never_hide_a_finding():
    """Two optimizer steps per window: the second has no micro-batch of its own. Not judged, so a
    run that would pass is refused; a run flagged anyway keeps its verdict and names them."""
    from accumcheck.integrations.accelerate import AccumulationCheck

    accelerator, model, optimizer, loader = accelerated(2 * N)
    check = AccumulationCheck(accelerator, model, optimizer)
    with check:
        for batch in check.batches(loader):
            micro_step(accelerator, model, optimizer, batch, steps_per_window=2)
    with pytest.raises(AccumcheckError) as refused:
        check.report
    assert not isinstance(refused.value, NothingJudgedError)
    assert str(refused.value).startswith(
        "accelerate.AccumulationCheck: 2 of the 4 optimizer steps (steps 1, 3, counted from 0) had no micro-batch "
        "recorded since the step before and were not judged: micro-batches fed around check.batches(loader), or a "
        "second step on one window; iterate")
    accelerator, model, optimizer, loader = accelerated(2 * N)
    check = AccumulationCheck(accelerator, model, optimizer)
    with check:
        for batch in check.batches(loader):
            micro_step(accelerator, model, optimizer, batch, scale=1 / N, steps_per_window=2)
    assert check.report.exit_code == 1 and check.report.summary().startswith("FLAGGED: 2 of 2 optimizer steps")
    assert check.report.notes[-1].startswith("2 of the 4 optimizer steps (steps 1, 3, counted from 0)")


@needs("torch", "accelerate")
@pytest.mark.parametrize("scale, code, summary", [(1.0, 0, "FAITHFUL"), (1 / N, 1, "FLAGGED")])
def test_accelerate_a_real_loop_still_gets_its_verdict(scale, code, summary):
    from accumcheck.integrations.accelerate import AccumulationCheck

    accelerator, model, optimizer, loader = accelerated(2 * N)
    check = AccumulationCheck(accelerator, model, optimizer)
    with check:
        for batch in check.batches(loader):
            micro_step(accelerator, model, optimizer, batch, scale=scale)
    assert check.report.exit_code == code and check.report.summary().startswith(summary)
    assert check.report.counts_text() == "2 optimizer steps checked, 4 micro-batches seen"


def case_trainer(tmp_path, **overrides):
    import transformers

    from accumcheck.case.reading import resolve_case
    from accumcheck.torch.stacks.cases import CaseLM, case_examples

    case = resolve_case("padded-tokens")
    args = dict(output_dir=str(tmp_path), per_device_train_batch_size=case.input.batch_size,
                gradient_accumulation_steps=N, num_train_epochs=1, learning_rate=1e-3, report_to="none",
                save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True, seed=0)
    return transformers.Trainer(model=CaseLM(case, N), args=transformers.TrainingArguments(**{**args, **overrides}),
                                train_dataset=case_examples(case, 2 * N))


@needs("torch", "transformers", "accelerate")
@pytest.mark.parametrize("steps", [None, 2])
def test_transformers_a_trainer_with_no_epoch_judged_nothing(tmp_path, steps):
    from accumcheck.integrations.transformers import check

    trainer = case_trainer(tmp_path, num_train_epochs=0)
    before, states, step = model_state(trainer.model), random_states(), trainer.state.global_step
    with pytest.raises(NothingJudgedError) as refused:
        check(trainer, steps=steps)
    assert str(refused.value) == (
        "transformers.check: the Trainer ran no optimizer step (0 micro-batches seen); its arguments ask for "
        "num_train_epochs=0 and max_steps=-1; train for at least one epoch or give max_steps")
    assert model_state(trainer.model) == before and random_states() == states
    assert trainer.state.global_step == step and trainer.optimizer is None


@needs("torch", "transformers", "accelerate")
@pytest.mark.parametrize("fault, code", [(None, 0), ("loss-over-n", 1)])
def test_transformers_a_real_trainer_still_gets_its_verdict(fault, code):
    from accumcheck.case.reading import resolve_case
    from accumcheck.integrations.transformers import run_case

    report = run_case(resolve_case("padded-tokens"), N, 2 * N, fault)
    assert report.exit_code == code and len(report.steps) == 2


def fit(check, module, batches, **settings):
    import lightning.pytorch as pl
    import torch

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(**{"max_epochs": 1, **settings}, accelerator="cpu", devices=1,
                             accumulate_grad_batches=N, callbacks=[check], logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))


def case_module():
    from accumcheck.case.reading import resolve_case
    from accumcheck.integrations.lightning import CaseModule
    from accumcheck.torch.stacks.cases import CaseLM, case_batches, window_items

    case = resolve_case("padded-tokens")
    batches = case_batches(case, 2 * N)
    return CaseModule(CaseLM(case, N), N, window_items(batches, N)), batches


@needs("torch", "lightning")
@pytest.mark.parametrize("setting", ["max_epochs", "max_steps", "limit_train_batches"])
def test_lightning_a_fit_with_nothing_to_train_judged_nothing(setting):
    from accumcheck.integrations.lightning import AccumulationCheck

    module, batches = case_module()
    before, states = model_state(module), random_states()
    check = AccumulationCheck(steps=2)
    fit(check, module, batches, **{setting: 0})
    with pytest.raises(NothingJudgedError) as refused:
        check.report
    assert str(refused.value) == (f"lightning.AccumulationCheck: the fit ran no optimizer step (0 micro-batches "
                                  f"seen); the Trainer has {setting}=0; let it train at least one window")
    assert model_state(module) == before and random_states() == states


@needs("torch", "lightning")
def test_lightning_a_callback_never_attached_judged_nothing():
    from accumcheck.integrations.lightning import AccumulationCheck

    with pytest.raises(NothingJudgedError, match=r"no report yet; pass the callback to Trainer\(callbacks=\[...\]\)"):
        AccumulationCheck().report


@needs("torch", "lightning")
@pytest.mark.parametrize("fault, code", [(None, 0), ("loss-over-n", 1)])
def test_lightning_a_real_fit_still_gets_its_verdict(fault, code):
    from accumcheck.integrations.lightning import run_case

    report = run_case("padded-tokens", N, 2 * N, fault)
    assert report.exit_code == code and len(report.steps) == 2


# ----------------------------------------------------------------------------- Gluon judging nothing


def gluon_loop(check, record=lambda i: True, count=2 * N) -> None:
    """A Gluon loop of windows of N; ``record(i)``: whether micro-batch i goes through check.record."""
    import mxnet as mx
    from mxnet import autograd

    net, trainer = check.net, check.trainer
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.default_rng(1)
    with check:
        for i in range(count):
            x, y = mx.nd.array(rng.standard_normal((4, 5))), mx.nd.array(rng.integers(0, 3, 4))
            x, y = check.record(x, y) if record(i) else (x.astype("float64"), y.astype("float64"))
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            if (i + 1) % N == 0:
                trainer.step(N * 4)
                net.collect_params().zero_grad()


def gluon_check(steps=None):
    import mxnet as mx

    from accumcheck.integrations.gluon import AccumulationCheck

    mx.random.seed(0)
    net = mx.gluon.nn.Dense(3, in_units=5)
    net.initialize(mx.init.Xavier())
    for param in net.collect_params().values():
        param.grad_req = "add"
    trainer = mx.gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9})
    return AccumulationCheck(net, trainer, mx.gluon.loss.SoftmaxCrossEntropyLoss(), steps=steps)


def gluon_state(check) -> tuple:
    params = check.net.collect_params()
    opt = check.trainer._optimizer
    return ({k: (p.dtype, p.data().asnumpy().tobytes()) for k, p in params.items()},
            {d: dict(c) for d, c in opt._all_index_update_counts.items()}, opt.num_update)


@needs("mxnet")
@pytest.mark.parametrize("steps", [None, 1])
def test_gluon_a_loop_that_never_records_judged_nothing(steps):
    check = gluon_check(steps)
    before = gluon_state(check)
    gluon_loop(check, record=lambda i: False)
    with pytest.raises(NothingJudgedError) as refused:
        check.report
    assert str(refused.value) == (
        "gluon.AccumulationCheck: the optimizer stepped 2 times but no micro-batch went through check.record, so "
        "nothing was judged; record every micro-batch before its forward pass: `x, y = check.record(x, y)`")
    assert gluon_state(check) == before


@needs("mxnet")
def test_gluon_an_empty_with_block_judged_nothing():
    check = gluon_check()
    with pytest.raises(NothingJudgedError, match="no report yet"):
        check.report
    with check:
        pass
    with pytest.raises(NothingJudgedError) as refused:
        check.report
    assert str(refused.value).startswith(
        "gluon.AccumulationCheck: the with block ran no optimizer step (0 micro-batches seen); run the training loop "
        "inside `with check:`, recording each micro-batch (`x, y = check.record(x, y)`)")


@needs("mxnet")
def test_gluon_a_window_fed_around_the_check_is_not_judged_and_never_passes():
    check = gluon_check()
    gluon_loop(check, record=lambda i: i < N, count=3 * N)  # the first window recorded, the next two not
    with pytest.raises(AccumcheckError) as refused:
        check.report
    assert not isinstance(refused.value, NothingJudgedError)
    assert str(refused.value).startswith(
        "gluon.AccumulationCheck: 2 of the 3 optimizer steps (steps 1, 2, counted from 0) had no micro-batch recorded "
        "since the step before and were not judged: micro-batches fed around check.record, or a second step on one "
        "window; record every micro-batch")


@needs("mxnet")
@pytest.mark.parametrize("fault, code", [(None, 0), ("step-per-micro-batch", 1)])
def test_gluon_a_real_loop_still_gets_its_verdict(fault, code):
    from accumcheck.integrations.gluon import run_case

    report = run_case("padded-tokens", N, 2 * N, fault)
    assert report.exit_code == code and len(report.steps) == 2
    check = gluon_check()
    gluon_loop(check)
    assert check.report.exit_code == 0
    assert check.report.counts_text() == "2 optimizer steps checked, 4 micro-batches seen"
