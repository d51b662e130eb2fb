"""The Hugging Face Trainer under the stack check: its real loop, on a tiny LlamaForCausalLM built
from a config and variable-length sequences, each optimizer step against its window as one batch.

Positive control: labels whose first position is already -100 (every labelled token is one the
model predicts), faithful at every step. Negative controls: a model the Trainer cannot pass
num_items_in_batch to (each micro-batch's own mean, transformers#34191), a compute_loss dividing
by N once more (1/N), and, with labels = input_ids, transformers 4.57's count of the labels
before the causal shift (transformers#46204: a factor of predicted over labelled tokens).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from zoo import tiny_llama  # noqa: E402

from accumcheck.errors import AccumcheckError, UserCodeError  # noqa: E402
from accumcheck.integrations.transformers import check  # noqa: E402

N = 4


def examples(count: int = 36, first_label_masked: bool = True, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(3, 17, (1,), generator=gen))
        ids = torch.randint(1, 64, (n,), generator=gen).tolist()
        out.append({"input_ids": ids, "attention_mask": [1] * n,
                    "labels": ([-100] + ids[1:]) if first_label_masked else ids})
    return out


def collate(features: list[dict]) -> dict:
    """Pads each micro-batch to its own longest sequence, labels with -100."""
    width = max(len(f["input_ids"]) for f in features)
    return {key: torch.tensor([f[key] + [fill] * (width - len(f[key])) for f in features])
            for key, fill in (("input_ids", 0), ("attention_mask", 0), ("labels", -100))}


def trainer_for(tmp_path, model=None, data=None, kind=None, **overrides):
    args = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=N,
                learning_rate=1e-3, report_to="none", logging_strategy="no", save_strategy="no", use_cpu=True,
                disable_tqdm=True, num_train_epochs=1, seed=0)
    args.update(overrides)
    trainer = (kind or transformers.Trainer)(model=model or tiny_llama(), args=transformers.TrainingArguments(**args),
                                             train_dataset=examples() if data is None else data, data_collator=collate)
    return trainer


def test_first_labels_masked_is_faithful_at_every_step_including_the_short_last_window(tmp_path):
    report = check(trainer_for(tmp_path))
    assert [s.verdict for s in report.steps] == ["faithful"] * 5
    assert [len(s.micro_batches) for s in report.steps] == [4, 4, 4, 4, 2]  # 18 micro-batches, the last window short
    assert report.micro_batches_seen == report.micro_batches_expected == 18 and report.unstepped == []
    # Llama's RMSNorm computes in float32 whatever the model's dtype, so a window rounds apart from its
    # micro-batches where their shapes differ (0 on an AVX-512 CPU here, 5e-8 at step 0 on an AVX2 one).
    assert max(s.result.max_relative_difference for s in report.steps) < 1e-6
    assert report.exit_code == 0


def test_clipping_that_fires_does_not_hide_the_gradient(tmp_path):
    report = check(trainer_for(tmp_path, max_grad_norm=1e-6), steps=2)  # every step's norm is far above 1e-6
    assert [s.verdict for s in report.steps] == ["faithful"] * 2
    assert any("read before clipping" in note for note in report.notes)


def test_labels_counted_before_the_causal_shift_are_a_constant_factor(tmp_path):
    """transformers 4.57 divides by every label that is not -100, the model's loss sums over the
    labels after its shift: each step's gradient is predicted/labelled times the window's
    (huggingface/transformers#46204, fixed in a later release: ci/transformers_releases.sh)."""
    if transformers.__version__ != "4.57.6":
        pytest.skip(f"the pinned test version's behaviour (4.57.6), not {transformers.__version__}'s")
    data = examples(first_label_masked=False)
    report = check(trainer_for(tmp_path, data=data), steps=3)
    assert [s.verdict for s in report.steps] == ["constant-factor"] * 3
    for s in report.steps:
        labelled = sum(s.result.item_counts)
        rows = 2 * len(s.micro_batches)  # each sequence's first label is never predicted
        assert s.result.matches == "predicted/labelled"
        assert s.result.factor == pytest.approx((labelled - rows) / labelled, rel=1e-6)  # FACTOR_TOLERANCE
    assert "transformers#46204" in report.summary()


class NoLossKwargs(torch.nn.Module):
    """A Llama behind a forward the Trainer cannot pass num_items_in_batch to: each micro-batch's
    loss is its own token mean, and the Trainer divides each by N (transformers#34191's loop)."""

    accepts_loss_kwargs = False

    def __init__(self) -> None:
        super().__init__()
        self.llama = tiny_llama()

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.llama(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def test_mean_of_micro_batch_means_is_flagged_as_no_constant_factor(tmp_path):
    report = check(trainer_for(tmp_path, model=NoLossKwargs()), steps=2)
    assert [s.verdict for s in report.steps] == ["mismatch"] * 2
    first = report.steps[0].result
    assert first.matches is None and not first.constant and first.spread > 1e-3
    assert "transformers#34191" in first.explanation
    assert report.exit_code == 1


class LossOverN(transformers.Trainer):
    def compute_loss(self, model, inputs, *args, **kwargs):
        return super().compute_loss(model, inputs, *args, **kwargs) / self.args.gradient_accumulation_steps


def test_a_loss_divided_by_n_once_more_is_fingerprinted_as_1_over_n(tmp_path):
    report = check(trainer_for(tmp_path, kind=LossOverN), steps=2)
    assert [(s.verdict, s.result.matches) for s in report.steps] == [("constant-factor", "1/N")] * 2
    assert report.steps[0].result.factor == pytest.approx(1 / N, rel=1e-6)  # RMSNorm rounds in float32


def test_steps_cut_the_run_short_and_say_so(tmp_path):
    report = check(trainer_for(tmp_path), steps=2)
    assert len(report.steps) == 2 and report.micro_batches_seen == 8
    assert report.micro_batches_expected is None  # the run was cut short: no claim about the rest
    assert report.counts_text() == "2 optimizer steps checked, 8 micro-batches seen"


def _snapshot(model):
    return {name: (p.detach().clone(), p.dtype, None if p.grad is None else p.grad.clone())
            for name, p in model.named_parameters()}


def test_the_model_trainer_and_random_states_are_left_as_found(tmp_path):
    trainer = trainer_for(tmp_path)
    model = trainer.model
    before, state, callbacks = _snapshot(model), trainer.state, list(trainer.callback_handler.callbacks)
    rng = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    check(trainer, steps=2)
    after = _snapshot(model)
    assert all(torch.equal(before[n][0], after[n][0]) and before[n][1] == after[n][1] and after[n][2] is None
               for n in before)
    assert trainer.optimizer is None and trainer.lr_scheduler is None and trainer.state is state
    assert trainer.callback_handler.callbacks == callbacks and "training_step" not in trainer.__dict__
    assert random.getstate() == rng[0] and (np.random.get_state()[1] == rng[1]).all()
    assert torch.equal(torch.get_rng_state(), rng[2])


class Boom(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        raise RuntimeError("the user's callback failed")


def test_the_model_is_put_back_when_the_trainer_raises(tmp_path):
    trainer = trainer_for(tmp_path)
    trainer.add_callback(Boom())
    before = _snapshot(trainer.model)
    # the user's run failed, not the check: one line (exit 2 on the command line), the original chained
    with pytest.raises(UserCodeError, match="the Trainer raised RuntimeError: the user's callback failed") as caught:
        check(trainer, steps=3)
    assert isinstance(caught.value.__cause__, RuntimeError) and "\n" not in str(caught.value)
    after = _snapshot(trainer.model)
    assert all(torch.equal(before[n][0], after[n][0]) and after[n][1] == torch.float32 for n in before)
    assert "clip_grad_norm_" not in trainer.accelerator.__dict__


def test_a_trainer_that_cannot_start_is_the_users_error_and_a_bug_of_ours_is_not(tmp_path, monkeypatch):
    with pytest.raises(UserCodeError, match="the Trainer raised ValueError: num_samples should be a positive"):
        check(trainer_for(tmp_path, data=[]))
    from accumcheck.torch.stacks import recorder

    # accumcheck's own code failing inside the Trainer's run (calling None there): a bug, raised as it is
    monkeypatch.setattr(recorder, "predicted_count", None)
    with pytest.raises(TypeError, match="'NoneType' object is not callable"):
        check(trainer_for(tmp_path), steps=1)


@pytest.mark.parametrize("bad, message", [(object(), "expected a transformers.Trainer"), (0, "positive integer")])
def test_bad_input_is_one_line(tmp_path, bad, message):
    trainer = trainer_for(tmp_path)
    with pytest.raises(AccumcheckError, match=message) as caught:
        check(bad, steps=1) if not isinstance(bad, int) else check(trainer, steps=bad)
    assert "\n" not in str(caught.value)


def test_an_optimizer_and_scheduler_the_user_gave_are_put_back(tmp_path):
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(**collate(examples(2)), ).loss.backward()
    optimizer.step()  # state of its own before the check: a 0-dim step and float32 moments
    optimizer.zero_grad(set_to_none=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    state = {p: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=N, report_to="none",
        logging_strategy="no", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0),
        train_dataset=examples(), data_collator=collate, optimizers=(optimizer, scheduler))
    report = check(trainer, steps=2)
    assert [s.verdict for s in report.steps] == ["faithful"] * 2
    assert all(torch.equal(state[p][k], v) and v.dtype == state[p][k].dtype
               for p, s in optimizer.state.items() for k, v in s.items())
    assert scheduler.last_epoch == 0 and optimizer.param_groups[0]["lr"] == 1e-3


def test_a_missing_transformers_is_one_actionable_error(monkeypatch):
    """Importing the integration without its stack installed: one AccumcheckError saying what to install."""
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "accumcheck.integrations.transformers", raising=False)
    with pytest.raises(AccumcheckError, match=r"accumcheck.integrations.transformers needs transformers, accelerate and PyTorch \(transformers is not installed\); install them with pip install 'accumcheck\[transformers\]'"):
        importlib.import_module("accumcheck.integrations.transformers")
