"""Hugging Face ``Trainer`` under accumcheck: K optimizer steps of the user's Trainer as configured
(its ``gradient_accumulation_steps``, data collator, ``compute_loss``), each step's gradient set
beside its window's gradient as one batch.

    report = accumcheck.integrations.transformers.check(trainer, steps=3)

What would hide the check is handled: the gradient is read before the Trainer clips it (its
``accelerator.clip_grad_norm_``; the optimizer's step pre-hook where it does not clip); the
micro-batches are recorded as the Trainer feeds them (after its sampler shuffled them); the
reference is computed before the optimizer moves the parameters; and the model, its optimizer
and scheduler (where the Trainer had them), the Trainer's state and the random states are put
back afterwards, so the check leaves no trace of the steps it ran. A run that took no optimizer
step and fed no micro-batch (``num_train_epochs=0``, ``max_steps=0``) raises NothingJudgedError
once all that is put back: nothing was judged, so nothing passes.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import math
import os
import sys
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from ..case.definition import Case
from ..errors import USER_EXCEPTIONS, AccumcheckError, UserCodeError, first_line
from ..judge.stack import stack_report
from ..options.spec import stack_command
from ..report import StackReport
from . import missing

try:
    import accelerate  # noqa: F401  (the Trainer's own engine: missing, one line says so)
    import transformers  # noqa: F401

    from ..torch.stacks.batches import join_paired
    from ..torch.stacks.cases import CaseLM, case_examples
    from ..torch.stacks.float64run import Float64Run, float64_kernel_error, stack_library
    from ..torch.stacks.owndtype import budget_note, budgeted, checked_every, sampled_note, sampled_reference
    from ..torch.stacks.recorder import StackRecorder
    from ..torch.stacks.reference import reference_choice, reference_keyword
    from ..torch.stacks.world import World
except ModuleNotFoundError as exc:
    raise missing(__name__, exc, "transformers, accelerate and PyTorch", "pip install 'accumcheck[transformers]'") from None

FAULTS = ("micro-batch-mean", "loss-over-n")
# TRL trainers whose micro-batches are preference pairs, the chosen rows then the rejected ones
PAIRED = frozenset({"DPOTrainer"})
# TRL trainers that generate completions inside the step: what trains is not the data fed
GENERATING = frozenset({"GRPOTrainer", "RLOOTrainer", "OnlineDPOTrainer", "PPOTrainer", "NashMDTrainer",
                        "XPOTrainer"})


def check(trainer: Any, steps: int | None = None, terms: Mapping[str, Callable[[Any], Any]] | None = None,
          reference: str = "auto", memory_budget: int | str | None = None) -> StackReport:
    """Run ``steps`` optimizer steps of ``trainer`` (default: as many as its own arguments ask
    for) in float64 and judge each step's gradient against its window's as one batch. Returns a
    StackReport: a verdict per optimizer step, the micro-batches seen and any never stepped on.
    Raises NothingJudgedError where the Trainer ran no optimizer step and fed no micro-batch.

    ``terms`` names additive terms of the model's loss, each a function of the model's outputs
    returning that term's part of the loss (``{"z-loss": lambda out: 1e-3 * out.z_loss}``); a
    mixture-of-experts model's router load-balancing loss (``aux_loss`` times the config's
    ``router_aux_loss_coef``) is found without being named. Where a step is not its window's
    gradient, it is fitted as the rest of the window's loss plus each term summed over the
    micro-batches, so that a term added once per micro-batch is named.

    ``reference``: "auto" computes each window's reference micro-batch by micro-batch (the model's
    own loss on each, weighted by its share of the window's labelled or predicted tokens; one
    micro-batch's activations) where the loss is shown to be such a mean and has no terms, else on
    the window as one batch; "joined" always on the window as one batch; "micro-batches" raises
    where a window cannot be split.

    ``memory_budget`` (bytes, or a text such as "2G"): what the check may hold beside the run. Where
    the float64 check (``owndtype.float64_need``) does not fit, each window's reference is
    computed in the model's own dtype micro-batch by micro-batch, summed in float64, in groups of
    tensors that fit (``accumcheck.torch.stacks.owndtype``), and judged within the round-off of
    both dtypes; a budget the largest tensor alone does not fit is refused naming the least one."""
    transformers = stack_library("transformers", "Hugging Face transformers (and accelerate)")
    if not isinstance(trainer, transformers.Trainer):
        raise AccumcheckError(f"transformers.check: expected a transformers.Trainer, got {type(trainer).__name__}")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise AccumcheckError(f"transformers.check: steps must be a positive integer, got {steps!r}")
    if terms is not None and not (isinstance(terms, Mapping) and all(isinstance(k, str) and callable(v)
                                                                     for k, v in terms.items())):
        raise AccumcheckError("transformers.check: terms must map each term's name to a function of the model's "
                              "outputs returning its part of the loss")
    lineage = {cls.__name__ for cls in type(trainer).__mro__}
    generating = sorted(lineage & GENERATING)
    if generating:
        raise AccumcheckError(f"transformers.check: {type(trainer).__name__} generates its micro-batches inside the "
                              f"step ({generating[0]}), so a window cannot be replayed as one batch; check the loss "
                              "on recorded batches with accumcheck.torch.check, or a Trainer that trains on its data")
    window_reference = reference_choice(reference, "transformers.check")
    model = trainer.model
    optimizers = [trainer.optimizer] if trainer.optimizer is not None else []
    own = budgeted(memory_budget, model, optimizers, lambda k: trainer.args.gradient_accumulation_steps,
                   "transformers.check")
    join = join_paired if lineage & PAIRED else None
    World.current().meet("transformers.check")  # a rank without the check: named, not waited for
    recorder = StackRecorder(model, lambda m, batch: _window_loss(trainer, m, batch, terms or {}), join,
                             window_reference=window_reference, own_dtype=own,
                             accum_steps=lambda k: trainer.args.gradient_accumulation_steps)
    recorder.computed = _computed_dtype(trainer.args, model)
    # a model that takes num_items_in_batch normalises the window itself: the Trainer skips its 1/N
    recorder.takes_item_count = getattr(trainer, "model_accepts_loss_kwargs", None)
    callback = _callback(transformers, recorder, steps)
    saved = {name: getattr(trainer, name, None) for name in ("optimizer", "lr_scheduler", "state", "control")}
    schedule = None if trainer.lr_scheduler is None else copy.deepcopy(trainer.lr_scheduler.state_dict())
    clip = trainer.accelerator.clip_grad_norm_
    # accelerate's shared gradient state: a run that raises leaves its loader among the active ones
    gradient_state = trainer.accelerator.gradient_state
    iterating = (gradient_state.sync_gradients, gradient_state.dataloader_references)
    run = Float64Run(model, (trainer.optimizer,) if trainer.optimizer is not None else (), float64=own is None,
                     on_disk=own is not None)
    callbacks = list(trainer.callback_handler.callbacks)
    # The check's steps are no training of yours: not printed, not sent to TensorBoard, W&B, ...
    trainer.callback_handler.callbacks = [c for c in callbacks if not _reports(transformers, c)]
    trainer.add_callback(callback)
    try:
        with run:
            trainer.training_step = _recording(trainer.training_step, recorder)
            trainer.accelerator.clip_grad_norm_ = _captured_first(clip, recorder)
            try:
                trainer.train()
            except AccumcheckError:
                raise
            except USER_EXCEPTIONS as exc:
                if _raised_here(exc):
                    raise
                kernel = float64_kernel_error(exc)
                if kernel is not None:
                    raise AccumcheckError(f"transformers.check: the check runs the model in float64 and one of its "
                                          f"operations has no float64 kernel here ({kernel}); give that module a "
                                          "float64 path (an eager implementation) for the check") from exc
                raise UserCodeError(f"transformers.check: the Trainer raised {type(exc).__name__}: "
                                    f"{first_line(exc)}; fix the Trainer's model, data or arguments") from exc
            finally:
                recorder.unwatch()
    finally:
        trainer.__dict__.pop("training_step", None)
        trainer.accelerator.__dict__.pop("clip_grad_norm_", None)
        trainer.callback_handler.callbacks = callbacks
        gradient_state.sync_gradients, gradient_state.dataloader_references = iterating
        for name, value in saved.items():
            setattr(trainer, name, value)
        if schedule is not None:  # a scheduler the user gave the Trainer counted the run's steps
            trainer.lr_scheduler.load_state_dict(schedule)
    args = trainer.args
    world = recorder.world
    expected = None
    if steps is None and args.max_steps <= 0:  # the whole configured run: every batch of every epoch
        expected = len(trainer.get_train_dataloader()) * math.ceil(args.num_train_epochs) * world.size
    notes = [f"the Trainer's own loop: gradient_accumulation_steps = {args.gradient_accumulation_steps}, "
             f"max_grad_norm = {args.max_grad_norm} (the gradient is read before clipping), "
             f"{type(trainer).__name__}.compute_loss for the window's reference; the windows' "
             "micro-batches as the Trainer's sampler fed them",
             f"dropout off ({run.dropouts} rates set to 0); progress, logs and reporting off for the run; the model, "
             "optimizer, scheduler, Trainer state and random states were put back after it"]
    if world.parallel:
        notes.append(data_parallel_note(world, getattr(args, "average_tokens_across_devices", None)))
    notes += [n for n in (budget_note(own, model, optimizers, unsplit=recorder.unsplit),) if n]
    coverage = recorder.coverage("transformers.check", "the Trainer's training_step",
                                 "let the Trainer's own loop feed its micro-batches (a training loop of your own: "
                                 "accumcheck.integrations.accelerate)", "the Trainer", _idle_fix(args))
    return stack_report("transformers", type(model).__name__, args.gradient_accumulation_steps, recorder.windows,
                        recorder.seen_everywhere, {"transformers": transformers.__version__, **_versions()}, notes,
                        reproduce=f"accumcheck.integrations.transformers.check(trainer, steps={steps}"
                                  f"{reference_keyword(window_reference)}"
                                  f"{'' if memory_budget is None else f', memory_budget={memory_budget!r}'})",
                        micro_batches_expected=expected, coverage=coverage, world_size=world.size,
                        reference_dtype="float64" if own is None else recorder.computed,
                        stepped=recorder.stepped_indices if recorder.unsplit else None, let_go=recorder.unsplit)


class watch:  # noqa: N801  (used as a function: ``with watch(trainer) as sampled``)
    """The sampled check, on in your real run: the Trainer trains as configured (its dtype, dropout,
    logging, everything it does), untouched, and one window in ``every`` is judged, with every window
    whose number of micro-batches differs from the one before (an epoch's short last window, a data
    loader's change, the first window after a resumed run's start), so a fault that appears only
    at step 40,000 is still seen. A judged window's reference is computed beside the run in the
    model's own dtype, micro-batch by micro-batch with the run's own random draws (dropout), summed
    in float64 (``accumcheck.torch.stacks.owndtype``; within ``memory_budget`` where given).

        with accumcheck.integrations.transformers.watch(trainer, every=100) as sampled:
            trainer.train()
        print(sampled.report.render())   # the steps judged, and why each

    Only windows whose loss splits micro-batch by micro-batch are judged (a window that cannot be
    split raises AccumcheckError at that step, naming why). The report lists the steps judged."""

    def __init__(self, trainer: Any, every: int = 100, terms: Mapping[str, Callable[[Any], Any]] | None = None,
                 memory_budget: int | str | None = None) -> None:
        transformers = stack_library("transformers", "Hugging Face transformers (and accelerate)")
        if not isinstance(trainer, transformers.Trainer):
            raise AccumcheckError(f"transformers.watch: expected a transformers.Trainer, got {type(trainer).__name__}")
        checked_every(every, "transformers.watch")
        if World.current().parallel:
            raise AccumcheckError("transformers.watch: the sampled check runs in one process; check a run on several "
                                  "ranks with transformers.check")
        self.trainer, self.every = trainer, every
        model = trainer.model
        own = sampled_reference(memory_budget, model, lambda k: trainer.args.gradient_accumulation_steps,
                                "transformers.watch")
        self.recorder = StackRecorder(model, lambda m, batch: _window_loss(trainer, m, batch, terms or {}),
                                      join_paired if {c.__name__ for c in type(trainer).__mro__} & PAIRED else None,
                                      window_reference="micro-batches", own_dtype=own, every=every)
        self.recorder.computed = _computed_dtype(trainer.args, model)
        self.recorder.takes_item_count = getattr(trainer, "model_accepts_loss_kwargs", None)
        self._callback = _callback(transformers, self.recorder, None, updates=False)

    def __enter__(self) -> "watch":
        trainer = self.trainer
        trainer.training_step = _recording(trainer.training_step, self.recorder)
        trainer.accelerator.clip_grad_norm_ = _captured_first(trainer.accelerator.clip_grad_norm_, self.recorder)
        trainer.add_callback(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        self.recorder.unwatch()
        self.trainer.__dict__.pop("training_step", None)
        self.trainer.accelerator.__dict__.pop("clip_grad_norm_", None)
        self.trainer.remove_callback(self._callback)

    @property
    def report(self) -> StackReport:
        """The steps judged so far (StackReport; NothingJudgedError where the run fed nothing)."""
        transformers = stack_library("transformers", "Hugging Face transformers (and accelerate)")
        recorder, args = self.recorder, self.trainer.args
        notes = [sampled_note(recorder.judged_why, recorder.optimizer_steps, self.every,
                              "the Trainer trained as configured", recorder.unsplit, recorder.own_seconds), budget_note(
                     recorder.own_dtype, self.trainer.model, [self.trainer.optimizer], sampled=True)]
        coverage = recorder.coverage("transformers.watch", "the Trainer's training_step",
                                     "let the Trainer's own loop feed its micro-batches", "the Trainer", _idle_fix(args))
        return stack_report("transformers", type(self.trainer.model).__name__, args.gradient_accumulation_steps,
                            recorder.windows, recorder.seen_everywhere,
                            {"transformers": transformers.__version__, **_versions()}, [n for n in notes if n],
                            reproduce=f"accumcheck.integrations.transformers.watch(trainer, every={self.every})",
                            coverage=coverage, world_size=recorder.world.size, reference_dtype=recorder.computed,
                            stepped=recorder.stepped_indices, let_go=recorder.unsplit)


def data_parallel_note(world: Any, average_tokens: bool | None) -> str:
    """What a data-parallel Trainer's windows are, for the report's notes."""
    counted = "" if average_tokens is None else (
        f"; average_tokens_across_devices = {average_tokens} (num_items_in_batch counted over "
        f"{'every rank' if average_tokens else 'each rank alone'})")
    return (f"data parallel: {world.size} ranks ({world.backend}); each step's window is every rank's micro-batches "
            f"of it, gathered, rank r's i-th micro-batch numbered i x {world.size} + r{counted}")


def _idle_fix(args: Any) -> str:
    """Why a Trainer took no step, from its arguments: no epoch and no max_steps, or no data."""
    if args.max_steps <= 0 and args.num_train_epochs <= 0:
        return (f"its arguments ask for num_train_epochs={args.num_train_epochs:g} and max_steps={args.max_steps}; "
                "train for at least one epoch or give max_steps")
    return "is its train_dataset empty? give it at least one micro-batch, or a positive max_steps"


def run_case(case: Case, accum_steps: int, batches: int | None = None, fault: str | None = None,
             world_size: int = 1) -> StackReport:
    """A built-in case through a Hugging Face Trainer as a user would set it up (its default
    clipping, AdamW, shuffling; the model passes ``num_items_in_batch`` on), ``batches``
    micro-batches (default 2N + 2 per rank: two full windows and a short one), in one epoch, on
    ``world_size`` CPU ranks (started by torchrun, which the Trainer reads itself). ``fault``:
    "micro-batch-mean", "loss-over-n" or, on several ranks, "rank-loss-scaled" (the last rank's
    loss doubled)."""
    transformers = stack_library("transformers", "Hugging Face transformers (and accelerate)")
    faults = FAULTS + (("rank-loss-scaled",) if world_size > 1 else ())
    if fault not in (None, *faults):
        raise AccumcheckError(f"--fault {fault}: not a fault the transformers stack runs{' on one rank' * (world_size == 1)}; "
                              f"use one of {', '.join(faults)}")
    model = CaseLM(case, accum_steps, fault if fault == "micro-batch-mean" else None)
    count = (2 * accum_steps + 2) * world_size if batches is None else batches
    with tempfile.TemporaryDirectory(prefix="accumcheck-trainer-") as folder:
        args = transformers.TrainingArguments(
            output_dir=folder, per_device_train_batch_size=case.input.batch_size, gradient_accumulation_steps=accum_steps,
            num_train_epochs=1, learning_rate=1e-3, report_to="none", save_strategy="no", logging_strategy="no",
            use_cpu=True, disable_tqdm=True, seed=case.seed)
        if args.world_size != world_size:
            raise AccumcheckError(f"--world-size {world_size}: the Trainer runs on {args.world_size} processes here; "
                                  "start the ranks with torchrun (accumcheck stack --world-size does)")
        kind = _loss_over_n(transformers.Trainer) if fault == "loss-over-n" else \
            _rank_loss_scaled(transformers.Trainer) if fault == "rank-loss-scaled" else transformers.Trainer
        trainer = kind(model=model, args=args, train_dataset=case_examples(case, count))
        report = check(trainer)
    report.model = f"{case.name} (built-in case)"
    report.reproduce = stack_command("transformers", case.name, accum_steps, batches, fault, world_size)
    return report


def _rank_loss_scaled(base: type) -> type:
    class RankLossScaled(base):  # type: ignore[misc, valid-type]
        """The last rank's loss doubled in compute_loss: its micro-batches weigh twice their share."""

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            found = super().compute_loss(model, inputs, *args, **kwargs)
            last = self.args.process_index == self.args.world_size - 1 and kwargs.get("num_items_in_batch") is not None
            if not last:
                return found
            return (found[0] * 2, found[1]) if isinstance(found, tuple) else found * 2

    return RankLossScaled


