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

import warnings
from typing import Any, Callable

from ..case.reading import resolve_case
from ..errors import AccumcheckError
from ..options.spec import stack_command
from ..report import StackReport
from . import missing

try:
    import accelerate  # noqa: F401  (the stack: missing, one line says so)
    import torch

    from ..torch import loopcheck
    from ..torch.stacks.cases import FAULTS, RANK_FAULTS, CaseLM, case_batches, window_items
    from ..torch.stacks.float64run import stack_library
    from ..torch.stacks.reference import reference_keyword
except ModuleNotFoundError as exc:
    raise missing(__name__, exc, "accelerate and PyTorch", "pip install 'accumcheck[accelerate]'") from None

_CLIPS = ("clip_grad_norm_", "clip_grad_value_")


class AccumulationCheck(loopcheck.AccumulationCheck):
    """The check of a user's accelerate loop. ``loss_fn(model(inputs), target)``, ``step(model,
    batch)`` or the model's own loss (``model(**batch).loss``) is the loss of the window as one
    batch, as ``accumcheck.torch.check`` reads a batch; ``steps`` stops the loop after that many
    optimizer steps; ``scheduler`` (the learning-rate scheduler the loop steps) is put back afterwards
    with the rest; ``reference`` ("auto", "joined", "micro-batches") as for
    ``accumcheck.torch.AccumulationCheck``. ``report`` is the StackReport once the ``with`` block is left; it raises
    NothingJudgedError for a block in which nothing was judged. Launched on several processes
    (``accelerate launch``, torchrun), every process runs the check and holds the same report."""

    who = "accelerate.AccumulationCheck"
    restored = "model, optimizer, random states and the accelerator's accumulation state"

    def __init__(self, accelerator: Any, model: torch.nn.Module, optimizer: Any,
                 loss_fn: Callable[..., Any] | None = None, step: Callable[[Any, Any], Any] | None = None,
                 steps: int | None = None, scheduler: Any = None, reference: str = "auto",
                 memory_budget: int | str | None = None, every: int | None = None) -> None:
        accelerate = stack_library("accelerate", "Hugging Face accelerate")
        if not isinstance(accelerator, accelerate.Accelerator):
            raise AccumcheckError(f"accelerate.AccumulationCheck: expected an accelerate.Accelerator, got "
                                  f"{type(accelerator).__name__}")
        super().__init__(model, optimizer, loss_fn, step, steps, scheduler, reference, memory_budget, every)
        self.accelerator = accelerator
        self.version = accelerate.__version__

    def __enter__(self) -> "AccumulationCheck":
        accelerator, state = self.accelerator, self.accelerator.gradient_state
        self._accelerator_state = (accelerator.step, state.sync_gradients, state.dataloader_references)
        super().__enter__()
        try:
            for name in _CLIPS:
                setattr(accelerator, name, self._captured_first(getattr(accelerator, name)))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._inside:
            return
        accelerator, state = self.accelerator, self.accelerator.gradient_state
        try:
            for name in _CLIPS:
                accelerator.__dict__.pop(name, None)
        finally:
            super().__exit__(*exc)
            if self.every is None:  # the check's own steps; a sampled check's run is the user's
                accelerator.step, state.sync_gradients, state.dataloader_references = self._accelerator_state

    def _stepping(self) -> bool:
        return bool(self.accelerator.sync_gradients)  # a clip on a micro-step that does not sync is no step's

    def _accum_steps(self) -> int:
        return self.accelerator.gradient_accumulation_steps

    def _loop_note(self, reference: str) -> str:
        return (f"the user's loop: Accelerator(gradient_accumulation_steps={self.accelerator.gradient_accumulation_steps}"
                f"); the gradient is read at the optimizer's step, as it was before accelerator.clip_grad_norm_ on a "
                f"step that syncs; {reference} for the window's reference")

    def _stack(self) -> tuple[str, dict[str, str], str]:
        return "accelerate", {"accelerate": self.version, "torch": torch.__version__}, \
            f"accumcheck.integrations.accelerate.AccumulationCheck(accelerator, model, optimizer, steps={self.steps}" \
            f"{reference_keyword(self.window_reference)}{self._budget_keyword()})"


def run_case(case: Any, accum_steps: int, batches: int | None = None, fault: str | None = None,
             world_size: int = 1) -> StackReport:
    """A built-in token case through an accelerate loop written as accelerate's guide says for
    windows of different token counts: each micro-batch's token-summed loss over its window's
    labelled tokens (on every process: the global window's), times N and the number of processes
    (``backward`` divides by N, the all-reduce averages over the processes), a prepared dataloader
    (so a last short window steps), clipping when the gradients sync; ``batches`` micro-batches
    (default 2N + 2 per process: two full windows and a short one). ``fault``: "micro-batch-mean"
    (the model ignores the window's token count), "loss-over-n" (the loop divides the loss by N
    before ``backward``, which divides again) or, on several processes, "rank-loss-scaled" (the
    last process's loss doubled). ``world_size``: the processes the run was started on (torchrun's,
    which accelerate reads itself). Returns the StackReport of every step."""
    accelerate = stack_library("accelerate", "Hugging Face accelerate")
    if fault not in (None, *FAULTS, *RANK_FAULTS):
        raise AccumcheckError(f"--fault {fault}: not a fault the accelerate stack runs; use one of "
                              f"{', '.join(FAULTS + RANK_FAULTS)}")
    case = resolve_case(case)
    # on the CPU (gloo under torchrun: accelerate makes a multi-CPU run only when told cpu=True)
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=accum_steps, cpu=True)
    world, rank = accelerator.num_processes, accelerator.process_index
    if world != world_size:
        raise AccumcheckError(f"--world-size {world_size}: accelerate runs on {world} processes here; start the ranks "
                              "with torchrun (accumcheck stack --world-size does)")
    if fault in RANK_FAULTS and world < 2:
        raise AccumcheckError(f"--fault {fault}: a fault of one rank of several; run with --world-size 2 or more")
    count = (2 * accum_steps + 2) * world if batches is None else batches
    model = CaseLM(case, accum_steps, fault if fault == "micro-batch-mean" else None)
    micro_batches = case_batches(case, count)
    items = window_items(micro_batches, accum_steps * world)  # by global micro-batch: i x W + rank
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # one micro-batch per item, so that a prepared loader hands process r every W-th one
        loader = torch.utils.data.DataLoader(micro_batches, batch_size=1, collate_fn=lambda found: found[0])
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    scale = accum_steps * world * (2.0 if fault == "rank-loss-scaled" and rank == world - 1 else 1.0)
    check = AccumulationCheck(accelerator, model, optimizer)
    with check:
        for i, batch in enumerate(check.batches(loader)):
            with accelerator.accumulate(model):
                loss = model(**batch, num_items_in_batch=items[i * world + rank])["loss"] * scale
                accelerator.backward(loss / accum_steps if fault == "loss-over-n" else loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
    accelerator.free_memory()
    report = check.report
    report.model = f"{case.name} (built-in case)"
    report.reproduce = stack_command("accelerate", case.name, accum_steps, batches, fault, world)
    report.micro_batches_expected = count
    return report
