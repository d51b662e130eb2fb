"""The case as a pure JAX function of a parameter pytree: the layer primitives, the loss, the
micro-step's gradient.

The parameters are a flat dict from canonical names (``block0.attn.q.weight``) to arrays, the
pytree ``jax.grad`` differentiates. Conditional layers route by the micro-batch's index, a Python
bool per branch: each route is its own traced function (jit compiles it once).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..case.definition import IGNORE_LABEL, LAYERNORM_EPS, Case
from ..case.layers import run_layers

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float64": jnp.float64}


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


def case_params(case: Case, weights: dict[str, np.ndarray], dtype: str, device: Any) -> dict[str, Any]:
    """The case's weights as the parameter pytree, in ``dtype`` on ``device``."""
    return {name: jax.device_put(jnp.asarray(value, dtype=DTYPES[dtype]), device) for name, value in weights.items()}


def batch_arrays(case: Case, step: int, dtype: str, device: Any) -> tuple[Any, Any, tuple[bool, ...]]:
    """Micro-step ``step``'s inputs (token ids as int32, features in ``dtype``), labels and route."""
    batch = case.batch(step)
    inputs = batch.inputs
    inputs = inputs.astype(np.int32) if inputs.dtype.kind in "iu" else inputs.astype(DTYPES[dtype])
    return (jax.device_put(inputs, device), jax.device_put(batch.labels.astype(np.int32), device),
            tuple(case.gates(batch.index)))


# The last few cases' gradient functions, by the case object itself: a run and its judge's second
# pass (the same RunConfig) share one compiled function instead of compiling it twice.
_COMPILED: dict[tuple[int, bool, str | None], tuple[Case, Callable[..., Any]]] = {}
_KEPT = 4


def grad_function(case: Case, jit: bool, compute_dtype: str | None = None) -> Callable[..., Any]:
    """``f(params, inputs, labels, total, gates) -> ((loss, logits), grads)``, jit-compiled once
    per route (``gates``) unless ``jit`` is False. ``compute_dtype``: the forward casts the
    parameters to it (float32 master weights for a bfloat16 model; their gradients come back in
    the parameters' dtype, exactly)."""
    key = (id(case), jit, compute_dtype)
    if key in _COMPILED and _COMPILED[key][0] is case:
        return _COMPILED[key][1]
    step = _grad_function(case, jit, compute_dtype)
    _COMPILED[key] = (case, step)
    while len(_COMPILED) > _KEPT:
        del _COMPILED[next(iter(_COMPILED))]
    return step


def _grad_function(case: Case, jit: bool, compute_dtype: str | None) -> Callable[..., Any]:
    shapes = {p.name: p.shape for p in case.parameters()}

    def loss(params: dict[str, Any], inputs: Any, labels: Any, total: Any, gates: tuple[bool, ...]) -> Any:
        if compute_dtype is not None:
            params = {name: p.astype(DTYPES[compute_dtype]) for name, p in params.items()}
        logits = run_layers(case, inputs, params, JaxOps(gates), shapes)
        return case_loss(case, logits, labels, total), logits

    step = jax.value_and_grad(loss, has_aux=True)
    return jax.jit(step, static_argnums=4) if jit else step
