"""Data-parallel accumulation on torch.distributed: DistributedDataParallel's ``no_sync()``
against an all-reduce every micro-step, on gloo (CPU) or nccl (CUDA).

Each of W ranks runs N micro-steps; rank r's micro-step k is global micro-batch k*W + r (the
interleaving of DistributedSampler). One pass per rank feeds every mode:

  native     DDP with ``no_sync()`` for micro-steps 0..N-2: ``.grad`` accumulates locally and
             the last micro-step's backward all-reduces the totals (mean over ranks), in
             ``reduce_dtype`` through DDP's own communication hooks
  manual     each micro-step's gradient averaged over the ranks (float32, what an all-reduce of it
             gives) and added into a buffer of the accumulation dtype, as hand-written
             accumulation under DDP does; summed on rank 0 beside the reference (``dpreference``)
  E, S       float64 sums of the rank's micro-gradients, summed over the ranks at the end
  reference  one process accumulating the W*N global micro-batches, divided by W: the ranks'
             micro-gradients of this same pass, added in the global order on rank 0, the same
             additions as one process's (``dpreference``)

A communication hook wrapping DDP's own records what each rank hands to the all-reduce: its local
no_sync total, judged against that rank's own E and S, which names the rank where an
accumulation went wrong. Under torchrun (or in a process group the caller made) every rank
gathers every other rank's view and returns the same RunResult, so each rank reports the same
(the CLI prints rank 0's); of ranks started here only rank 0's result is read, so only rank 0
gathers.

Launch: ``torch.multiprocessing`` starts W processes on this machine (forked from a server that has
imported PyTorch once, ``forkserver``; rendezvous through a file), unless the process already
belongs to a job: started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set: env://
rendezvous), or with a process group already initialised. Ranks it starts end with the run: an
interrupted run (Ctrl-C; SIGTERM or SIGHUP on the command line) ends them before it returns, and a
rank whose starting process is gone (even SIGKILLed) ends itself.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
import multiprocessing
import os
import pickle
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ..errors import AccumcheckError
from ..report import DataParallelSetup
from ..run.backend import Progress
from ..run.config import RunConfig
from ..run.launch import launched_world_size, raise_pending
from ..run.results import ParamAccumulation, RankAccumulation, RunResult
from .casemodel import build_model, case_loss, deterministic, isolated, to_inputs, to_numpy
from .dpreference import StreamedReference, in_global_order, oracle_reference
from .forkserver import start_method
from .passes import accumulate

REDUCE_DTYPES = ("float32", "bfloat16", "float16")
# A rank waits this long for the others at a collective before giving up (the single-process
# reference runs on rank 0 while the others wait for it).
_TIMEOUT = datetime.timedelta(minutes=30)
# An interrupted run's ranks get this long to go after SIGTERM before SIGKILL.
_GRACE_S = 5.0
# The exit status of a rank that ended because the process that started it was gone.
_ORPHANED = 1


def check_devices(device: str, world_size: int) -> None:
    """Raise AccumcheckError unless ``world_size`` ranks can run on ``device`` here."""
    if not dist.is_available():
        raise AccumcheckError(f"--world-size: this torch {torch.__version__} is built without torch.distributed")
    if device == "cpu":
        return
    if device not in ("gpu", "cuda"):
        raise AccumcheckError(f"--device {device} with --world-size: each rank takes its own GPU (cuda:LOCAL_RANK); "
                              "use --device gpu, or --device cpu for gloo")
    if not torch.cuda.is_available():
        raise AccumcheckError(f"--device {device}: CUDA is not available to torch {torch.__version__}; "
                              "use --device cpu (gloo)")
    if not dist.is_nccl_available():
        raise AccumcheckError(f"--device {device} with --world-size: this torch has no NCCL; use --device cpu (gloo)")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if launched_world_size() else world_size
    if local > torch.cuda.device_count():
        raise AccumcheckError(f"--world-size {world_size}: {local} ranks on this machine need {local} GPUs "
                              f"(nccl gives each rank its own), {torch.cuda.device_count()} present; "
                              "lower --world-size or use --device cpu")


def run_data_parallel(config: RunConfig, versions: dict[str, str], progress: Progress | None = None) -> RunResult:
    """Run ``config`` data-parallel on ``config.world_size`` ranks, N = ``config.accum_steps``
    micro-steps each, with its fault (if any) in the native accumulation of rank
    ``config.fault_rank`` only. Returns the RunResult every rank agrees on. Raises
    AccumcheckError for a device or launch problem."""
    world_size, device = config.world_size, config.device
    check_devices(device, world_size)
    job = {"config": config, "versions": versions}
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise AccumcheckError(f"--world-size {world_size}: this process belongs to a process group of "
                                  f"{dist.get_world_size()} ranks; pass world_size={dist.get_world_size()}")
        return _rank_run(job, dist.get_rank(), world_size, "existing process group", progress)
    launched = launched_world_size()
    if launched is not None:
        if launched != world_size:
            raise AccumcheckError(f"--world-size {world_size}: this process was started by torchrun with "
                                  f"WORLD_SIZE={launched}; pass --world-size {launched} or leave it out")
        rank = int(os.environ["RANK"])
        dist.init_process_group(_backend_for(device), init_method="env://", rank=rank, world_size=world_size,
                                timeout=_TIMEOUT)
        try:
            return _rank_run(job, rank, world_size, "torchrun", progress)
        finally:
            _leave()
    return _spawn(job, world_size, progress)


def _leave() -> None:
    """Destroy the process group once DDP's reducer (kept alive by reference cycles, holding the
    group and Python hooks) is gone: left to interpreter shutdown, gloo's teardown can abort."""
    gc.collect()
    dist.destroy_process_group()


