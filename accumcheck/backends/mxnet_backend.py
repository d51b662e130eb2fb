"""MXNet Gluon backend: ``grad_req='add'`` against ``grad_req='write'`` plus a buffer.

MXNet cannot give both modes from one backward pass: the mode is a property of the parameter. So
the case runs twice from the same weights and batches: the native pass with ``grad_req='add'``
(gradients zeroed once, then N micro-steps), the manual pass with ``grad_req='write'`` where each
micro-step's ``p.grad()`` is added into a buffer (``acc[:] += p.grad()``, as users write it) and
into the float64 sums E and S. Both passes are hybridized (``static_alloc=True``, as in the
original bug reports) unless asked not to be.

With ``grad_req='add'`` MXNet's backward kernels write into the gradient with ``kAddTo``: the
embedding backward, for one, adds each token's row straight into the running total, so a
micro-step's inner terms are rounded at their own scale, which cancellation can make far larger
than the micro-gradient. The native bound carries a kernel allowance of KERNEL_ALLOWANCE units
of u at the tensor's scale for that (``bounds.ModeBound``); the largest need measured on the
built-in cases was 0.94 (embed-attention's embedding at N = 2).
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Iterator

import numpy as np

from ..cases import IGNORE_LABEL, LAYERNORM_EPS, Case, Layer
from ..errors import AccumcheckError
from ..faults import Fault, FaultInjector, round_to_bfloat16
from ..kernels import add_step
from .base import Backend, ParamAccumulation, Progress, RunResult

KERNEL_ALLOWANCE = 4.0


def _mx() -> Any:
    # MXNet logs a line for every storage fallback unless told not to, before it is imported.
    os.environ.setdefault("MXNET_STORAGE_FALLBACK_LOG_VERBOSE", "0")
    os.environ.setdefault("MXNET_SUBGRAPH_VERBOSE", "0")
    import mxnet

    return mxnet


def resolve_context(device: str) -> Any:
    """An mx.Context for "cpu", "gpu", "cuda" or "cuda:N"/"gpu:N"; AccumcheckError if unavailable."""
    mx = _mx()
    if device == "cpu":
        return mx.cpu()
    kind, _, index = device.partition(":")
    if kind not in ("gpu", "cuda") or (index and not index.isdigit()):
        raise AccumcheckError(f"--device: unknown device {device!r}; use cpu, gpu, cuda or cuda:N")
    gpus = mx.context.num_gpus()
    if gpus == 0:
        raise AccumcheckError(f"--device {device}: MXNet {mx.__version__} sees no GPU "
                              "(mx.context.num_gpus() is 0); use --device cpu or a CUDA build of mxnet")
    number = int(index or 0)
    if number >= gpus:
        raise AccumcheckError(f"--device {device}: only {gpus} GPU(s) present")
    return mx.gpu(number)


def _sanitize(name: str) -> str:
    return name.replace(".", "__")


def build_block(case: Case, weights: dict[str, np.ndarray], dtype: str, ctx: Any) -> Any:
    """The case as a Gluon HybridBlock holding ``weights``; ``canonical`` maps names to Parameters."""
    mx = _mx()
    from mxnet import gluon

    shapes = {p.name: p.shape for p in case.parameters()}

    class CaseBlock(gluon.HybridBlock):
        def __init__(self) -> None:
            super().__init__(prefix="case_")
            self.canonical: dict[str, Any] = {}
            with self.name_scope():
                for name, value in weights.items():
                    param = self.params.get(_sanitize(name), shape=value.shape, dtype=dtype, init=mx.init.Zero())
                    # Gluon passes a parameter to hybrid_forward under its attribute name.
                    setattr(self, _sanitize(name), param)
                    self.canonical[name] = param

        def hybrid_forward(self, F: Any, x: Any, *gates: Any, **params: Any) -> Any:
            named = {name: params[_sanitize(name)] for name in self.canonical}
            return _forward(F, case.layers, x, named, "", case, shapes, gates[0] if gates else None, [0])

    block = CaseBlock()
    block.initialize(ctx=ctx)
    for name, param in block.canonical.items():
        param.set_data(mx.nd.array(weights[name], ctx=ctx, dtype=dtype))
    return block


def _forward(F: Any, layers: tuple[Layer, ...], x: Any, params: dict[str, Any], prefix: str,
             case: Case, shapes: dict[str, tuple[int, ...]], gates: Any = None, branch: list[int] | None = None) -> Any:
    # Widths come from the case: under hybridize the parameters are symbols without shapes.
    def dense(x: Any, weight: str, bias: str) -> Any:
        units = shapes[weight][0]
        if bias not in params:
            return F.FullyConnected(x, params[weight], num_hidden=units, no_bias=True, flatten=False)
        return F.FullyConnected(x, params[weight], params[bias], num_hidden=units, flatten=False)

    for layer in layers:
        name, o = prefix + layer.name, layer.options
        if layer.type == "embedding":
            x = F.Embedding(x, params[f"{name}.weight"], input_dim=case.input.vocab, output_dim=o["dim"])
        elif layer.type == "dense":
            x = dense(x, f"{name}.weight", f"{name}.bias")
        elif layer.type == "shared_dense":
            outs = [dense(x * scale, f"{name}.weight", f"{name}.bias") for scale in o["scales"]]
            x = outs[0]
            for out in outs[1:]:
                x = x + out
        elif layer.type == "activation":
            fn = o["fn"]
            x = F.LeakyReLU(x, act_type="gelu") if fn == "gelu" else F.Activation(x, act_type=fn)
        elif layer.type == "layernorm":
            x = F.LayerNorm(x, params[f"{name}.gamma"], params[f"{name}.beta"], axis=-1, eps=LAYERNORM_EPS)
        elif layer.type == "attention":
            x = _attention(F, x, dense, name, o["heads"], o["out_proj"], shapes[f"{name}.q.weight"][0])
        elif layer.type == "residual":
            x = x + _forward(F, layer.body, x, params, prefix, case, shapes, gates, branch)
        elif layer.type == "block":
            x = _forward(F, layer.body, x, params, f"{name}.", case, shapes, gates, branch)
        elif layer.type == "conditional":
            # A hybridized graph cannot branch on data, so the branch is multiplied by its gate
            # (1 or 0, an input): where the gate is 0 its parameters get gradients of exactly 0.
            which = branch[0]
            branch[0] += 1
            body = _forward(F, layer.body, x, params, f"{name}.", case, shapes, gates, branch)
            gate = F.slice_axis(gates, axis=0, begin=which, end=which + 1)
            x = x + F.broadcast_mul(body, gate.reshape((1,) * (3 if case.input.kind == "tokens" else 2)))
        elif layer.type == "tied_output":
            x = dense(x, f"{o['tie']}.weight", f"{name}.bias")
    return x


def _attention(F: Any, x: Any, dense: Any, name: str, heads: int, out_proj: bool, width: int) -> Any:
    # Shapes are symbolic when hybridized: reshape with MXNet's special codes
    # (0 keep, -1 infer, -3 merge two axes, -4 split one).
    def project(p: str) -> Any:
        y = dense(x, f"{name}.{p}.weight", f"{name}.{p}.bias")
        return y.reshape((0, 0, heads, -1)).transpose((0, 2, 1, 3)).reshape((-3, 0, 0))

    q, k, v = project("q"), project("k"), project("v")
    scores = F.batch_dot(q, k, transpose_b=True) / math.sqrt(width // heads)
    y = F.batch_dot(F.softmax(scores, axis=-1), v)
    y = y.reshape((-4, -1, heads, 0, 0)).transpose((0, 2, 1, 3)).reshape((0, 0, -3))
    if out_proj:
        y = dense(y, f"{name}.o.weight", f"{name}.o.bias")
    return y


def case_loss(case: Case, logits: Any, labels: Any, total_tokens: int | None = None) -> Any:
    """Softmax cross-entropy, padding ignored, as torch.nn.functional.cross_entropy computes it."""
    mx = _mx()
    classes = case.num_classes
    flat = labels.reshape((-1,))
    kept = flat != IGNORE_LABEL
    picked = mx.nd.pick(mx.nd.log_softmax(logits.reshape((-1, classes)), axis=-1), mx.nd.maximum(flat, 0), axis=-1)
    total = -(picked * kept).sum()
    if case.loss_reduction == "token_count":
        return total / total_tokens
    return total / kept.sum() if case.loss_reduction == "mean" else total


class MXNetBackend(Backend):
    framework_name = "mxnet"

    def versions(self) -> dict[str, str]:
        return {"mxnet": _mx().__version__}

    def run(self, case: Case, accum_steps: int, device: str, fault: Fault | None = None,
            oracle: bool = False, progress: Progress | None = None,
            options: dict[str, Any] | None = None, weights: dict[str, np.ndarray] | None = None) -> RunResult:
        ctx = resolve_context(device)
        hybridize = (options or {}).get("hybridize", True)
        if (options or {}).get("full_batch"):
            raise AccumcheckError("--full-batch: the full-batch reference is computed by the PyTorch backend; "
                                  "use --framework torch")
        if (options or {}).get("mode", "native") != "native":
            raise AccumcheckError(f"--mode {options['mode']}: GradAccumulator is accumcheck.torch's; "
                                  "the MXNet backend compares grad_req='add' only")
        for key in ("dtype", "accum_dtype"):
            if (options or {}).get(key, "float32") != "float32":
                raise AccumcheckError(f"--{key.replace('_', '-')} {options[key]}: the MXNet backend runs float32 only "
                                      "(MXNet 1.x has no bfloat16 kernels on the CPU for these operators); "
                                      "use --framework torch for reduced precision")
        weights = case.weights() if weights is None else weights
        kinds = {p.name: p.kind for p in case.parameters()}
        block = _prepared(case, weights, "float32", ctx, hybridize)
        native, native_loss, _ = native_pass(block.canonical, _case_step(case, block, ctx, "float32", accum_steps), accum_steps,
                                             ctx, fault, progress)
        block = _prepared(case, weights, "float32", ctx, hybridize)
        manual, exact, absum, manual_loss, logits = manual_pass(block.canonical, _case_step(case, block, ctx, "float32", accum_steps),
                                                                accum_steps, ctx, progress)
        settings: dict[str, Any] = {"hybridize": hybridize, "static_alloc": hybridize, "requested_device": device,
                                    "native": "grad_req='add'", "manual": "grad_req='write' + acc[:] += p.grad()"}
        oracle_grads = None
        losses = {"mean_loss": native_loss, "manual_mean_loss": manual_loss}
        if oracle:
            oracle_grads, oracle_loss, settings["oracle"] = _oracle(case, weights, ctx, hybridize, accum_steps,
                                                                     device, progress)
            if oracle_loss is not None:
                losses["oracle_mean_loss"] = oracle_loss
        params = [ParamAccumulation(name=name, kind=kinds[name], native=native[name], manual=manual[name],
                                    exact=exact[name], absum=absum[name],
                                    oracle=None if oracle_grads is None else oracle_grads[name])
                  for name in weights]
        return RunResult(params=params, framework="mxnet", versions=self.versions(), device=str(ctx),
                         param_dtype="float32", accum_dtype="float32", native_kernel_allowance=KERNEL_ALLOWANCE,
                         losses=losses, settings=settings, first_logits=logits)


# A step function runs one micro-step's forward under autograd.record() and returns (loss, output).
StepFn = Callable[[int], tuple[Any, Any]]


def _case_step(case: Case, block: Any, ctx: Any, dtype: str, accum_steps: int = 0) -> StepFn:
    mx = _mx()
    total = case.token_count(accum_steps) if case.loss_reduction == "token_count" else None

    def step(index: int) -> tuple[Any, Any]:
        batch = case.batch(index)
        # Embedding takes its indices as floats (exact below 2**24).
        inputs = mx.nd.array(batch.inputs, ctx=ctx, dtype=dtype)
        labels = mx.nd.array(batch.labels, ctx=ctx, dtype=dtype)
        gates = case.gates(batch.index)
        out = block(inputs, mx.nd.array(gates, ctx=ctx, dtype=dtype)) if gates else block(inputs)
        return case_loss(case, out, labels, total), out

    return step


def _prepared(case: Case, weights: dict[str, np.ndarray], dtype: str, ctx: Any, hybridize: bool) -> Any:
    block = build_block(case, weights, dtype, ctx)
    if hybridize:
        block.hybridize(static_alloc=True)
    return block


def _set_grad_req(params: dict[str, Any], req: dict[str, str], default: str, refresh: Callable[[], None] | None) -> None:
    for name, param in params.items():
        param.grad_req = req.get(name, default)
    if refresh is not None:
        refresh()


def native_pass(params: dict[str, Any], step: StepFn, accum_steps: int, ctx: Any, fault: Fault | None,
                progress: Progress | None, phase: str = "native: grad_req='add'",
                refresh: Callable[[], None] | None = None) -> tuple[dict[str, np.ndarray], float, Any]:
    """grad_req='add', zeroed once, N micro-steps. Returns the gradients, the mean loss and the
    output of micro-step 0. A faulted parameter is accumulated by the fault injector instead,
    from its exact micro-gradients (grad_req='write')."""
    mx = _mx()
    target = fault.param if fault is not None else None
    _set_grad_req(params, {target: "write"} if target else {}, "add", refresh)
    for param in params.values():
        param.zero_grad()
    injector = None
    if fault is not None:
        injector = FaultInjector(fault, accum_steps,
                                 lambda t: mx.nd.array(round_to_bfloat16(t.asnumpy()), ctx=ctx, dtype=t.dtype))
    total = None
    losses: list[Any] = []
    for index, _ in _micro_steps(step, accum_steps, losses):
        if injector is not None:
            grad = params[target].grad().copy()
            contribution = injector.contribution(index, grad, total)
            total = contribution.copy() if total is None else total + contribution
            replaced = injector.after_add(index, total)
            total = total if replaced is None else replaced
        if progress is not None:
            progress(phase, index + 1, accum_steps)
    grads = {name: p.grad().asnumpy() for name, p in params.items()}
    if target is not None:
        grads[target] = total.asnumpy()
    return grads, float(losses[1].asscalar()) / accum_steps, losses[0]


def manual_pass(params: dict[str, Any], step: StepFn, accum_steps: int, ctx: Any, progress: Progress | None,
                refresh: Callable[[], None] | None = None) -> tuple[dict, dict, dict, float, np.ndarray]:
    """grad_req='write'; each micro-step's p.grad() goes into acc (float32), E and S (float64).
    Returns acc, E, S (numpy), the mean loss and the output of micro-step 0 (numpy)."""
    mx = _mx()
    _set_grad_req(params, {}, "write", refresh)
    # On the CPU each gradient is added by one compiled pass into numpy buffers (MXNet's
    # elementwise operators and concat are slow there); on a GPU the adds stay on the device.
    # Element by element both are acc[name][:] += p.grad().
    on_cpu = ctx.device_type == "cpu"
    if on_cpu:
        acc = {name: np.zeros(p.shape, np.dtype(p.dtype)) for name, p in params.items()}
        exact = {name: np.zeros(p.shape, np.float64) for name, p in params.items()}
        absum = {name: np.zeros(p.shape, np.float64) for name, p in params.items()}
    else:
        acc = {name: mx.nd.zeros(p.shape, ctx=ctx, dtype=p.dtype) for name, p in params.items()}
        exact = {name: mx.nd.zeros(p.shape, ctx=ctx, dtype="float64") for name, p in params.items()}
        absum = {name: mx.nd.zeros(p.shape, ctx=ctx, dtype="float64") for name, p in params.items()}
    losses: list[Any] = []
    pending: dict[str, Any] = {}
    for index, _ in _micro_steps(step, accum_steps, losses):
        if on_cpu:
            # Copy on MXNet's engine, read on the host one micro-step later: the host waits for a
            # gradient only while the engine already runs the next micro-step.
            _add_on_host(pending, acc, exact, absum)
            pending = {name: param.grad().copy() for name, param in params.items()}
        else:
            for name, param in params.items():
                grad = param.grad()
                acc[name][:] += grad
                wide = grad.astype("float64")
                exact[name][:] += wide
                absum[name][:] += mx.nd.abs(wide)
        if progress is not None:
            progress("manual: grad_req='write' + buffer", index + 1, accum_steps)
    _add_on_host(pending, acc, exact, absum)

    def split(values: dict[str, Any]) -> dict[str, np.ndarray]:
        return values if on_cpu else {name: v.asnumpy() for name, v in values.items()}

    first, loss_sum = losses
    logits = first.asnumpy() if hasattr(first, "asnumpy") else None
    return split(acc), split(exact), split(absum), float(loss_sum.asscalar()) / accum_steps, logits


def _micro_steps(step: StepFn, accum_steps: int, losses: list[Any]) -> Iterator[tuple[int, Any]]:
    """Forward under autograd.record() and backward, micro-step by micro-step; yields (index,
    output). Leaves [output of micro-step 0, summed mean loss] in ``losses`` (NDArrays)."""
    from mxnet import autograd

    losses[:] = [None, None]
    for index in range(accum_steps):
        with autograd.record():
            loss, out = step(index)
        loss.backward()
        losses[1] = loss.mean() if losses[1] is None else losses[1] + loss.mean()
        if index == 0:
            losses[0] = out
        yield index, out


def _add_on_host(grads: dict[str, Any], acc: dict, exact: dict, absum: dict) -> None:
    for name, grad in grads.items():
        add_step(grad.asnumpy().reshape(-1), acc[name].reshape(-1), exact[name].reshape(-1), absum[name].reshape(-1))


def _oracle(case: Case, weights: dict[str, np.ndarray], ctx: Any, hybridize: bool, accum_steps: int,
            device: str, progress: Progress | None) -> tuple[dict | None, float | None, str]:
    """The whole model in float64 with grad_req='add'; PyTorch's float64 model where MXNet lacks a
    float64 kernel for one of the case's operators."""
    mx = _mx()
    try:
        block = _prepared(case, weights, "float64", ctx, hybridize)
        grads, loss, _ = native_pass(block.canonical, _case_step(case, block, ctx, "float64", accum_steps), accum_steps, ctx,
                                     None, progress, phase="float64 oracle")
        return grads, loss, "mxnet float64"
    except mx.base.MXNetError as exc:
        reason = str(exc).strip().splitlines()[0][:160]
    try:
        from .torch_backend import float64_oracle
    except ImportError:
        return None, None, f"none: MXNet float64 failed ({reason}) and torch is not installed"
    grads, loss = float64_oracle(case, weights, accum_steps, "cpu" if device == "cpu" else "cuda", progress)
    return grads, loss, f"torch float64 (MXNet float64 failed: {reason})"


BACKEND_CLASS = MXNetBackend
