"""What every PyTorch training stack's check shares: the model run in float64 for the check and put
back afterwards, the micro-batches recorded as the stack feeds them, and at each optimizer step the
gradient the optimizer is about to apply set beside the gradient of its window as one batch.

In float64 the two are two summation orders of one sum, ~1e-15 apart; what is left to differ is
what the stack does around autograd (how it normalises the loss, what it divides a window by,
which micro-batches reach a step). Autocast leaves float64 alone, so a bf16 or fp16 setting of the
stack does not hide anything here (precision is what ``accumcheck check`` looks at).
"""

from __future__ import annotations

import copy
import importlib
import random
import re
from collections import defaultdict
from typing import Any, Callable

import numpy as np
import torch

from ...errors import AccumcheckError, first_line
from ...judge.fullbatch import SEMANTIC_TOLERANCE, largest_difference
from ...judge.stack import Coverage
from ...run.results import Hypotheses, StackWindow, StepPrecision, TermGradients
from ...run.usermodel import map_leaves
from ..bydesign import batch_level_modules
from ..casemodel import to_numpy
from ..userbatch import item_count
from .batches import join_padded, predicted_count
from .reference import ReferencePlan, add_gradients, plan_reference, reference_choice, weighted_absum, weighted_sum
from .stepwatch import StepWatch
from .world import World

_DROPOUT_WORDS = ("dropout", "pdrop")


def stack_library(name: str, what: str) -> Any:
    """The stack's library, imported when a check first needs it; missing, one AccumcheckError
    saying what to install (``accumcheck[name]``)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise AccumcheckError(f"the {name} stack needs {what}; install it with pip install "
                              f"'accumcheck[{name}]'") from None


def float64_leaves(value: Any) -> Any:
    """``value`` with every floating tensor in it in float64 (through tuples, lists, mappings)."""
    return map_leaves(value, lambda t: t.to(torch.float64) if isinstance(t, torch.Tensor) and t.is_floating_point()
                      else t)


def innermost_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a stack's wrapper (accelerate's AcceleratedOptimizer, Lightning's
    LightningOptimizer), whose step runs only when the stack really steps."""
    seen = 0
    while not isinstance(optimizer, torch.optim.Optimizer) or type(optimizer).__name__ == "AcceleratedOptimizer":
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None or seen > 8:
            break
        optimizer, seen = inner, seen + 1
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise AccumcheckError(f"stack check: {type(optimizer).__name__} is not a torch optimizer and wraps none; "
                              "pass the optimizer the stack steps")
    return optimizer


class Float64Run:
    """The model (and its optimizers) in float64 for the check (unless ``float64`` is False: a
    data-parallel or sharded stack whose communication is set up for its dtypes runs in them, and
    is judged against a float64 copy), dropout off, and everything put back on exit: parameter and buffer tensors (the very ones, so their values are bit for bit
    as before), ``.grad``, training flags, dropout rates, optimizer state and hyper-parameters,
    a ``forward`` a stack patched onto the model, and the random states the stack reseeds."""

    def __init__(self, model: torch.nn.Module, optimizers: tuple[Any, ...] = (), float64: bool = True) -> None:
        self.model = model
        self.optimizers = [innermost_optimizer(o) for o in optimizers if o is not None]
        self.dropouts = 0
        self.float64 = float64  # False: the model keeps its dtypes (a stack judged against a float64 copy)

    def __enter__(self) -> "Float64Run":
        model = self.model
        self._params = [p for p in model.parameters()]
        self._data = [p.data for p in self._params]
        self._grads = [p.grad for p in self._params]
        self._buffers = [(m, name, b) for m in model.modules() for name, b in m._buffers.items() if b is not None]
        self._flags = [(m, m.training) for m in model.modules()]
        self._forward = model.__dict__.get("forward")
        self._rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        self._optimizer_state = [(o, o.state, [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups])
                                 for o in self.optimizers]
        self._rates = self._dropout_off(model)
        if not self.float64:
            self._hook, self._experts = None, None
            return self
        with torch.no_grad():
            for p in self._params:
                if p.is_floating_point():
                    p.data = p.data.to(torch.float64)
                p.grad = None
            for m, name, b in self._buffers:
                if b.is_floating_point():
                    m._buffers[name] = b.to(torch.float64)
            for o in self.optimizers:  # state the optimizer already has, as copies: float64 for the run
                fresh: defaultdict[Any, dict[str, Any]] = defaultdict(dict)  # as torch's own: new params get {}
                for p, s in o.state.items():
                    fresh[p] = {k: _run_copy(v) for k, v in s.items()}
                o.state = fresh
        self._hook = model.register_forward_pre_hook(_inputs_in_float64, with_kwargs=True)
        self._experts = _eager_experts(model)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hook is not None:
            self._hook.remove()
        if self._experts is not None:
            self.model.set_experts_implementation(self._experts)
        for p, data, grad in zip(self._params, self._data, self._grads):
            p.data = data
            p.grad = grad
        for m, name, b in self._buffers:
            m._buffers[name] = b
        for m, flag in self._flags:
            m.training = flag
        for obj, attr, value in self._rates:
            setattr(obj, attr, value)
        if self._forward is None:
            self.model.__dict__.pop("forward", None)
        else:
            self.model.forward = self._forward
        for o, state, groups in self._optimizer_state:
            o.state = state
            for group, saved in zip(o.param_groups, groups):
                group.update(saved)
        random.setstate(self._rng[0])
        np.random.set_state(self._rng[1])
        torch.set_rng_state(self._rng[2])

    def _dropout_off(self, model: torch.nn.Module) -> list[tuple[Any, str, Any]]:
        """Every dropout rate set to 0, as (object, attribute, old value): ``nn.Dropout*`` modules'
        ``p`` and float attributes named like a dropout rate (Hugging Face attention modules
        keep ``attention_dropout`` and call the functional form)."""
        saved = []
        for m in model.modules():
            for attr, value in list(vars(m).items()):
                is_rate = (attr == "p" and isinstance(m, torch.nn.modules.dropout._DropoutNd)) or \
                    any(word in attr.lower() for word in _DROPOUT_WORDS)
                if is_rate and isinstance(value, float) and value > 0:
                    saved.append((m, attr, value))
                    setattr(m, attr, 0.0)
        self.dropouts = len(saved)
        return saved


