"""The case as a Gluon HybridBlock, a loss and batches: contexts, the layer primitives, the block,
the loss, and the micro-step the engine runs them by."""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from ..case.definition import IGNORE_LABEL, LAYERNORM_EPS, Case
from ..case.layers import run_layers
from ..errors import AccumcheckError
from .library import mx
from .microstep import MicroStep


def resolve_context(device: str) -> Any:
    """An mx.Context for "cpu", "gpu", "cuda" or "cuda:N"/"gpu:N"; AccumcheckError if unavailable."""
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


class MXNetOps:
    """The layer primitives (``accumcheck.case.layers.LayerOps``) in ``F`` (mx.nd, or mx.sym when
    hybridized). Widths come from the case: under hybridize the parameters are symbols without
    shapes. ``gates`` is the 0/1 input that routes conditional branches; ``rank`` the number of
    axes of the activations."""

    def __init__(self, F: Any, gates: Any, rank: int) -> None:
        self.F, self.gates, self.rank = F, gates, rank

    def embedding(self, x: Any, weight: Any, vocab: int, dim: int) -> Any:
        return self.F.Embedding(x, weight, input_dim=vocab, output_dim=dim)

    def dense(self, x: Any, weight: Any, bias: Any, units: int) -> Any:
        if bias is None:
            return self.F.FullyConnected(x, weight, num_hidden=units, no_bias=True, flatten=False)
        return self.F.FullyConnected(x, weight, bias, num_hidden=units, flatten=False)

    def shared_dense(self, x: Any, weight: Any, bias: Any, units: int, scales: tuple[float, ...]) -> Any:
        outs = [self.dense(x * scale, weight, bias, units) for scale in scales]
        total = outs[0]
        for out in outs[1:]:
            total = total + out
        return total

    def activation(self, x: Any, fn: str) -> Any:
        return self.F.LeakyReLU(x, act_type="gelu") if fn == "gelu" else self.F.Activation(x, act_type=fn)

    def layernorm(self, x: Any, gamma: Any, beta: Any) -> Any:
        return self.F.LayerNorm(x, gamma, beta, axis=-1, eps=LAYERNORM_EPS)

    def attention(self, x: Any, projections: dict[str, tuple[Any, Any]], heads: int, width: int) -> Any:
        F = self.F

        # Shapes are symbolic when hybridized: reshape with MXNet's special codes
        # (0 keep, -1 infer, -3 merge two axes, -4 split one).
        def project(p: str) -> Any:
            y = self.dense(x, *projections[p], width)
            return y.reshape((0, 0, heads, -1)).transpose((0, 2, 1, 3)).reshape((-3, 0, 0))

        q, k, v = project("q"), project("k"), project("v")
        scores = F.batch_dot(q, k, transpose_b=True) / math.sqrt(width // heads)
        y = F.batch_dot(F.softmax(scores, axis=-1), v)
        y = y.reshape((-4, -1, heads, 0, 0)).transpose((0, 2, 1, 3)).reshape((0, 0, -3))
        return self.dense(y, *projections["o"], width) if "o" in projections else y

    def branch(self, x: Any, body: Any, which: int) -> Any:
        # A hybridized graph cannot branch on data, so the branch is multiplied by its gate
        # (1 or 0, an input): where the gate is 0 its parameters get gradients of exactly 0.
        inner = body(x)
        gate = self.F.slice_axis(self.gates, axis=0, begin=which, end=which + 1)
        return x + self.F.broadcast_mul(inner, gate.reshape((1,) * self.rank))


def float16_on_cpu(dtype: str, ctx: Any) -> bool:
    """Whether the block computes in float32 from float16 parameters: MXNet 1.x has no float16
    FullyConnected or batch_dot on the CPU (cuDNN only). The gradients come back through the cast
    in float16, so grad_req='add' still sums float16 gradients in float16, as on a GPU; only the
    forward's own rounding differs from a GPU's float16 kernels."""
    return dtype == "float16" and ctx.device_type == "cpu"


def build_block(case: Case, weights: dict[str, np.ndarray], dtype: str, ctx: Any) -> Any:
    """The case as a Gluon HybridBlock holding ``weights`` in ``dtype``; ``canonical`` maps names
    to Parameters. float16 on the CPU computes in float32 (``float16_on_cpu``)."""
    shapes = {p.name: p.shape for p in case.parameters()}
    rank = 3 if case.input.kind == "tokens" else 2
    upcast = float16_on_cpu(dtype, ctx)

    class CaseBlock(mx.gluon.HybridBlock):
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
            if upcast:
                x, gates = F.cast(x, dtype="float32"), tuple(F.cast(g, dtype="float32") for g in gates)
                named = {name: F.cast(p, dtype="float32") for name, p in named.items()}
            return run_layers(case, x, named, MXNetOps(F, gates[0] if gates else None, rank), shapes)

    block = CaseBlock()
    block.initialize(ctx=ctx)
    for name, param in block.canonical.items():
        param.set_data(mx.nd.array(weights[name], ctx=ctx, dtype=dtype))
    return block


def case_loss(case: Case, logits: Any, labels: Any, total_tokens: int | None = None) -> Any:
    """Softmax cross-entropy, padding ignored, as torch.nn.functional.cross_entropy computes it."""
    classes = case.num_classes
    flat = labels.reshape((-1,)).astype(logits.dtype, copy=False)  # float16 labels meet float32 logits on the CPU
    kept = flat != IGNORE_LABEL
    picked = mx.nd.pick(mx.nd.log_softmax(logits.reshape((-1, classes)), axis=-1), mx.nd.maximum(flat, 0), axis=-1)
    total = -(picked * kept).sum()
    if case.loss_reduction == "token_count":
        return total / total_tokens
    return total / kept.sum() if case.loss_reduction == "mean" else total


def prepared(case: Case, weights: dict[str, np.ndarray], dtype: str, ctx: Any, hybridize: bool) -> Any:
    """``build_block``, hybridized (``static_alloc=True``, as in the original bug reports) unless not asked to."""
    block = build_block(case, weights, dtype, ctx)
    if hybridize:
        block.hybridize(static_alloc=True)
    return block


def case_step(case: Case, block: Any, ctx: Any, dtype: str, accum_steps: int = 0, keep: bool = False) -> MicroStep:
    """The case's micro-step ``index`` through ``block``: (loss, output). Its batches are
    ``((inputs[, gates]), labels)`` and its loss ``case_loss``; what they raise is raised as it is.
    ``keep``: each batch is made once and kept, for passes that run the same micro-steps again
    (a case's batches are a few hundred numbers each)."""
    total = case.token_count(accum_steps) if case.loss_reduction == "token_count" else None
    kept: dict[int, tuple[tuple[Any, ...], Any]] = {}

    def batch(index: int) -> tuple[tuple[Any, ...], Any]:
        if index in kept:
            return kept[index]
        micro = case.batch(index)
        made = case_batch(micro.inputs, micro.labels, case.gates(micro.index), ctx, dtype)
        if keep:
            kept[index] = made
        return made

    return MicroStep(block, batch, ctx, case_loss_fn(case, total), None, user=False)


def whole_step(case: Case, block: Any, ctx: Any, accum_steps: int) -> MicroStep:
    """The case's ``accum_steps`` micro-batches joined into one batch, in float64, through ``block``
    (its micro-step 0). The whole batch's mean over its labelled tokens is the token-count loss's
    sum over the window."""
    batches = [case.batch(k) for k in range(accum_steps)]  # the whole window at once: memory grows with N
    inputs = np.concatenate([b.inputs for b in batches])
    labels = np.concatenate([b.labels for b in batches])
    whole = case if case.loss_reduction != "token_count" else case.with_reduction("mean")
    return MicroStep(block, lambda _: case_batch(inputs, labels, [], ctx, "float64"), ctx, case_loss_fn(whole), None,
                     user=False)


def case_batch(inputs: np.ndarray, labels: np.ndarray, gates: Any, ctx: Any, dtype: str) -> tuple[tuple[Any, ...], Any]:
    """One batch as NDArrays on ``ctx``: ``((inputs, gates), labels)``, or ``((inputs,), labels)``
    without gates. Embedding takes its indices as floats (exact below 2**24)."""
    x = mx.nd.array(inputs, ctx=ctx, dtype=dtype)
    y = mx.nd.array(labels, ctx=ctx, dtype=dtype)
    return ((x, mx.nd.array(gates, ctx=ctx, dtype=dtype)) if gates else (x,)), y


def case_loss_fn(case: Case, total_tokens: int | None = None) -> Callable[[Any, Any], Any]:
    return lambda logits, labels: case_loss(case, logits, labels, total_tokens)
