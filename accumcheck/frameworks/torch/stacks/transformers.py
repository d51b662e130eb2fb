"""Hugging Face ``Trainer`` under accumcheck: K optimizer steps of the user's Trainer as configured
(its ``gradient_accumulation_steps``, data collator, ``compute_loss``), each step's gradient set
beside its window's gradient as one batch.

    report = accumcheck.integrations.transformers.check(trainer, steps=3)

What would hide the check is handled: the gradient is read before the Trainer clips it (its
``accelerator.clip_grad_norm_``; the optimizer's step pre-hook where it does not clip); the
micro-batches are recorded as the Trainer feeds them (after its sampler shuffled them); the
reference is computed before the optimizer moves the parameters; and the model, its optimizer
and scheduler (where the Trainer had them), the Trainer's state and the random states are put
back afterwards, so the check leaves no trace of the steps it ran.
"""

from __future__ import annotations

import importlib
import inspect
import math
from typing import Any

from ....errors import AccumcheckError
from ....judge.stack import stack_report
from ....report import StackReport
from .recorder import Float64Run, StackRecorder


def _transformers() -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise AccumcheckError("the transformers stack needs Hugging Face transformers (and accelerate); install "
                              "them with pip install 'accumcheck[transformers]'") from None


def check(trainer: Any, steps: int | None = None) -> StackReport:
    """Run ``steps`` optimizer steps of ``trainer`` (default: as many as its own arguments ask
    for) in float64 and judge each step's gradient against its window's as one batch. Returns a
    StackReport: a verdict per optimizer step, the micro-batches seen and any never stepped on."""
    transformers = _transformers()
    if not isinstance(trainer, transformers.Trainer):
        raise AccumcheckError(f"transformers.check: expected a transformers.Trainer, got {type(trainer).__name__}")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise AccumcheckError(f"transformers.check: steps must be a positive integer, got {steps!r}")
    model = trainer.model
    recorder = StackRecorder(model, lambda m, batch: _window_loss(trainer, m, batch))
    callback = _callback(transformers, recorder, steps)
    saved = {name: getattr(trainer, name, None) for name in ("optimizer", "lr_scheduler", "state", "control")}
    clip = trainer.accelerator.clip_grad_norm_
    run = Float64Run(model, (trainer.optimizer,) if trainer.optimizer is not None else ())
    trainer.add_callback(callback)
    try:
        with run:
            trainer.training_step = _recording(trainer.training_step, recorder)
            trainer.accelerator.clip_grad_norm_ = _captured_first(clip, recorder)
            try:
                trainer.train()
            finally:
                recorder.unwatch()
    finally:
        trainer.__dict__.pop("training_step", None)
        trainer.accelerator.__dict__.pop("clip_grad_norm_", None)
        trainer.remove_callback(callback)
        for name, value in saved.items():
            setattr(trainer, name, value)
    args = trainer.args
    expected = None
    if steps is None and args.max_steps <= 0:  # the whole configured run: every batch of every epoch
        expected = len(trainer.get_train_dataloader()) * math.ceil(args.num_train_epochs)
    notes = [f"the Trainer's own loop: gradient_accumulation_steps = {args.gradient_accumulation_steps}, "
             f"max_grad_norm = {args.max_grad_norm} (the gradient is read before clipping), "
             f"{type(trainer).__name__}.compute_loss on the window as one batch for the reference",
             f"dropout off ({run.dropouts} rates set to 0); the model, optimizer, scheduler, Trainer state and "
             "random states were put back after the run"]
    return stack_report("transformers", type(model).__name__, args.gradient_accumulation_steps, recorder.windows,
                        recorder.seen, {"transformers": transformers.__version__, **_versions()}, notes,
                        reproduce=f"accumcheck.integrations.transformers.check(trainer, steps={steps})",
                        micro_batches_expected=expected)


def _window_loss(trainer: Any, model: Any, batch: Any) -> Any:
    """The Trainer's own loss of the window as one batch: its ``compute_loss``, with no
    ``num_items_in_batch``, so the loss normalises over the window itself."""
    inputs = trainer._prepare_inputs(batch)
    if "num_items_in_batch" in inspect.signature(trainer.compute_loss).parameters:
        return trainer.compute_loss(model, inputs, num_items_in_batch=None)
    return trainer.compute_loss(model, inputs)


def _recording(training_step: Any, recorder: StackRecorder) -> Any:
    def step(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        recorder.record(inputs)
        return training_step(model, inputs, *args, **kwargs)
    return step


def _captured_first(clip: Any, recorder: StackRecorder) -> Any:
    def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
        recorder.capture()  # the gradient as the optimizer would apply it, before clipping
        return clip(*args, **kwargs)
    return clip_grad_norm_


def _callback(transformers: Any, recorder: StackRecorder, steps: int | None) -> Any:
    class AccumulationCheckCallback(transformers.TrainerCallback):
        """Watches the optimizer the Trainer made, and stops after ``steps`` optimizer steps."""

        def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
            if optimizer is not None:
                recorder.watch(optimizer)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if steps is not None and len(recorder.windows) >= steps:
                control.should_training_stop = True

    return AccumulationCheckCallback()


def _versions() -> dict[str, str]:
    import torch

    found = {"torch": torch.__version__}
    try:
        found["accelerate"] = importlib.import_module("accelerate").__version__
    except ImportError:
        pass
    return found
