"""A tiny Hugging Face Llama over sequences of different lengths (padding labelled -100): three
ways to normalise the loss of an accumulation window, each a setup for ``accumcheck check``.

    accumcheck check examples/llama_window.py:per_micro_batch_mean --full-batch --accum-steps 4
    accumcheck check examples/llama_window.py:token_count --full-batch --loss-reduction token_count
    accumcheck check examples/llama_window.py:token_count --full-batch --loss-reduction mean

The first is what a loop that averages each micro-batch's mean loss computes (transformers#34191);
the second divides the summed loss by the window's token count (``num_items_in_batch``); the
third divides that by the number of micro-steps once more.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

STEPS = 4


def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def batches(n=STEPS, length=12):
    """Micro-batches of two sequences, each of its own length, padded to ``length``."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        ids = torch.randint(1, 64, (2, length), generator=gen)
        mask = (torch.arange(length) < torch.randint(2, length + 1, (2, 1), generator=gen)).long()
        out.append({"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def per_micro_batch_mean():
    """The model's own loss: the mean over each micro-batch's tokens."""
    return {"model": model(), "batches": batches(), "accum_steps": STEPS}


def token_count():
    """The loss summed over tokens and divided by the whole window's token count."""
    window = batches()
    total = sum(int((b["labels"][:, 1:] != -100).sum()) for b in window)

    def step(net, batch):
        logits = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        labels = batch["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                                 ignore_index=-100, reduction="sum")
        return loss / total

    return {"model": model(), "batches": window, "step": step, "accum_steps": STEPS}
