"""The case's layer vocabulary, interpreted once for every framework.

``run_layers`` walks a case's layers: it names each layer's parameters (``block0.attn.q.weight``),
opens and closes blocks, adds residuals, counts conditional branches and ties an output layer to
its embedding. What a layer computes is the framework's: it supplies ``LayerOps``, one method per
primitive, and each primitive is one dispatch-table entry away from the layer type that uses it.
Adding a framework means writing its LayerOps; adding a layer type means one handler here and one
primitive (at most) per framework.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from .definition import Case, Layer


class LayerOps(Protocol):
    """A framework's primitives. ``x`` is its tensor (or symbol); a missing bias is None."""

    def embedding(self, x: Any, weight: Any, vocab: int, dim: int) -> Any: ...

    def dense(self, x: Any, weight: Any, bias: Any, units: int) -> Any: ...

    def shared_dense(self, x: Any, weight: Any, bias: Any, units: int, scales: tuple[float, ...]) -> Any:
        """sum(dense(x * scale) for scale in scales): one weight used several times."""

    def activation(self, x: Any, fn: str) -> Any: ...

    def layernorm(self, x: Any, gamma: Any, beta: Any) -> Any: ...

    def attention(self, x: Any, projections: dict[str, tuple[Any, Any]], heads: int, width: int) -> Any:
        """Multi-head self-attention; ``projections`` maps "q", "k", "v" (and "o" when the layer has
        an output projection) to (weight, bias)."""

    def branch(self, x: Any, body: Callable[[Any], Any], which: int) -> Any:
        """x + body(x) where conditional branch number ``which`` (depth-first order) is taken, else x."""


class _Walk:
    """One forward pass: the parameters, the framework's primitives, the case's shapes."""

    def __init__(self, params: dict[str, Any], ops: LayerOps, case: Case, shapes: dict[str, tuple[int, ...]]):
        self.params, self.ops, self.case, self.shapes = params, ops, case, shapes
        self.branches = 0

    def weight_and_bias(self, name: str) -> tuple[Any, Any]:
        return self.params[f"{name}.weight"], self.params.get(f"{name}.bias")

    def layers(self, layers: tuple[Layer, ...], x: Any, prefix: str) -> Any:
        for layer in layers:
            x = _HANDLERS[layer.type](self, layer, x, prefix)
        return x


def _embedding(walk: _Walk, layer: Layer, x: Any, prefix: str) -> Any:
    return walk.ops.embedding(x, walk.params[f"{prefix}{layer.name}.weight"], walk.case.input.vocab,
                              layer.options["dim"])


def _dense(walk: _Walk, layer: Layer, x: Any, prefix: str) -> Any:
    return walk.ops.dense(x, *walk.weight_and_bias(prefix + layer.name), layer.options["units"])


def _shared_dense(walk: _Walk, layer: Layer, x: Any, prefix: str) -> Any:
    return walk.ops.shared_dense(x, *walk.weight_and_bias(prefix + layer.name), layer.options["units"],
                                 layer.options["scales"])


def _activation(walk: _Walk, layer: Layer, x: Any, prefix: str) -> Any:
    return walk.ops.activation(x, layer.options["fn"])


def _layernorm(walk: _Walk, layer: Layer, x: Any, prefix: str) -> Any:
    name = prefix + layer.name
    return walk.ops.layernorm(x, walk.params[f"{name}.gamma"], walk.params[f"{name}.beta"])


def _attention(walk: _Walk, layer: Layer, x: Any, prefix: str) -> Any:
    name = prefix + layer.name
    kinds = ("q", "k", "v", "o") if layer.options["out_proj"] else ("q", "k", "v")
    projections = {p: walk.weight_and_bias(f"{name}.{p}") for p in kinds}
    return walk.ops.attention(x, projections, layer.options["heads"], walk.shapes[f"{name}.q.weight"][0])


def _residual(walk: _Walk, layer: Layer, x: Any, prefix: str) -> Any:
    return x + walk.layers(layer.body, x, prefix)  # a residual adds no prefix


def _block(walk: _Walk, layer: Layer, x: Any, prefix: str) -> Any:
    return walk.layers(layer.body, x, f"{prefix}{layer.name}.")


def _conditional(walk: _Walk, layer: Layer, x: Any, prefix: str) -> Any:
    which = walk.branches
    walk.branches += 1
    return walk.ops.branch(x, lambda inner: walk.layers(layer.body, inner, f"{prefix}{layer.name}."), which)


def _tied_output(walk: _Walk, layer: Layer, x: Any, prefix: str) -> Any:
    tie = layer.options["tie"]
    return walk.ops.dense(x, walk.params[f"{tie}.weight"], walk.params.get(f"{prefix}{layer.name}.bias"),
                          walk.shapes[f"{tie}.weight"][0])


_HANDLERS: dict[str, Callable[[_Walk, Layer, Any, str], Any]] = {
    "embedding": _embedding,
    "dense": _dense,
    "shared_dense": _shared_dense,
    "activation": _activation,
    "layernorm": _layernorm,
    "attention": _attention,
    "residual": _residual,
    "block": _block,
    "conditional": _conditional,
    "tied_output": _tied_output,
}


def run_layers(case: Case, x: Any, params: dict[str, Any], ops: LayerOps,
               shapes: dict[str, tuple[int, ...]] | None = None) -> Any:
    """The case's output (logits) for input ``x``: its layers applied with the framework's
    ``ops`` to ``params`` (canonical parameter name -> the framework's parameter). ``shapes``
    (canonical name -> shape) saves recomputing them from the case on every call."""
    if shapes is None:
        shapes = {p.name: p.shape for p in case.parameters()}
    return _Walk(params, ops, case, shapes).layers(case.layers, x, "")
