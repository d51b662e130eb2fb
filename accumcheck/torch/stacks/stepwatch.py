"""What a torch optimizer step does with the gradient, watched for a stack's check: how many
optimizer steps, scheduler steps and clippings a window took, whether its parameters moved between
its micro-batches, and its update against the optimizer applied once, from its state before the
window, to the gradient it was handed (a float64 copy of the optimizer and of that state).

A window here is what the gradient holds: it starts where the optimizer's ``zero_grad`` ran or
every gradient was zero or None, and ends at the optimizer step that applies it, so a loop that steps at every
micro-batch but zeroes once per window shows several steps in one window. The causes the update is
tried against are the ones Keras 3.0-3.4 had (keras#19990): decoupled weight decay applied at every
micro-step, and Adam's step count (its bias correction) advanced at every micro-step.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import numpy as np
import torch

from ...judge.update import update_error
from ...run.results import StepUpdate
from ..casemodel import to_numpy

DECAY_EACH = "weight decay applied at every micro-step"
BIAS_EACH = "Adam's bias correction counting micro-steps"
LR_INSIDE = "the learning rate a scheduler set inside the window"
# torch.optim's optimizers whose step moves each parameter by its own gradient and state alone: their
# replay runs a chunk of parameters at a time, of at most REPLAY_ELEMENTS elements (32 MiB in float64)
PER_TENSOR = tuple(getattr(torch.optim, name) for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam",
                                                           "RMSprop", "Adagrad", "Adadelta", "ASGD", "Rprop",
                                                           "Adafactor") if hasattr(torch.optim, name))
REPLAY_ELEMENTS = 1 << 22


class _Start:
    """The optimizer and its parameters as a window found them: copies for the replay, or (``light``,
    where nothing is replayed) only each parameter's fingerprint, to see it move."""

    def __init__(self, optimizer: torch.optim.Optimizer, light: bool = False) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.light = light
        self.data = {id(p): _fingerprint(p) if light else p.detach().clone() for p in params}
        self.state = {} if light else {id(p): {k: _copy(v) for k, v in optimizer.state[p].items()} for p in params
                                       if p in optimizer.state}
        self.groups = [{k: _copy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]

    def moved(self, p: torch.Tensor) -> bool:
        if self.light:
            return not torch.equal(_fingerprint(p), self.data[id(p)])
        return not torch.equal(_local(p.detach()), _local(self.data[id(p)]))


def _fingerprint(p: torch.Tensor) -> torch.Tensor:
    """A parameter's sum and sum of squares in its dtype (no copy of it, at the speed of a read):
    an update moves them but for one too small to change either sum's rounding."""
    flat = _local(p.detach()).reshape(-1)
    return torch.stack([flat.sum(), torch.dot(flat, flat)]) if flat.is_floating_point() else flat.clone()


class StepWatch:
    """Installed on a torch optimizer (``install``, ``remove``); ``micro_batch()`` is called as each
    micro-batch enters, ``clipped()`` at each gradient clipping where the check sees clipping;
    ``take()`` hands the ``StepUpdate`` of the last optimizer step (None before one). ``replay``
    False (a sharded model) counts and compares without replaying the update."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, replay: bool = True) -> None:
        self.model, self.optimizer, self.replay = model, optimizer, replay
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.clip_watched = False
        self.paused = False  # the check's own reference runs (a training_step that steps a scheduler)
        self._start: _Start | None = None
        self._moved: set[str] = set()
        self._steps = 0  # optimizer steps since the gradient was last zeroed
        self._seen = 0  # micro-batches since the last optimizer step
        self._held = 0  # micro-batches since the gradient was last zeroed
        self._clips = 0
        self._schedules = 0
        self._scheduled = False  # a scheduler of this optimizer stepped during the check
        self._scheduled_now = False  # since the last micro-batch or optimizer step
        self._update: StepUpdate | None = None
        self._hook: Any = None
        self._scheduler_step: Any = None

    def install(self) -> None:
        self._hook = self.optimizer.register_step_post_hook(self._after)
        zero_grad, watch = self.optimizer.zero_grad, self

        def zeroed(*args: Any, **kwargs: Any) -> Any:
            watch._steps, watch._held = 0, 0  # the loop starts a new window
            return zero_grad(*args, **kwargs)
        self.optimizer.zero_grad = zeroed
        cls = torch.optim.lr_scheduler.LRScheduler
        self._scheduler_step = cls.__dict__["step"]
        original, watch = self._scheduler_step, self

        def step(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
            # schedulers stepped together (ChainedScheduler's, one per parameter group) are one step
            if _steps_of(scheduler) is watch.optimizer and not watch.paused and not watch._scheduled_now:
                watch._schedules += 1
                watch._scheduled = watch._scheduled_now = True
            return original(scheduler, *args, **kwargs)
        cls.step = step

    def remove(self) -> None:
        self.optimizer.__dict__.pop("zero_grad", None)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._scheduler_step is not None:
            torch.optim.lr_scheduler.LRScheduler.step = self._scheduler_step
            self._scheduler_step = None

    def clipped(self) -> None:
        self._clips += 1

    def take(self) -> StepUpdate | None:
        update, self._update = self._update, None
        return update

    def micro_batch(self) -> None:
        """A micro-batch enters: the gradient holds a new window where every gradient is zero; the
        first since a step takes the window's start, the others compare the parameters with it."""
        self._scheduled_now = False
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if all(p.grad is None or not bool(p.grad.any()) for p in params):
            self._steps, self._held = 0, 0
        self._seen += 1
        self._held += 1
        if self._start is None:
            self._start = _Start(self.optimizer, light=not self.replay)
            return
        with torch.no_grad():
            for p in params:
                name = self._name(p)
                if name not in self._moved and self._start.moved(p):
                    self._moved.add(name)

    def _name(self, p: torch.Tensor) -> str:
        return self.names.get(id(p), f"parameter {id(p):x}")

    def _after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._steps, self._scheduled_now = self._steps + 1, False
        group = self.optimizer.param_groups[0]
        lr = group.get("lr")
        update = StepUpdate(optimizer_steps=self._steps, scheduler_steps=self._schedules if self._scheduled else None,
                            clip_calls=self._clips if self.clip_watched else None, moved=sorted(self._moved),
                            lr=float(lr) if lr is not None else None, gradient_micro_batches=self._held)
        start = self._start
        if start is None:
            update.replay_note = "no micro-batch was seen before this step"
        elif not self.replay:
            update.replay_note = "the update of a sharded model is not replayed"
        else:
            try:
                self._judge_ready(update, start)
            except (RuntimeError, TypeError, ValueError, KeyError) as exc:
                update.replay_note = f"the optimizer could not be replayed in float64 ({str(exc).splitlines()[0][:120]})"
                update.error, update.tried = None, {}
        self._update = update
        self._start, self._moved, self._clips, self._schedules, self._seen = None, set(), 0, 0, 0

    def _judge_ready(self, update: StepUpdate, start: _Start) -> None:
        """The applied update against the float64 replays, once and with each cause, judged here
        (``update.error``, ``update.tried``) a chunk of parameters at a time, so that what the replay
        holds beside the run is a chunk's, not the model's, and nothing of its size is kept."""
        optimizer = self.optimizer
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        dtypes = {str(p.dtype).removeprefix("torch.") for p in params}
        update.dtype = "float64" if dtypes == {"float64"} else "float32" if "float32" in dtypes else min(dtypes)
        micro = max(1, self._seen)
        decays = any(float(g.get("weight_decay", 0) or 0) > 0 for g in start.groups) and micro > 1 and \
            _decoupled(optimizer)
        counts = micro > 1 and any("betas" in g for g in start.groups) and \
            any("step" in s for s in start.state.values())
        causes: dict[str, dict[str, Any]] = {}
        if decays:
            causes[DECAY_EACH] = {"decay": True}
        if counts:
            causes[BIAS_EACH] = {"count": True}
        if decays and counts:
            causes[f"{DECAY_EACH} and {BIAS_EACH}"] = {"decay": True, "count": True}
        used = [g.get("lr") for g in optimizer.param_groups]
        if used != [g.get("lr") for g in start.groups]:
            causes[LR_INSIDE] = {"lrs": used}
        lr = float(start.groups[0].get("lr", 0.0) or 0.0)
        error, tried = 0.0, {cause: 0.0 for cause in causes}
        for chunk in _chunks(optimizer, params):
            handed = {id(p): p.grad.detach().to(torch.float64) for p in chunk}
            began = {self._name(p): start.data[id(p)].to(torch.float64) for p in chunk}
            applied = {self._name(p): to_numpy(p.detach().to(torch.float64) - began[self._name(p)]) for p in chunk}
            expected = self._replayed(start, handed, micro)
            scale = {name: np.abs(to_numpy(value)) + np.abs(expected[name]) + lr for name, value in began.items()}
            error = max(error, update_error(applied, expected, scale, update.dtype))
            for cause, how in causes.items():
                tried[cause] = max(tried[cause], update_error(applied, self._replayed(start, handed, micro, **how),
                                                              scale, update.dtype))
            del handed, began, applied, expected, scale
        update.error, update.tried = error, tried

    def _replayed(self, start: _Start, handed: dict[int, torch.Tensor], micro: int, decay: bool = False,
                  count: bool = False, lrs: list[Any] | None = None) -> dict[str, np.ndarray]:
        """The optimizer applied once in float64 from the window's start to ``handed``; with
        ``decay`` its decoupled weight decay applied micro - 1 times more before, with ``count``
        its step count advanced micro - 1 more, with ``lrs`` the learning rates the step used."""
        optimizer = self.optimizer
        twins: list[tuple[torch.Tensor, torch.Tensor]] = []
        groups = []
        for i, (group, hyper) in enumerate(zip(optimizer.param_groups, start.groups)):
            hyper = {k: _copy(v) for k, v in hyper.items()}
            if lrs is not None:
                hyper["lr"] = lrs[i]
            mine = []
            for p in group["params"]:
                if id(p) not in handed:
                    continue
                twin = start.data[id(p)].to(torch.float64).clone()
                if decay:
                    twin.mul_((1.0 - float(hyper["lr"]) * float(hyper.get("weight_decay", 0.0))) ** (micro - 1))
                twin.grad = handed[id(p)].clone()
                mine.append(twin)
                twins.append((p, twin))
            groups.append({**hyper, "params": mine})
        replica = type(optimizer)([g for g in groups if g["params"]])
        for p, twin in twins:
            if id(p) in start.state:
                state = {k: _float64(v) for k, v in start.state[id(p)].items()}
                if count and "step" in state:
                    state["step"] = state["step"] + (micro - 1)
                replica.state[twin] = state
        replica.step()
        return {self._name(p): to_numpy(twin.detach() - start.data[id(p)].to(torch.float64)) for p, twin in twins}


def _steps_of(scheduler: Any) -> Any:
    """The torch optimizer a scheduler sets the learning rate of, through a stack's wrappers
    (accelerate's AcceleratedOptimizer)."""
    optimizer, seen = getattr(scheduler, "optimizer", None), 0
    while optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) and seen < 8:
        optimizer, seen = getattr(optimizer, "optimizer", None), seen + 1
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _chunks(optimizer: Any, items: list[Any], size: Callable[[Any], int] = torch.Tensor.numel) -> list[list[Any]]:
    """``items`` (parameters, or their sizes) in chunks of at most REPLAY_ELEMENTS elements (a
    larger one alone) where the optimizer is one of torch.optim's that update each parameter from
    its own gradient and state (PER_TENSOR; None, one not made yet, is counted as the Trainer's
    AdamW); any other optimizer's in one chunk, as its step may join them."""
    if optimizer is not None and type(optimizer) not in PER_TENSOR:
        return [items]
    chunks: list[list[Any]] = [[]]
    held = 0
    for item in items:
        if chunks[-1] and held + size(item) > REPLAY_ELEMENTS:
            chunks.append([])
            held = 0
        chunks[-1].append(item)
        held += size(item)
    return chunks


def replay_chunk(optimizer: Any, sizes: list[int]) -> int:
    """The elements of the largest chunk the update's replay holds at once, for parameters of
    ``sizes`` elements."""
    return max((sum(chunk) for chunk in _chunks(optimizer, sizes, int)), default=0)


def _decoupled(optimizer: torch.optim.Optimizer) -> bool:
    """An optimizer whose weight decay scales the parameters (AdamW), not the gradient."""
    return isinstance(optimizer, torch.optim.AdamW) or any(g.get("decoupled_weight_decay") for g in
                                                           optimizer.param_groups)


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _float64(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(torch.float64).clone() if value.is_floating_point() and value.dim() > 0 else value.clone()
    return copy.deepcopy(value)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) parameter's local shard; any other tensor itself."""
    local = getattr(tensor, "to_local", None)
    return local() if callable(local) else tensor
