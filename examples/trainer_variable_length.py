"""A Hugging Face Trainer with gradient_accumulation_steps=4 on variable-length sequences: is each
optimizer step the gradient of its 4 micro-batches as one batch?

    python examples/trainer_variable_length.py [REPORT.json]

A tiny LlamaForCausalLM built from a config (random weights), 36 sequences of 3 to 16 tokens,
labels = input_ids with the padding labelled -100 (as DataCollatorForLanguageModeling makes them),
2 sequences per micro-batch. Prints the per-step table; exits 1 when a step is flagged.
"""

import sys
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from accumcheck.integrations.transformers import check
from accumcheck.render import render


def sequences(count: int = 36, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(3, 17, (1,), generator=gen))
        ids = torch.randint(1, 64, (n,), generator=gen).tolist()
        out.append({"input_ids": ids, "attention_mask": [1] * n, "labels": ids})
    return out


def pad(features: list[dict]) -> dict:
    """Each micro-batch padded to its longest sequence; padded labels are -100."""
    width = max(len(f["input_ids"]) for f in features)
    return {key: torch.tensor([f[key] + [fill] * (width - len(f[key])) for f in features])
            for key, fill in (("input_ids", 0), ("attention_mask", 0), ("labels", -100))}


torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64)
args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2, gradient_accumulation_steps=4,
                         num_train_epochs=1, learning_rate=1e-3, report_to="none", logging_strategy="no",
                         save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0)
trainer = Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=sequences(), data_collator=pad)

report = check(trainer)  # the Trainer's whole run: 18 micro-batches, 5 optimizer steps
print(render(report, "table"))
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as handle:
        handle.write(report.to_json())
sys.exit(report.exit_code)
