"""One backward pass per micro-step feeds native, manual, E and S together.

Native accumulation is PyTorch's own: ``.grad`` accumulating across ``backward()`` calls. A hook
on each parameter sees the micro-gradient before it is added (leaf-tensor hooks run before
AccumulateGrad); after the backward the step is added into the manual buffer and the float64
sums E and S (on the CPU, eight steps at a time: the micro-gradients themselves held, or flat
copies of them). The two modes see
the very same micro-gradients, and the memory held does not grow with the number of micro-steps.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ..errors import USER_EXCEPTIONS, AccumcheckError
from ..judge.hostsums import add_held, add_step
from ..run.backend import Progress
from ..run.faults import Fault, FaultInjector
from .accumulator import GradAccumulator

# On the CPU, eight micro-steps are held and added in one pass, as long as they take no more than
# HELD_BYTES: eight separate passes would read and write manual, E and S eight times.
HELD_STEPS = 8
HELD_BYTES = 16 * 2**20
# Flat step buffers used in turn where steps are not held in a ring and are handed to ``on_step``:
# each stays as it is for two further steps (one buffer without ``on_step``).
STEP_ROWS = 3
# Rows enough for either way of handing steps on.
ROWS = max(HELD_STEPS, STEP_ROWS)


class StepRecorder:
    """Feeds manual, E and S from the micro-gradients the native path receives.

    During backward the hooks (``hook``) only keep a reference to each parameter's micro-gradient;
    after backward (``flush``) the step goes into flat buffers, instead of three small operations
    per parameter inside the backward. On the CPU in float32, one compiled call adds the steps
    held for every parameter (``hostsums.add_held``): ``HELD_STEPS`` steps at a time where they
    are held. ``hold_refs``: the micro-gradients themselves are held, each parameter's in a list
    its hook appends to (a model of plain operations, whose backward hands out fresh tensors
    nothing writes to later); otherwise each step is copied into a ring of flat rows (a user's
    model, whose custom backward might reuse a gradient's memory). Without holding (``hold_steps``
    False, or a model too large), each step is added as soon as it is complete. Off the host path,
    one concatenation and one fused pass per step (three adds on CUDA). Each element takes the
    same additions in the same order on every path.

    ``on_step`` (data parallel) is handed each step as one flat tensor (a row of the ring, or one
    of ``STEP_ROWS`` step buffers used in turn), which stays as it is until ``STEP_ROWS - 1``
    further steps have been recorded: it may keep the row that long (to send it, or to add it
    once the other ranks' steps arrive) without a copy. ``rows``, when given with ``on_step``,
    is a (``ROWS``, total) tensor the steps handed on are written into (memory another process
    reads: the rows of a rank other than 0, which rank 0 adds from where they are); ``sums``, when
    given, the two flat float64 tensors E and S are summed in."""

    def __init__(self, params: dict[str, Any], accum_dtype: Any = None,
                 on_step: Callable[[Any], None] | None = None, hold_steps: bool = True,
                 hold_refs: bool = False, rows: Any = None, sums: tuple[Any, Any] | None = None) -> None:
        self.params = params
        self.on_step = on_step
        first = next(iter(params.values()))
        total = sum(p.numel() for p in params.values())
        step_dtype = first.dtype
        for p in params.values():  # a model of mixed dtypes: a step buffer that holds each exactly
            step_dtype = torch.promote_types(step_dtype, p.dtype)
        self.manual = torch.zeros(total, dtype=accum_dtype or first.dtype, device=first.device)
        if sums is None:
            self.exact = torch.zeros(total, dtype=torch.float64, device=first.device)
            self.absum = torch.zeros(total, dtype=torch.float64, device=first.device)
        else:  # memory another process reads them from
            self.exact, self.absum = (buffer.zero_() for buffer in sums)
        self.grads: dict[str, Any] = {}
        self.missing: dict[str, int] = {}  # micro-steps in which a parameter received no gradient
        self.ring = self.lists = None
        self.count = 0  # steps held, not yet added
        # (Adding on a second thread beside the next forward was measured slower: torch's threads
        # want both cores.)
        host = (first.device.type == "cpu"
                and self.manual.dtype in (torch.float32, torch.float64)
                and all(p.dtype == torch.float32 for p in params.values()))
        self.holds = host and hold_steps and HELD_STEPS * 4 * total <= HELD_BYTES
        self.host = host
        if host:
            self.spans = np.cumsum([0] + [p.numel() for p in params.values()], dtype=np.int64)
            self.flat = (self.manual.numpy(), self.exact.numpy(), self.absum.numpy())
        if rows is not None and (on_step is None or tuple(rows.shape) != (ROWS, total)
                                 or rows.dtype != (torch.float32 if self.holds else step_dtype)):
            raise ValueError(f"rows: a ({ROWS}, {total}) tensor of the step's dtype, handed on to on_step")
        if self.holds and hold_refs and on_step is None:
            self.lists = [[] for _ in params]  # each parameter's micro-gradients held, in step order
            self.index = {name: index for index, name in enumerate(params)}
            # The list lengths after each step with every parameter's gradient there.
            self.full = [[count] * len(params) for count in range(HELD_STEPS + 1)]
        elif self.holds:
            self.ring = torch.empty((HELD_STEPS, total), dtype=torch.float32) if rows is None else rows[:HELD_STEPS]
            # Each row as one view per parameter: one foreach copy fills a row (measured faster
            # than torch.cat into it, which copies input by input).
            self.rows = [[self.ring[row, span].view(params[name].shape) for name, span in self._spans()]
                         for row in range(HELD_STEPS)]
            self.ring_addresses = (self.ring.data_ptr() + 4 * (self.spans[:-1, None]
                                   + total * np.arange(HELD_STEPS, dtype=np.int64)))
        elif not host or on_step is not None:
            self.steps = ([torch.empty(total, dtype=step_dtype, device=first.device)
                           for _ in range(STEP_ROWS if on_step is not None else 1)]
                          if rows is None else list(rows[:STEP_ROWS]))
            self.turn = 0

    def hook(self, name: str) -> Callable[[Any], None]:
        """The gradient hook that records ``name``'s micro-gradient: a C-level callable, which
        costs no Python frame inside the backward pass."""
        if self.lists is not None:
            return self.lists[self.index[name]].append
        return functools.partial(self.grads.__setitem__, name)

    def flush(self) -> None:
        """Add the step just finished into manual, E and S (once HELD_STEPS steps are held)."""
        if self.lists is not None:
            self.count += 1
            if list(map(len, self.lists)) != self.full[self.count]:  # a parameter unused in this micro-step
                for (name, p), held in zip(self.params.items(), self.lists):
                    if len(held) < self.count:
                        self.missing[name] = self.missing.get(name, 0) + 1
                        held.append(torch.zeros_like(p))
            if self.count == HELD_STEPS:
                self._add_held()
            return
        grads = self.grads
        if len(grads) < len(self.params):  # a parameter unused in this micro-step
            for name, p in self.params.items():
                if name not in grads:
                    self.missing[name] = self.missing.get(name, 0) + 1
                    grads[name] = torch.zeros_like(p)
        if self.ring is not None:
            torch._foreach_copy_(self.rows[self.count], [grads[name] for name in self.params])
            grads.clear()
            if self.on_step is not None:
                self.on_step(self.ring[self.count])
            self.count += 1
            if self.count == HELD_STEPS:
                self._add_held()
            return
        if self.host and self.on_step is None:
            held = [grads[name].contiguous() for name in self.params]  # itself where contiguous already
            add_held(np.array([[g.data_ptr()] for g in held], np.int64), self.spans, *self.flat)
            grads.clear()
            return
        step = self.steps[self.turn]
        self.turn = (self.turn + 1) % len(self.steps)
        torch.cat([grads[name].reshape(-1) for name in self.params], out=step)
        grads.clear()
        if self.on_step is not None:
            self.on_step(step)
        if step.device.type == "cpu" and step.dtype in (torch.float32, torch.float64) and self.host:
            add_step(step.numpy(), self.manual.numpy(), self.exact.numpy(), self.absum.numpy())
        else:
            self.manual.add_(step)
            self.exact.add_(step)
            # In place where the step is this recorder's alone; a step handed on stays as it is.
            self.absum.add_(step.abs() if self.on_step is not None else step.abs_())

    def _add_held(self) -> None:
        """The steps held, in their order, into manual, E and S: one compiled call."""
        if self.lists is not None:
            # Plain operations hand every backward a fresh gradient that nothing writes to
            # afterwards (the reference also keeps AccumulateGrad from adopting it as .grad).
            held = list(itertools.chain.from_iterable(self.lists))
            if not all(map(torch.Tensor.is_contiguous, held)):
                held = [g.contiguous() for g in held]
            addresses = np.fromiter(map(torch.Tensor.data_ptr, held), np.int64, len(held))
            add_held(addresses.reshape(len(self.lists), -1), self.spans, *self.flat)
            del held
            for steps in self.lists:
                steps.clear()
        else:
            add_held(self.ring_addresses[:, :self.count], self.spans, *self.flat)
        self.count = 0

    def _spans(self) -> Iterator[tuple[str, slice]]:
        offset = 0
        for name, p in self.params.items():
            yield name, slice(offset, offset + p.numel())
            offset += p.numel()

    def buffers(self) -> dict[str, tuple[Any, Any, Any]]:
        """Per-parameter (manual, exact, absum) views of the flat buffers, every step added."""
        if self.count:
            self._add_held()
        return {name: tuple(buf[span].view(self.params[name].shape) for buf in (self.manual, self.exact, self.absum))
                for name, span in self._spans()}


def _inject_into(accumulator: GradAccumulator, index: int, injector: FaultInjector, step: int, param: Any) -> None:
    """Micro-step ``step`` of the faulted parameter into the GradAccumulator's buffer, as the
    fault has it (in the buffer's dtype: a fault on a bfloat16 gradient would round away)."""
    grad = torch.zeros_like(param, dtype=accumulator.dtype) if param.grad is None else param.grad.to(accumulator.dtype)
    param.grad = None
    accumulator.add_to(index, injector.contribution(step, grad, accumulator.total(index) if step else None))
    replaced = injector.after_add(step, accumulator.total(index))
    if replaced is not None:
        accumulator.replace(index, replaced)


def accumulate(params: dict[str, Any], step_loss: Callable[[int], Any], accum_steps: int, fault: Fault | None,
               progress: Progress | None, phase: str, accum_dtype: Any = None, mode: str = "native",
               step_context: Callable[[int], Any] | None = None,
               on_step: Callable[[Any], None] | None = None, hold_steps: bool = True,
               hold_refs: bool = False, step_rows: Any = None, sums: tuple[Any, Any] | None = None,
               backward_error: Callable[[BaseException, int], Exception] | None = None) -> dict[str, Any]:
    """Run ``step_loss(step).backward()`` for each micro-step, letting ``.grad`` accumulate
    natively while the hooks feed manual (in ``accum_dtype``, default the parameters'), E and S.
    ``params`` maps names to leaf parameters, whose ``.grad`` is reset first. ``mode`` picks
    what fills the native slot: "native" (``.grad`` accumulating), "accumulator" or
    "compensated" (GradAccumulator taking each micro-step's ``.grad``).
    ``step_context(step)``, when given, is entered around each micro-step's forward and backward
    (DistributedDataParallel's ``no_sync()``); ``on_step``, when given, is handed each micro-step's
    flat gradient (see StepRecorder), written into ``step_rows`` where given; E and S are summed
    into ``sums`` where given.
    ``hold_steps`` False: nothing kept beyond one micro-step (a memory budget's groups);
    ``hold_refs``: the micro-gradients are held, not copied (a built-in model; see StepRecorder). ``backward_error(exc, step)``, when given, is the
    error raised (from ``exc``) for what a backward pass raised: the user's hooks ran in it.
    Returns {"buffers": name -> (manual, exact, absum), "flat": the same three as flat tensors,
    parameters in order, "native": name -> accumulated .grad,
    "loss": mean loss, "losses": each micro-step's loss, "steps_with_grad": name -> micro-steps with
    a gradient, for the parameters that missed some}."""
    recorder = StepRecorder(params, accum_dtype, on_step, hold_steps, hold_refs, step_rows, sums)
    handles = []
    state = {"step": 0}
    injector = None
    if fault is not None:
        injector = FaultInjector(fault, accum_steps, lambda t: t.to(torch.bfloat16).to(t.dtype))
    accumulator = None
    if mode != "native":
        accumulator = GradAccumulator(params.values(), compensated=mode == "compensated")
    target = list(params).index(fault.param) if fault is not None else -1

    for name, param in params.items():
        param.grad = None
        # With a GradAccumulator the fault acts on its float32 buffer (below), not on .grad.
        if injector is None or fault.param != name or accumulator is not None:
            handles.append(param.register_hook(recorder.hook(name)))
            continue

        record = recorder.hook(name)

        def inject(grad: Any, param: Any = param, record: Any = record) -> Any:
            # A copy: the native path may adopt ``grad`` as .grad, and the bf16 fault rounds that.
            record(grad.clone())
            return injector.contribution(state["step"], grad, param.grad)

        handles.append(param.register_hook(inject))
        if fault.kind == "bf16":
            def round_total(p: Any) -> None:
                replaced = injector.after_add(state["step"], p.grad)
                if replaced is not None:
                    p.grad.copy_(replaced)

            handles.append(param.register_post_accumulate_grad_hook(round_total))

    first = next(iter(params.values()))
    loss_sum = torch.zeros((), dtype=torch.float64, device=first.device)
    losses = None
    try:
        for step in range(accum_steps):
            state["step"] = step
            with step_context(step) if step_context is not None else contextlib.nullcontext():
                loss = step_loss(step)
                try:
                    loss.backward()
                except AccumcheckError:
                    raise
                except USER_EXCEPTIONS as exc:
                    if backward_error is None:
                        raise
                    raise backward_error(exc, step) from exc
            recorder.flush()
            if accumulator is not None:
                if injector is not None:
                    _inject_into(accumulator, target, injector, step, params[fault.param])
                accumulator.add()
            loss_sum += loss.detach()
            if losses is None:  # one tensor for every step's loss: no device sync, nothing kept alive
                losses = torch.empty(accum_steps, dtype=loss.dtype, device=loss.device)
            losses[step] = loss.detach()
            if progress is not None:
                progress(phase, step + 1, accum_steps)
    finally:
        for handle in handles:
            handle.remove()
    if accumulator is not None:
        native = dict(zip(params, accumulator.totals()))
    else:
        native = {name: (p.grad if p.grad is not None else torch.zeros_like(p)) for name, p in params.items()}
    buffers = recorder.buffers()
    return {"buffers": buffers, "flat": (recorder.manual, recorder.exact, recorder.absum), "native": native,
            "loss": float(loss_sum) / accum_steps,
            "losses": [] if losses is None else losses.tolist(),
            "steps_with_grad": {name: accum_steps - missed for name, missed in recorder.missing.items()}}