def _loss_over_n(base: type) -> type:
    class LossOverN(base):  # type: ignore[misc, valid-type]
        """The loss divided by N once more in compute_loss: the Trainer divides it already."""

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            return super().compute_loss(model, inputs, *args, **kwargs) / self.args.gradient_accumulation_steps

    return LossOverN


def _reports(transformers: Any, callback: Any) -> bool:
    """A callback that prints or reports the run (progress bars, logs, experiment trackers)."""
    return isinstance(callback, (transformers.PrinterCallback, transformers.ProgressCallback)) or \
        type(callback).__module__.startswith("transformers.integrations")


def _window_loss(trainer: Any, model: Any, batch: Any, named: Mapping[str, Callable[[Any], Any]]) -> Any:
    """The Trainer's own loss of the window as one batch, with the loss's additive terms: its
    ``compute_loss`` with no ``num_items_in_batch``, so the loss normalises over the window
    itself, and with ``gradient_accumulation_steps`` 1 while it runs (one batch is a window of
    one), so a ``compute_loss`` that divides by it is caught dividing the real windows."""
    inputs = trainer._prepare_inputs(batch)
    saved = trainer.args.gradient_accumulation_steps, trainer.__dict__.get("current_gradient_accumulation_steps")
    trainer.args.gradient_accumulation_steps = 1
    if saved[1] is not None:
        trainer.current_gradient_accumulation_steps = 1
    parameters = inspect.signature(trainer.compute_loss).parameters
    kwargs = {"num_items_in_batch": None} if "num_items_in_batch" in parameters else {}
    # the outputs only where the loss may have terms: TRL's fused heads build the logits again for them
    wanted = bool(named) or bool(getattr(getattr(model, "config", None), "router_aux_loss_coef", None))
    try:
        if "return_outputs" not in parameters or not wanted:
            return trainer.compute_loss(model, inputs, **kwargs)
        found = trainer.compute_loss(model, inputs, return_outputs=True, **kwargs)
    finally:
        trainer.args.gradient_accumulation_steps = saved[0]
        if saved[1] is not None:
            trainer.current_gradient_accumulation_steps = saved[1]
    loss, outputs = found if isinstance(found, tuple) and len(found) == 2 else (found, None)
    return loss, loss_terms(model, outputs, named)


