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
Several contexts (data parallel in one process): record each micro-batch whole, before
``split_and_load``; the applied gradient is every context's gradient summed, as the kvstore (or
``allreduce_grads``) sums them, and the reference runs on the first context. The float64 run uses a
kvstore of its own, of the Trainer's kind, initialised from the float64 copies (with
``update_on_kvstore``, its optimizer states copied from the Trainer's kvstore); the Trainer's own
kvstore is set aside untouched and comes back afterwards. Refused in one line: a distributed
kvstore (``dist_*``), row_sparse weights or gradients, deferred initialisation. Supported:
``trainer.step`` (a loop that calls ``allreduce_grads()`` and ``update()`` itself is not captured).

A loop that judged nothing does not pass: ``report`` raises NothingJudgedError where no micro-batch
was recorded (the loop never called ``check.record``, or the block ran no loop), and
AccumcheckError where ``trainer.step`` ran with no micro-batch recorded since the step before and
the report would otherwise pass.
"""

from __future__ import annotations

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

    from ..mxnet.casemodel import build_block
    from ..mxnet.library import mx
    from ..mxnet.stepwatch import GluonStepWatch
    from ..mxnet.trainerstate import DTYPE, Float64Run
except ModuleNotFoundError as exc:
    raise missing(__name__, exc, "MXNet", "pip install 'accumcheck[mxnet]'") from None

FAULTS = ("step-per-micro-batch", "loss-over-n", "step-per-context-batch")


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
        self._layout: str | None = None  # the contexts and kvstore note, where there is more than one device
        self._state: Float64Run | None = None
        self._finished = False

    @property
    def done(self) -> bool:
        """True once ``steps`` optimizer steps were checked: the loop may stop."""
        return self.steps is not None and len(self.windows) >= self.steps

    def __enter__(self) -> AccumulationCheck:
        if self._state is not None:
            raise AccumcheckError("AccumulationCheck: this check is already active; use one `with check:` at a time")
        self._state = Float64Run(self.net, self.trainer)
        self._layout = self._state.layout()
        self._state.enter()
        self._original_step = self.trainer.__dict__.get("step")
        step = self.trainer.step

        self._watch = GluonStepWatch(self.trainer, self._state.trained)

        def checked_step(batch_size: int, ignore_stale_grad: bool = False) -> Any:
            if self.done:
                return step(batch_size, ignore_stale_grad)
            captured = bool(self._pending)
            if captured:
                self._capture(batch_size)
            else:
                self.unrecorded.append(self.optimizer_steps)
            self.optimizer_steps += 1
            self._watch.handed(batch_size)
            found = step(batch_size, ignore_stale_grad)
            update = self._watch.stepped()
            if captured:
                self.windows[-1].update = update
            return found

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
            self._watch.micro_batch()
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
        if self._layout is not None:
            notes.append(self._layout)
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
        # Summed over the contexts as the kvstore (or Trainer.allreduce_grads) sums them before the update.
        applied = {p.name: sum(g.asnumpy().astype(np.float64) for g in p.list_grad()) * scale for p in params}
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
            full = {p.name: p.grad(self._state.ctx).asnumpy().astype(np.float64) / total for p in params}
        counts = [int(b[0].shape[0]) for b in batches] if self._per_sample else None
        self.windows.append(StackWindow(step=len(self.windows), micro_batches=indices, applied=applied, window=full,
                                        item_counts=counts, contexts=len(self._state.contexts)))


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


def run_case(case: Any, accum_steps: int, batches: int | None = None, fault: str | None = None,
             world_size: int = 1) -> StackReport:
    """A built-in case (or a Case, or a case file) through a plain Gluon loop under
    AccumulationCheck: ``batches`` micro-batches (default 2N + 2, so the last window is short and
    stepped with ``trainer.step(k * b)``), ``grad_req='add'``, sgd. ``world_size`` > 1: the net on
    that many CPU contexts, each micro-batch split across them (``split_and_load``) and the
    gradients summed by a kvstore 'local', in this one process. ``fault``: None,
    "step-per-micro-batch" (``trainer.step(b)`` instead of ``N * b``), "loss-over-n" (the loss
    divided by N as well) or, with several contexts, "step-per-context-batch" (``trainer.step``
    given one context's share of the window's samples). Returns the StackReport; raises
    AccumcheckError for bad input."""
    if fault is not None and fault not in FAULTS:
        raise AccumcheckError(f"run_case: unknown fault {fault!r}; choose one of {', '.join(FAULTS)} (or None)")
    n = accum_steps
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise AccumcheckError(f"run_case: accum_steps must be a whole number >= 1, got {n!r}")
    total = 2 * n + 2 if batches is None else batches
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise AccumcheckError(f"run_case: batches must be a whole number >= 1, got {batches!r}")
    if fault == "step-per-context-batch" and world_size < 2:
        raise AccumcheckError("--fault step-per-context-batch: needs several contexts; add --world-size 2")
    case = resolve_case(case)
    if case.conditional_layers():
        raise AccumcheckError(f"run_case: case {case.name!r} routes each micro-batch through its own branches, "
                              "so its window has no single batch to compare with; choose a case without "
                              "conditional layers")
    b = case.input.batch_size
    if world_size > b:
        raise AccumcheckError(f"--world-size {world_size}: case {case.name!r} has micro-batches of {b} samples, too "
                              f"few to split across {world_size} contexts; use --world-size {b} or less")
    contexts = [mx.cpu(i) for i in range(world_size)]
    net = build_block(case, case.weights(), "float32", contexts[0])
    if world_size > 1:
        net.collect_params().reset_ctx(contexts)
    net.hybridize()
    for param in net.collect_params().values():
        param.grad_req = "add"
    trainer = mx.gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                               kvstore="local" if world_size > 1 else "device")
    loss_fn = case_loss_fn(case)
    check = AccumulationCheck(net, trainer, loss_fn, accum_steps=n)
    with check:
        for i in range(total):
            batch = case.batch(i)
            x, y = check.record(batch.inputs, batch.labels)
            shards = zip(mx.gluon.utils.split_and_load(x, contexts, even_split=False),
                         mx.gluon.utils.split_and_load(y, contexts, even_split=False))
            with autograd.record():
                losses = [loss_fn(net(xs), ys) / (n if fault == "loss-over-n" else 1) for xs, ys in shards]
            autograd.backward(losses)
            if (i + 1) % n == 0 or i == total - 1:
                samples = (i % n + 1) * b
                trainer.step({"step-per-micro-batch": b, "step-per-context-batch": samples / world_size}.get(
                    fault, samples))
                net.collect_params().zero_grad()
    report = check._build_report(f"{case.name} (built-in case)",
                                 reproduce=stack_command("gluon", case.name, n, batches, fault, world_size))
    report.micro_batches_expected = total
    return report
