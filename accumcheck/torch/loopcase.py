"""A built-in case through your own PyTorch loop (``accumcheck stack --stack loop`` and ``--stack
fsdp2``), checked by ``accumcheck.torch.AccumulationCheck``: the loop a user writes, one process,
DistributedDataParallel or FSDP2, each rank on its own micro-batches (rank r's i-th is the case's
i*W + r).

The loop normalises each micro-batch's token-summed loss by its window's labelled tokens over
every rank, times the world size (the all-reduce averages over the ranks), and skips the
gradient sync on all but a window's last micro-step: ``require_backward_grad_sync`` under DDP,
``set_requires_gradient_sync`` under FSDP2. Faults break it on purpose: "loss-over-n" (the loss
divided by N, which the normalisation already is), "micro-batch-mean" (each micro-batch's own
mean), "rank-loss-scaled" (the last rank's loss doubled), "rank-drops-micro-batch" (the last rank
never backwards its window's first micro-batch) and "bfloat16-reduce" (the gradients reduced in
bfloat16: DDP's bf16 compression hook, FSDP2's ``reduce_dtype``).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ..case.reading import resolve_case
from ..errors import AccumcheckError
from ..options.spec import stack_command
from ..report import StackReport
from .loopcheck import AccumulationCheck
from .stacks.cases import FAULTS, RANK_FAULTS, CaseLM, case_batches, window_items

LOOP_FAULTS = FAULTS + RANK_FAULTS + ("bfloat16-reduce",)


def run_case(case: Any, accum_steps: int, batches: int | None = None, fault: str | None = None,
             world_size: int = 1) -> StackReport:
    """The case through a plain loop: one process, or DistributedDataParallel on ``world_size``
    ranks (torchrun's; gloo on the CPU). Returns the StackReport every rank agrees on."""
    return _run(case, accum_steps, batches, fault, world_size, sharded=False)


def run_sharded_case(case: Any, accum_steps: int, batches: int | None = None, fault: str | None = None,
                     world_size: int = 1) -> StackReport:
    """The case through the same loop with the model sharded by FSDP2 (``fully_shard`` over a CPU
    device mesh of ``world_size`` ranks)."""
    return _run(case, accum_steps, batches, fault, world_size, sharded=True)


def _run(case: Any, accum_steps: int, batches: int | None, fault: str | None, world_size: int,
         sharded: bool) -> StackReport:
    name = "fsdp2" if sharded else "loop"
    if fault not in (None, *LOOP_FAULTS):
        raise AccumcheckError(f"--fault {fault}: not a fault the {name} stack runs; use one of {', '.join(LOOP_FAULTS)}")
    if (fault in RANK_FAULTS or fault == "bfloat16-reduce" or sharded) and world_size < 2:
        raise AccumcheckError(f"--stack {name}{' --fault ' + fault if fault else ''}: runs on several ranks; "
                              "give --world-size 2 or more")
    case = resolve_case(case)
    count = (2 * accum_steps + 2) * world_size if batches is None else batches
    micro_batches = case_batches(case, count)
    items = window_items(micro_batches, accum_steps * world_size)  # by the case's numbering, i x W + r
    with _process_group(world_size) as rank:
        report = _train(case, micro_batches[rank::world_size], items, accum_steps, fault, world_size, rank,
                        sharded)
    report.model = f"{case.name} (built-in case)"
    report.reproduce = stack_command(name, case.name, accum_steps, batches, fault, world_size)
    report.micro_batches_expected = count
    return report


def _train(case: Any, mine: list, items: list, accum_steps: int, fault: str | None, world_size: int, rank: int,
           sharded: bool) -> StackReport:
    """This rank's loop over its micro-batches ``mine``, checked: the report. Its model, the DDP or
    FSDP2 wrapping and the check are gone when it returns (``_process_group`` then frees their
    reference cycles before the group goes)."""
    model = CaseLM(case, accum_steps, fault if fault == "micro-batch-mean" else None)
    trained = _shard(model, world_size, fault) if sharded else _replicate(model, world_size, fault)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scale = world_size * (2.0 if fault == "rank-loss-scaled" and rank == world_size - 1 else 1.0) / (
        accum_steps if fault == "loss-over-n" else 1)
    dropping = fault == "rank-drops-micro-batch" and rank == world_size - 1
    check = AccumulationCheck(trained, optimizer, step=lambda m, batch: m(**batch)["loss"])
    with check:
        for i, batch in enumerate(check.batches(mine)):
            last = (i + 1) % accum_steps == 0 or i == len(mine) - 1
            _sync(trained, last, sharded)
            loss = trained(**batch, num_items_in_batch=items[i * world_size + rank])["loss"] * scale
            if not (dropping and i % accum_steps == 0 and not last):
                loss.backward()
            if last:
                torch.nn.utils.clip_grad_norm_(trained.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    return check.report


@contextlib.contextmanager
def _process_group(world_size: int) -> Iterator[int]:
    """This process's rank in a gloo group of ``world_size`` (torchrun's environment), made here
    and destroyed after where none was; 0 in one process."""
    if world_size == 1:
        yield 0
        return
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo")
    try:
        if dist.get_world_size() != world_size:
            raise AccumcheckError(f"--world-size {world_size}: this job has {dist.get_world_size()} ranks; start the "
                                  "ranks with torchrun (accumcheck stack --world-size does)")
        yield dist.get_rank()
        dist.barrier()  # no rank tears down its connections while another still reads from it
    finally:
        if made:
            # DDP's reducer and FSDP2's state hold the group through reference cycles: freed here, while
            # the interpreter runs, not at its shutdown, where gloo's teardown can abort the rank.
            gc.collect()
            dist.destroy_process_group()


def _replicate(model: torch.nn.Module, world_size: int, fault: str | None) -> torch.nn.Module:
    if world_size == 1:
        return model
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if fault == "bfloat16-reduce":
        ddp.register_comm_hook(None, _bfloat16_all_reduce)
    return ddp


def _bfloat16_all_reduce(state, bucket):  # unannotated: DDP checks a hook's annotations against its classes
    """A DDP communication hook averaging each gradient bucket in bfloat16 (what DDP's own
    ``bf16_compress_hook`` does, which is kept to NCCL): cast, divided by the world size, all-reduced,
    cast back into the bucket."""
    buffer = bucket.buffer()
    low = buffer.to(torch.bfloat16).div_(dist.get_world_size())
    reduced = dist.all_reduce(low, async_op=True).get_future()

    def back(done: Any) -> torch.Tensor:
        buffer.copy_(done.value()[0])
        return buffer

    return reduced.then(back)


_bfloat16_all_reduce.reduce_dtype = "bfloat16"  # for the check: the dtype this hook reduces in


def _shard(model: torch.nn.Module, world_size: int, fault: str | None) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if fault == "bfloat16-reduce" else None)
    for layer in model.modules():
        if isinstance(layer, (torch.nn.Linear, torch.nn.Embedding)):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def _sync(model: torch.nn.Module, last: bool, sharded: bool) -> None:
    """Sync the gradients on a window's last micro-step only, as the framework's own switch says."""
    if sharded:
        model.set_requires_gradient_sync(last)
    elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model.require_backward_grad_sync = last