def _backend_for(device: str) -> str:
    return "gloo" if device == "cpu" else "nccl"


# ----------------------------------------------------------------------------- launching


def _spawn(job: dict[str, Any], world_size: int, progress: Progress | None) -> RunResult:
    """Start ``world_size`` processes with torch.multiprocessing and return rank 0's result.

    No rank outlives the call, however it ends: with a result, a rank's error, or Ctrl-C (SIGTERM
    and SIGHUP too, which the command line raises like it) while this process waits, the ranks
    still running are ended here. Where this process dies without a word (SIGKILL), each rank
    ends itself (``_end_with_parent``); the fork server, which stays for the next run, ends when
    its last client (this process and its ranks) has."""
    method = start_method()
    with tempfile.TemporaryDirectory(prefix="accumcheck-ddp-") as folder:
        queue = mp.get_context(method).SimpleQueue()
        # Daemonic: were the ranks ever still running when this process exits, multiprocessing
        # ends them instead of waiting for them (a rank starts no processes of its own).
        context = mp.start_processes(_spawned, args=(world_size, folder, job, queue), nprocs=world_size,
                                     join=False, daemon=True, start_method=method)

        def drain() -> None:
            while not queue.empty():
                phase, done, total = queue.get()
                if progress is not None:
                    progress(phase, done, total)

        try:
            while not context.join(timeout=0.1):
                raise_pending()  # a signal whose Terminated was swallowed ends the wait (launch.py)
                drain()
        except mp.ProcessExitedException as exc:
            errors = sorted(Path(folder).glob("error-*.txt"))
            if errors:
                raise AccumcheckError(errors[0].read_text()) from None
            # Not a usage error: a rank crashed (its own output, above, says where).
            raise RuntimeError(f"rank {exc.error_index} of the data-parallel run died: {exc}") from None
        finally:
            _end(context.processes)
        drain()
        with open(Path(folder) / "result.pkl", "rb") as handle:
            return pickle.load(handle)


def _end(processes: list[Any]) -> None:
    """End the ranks still running: SIGTERM (a rank keeps its default action, death at once), then
    SIGKILL for one still there after ``_GRACE_S``; each one reaped. Nothing to do after a run
    that finished, whose ranks have all been joined."""
    running = [process for process in processes if process.is_alive()]
    for process in running:
        process.terminate()
    deadline = time.monotonic() + _GRACE_S
    for process in running:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


