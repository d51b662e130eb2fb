"""The Gluon ``Trainer`` under the training stack check: at each ``trainer.step(batch_size)`` of a
user's own loop (``grad_req='add'``), the gradient the optimizer is about to apply against the
gradient of the same window's micro-batches as one batch.

    check = AccumulationCheck(net, trainer, loss_fn)
    with check:
        for i, (x, y) in enumerate(batches):
            x, y = check.record(x, y)              # the micro-batch, in float64
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            if (i + 1) % N == 0 or i == len(batches) - 1:
                trainer.step(N * b)                # captured here
                net.collect_params().zero_grad()
    print(check.report.summary())

The applied gradient is each parameter's accumulated gradient times the rescale the step applies,
``rescale_grad / batch_size`` (so ``trainer.step(b)`` where ``N * b`` samples ran is an N times
too large update, not a detail of the optimizer). The reference runs the same parameters on the
window's micro-batches concatenated along axis 0: for a per-sample loss (Gluon's losses return
shape (batch,)) the gradient of its sum over the window divided by the window's samples, for a
scalar loss the gradient of the window's loss itself. Everything runs in float64 (parameters,
gradients, the recorded micro-batches, optimizer states), so the two agree to ~1e-15 of their
scale when the loop computes what one batch would.

Afterwards the block and the Trainer are as found, also when the loop raises: the very parameter
and gradient arrays (the float64 run works on copies), dtypes, ``grad_req``, auxiliary states,
Dropout rates, the optimizer's states, update counts and learning-rate schedule, ``trainer.step``.
Supported: one context and no kvstore (a Trainer on one device), ``trainer.step`` (a loop that
calls ``allreduce_grads()`` and ``update()`` itself is not captured), no deferred initialisation.

A loop that judged nothing does not pass: ``report`` raises NothingJudgedError where no micro-batch
was recorded (the loop never called ``check.record``, or the block ran no loop), and
AccumcheckError where ``trainer.step`` ran with no micro-batch recorded since the step before and
the report would otherwise pass.
"""

from __future__ import annotations

import copy
import random
from typing import Any, Callable

import numpy as np

from ..case.definition import IGNORE_LABEL
from ..case.reading import resolve_case
from ..errors import AccumcheckError, NothingJudgedError
from ..judge.stack import Coverage, stack_report
from ..options.spec import stack_command
from ..report import StackReport
from ..run.results import StackWindow
from . import missing

try:
    from mxnet import autograd

    from ..mxnet.blockstate import AuxState, clear_cached_ops, layers_for_check, unique_params
    from ..mxnet.casemodel import build_block
    from ..mxnet.library import mx
except ModuleNotFoundError as exc:
    raise missing(__name__, exc, "MXNet", "pip install 'accumcheck[mxnet]'") from None

FAULTS = ("step-per-micro-batch", "loss-over-n")
DTYPE = "float64"


