"""The accelerate stack check (accumcheck.integrations.accelerate): a user's loop with
``Accelerator(gradient_accumulation_steps=N)`` and ``accelerator.accumulate(model)``, every optimizer
step judged against its window as one batch, the model and optimizer put back afterwards."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
accelerate = pytest.importorskip("accelerate")

import torch.nn.functional as F  # noqa: E402
from zoo import TinyLM, lm_batches  # noqa: E402

from accumcheck.errors import AccumcheckError  # noqa: E402
from accumcheck.integrations.accelerate import AccumulationCheck, run_case  # noqa: E402

N = 4


def setup(batches, prepare_loader=True, optimizer=torch.optim.SGD):
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=N)
    model = TinyLM()
    opt = optimizer(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    if prepare_loader:
        model, opt, loader = accelerator.prepare(model, opt, loader)
    else:
        model, opt = accelerator.prepare(model, opt)
    return accelerator, model, opt, loader


def user_loop(check, accelerator, model, optimizer, loader, scale=1.0, clip=None, clip_every_micro_batch=False):
    for batch in check.batches(loader):
        with accelerator.accumulate(model):
            loss = model(**batch)["loss"]
            accelerator.backward(loss * scale)
            if clip is not None and (clip_every_micro_batch or accelerator.sync_gradients):
                norm = accelerator.clip_grad_norm_(model.parameters(), clip)
                check.norms.append(float(norm))
            optimizer.step()
            optimizer.zero_grad()


def checked(batches, prepare_loader=True, steps=None, **loop):
    accelerator, model, opt, loader = setup(batches, prepare_loader)
    check = AccumulationCheck(accelerator, model, opt, steps=steps)
    check.norms = []
    with check:
        user_loop(check, accelerator, model, opt, loader, **loop)
    return check


def verdicts(report):
    return [s.verdict for s in report.steps]


def test_equal_micro_batches_with_the_models_mean_loss_are_faithful():
    report = checked(lm_batches(2 * N)).report
    assert verdicts(report) == ["faithful", "faithful"]
    assert [s.micro_batches for s in report.steps] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert report.counts_text() == "2 optimizer steps checked, 8 micro-batches seen"
    assert report.unstepped == [] and report.exit_code == 0
    assert max(s.result.max_relative_difference for s in report.steps) < 1e-12


def test_a_per_micro_batch_token_mean_over_different_lengths_is_a_mismatch():
    report = checked(lm_batches(2 * N, variable=True)).report
    assert verdicts(report) == ["mismatch", "mismatch"]
    assert report.exit_code == 1 and report.counts_text() == "2 optimizer steps checked, 8 micro-batches seen"


def test_the_window_token_count_times_n_is_faithful_over_different_lengths():
    report = run_case("padded-tokens", N, 2 * N)
    assert verdicts(report) == ["faithful", "faithful"]
    assert report.model == "padded-tokens (built-in case)"


def test_a_loss_divided_by_n_once_more_is_the_constant_factor_1_over_n():
    report = checked(lm_batches(2 * N), scale=1 / N).report
    assert verdicts(report) == ["constant-factor", "constant-factor"]
    assert [s.result.matches for s in report.steps] == ["1/N", "1/N"]
    assert report.steps[0].result.factor == pytest.approx(1 / N)


def test_clipping_that_fires_does_not_hide_the_gradient_it_clipped():
    check = checked(lm_batches(2 * N), clip=1e-3)
    assert min(check.norms) > 1e-3  # clipping fired at both steps
    assert verdicts(check.report) == ["faithful", "faithful"]


def test_clipping_every_micro_batch_is_caught_clipping_half_a_window():
    check = checked(lm_batches(2 * N), clip=1e-3, clip_every_micro_batch=True)
    assert len(check.norms) == 2 * N
    assert "faithful" not in verdicts(check.report)


def test_a_prepared_dataloaders_short_last_window_steps_divided_by_n_not_k():
    # accelerate steps at the end of a prepared dataloader, but backward divided by N: k/N
    report = checked(lm_batches(N + 2)).report
    assert verdicts(report) == ["faithful", "constant-factor"]
    last = report.steps[1]
    assert last.micro_batches == [4, 5] and last.result.matches == "k/N"
    assert last.result.factor == pytest.approx(2 / N)
    assert report.unstepped == []


def test_a_plain_dataloaders_short_last_window_never_reaches_a_step():
    # without accelerator.prepare(dataloader) accelerate cannot see the end: the rest is dropped
    report = checked(lm_batches(N + 2), prepare_loader=False).report
    assert verdicts(report) == ["faithful"]
    assert report.unstepped == [4, 5] and report.exit_code == 1
    assert report.counts_text() == "1 optimizer step checked, 6 micro-batches seen"


def test_steps_stops_the_loop_after_that_many_optimizer_steps():
    check = checked(lm_batches(3 * N), steps=1)
    assert check.report.counts_text() == "1 optimizer step checked, 4 micro-batches seen"
    assert check.report.unstepped == []


def test_a_loss_fn_reads_inputs_and_float_targets_in_float64():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    batches = [(torch.randn(5, 3), torch.randn(5, 1)) for _ in range(N)]
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=N)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = accelerator.prepare(model, opt, torch.utils.data.DataLoader(batches, batch_size=None))
    check = AccumulationCheck(accelerator, model, opt, loss_fn=F.mse_loss)
    with check:
        for x, y in check.batches(loader):
            assert x.dtype == y.dtype == torch.float64
            with accelerator.accumulate(model):
                accelerator.backward(F.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
    assert verdicts(check.report) == ["faithful"]


def snapshot(model, optimizer):
    params = {n: (p.dtype, p.detach().clone(), None if p.grad is None else p.grad.clone())
              for n, p in model.named_parameters()}
    state = {id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for p, s in optimizer.state.items()}
    flags = [m.training for m in model.modules()]
    return params, state, flags, model.drop.p, torch.get_rng_state()


def assert_same(before, after):
    (params, state, flags, p, rng), (params2, state2, flags2, p2, rng2) = before, after
    assert params.keys() == params2.keys()
    for name, (dtype, value, grad) in params.items():
        dtype2, value2, grad2 = params2[name]
        assert dtype2 == dtype and torch.equal(value2, value), name
        assert (grad is None and grad2 is None) or torch.equal(grad, grad2), name
    assert state.keys() == state2.keys()
    for key in state:
        assert all(torch.equal(v, state2[key][k]) if isinstance(v, torch.Tensor) else v == state2[key][k]
                   for k, v in state[key].items())
    assert flags == flags2 and p == p2 and torch.equal(rng, rng2)


@pytest.mark.parametrize("raises", [False, True])
def test_the_model_optimizer_and_accelerator_are_left_as_found(raises):
    accelerator, model, opt, loader = setup(lm_batches(2 * N), optimizer=torch.optim.Adam)
    model(**lm_batches(1)[0])["loss"].backward()  # a gradient and Adam state the check must keep
    opt.optimizer.step()
    model.eval()
    inner = opt.optimizer
    before = snapshot(model, inner)
    state = (accelerator.step, accelerator.gradient_state.sync_gradients)
    check = AccumulationCheck(accelerator, model, opt)
    with pytest.raises(RuntimeError, match="the user's loop broke") if raises else _nothing():
        with check:
            for i, batch in enumerate(check.batches(loader)):
                if raises and i == 5:
                    raise RuntimeError("the user's loop broke")
                with accelerator.accumulate(model):
                    accelerator.backward(model(**batch)["loss"])
                    opt.step()
                    opt.zero_grad()
    assert_same(before, snapshot(model, inner))
    assert "clip_grad_norm_" not in vars(accelerator) and not inner._optimizer_step_pre_hooks
    assert (accelerator.step, accelerator.gradient_state.sync_gradients) == state
    assert check.report.counts_text() == ("1 optimizer step checked, 6 micro-batches seen" if raises else
                                          "2 optimizer steps checked, 8 micro-batches seen")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_bad_input_is_one_line_errors():
    accelerator, model, opt, loader = setup(lm_batches(N))
    calls = [lambda: AccumulationCheck("accelerator", model, opt),
             lambda: AccumulationCheck(accelerator, "model", opt),
             lambda: AccumulationCheck(accelerator, model, "optimizer"),
             lambda: AccumulationCheck(accelerator, model, opt, steps=0),
             lambda: AccumulationCheck(accelerator, model, opt, loss_fn=F.mse_loss, step=lambda m, b: 0),
             lambda: AccumulationCheck(accelerator, model, opt).batches(loader),
             lambda: AccumulationCheck(accelerator, model, opt).report,
             lambda: run_case("padded-tokens", N, 2 * N, fault="drop-micro-batch")]
    for call in calls:
        with pytest.raises(AccumcheckError) as info:
            call()
        assert "\n" not in str(info.value)


def test_a_reference_loss_that_is_not_a_loss_is_a_one_line_error():
    accelerator, model, opt, loader = setup(lm_batches(N))
    check = AccumulationCheck(accelerator, model, opt, step=lambda m, batch: m(**batch)["logits"])
    with pytest.raises(AccumcheckError, match="scalar") as info:
        with check:
            user_loop(check, accelerator, model, opt, loader)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("fault, verdict, matches", [(None, "faithful", None), ("micro-batch-mean", "mismatch", None),
                                                     ("loss-over-n", "constant-factor", "1/N")])
def test_run_case_runs_a_built_in_case_and_its_faults(fault, verdict, matches):
    report = run_case("padded-tokens", N, fault=fault)
    assert report.counts_text() == "3 optimizer steps checked, 10 micro-batches seen of the 10 the data holds"
    assert verdicts(report) == [verdict] * 3 and [s.result.matches for s in report.steps] == [matches] * 3
    assert report.reproduce.startswith("accumcheck stack --stack accelerate --case padded-tokens")


def test_a_missing_accelerate_is_one_actionable_error(monkeypatch):
    """Importing the integration without its stack installed: one AccumcheckError saying what to install."""
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "accelerate", None)
    monkeypatch.delitem(sys.modules, "accumcheck.integrations.accelerate", raising=False)
    with pytest.raises(AccumcheckError, match=r"accumcheck.integrations.accelerate needs accelerate and PyTorch \(accelerate is not installed\); install them with pip install 'accumcheck\[accelerate\]'"):
        importlib.import_module("accumcheck.integrations.accelerate")


def test_a_scheduler_the_loop_steps_is_put_back():
    accelerator, model, opt, loader = setup(lm_batches(2 * N))
    scheduler = accelerator.prepare(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    lr = opt.param_groups[0]["lr"]
    check = AccumulationCheck(accelerator, model, opt, scheduler=scheduler)
    with check:
        for batch in check.batches(loader):
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch)["loss"])
                opt.step()
                scheduler.step()
                opt.zero_grad()
    # a prepared scheduler steps only with the optimizer, once a window, though the loop calls it each micro-batch
    assert verdicts(check.report) == ["faithful", "faithful"]
    assert [s.update.scheduler_steps for s in check.report.steps] == [None, 1]
    assert scheduler.scheduler.last_epoch == 0 and opt.param_groups[0]["lr"] == lr


def test_a_scheduler_not_prepared_and_stepped_every_micro_batch_is_named():
    accelerator, model, opt, loader = setup(lm_batches(2 * N), optimizer=torch.optim.AdamW)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    check = AccumulationCheck(accelerator, model, opt, scheduler=scheduler)
    with check:
        for batch in check.batches(loader):
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch)["loss"])
                opt.step()
                scheduler.step()
                opt.zero_grad()
    report = check.report
    assert verdicts(report) == ["update", "update"] and report.exit_code == 1
    assert "the scheduler stepped 4 times in this window" in report.steps[1].explanation


def test_a_scheduler_must_be_one():
    accelerator, model, opt, _ = setup(lm_batches(1))
    with pytest.raises(AccumcheckError, match="scheduler must be a learning-rate scheduler"):
        AccumulationCheck(accelerator, model, opt, scheduler=0.5)
