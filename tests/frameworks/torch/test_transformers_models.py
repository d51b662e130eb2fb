"""The Trainer's stack check on the models people train now, each tiny and built from a config:
BERT heads that take ``**kwargs`` but ignore ``num_items_in_batch`` (transformers#47688), a masked
LM whose micro-batches mask different numbers of tokens, and a Mixtral whose loss adds a router
load-balancing term. Each finding has its fault present (named) and absent (faithful, or
batch-level where the model computes over the batch by design)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from accumcheck.integrations.transformers import check  # noqa: E402

N = 4


def bert_config(**extra):
    return transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=64, max_position_embeddings=64, **extra)


class KwargsBert(transformers.BertForSequenceClassification):
    """transformers 5's contract bug on 4.x: the head takes loss kwargs (the Trainer stops dividing
    by N) and its CrossEntropyLoss never sees num_items_in_batch."""

    accepts_loss_kwargs = True

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


class KwargsMaskedLM(transformers.BertForMaskedLM):
    accepts_loss_kwargs = True

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def sentences(count, seed=1, label=False, masked=False):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(5, 12, (1,), generator=gen))
        ids = torch.randint(5, 64, (n,), generator=gen)
        example = {"input_ids": ids.tolist(), "attention_mask": [1] * n}
        if label:
            example["labels"] = int(torch.randint(0, 3, (1,), generator=gen))
        if masked:  # a masked LM's labels: 30% of the tokens, at least one, chosen once per example
            chosen = torch.rand(n, generator=gen) < 0.3
            chosen[int(torch.randint(0, n, (1,), generator=gen))] = True
            example["labels"] = [t if c else -100 for t, c in zip(ids.tolist(), chosen.tolist())]
            example["input_ids"] = [4 if c else t for t, c in zip(ids.tolist(), chosen.tolist())]
        out.append(example)
    return out


def collate(features):
    width = max(len(f["input_ids"]) for f in features)
    batch = {key: torch.tensor([f[key] + [0] * (width - len(f[key])) for f in features])
             for key in ("input_ids", "attention_mask")}
    if isinstance(features[0]["labels"], int):
        batch["labels"] = torch.tensor([f["labels"] for f in features])
    else:
        batch["labels"] = torch.tensor([f["labels"] + [-100] * (width - len(f["labels"])) for f in features])
    return batch


def trainer_for(tmp_path, model, data, kind=None):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                                          gradient_accumulation_steps=N, learning_rate=1e-3, report_to="none",
                                          logging_strategy="no", save_strategy="no", use_cpu=True, disable_tqdm=True,
                                          num_train_epochs=1, seed=0)
    return (kind or transformers.Trainer)(model=model, args=args, train_dataset=data, data_collator=collate)


def test_a_head_that_ignores_num_items_in_batch_is_named_n_n_k(tmp_path):
    """14 examples, 2 a micro-batch: windows of 4 and 3 micro-batches. Each step applies N x (k x on
    the short window) the window's gradient; BERT's key biases carry no signal and name nothing."""
    torch.manual_seed(0)
    trainer = trainer_for(tmp_path, KwargsBert(bert_config(num_labels=3)), sentences(14, label=True))
    report = check(trainer)
    assert [(s.verdict, s.result.matches) for s in report.steps] == [("constant-factor", "N"), ("constant-factor", "k")]
    assert [len(s.micro_batches) for s in report.steps] == [4, 3]
    for s in report.steps:
        assert "transformers#47688" in s.result.explanation and "model_accepts_loss_kwargs = False" in s.result.explanation
        assert any(name.endswith("attention.self.key.bias") for name in s.result.silent_tensors)
        assert not s.result.factor_worst_tensor.endswith("key.bias")
    assert report.exit_code == 1


def test_a_head_the_trainer_divides_is_faithful(tmp_path):
    """Positive control: the same head where the Trainer divides by N (transformers 4.x: the model
    does not take loss kwargs), each micro-batch holding the same number of examples."""
    torch.manual_seed(0)
    trainer = trainer_for(tmp_path, transformers.BertForSequenceClassification(bert_config(num_labels=3)),
                          sentences(14, label=True))
    if trainer.model_accepts_loss_kwargs:  # transformers 5: the head is the bug above (ci/transformers_models.sh)
        pytest.skip("this transformers' BertForSequenceClassification takes loss kwargs and ignores them")
    report = check(trainer)
    assert [s.verdict for s in report.steps] == ["faithful", "faithful"] and report.exit_code == 0


@pytest.mark.parametrize("kind", ["ignores-count", "divided-by-n"])
def test_a_masked_lm_accumulates_each_micro_batchs_own_mean(tmp_path, kind):
    """Micro-batches masking different numbers of tokens: the step is the micro-batches' own mean
    losses summed (x 1: the Trainer skipped its 1/N, #47688) or averaged (x 1/N, #34191's
    weighting), never the window's mean; both named from the micro-batches' own gradients."""
    torch.manual_seed(0)
    model = (KwargsMaskedLM if kind == "ignores-count" else transformers.BertForMaskedLM)(bert_config())
    trainer = trainer_for(tmp_path, model, sentences(16, masked=True))
    report = check(trainer, steps=1)
    result = report.steps[0].result
    assert report.steps[0].verdict == "mismatch" and result.micro_sum_residual < 1e-9
    if trainer.model_accepts_loss_kwargs:
        assert result.micro_sum_factor == pytest.approx(1.0) and "transformers#47688" in result.explanation
    else:
        assert result.micro_sum_factor == pytest.approx(1 / N) and "transformers#34191" in result.explanation


def test_a_masked_lm_normalised_by_the_window_is_faithful(tmp_path):
    """Positive control: a masked LM whose loss takes num_items_in_batch (sums, divides by it)."""

    class WindowMaskedLM(transformers.BertForMaskedLM):
        accepts_loss_kwargs = True

        def forward(self, input_ids=None, attention_mask=None, labels=None, num_items_in_batch=None, **kwargs):
            out = super().forward(input_ids=input_ids, attention_mask=attention_mask)
            total = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), labels.reshape(-1),
                                                      ignore_index=-100, reduction="sum")
            out["loss"] = total / (num_items_in_batch if num_items_in_batch is not None else (labels != -100).sum())
            return out

    torch.manual_seed(0)
    report = check(trainer_for(tmp_path, WindowMaskedLM(bert_config()), sentences(16, masked=True)), steps=1)
    assert report.steps[0].verdict == "faithful" and report.exit_code == 0


def tiny_mixtral():
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1,
                                        max_position_embeddings=64)
    return transformers.MixtralForCausalLM(config)


def causal(count, seed=2):
    """Variable-length sequences with the first label masked: every labelled token is predicted,
    so the Trainer's count is the model's on every transformers release."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(4, 12, (1,), generator=gen))
        ids = torch.randint(1, 64, (n,), generator=gen).tolist()
        out.append({"input_ids": ids, "attention_mask": [1] * n, "labels": [-100] + ids[1:]})
    return out