def _end_with_parent() -> None:
    """End this rank as soon as the process that started it ends, however it ends (SIGKILL too):
    a daemon thread waits on multiprocessing's sentinel of the parent process (``parent_process()``,
    the process that asked for the rank, not the fork server that forked it), which becomes ready
    when that process is gone. Linux's PR_SET_PDEATHSIG (torch sets it to SIGINT) follows the
    parent in the process tree, the fork server, which outlives a killed main process."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(_ORPHANED)

    threading.Thread(target=watch, name="accumcheck-parent-watch", daemon=True).start()


def _spawned(rank: int, world_size: int, folder: str, job: dict[str, Any], queue: Any) -> None:
    """Entry point of a spawned rank: rendezvous through a file in ``folder``, run, and leave
    rank 0's result (or this rank's AccumcheckError) there."""
    faulthandler.enable()  # a rank that crashes in native code says where
    _end_with_parent()

    def report(phase: str, done: int, total: int) -> None:
        queue.put((phase, done, total))

    try:
        dist.init_process_group(_backend_for(job["config"].device), init_method=f"file://{folder}/rendezvous",
                                rank=rank, world_size=world_size, timeout=_TIMEOUT)
        try:
            result = _rank_run(job, rank, world_size, "torch.multiprocessing", report if rank == 0 else None)
        finally:
            _leave()
    except AccumcheckError as exc:
        Path(folder, f"error-{rank}.txt").write_text(str(exc))
        sys.exit(2)
    if rank == 0:
        with open(Path(folder) / "result.pkl", "wb") as handle:
            pickle.dump(result, handle, protocol=pickle.HIGHEST_PROTOCOL)


# ----------------------------------------------------------------------------- one rank


def _local_rank(rank: int, world_size: int, launcher: str) -> tuple[int, int]:
    """(local rank, ranks on this machine)."""
    if launcher == "torch.multiprocessing":
        return rank, world_size
    return int(os.environ.get("LOCAL_RANK", rank)), int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def _rank_device(device: str, local_rank: int) -> Any:
    if device == "cpu":
        return torch.device("cpu")
    dev = torch.device("cuda", local_rank)
    torch.cuda.set_device(dev)  # nccl's object collectives use the current device
    return dev


@contextlib.contextmanager
def _threads_per_rank(dev: Any, local_world: int, launcher: str) -> Any:
    """On the CPU, share the cores among the ranks of this machine (oversubscribed OpenMP threads
    spin and make a run many times slower); launched the same way, runs are then bit-identical."""
    if dev.type != "cpu" or launcher == "existing process group":
        yield torch.get_num_threads()
        return
    saved = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // local_world))
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(saved)


def _rank_run(job: dict[str, Any], rank: int, world_size: int, launcher: str,
              progress: Progress | None) -> RunResult | None:
    """This rank's part of the run: its RunResult (the same on every rank), or None on a rank
    other than 0 of ranks spawned here (only rank 0's result is read)."""
    config: RunConfig = job["config"]
    case, steps = config.case, config.accum_steps
    local_rank, local_world = _local_rank(rank, world_size, launcher)
    dev = _rank_device(config.device, local_rank)
    weights = case.weights()
    accum = getattr(torch, config.accum_dtype)
    fault = config.fault if rank == config.fault_rank else None
    find_unused = bool(case.conditional_layers())
    with _threads_per_rank(dev, local_world, launcher) as threads, deterministic(dev) as settings, isolated(dev):
        model = build_model(case, weights, torch.float32, dev)
        ddp = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                                      find_unused_parameters=find_unused)
        handed = _record_comm_hook(ddp, model.canonical, config.reduce_dtype)
        total = case.token_count(world_size * steps) if case.loss_reduction == "token_count" else None

        def step_loss(step: int) -> Any:
            batch = case.batch(step * world_size + rank)
            labels = torch.from_numpy(batch.labels).to(dev)
            return case_loss(case, ddp(to_inputs(batch.inputs, dev, torch.float32), batch.index), labels, total)

        def no_sync_but_last(step: int) -> Any:
            return ddp.no_sync() if step < steps - 1 else contextlib.nullcontext()

        width = sum(p.numel() for p in model.canonical.values())
        # Each micro-gradient goes to rank 0, which sums the single-process reference and manual.
        reference = StreamedReference(width, world_size, rank, torch.float32, accum, dev)
        # (The recorder's manual buffer holds this rank's own sum, which nothing reads.)
        sums = accumulate(model.canonical, step_loss, steps, fault, progress, f"rank {rank}: DDP no_sync + all-reduce",
                          accum, step_context=no_sync_but_last, on_step=reference.add, step_rows=reference.rows,
                          sums=reference.sums)
        summed, manual_flat = reference.finish()
        # Spawned here, only rank 0's result is read: the others hand it their arrays and return.
        everyone = launcher != "torch.multiprocessing"
        summary = {"rank": rank, "host": socket.gethostname(), "loss": sums["loss"], "losses": sums["losses"],
                   "handed": [name in handed for name in model.canonical]}
        views = _gather_views(model.canonical, summary, handed, sums["flat"][1:], sums["native"], rank, world_size,
                              everyone, reference.peer_sums if reference.shared else None)
        oracle = oracle_reference(case, weights, steps, world_size, rank, dev, progress) if config.oracle else None
        single = manual = None
        if rank == 0:
            at = 0
            single, manual = {}, {}
            for name, p in model.canonical.items():
                single[name] = to_numpy(summed[at:at + p.numel()].view(p.shape) / world_size)
                manual[name] = to_numpy(manual_flat[at:at + p.numel()].view(p.shape))
                at += p.numel()
        if everyone:
            shared = [(single, manual, oracle)]
            dist.broadcast_object_list(shared, src=0)
            single, manual, oracle = shared[0]
        # No rank leaves (and tears its connections down) while another still reads from it.
        dist.barrier()
    if views is None:
        return None
    single_loss = in_global_order([v["losses"] for v in views])

    missing = [name for name in model.canonical if any(name not in v["local_native"] for v in views)]
    if missing:
        raise AccumcheckError(f"DistributedDataParallel handed no gradient of {', '.join(missing)} to the all-reduce")
    exact = {name: sum(v["exact"][name] for v in views) / world_size for name in model.canonical}
    absum = {name: sum(v["absum"][name] for v in views) / world_size for name in model.canonical}
    kinds = {p.name: p.kind for p in case.parameters()}
    params = [ParamAccumulation(name=name, kind=kinds[name], native=views[0]["native"][name], manual=manual[name],
                                exact=exact[name], absum=absum[name], reference=single[name],
                                oracle=None if oracle is None else oracle[name])
              for name in model.canonical]
    ranks = [RankAccumulation(rank=v["rank"], host=v["host"], local_native=v["local_native"], exact=v["exact"],
                              absum=v["absum"], native=v["native"]) for v in views]
    losses = {"mean_loss": float(np.mean([v["loss"] for v in views])), "single_process_mean_loss": single_loss}
    name = "cpu" if dev.type == "cpu" else f"cuda ({torch.cuda.get_device_name(dev)})"
    settings["threads"] = threads
    reduce_dtype = config.reduce_dtype
    setup = DataParallelSetup(
        world_size=world_size, backend=dist.get_backend(), launcher=launcher, reduce_dtype=reduce_dtype,
        find_unused_parameters=find_unused, hosts=sorted({v["host"] for v in views}),
        fault_rank=config.fault_rank if config.fault else None,
        native="DistributedDataParallel, no_sync() for micro-steps 1..N-1, all-reduce (mean) on the last"
               + (f", {reduce_dtype} communication hook" if reduce_dtype != "float32" else ""),
        manual=f"every micro-step's gradient averaged over the ranks (float32, as an all-reduce) into a "
               f"{config.accum_dtype} buffer",
        reference=f"one process, the {world_size * steps} global micro-batches, divided by {world_size}",
        micro_batches="rank r, micro-step k: global micro-batch k*W + r")
    return RunResult(params=params, framework="torch", versions=job["versions"], device=name, param_dtype="float32",
                     accum_dtype=config.accum_dtype, losses=losses, settings=settings, ranks=ranks,
                     data_parallel=setup)


