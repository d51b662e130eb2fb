"""full_batch=True on a user's model: the tiny Llama over ragged sequences (padding labelled -100).
A per-micro-batch mean loss is not the full batch's, and not by a constant factor; a loss
normalised by the window's token count is; a token-count loss divided by N again is off by the
constant 1/N."""

import pytest

import accumcheck

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from zoo import tiny_llama, token_batches  # noqa: E402

import accumcheck.torch  # noqa: E402

N = 4


def window_tokens(batches):
    """Labelled tokens the model's shifted loss counts over the whole window."""
    return sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)


def token_count_step(total):
    """The causal LM loss summed over tokens and divided by the window's token count."""
    def step(model, batch):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels.reshape(-1),
                                                 ignore_index=-100, reduction="sum") / total
    return step


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def test_a_per_micro_batch_mean_is_not_the_full_batch_and_not_a_constant_factor(llama):
    batches = token_batches(N)
    report = accumcheck.torch.check(llama, batches=batches, accum_steps=N, full_batch=True)
    f = report.full_batch
    assert report.exit_code == 1 and report.semantic_mismatch and report.flagged == []
    assert not f.equivalent and not f.constant and f.max_relative_difference > 1e-3
    assert f.normalisation == "mean" and f.accumulated_scaled_by == "1/N"
    assert f.item_counts == [int((b["labels"] != -100).sum()) for b in batches] and len(set(f.item_counts)) > 1
    assert "not a constant factor" in f.explanation and f.factor_worst_tensor in f.explanation


def test_a_token_count_normalised_loss_is_the_full_batch(llama):
    batches = token_batches(N)
    report = accumcheck.torch.check(llama, batches=batches, accum_steps=N, full_batch=True,
                                    step=token_count_step(window_tokens(batches)), loss_reduction="token_count")
    accumcheck.assert_faithful(report)
    assert report.full_batch.equivalent and report.full_batch.max_relative_difference < 1e-12


def test_a_token_count_loss_divided_by_n_again_is_a_constant_quarter(llama):
    batches = token_batches(N)
    report = accumcheck.torch.check(llama, batches=batches, accum_steps=N, full_batch=True,
                                    step=token_count_step(window_tokens(batches)), loss_reduction="mean")
    f = report.full_batch
    assert report.exit_code == 1 and f.constant is True and f.matches == "1/N"
    assert f.factor == pytest.approx(0.25, rel=1e-9)
    assert "0.250 x full batch on all 21 tensors" in f.explanation


def test_equal_lengths_make_the_mean_loss_equivalent(llama):
    batches = token_batches(N, ragged=False)
    report = accumcheck.torch.check(llama, batches=batches, accum_steps=N, full_batch=True)
    accumcheck.assert_faithful(report)
    assert report.full_batch.equivalent


def test_an_injected_factor_is_fitted(llama):
    batches = token_batches(N)
    total = window_tokens(batches)
    plain = token_count_step(total)

    def step(model, batch):  # micro-batches (2 sequences) weighted 1.5, the joined batch not
        return plain(model, batch) * (1.5 if len(batch["input_ids"]) == 2 else 1.0)

    report = accumcheck.torch.check(llama, batches=batches, accum_steps=N, full_batch=True, step=step,
                                    loss_reduction="sum")
    f = report.full_batch
    assert f.constant is True and f.factor == pytest.approx(1.5, rel=1e-6) and f.matches is None


def test_batches_that_do_not_join_need_collate(llama):
    batches = [token_batches(1, length=12)[0], token_batches(1, length=9, seed=5)[0]]
    with pytest.raises(accumcheck.AccumcheckError, match=r"full_batch: cannot join .*'input_ids'.* collate="):
        accumcheck.torch.check(llama, batches=batches, accum_steps=2, full_batch=True)

    def collate(parts):  # right-pad to the longest, as a data collator does
        width = max(p["input_ids"].shape[1] for p in parts)
        pad = {"input_ids": 0, "attention_mask": 0, "labels": -100}
        return {k: torch.cat([torch.nn.functional.pad(p[k], (0, width - p[k].shape[1]), value=v) for p in parts])
                for k, v in pad.items()}

    report = accumcheck.torch.check(llama, batches=batches, accum_steps=2, full_batch=True, collate=collate,
                                    step=token_count_step(window_tokens(batches)), loss_reduction="token_count")
    assert report.full_batch.equivalent