def float64_copy(model: torch.nn.Module, shared: tuple[Any, ...] = ()) -> torch.nn.Module:
    """A copy of ``model`` in float64 sharing no storage with it, dropout off, for a reference
    computed beside a stack that runs in its own dtypes (``refresh_copy`` brings its weights up);
    the objects in ``shared`` (a Lightning module's trainer) referenced, not copied."""
    with torch.no_grad():
        copied = copy.deepcopy(model, {id(obj): obj for obj in shared}).to(torch.float64)
    for p in copied.parameters():
        p.grad = None
    return copied


def refresh_copy(copied: torch.nn.Module, model: torch.nn.Module) -> None:
    """``copied``'s parameters and buffers set to ``model``'s values now (float64)."""
    with torch.no_grad():
        for (_, mine), (_, theirs) in zip(copied.named_parameters(), model.named_parameters()):
            mine.copy_(theirs.detach())
        for (_, mine), (_, theirs) in zip(copied.named_buffers(), model.named_buffers()):
            mine.copy_(theirs.detach())


def _eager_experts(model: torch.nn.Module) -> dict[str, Any] | None:
    """A Hugging Face mixture-of-experts model switched to its eager experts path, whose matmuls
    run in float64 (the default ``grouped_mm`` kernel has no float64 on the CPU); its
    implementation as found, to put back, or None where nothing was switched."""
    get, set_ = getattr(model, "get_experts_implementation", None), getattr(model, "set_experts_implementation", None)
    if not (callable(get) and callable(set_)):
        return None
    found = get()
    if not isinstance(found, dict) or all(value in (None, "eager") for value in found.values()):
        return None
    set_("eager")
    return found


def float64_kernel_error(exc: BaseException) -> str | None:
    """The message of an error from an operation with no float64 kernel (``got Double``, ``not
    implemented for 'Double'``), or None for any other error."""
    text = first_line(exc)
    return text if isinstance(exc, (RuntimeError, TypeError, NotImplementedError)) and re.search(
        r"\bDouble\b|float64", text) else None


def _run_copy(value: Any) -> Any:
    """An optimizer state value for the run: a copy (a 0-dim ``step`` too, which the run's steps
    would otherwise count up in place), floating tensors of parameter shape in float64."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.to(torch.float64) if value.is_floating_point() and value.dim() > 0 else value.clone()


def _inputs_in_float64(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    return float64_leaves(args), float64_leaves(kwargs)


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
                 precision: StepPrecision | None = None, window_reference: str = "auto") -> None:
        self.model = model
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

    @property
    def seen_everywhere(self) -> int:
        """Micro-batches recorded on every rank together (a collective in a data-parallel run)."""
        return sum(self.world.gather(self.seen))

    def record(self, batch: Any) -> None:
        """One micro-batch entered the current window (kept as it was fed)."""
        kept = map_leaves(batch, lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t)
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
        world = self.world
        pending = sorted((entry for part in world.gather(self.pending) for entry in part), key=lambda e: e[0])
        if not pending:
            return
        named = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
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
                                      self.join_window, hypotheses.by_design)
                if plan.split:  # each micro-batch's own gradient, kept for the hypotheses below
                    window, found, each = self._micro_batch_sums(module, ref_named, batches, plan.weights)
                    micro, term_windows = (weighted_sum(each, (1.0,) * len(each)), found, each), {}
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
        self.pending = []
        self._captured = True
        self._window_step = self.optimizer_steps

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
                          batches: list[Any], weights: tuple[float, ...] | None = None
                          ) -> tuple[Gradients, dict[str, Gradients], list[Gradients]]:
        """Over the window's micro-batches, each as a batch of its own: its loss's gradient summed,
        each term's, and each one's gradient. With ``weights``, each one's loss times its weight, as
        the window's loss scales its items (float32 parts of a model round alike), divided back."""
        total: Gradients = {}
        terms: dict[str, Gradients] = {}
        each: list[Gradients] = []
        for i, batch in enumerate(batches):
            w = 1.0 if weights is None else weights[i]
            gradient, term_gradients = self._gradients(module, named, self.join_window([batch]), w)
            add_gradients(total, gradient)
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


def _grad(p: torch.Tensor) -> np.ndarray:
    return _array(p.grad, p)


def _array(grad: torch.Tensor | None, p: torch.Tensor) -> np.ndarray:
    """A gradient in float64 on the host; zeros of the parameter's shape where there is none."""
    return np.zeros(tuple(p.shape)) if grad is None else to_numpy(grad.detach()).astype(np.float64)