def _gather_views(params: dict[str, Any], summary: dict[str, Any], handed: dict[str, Any],
                  sums: tuple[Any, Any], native: dict[str, Any], rank: int, world_size: int,
                  everyone: bool, peer_sums: list | None = None) -> list[dict[str, Any]] | None:
    """Every rank's view on rank 0 (on every rank when ``everyone``), in rank order, None on a
    rank that gets none: its ``summary`` (rank, host, losses, which parameters DDP handed to the
    all-reduce) and, by parameter name, ``local_native`` (what DDP handed), ``exact`` and ``absum``
    (its E and S, ``sums``: flat, parameters in order) and ``native`` (its gradient after the
    all-reduce). The arrays travel as three flat tensors per rank, point to point (pickled objects
    took much longer on gloo): E and S as they are, the rest joined into one; rank 0 reads the E
    and S of the other ranks where they share them with it (``peer_sums``: on rank 0 theirs, rank 1
    onwards, and an empty list on the others; None where they are sent)."""
    summaries: list[Any] = [None] * world_size
    dist.all_gather_object(summaries, summary)
    narrow = _flat_native(params, handed, native)
    flats: list[Any] = [None] * world_size
    flats[rank] = (narrow, *sums)
    # All three to every other rank under ``everyone``; else to rank 0, E and S only if unshared.
    count = 1 if peer_sums is not None and not everyone else 3
    ops = []
    for peer in range(world_size):
        if peer == rank:
            continue
        if everyone or peer == 0:
            ops += [dist.P2POp(dist.isend, tensor, peer) for tensor in flats[rank][:count]]
        if everyone or rank == 0:
            received = tuple(map(torch.empty_like, flats[rank][:count]))
            flats[peer] = received + (tuple(peer_sums[peer - 1]) if count == 1 else ())
            ops += [dist.P2POp(dist.irecv, tensor, peer) for tensor in received]
    if ops:  # batched: NCCL would deadlock on two ranks that each send before they receive
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    if not (everyone or rank == 0):
        return None
    views = []
    for summary_of, arrays in zip(summaries, flats):
        narrow_of, exact_of, absum_of = (tensor.cpu().numpy() for tensor in arrays)
        local_native, native_of, exact, absum = {}, {}, {}, {}
        at, width = 0, exact_of.size
        for name, p, got in zip(params, params.values(), summary_of.pop("handed")):
            span = slice(at, at + p.numel())
            if got:
                local_native[name] = narrow_of[span].reshape(p.shape)
            native_of[name] = narrow_of[width:][span].reshape(p.shape)
            exact[name] = exact_of[span].reshape(p.shape)
            absum[name] = absum_of[span].reshape(p.shape)
            at += p.numel()
        views.append({**summary_of, "local_native": local_native, "native": native_of, "exact": exact,
                      "absum": absum})
    return views


