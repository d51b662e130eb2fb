"""DeepSpeed's own loop (``engine(batch)``, ``engine.backward(loss)``, ``engine.step()`` on every
micro-batch) with gradient_accumulation_steps = 4 under ZeRO stage 1 or 2, on 2 CPU ranks
(``DS_ACCELERATOR=cpu``, gloo), checked by accumcheck.integrations.deepspeed.AccumulationCheck.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/deepspeed_loop.py [--stage 1] [--fault]

``--fault`` divides the loss by N in the loop as well, which engine.backward already does: exit 1
with 1/N named. A small MLP language model, a torch.optim.AdamW handed to deepspeed.initialize (so
nothing compiles), 4 sequences of 16 tokens per micro-batch on each rank. At every accumulation
boundary every rank reads the full gradient the optimizer will apply
(deepspeed.utils.safe_get_full_grad) and judges it against every rank's micro-batches as one batch
on a float64 copy of the module; rank 0 prints the report.
"""

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from accumcheck.integrations.deepspeed import AccumulationCheck  # noqa: E402
from accumcheck.render import render  # noqa: E402

N, VOCAB, WIDTH = 4, 64, 32


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.hidden = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.head = torch.nn.Linear(2 * WIDTH, VOCAB)

    def forward(self, tokens, targets):
        logits = self.head(F.gelu(self.hidden(self.embed(tokens))))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def main(argv: list[str]) -> int:
    stage = int(argv[argv.index("--stage") + 1]) if "--stage" in argv else 2
    fault = "--fault" in argv
    deepspeed.init_distributed("gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = TinyLM()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": N, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config=config)
    data = torch.Generator().manual_seed(1 + rank)  # each rank its own shard of the data
    batches = [(lambda t: (t[:, :-1], t[:, 1:]))(torch.randint(0, VOCAB, (4, 17), generator=data))
               for _ in range(2 * N)]

    # the loss of a window as one batch: the model's mean cross-entropy (backward divides by N)
    check = AccumulationCheck(engine, step=lambda m, batch: m(*batch))
    with check:
        for x, y in check.batches(batches):
            loss = engine(x, y)
            engine.backward(loss / N if fault else loss)
            engine.step()
    report = check.report  # a collective: every rank reads it
    if rank == 0:
        print(render(report, "table"))
    return report.exit_code


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1:]))
