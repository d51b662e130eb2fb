"""accelerate under accumcheck: the user's own loop, written with ``Accelerator(
gradient_accumulation_steps=N)`` and ``with accelerator.accumulate(model):``, run for K optimizer
steps with each step's gradient set beside its window's gradient as one batch.

    check = AccumulationCheck(accelerator, model, optimizer, steps=3)
    with check:
        for batch in check.batches(dataloader):
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
    print(check.report.summary())

What accelerate does is what is judged: ``backward`` divides every micro-batch's loss by N, the
prepared optimizer steps only when ``sync_gradients``, and a prepared dataloader's last short
window steps early. The gradient is read before ``accelerator.clip_grad_norm_`` (or
``clip_grad_value_``) on a step that syncs, else at the optimizer's real step. On exit the model,
its optimizer, the random states and the accelerator's accumulation state are put back, also when
the loop raises.

A loop that judged nothing does not pass: reading ``report`` raises NothingJudgedError where no
micro-batch went through ``check.batches`` (the loop iterated its loader itself, or the block ran
no loop), and AccumcheckError where optimizer steps the check did not see would leave a pass.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, Callable

from ..case.reading import resolve_case
from ..errors import AccumcheckError, NothingJudgedError
from ..judge.stack import stack_report
from ..options.spec import stack_command
from ..report import StackReport
from . import missing

try:
    import accelerate  # noqa: F401  (the stack: missing, one line says so)
    import torch

    from ..torch.stacks.cases import FAULTS, CaseLM, case_batches, window_items
    from ..torch.stacks.recorder import Float64Run, StackRecorder, float64_leaves, stack_library
    from ..torch.userbatch import micro_loss
except ModuleNotFoundError as exc:
    raise missing(__name__, exc, "accelerate and PyTorch", "pip install 'accumcheck[accelerate]'") from None

_CLIPS = ("clip_grad_norm_", "clip_grad_value_")


class AccumulationCheck:
    """The check of a user's accelerate loop. ``loss_fn(model(inputs), target)``, ``step(model,
    batch)`` or the model's own loss (``model(**batch).loss``) is the loss of the window as one
    batch, as ``accumcheck.torch.check`` reads a batch; ``steps`` stops the loop after that many
    optimizer steps; ``scheduler`` (the learning-rate scheduler the loop steps) is put back afterwards
    with the rest. ``report`` is the StackReport once the ``with`` block is left; it raises
    NothingJudgedError for a block in which nothing was judged."""

    def __init__(self, accelerator: Any, model: torch.nn.Module, optimizer: Any,
                 loss_fn: Callable[..., Any] | None = None, step: Callable[[Any, Any], Any] | None = None,
                 steps: int | None = None, scheduler: Any = None) -> None:
        accelerate = stack_library("accelerate", "Hugging Face accelerate")
        if not isinstance(accelerator, accelerate.Accelerator):
            raise AccumcheckError(f"accelerate.AccumulationCheck: expected an accelerate.Accelerator, got "
                                  f"{type(accelerator).__name__}")
        if not isinstance(model, torch.nn.Module):
            raise AccumcheckError(f"accelerate.AccumulationCheck: model must be a torch.nn.Module, got "
                                  f"{type(model).__name__}")
        if loss_fn is not None and step is not None:
            raise AccumcheckError("accelerate.AccumulationCheck: pass loss_fn or step, not both")
        for name, fn in (("loss_fn", loss_fn), ("step", step)):
            if fn is not None and not callable(fn):
                raise AccumcheckError(f"accelerate.AccumulationCheck: {name} must be callable, got {type(fn).__name__}")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise AccumcheckError(f"accelerate.AccumulationCheck: steps must be a positive integer, got {steps!r}")
        self.accelerator, self.model, self.optimizer = accelerator, model, optimizer
        if scheduler is not None and not callable(getattr(scheduler, "state_dict", None)):
            raise AccumcheckError(f"accelerate.AccumulationCheck: scheduler must be a learning-rate scheduler "
                                  f"(with state_dict), got {type(scheduler).__name__}")
        self.loss_fn, self.step, self.steps, self.scheduler = loss_fn, step, steps, scheduler
        self.version = accelerate.__version__
        self.run = Float64Run(model, (optimizer,))  # refuses an optimizer that is not (or wraps no) torch one
        self.recorder: StackRecorder | None = None
        self.accum_steps = 0
        self._report: StackReport | None = None
        self._finished = False  # the with block was left: the report can be built
        self._fed = False  # check.batches was called in the block
        self._inside = False

    def __enter__(self) -> "AccumulationCheck":
        if self._inside:
            raise AccumcheckError("accelerate.AccumulationCheck: already inside its with block")
        accelerator, state = self.accelerator, self.accelerator.gradient_state
        self.accum_steps = accelerator.gradient_accumulation_steps
        self.recorder = StackRecorder(self.model, self._window_loss, labelled=self.loss_fn is not None)
        self._accelerator_state = (accelerator.step, state.sync_gradients, state.dataloader_references)
        self._schedule = None if self.scheduler is None else copy.deepcopy(self.scheduler.state_dict())
        self._report, self._finished, self._fed = None, False, False
        self.run.__enter__()
        self._inside = True
        try:
            for name in _CLIPS:
                setattr(accelerator, name, _captured_first(getattr(accelerator, name), accelerator, self.recorder))
            self.recorder.watch(self.optimizer)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._inside:
            return
        self._inside = False
        accelerator, state = self.accelerator, self.accelerator.gradient_state
        try:
            self.recorder.unwatch()
            for name in _CLIPS:
                accelerator.__dict__.pop(name, None)
        finally:
            self.run.__exit__(*exc)
            accelerator.step, state.sync_gradients, state.dataloader_references = self._accelerator_state
            if self._schedule is not None:  # the loop's scheduler counted the run's steps
                self.scheduler.load_state_dict(self._schedule)
            self._finished = True

    def batches(self, dataloader: Iterable[Any]) -> Iterator[Any]:
        """The dataloader's micro-batches, each recorded and handed on with its floating tensors in
        float64; stops before the next micro-batch once ``steps`` optimizer steps have run."""
        if not self._inside:
            raise AccumcheckError("accelerate.AccumulationCheck: call check.batches(dataloader) inside `with check:`")
        try:
            iterator = iter(dataloader)
        except TypeError:
            raise AccumcheckError(f"accelerate.AccumulationCheck.batches: expected an iterable of micro-batches "
                                  f"(a DataLoader), got {type(dataloader).__name__}") from None
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
                yield float64_leaves(batch)
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()  # a prepared dataloader left early; its gradient state is put back on exit

    @property
    def report(self) -> StackReport:
        """The StackReport of the block, judged when first read; NothingJudgedError where nothing was
        judged, AccumcheckError where steps the check did not see would leave a pass."""
        if not self._finished:
            raise NothingJudgedError("accelerate.AccumulationCheck: no report yet; run the loop inside `with check:` "
                                     "and read check.report after it")
        if self._report is None:
            self._report = self._build_report()
        return self._report

    def _window_loss(self, model: Any, batch: Any) -> Any:
        return micro_loss(model, float64_leaves(batch), "the window as one batch", self.loss_fn, self.step)

    def _build_report(self) -> StackReport:
        recorder = self.recorder
        reference = "step(model, batch)" if self.step is not None else \
            "loss_fn(model(inputs), target)" if self.loss_fn is not None else "the model's own loss"
        notes = [f"the user's loop: Accelerator(gradient_accumulation_steps={self.accum_steps}); the gradient is read "
                 "before accelerator.clip_grad_norm_ on a step that syncs, else at the optimizer's step; "
                 f"{reference} on the window as one batch for the reference",
                 f"dropout off ({self.run.dropouts} rates set to 0); the model, optimizer, random states and the "
                 "accelerator's accumulation state were put back after the run"]
        idle_fix = ("check.batches(loader) gave no micro-batch: is the data loader empty?" if self._fed else
                    "run the training loop inside `with check:`, iterating `for batch in check.batches(loader):`")
        coverage = recorder.coverage("accelerate.AccumulationCheck", "check.batches(loader)",
                                     "iterate `for batch in check.batches(loader):` inside `with check:`",
                                     "the with block", idle_fix)
        return stack_report("accelerate", type(self.model).__name__, self.accum_steps, recorder.windows,
                            recorder.seen, {"accelerate": self.version, "torch": torch.__version__}, notes,
                            reproduce=f"accumcheck.integrations.accelerate.AccumulationCheck(accelerator, model, "
                                      f"optimizer, steps={self.steps})", coverage=coverage)


def _captured_first(clip: Any, accelerator: Any, recorder: StackRecorder) -> Any:
    def clip_gradients(*args: Any, **kwargs: Any) -> Any:
        if accelerator.sync_gradients:
            recorder.capture()  # the gradient as the optimizer would apply it, before clipping
        return clip(*args, **kwargs)
    return clip_gradients


def run_case(case: Any, accum_steps: int, batches: int | None = None, fault: str | None = None) -> StackReport:
    """A built-in token case through an accelerate loop written as accelerate's guide says for
    windows of different token counts: each micro-batch's token-summed loss over its window's
    labelled tokens, times N (``backward`` divides by N), a prepared dataloader (so a last short
    window steps), clipping when the gradients sync; ``batches`` micro-batches (default 2N + 2: two
    full windows and a short one). ``fault``: "micro-batch-mean" (the model ignores the window's
    token count) or "loss-over-n" (the loop divides the loss by N before ``backward``, which
    divides again). Returns the StackReport of every step."""
    accelerate = stack_library("accelerate", "Hugging Face accelerate")
    if fault not in (None, *FAULTS):
        raise AccumcheckError(f"--fault {fault}: not a fault the accelerate stack runs; use one of {', '.join(FAULTS)}")
    case = resolve_case(case)
    count = 2 * accum_steps + 2 if batches is None else batches
    model = CaseLM(case, accum_steps, fault if fault == "micro-batch-mean" else None)
    micro_batches = case_batches(case, count)
    items = window_items(micro_batches, accum_steps)
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=accum_steps)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loader = torch.utils.data.DataLoader(micro_batches, batch_size=None)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    check = AccumulationCheck(accelerator, model, optimizer)
    with check:
        for i, batch in enumerate(check.batches(loader)):
            with accelerator.accumulate(model):
                loss = model(**batch, num_items_in_batch=items[i])["loss"] * accum_steps
                accelerator.backward(loss / accum_steps if fault == "loss-over-n" else loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
    accelerator.free_memory()
    report = check.report
    report.model = f"{case.name} (built-in case)"
    report.reproduce = stack_command("accelerate", case.name, accum_steps, batches, fault)
    report.micro_batches_expected = count
    return report