def loss_terms(model: Any, outputs: Any, named: Mapping[str, Callable[[Any], Any]]) -> dict[str, Any]:
    """The additive terms of a Hugging Face model's loss in ``outputs``: a router load-balancing
    loss (``aux_loss`` x ``config.router_aux_loss_coef``, which Mixtral-style models add to the
    loss) and the ones the user named."""
    terms = {}
    aux = _output(outputs, "aux_loss")
    coefficient = getattr(getattr(model, "config", None), "router_aux_loss_coef", None)
    if aux is not None and isinstance(coefficient, (int, float)) and coefficient:
        terms[f"router load-balancing loss (aux_loss x {coefficient:g})"] = coefficient * aux
    for name, term in named.items():
        try:
            terms[name] = term(outputs)
        except USER_EXCEPTIONS as exc:
            raise UserCodeError(f"transformers.check: the term {name!r} raised {type(exc).__name__}: "
                                f"{first_line(exc)}; it gets the model's outputs and returns its part of the loss") from exc
    return terms


def _output(outputs: Any, key: str) -> Any:
    """``outputs[key]`` of a model's output (a ModelOutput, a mapping), None where absent."""
    if isinstance(outputs, Mapping):
        return outputs.get(key)
    return getattr(outputs, key, None)


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


def _callback(transformers: Any, recorder: StackRecorder, steps: int | None, updates: bool = True) -> Any:
    class AccumulationCheckCallback(transformers.TrainerCallback):
        """Watches the optimizer the Trainer made, and stops after ``steps`` optimizer steps."""

        def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
            if optimizer is not None:
                recorder.watch(optimizer)
                if updates:
                    recorder.watch_updates(optimizer, replay=recorder.own_dtype is None)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if steps is not None and len(recorder.windows) >= steps:
                control.should_training_stop = True

    return AccumulationCheckCallback()


def _computed_dtype(args: Any, model: Any) -> str:
    """The dtype the Trainer computes its micro-gradients in: autocast's where it mixes precision."""
    if getattr(args, "bf16", False):
        return "bfloat16"
    if getattr(args, "fp16", False):
        return "float16"
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    return "float32" if dtype is None else str(dtype).removeprefix("torch.")


def _versions() -> dict[str, str]:
    import torch

    found = {"torch": torch.__version__}
    try:
        found["accelerate"] = importlib.import_module("accelerate").__version__
    except ImportError:
        pass
    return found


def _raised_here(exc: BaseException) -> bool:
    """Whether the innermost frame of ``exc`` is accumcheck's own code (a bug of ours, exit 3), not
    the Trainer's, the model's or the data's (the user's run, exit 2)."""
    package = os.path.dirname(os.path.abspath(sys.modules[__name__.partition(".")[0]].__file__))
    frame = exc.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    return frame is not None and os.path.abspath(frame.tb_frame.f_code.co_filename).startswith(package + os.sep)