class AccumulationCheck:
    """Checks every optimizer step a Gluon loop takes inside ``with check:``; ``report`` is the
    StackReport afterwards.

    ``net``: the initialised gluon.Block the loop trains; ``trainer``: its gluon.Trainer;
    ``loss_fn(output, label)``: the loop's loss (None: ``net(*inputs)`` returns the loss itself).
    ``steps=K`` checks the first K optimizer steps only: ``done`` is then True, ``record`` hands
    micro-batches back (still in float64) without recording them, and the rest of the run is
    not counted. ``accum_steps``: N, the window the loop means (default: the first window's size).
    A ``trainer.step`` with no micro-batch recorded since the last one is not checked: the report
    then never passes (NothingJudgedError where nothing at all was recorded). Raises
    AccumcheckError for bad arguments, at construction."""

    def __init__(self, net: Any, trainer: Any, loss_fn: Callable[..., Any] | None = None, *,
                 steps: int | None = None, accum_steps: int | None = None) -> None:
        if not isinstance(net, mx.gluon.Block):
            raise AccumcheckError(f"AccumulationCheck: net must be a gluon.Block, got a {type(net).__name__}; "
                                  "pass the network the loop trains")
        if not isinstance(trainer, mx.gluon.Trainer):
            raise AccumcheckError(f"AccumulationCheck: trainer must be a gluon.Trainer, got a "
                                  f"{type(trainer).__name__}; pass the Trainer whose step() the loop calls")
        if loss_fn is not None and not callable(loss_fn):
            raise AccumcheckError(f"AccumulationCheck: loss_fn must be callable, got a {type(loss_fn).__name__}")
        for name, value in (("steps", steps), ("accum_steps", accum_steps)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise AccumcheckError(f"AccumulationCheck: {name} must be a whole number >= 1, got {value!r}")
        self.net, self.trainer, self.loss_fn = net, trainer, loss_fn
        self.steps, self.accum_steps = steps, accum_steps
        self.windows: list[StackWindow] = []
        self.seen = 0  # micro-batches recorded
        self.optimizer_steps = 0  # trainer.step calls before ``done``
        self.unrecorded: list[int] = []  # of those, the ones with no micro-batch recorded since the step before
        self._pending: list[tuple[int, list[Any]]] = []
        self._per_sample: bool | None = None
        self._state: _Float64Run | None = None
        self._finished = False

    @property
    def done(self) -> bool:
        """True once ``steps`` optimizer steps were checked: the loop may stop."""
        return self.steps is not None and len(self.windows) >= self.steps

    def __enter__(self) -> AccumulationCheck:
        if self._state is not None:
            raise AccumcheckError("AccumulationCheck: this check is already active; use one `with check:` at a time")
        self._state = _Float64Run(self.net, self.trainer)
        self._state.enter()
        self._original_step = self.trainer.__dict__.get("step")
        step = self.trainer.step

        def checked_step(batch_size: int, ignore_stale_grad: bool = False) -> Any:
            if not self.done:
                if self._pending:
                    self._capture(batch_size)
                else:
                    self.unrecorded.append(self.optimizer_steps)
                self.optimizer_steps += 1
            return step(batch_size, ignore_stale_grad)

        self.trainer.step = checked_step
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._original_step is None:
                self.trainer.__dict__.pop("step", None)
            else:
                self.trainer.step = self._original_step
        finally:
            self._state.exit()
            self._state = None
            self._finished = True

    def record(self, *arrays: Any) -> Any:
        """Records one micro-batch (``x, y`` for ``loss_fn(net(x), y)``; the inputs alone without
        loss_fn) and returns it as float64 NDArrays on the net's context, one value per argument
        (a single argument comes back alone). Integer NDArrays are kept as they are."""
        if self._state is None:
            raise AccumcheckError("AccumulationCheck: record() was called outside `with check:`; record the "
                                  "micro-batches inside the with block, where the net runs in float64")
        if not arrays:
            raise AccumcheckError("AccumulationCheck: record() needs the micro-batch, e.g. x, y = check.record(x, y)")
        values = [_wide(a, self._state.ctx, i) for i, a in enumerate(arrays)]
        if not self.done:
            self._pending.append((self.seen, [v.copy() for v in values]))
            self.seen += 1
        return values[0] if len(values) == 1 else tuple(values)

    @property
    def report(self) -> StackReport:
        """The StackReport of the checked run (after the with block)."""
        return self._build_report(type(self.net).__name__)

    def _build_report(self, model: str, reproduce: str = "") -> StackReport:
        if not self._finished:
            raise NothingJudgedError("gluon.AccumulationCheck: no report yet; run the loop inside `with check:` first")
        n = self.accum_steps or (len(self.windows[0].micro_batches) if self.windows else 1)
        notes = ["ran in float64: parameters, gradients, recorded micro-batches and optimizer states",
                 "trainer.step's rescale (rescale_grad / batch_size) judged as part of the applied gradient",
                 "dropout off, BatchNorm on its running statistics",
                 "reference: " + ("a per-sample loss summed over the window's samples and divided by their number"
                                  if self._per_sample is not False else "the scalar loss of the window as one batch"),
                 "parameters, gradients, optimizer states and Python's and NumPy's random states restored "
                 "afterwards"]
        if self.steps is not None:
            notes.append(f"checked the first {self.steps} optimizer step{'s' * (self.steps != 1)} only")
        record = "x, y = check.record(x, y)" if self.loss_fn is not None else "x = check.record(x)"
        coverage = Coverage(who="gluon.AccumulationCheck", feed="check.record", fix=f"record every micro-batch "
                            f"before its forward pass: `{record}`", idle="the with block",
                            idle_fix=f"run the training loop inside `with check:`, recording each micro-batch "
                                     f"(`{record}`) and calling trainer.step once per window",
                            optimizer_steps=self.optimizer_steps, unrecorded=list(self.unrecorded))
        return stack_report("gluon", model, n, self.windows, self.seen, {"mxnet": mx.__version__}, notes,
                            reproduce=reproduce, coverage=coverage)

    def _capture(self, batch_size: int) -> None:
        """The window's applied gradient and its gradient as one batch; the loop's gradients as
        they were afterwards."""
        params = self._state.trained
        scale = self.trainer._scale / batch_size  # what Trainer.step makes the optimizer's rescale_grad
        applied = {p.name: p.grad().asnumpy().astype(np.float64) * scale for p in params}
        window, self._pending = self._pending, []
        indices, batches = [i for i, _ in window], [b for _, b in window]
        joined = [mx.nd.concat(*parts, dim=0) if parts[0].ndim else parts[0] for parts in zip(*batches)]
        with self._state.loop_kept():
            for p in self._state.with_grad:
                p.zero_grad()
            with autograd.record():
                out = self.net(*(joined[:-1] if self.loss_fn is not None else joined))
                loss = self.loss_fn(out, joined[-1]) if self.loss_fn is not None else out
            if not isinstance(loss, mx.nd.NDArray):
                raise AccumcheckError(f"AccumulationCheck: the loss is a {type(loss).__name__}, not an NDArray; "
                                      "pass loss_fn(output, label) returning the loss NDArray")
            self._per_sample = loss.size > 1
            loss.backward()
            total = loss.shape[0] if self._per_sample else 1
            full = {p.name: p.grad().asnumpy().astype(np.float64) / total for p in params}
        counts = [int(b[0].shape[0]) for b in batches] if self._per_sample else None
        self.windows.append(StackWindow(step=len(self.windows), micro_batches=indices, applied=applied, window=full,
                                        item_counts=counts))


class _Float64Run:
    """The net and the Trainer in float64 between ``enter`` and ``exit``, and put back as found."""

    def __init__(self, net: Any, trainer: Any) -> None:
        params, _ = unique_params(net)
        deferred = [name for name, p in params.items() if p._data is None]
        if deferred:
            raise AccumcheckError(f"AccumulationCheck: parameter {deferred[0]!r} is not initialised yet (deferred "
                                  "initialisation); call net.initialize() and run one forward pass before the check")
        contexts = {str(c) for p in params.values() for c in p.list_ctx()}
        if len(contexts) != 1 or len(trainer._contexts) != 1 or _uses_kvstore(trainer):
            raise AccumcheckError("AccumulationCheck: the net or trainer spans several contexts or a kvstore; "
                                  "the check supports a Trainer on one device (kvstore='device' or None)")
        ours = {id(p) for p in params.values()}
        strangers = [p.name for p in trainer._params if id(p) not in ours]
        if strangers:
            raise AccumcheckError(f"AccumulationCheck: the trainer updates {strangers[0]!r}, which is not a parameter "
                                  "of net; pass the net whose parameters the trainer holds")
        self.net, self.trainer, self.params = net, trainer, list(params.values())
        self.ctx = self.params[0].list_ctx()[0]
        self.trained = [p for p in trainer._params if p.grad_req != "null"]
        self.with_grad = [p for p in self.params if p.grad_req != "null"]

    def enter(self) -> None:
        self.random_states = random.getstate(), np.random.get_state()  # the loop's draws are undone on exit
        self.saved = [(p, p._data, p._grad, p._dtype) for p in self.params]
        self.optimizer = _OptimizerState(self.trainer, self.params)
        self.layers = layers_for_check(self.net, train_mode=False)
        self.layers.__enter__()
        try:
            self.net.cast(DTYPE)
            for p in self.params:  # a Parameter outside the net's children is cast too (shared ones)
                if np.dtype(p.dtype) != np.float64:
                    p.cast(DTYPE)
            self.optimizer.widen()
        except BaseException:
            self.exit()
            raise

    def exit(self) -> None:
        try:
            for p, data, grad, dtype in self.saved:
                p._data, p._grad, p._dtype = data, grad, dtype
                if grad is not None:
                    autograd.mark_variables(data, grad, p.grad_req)
            self.optimizer.restore()
        finally:
            self.layers.__exit__(None, None, None)
            clear_cached_ops(self.net)
            random.setstate(self.random_states[0])
            np.random.set_state(self.random_states[1])

    def loop_kept(self) -> _LoopKept:
        """Around the reference pass: the loop's gradients, fresh-gradient flags and auxiliary
        states as they were."""
        return _LoopKept(self.params)


class _LoopKept:
    def __init__(self, params: list[Any]) -> None:
        self.params = params

    def __enter__(self) -> None:
        self.grads = [(p, [g.copy() for g in p.list_grad()]) for p in self.params if p.grad_req != "null"]
        self.aux = AuxState({p.name: p for p in self.params if p.grad_req == "null"})
        self.fresh = [(d, d._fresh_grad) for p in self.params if p.grad_req != "null" for d in p.list_data()]

    def __exit__(self, *exc: object) -> None:
        for p, values in self.grads:
            for target, value in zip(p.list_grad(), values):
                target[:] = value
        self.aux.restore()
        for data, fresh in self.fresh:
            data._fresh_grad = fresh


class _OptimizerState:
    """The Trainer's optimizer as found: its attributes, update counts, learning-rate schedule,
    each updater's states (float64 copies during the run) and the Trainer's kvstore bookkeeping."""

    TRAINER_FIELDS = ("_kv_initialized", "_kvstore", "_update_on_kvstore", "_distributed", "_params_to_init")

    def __init__(self, trainer: Any, params: list[Any]) -> None:
        self.trainer = trainer
        self.opt = opt = trainer._optimizer
        self.fields = dict(vars(opt))
        self.counts = {device: dict(counts) for device, counts in opt._all_index_update_counts.items()}
        self.schedule = copy.deepcopy(vars(opt.lr_scheduler)) if opt.lr_scheduler is not None else None
        self.updaters = [(u, u.states, u.states_synced) for u in trainer._updaters]
        self.trainer_fields = {f: copy.copy(getattr(trainer, f)) for f in self.TRAINER_FIELDS}
        self.half = {i for i, p in enumerate(trainer._params) if np.dtype(p.dtype) == np.float16}

    def widen(self) -> None:
        """Each updater gets float64 copies of its states (the originals stay untouched)."""
        for updater, states, synced in self.updaters:
            master = self.opt.multi_precision
            updater.states = {i: _wide_state(s[1] if master and i in self.half and isinstance(s, tuple) else s)
                              for i, s in states.items()}
            updater.states_synced = dict(synced)

    def restore(self) -> None:
        opt = self.opt
        vars(opt).clear()
        vars(opt).update(self.fields)
        every = opt._all_index_update_counts  # device -> {index: count}; _index_update_count is one of them
        for device in [d for d in every if d not in self.counts]:
            del every[device]
        for device, saved in self.counts.items():
            every[device].clear()
            every[device].update(saved)
        if self.schedule is not None:
            vars(opt.lr_scheduler).clear()
            vars(opt.lr_scheduler).update(self.schedule)
        for updater, states, synced in self.updaters:
            updater.states, updater.states_synced = states, synced
        for name, value in self.trainer_fields.items():
            setattr(self.trainer, name, value)


def _uses_kvstore(trainer: Any) -> bool:
    if trainer._kv_initialized:
        return trainer._kvstore is not None
    kind = trainer._kvstore_params["kvstore"]
    return kind is not None and (not isinstance(kind, str) or "dist" in kind)


def _wide_state(state: Any) -> Any:
    if isinstance(state, mx.nd.NDArray):
        return state.astype(DTYPE) if np.issubdtype(state.dtype, np.floating) else state.copy()
    if isinstance(state, (tuple, list)):
        return type(state)(_wide_state(s) for s in state)
    return state


def _wide(value: Any, ctx: Any, position: int) -> Any:
    """A recorded array as a float64 NDArray on ``ctx`` (an integer NDArray keeps its dtype)."""
    if isinstance(value, np.ndarray):
        return mx.nd.array(value, ctx=ctx, dtype=DTYPE)
    if isinstance(value, mx.nd.NDArray):
        floating = np.issubdtype(value.dtype, np.floating)
        return value.as_in_context(ctx).astype(DTYPE if floating else value.dtype, copy=True)
    raise AccumcheckError(f"AccumulationCheck: record() argument {position + 1} is a {type(value).__name__}; "
                          "pass NDArrays or numpy arrays, e.g. x, y = check.record(x, y)")


# ----------------------------------------------------------------------------- a built-in case


def case_loss_fn(case: Any) -> Callable[[Any, Any], Any]:
    """The case's loss as a Gluon user writes it: softmax cross-entropy with padding (-100)
    ignored through a 0/1 sample weight, per sample (shape (batch,)) as Gluon's losses return
    it. Per sample, the trainer's ``step(samples)`` is the normalisation: for padded-tokens each
    sequence's loss is its summed token losses over its 16 positions, and the reference is the
    mean of that over the window's sequences. That is the window as one batch for this loss; it
    is not the mean over the window's labelled tokens (the case's own "mean"), which a Gluon loop
    gets only from a scalar loss divided by the window's token count."""
    del case  # every case's loss is softmax cross-entropy over its last axis
    ce = mx.gluon.loss.SoftmaxCrossEntropyLoss(axis=-1)

    def loss_fn(out: Any, labels: Any) -> Any:
        kept = (labels != IGNORE_LABEL).expand_dims(-1)
        return ce(out, mx.nd.maximum(labels, 0), kept)

    return loss_fn


def run_case(case: Any, accum_steps: int, batches: int | None = None, fault: str | None = None) -> StackReport:
    """A built-in case (or a Case, or a case file) through a plain Gluon loop under
    AccumulationCheck: ``batches`` micro-batches (default 2N + 2, so the last window is short and
    stepped with ``trainer.step(k * b)``), ``grad_req='add'``, sgd. ``fault``: None,
    "step-per-micro-batch" (``trainer.step(b)`` instead of ``N * b``) or "loss-over-n" (the
    loss divided by N as well). Returns the StackReport; raises AccumcheckError for bad input."""
    if fault is not None and fault not in FAULTS:
        raise AccumcheckError(f"run_case: unknown fault {fault!r}; choose one of {', '.join(FAULTS)} (or None)")
    n = accum_steps
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise AccumcheckError(f"run_case: accum_steps must be a whole number >= 1, got {n!r}")
    total = 2 * n + 2 if batches is None else batches
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise AccumcheckError(f"run_case: batches must be a whole number >= 1, got {batches!r}")
    case = resolve_case(case)
    if case.conditional_layers():
        raise AccumcheckError(f"run_case: case {case.name!r} routes each micro-batch through its own branches, "
                              "so its window has no single batch to compare with; choose a case without "
                              "conditional layers")
    net = build_block(case, case.weights(), "float32", mx.cpu())
    net.hybridize()
    for param in net.collect_params().values():
        param.grad_req = "add"
    trainer = mx.gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    loss_fn = case_loss_fn(case)
    b = case.input.batch_size
    check = AccumulationCheck(net, trainer, loss_fn, accum_steps=n)
    with check:
        for i in range(total):
            batch = case.batch(i)
            x, y = check.record(batch.inputs, batch.labels)
            with autograd.record():
                loss = loss_fn(net(x), y)
                if fault == "loss-over-n":
                    loss = loss / n
            loss.backward()
            if (i + 1) % n == 0 or i == total - 1:
                trainer.step(b if fault == "step-per-micro-batch" else (i % n + 1) * b)
                net.collect_params().zero_grad()
    report = check._build_report(f"{case.name} (built-in case)", reproduce=stack_command("gluon", case.name, n, batches,
                                                                                           fault))
    report.micro_batches_expected = total
    return report
