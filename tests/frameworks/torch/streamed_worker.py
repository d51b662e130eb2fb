"""One rank of the test of the data-parallel reference's sums (test_distributed.py), started with
torch.multiprocessing: every rank hands its micro-steps to ``StreamedReference``, with its steps
shared with rank 0 and then sent to it, and rank 0 saves what it summed."""

import json
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from accumcheck.torch.dpreference import StreamedReference
from accumcheck.torch.passes import ROWS, STEP_ROWS

WIDTH, STEPS = 4099, 11


def micro_gradient(step: int, rank: int) -> np.ndarray:
    """Values over twelve orders of magnitude and both signs: added in another order, or rounded
    once instead of per step, the sums come out different."""
    rng = np.random.default_rng(1000 * step + rank)
    return (rng.standard_normal(WIDTH) * 10.0 ** rng.integers(-6, 6, WIDTH)).astype(np.float32)


def run(rank: int, world_size: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world_size)
    try:
        for share in (True, False):
            for accum in (torch.float32, torch.float64):
                reference = StreamedReference(WIDTH, world_size, rank, torch.float32, accum, torch.device("cpu"),
                                              share=share)
                # A rank writes each step into rows used in turn, as the step recorder does.
                rows = reference.rows if reference.rows is not None else torch.empty(ROWS, WIDTH)
                for step in range(STEPS):
                    row = rows[step % STEP_ROWS]
                    row.copy_(torch.from_numpy(micro_gradient(step, rank)))
                    reference.add(row)
                total, manual = reference.finish()
                if rank == 0:
                    name = f"{'shared' if share else 'sent'}-{str(accum).removeprefix('torch.')}"
                    np.save(Path(folder, f"{name}-total.npy"), total.numpy())
                    np.save(Path(folder, f"{name}-manual.npy"), manual.numpy())
                    Path(folder, f"{name}.json").write_text(json.dumps({"shared": reference.shared}))
                dist.barrier()
    finally:
        dist.destroy_process_group()
