"""A Hugging Face Trainer under torchrun on 2 CPU ranks (gloo), gradient_accumulation_steps=2,
sequences of different lengths, rank 0's longer than rank 1's: is each optimizer step the
gradient of every rank's micro-batches of it as one batch?

    torchrun --nproc_per_node 2 examples/trainer_ddp.py [--per-rank-tokens] [REPORT.json]

A tiny LlamaForCausalLM built from a config (random weights), 2 sequences per micro-batch on each
rank. ``--per-rank-tokens`` sets average_tokens_across_devices=False, so each rank normalises its
loss by its own tokens (transformers#34242). Every rank runs the check; rank 0 prints the report
(and writes REPORT.json); every rank exits 1 when a step is flagged.
"""

import os
import sys
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from accumcheck.integrations.transformers import check
from accumcheck.render import render


def sequences(count: int = 32, seed: int = 0) -> list[dict]:
    """Micro-batches of 2 rows, long (17 to 24 tokens) and short (3 to 8) in turn: the Trainer's
    loader, not shuffling, hands its micro-batches to the ranks in turn, so rank 0 gets the long."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        low, high = (17, 25) if (i // 2) % 2 == 0 else (3, 9)
        n = int(torch.randint(low, high, (1,), generator=gen))
        ids = torch.randint(1, 64, (n,), generator=gen).tolist()
        out.append({"input_ids": ids, "attention_mask": [1] * n, "labels": ids})
    return out


def pad(features: list[dict]) -> dict:
    """Each micro-batch padded to its longest sequence; padded labels are -100."""
    width = max(len(f["input_ids"]) for f in features)
    return {key: torch.tensor([f[key] + [fill] * (width - len(f[key])) for f in features])
            for key, fill in (("input_ids", 0), ("attention_mask", 0), ("labels", -100))}


class InOrder(Trainer):
    """The Trainer, its sampler not shuffling (the example's data is split by length on purpose)."""

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def main(argv: list[str]) -> int:
    per_rank = "--per-rank-tokens" in argv
    paths = [a for a in argv if not a.startswith("--")]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, num_train_epochs=1, learning_rate=1e-3, report_to="none",
                             logging_strategy="no", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
                             average_tokens_across_devices=not per_rank, ddp_backend="gloo")
    trainer = InOrder(model=LlamaForCausalLM(config), args=args, train_dataset=sequences(), data_collator=pad)
    report = check(trainer, steps=3)  # every rank: 3 optimizer steps, each of 2 ranks x 2 micro-batches
    if int(os.environ.get("RANK", "0")) == 0:
        print(render(report, "table"))
        if paths:
            with open(paths[0], "w") as handle:
                handle.write(report.to_json())
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
