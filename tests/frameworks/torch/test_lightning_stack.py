"""The Lightning stack check (accumcheck.integrations.lightning): a callback on a
``Trainer(accumulate_grad_batches=N)`` fit, every optimizer step judged against its window as one
batch, the module and optimizer put back afterwards."""

from __future__ import annotations

import logging
import warnings

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")

import torch.nn.functional as F  # noqa: E402
from zoo import TinyLM, lm_batches  # noqa: E402

from accumcheck.errors import AccumcheckError  # noqa: E402
from accumcheck.integrations.lightning import AccumulationCheck, run_case  # noqa: E402

N = 4


class LitLM(pl.LightningModule):
    """TinyLM's token-mean loss per micro-batch (times ``scale``), logged as a user would."""

    def __init__(self, scale=1.0, fail_at=None, optimizer=None):
        super().__init__()
        self.lm = TinyLM()
        self.scale, self.fail_at, self.optimizer = scale, fail_at, optimizer
        self.logged, self.norms = 0, []

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise RuntimeError("the user's training_step broke")
        scale = 1 / self.trainer.accumulate_grad_batches if self.scale == "1/N" else self.scale
        loss = self.lm(**batch)["loss"] * scale
        self.log("train_loss", loss)
        return {"loss": loss}

    def log(self, *args, **kwargs):
        self.logged += 1
        return super().log(*args, **kwargs)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        before = torch.nn.utils.get_total_norm([p.grad for p in self.parameters()])
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.norms.append((float(before), float(torch.nn.utils.get_total_norm([p.grad for p in self.parameters()]))))

    def configure_optimizers(self):
        return self.optimizer or torch.optim.SGD(self.parameters(), lr=0.1)


def fit(module, batches, check, **trainer):
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=N, callbacks=[check],
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   **trainer).fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    return check.report


def checked(batches, steps=None, **options):
    trainer = {k: options.pop(k) for k in list(options) if k.startswith("gradient_clip")}
    module = LitLM(**options)
    return module, fit(module, batches, AccumulationCheck(steps=steps), **trainer)


def verdicts(report):
    return [s.verdict for s in report.steps]


def test_equal_micro_batches_with_a_mean_loss_are_faithful_and_the_reference_logs_nothing():
    module, report = checked(lm_batches(2 * N))
    assert verdicts(report) == ["faithful", "faithful"]
    assert [s.micro_batches for s in report.steps] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert report.counts_text() == "2 optimizer steps checked, 8 micro-batches seen"
    assert report.unstepped == [] and report.exit_code == 0
    assert module.logged == 2 * N  # the two window references ran training_step with self.log silenced


def test_a_per_micro_batch_token_mean_over_different_lengths_is_a_mismatch():
    _, report = checked(lm_batches(2 * N, variable=True))
    assert verdicts(report) == ["mismatch", "mismatch"]
    assert report.exit_code == 1 and report.counts_text() == "2 optimizer steps checked, 8 micro-batches seen"


def test_a_training_step_dividing_by_n_as_lightning_does_is_the_constant_factor_1_over_n():
    _, report = checked(lm_batches(2 * N), scale="1/N")  # loss / self.trainer.accumulate_grad_batches
    assert [s.result.matches for s in report.steps] == ["1/N", "1/N"]
    assert verdicts(report) == ["constant-factor", "constant-factor"]


def test_a_constant_in_the_loss_is_the_loss_itself_for_the_reference_as_well():
    # what training_step returns defines the loss; only a division by the run's N is a window's
    _, report = checked(lm_batches(2 * N), scale=1 / N)
    assert verdicts(report) == ["faithful", "faithful"]


def test_clipping_that_fires_does_not_hide_the_gradient_it_clipped():
    module, report = checked(lm_batches(2 * N), gradient_clip_val=1e-3)
    assert len(module.norms) == 2 and all(before > 1e-2 and after == pytest.approx(1e-3, rel=1e-3)
                                          for before, after in module.norms)
    assert verdicts(report) == ["faithful", "faithful"]


def test_the_short_last_window_of_an_epoch_steps_divided_by_n_not_k():
    # Lightning steps on the epoch's last batch, but its loss was divided by N: k/N
    _, report = checked(lm_batches(N + 2))
    assert verdicts(report) == ["faithful", "constant-factor"]
    last = report.steps[1]
    assert last.micro_batches == [4, 5] and last.result.matches == "k/N"
    assert last.result.factor == pytest.approx(2 / N)
    assert report.unstepped == [] and report.counts_text() == "2 optimizer steps checked, 6 micro-batches seen"


def test_steps_stops_the_fit_after_that_many_optimizer_steps():
    _, report = checked(lm_batches(3 * N), steps=1)
    assert report.counts_text() == "1 optimizer step checked, 4 micro-batches seen"


