"""DeepSpeed under accumcheck: the user's own loop over a ``deepspeed.initialize`` engine with
``gradient_accumulation_steps`` N (ZeRO stage 0, 1 or 2), run for K optimizer steps with each step's
gradient set beside its global window's gradient as one batch.

    check = AccumulationCheck(engine, steps=3)
    with check:
        for batch in check.batches(loader):
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
    report = check.report   # every rank holds the same report; print it on rank 0

What DeepSpeed does is what is judged: ``engine.backward`` divides every micro-batch's loss by N
(``scale_wrt_gas``), the reduction averages over the data-parallel ranks, and ``engine.step`` steps
only at an accumulation boundary. A window is every rank's micro-batches of that step. At each
boundary, before ``engine.step()`` unscales and clips, every rank reads the gradient the optimizer
will apply with ``deepspeed.utils.safe_get_full_grad`` (a collective under ZeRO); the window's
gradient is computed on a float64 copy of the engine's module holding its weights at that step (ZeRO
1 and 2 keep every rank's module whole). The engine runs in its dtypes (bf16, fp16, a
``grad_accum_dtype``, a ``communication_data_type``) and below float64 is judged against their
round-off. On exit the module's weights, the optimizer's master weights and state, the loss scaler,
the engine's counters, its scheduler and the random states are put back, also when the loop raises.

Refused in one line (AccumcheckError): ZeRO stage 3 (each rank's module holds only its shard),
the pipeline engine, ``managed_gradient_accumulation: false`` (the reduction runs inside ``step``),
an engine without an optimizer, a ``with`` block entered in the middle of a window, and a rank that
does not run the check (the ranks meet at the block's start) or feeds its micro-batches around it.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import sys
import warnings
from typing import Any, Callable, Iterator

from ..case.reading import resolve_case
from ..errors import AccumcheckError
from ..options.spec import stack_command
from ..report import StackReport
from . import missing

try:
    import torch

    from ..run.results import StepPrecision
    from ..torch import loopcheck
    from ..torch.stacks.cases import FAULTS, RANK_FAULTS, CaseLM, case_batches, window_items
    from ..torch.stacks.float64run import Float64Run, float64_copy, refresh_copy, stack_library
    from ..torch.stacks.reference import reference_keyword
except ModuleNotFoundError as exc:
    raise missing(__name__, exc, "DeepSpeed and PyTorch", "pip install torch deepspeed") from None

# the engine's and its ZeRO optimizer's step-by-step state, put back on exit
_ENGINE_STATE = ("global_steps", "global_samples", "micro_steps", "skipped_steps", "_global_grad_norm", "_step_applied")
_OPTIMIZER_STATE = ("micro_step_id", "overflow", "_global_grad_norm")
# the faults a built-in run through DeepSpeed breaks its loop with ("bfloat16-reduce": the engine's
# communication_data_type set to bf16)
DEEPSPEED_FAULTS = FAULTS + RANK_FAULTS + ("bfloat16-reduce",)


class AccumulationCheck(loopcheck.AccumulationCheck):
    """The check of a user's loop over a DeepSpeed engine. ``loss_fn(model(inputs), target)``,
    ``step(model, batch)`` or the model's own loss (``model(**batch).loss``, or the tensor the module
    returns) is the loss of the window as one batch, computed on a float64 copy of
    ``engine.module``: the loss as the loop computes it before any division by N. ``steps`` stops
    the loop after that many optimizer steps; ``reference`` ("auto", "joined", "micro-batches") as for
    ``accumcheck.torch.AccumulationCheck``. ``report`` is the StackReport once the ``with`` block
    is left; every rank must read it (it is agreed on with a collective) and every rank holds the
    same."""

    who = "deepspeed.AccumulationCheck"
    judges_updates = False  # the engine's optimizer steps its own partitions, not replayed here
    restored = ("module's weights, the optimizer's master weights and state, the loss scaler, the engine's counters "
                "and the random states")
    def __init__(self, engine: Any, loss_fn: Callable[..., Any] | None = None,
                 step: Callable[[Any, Any], Any] | None = None, steps: int | None = None,
                 reference: str = "auto", memory_budget: int | str | None = None) -> None:
        deepspeed = stack_library("deepspeed", "DeepSpeed")
        _refuse_unjudgeable(engine, deepspeed, self.who)
        scheduler = engine.lr_scheduler if callable(getattr(engine.lr_scheduler, "state_dict", None)) else None
        # the engine is judged against a float64 copy of its module: a budget must hold it
        loopcheck.replica_fits(memory_budget, engine.module, engine.optimizer, self.who)
        super().__init__(engine.module, engine.optimizer, loss_fn, step, steps, scheduler, reference)
        self.memory_budget = memory_budget
        self.engine = engine
        self.version = deepspeed.__version__
        self._full_grad = deepspeed.utils.safe_get_full_grad
        # the engine's flat buffers and reductions are set up for its dtypes: it runs in them, judged
        # against a float64 copy of its module
        self.parallel = True
        self.run = Float64Run(self.model, (self.optimizer,), float64=False)

    # -------------------------------------------------------------- the block

    def __enter__(self) -> "AccumulationCheck":
        engine = self.engine
        if not self._inside:
            _refuse_mid_window(engine, self.who)
        super().__enter__()
        try:
            self.recorder.unwatch()  # a ZeRO optimizer steps its torch optimizer once per param group: the
            # boundaries of engine.step are counted instead
            self.recorder.precision = engine_precision(engine)
            self._saved = _EngineState(engine, self.optimizer)
            engine.step = self._stepped_at_boundary(engine.step)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._inside:
            return
        try:
            self.engine.__dict__.pop("step", None)
        finally:
            try:
                super().__exit__(*exc)
            finally:
                saved = getattr(self, "_saved", None)
                if saved is not None:
                    saved.restore()
                    self._saved = None

    def _stepped_at_boundary(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """``engine.step`` that, at an accumulation boundary, first captures the window (on every rank:
        the gradient gathered, the window's micro-batches gathered) and counts the optimizer step."""
        def step_at_boundary(*args: Any, **kwargs: Any) -> Any:
            if self.engine.is_gradient_accumulation_boundary():
                self._same_feed()
                self.recorder.stepped()
            return step(*args, **kwargs)
        return step_at_boundary

    def _same_feed(self) -> None:
        """Every rank recorded micro-batches for this window, or none did (a rank whose micro-batches
        go around ``check.batches`` would leave them out of the window)."""
        counts = self.recorder.world.gather(len(self.recorder.pending))
        if any(counts) and not all(counts):
            listed = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
            raise AccumcheckError(f"{self.who}: the ranks recorded different numbers of micro-batches for one optimizer "
                                  f"step ({listed}); every rank must iterate `for batch in check.batches(loader):`")

    # -------------------------------------------------------------- what is read

    def _applied(self, name: str, param: torch.nn.Parameter) -> torch.Tensor | None:
        """The whole gradient the engine's optimizer applies (before it unscales an fp16 loss scale
        and clips): ``safe_get_full_grad``, a collective under ZeRO, divided by the loss scale."""
        grad = self._full_grad(param)
        if grad is not None and self.engine.fp16_enabled():
            grad = grad.float() / float(getattr(self.engine.optimizer, "loss_scale", 1.0) or 1.0)
        return grad

    def _reference(self) -> torch.nn.Module:
        """The float64 copy of the engine's module, holding its weights now (without the engine's
        forward hooks)."""
        if self._replica is None:
            self._replica = float64_copy(self.model, (self.engine,))
            _without_engine_hooks(self._replica, self.engine)
        else:
            refresh_copy(self._replica, self.model)
        return self._replica

    # -------------------------------------------------------------- the report

    def _accum_steps(self) -> int:
        return int(self.engine.gradient_accumulation_steps())

    def _loop_note(self, reference: str) -> str:
        engine = self.engine
        clip = engine.gradient_clipping()
        return (f"the user's loop: a DeepSpeed engine (ZeRO stage {engine.zero_optimization_stage()}, "
                f"gradient_accumulation_steps={engine.gradient_accumulation_steps()}); the gradient is read with "
                "deepspeed.utils.safe_get_full_grad at each accumulation boundary, before engine.step()"
                f"{f' clips it to {clip:g}' if clip else ''}; {reference} for the window's reference")

    def _stack(self) -> tuple[str, dict[str, str], str]:
        return "deepspeed", {"deepspeed": self.version, "torch": torch.__version__}, \
            f"accumcheck.integrations.deepspeed.AccumulationCheck(engine, steps={self.steps}" \
            f"{reference_keyword(self.window_reference)}{self._budget_keyword()})"


def engine_precision(engine: Any) -> StepPrecision:
    """The dtypes the engine computes each micro-batch's gradient in (its module's: bf16, fp16 or
    float32), sums a rank's micro-batches in (``grad_accum_dtype``, default the module's; ZeRO-2
    sums its reduced partitions in float32 where either is float32) and reduces over the ranks in
    (``communication_data_type``, default the module's)."""
    model, accumulation = engine.get_data_types()
    if engine.zero_optimization_stage() == 2 and torch.float32 in (model, accumulation):
        accumulation = torch.float32
    reduction = engine.communication_data_type
    return StepPrecision(accumulation=_dtype(accumulation), reduction=_dtype(reduction), computed=_dtype(model))


def _dtype(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _refuse_unjudgeable(engine: Any, deepspeed: Any, who: str) -> None:
    """AccumcheckError, in one line, for an engine the check cannot judge."""
    if not isinstance(engine, deepspeed.DeepSpeedEngine):
        raise AccumcheckError(f"{who}: expected the engine deepspeed.initialize returns, got {type(engine).__name__}")
    if isinstance(engine, deepspeed.PipelineEngine):
        raise AccumcheckError(f"{who}: the pipeline engine (PipelineEngine.train_batch) runs its micro-batches itself; "
                              "the check judges a loop that calls engine(batch), engine.backward and engine.step")
    stage = engine.zero_optimization_stage()
    if stage >= 3:
        raise AccumcheckError(f"{who}: ZeRO stage {stage} partitions the weights, so no rank holds the module whole "
                              "for the reference; run the check under ZeRO stage 1 or 2 (the accumulation is the same)")
    managed = getattr(engine, "managed_gradient_accumulation", None)
    if callable(managed) and not managed():
        raise AccumcheckError(f"{who}: managed_gradient_accumulation is false, so the gradients are reduced inside "
                              "engine.step() and cannot be read before it; run the check with the default (true)")
    optimizer = engine.optimizer
    if optimizer is None or type(optimizer).__name__ == "DummyOptim":
        raise AccumcheckError(f"{who}: the engine has no optimizer; pass one to deepspeed.initialize (optimizer= or "
                              "the config's \"optimizer\")")


def _refuse_mid_window(engine: Any, who: str) -> None:
    """AccumcheckError where the engine is inside a window: its first micro-batches would be in the
    applied gradient and in no recorded window."""
    gas = engine.gradient_accumulation_steps()
    if getattr(engine, "_is_gradient_accumulation_boundary", None) is None and engine.micro_steps % gas:
        raise AccumcheckError(f"{who}: entered at micro-step {engine.micro_steps % gas} of a window of {gas}; enter "
                              "`with check:` before a window's first micro-batch")


def _without_engine_hooks(copied: torch.nn.Module, engine: Any) -> None:
    """The forward hooks the engine put on its module, taken off the copy (they run the engine's
    timers and profilers, which the reference is none of)."""
    ids = {getattr(getattr(engine, attr, None), "id", None)
           for attr in ("module_forward_pre_hook", "module_forward_post_hook", "first_dataloader_check")} - {None}
    for hooks in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                  "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
        found = getattr(copied, hooks, None)
        for hook_id in ids:
            if found is not None:
                found.pop(hook_id, None)


class _EngineState:
    """What the engine changes as it trains, kept at the with block's start and put back: the
    module's weights (ZeRO's flat buffers, whose views they are), the torch optimizer's master
    weights (ZeRO's fp32 partitions) and state, the loss scaler and the step counters; the window
    a loop left unfinished is discarded, as DeepSpeed discards an overflowed step's."""

    def __init__(self, engine: Any, optimizer: torch.optim.Optimizer) -> None:
        self.engine, self.optimizer = engine, optimizer
        with torch.no_grad():
            self.weights = [(p, p.detach().clone()) for p in engine.module.parameters()]
            self.masters = [(p, p.detach().clone()) for g in optimizer.param_groups for p in g["params"]]
            self.state = {p: {k: (v, v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                              for k, v in s.items()} for p, s in optimizer.state.items()}
        self.counters = _attributes(engine, _ENGINE_STATE)
        self.wrapper = _attributes(engine.optimizer, _OPTIMIZER_STATE)
        scaler = getattr(engine.optimizer, "loss_scaler", None)
        self.scaler = (scaler, copy.deepcopy(vars(scaler))) if scaler is not None and hasattr(scaler, "__dict__") \
            else None

    def restore(self) -> None:
        engine, optimizer = self.engine, self.optimizer
        _discard_window(engine)
        with torch.no_grad():
            for p, value in self.weights + self.masters:
                p.copy_(value)
            for p in [p for p in optimizer.state if p not in self.state]:
                del optimizer.state[p]
            for p, saved in self.state.items():
                optimizer.state[p] = {k: (found.copy_(value) if isinstance(found, torch.Tensor) and
                                          found.shape == value.shape else value) for k, (found, value) in saved.items()}
        for obj, values in ((engine, self.counters), (engine.optimizer, self.wrapper)):
            for name, value in values.items():
                setattr(obj, name, value)
        if self.scaler is not None:
            vars(self.scaler[0]).update(self.scaler[1])


def _attributes(obj: Any, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: copy.copy(getattr(obj, name)) for name in names if hasattr(obj, name)}


def _discard_window(engine: Any) -> None:
    """The gradient accumulated since the last step dropped (a loop that raised, or stopped, in the
    middle of a window), as DeepSpeed drops an overflowed step's: the module's and ZeRO's
    gradient buffers emptied."""
    optimizer = engine.optimizer
    zero_grad = getattr(optimizer, "zero_grad", None)
    if callable(zero_grad):
        zero_grad(set_to_none=True)
    for name in ("_release_preflattened_grad_buffers", "clear_hp_grads"):
        release = getattr(optimizer, name, None)
        if callable(release):
            release()
    for name in ("averaged_gradients", "all_grad_tensors"):
        buffers = getattr(optimizer, name, None)
        if isinstance(buffers, dict):
            for key in buffers:
                buffers[key] = None
    engine.zero_grad()


# -------------------------------------------------------------- a built-in case through DeepSpeed


def run_case(case: Any, accum_steps: int, batches: int | None = None, fault: str | None = None,
             world_size: int = 1, zero_stage: int = 2) -> StackReport:
    """A built-in token case through a DeepSpeed engine on the CPU (gloo; ranks started by torchrun):
    ZeRO stage ``zero_stage``, ``gradient_accumulation_steps`` N, a torch AdamW, the loop DeepSpeed's
    guide writes (``engine(batch)``, ``engine.backward(loss)``, ``engine.step()`` every micro-batch).
    Each micro-batch's token-summed loss is divided by its global window's labelled tokens and
    multiplied by N and the world size (``backward`` divides by N, the reduction averages over the
    ranks); ``batches`` micro-batches in all (default 2N per rank: two windows). ``fault``:
    "micro-batch-mean" (the model ignores the window's token count), "loss-over-n" (the loop divides
    the loss by N, which ``backward`` does again), and on several ranks "rank-loss-scaled" (the last
    rank's loss doubled), "rank-drops-micro-batch" (the last rank never backwards its window's first
    micro-batch) or "bfloat16-reduce" (``communication_data_type`` bf16). Returns the StackReport every
    rank agrees on."""
    if fault not in (None, *DEEPSPEED_FAULTS):
        raise AccumcheckError(f"--fault {fault}: not a fault the deepspeed stack runs; use one of "
                              f"{', '.join(DEEPSPEED_FAULTS)}")
    if (fault in RANK_FAULTS or fault == "bfloat16-reduce") and world_size < 2:
        raise AccumcheckError(f"--fault {fault}: a fault of a data-parallel run; run with --world-size 2 or more")
    if zero_stage not in (0, 1, 2):
        raise AccumcheckError(f"zero_stage {zero_stage}: the check judges ZeRO stage 0, 1 or 2")
    case = resolve_case(case)
    deepspeed = _cpu_deepspeed()
    count = 2 * accum_steps * world_size if batches is None else batches
    micro_batches = case_batches(case, count)
    items = window_items(micro_batches, accum_steps * world_size)  # by the case's numbering, i x W + r
    _process_group(world_size)
    try:
        rank = torch.distributed.get_rank()
        if torch.distributed.get_world_size() != world_size:
            raise AccumcheckError(f"--world-size {world_size}: this job has {torch.distributed.get_world_size()} "
                                  "ranks; start the ranks with torchrun (accumcheck stack --world-size does)")
        model = CaseLM(case, accum_steps, fault if fault == "micro-batch-mean" else None)
        config = {"train_micro_batch_size_per_gpu": int(micro_batches[0]["input_ids"].shape[0]),
                  "gradient_accumulation_steps": accum_steps, "zero_optimization": {"stage": zero_stage},
                  "zero_allow_untested_optimizer": True, "steps_per_print": 2 ** 31}
        config["train_batch_size"] = config["train_micro_batch_size_per_gpu"] * accum_steps * world_size
        if fault == "bfloat16-reduce":
            config["communication_data_type"] = "bf16"
        with warnings.catch_warnings(), _local_rank():
            warnings.simplefilter("ignore")
            engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                              config=config)
        mine = micro_batches[rank::world_size]
        scale = accum_steps * world_size * (2.0 if fault == "rank-loss-scaled" and rank == world_size - 1 else 1.0)
        dropping = fault == "rank-drops-micro-batch" and rank == world_size - 1
        check = AccumulationCheck(engine, step=lambda m, batch: m(**batch)["loss"])
        with check:
            for i, batch in enumerate(check.batches(mine)):
                batch = {k: v.to(engine.device) for k, v in batch.items()}
                loss = engine(**batch, num_items_in_batch=items[i * world_size + rank])["loss"] * scale
                if dropping and i % accum_steps == 0:
                    loss = loss * 0.0  # ZeRO reduces at every backward: the collective runs, the micro-batch adds nothing
                engine.backward(loss / accum_steps if fault == "loss-over-n" else loss)
                engine.step()
        report = check.report
        engine.destroy()
    finally:
        torch.distributed.barrier()  # no rank tears down its connections while another still reads from it
    report.model = f"{case.name} (built-in case)"
    report.reproduce = stack_command("deepspeed", case.name, accum_steps, batches, fault, world_size)
    report.micro_batches_expected = count
    return report


def _cpu_deepspeed() -> Any:
    """DeepSpeed on its CPU accelerator (where nothing imported it with another yet); without a C++
    compiler, its shared-memory communication op (JIT-built with g++) left out for plain gloo."""
    if "deepspeed" not in sys.modules:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    deepspeed = stack_library("deepspeed", "DeepSpeed")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


@contextlib.contextmanager
def _local_rank() -> Iterator[None]:
    """LOCAL_RANK, which deepspeed.initialize asks for, set to 0 in a process torchrun did not start."""
    if "LOCAL_RANK" in os.environ:
        yield
        return
    os.environ["LOCAL_RANK"] = "0"
    try:
        yield
    finally:
        os.environ.pop("LOCAL_RANK", None)


def _process_group(world_size: int) -> None:
    """A gloo process group for the engine where there is none: torchrun's where it started the
    ranks, a group of one otherwise. It stays for the process, as DeepSpeed keeps the groups it
    derives from it (a second run in the process uses them)."""
    dist = torch.distributed
    if dist.is_initialized():
        return
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group("gloo")
