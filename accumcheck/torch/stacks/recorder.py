"""What every PyTorch training stack's check shares: the model run in float64 for the check and put
back afterwards, the micro-batches recorded as the stack feeds them, and at each optimizer step the
gradient the optimizer is about to apply set beside the gradient of its window as one batch.

In float64 the two are two summation orders of one sum, ~1e-15 apart; what is left to differ is
what the stack does around autograd (how it normalises the loss, what it divides a window by,
which micro-batches reach a step). Autocast leaves float64 alone, so a bf16 or fp16 setting of the
stack does not hide anything here (precision is what ``accumcheck check`` looks at).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import numpy as np
import torch

from ...errors import AccumcheckError
from ...judge.fullbatch import SEMANTIC_TOLERANCE, largest_difference
from ...judge.stack import Coverage, judge_window
from ...run.results import Hypotheses, StackWindow, StepPrecision, TermGradients
from ...run.usermodel import map_leaves
from ..bydesign import batch_level_modules
from ..casemodel import to_numpy
from ..userbatch import item_count
from .batches import join_padded, predicted_count
from .float64run import innermost_optimizer
from .owndtype import OwnDtypeReference, restore_rng, rng_state
from .reference import ReferencePlan, add_gradients, plan_reference, reference_choice, weighted_absum, weighted_sum
from .stepwatch import StepWatch
from .world import World


class StackRecorder:
    """The micro-batches a stack feeds, and at each optimizer step its window judged-ready: the
    applied gradient and the window's gradient as one batch, both float64.

    ``window_loss(model, batch)`` is the loss of a batch as the stack computes it (or the loss
    and a mapping of its additive terms by name, each a scalar tensor), applied to
    the window's micro-batches joined (``join_window``, default: concatenated along dim 0,
    sequences right-padded to one length), or micro-batch by micro-batch where the loss is shown
    to be a mean over the window's items (``window_reference``: "auto", "joined" or
    "micro-batches", ``accumcheck.torch.stacks.reference``). ``capture()`` is called before clipping and, as a
    fallback, from the optimizer's step pre-hook; a window is captured once. ``stepped()`` counts
    the stack's real optimizer steps (``optimizer_steps``) and, in ``unrecorded``, those with no
    micro-batch recorded since the step before: steps the check did not judge.

    In a data-parallel run (``World``) every rank records its own micro-batches and calls
    ``capture()`` at the same steps; the window is every rank's micro-batches, gathered, and every
    rank computes its gradient alike, so every rank holds the same windows. ``applied_gradient(name,
    parameter)`` is the whole gradient the optimizer applies (default ``.grad``; a sharded stack
    gathers it, on every rank in the same order); ``reference()`` is the module the window's
    gradient is computed on (default: ``model``, which the stack's check runs in float64), with
    ``model``'s parameter names; ``precision`` says in which dtypes a stack that does not run in
    float64 sums the micro-batches and reduces over the ranks, so that its round-off is allowed
    for."""

    def __init__(self, model: torch.nn.Module, window_loss: Callable[[Any, Any], Any],
                 join_window: Callable[[list[Any]], Any] | None = None, labelled: bool = False, *,
                 applied_gradient: Callable[[str, torch.nn.Parameter], torch.Tensor | None] | None = None,
                 reference: Callable[[], torch.nn.Module] | None = None,
                 precision: StepPrecision | None = None, window_reference: str = "auto",
                 own_dtype: OwnDtypeReference | None = None, every: int | None = None,
                 accum_steps: Callable[[int], int] | None = None) -> None:
        self.model = model
        # the stack's N for a window of k micro-batches, where known as the run goes: each window is
        # then judged once its step has run and its arrays let go, so the check holds one window's
        self.accum_steps = accum_steps
        self.window_reference = reference_choice(window_reference, "stack check")  # ``stacks.reference``
        self.window_loss = window_loss
        self.join_window = join_window or join_padded
        self.labelled = labelled  # (inputs, target) batches: count the target's items
        self.applied_gradient = applied_gradient or (lambda name, p: p.grad)
        self.reference = reference
        self.precision = precision
        self.world = World.current()
        self.windows: list[StackWindow] = []
        self.pending: list[tuple[int, Any]] = []
        self.seen = 0
        self.optimizer_steps = 0
        self.unrecorded: list[int] = []
        self._captured = False  # a window captured since the last optimizer step
        self.takes_item_count: bool | None = None  # the model normalises by the window's items itself
        self._hooks: list[Any] = []
        self.step_watch: StepWatch | None = None  # what each optimizer step does with the gradient
        self._window_step = -1  # the optimizer step the last captured window is applied at
        # the windows' references in the model's own dtype, in groups of tensors (a memory budget, a sampled run)
        self.own_dtype = own_dtype
        self.computed = "float32"  # the dtype the stack computes its micro-gradients in (autocast's), for own_dtype
        self.every = every  # sampled: one window in ``every`` judged, and every window of a new length
        self.stepped_indices: set[int] = set()  # micro-batches that reached a step, judged or not (sampled)
        self.judged_why: dict[int, str] = {}  # sampled: the optimizer steps judged, and why each
        self._rng: list[Any] = []  # sampled: torch's random states as each pending micro-batch began
        self._last_length: int | None = None
        # in its own dtype: steps whose window was let go, its loss not split micro-batch by micro-batch (a live
        # run cannot hold the window as one batch; under a budget, the probe undecided), and why; sampled, the
        # next window is judged in its place
        self.unsplit: dict[int, str] = {}
        self.own_seconds: dict[int, float] = {}  # the recorder's own time at each optimizer step (its cost)
        self.probed = ""  # the count a window's probe showed the loss to be a mean over (``plan_reference``)

    @property
    def seen_everywhere(self) -> int:
        """Micro-batches recorded on every rank together (a collective in a data-parallel run)."""
        return sum(self.world.gather(self.seen))

    @contextlib.contextmanager
    def _own_time(self) -> Any:
        """Counts the time inside it to the optimizer step the recorder serves (``own_seconds``)."""
        step, started = self.optimizer_steps, time.perf_counter()
        try:
            yield
        finally:
            self.own_seconds[step] = self.own_seconds.get(step, 0.0) + time.perf_counter() - started

    def record(self, batch: Any) -> None:
        """One micro-batch entered the current window (kept as it was fed)."""
        with self._own_time():
            kept = map_leaves(batch, lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t)
            if self.every is not None:  # the run's own dropout: the reference draws what this micro-batch draws
                self._rng.append(rng_state())
            if self.step_watch is not None:
                self.step_watch.micro_batch()
            self.pending.append((self.world.global_index(self.seen), kept))
            self.seen += 1

    def watch(self, optimizer: Any) -> None:
        """Capture at ``optimizer``'s real steps (a wrapper's skipped steps do not count). Not for
        a stack that runs the last backward inside ``step(closure)`` (Lightning): the hook fires
        before that gradient exists."""
        inner = innermost_optimizer(optimizer)
        self._hooks.append(inner.register_step_pre_hook(lambda *_: self.stepped()))

    def watch_updates(self, optimizer: Any, replay: bool = True) -> StepWatch:
        """Each step of ``optimizer`` gives its window a ``StepUpdate`` (``StepWatch``); after ``watch``."""
        watch = StepWatch(self.model, innermost_optimizer(optimizer), replay=replay)
        watch.install()
        self.step_watch = watch
        self._hooks.append(watch.optimizer.register_step_post_hook(lambda *_: self._updated()))
        return watch

    def _updated(self) -> None:
        update = self.step_watch.take() if self.step_watch is not None else None
        if update is not None and self.windows and self._window_step == self.optimizer_steps - 1:
            self.windows[-1].update = self.windows[-1].update or update
        self._settle()

    def _settle(self) -> None:
        """The windows whose step has run judged (``accum_steps`` given), their arrays let go."""
        if self.accum_steps is None:
            return
        for window in self.windows:
            if window.judged is None:
                window.judged = judge_window(window, self.accum_steps(len(window.micro_batches)))
                window.applied, window.window, window.absum, window.hypotheses = {}, {}, None, Hypotheses()

    def stepped(self) -> None:
        """The stack's optimizer steps now: the window is captured where it was not yet; a step
        with no micro-batch recorded since the one before is one the check does not judge."""
        self.capture()
        if not self._captured:
            self.unrecorded.append(self.optimizer_steps)
        self.optimizer_steps += 1
        self._captured = False

    def unwatch(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self.step_watch is not None:
            self.step_watch.remove()

    def coverage(self, who: str, feed: str, fix: str, idle: str, idle_fix: str) -> Coverage:
        """What the recorder counted beside its windows, with the words that say what was not judged
        (``accumcheck.judge.stack.Coverage``)."""
        return Coverage(who=who, feed=feed, fix=fix, idle=idle, idle_fix=idle_fix,
                        optimizer_steps=self.optimizer_steps, unrecorded=list(self.unrecorded))

    def capture(self) -> None:
        """The current window: the gradient the optimizer is about to apply, and the window's as one
        batch, or micro-batch by micro-batch under the window's normalisation where its loss splits
        (``stacks.reference``; the stack's gradients and buffers are put back before it goes on). Where the loss has
        additive terms, or the window's gradient is not what was applied, also what else may
        explain it (``Hypotheses``): each term's gradient on the window and summed over the
        micro-batches, the micro-batches' own losses' gradients summed, and in a data-parallel run
        each rank's micro-batches as a batch of their own, averaged over the ranks."""
        with self._own_time():
            self._capture()

    def _capture(self) -> None:
        world = self.world
        pending = sorted((entry for part in world.gather(self.pending) for entry in part), key=lambda e: e[0])
        if not pending:
            return
        if self.every is not None and not self._sampled(pending):
            return
        self._settle()  # a step the watch saw no update of (or no watch): its window is complete
        named = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        if self.own_dtype is not None:
            return self._capture_own_dtype(named, pending)
        applied = {name: _array(self.applied_gradient(name, p), p) for name, p in named}
        module = self.model if self.reference is None else self.reference()
        reference = dict(module.named_parameters())
        missing = [name for name, _ in named if name not in reference]
        if missing:
            raise AccumcheckError(f"stack check: the reference module has no parameter {missing[0]!r} of the model")
        ref_named = [(name, reference[name]) for name, _ in named]
        batches = [b for _, b in pending]
        indices = [i for i, _ in pending]
        grads = [p.grad for _, p in ref_named]
        buffers = [(b, b.detach().clone()) for b in module.buffers()]
        hypotheses = Hypotheses(takes_item_count=self.takes_item_count, by_design=batch_level_modules(module))
        absum = micro = None
        if self.step_watch is not None:  # the reference's own calls are not the stack's
            self.step_watch.paused = True
        try:
            with torch.enable_grad():
                plan = plan_reference(self.window_reference, module, batches, self.labelled, self.window_loss,
                                      self.join_window, hypotheses.by_design, self.probed)
                self.probed = plan.count or self.probed
                if plan.split:  # each micro-batch's own gradient kept only where the round-off needs it
                    keep = self.precision is not None  # (a flagged window's hypotheses run them again below)
                    window, found, each = self._micro_batch_sums(module, ref_named, batches, plan.weights, keep)
                    micro, term_windows = (weighted_sum(each, (1.0,) * len(each)), found, each) if keep else None, {}
                    if found:  # terms the probe's rows did not have: the window as one batch
                        plan = ReferencePlan(False, "the loss has additive terms of its own")
                if not plan.split:
                    window, term_windows = self._gradients(module, ref_named, self.join_window(batches))
                if term_windows:
                    hypotheses.main = {name: g - sum(t[name] for t in term_windows.values())
                                       for name, g in window.items()}
                close = largest_difference(applied, window)[0] <= SEMANTIC_TOLERANCE
                if term_windows or not close or self.precision is not None:
                    micro_sum, summed, each = micro or self._micro_batch_sums(module, ref_named, batches)
                    hypotheses.micro_sum = micro_sum
                    hypotheses.micro_batches = None if close else each
                    absum = [{name: np.abs(g) for name, g in gradient.items()} for gradient in each]
                    hypotheses.terms = {name: TermGradients(summed[name], term_windows[name])
                                        for name in term_windows if name in summed}
                if world.parallel and not close:
                    hypotheses.rank_windows = self._rank_windows(module, ref_named, pending)
        finally:
            if self.step_watch is not None:
                self.step_watch.paused = False
            with torch.no_grad():
                for (_, p), g in zip(ref_named, grads):
                    p.grad = g
                for b, value in buffers:
                    b.copy_(value)
        counts = [item_count(b, self.labelled) for b in batches]
        predicted = [predicted_count(b) for b in batches]
        known = None not in counts
        if absum is not None and self.precision is not None:
            absum = weighted_absum(absum, counts if known else None)
        self.windows.append(StackWindow(step=len(self.windows), micro_batches=indices,
                                        applied=applied, window=window,
                                        item_counts=counts if known else None,
                                        predicted_counts=None if None in predicted else predicted,
                                        hypotheses=hypotheses, world_size=world.size,
                                        precision=self.precision, absum=absum, reference=plan.reference,
                                        reference_note=plan.note))
        self._done(indices)

    def _done(self, indices: list[int]) -> None:
        self.stepped_indices.update(indices)
        self.pending, self._rng = [], []
        self._captured = True
        self._window_step = self.optimizer_steps

    def _sampled(self, pending: list[tuple[int, Any]]) -> bool:
        """Whether the sampled check judges this window: every ``every``-th optimizer step from the
        first, and every window whose length differs from the one before (an epoch's short last
        window, a data loader's change, the first window after either). Not judged: let go."""
        step, length = self.optimizer_steps, len(pending)
        why = "" if self._last_length is None or length == self._last_length else \
            f"{length} micro-batches after windows of {self._last_length}"
        self._last_length = length
        if step % self.every == 0:
            why = why or f"one step in {self.every}"
        if self.unsplit and max(self.unsplit) == step - 1 and not why:
            why = f"in place of step {step - 1}, whose window could not be split"
        if why:
            self.judged_why[step] = why
            return True
        self._done([i for i, _ in pending])
        return False

    def _capture_own_dtype(self, named: list[tuple[str, torch.Tensor]], pending: list[tuple[int, Any]]) -> None:
        """The window judged as it is captured, its reference in the model's own dtype micro-batch by
        micro-batch and in groups of tensors (``stacks.owndtype``); the random states put back after it."""
        module = self.model if self.reference is None else self.reference()
        reference = dict(module.named_parameters())
        ref_named = [(name, reference[name]) for name, _ in named]
        batches, indices = [b for _, b in pending], [i for i, _ in pending]
        by_design = batch_level_modules(module)
        buffers = [(b, b.detach().clone()) for b in module.buffers()]
        found = rng_state()
        if self.step_watch is not None:
            self.step_watch.paused = True
        try:
            with torch.enable_grad():
                with _dropout_free(module, self.every is not None):  # the probe compares rows: no random draws
                    # a live run is never stopped by its check: a window that cannot be split is let go, said
                    choice = "auto" if self.every is not None else self.window_reference
                    plan = plan_reference(choice, module, batches, self.labelled, self.window_loss,
                                          self.join_window, by_design, self.probed) \
                        if len(batches) > 1 else ReferencePlan(True, "one micro-batch", (1.0,))
                    self.probed = plan.count or self.probed
                # under a budget too, a window the probe could not decide on is let go (a later one may)
                if not plan.split and (self.every is not None or plan.undecided):
                    self.unsplit[self.optimizer_steps] = plan.note
                    self.judged_why.pop(self.optimizer_steps, None)
                    self._done(indices)
                    return
                counts = [item_count(b, self.labelled) for b in batches]
                predicted = [predicted_count(b) for b in batches]
                # numbered by the optimizer step where windows were let go (sampled, or undecided under a budget)
                numbered = self.every is not None or self.unsplit
                window = StackWindow(step=self.optimizer_steps if numbered else len(self.windows),
                                     micro_batches=indices, applied={}, window={},
                                     item_counts=None if None in counts else counts,
                                     predicted_counts=None if None in predicted else predicted,
                                     hypotheses=Hypotheses(takes_item_count=self.takes_item_count),
                                     world_size=self.world.size, reference=plan.reference, reference_note=plan.note)
                params = dict(named)
                window.judged = self.own_dtype.step(window, module, ref_named,
                                                    lambda name, _: self.applied_gradient(name, params[name]),
                                                    batches, plan, self.window_loss, self.join_window, self.computed,
                                                    self._rng if self.every is not None else None)
        finally:
            if self.step_watch is not None:
                self.step_watch.paused = False
            restore_rng(found)
            with torch.no_grad():
                for b, value in buffers:
                    b.copy_(value)
        self.windows.append(window)
        self._done(indices)

    def _gradients(self, module: torch.nn.Module, named: list[tuple[str, torch.Tensor]],
                   batch: Any, scale: float = 1.0) -> tuple[Gradients, dict[str, Gradients]]:
        """The gradient of the stack's loss of ``batch`` (times ``scale``), and of each of its additive terms."""
        found = self.window_loss(module, batch)
        loss, terms = found if isinstance(found, tuple) else (found, {})
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad):
            raise AccumcheckError("stack check: the window's loss is not a scalar tensor with a gradient "
                                  f"(got {type(loss).__name__}); the loss function must return the loss")
        terms = {name: t for name, t in terms.items() if isinstance(t, torch.Tensor) and t.requires_grad}
        gradients = []
        for part in (loss * scale if scale != 1.0 else loss, *terms.values()):
            for _, p in named:
                p.grad = None
            part.backward(retain_graph=bool(terms))
            gradients.append({name: _grad(p) for name, p in named})
        return gradients[0], dict(zip(terms, gradients[1:]))

    def _micro_batch_sums(self, module: torch.nn.Module, named: list[tuple[str, torch.Tensor]],
                          batches: list[Any], weights: tuple[float, ...] | None = None, keep: bool = True
                          ) -> tuple[Gradients, dict[str, Gradients], list[Gradients]]:
        """Over the window's micro-batches, each as a batch of its own: its loss's gradient summed,
        each term's, and each one's gradient (``keep``; else none, the sums alone held). With
        ``weights``, each one's loss times its weight, as the window's loss scales its items
        (float32 parts of a model round alike), divided back."""
        total: Gradients = {}
        terms: dict[str, Gradients] = {}
        each: list[Gradients] = []
        for i, batch in enumerate(batches):
            w = 1.0 if weights is None else weights[i]
            gradient, term_gradients = self._gradients(module, named, self.join_window([batch]), w)
            add_gradients(total, gradient)
            if keep:
                each.append(gradient if w == 1.0 else {name: g / w for name, g in gradient.items()})
            for name, g in term_gradients.items():
                add_gradients(terms.setdefault(name, {}), g)
        return total, terms, each

    def _rank_windows(self, module: torch.nn.Module, named: list[tuple[str, torch.Tensor]],
                      pending: list[tuple[int, Any]]) -> list[Gradients]:
        """Each rank's micro-batches of the window as a batch of their own (normalised over that
        rank's items only), their gradients by rank: a data-parallel step where each rank counted
        its own items (num_items_in_batch counted per rank, transformers#34242) is a weighted sum
        of them."""
        size = self.world.size
        found = []
        for rank in range(size):
            mine = [b for i, b in pending if i % size == rank]
            found.append(self._gradients(module, named, self.join_window(mine))[0] if mine else
                         {name: np.zeros(tuple(p.shape)) for name, p in named})
        return found


Gradients = dict[str, np.ndarray]


@contextlib.contextmanager
def _dropout_free(module: torch.nn.Module, live: bool) -> Any:
    """In a live run (``live``), ``module`` in eval mode while the block runs (its dropout off), its
    modules' flags put back after."""
    flags = [(m, m.training) for m in module.modules()] if live else []
    if live:
        module.eval()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def _grad(p: torch.Tensor) -> np.ndarray:
    return _array(p.grad, p)


def _array(grad: torch.Tensor | None, p: torch.Tensor) -> np.ndarray:
    """A gradient in float64 on the host; zeros of the parameter's shape where there is none."""
    return np.zeros(tuple(p.shape)) if grad is None else to_numpy(grad.detach()).astype(np.float64)