class LitRegression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        self.dtypes = set()

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.dtypes |= {x.dtype, y.dtype}
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_tuple_batches_reach_training_step_in_float64_and_a_loss_override_is_the_reference():
    torch.manual_seed(0)
    batches = [(torch.randn(5, 3), torch.randn(5, 1)) for _ in range(N)]
    module = LitRegression()
    report = fit(module, batches, AccumulationCheck())
    assert module.dtypes == {torch.float64} and verdicts(report) == ["faithful"]
    doubled = fit(LitRegression(), batches, AccumulationCheck(loss=lambda m, b: 2 * F.mse_loss(m.net(b[0]), b[1])))
    assert [s.result.factor for s in doubled.steps] == [pytest.approx(0.5)]


def snapshot(module, optimizer):
    params = {n: (p.dtype, p.detach().clone(), None if p.grad is None else p.grad.clone())
              for n, p in module.named_parameters()}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    return params, state, [m.training for m in module.modules()], module.lm.drop.p, torch.get_rng_state()


@pytest.mark.parametrize("fail_at", [None, 5])
def test_the_module_and_optimizer_are_left_as_found(fail_at):
    module = LitLM(fail_at=fail_at)
    module.optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
    module.lm(**lm_batches(1)[0])["loss"].backward()  # a gradient and Adam state the check must keep
    module.optimizer.step()
    module.eval()
    before = snapshot(module, module.optimizer)
    check = AccumulationCheck()
    with pytest.raises(RuntimeError, match="training_step broke") if fail_at else _nothing():
        fit(module, lm_batches(2 * N), check)
    after = snapshot(module, module.optimizer)
    for name, (dtype, value, grad) in before[0].items():
        dtype2, value2, grad2 = after[0][name]
        assert dtype2 == dtype and torch.equal(value2, value) and torch.equal(grad2, grad), name
    assert before[1].keys() == after[1].keys()
    assert all(torch.equal(v, after[1][key][k]) for key, s in before[1].items() for k, v in s.items())
    assert before[2:4] == after[2:4] and torch.equal(before[4], after[4])
    assert "log" not in vars(module) and "batch_to_device" not in vars(module.trainer.strategy)
    assert check.report.counts_text() == ("1 optimizer step checked, 6 micro-batches seen" if fail_at else
                                          "2 optimizer steps checked, 8 micro-batches seen")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_bad_input_is_one_line_errors():
    calls = [lambda: AccumulationCheck(steps=0), lambda: AccumulationCheck(steps=True),
             lambda: AccumulationCheck(loss="mse"), lambda: AccumulationCheck().report,
             lambda: run_case("padded-tokens", N, 2 * N, fault="drop-micro-batch"),
             lambda: fit(LitLM(), lm_batches(N), AccumulationCheck(loss=lambda m, batch: m.lm(**batch)["logits"]))]
    for call in calls:
        with pytest.raises(AccumcheckError) as info:
            call()
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("fault, verdict, matches", [(None, "faithful", None), ("micro-batch-mean", "mismatch", None),
                                                     ("loss-over-n", "constant-factor", "1/N")])
def test_run_case_runs_a_built_in_case_and_its_faults(fault, verdict, matches):
    report = run_case("padded-tokens", N, fault=fault)
    assert report.counts_text() == "3 optimizer steps checked, 10 micro-batches seen of the 10 the data holds"
    assert verdicts(report) == [verdict] * 3 and [s.result.matches for s in report.steps] == [matches] * 3
    assert report.model == "padded-tokens (built-in case)"


def test_a_missing_lightning_is_one_actionable_error(monkeypatch):
    """Importing the integration without its stack installed: one AccumcheckError saying what to install."""
    import importlib
    import sys

    for name in [m for m in sys.modules if m == "lightning" or m.startswith("lightning.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "accumcheck.integrations.lightning", raising=False)
    with pytest.raises(AccumcheckError, match=r"accumcheck.integrations.lightning needs lightning and PyTorch \(lightning(\.pytorch)? is not installed\); install them with pip install 'accumcheck\[lightning\]'"):
        importlib.import_module("accumcheck.integrations.lightning")


class ScheduledLM(LitLM):
    """AdamW with weight decay and a scheduler Lightning steps once per optimizer step; with
    ``every_batch`` the training_step also steps it, a mistake Lightning lets a user make."""

    def __init__(self, every_batch=False):
        super().__init__()
        self.every_batch = every_batch

    def training_step(self, batch, batch_idx):
        found = super().training_step(batch, batch_idx)
        if self.every_batch:
            self.lr_schedulers().step()
        return found

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9),
                                                   "interval": "step"}}


def test_adamw_with_a_scheduler_lightning_steps_makes_one_update_per_window():
    report = fit(ScheduledLM(), lm_batches(3 * N), AccumulationCheck())
    assert verdicts(report) == ["faithful"] * 3 and report.exit_code == 0
    assert all(s.update.one_update and s.update.error <= 1 for s in report.steps)
    assert [s.update.scheduler_steps for s in report.steps] == [None, 1, 1]


def test_a_training_step_that_steps_the_scheduler_every_batch_is_named():
    report = fit(ScheduledLM(every_batch=True), lm_batches(3 * N), AccumulationCheck())
    assert report.exit_code == 1 and verdicts(report)[1:] == ["update", "update"]
    assert "the scheduler stepped 5 times in this window" in report.steps[1].explanation
