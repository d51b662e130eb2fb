"""Lightning under accumcheck: a callback for ``Trainer(accumulate_grad_batches=N)`` that sets
every optimizer step's gradient beside its window's gradient as one batch.

    check = AccumulationCheck(steps=3)
    trainer = Trainer(accumulate_grad_batches=4, callbacks=[check], ...)
    trainer.fit(module, dataloader)
    print(check.report.summary())

What Lightning does is what is judged: it divides each micro-batch's ``training_step`` loss by N,
and it steps on an epoch's last batch even when that window is short (still dividing by N). The
window's reference is the module's own ``training_step`` on the window's micro-batches joined
(with ``self.log`` silenced), or ``loss(module, batch)``. The gradient is read in
``on_before_optimizer_step``, which Lightning calls after the closure's backward (and after
unscaling AMP gradients) and before it clips. For the fit, the module and its optimizers run in
float64 and every batch leaves the strategy's ``batch_to_device`` (after ``on_after_batch_transfer``)
with its floating tensors in float64; both are put back when the fit ends or raises.

A fit that judged nothing does not pass: reading ``report`` raises NothingJudgedError where the
fit took no optimizer step and fed no batch (``max_epochs=0``, ``max_steps=0``,
``limit_train_batches=0``, an empty data loader) or the callback never ran.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any, Callable

from ..case.reading import resolve_case
from ..errors import AccumcheckError, NothingJudgedError
from ..judge.stack import stack_report
from ..options.spec import stack_command
from ..report import StackReport
from . import missing

try:
    import lightning.pytorch as pl
    import torch

    from ..run.results import StepPrecision
    from ..torch.loopcheck import replica_fits
    from ..torch.stacks.cases import FAULTS, RANK_FAULTS, CaseLM, case_batches, window_items
    from ..torch.stacks.float64run import Float64Run, LiveRun, float64_copy, float64_leaves, refresh_copy
    from ..torch.stacks.owndtype import (
        OwnDtypeReference,
        budget_note,
        budgeted,
        checked_every,
        sampled_note,
        sampled_reference,
    )
    from ..torch.stacks.recorder import StackRecorder
    from ..torch.stacks.reference import reference_choice, reference_keyword
    from ..torch.stacks.world import World
except ModuleNotFoundError as exc:
    raise missing(__name__, exc, "lightning and PyTorch", "pip install 'accumcheck[lightning]'") from None


class AccumulationCheck(pl.Callback):
    """The check of a Lightning fit as a callback. ``steps`` stops the fit after that many
    optimizer steps; ``loss(module, batch)`` replaces ``training_step`` as the loss of the window
    as one batch; ``reference`` ("auto", "joined", "micro-batches") as for
    ``accumcheck.torch.AccumulationCheck``. ``report`` is the StackReport once the fit has ended (or
    raised); it raises NothingJudgedError for a fit in which nothing was judged. ``memory_budget``
    and ``every`` (the sampled check of your real fit, one process) as for
    ``accumcheck.torch.AccumulationCheck``."""

    def __init__(self, steps: int | None = None, loss: Callable[[Any, Any], Any] | None = None,
                 reference: str = "auto", memory_budget: int | str | None = None, every: int | None = None) -> None:
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise AccumcheckError(f"lightning.AccumulationCheck: steps must be a positive integer, got {steps!r}")
        if loss is not None and not callable(loss):
            raise AccumcheckError(f"lightning.AccumulationCheck: loss must be callable as loss(module, batch), "
                                  f"got {type(loss).__name__}")
        self.steps, self.loss = steps, loss
        self.window_reference = reference_choice(reference, "lightning.AccumulationCheck")
        self.memory_budget = memory_budget
        self.every = checked_every(every, "lightning.AccumulationCheck")
        self._own: OwnDtypeReference | None = None
        self.recorder: StackRecorder | None = None
        self._run: Float64Run | None = None
        self._report: StackReport | None = None
        self._ended: tuple[Any, ...] | None = None  # what the report needs from the fit, once it ended
        self._first_index = 0

    @property
    def report(self) -> StackReport:
        """The fit's StackReport, judged when first read; NothingJudgedError where nothing was judged."""
        if self._report is None:
            if self._ended is None:
                raise NothingJudgedError("lightning.AccumulationCheck: no report yet; pass the callback to "
                                         "Trainer(callbacks=[...]) and read .report after trainer.fit")
            self._report = self._build_report(*self._ended)
        return self._report

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._accum_steps, self._module = trainer.accumulate_grad_batches, pl_module
        # data parallel: the strategy's DDP buckets are set up for the module's dtypes, so it runs in them,
        # judged against a float64 copy of itself; in one process it runs in float64
        parallel = trainer.world_size > 1
        World.current().meet("lightning.AccumulationCheck")  # a rank without the callback: named, not waited for
        self._copy = None
        who = "lightning.AccumulationCheck"
        if self.every is not None and parallel:
            raise AccumcheckError(f"{who}: every= (the sampled check) runs in one process; check a data-parallel fit "
                                  "without it")
        if self.every is not None:
            self._own = sampled_reference(self.memory_budget, pl_module, lambda k: trainer.accumulate_grad_batches, who)
        elif parallel:
            replica_fits(self.memory_budget, pl_module, next(iter(trainer.optimizers), None), who)
        else:
            self._own = budgeted(self.memory_budget, pl_module, list(trainer.optimizers),
                                 lambda k: trainer.accumulate_grad_batches, who)
        self.recorder = StackRecorder(pl_module, self._window_loss, labelled=True,
                                      reference=self._reference if parallel else None,
                                      precision=StepPrecision() if parallel else None,
                                      window_reference=self.window_reference, own_dtype=self._own, every=self.every,
                                      accum_steps=lambda k: self._accum_steps)
        self._report, self._ended = None, None
        self._run = LiveRun() if self.every is not None else \
            Float64Run(pl_module, tuple(trainer.optimizers), float64=not parallel and self._own is None,
                       on_disk=self._own is not None)
        self._run.__enter__()
        if trainer.optimizers and self.every is None:
            self.recorder.watch_updates(trainer.optimizers[0], replay=self._own is None)
        self._strategy = trainer.strategy
        if not parallel and self._own is None:
            transfer = trainer.strategy.batch_to_device
            trainer.strategy.batch_to_device = lambda *args, **kwargs: float64_leaves(transfer(*args, **kwargs))

    def _reference(self) -> Any:
        """A float64 copy of the module (its trainer shared, not copied), holding its weights now."""
        if self._copy is None:
            self._copy = float64_copy(self._module, (self._module.trainer,))
            self._copy.trainer = self._module.trainer  # a module's pickled state leaves its trainer out
        else:
            refresh_copy(self._copy, self._module)
        return self._copy

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self.recorder.pending:
            self._first_index = batch_idx
        self.recorder.record(batch)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        # after the window's backward passes, before Lightning clips; not the optimizer's step
        # pre-hook, which fires before the closure that runs the last micro-batch's backward
        self.recorder.stepped()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.steps is not None and len(self.recorder.windows) >= self.steps:
            trainer.should_stop = True

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._finish(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._finish(trainer)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._finish(trainer)

    def _finish(self, trainer: Any) -> None:
        if self._run is None:
            return
        run, self._run = self._run, None
        self._copy = None
        self.recorder.unwatch()
        try:
            self._strategy.__dict__.pop("batch_to_device", None)
        finally:
            run.__exit__(None, None, None)
        self._ended = (trainer.gradient_clip_val, run.dropouts, _idle_fix(trainer))

    def _window_loss(self, module: Any, batch: Any) -> Any:
        """``loss(module, batch)``, or the module's ``training_step`` on the window as one batch,
        with ``self.log`` silenced (the reference is no metric of the run) and the trainer's
        ``accumulate_grad_batches`` 1 while it runs (one batch is a window of one), so a
        training_step that divides by it is caught dividing the real windows."""
        if module is self._copy:  # data parallel: the batch as the ranks ran it, for the float64 copy
            batch = float64_leaves(batch)
        if self.loss is not None:
            return self.loss(module, batch)
        trainer = module.trainer
        silent = {name: lambda *args, **kwargs: None for name in ("log", "log_dict")}
        module.__dict__.update(silent)
        trainer.accumulate_grad_batches = 1
        try:
            out = module.training_step(batch, self._first_index)
        finally:
            trainer.accumulate_grad_batches = self._accum_steps
            for name in silent:
                module.__dict__.pop(name, None)
        return out.get("loss") if isinstance(out, Mapping) else out

    def _build_report(self, clip: Any, dropouts: int, idle_fix: str) -> StackReport:
        recorder, n = self.recorder, self._accum_steps
        reference = "loss(module, batch)" if self.loss is not None else \
            f"{type(self._module).__name__}.training_step (self.log silenced, accumulate_grad_batches 1)"
        notes = [f"Lightning's own loop: accumulate_grad_batches = {n}, gradient_clip_val = "
                 f"{clip} (the gradient is read in on_before_optimizer_step, before clipping); "
                 f"{reference} for the window's reference",
                 f"dropout off ({dropouts} rates set to 0); the module, its optimizers and the random states "
                 "were put back after the fit"]
        coverage = recorder.coverage("lightning.AccumulationCheck", "the fit's training batches",
                                     "let the fit feed its batches (training_step with automatic optimization)",
                                     "the fit", idle_fix)
        world = recorder.world
        if world.parallel:
            notes[1] = (f"dropout off ({dropouts} rates set to 0); the module runs in its dtypes against a float64 copy "
                        "of it; the module, its optimizers and the random states were put back after the fit")
            notes.append(f"data parallel: {world.size} ranks ({world.backend}); each step's window is every rank's "
                         f"micro-batches of it, rank r's i-th micro-batch numbered i x {world.size} + r")
        if self.every is not None:
            notes[1] = sampled_note(recorder.judged_why, recorder.optimizer_steps, self.every, "the fit trained as written",
                                    recorder.unsplit, recorder.own_seconds)
        notes += [note for note in (budget_note(self._own, self._module, [], sampled=self.every is not None,
                                                            unsplit=recorder.unsplit),) if note]
        budget = ("" if self.memory_budget is None else f", memory_budget={self.memory_budget!r}") + \
            ("" if self.every is None else f", every={self.every}")
        return stack_report("lightning", type(self._module).__name__, n, recorder.windows, recorder.seen_everywhere,
                            {"lightning": pl.__version__, "torch": torch.__version__}, notes,
                            reproduce=f"accumcheck.integrations.lightning.AccumulationCheck(steps={self.steps}"
                                      f"{reference_keyword(self.window_reference)}{budget}) among the Trainer's callbacks",
                            coverage=coverage, world_size=world.size,
                            precision="float64" if recorder.precision is None else recorder.precision.reduction,
                            reference_dtype="float64" if self._own is None else recorder.computed,
                            stepped=recorder.stepped_indices if self.every is not None or recorder.unsplit else None,
                            let_go=recorder.unsplit)


def _idle_fix(trainer: Any) -> str:
    """Why a fit took no step, from the Trainer's settings: no epoch, no step, no batch, or no data."""
    for name in ("max_epochs", "max_steps", "limit_train_batches"):
        if getattr(trainer, name, None) == 0:
            return f"the Trainer has {name}=0; let it train at least one window"
    return "was the training data loader empty? give the fit at least one batch"


class CaseModule(pl.LightningModule):
    """A built-in case as a user's LightningModule written for windows of different token counts:
    each micro-batch's token-summed loss over its window's labelled tokens (on every rank: the
    global window's), times N and the world size (Lightning divides by N, the all-reduce averages
    over the ranks); ``loss_over_n`` divides by N once more, as a module that does Lightning's
    division itself would; ``rank_loss_scaled`` doubles the last rank's loss."""

    def __init__(self, case_model: CaseLM, accum_steps: int, items: list[int], loss_over_n: bool = False,
                 rank_loss_scaled: bool = False) -> None:
        super().__init__()
        self.case = case_model
        self.accum_steps, self.items, self.loss_over_n = accum_steps, items, loss_over_n
        self.rank_loss_scaled = rank_loss_scaled

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        world, rank = self.trainer.world_size, self.trainer.global_rank  # rank r's i-th batch: i x W + r
        loss = self.case(**batch, num_items_in_batch=self.items[batch_idx * world + rank])["loss"]
        loss = loss * self.accum_steps * world * (2.0 if self.rank_loss_scaled and rank == world - 1 else 1.0)
        return loss / self.accum_steps if self.loss_over_n else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run_case(case: Any, accum_steps: int, batches: int | None = None, fault: str | None = None,
             world_size: int = 1) -> StackReport:
    """A built-in token case through ``Trainer(accumulate_grad_batches=N, gradient_clip_val=1.0)``
    for one epoch of ``batches`` micro-batches (default 2N + 2 per rank: two full windows and a
    short one), on ``world_size`` CPU processes (``strategy="ddp"``: Lightning starts them, or
    takes those torchrun started). ``fault``: "micro-batch-mean" (the model ignores the window's
    token count), "loss-over-n" (training_step divides by N, which Lightning does again) or, on
    several ranks, "rank-loss-scaled" (the last rank's loss doubled). Returns the StackReport of
    every step."""
    if fault not in (None, *FAULTS, *RANK_FAULTS[:1]):
        raise AccumcheckError(f"--fault {fault}: not a fault the lightning stack runs; use one of "
                              f"{', '.join(FAULTS + RANK_FAULTS[:1])}")
    if fault in RANK_FAULTS and world_size < 2:
        raise AccumcheckError(f"--fault {fault}: a fault of one rank of several; run with --world-size 2 or more")
    case = resolve_case(case)
    count = (2 * accum_steps + 2) * world_size if batches is None else batches
    micro_batches = case_batches(case, count)
    case_model = CaseLM(case, accum_steps, fault if fault == "micro-batch-mean" else None)
    module = CaseModule(case_model, accum_steps, window_items(micro_batches, accum_steps * world_size),
                        fault == "loss-over-n", fault == "rank-loss-scaled")
    # the window's reference: the case's own token mean over it (training_step knows the run's windows only)
    check = AccumulationCheck(loss=lambda m, batch: m.case(**batch)["loss"])
    chatter = logging.getLogger("lightning.pytorch")
    level = chatter.level
    chatter.setLevel(logging.WARNING)
    parallel = {"devices": world_size, "strategy": "ddp"} if world_size > 1 else {"devices": 1}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no workers, no logger: what a small run means to do
            trainer = pl.Trainer(accelerator="cpu", max_epochs=1, accumulate_grad_batches=accum_steps,
                                 gradient_clip_val=1.0, callbacks=[check], logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                                 **parallel)
            # rank r takes micro-batches r, r + W, ... (the numbering of the report and of the module's items)
            sampler = torch.utils.data.DistributedSampler(micro_batches, world_size, trainer.global_rank, shuffle=False) \
                if world_size > 1 else None
            trainer.fit(module, torch.utils.data.DataLoader(micro_batches, batch_size=None, sampler=sampler))
    finally:
        chatter.setLevel(level)
    report = check.report
    report.model = f"{case.name} (built-in case)"
    report.reproduce = stack_command("lightning", case.name, accum_steps, batches, fault, world_size)
    report.micro_batches_expected = count
    return report