def _flat_native(params: dict[str, Any], handed: dict[str, Any], native: dict[str, Any]) -> Any:
    """This rank's float32 arrays, parameters in order: what DDP handed (zeros where it handed
    nothing), then the gradient after the all-reduce."""
    return torch.cat([(handed[name] if name in handed else torch.zeros_like(p)).reshape(-1).float()
                      for name, p in params.items()]
                     + [native[name].reshape(-1).float() for name in params])


def _record_comm_hook(ddp: Any, params: dict[str, Any], reduce_dtype: str) -> dict[str, Any]:
    """Register DDP's own all-reduce hook for ``reduce_dtype``, wrapped to keep a copy of what this
    rank hands to it; returns the dict (name -> local total) it fills on the synchronising step."""
    inner = {"float32": default_hooks.allreduce_hook, "bfloat16": default_hooks.bf16_compress_hook,
             "float16": default_hooks.fp16_compress_hook}[reduce_dtype]
    names = {id(p): name for name, p in params.items()}
    handed: dict[str, Any] = {}

    def hook(state, bucket):  # no annotations: DDP checks them against dist.GradBucket
        for param, grad in zip(bucket.parameters(), bucket.gradients()):
            handed[names[id(param)]] = grad.detach().clone()
        return inner(state, bucket)

    ddp.register_comm_hook(None, hook)
    return handed
