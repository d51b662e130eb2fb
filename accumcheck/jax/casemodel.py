"""A built-in case as the engine runs it: its weights as the parameters, a pure JAX loss function
of them (the layer primitives, the loss) and its micro-batches.

The parameters are a flat dict from canonical names (``block0.attn.q.weight``) to arrays, the
pytree ``jax.grad`` differentiates. Conditional layers route by the micro-batch's index, a Python
bool per branch held static in the batch: each route is its own traced function (jit compiles it
once).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..case.definition import IGNORE_LABEL, LAYERNORM_EPS, Case
from ..case.layers import run_layers
from .engine import GradFn, gradient
from .library import DTYPES


class JaxOps:
    """The layer primitives (``accumcheck.case.layers.LayerOps``) in jax.numpy, for one route
    through the conditional layers (``gates``)."""

    def __init__(self, gates: tuple[bool, ...]) -> None:
        self.gates = gates

    def embedding(self, x: Any, weight: Any, vocab: int, dim: int) -> Any:
        return jnp.take(weight, x, axis=0)

    def dense(self, x: Any, weight: Any, bias: Any, units: int) -> Any:
        y = x @ weight.T  # weight is [out, in], as in the case's layout
        return y + bias if bias is not None else y

    def shared_dense(self, x: Any, weight: Any, bias: Any, units: int, scales: tuple[float, ...]) -> Any:
        return sum(self.dense(x * scale, weight, bias, units) for scale in scales)

    def activation(self, x: Any, fn: str) -> Any:
        if fn == "gelu":
            return jax.nn.gelu(x, approximate=False)  # the erf form, as torch's and MXNet's default
        return {"relu": jax.nn.relu, "tanh": jnp.tanh}[fn](x)

    def layernorm(self, x: Any, gamma: Any, beta: Any) -> Any:
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)  # biased, as torch's layer_norm
        return (x - mean) / jnp.sqrt(var + LAYERNORM_EPS) * gamma + beta

    def attention(self, x: Any, projections: dict[str, tuple[Any, Any]], heads: int, width: int) -> Any:
        batch, seq, _ = x.shape
        head = width // heads

        def project(p: str) -> Any:
            y = self.dense(x, *projections[p], width)
            return y.reshape(batch, seq, heads, head).transpose(0, 2, 1, 3)

        q, k, v = project("q"), project("k"), project("v")
        weights = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / math.sqrt(head), axis=-1)
        y = (weights @ v).transpose(0, 2, 1, 3).reshape(batch, seq, width)
        return self.dense(y, *projections["o"], width) if "o" in projections else y

    def branch(self, x: Any, body: Callable[[Any], Any], which: int) -> Any:
        # A real branch: on the other micro-batches the body's parameters get a zero gradient.
        return x + body(x) if self.gates[which] else x


def case_loss(case: Case, logits: Any, labels: Any, total_tokens: float | None = None) -> Any:
    """Softmax cross-entropy with padding ignored, as ``torch.nn.functional.cross_entropy``: the
    micro-batch's mean over its labelled positions or their sum, or ("token_count") that sum over
    ``total_tokens``."""
    flat = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    keep = flat_labels != IGNORE_LABEL
    picked = jnp.take_along_axis(jax.nn.log_softmax(flat, axis=-1), jnp.where(keep, flat_labels, 0)[:, None], axis=-1)
    total = -jnp.sum(jnp.where(keep, picked[:, 0], 0))
    if case.loss_reduction == "token_count":
        return total / total_tokens
    if case.loss_reduction == "sum":
        return total
    return total / jnp.sum(keep).astype(total.dtype)


@jax.tree_util.register_pytree_node_class
class CaseBatch:
    """One micro-batch as the case's loss takes it: inputs, labels and the token total (arrays, or
    a Python float or None); the route through the conditional layers (``gates``) is the pytree's
    static part, so that jit compiles each route once."""

    def __init__(self, inputs: Any, labels: Any, total: float | None, gates: tuple[bool, ...]) -> None:
        self.inputs, self.labels, self.total, self.gates = inputs, labels, total, gates

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[bool, ...]]:
        return (self.inputs, self.labels, self.total), self.gates

    @classmethod
    def tree_unflatten(cls, gates: tuple[bool, ...], children: tuple[Any, ...]) -> CaseBatch:
        return cls(*children, gates)


def case_batches(case: Case, accum_steps: int, dtype: str, device: Any) -> Callable[[int], CaseBatch]:
    """Micro-batch ``k`` of the case's ``accum_steps``: token ids as int32, features in ``dtype``,
    on ``device``."""
    total = float(case.token_count(accum_steps)) if case.loss_reduction == "token_count" else None

    def batch(step: int) -> CaseBatch:
        micro = case.batch(step)
        inputs = micro.inputs
        inputs = inputs.astype(np.int32) if inputs.dtype.kind in "iu" else inputs.astype(DTYPES[dtype])
        return CaseBatch(jax.device_put(inputs, device), jax.device_put(micro.labels.astype(np.int32), device),
                         total, tuple(case.gates(micro.index)))

    return batch


class CaseParams:
    """The case's weights as the engine's parameter set: a flat dict by canonical name (in the
    case's order), run in ``dtype`` on ``device``."""

    def __init__(self, case: Case, weights: dict[str, np.ndarray], dtype: str, accum_dtype: str,
                 device: Any) -> None:
        self.weights, self.device = weights, device
        self.names = list(weights)
        self.kinds = {p.name: p.kind for p in case.parameters()}
        self.dtypes = dict.fromkeys(self.names, dtype)
        self.param_dtype, self.accum_dtype = dtype, accum_dtype

    def arrays(self, dtype: Any = None) -> dict[str, Any]:
        dtype = DTYPES[self.param_dtype] if dtype is None else dtype
        return {name: jax.device_put(jnp.asarray(value, dtype=dtype), self.device)
                for name, value in self.weights.items()}

    def tree(self, flat: dict[str, Any]) -> dict[str, Any]:
        return flat

    def flat(self, grads: dict[str, Any]) -> dict[str, Any]:
        return grads

    def wide(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()


# The last few cases' gradient functions, by the case object itself: a run and its judge's second
# pass (the same RunConfig) share one compiled function instead of compiling it twice.
_COMPILED: dict[tuple[int, bool, str | None], tuple[Case, GradFn]] = {}
_KEPT = 4


def grad_function(case: Case, jit: bool, compute_dtype: str | None = None) -> GradFn:
    """The engine's gradient of the case's loss, ``f(params, batch) -> ((loss, logits), grads)``,
    jit-compiled once per route unless ``jit`` is False. ``compute_dtype``: the forward casts the
    parameters to it (float32 master weights for a bfloat16 model; their gradients come back in
    the parameters' dtype, exactly)."""
    key = (id(case), jit, compute_dtype)
    if key in _COMPILED and _COMPILED[key][0] is case:
        return _COMPILED[key][1]
    step = gradient(_loss_function(case, compute_dtype), jit, aux=True)
    _COMPILED[key] = (case, step)
    while len(_COMPILED) > _KEPT:
        del _COMPILED[next(iter(_COMPILED))]
    return step


def _loss_function(case: Case, compute_dtype: str | None) -> Callable[[dict[str, Any], CaseBatch], Any]:
    shapes = {p.name: p.shape for p in case.parameters()}

    def loss(params: dict[str, Any], batch: CaseBatch) -> Any:
        if compute_dtype is not None:
            params = {name: p.astype(DTYPES[compute_dtype]) for name, p in params.items()}
        logits = run_layers(case, batch.inputs, params, JaxOps(batch.gates), shapes)
        return case_loss(case, logits, batch.labels, batch.total), logits

    return loss
