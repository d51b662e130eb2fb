"""An accelerate training loop with gradient accumulation, checked step by step: at every optimizer
step the gradient about to be applied (read before clipping) is judged against its window's
micro-batches as one batch (in float64, the model, optimizer and accelerator put back afterwards).

    python examples/stack_accelerate.py         # accelerate's recipe for windows of different token
                                                # counts: faithful, exit code 0
    python examples/stack_accelerate.py --mean  # each micro-batch's own token mean: flagged, exit code 1
    torchrun --nproc_per_node 2 examples/stack_accelerate.py [--mean]   # the same on 2 CPU processes:
                                                # ten micro-batches per rank, rank r's i-th the data's
                                                # i x 2 + r, each step's window every rank's of it

A tiny language model over sequences of different lengths (padding labelled -100), ten
micro-batches with N = 4: two full windows and a short last one of two, which accelerate steps
because the dataloader is prepared.
"""

import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator

import accumcheck.render
from accumcheck.integrations.accelerate import AccumulationCheck

N, MICRO_BATCHES, VOCAB = 4, 10, 32


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.dropout = torch.nn.Dropout(0.1)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids, labels, num_items_in_batch=None):
        logits = self.head(self.dropout(self.embed(input_ids)))
        total = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum")
        items = (labels != -100).sum() if num_items_in_batch is None else num_items_in_batch
        return {"loss": total / items, "logits": logits}


def micro_batches(count):
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (4, 12), generator=gen)
        lengths = torch.randint(3, 13, (4, 1), generator=gen)
        batches.append({"input_ids": ids, "labels": ids.masked_fill(torch.arange(12) >= lengths, -100)})
    return batches


def main(mean: bool = False) -> int:
    torch.manual_seed(0)
    accelerator = Accelerator(gradient_accumulation_steps=N, cpu=True)
    ranks, rank = accelerator.num_processes, accelerator.process_index
    batches = micro_batches(MICRO_BATCHES * ranks)
    # accelerate's recipe: the window's labelled tokens over every rank, counted before its
    # micro-batches run; rank r's i-th micro-batch is the data's i x ranks + r
    counts = [int((b["labels"] != -100).sum()) for b in batches]
    window = N * ranks
    window_tokens = [sum(counts[j - j % window:j - j % window + window]) for j in range(len(batches))]

    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # one micro-batch per loader batch (accelerate shards a loader's batches over the ranks in turn)
    loader = torch.utils.data.DataLoader(batches, batch_size=1, collate_fn=lambda one: one[0])
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    check = AccumulationCheck(accelerator, model, optimizer)
    with check:
        for i, batch in enumerate(check.batches(loader)):
            with accelerator.accumulate(model):
                if mean:
                    loss = model(**batch)["loss"]  # each micro-batch's own mean (transformers#34191)
                else:  # backward divides by N and DDP averages the ranks: multiply both back, the
                    # window's token count normalises
                    loss = model(**batch, num_items_in_batch=window_tokens[i * ranks + rank])["loss"] * N * ranks
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
    report = check.report  # every rank reads it (a collective); the main process prints it
    if accelerator.is_main_process:
        print(accumcheck.render.render(report, "table"))
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main(mean="--mean" in sys.argv[1:]))
