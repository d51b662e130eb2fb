"""The reference in the model's own dtype, for a stack check that must fit beside the training run:
under a memory budget that a float64 copy of the model does not fit, and in the sampled check that
stays on in the user's real run.

The window's reference is computed micro-batch by micro-batch (``stacks.reference``: only where
the loss is shown to be a mean over the window's items), each micro-batch's weighted loss
differentiated in the model's dtype with ``torch.autograd.grad`` (the stack's ``.grad`` is not
touched), and summed in float64. Against the gradient the stack applies, the two differ by the
round-off of two float32 (or lower) computations of the same micro-gradients and of the stack's
sum over them, which the step's precision bound allows for (``judge.stack.precision_fit``, with
the reference's dtype counted).

The tensors are taken in groups (``run.budget.plan``) whose float64 sums fit the budget: each
group's pass runs the window's micro-batches again and is judged and freed before the next, so the
check holds one group's sums beside the run. A float64 copy is used instead wherever it fits.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Mapping

import numpy as np
import torch

from ...errors import AccumcheckError
from ...files import size_text
from ...judge import pieces
from ...judge.hostsums import add_squares
from ...judge.stack import judge_groups, judge_window, let_go_text
from ...options.values import byte_count
from ...report import StackStep
from ...run.budget import ALLOCATOR, FIXED_BYTES, TensorNeed, minimum, plan
from ...run.results import Hypotheses, StackWindow, StepPrecision
from ..casemodel import to_numpy
from .reference import ReferencePlan
from .stepwatch import replay_chunk

# Per element of a tensor while its group runs: the float64 sum F over the window's micro-batches
# (A is the stack's own gradient, read where it is). ||S||, the round-off's scale, is kept as a
# number per tensor (a sum of norms), not per element. A tensor's micro-gradient, in the parameter's
# own dtype, lives only while it is added (``_sums``): one tensor's at a time, counted with the
# judge's temporaries (``tensor_needs``).
SUMS_BYTES = 8
# The judge's temporaries per element of the piece it is judging, one piece of one tensor at a time
# (``judge.pieces``): A in float64, cF and A - cF.
JUDGE_BYTES = 24
# Per element of the float64 check (``recorder.Float64Run``): the parameter and its gradient in
# float64 beside the run's own, A and F on the host, the parameter's float64 copy at the window's
# start (the update's replay starts from it), and each optimizer state tensor in float64 (the run's
# copy and the window's start).
FLOAT64_PARAMETER_BYTES = 8 + 8 + 8 + 8 + 8
FLOAT64_STATE_BYTES = 8 + 8
# And while the update is replayed, per element of its chunk (``stepwatch.replay_chunk``): the twin,
# its gradient, its two state tensors, the gradient handed, the applied and expected updates, their
# scale and one temporary, all float64.
REPLAY_BYTES = 9 * 8


def float64_need(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> int:
    """What the float64 check holds beside the run (the activations of the float64 forward apart):
    FIXED_BYTES and, per parameter element, FLOAT64_PARAMETER_BYTES, per optimizer state element
    FLOAT64_STATE_BYTES (an optimizer with no state yet is counted as AdamW: two per parameter),
    and REPLAY_BYTES per element of the update's largest replay chunk; ALLOCATOR times those, as
    for the groups (the allocator's heap grows past what is live: without it the count fell short
    of what the check added to the run's peak in benchmarks/bench_stacks.py)."""
    params = [p for p in model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in params)
    inner = [getattr(o, "optimizer", o) for o in optimizers if o is not None]
    state = sum(v.numel() for o in inner for s in getattr(o, "state", {}).values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0)
    if not state:  # a fresh (or not yet made) optimizer: AdamW's two moments per parameter appear at its first step
        state = 2 * count
    chunk = replay_chunk(inner[0] if inner else None, [p.numel() for p in params])
    held = count * FLOAT64_PARAMETER_BYTES + state * FLOAT64_STATE_BYTES + chunk * REPLAY_BYTES
    return FIXED_BYTES + math.ceil(held * ALLOCATOR)


def budgeted(memory_budget: Any, model: torch.nn.Module, optimizers: list[Any], accum_steps: Callable[[int], int],
             who: str) -> OwnDtypeReference | None:
    """A stack check's ``memory_budget``: None where none was given or the float64 check fits it
    (``float64_need``), else the own-dtype reference planned in groups within it. Raises
    AccumcheckError (one line) for a value that is not a number of bytes, and for a budget that
    even the largest tensor's sums alone do not fit, naming the least that would."""
    if memory_budget is None:
        return None
    try:
        budget = byte_count(memory_budget)
    except ValueError as exc:
        raise AccumcheckError(f"{who}: memory_budget: {exc}") from None
    if float64_need(model, optimizers) <= budget:
        return None
    own = OwnDtypeReference(budget, accum_steps, who)
    own.plan([(name, p) for name, p in model.named_parameters() if p.requires_grad])
    return own


def sampled_reference(memory_budget: Any, model: torch.nn.Module, accum_steps: Callable[[int], int],
                      who: str) -> OwnDtypeReference:
    """The sampled check's reference: always in the model's own dtype, within ``memory_budget``
    where one is given (planned now, so a budget too small is refused before the run)."""
    budget = None
    if memory_budget is not None:
        try:
            budget = byte_count(memory_budget)
        except ValueError as exc:
            raise AccumcheckError(f"{who}: memory_budget: {exc}") from None
    own = OwnDtypeReference(budget, accum_steps, who)
    own.plan([(name, p) for name, p in model.named_parameters() if p.requires_grad])
    return own


def sampled_note(judged_why: dict[int, str], optimizer_steps: int, every: int, ran: str,
                 unsplit: dict[int, str] | None = None, own_seconds: dict[int, float] | None = None) -> str:
    """How a sampled check's report says which steps it judged, and why each; which chosen steps it
    could not judge (``unsplit``: their loss cannot be split micro-batch by micro-batch); and what it
    cost the run (``own_seconds``: the recorder's own time at each optimizer step)."""
    listed = ", ".join(f"{step}" + ("" if why.startswith("one step in") else f" ({why})")
                       for step, why in judged_why.items())
    missed = f"; not judged, their loss not split micro-batch by micro-batch, as a live run needs: " \
        f"{let_go_text(unsplit)}" if unsplit else ""
    return (f"sampled in your run: {len(judged_why)} of {optimizer_steps} optimizer steps judged, one in {every} and "
            f"every window of a new length (steps {listed or 'none'}){missed}; {ran}, untouched, its dropout "
            f"replayed for the reference{own_time_text(own_seconds or {}, judged_why)}")


def own_time_text(own_seconds: dict[int, float], judged: Mapping[int, Any]) -> str:
    """The sampled check's own time, as a note says it: the median over the steps it let go, and the
    judged steps' (empty where it timed nothing)."""
    let_go = sorted(t for step, t in own_seconds.items() if step not in judged)
    on_judged = [t for step, t in own_seconds.items() if step in judged]
    said = [f"{_duration(statistics.median(let_go))} a step let go (median of {len(let_go)})"] if let_go else []
    if on_judged:
        said.append(f"{_duration(sum(on_judged))} on the {len(on_judged)} judged")
    return f"; its own time: {', '.join(said)}" if said else ""


def _duration(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds >= 1 else f"{1e3 * seconds:.2g} ms"


def checked_every(every: Any, who: str) -> int | None:
    """A sampled check's ``every`` (None: not sampled); AccumcheckError where it is no positive integer."""
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise AccumcheckError(f"{who}: every must be a positive integer, got {every!r}")
    return every


def budget_note(own: OwnDtypeReference | None, model: torch.nn.Module, optimizers: list[Any],
                sampled: bool = False, unsplit: dict[int, str] | None = None) -> str:
    """How a report says what its memory budget chose (and, ``unsplit``, the steps it let go)."""
    if own is None or own.budget is None:
        return ""
    missed = f"; not judged, the probe undecided between two readings of the loss on their rows: " \
        f"{let_go_text(unsplit)}" if unsplit and not sampled else ""
    groups = len(own.groups or ())
    if sampled:
        return (f"memory budget {size_text(own.budget)}: each judged window's reference in {groups} "
                f"group{'s' * (groups != 1)} of tensors")
    return (f"memory budget {size_text(own.budget)}: the float64 check needs "
            f"{size_text(float64_need(model, optimizers))}, so each window's reference is computed in the model's "
            f"own dtype micro-batch by micro-batch and summed in float64, in {groups} group{'s' * (groups != 1)} of "
            "tensors, and judged within the round-off of both dtypes (the bound each step states); the update's "
            f"replay in float64 is off, its counts are kept{missed}")


def tensor_needs(named: list[tuple[str, torch.Tensor]]) -> list[TensorNeed]:
    """What each tensor's group holds beside the run (``run.budget``): its float64 sums while the
    group runs; and at its own moment, one tensor at a time, its micro-gradient while it is added or
    the judge's temporaries of one piece while it is judged, whichever is more."""
    return [TensorNeed(name, math.ceil(p.numel() * SUMS_BYTES * ALLOCATOR),
                       max(gradient_bytes(p), min(p.numel(), pieces.PIECE) * JUDGE_BYTES)) for name, p in named]


def gradient_bytes(p: torch.Tensor) -> int:
    """What a tensor's gradient holds while it is added (``_sums``): itself (a quarter more for the
    allocator), its float32 copy on the host where numpy has no such dtype (``to_numpy``), and one
    piece in float64 for its norm."""
    host = 4 if p.element_size() < 4 else 0
    return math.ceil(p.numel() * (p.element_size() + host) * ALLOCATOR) + min(p.numel(), pieces.PIECE) * 8


class OwnDtypeReference:
    """The windows' references in the model's own dtype, in groups of tensors within ``budget``
    bytes (None: one group), each window judged as it is captured (``judge_window``), so nothing
    of its size is kept. ``accum_steps()`` is the stack's N where the window is judged.

    A window's float64 sums live in one buffer, of the largest group's size, that each group
    writes over in turn: memory the system has just handed over costs a page fault at its first
    touch (more than the sum's own pass over it, measured), so it is taken once a window, not once
    a group. It is let go when the window is judged, so the run's own steps never hold it."""

    def __init__(self, budget: int | None, accum_steps: Callable[[int], int], who: str) -> None:
        self.budget = budget
        self.accum_steps = accum_steps
        self.who = who
        self.groups: list[list[str]] | None = None

    def plan(self, named: list[tuple[str, torch.Tensor]]) -> list[list[str]]:
        """The groups of tensors, planned once; AccumcheckError (one line, the least budget that
        would do) where the largest tensor alone does not fit."""
        if self.groups is None:
            self.groups = plan(tensor_needs(named), self.budget, f"{self.who}: memory_budget")
        return self.groups

    def step(self, window: StackWindow, module: torch.nn.Module, named: list[tuple[str, torch.Tensor]],
             applied_gradient: Callable[[str, Any], torch.Tensor | None], batches: list[Any], plan_: ReferencePlan,
             window_loss: Callable[[Any, Any], Any], join: Callable[[list[Any]], Any], computed: str,
             rng_states: list[Any] | None = None) -> StackStep:
        """The window judged in groups: each group's F and S from the micro-batches (``plan_``'s
        weights), its A read from the stack, judged and dropped before the next group runs."""
        if not plan_.split:
            raise AccumcheckError(f"{self.who}: the window's reference cannot be computed micro-batch by micro-batch "
                                  f"({plan_.note}), and the window as one batch holds all its micro-batches' "
                                  "activations at once, beyond any memory budget or live run; run the check without "
                                  "memory_budget or every (or on fewer micro-batches per window)")
        groups = self.plan(named)
        dtype = _dtype_name(named)
        sizes = {name: p.numel() for name, p in named}
        buffer = np.empty(max((sum(sizes[name] for name in group) for group in groups), default=0))
        steps = []
        for group in groups:
            wanted = set(group)
            params = [(name, p) for name, p in named if name in wanted]
            steps.append(self._group(window, module, params, applied_gradient, batches, plan_, window_loss, join,
                                     computed, rng_states, dtype, buffer))
        del buffer
        note = f"computed in {computed}" + (
            f"; judged in {len(groups)} group{'s' * (len(groups) != 1)} of tensors within the memory budget of "
            f"{size_text(self.budget)}" if self.budget is not None else "")
        return judge_groups(steps, note)

    def _group(self, window: StackWindow, module: torch.nn.Module, params: list[tuple[str, torch.Tensor]],
               applied_gradient: Callable[[str, Any], torch.Tensor | None], batches: list[Any], plan_: ReferencePlan,
               window_loss: Callable[[Any, Any], Any], join: Callable[[list[Any]], Any], computed: str,
               rng_states: list[Any] | None, dtype: str, buffer: np.ndarray) -> StackStep:
        """One group's pass over the window's micro-batches, judged; its sums in ``buffer``, which
        the next group writes over."""
        sums, norms = _sums(window_loss, module, params, batches, plan_.weights, join, rng_states, buffer)
        applied = {name: _host(applied_gradient(name, p), p) for name, p in params}
        part = StackWindow(step=window.step, micro_batches=window.micro_batches, applied=applied, window=sums,
                           item_counts=window.item_counts, predicted_counts=window.predicted_counts,
                           hypotheses=Hypotheses(takes_item_count=window.hypotheses.takes_item_count),
                           world_size=window.world_size,
                           precision=StepPrecision(accumulation=_grad_dtype(params, dtype), reduction=dtype,
                                                   computed=computed, reference=computed),
                           scale_norm=math.sqrt(sum(n * n for n in norms.values())),
                           reference=window.reference, reference_note=window.reference_note)
        return judge_window(part, self.accum_steps(len(window.micro_batches)))


def least_budget(named: list[tuple[str, torch.Tensor]]) -> int:
    """The smallest budget the own-dtype reference fits (``run.budget.minimum``)."""
    return max(minimum(tensor_needs(named)), FIXED_BYTES)


def _sums(window_loss: Callable[[Any, Any], Any], module: torch.nn.Module, params: list[tuple[str, torch.Tensor]],
          batches: list[Any], weights: tuple[float, ...], join: Callable[[list[Any]], Any],
          rng_states: list[Any] | None, buffer: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """F = sum_b w_b grad(loss_b) over ``params``, float64 on the host, and per tensor the sum over
    the micro-batches of ||w_b grad(loss_b)||, a bound on the norm of S = sum_b |w_b grad(loss_b)|.
    ``torch.autograd.grad`` leaves the stack's ``.grad`` as it is; a hook on each tensor (the last
    of its hooks: it sees what the user's own hooks made of the gradient) adds the gradient as the
    backward pass reaches it and hands back a zero without storage, so that a tensor's gradient is
    freed once added and the group never holds all its gradients at once. The sums are views of
    ``buffer`` (float64, flat, at least the group's size), written over: a tensor's first gradient
    of the window is set, not added, and one that gets none is zeroed at the end."""
    sums, at = {}, 0
    for name, p in params:
        sums[name] = buffer[at:at + p.numel()].reshape(tuple(p.shape))
        at += p.numel()
    norms = {name: 0.0 for name, _ in params}
    written: set[str] = set()

    def adding(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        def add(grad: torch.Tensor) -> torch.Tensor:
            got = grad.detach()
            first = name not in written
            written.add(name)
            if got.device.type == "cpu" and got.dtype in (torch.float32, torch.float64) and got.is_contiguous():
                # one compiled pass reads the gradient once for both
                flat = got.numpy().reshape(-1)
                norms[name] += math.sqrt(add_squares(flat, sums[name].reshape(-1), first))
            else:
                if first:
                    sums[name][...] = to_numpy(got)  # each element in float64, exactly
                else:
                    sums[name] += to_numpy(got)  # added into float64 element by element, no copy
                norms[name] += _norm(got)
            return torch.zeros((), dtype=grad.dtype, device=grad.device).expand_as(grad)
        return add

    tensors = [p for _, p in params]
    handles = [p.register_hook(adding(name)) for name, p in params]
    try:
        for i, (batch, w) in enumerate(zip(batches, weights)):
            if rng_states is not None:  # the random draws (dropout) the stack's own pass of this micro-batch made
                _set_rng(rng_states[i])
            found = window_loss(module, join([batch]))
            loss = found[0] if isinstance(found, tuple) else found
            torch.autograd.grad(loss * w, tensors, allow_unused=True)
            del loss, found
    finally:
        for handle in handles:
            handle.remove()
    for name, total in sums.items():
        if name not in written:  # no gradient in any micro-batch: its sum is zero
            total.fill(0.0)
    return sums, norms


def _norm(grad: torch.Tensor) -> float:
    """||grad|| in float64, a piece at a time (torch's float64 norm copies what it reads to float64)."""
    flat = grad.reshape(-1)
    return math.sqrt(sum(float(torch.linalg.vector_norm(flat[lo:lo + pieces.PIECE], dtype=torch.float64)) ** 2
                         for lo in range(0, flat.numel(), pieces.PIECE)))


def rng_state() -> tuple[Any, Any]:
    """torch's random states now (the CPU's, and every CUDA device's where CUDA is in use)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng(state: tuple[Any, Any]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def restore_rng(state: tuple[Any, Any]) -> None:
    """torch's random states set back to ``state`` (``rng_state``)."""
    _set_rng(state)


def _host(grad: torch.Tensor | None, p: torch.Tensor) -> np.ndarray:
    """The applied gradient as it is (a view where it is on the host), float64 only where the judge reads it."""
    return np.zeros(tuple(p.shape)) if grad is None else to_numpy(grad.detach())


def _dtype_name(named: list[tuple[str, torch.Tensor]]) -> str:
    """The least precise floating dtype of the parameters (the one whose round-off bounds the step)."""
    dtypes = {p.dtype for _, p in named if p.is_floating_point()}
    return str(max(dtypes, key=lambda d: torch.finfo(d).eps, default=torch.float32)).removeprefix("torch.")


def _grad_dtype(params: list[tuple[str, torch.Tensor]], fallback: str) -> str:
    dtypes = {p.grad.dtype for _, p in params if p.grad is not None}
    return str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else fallback