class RouterAveraged(transformers.Trainer):
    """The router loss divided by the window's micro-batches, as accumulation should."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        term = model.config.router_aux_loss_coef * outputs.aux_loss
        loss = loss - term + term / self.current_gradient_accumulation_steps
        return (loss, outputs) if return_outputs else loss


def test_a_router_loss_added_once_per_micro_batch_is_named(tmp_path):
    report = check(trainer_for(tmp_path, tiny_mixtral(), causal(16)), steps=2)
    for s in report.steps:
        r = s.result
        assert s.verdict == "mismatch" and r.terms_residual < 1e-6
        assert r.main_factor == pytest.approx(1.0, rel=1e-6)  # the cross-entropy part is the window's
        (term,) = r.terms
        assert term.name.startswith("router load-balancing loss") and term.factor == pytest.approx(1.0, rel=1e-6)
        assert term.batch_level
        assert "added once per micro-batch, not divided by the 4 micro-batches (4x its share)" in r.explanation
        assert "transformers#34191" not in r.explanation
    assert report.exit_code == 1


def test_a_router_loss_averaged_over_the_micro_batches_is_batch_level_not_a_fault(tmp_path):
    report = check(trainer_for(tmp_path, tiny_mixtral(), causal(16), kind=RouterAveraged), steps=2)
    assert [s.verdict for s in report.steps] == ["batch-level", "batch-level"]
    assert report.steps[0].result.terms[0].factor == pytest.approx(1 / N, rel=1e-6)
    assert "computed over the batch by design" in report.steps[0].result.explanation
    assert report.exit_code == 0 and report.summary().startswith("FAITHFUL")


class LogitPenalty(transformers.Trainer):
    """A penalty on the logits added to each micro-batch's loss, not divided by N."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        loss = loss + 0.01 * outputs.logits.pow(2).mean()
        return (loss, outputs) if return_outputs else loss


