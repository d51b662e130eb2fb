"""The Hugging Face Trainer with gradient_accumulation_steps=4 on the models people train now,
each tiny and built from a config (random weights):

    python examples/trainer_models.py bert-classification   # 14 sentences: windows of 4 and 3 micro-batches
    python examples/trainer_models.py bert-masked-lm        # 16 sentences, 30% of tokens masked
    python examples/trainer_models.py mixtral               # 16 sequences, output_router_logits=True

Prints the per-step table and the report's summary; exits 1 when a step is flagged. What each
shows depends on your transformers release: from 5.x, BERT's heads take **kwargs (the Trainer stops
dividing by N) and ignore num_items_in_batch (transformers#47688); Mixtral adds its router
load-balancing loss once per micro-batch on every release.
"""

import sys
import tempfile

import torch
import transformers

from accumcheck.integrations.transformers import check
from accumcheck.render import render

N = 4


def sentences(count: int, masked: bool, seed: int = 1) -> list[dict]:
    """Sentences of 5 to 11 tokens; a class label each, or (masked) 30% of the tokens masked."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(5, 12, (1,), generator=gen))
        ids = torch.randint(5, 64, (n,), generator=gen)
        example = {"input_ids": ids.tolist(), "attention_mask": [1] * n,
                   "labels": int(torch.randint(0, 3, (1,), generator=gen))}
        if masked:
            chosen = torch.rand(n, generator=gen) < 0.3
            chosen[int(torch.randint(0, n, (1,), generator=gen))] = True
            example["labels"] = [t if c else -100 for t, c in zip(ids.tolist(), chosen.tolist())]
            example["input_ids"] = [4 if c else t for t, c in zip(ids.tolist(), chosen.tolist())]
        out.append(example)
    return out


def sequences(count: int, seed: int = 2) -> list[dict]:
    """Causal LM sequences of 4 to 11 tokens, the first label masked (every label is predicted)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(4, 12, (1,), generator=gen))
        ids = torch.randint(1, 64, (n,), generator=gen).tolist()
        out.append({"input_ids": ids, "attention_mask": [1] * n, "labels": [-100] + ids[1:]})
    return out


def pad(features: list[dict]) -> dict:
    """Each micro-batch padded to its longest sequence; padded labels are -100."""
    width = max(len(f["input_ids"]) for f in features)
    batch = {key: torch.tensor([f[key] + [0] * (width - len(f[key])) for f in features])
             for key in ("input_ids", "attention_mask")}
    labels = [f["labels"] for f in features]
    batch["labels"] = torch.tensor(labels if isinstance(labels[0], int) else
                                   [x + [-100] * (width - len(x)) for x in labels])
    return batch


def model_and_data(name: str):
    torch.manual_seed(0)
    bert = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=64)
    if name == "bert-classification":
        return transformers.BertForSequenceClassification(transformers.BertConfig(num_labels=3, **bert)), \
            sentences(14, masked=False)
    if name == "bert-masked-lm":
        return transformers.BertForMaskedLM(transformers.BertConfig(**bert)), sentences(16, masked=True)
    if name == "mixtral":
        config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                            num_experts_per_tok=2, output_router_logits=True,
                                            router_aux_loss_coef=0.1, max_position_embeddings=64)
        return transformers.MixtralForCausalLM(config), sequences(16)
    sys.exit(f"usage: python examples/trainer_models.py bert-classification|bert-masked-lm|mixtral (got {name!r})")


def trainer_for(name: str) -> transformers.Trainer:
    model, data = model_and_data(name)
    args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2,
                                          gradient_accumulation_steps=N, num_train_epochs=1, learning_rate=1e-3,
                                          report_to="none", logging_strategy="no", save_strategy="no", use_cpu=True,
                                          disable_tqdm=True, seed=0)
    return transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=pad)


if __name__ == "__main__":
    report = check(trainer_for(sys.argv[1] if len(sys.argv) > 1 else ""))
    print(render(report, "table"))
    sys.exit(report.exit_code)
