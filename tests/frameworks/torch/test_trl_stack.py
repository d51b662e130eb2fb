"""TRL's trainers under the Trainer's stack check (they subclass transformers.Trainer and override
its loss), on a tiny Llama built from a config and a character tokenizer built here. Runs where TRL
is installed: ci/trl.sh builds that environment (TRL needs numpy >= 1.26, the MXNet environment
of the default suite has 1.23).

Ground truth, measured without accumcheck (float64 model, gradients read before the step, the
window joined as one batch): SFTTrainer with completion-only loss applies the window's gradient
(x 1 within 1e-7: TRL computes its loss in float32 whatever the model's dtype); DPOTrainer too
where the window's micro-batches hold the same number of pairs, and on a last window of 2 + 1
pairs the mean of the two micro-batches' mean losses (x 1/2 their sum, exactly)."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from accumcheck.errors import AccumcheckError  # noqa: E402
from accumcheck.integrations.transformers import check  # noqa: E402

WORDS = "the cat sat on a mat and dog ran far away to see big red sun".split()


def tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, "<unk>": 3}
    for ch in "abcdefghijklmnopqrstuvwxyz0123456789 .,?!:'-\n":
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                                bos_token="<s>", unk_token="<unk>")


def llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
                                      bos_token_id=2, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config)


def text(rng, lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def common(tmp_path, **extra):
    return dict(output_dir=str(tmp_path), per_device_train_batch_size=2, learning_rate=1e-3, use_cpu=True,
                report_to="none", save_strategy="no", logging_strategy="no", bf16=False, fp16=False,
                gradient_checkpointing=False, seed=0, disable_tqdm=True, **extra)


def sft(tmp_path, kind=None, examples=16, accum=4):
    rng = random.Random(1)
    data = datasets.Dataset.from_list([{"prompt": text(rng, 1, 4) + ": ", "completion": text(rng, 1, 6)}
                                       for _ in range(examples)])
    args = trl.SFTConfig(**common(tmp_path, gradient_accumulation_steps=accum, completion_only_loss=True,
                                  num_train_epochs=1))
    return (kind or trl.SFTTrainer)(model=llama(), args=args, train_dataset=data, processing_class=tokenizer())


def dpo(tmp_path, pairs=8, accum=2):
    rng = random.Random(2)
    data = datasets.Dataset.from_list([{"prompt": text(rng, 1, 5) + ": ", "chosen": text(rng, 1, 6),
                                        "rejected": text(rng, 1, 6)} for _ in range(pairs)])
    model = llama()
    ref = llama()
    args = trl.DPOConfig(**common(tmp_path, gradient_accumulation_steps=accum, num_train_epochs=1,
                                  loss_type=["sigmoid"]))
    return trl.DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=data, processing_class=tokenizer())


def test_sft_completion_only_is_faithful(tmp_path):
    report = check(sft(tmp_path))
    assert [s.verdict for s in report.steps] == ["faithful"] * 2 and report.exit_code == 0
    # TRL's loss is float32 whatever the model's dtype: equal to the window's within the factor tolerance
    assert any("float32" in s.result.explanation or "within 1e-9" in s.result.explanation for s in report.steps)


class OwnMeanSFT(trl.SFTTrainer):
    """trl#2617's shape: a compute_loss of its own that averages each micro-batch over its own
    tokens, while the model takes loss kwargs, so the Trainer does not divide by N."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        logits, labels = outputs.logits[:, :-1], inputs["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 ignore_index=-100)
        return (loss, outputs) if return_outputs else loss


def test_sft_with_a_loss_that_ignores_the_window_is_flagged_as_each_micro_batchs_mean_summed(tmp_path):
    report = check(sft(tmp_path, kind=OwnMeanSFT), steps=1)
    result = report.steps[0].result
    assert report.steps[0].verdict == "mismatch" and report.exit_code == 1
    assert result.micro_sum_factor == pytest.approx(1.0, rel=1e-6) and result.micro_sum_residual < 1e-6


def test_dpo_with_equal_micro_batches_is_faithful(tmp_path):
    report = check(dpo(tmp_path))
    assert [s.verdict for s in report.steps] == ["faithful"] * 2 and report.exit_code == 0


def test_dpo_on_a_short_window_of_unequal_micro_batches_averages_their_means(tmp_path):
    """7 pairs, 2 a micro-batch, GA = 2: the last window holds 2 + 1 pairs, and the Trainer divides
    the sum of the two micro-batches' mean losses by 2, weighting the lone pair as two."""
    report = check(dpo(tmp_path, pairs=7))
    assert [s.verdict for s in report.steps] == ["faithful", "mismatch"]
    last = report.steps[1].result
    assert last.micro_sum_factor == pytest.approx(0.5, rel=1e-6) and "transformers#34191" in last.explanation


def test_generating_trainers_are_refused_in_one_line(tmp_path):
    class GRPOTrainer(transformers.Trainer):  # a stand-in with TRL's name: building a real one needs a reward setup
        pass

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(AccumcheckError, match="generates its micro-batches inside the step"):
        check(GRPOTrainer(model=llama(), args=args, train_dataset=[]))