def test_a_term_the_user_names_is_fitted(tmp_path):
    from zoo import tiny_llama

    named = {"logit penalty": lambda out: 0.01 * out.logits.pow(2).mean()}
    report = check(trainer_for(tmp_path, tiny_llama(), causal(8), kind=LogitPenalty), steps=1, terms=named)
    r = report.steps[0].result
    assert [t.name for t in r.terms] == ["logit penalty"] and r.terms[0].factor == pytest.approx(1.0, rel=1e-6)
    assert "the logit penalty is added once per micro-batch" in r.explanation
    # Unnamed, the same step is only a mismatch: nothing says which term.
    plain = check(trainer_for(tmp_path, tiny_llama(), causal(8), kind=LogitPenalty), steps=1).steps[0].result
    assert plain.terms == [] and "logit penalty" not in plain.explanation


def test_a_term_that_raises_is_the_users_error(tmp_path):
    from accumcheck.errors import UserCodeError

    with pytest.raises(UserCodeError, match="the term 'broken' raised KeyError"):
        check(trainer_for(tmp_path, tiny_mixtral(), causal(8)), steps=1, terms={"broken": lambda out: out["nope"]})


class Experts(torch.nn.Linear):
    """A model with transformers 5's experts switch: "grouped_mm" has no float64 kernel."""

    def __init__(self):
        super().__init__(2, 2)
        self.implementation = "grouped_mm"

    def get_experts_implementation(self):
        return {"": self.implementation}

    def set_experts_implementation(self, value):
        self.implementation = value if isinstance(value, str) else value[""]


def test_a_mixture_of_experts_runs_its_eager_experts_in_float64_and_is_put_back():
    from accumcheck.torch.stacks.float64run import Float64Run

    model = Experts()
    with Float64Run(model):
        assert model.implementation == "eager" and model.weight.dtype == torch.float64
    assert model.implementation == "grouped_mm" and model.weight.dtype == torch.float32
    model.implementation = "eager"
    with Float64Run(model):
        assert model.implementation == "eager"
    assert model.implementation == "eager"


def test_an_operation_without_float64_is_one_line_naming_it():
    from accumcheck.torch.stacks.float64run import float64_kernel_error

    assert float64_kernel_error(RuntimeError("Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double"))
    assert float64_kernel_error(RuntimeError('"addmm_impl_cpu_" not implemented for \'Double\''))
    assert float64_kernel_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert float64_kernel_error(ValueError("got Double")) is None


def test_a_mixtral_on_a_release_with_an_experts_switch_is_checked_and_put_back(tmp_path):
    """transformers 5: the default grouped_mm experts have no float64 kernel on the CPU; the check
    runs the eager path and puts the model's choice back (ci/transformers_releases.sh runs this)."""
    model = tiny_mixtral()
    if not hasattr(model, "set_experts_implementation"):
        pytest.skip(f"transformers {transformers.__version__} has one experts path")
    found = model.get_experts_implementation()
    report = check(trainer_for(tmp_path, model, causal(8)), steps=1)
    assert report.steps[0].result.terms and model.get_experts_implementation() == found
