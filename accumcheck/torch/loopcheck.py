"""Your own PyTorch training loop under accumcheck: any loop that accumulates gradients by hand,
one process or data-parallel (DistributedDataParallel with ``no_sync()`` or
``require_backward_grad_sync``, FSDP2's ``fully_shard`` with ``set_requires_gradient_sync``), with
or without GradScaler and clipping, run for K optimizer steps with each step's gradient set beside
its window's gradient as one batch.

    check = accumcheck.torch.AccumulationCheck(model, optimizer, steps=3)
    with check:
        for i, batch in enumerate(check.batches(loader)):
            model.require_backward_grad_sync = (i + 1) % N == 0
            loss = model(**batch).loss / N
            loss.backward()
            if (i + 1) % N == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
    report = check.report   # every rank holds the same report; print it on rank 0

What the loop does is what is judged: how it scales each micro-batch's loss, which micro-batches
reach a step, what DDP's all-reduce or FSDP2's reduce-scatter does with them. A window in a
data-parallel run is every rank's micro-batches of that step. The gradient is read at the
optimizer's step, as it was before ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``
(called through ``torch.nn.utils``) or GradScaler's ``unscale_`` changed it. A model that is not
sharded runs in float64 for the check; an FSDP2 model runs as configured (its
MixedPrecisionPolicy too), is judged against a float64 copy of itself, and below float64 against
the round-off of its dtypes. On exit the model, its optimizer, the scheduler given, the random
states and the patched functions are put back, also when the loop raises.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any, Callable

import torch

from ..errors import AccumcheckError, NothingJudgedError
from ..files import size_text
from ..judge.stack import stack_report
from ..options.values import byte_count
from ..report import StackReport
from ..run.results import StepPrecision
from .stacks.float64run import Float64Run, LiveRun, float64_copy, float64_leaves, innermost_optimizer, refresh_copy
from .stacks.owndtype import budget_note, budgeted, checked_every, float64_need, sampled_note, sampled_reference
from .stacks.recorder import StackRecorder
from .stacks.reference import reference_choice, reference_keyword
from .stacks.world import World
from .userbatch import micro_loss

_CLIPS = ("clip_grad_norm_", "clip_grad_value_")


class AccumulationCheck:
    """The check of a plain PyTorch loop. ``model`` is what the loop trains (a module, a
    DistributedDataParallel, an FSDP2 ``fully_shard`` model); ``optimizer`` the torch optimizer it
    steps (a GradScaler's ``step(optimizer)`` steps it too). ``loss_fn(model(inputs), target)``,
    ``step(model, batch)`` or the model's own loss (``model(**batch).loss``) is the loss of the
    window as one batch, as ``accumcheck.torch.check`` reads a batch: the loss as the loop computes
    it before any division by N. ``steps`` stops the loop after that many optimizer steps;
    ``scheduler`` is put back afterwards with the rest. ``reference``: "auto" computes each window's
    reference micro-batch by micro-batch (one micro-batch's activations) where the loss is shown to
    be a mean over the window's items, else on the window as one batch; "joined" always on the
    window as one batch; "micro-batches" raises where a window cannot be split. ``report`` is the StackReport once the
    ``with`` block is left; it raises NothingJudgedError for a block in which nothing was judged.

    ``memory_budget`` (bytes, or a text such as "2G"): where a float64 copy of the model and its
    optimizer state does not fit, each window's reference is computed in the model's own dtype
    micro-batch by micro-batch, summed in float64, in groups of tensors within it
    (``stacks.owndtype``). ``every=K``: the sampled check of your real run, which it leaves as it
    trains (nothing put back): one window in K and every window of a new length judged, beside the
    run in the model's own dtype with the run's own dropout draws (one process)."""

    who = "accumcheck.torch.AccumulationCheck"
    restored = "model, optimizer and random states"  # what the report says was put back
    # how long the ranks wait for each other at the with block's start (a rank without the check
    # never comes, and is named)
    agree_timeout_s = 120.0
    judges_updates = True  # what each optimizer step does with the gradient is judged too (StepWatch)

    def __init__(self, model: torch.nn.Module, optimizer: Any, loss_fn: Callable[..., Any] | None = None,
                 step: Callable[[Any, Any], Any] | None = None, steps: int | None = None,
                 scheduler: Any = None, reference: str = "auto", memory_budget: int | str | None = None,
                 every: int | None = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise AccumcheckError(f"{self.who}: model must be a torch.nn.Module, got {type(model).__name__}")
        if loss_fn is not None and step is not None:
            raise AccumcheckError(f"{self.who}: pass loss_fn or step, not both")
        for name, fn in (("loss_fn", loss_fn), ("step", step)):
            if fn is not None and not callable(fn):
                raise AccumcheckError(f"{self.who}: {name} must be callable, got {type(fn).__name__}")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise AccumcheckError(f"{self.who}: steps must be a positive integer, got {steps!r}")
        if scheduler is not None and not callable(getattr(scheduler, "state_dict", None)):
            raise AccumcheckError(f"{self.who}: scheduler must be a learning-rate scheduler (with state_dict), "
                                  f"got {type(scheduler).__name__}")
        self.wrapper = model
        self.model = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        self.optimizer = innermost_optimizer(optimizer)
        self.loss_fn, self.step, self.steps, self.scheduler = loss_fn, step, steps, scheduler
        self.window_reference = reference_choice(reference, self.who)
        self.sharded = _fully_sharded(self.model)
        self.parallel = self.sharded or self.wrapper is not self.model
        self.memory_budget = memory_budget
        self.every = checked_every(every, self.who)
        self.own = None
        self._window_length = 1
        if self.every is not None and self.parallel:
            raise AccumcheckError(f"{self.who}: every= (the sampled check) runs in one process; check a data-parallel "
                                  "or sharded run without it, or one process of it")
        if self.every is not None:
            self.own = sampled_reference(memory_budget, self.model, self._longest_window, self.who)
        elif self.parallel:
            replica_fits(memory_budget, self.model, self.optimizer, self.who)
        else:
            self.own = budgeted(memory_budget, self.model, [self.optimizer], self._longest_window, self.who)
        # DDP's buckets and FSDP2's shards are set up for the model's dtypes: such a model runs in them,
        # judged against a float64 copy; any other runs in float64 (in its own dtype under a memory budget;
        # sampled, the run is the user's own and nothing is changed)
        self.run = LiveRun() if self.every is not None else \
            Float64Run(self.model, (self.optimizer,), float64=not self.parallel and self.own is None,
                       on_disk=self.own is not None)
        self.recorder: StackRecorder | None = None
        self._replica: torch.nn.Module | None = None
        self._before_clip: dict[int, torch.Tensor | None] | None = None
        self._report: StackReport | None = None
        self._finished = False  # the with block was left: the report can be built
        self._fed = False  # check.batches was called in the block
        self._inside = False
        self._synced: list[bool] = []  # per micro-batch: its backward all-reduced (DDP)

    # -------------------------------------------------------------- the block

    def __enter__(self) -> "AccumulationCheck":
        if self._inside:
            raise AccumcheckError(f"{self.who}: already inside its with block")
        self._report, self._finished, self._fed, self._synced = None, False, False, []
        World.current().meet(self.who, self.agree_timeout_s)
        self._schedule = None if self.scheduler is None else copy.deepcopy(self.scheduler.state_dict())
        precision = None
        if self.sharded:
            from .stacks import sharded

            policy = sharded.mixed_precision(self.model)
            dtype = policy.get("param_dtype") or _dtype_name(self.model)
            precision = StepPrecision(accumulation=dtype, reduction=policy.get("reduce_dtype") or dtype, computed=dtype)
        elif self.parallel:
            dtype = _dtype_name(self.model)
            precision = StepPrecision(accumulation=dtype, reduction=_ddp_reduction(self.wrapper) or dtype, computed=dtype)
        self.recorder = StackRecorder(self.model, self._window_loss, labelled=self.loss_fn is not None,
                                      applied_gradient=self._applied, precision=precision,
                                      reference=self._reference if self.parallel else None,
                                      window_reference=self.window_reference, own_dtype=self.own, every=self.every)
        self.recorder.computed = _dtype_name(self.model)
        self.run.__enter__()
        self._inside = True
        try:
            self._clips = {name: getattr(torch.nn.utils, name) for name in _CLIPS}
            for name, clip in self._clips.items():
                setattr(torch.nn.utils, name, self._captured_first(clip))
            self.recorder.watch(self.optimizer)
            if self.judges_updates and self.every is None:
                self.recorder.watch_updates(self.optimizer, replay=not self.sharded and self.own is None
                                            ).clip_watched = True
            self._reset = self.optimizer.register_step_pre_hook(self._stepped)  # after the recorder's capture
            self._sync_hook = self.wrapper.register_forward_pre_hook(self._note_sync) \
                if self.wrapper is not self.model else None
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._inside:
            return
        self._inside = False
        try:
            self.recorder.unwatch()
            if getattr(self, "_reset", None) is not None:
                self._reset.remove()
            for name, clip in getattr(self, "_clips", {}).items():
                setattr(torch.nn.utils, name, clip)
            if getattr(self, "_sync_hook", None) is not None:
                self._sync_hook.remove()
        finally:
            self.run.__exit__(*exc)
            if self._schedule is not None and self.every is None:  # the loop's scheduler counted the check's steps
                self.scheduler.load_state_dict(self._schedule)
            self._replica = None
            self._finished = True

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """The loader's micro-batches, each recorded and handed on (with its floating tensors in
        float64 where the model runs in float64); stops before the next micro-batch once ``steps``
        optimizer steps have run."""
        if not self._inside:
            raise AccumcheckError(f"{self.who}: call check.batches(loader) inside `with check:`")
        try:
            iterator = iter(loader)
        except TypeError:
            raise AccumcheckError(f"{self.who}.batches: expected an iterable of micro-batches (a DataLoader), "
                                  f"got {type(loader).__name__}") from None
        self._fed = True
        return self._recorded(iterator)

    def _recorded(self, iterator: Iterator[Any]) -> Iterator[Any]:
        recorder = self.recorder
        try:
            while self.steps is None or len(recorder.windows) < self.steps:
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
                recorder.record(batch)
                self._before_clip = None  # a clip is read as it was before the last micro-batch's clips
                yield batch if self.parallel or self.own is not None else float64_leaves(batch)
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()  # a loader's iterator left early (a prepared one puts its state back on close)

    # -------------------------------------------------------------- what is read

    def _captured_first(self, clip: Callable[..., Any]) -> Callable[..., Any]:
        """``clip`` that keeps the gradient as it was before its first call since the last step:
        what the optimizer would apply unclipped, which the step then judges."""
        def clip_gradients(*args: Any, **kwargs: Any) -> Any:
            if self._before_clip is None and self.recorder.pending and self._stepping():
                self._before_clip = {id(p): None if p.grad is None else p.grad.detach().clone()
                                     for p in self.model.parameters()}
                if self.recorder.step_watch is not None:
                    self.recorder.step_watch.clipped()
            return clip(*args, **kwargs)
        return clip_gradients

    def _stepping(self) -> bool:
        """Whether a clip now is the one before an optimizer step (a stack that knows says)."""
        return True

    def _stepped(self, *_: Any) -> None:
        self._before_clip = None

    def _applied(self, name: str, param: torch.nn.Parameter) -> torch.Tensor | None:
        kept = self._before_clip
        grad = kept[id(param)] if kept is not None and id(param) in kept else param.grad
        if self.sharded:
            from .stacks import sharded

            grad = sharded.full_gradient(grad)
        return grad

    def _reference(self) -> torch.nn.Module:
        """The float64 (unsharded) copy of a data-parallel or FSDP2 model, holding its weights now."""
        if self.sharded:
            from .stacks import sharded

            make, refresh = sharded.float64_replica, sharded.refresh
        else:
            make, refresh = float64_copy, refresh_copy
        if self._replica is None:
            self._replica = make(self.model)
        else:
            refresh(self._replica, self.model)
        return self._replica

    def _longest_window(self, micro_batches: int) -> int:
        """N where a window is judged as it is captured: the most micro-batches a window held so far."""
        self._window_length = max(self._window_length, micro_batches)
        return self._window_length

    def _window_loss(self, model: Any, batch: Any) -> Any:
        if self.own is not None:  # the model's own dtype: the batch as the loop fed it
            return micro_loss(model, batch, "the window as one batch", self.loss_fn, self.step)
        return micro_loss(model, float64_leaves(batch), "the window as one batch", self.loss_fn, self.step)

    def _note_sync(self, module: Any, args: Any) -> None:
        """Whether DDP's backward of this forward all-reduces (``no_sync()`` and
        ``require_backward_grad_sync`` both set the flag DDP reads)."""
        self._synced.append(bool(getattr(module, "require_backward_grad_sync", True)))

    # -------------------------------------------------------------- the report

    @property
    def report(self) -> StackReport:
        """The StackReport of the block, judged when first read; NothingJudgedError where nothing was
        judged, AccumcheckError where steps the check did not see would leave a pass. In a
        data-parallel run every rank must read it (it is agreed on with a collective)."""
        if not self._finished:
            raise NothingJudgedError(f"{self.who}: no report yet; run the loop inside `with check:` and read "
                                     "check.report after it")
        if self._report is None:
            self._report = self._build_report()
        return self._report

    def _loop_note(self, reference: str) -> str:
        """The report's first note: whose loop, and where the gradient is read."""
        kind = ("FSDP2 (fully_shard)" if self.sharded else "DistributedDataParallel"
                if self.wrapper is not self.model else "one process")
        return (f"your loop ({kind}): the gradient is read at the optimizer's step, as it was before "
                f"torch.nn.utils.clip_grad_norm_ / clip_grad_value_; {reference} for the window's reference")

    def _stack(self) -> tuple[str, dict[str, str], str]:
        """The stack's name, its versions and how to reproduce the check, for the report."""
        return "fsdp2" if self.sharded else "loop", {"torch": torch.__version__}, \
            "accumcheck.torch.AccumulationCheck(model, optimizer, " \
            f"steps={self.steps}{reference_keyword(self.window_reference)}{self._budget_keyword()})"

    def _budget_keyword(self) -> str:
        return ("" if self.memory_budget is None else f", memory_budget={self.memory_budget!r}") + \
            ("" if self.every is None else f", every={self.every}")

    def _build_report(self) -> StackReport:
        recorder = self.recorder
        world = recorder.world
        accum_steps = self._accum_steps()
        reference = "step(model, batch)" if self.step is not None else \
            "loss_fn(model(inputs), target)" if self.loss_fn is not None else "the model's own loss"
        notes = [self._loop_note(reference)]
        if self.parallel:
            policy = recorder.precision
            notes.append(f"dropout off ({self.run.dropouts} rates set to 0); the model runs in its dtypes (accumulated "
                         f"in {policy.accumulation}, reduced in {policy.reduction}) against a float64 copy of it; the "
                         f"{self.restored} were put back after the run")
        elif self.every is not None:
            notes.append(sampled_note(recorder.judged_why, recorder.optimizer_steps, self.every,
                                      "your loop trained as written", recorder.unsplit, recorder.own_seconds))
        else:
            ran = "float64" if self.own is None else f"its own dtype ({recorder.computed})"
            notes.append(f"dropout off ({self.run.dropouts} rates set to 0); the model ran in {ran}; the "
                         f"{self.restored} were put back after the run")
            notes += [n for n in (budget_note(self.own, self.model, [self.optimizer], unsplit=recorder.unsplit),)
                      if n]
        if world.parallel:
            notes.append(f"data parallel: {world.size} ranks ({world.backend}); each step's window is every rank's "
                         f"micro-batches of it, rank r's i-th micro-batch numbered i x {world.size} + r")
        synced = self._sync_note(accum_steps)
        if synced:
            notes.append(synced)
        idle_fix = ("check.batches(loader) gave no micro-batch: is the data loader empty?" if self._fed else
                    "run the training loop inside `with check:`, iterating `for batch in check.batches(loader):`")
        coverage = recorder.coverage(self.who, "check.batches(loader)",
                                     "iterate `for batch in check.batches(loader):` inside `with check:`",
                                     "the with block", idle_fix)
        stack, versions, reproduce = self._stack()
        return stack_report(stack, type(self.model).__name__, accum_steps, recorder.windows,
                            recorder.seen_everywhere, versions, notes, reproduce=reproduce,
                            coverage=coverage, world_size=world.size,
                            precision="float64" if recorder.precision is None else recorder.precision.reduction,
                            reference_dtype="float64" if self.own is None else recorder.computed,
                            stepped=recorder.stepped_indices if self.every is not None or recorder.unsplit else None,
                            let_go=recorder.unsplit)

    def _accum_steps(self) -> int:
        """N, from the windows the loop stepped on: the most micro-batches one rank gave a step."""
        world = self.recorder.world
        counts = [len(w.micro_batches) for w in self.recorder.windows]
        held = [w.update.gradient_micro_batches for w in self.recorder.windows if w.update is not None]
        return max(1, max(counts, default=world.size) // world.size, max(held, default=0))

    def _sync_note(self, accum_steps: int) -> str:
        """DDP all-reduces beyond one per window: a cost, not a fault (the gradient is the same)."""
        world = self.recorder.world
        synced = world.gather(sum(self._synced))[0] if self.wrapper is not self.model else 0
        windows = len(self.recorder.windows)
        if not windows or synced <= windows or accum_steps <= 1:
            return ""
        return (f"DDP all-reduced on {synced} micro-steps for {windows} optimizer steps: {synced - windows} "
                "all-reduces more than one per window, a cost and not a fault (the gradient is the same); "
                "skip the sync with model.no_sync() or require_backward_grad_sync = False on all but a window's last "
                "micro-step")


def replica_fits(memory_budget: Any, model: torch.nn.Module, optimizer: Any, who: str) -> None:
    """A data-parallel or sharded model is judged against a float64 replica of the whole model:
    a ``memory_budget`` that does not hold it is refused in one line, with the least that does."""
    if memory_budget is None:
        return
    try:
        budget = byte_count(memory_budget)
    except ValueError as exc:
        raise AccumcheckError(f"{who}: memory_budget: {exc}") from None
    need = float64_need(model, [optimizer])
    if need > budget:
        raise AccumcheckError(f"{who}: memory_budget {size_text(budget)}: a data-parallel or sharded model is judged "
                              f"against a float64 replica of the whole model, which needs {size_text(need)}; give at "
                              f"least {need} ({size_text(need)}), or check one process of it")


def _fully_sharded(model: torch.nn.Module) -> bool:
    """An FSDP2 (``fully_shard``) model, or one with a sharded submodule."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _ddp_reduction(ddp: Any) -> str | None:
    """The dtype a DistributedDataParallel's communication hook all-reduces in, where it has one:
    its ``reduce_dtype`` attribute, or torch's compression hooks by name (bf16, fp16); a hook of
    no known dtype is judged against bfloat16's round-off, the lowest a hook reduces in (a lossy
    hook, PowerSGD, is beyond it and flagged)."""
    hooks = getattr(ddp, "_comm_hooks", None) or []
    for hook, _ in hooks:
        dtype = getattr(hook, "reduce_dtype", None)
        name = getattr(hook, "__name__", "")
        if dtype is not None:
            return str(dtype).removeprefix("torch.")
        return "float16" if "fp16" in name else "bfloat16"
    return None


def _dtype_name(model: torch.nn.Module) -> str:
    """The lowest precision among the model's floating parameters ("float32", "bfloat16")."""
    names = {str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()}
    from ..bounds import UNIT_ROUNDOFF

    return max(names & set(UNIT_ROUNDOFF), key=UNIT_ROUNDOFF.get, default="float32")
