"""Framework-neutral cases: the model a case describes, its weights and its batches.

A case names a model built from a small layer vocabulary, its input, its loss, its initialisation,
a seed and a default number of accumulation steps. Weights and batches come from numpy and the
seed alone, so every backend gets bit-identical numbers and gradients can be compared across
frameworks. Batches are generated on demand, one micro-step at a time, so memory never grows with
the number of accumulation steps. Case files are read by ``accumcheck.case.reading``; frameworks build
the model through ``accumcheck.case.layers``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import AccumcheckError
from ..options.choices import REDUCTIONS

LAYER_TYPES = (
    "block",
    "conditional",
    "embedding",
    "dense",
    "activation",
    "layernorm",
    "attention",
    "residual",
    "shared_dense",
    "tied_output",
)
ACTIVATIONS = ("relu", "gelu", "tanh")
PARAM_KINDS = ("embedding", "weight", "bias", "norm")
LAYERNORM_EPS = 1e-5
IGNORE_LABEL = -100  # padding positions: no loss, no gradient (PyTorch's ignore_index)


class CaseError(AccumcheckError):
    """A case file or case definition is malformed; the message names the file, key and fix."""


@dataclass(frozen=True)
class Layer:
    """One layer of a case: ``type``, ``name`` and its options.

    ``block``, ``residual`` and ``conditional`` layers hold a ``body``: a block is a named group
    whose name prefixes its parameters (``block0.attn.q.weight``); a residual computes
    ``x + body(x)`` and adds no prefix, so a block can hold two residuals whose layers share the
    block's namespace. A conditional computes ``x + body(x)`` only for the micro-batches whose
    index is a multiple of ``every`` (``x`` for the others) and prefixes its parameters like a
    block: its parameters get no gradient at all in the other micro-steps, the data-dependent
    branch that DistributedDataParallel needs ``find_unused_parameters=True`` for.
    """

    type: str
    name: str
    options: dict[str, Any] = field(default_factory=dict)
    body: tuple["Layer", ...] = ()


@dataclass(frozen=True)
class ParamSpec:
    """A parameter tensor: canonical name, shape, kind and how it is initialised."""

    name: str
    shape: tuple[int, ...]
    kind: str  # one of PARAM_KINDS
    init: str  # "xavier", "zeros" or "ones"
    fan_in: int = 0
    fan_out: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class InputSpec:
    kind: str  # "tokens" or "features"
    batch_size: int
    vocab: int = 0
    seq_len: int = 0
    features: int = 0
    scale: float = 1.0
    spread: float = 0.0  # >0: every sample is one shared base vector plus spread * noise
    labels: str = "random"  # "random" or "alternate"
    min_len: int = 0  # tokens: >0 gives each sequence a length in [min_len, seq_len], padded after
    distinct_batches: int = 0  # 0: a fresh batch each micro-step; K: cycle K batches


@dataclass(frozen=True)
class Batch:
    """One micro-batch: ``inputs`` (int64 token ids [B, T] or float32 features [B, F]),
    int64 ``labels`` ([B, T] or [B]) and its ``index`` among the case's micro-batches (which
    decides the route through conditional layers)."""

    inputs: np.ndarray
    labels: np.ndarray
    index: int = 0


@dataclass(frozen=True)
class Case:
    """A validated case. ``source`` is where it came from; ``text`` is its TOML, kept so a report
    can reproduce the run exactly."""

    name: str
    description: str
    seed: int
    accum_steps: int
    input: InputSpec
    loss_reduction: str
    init_magnitude: float
    init_scale: float
    layers: tuple[Layer, ...]
    source: str = "<memory>"
    text: str = ""

    def with_seed(self, seed: int) -> "Case":
        return dataclasses.replace(self, seed=seed)

    def with_reduction(self, reduction: str) -> "Case":
        if reduction not in REDUCTIONS:
            raise CaseError(f"--loss-reduction: {reduction!r} is not one of {', '.join(REDUCTIONS)}")
        return dataclasses.replace(self, loss_reduction=reduction)

    @property
    def num_classes(self) -> int:
        return _walk(self.layers, self.input, [], "")[0]

    def parameters(self) -> list[ParamSpec]:
        """Every parameter tensor in a fixed order (the order of the layers)."""
        specs: list[ParamSpec] = []
        _walk(self.layers, self.input, specs, "")
        return specs

    def weights(self) -> dict[str, np.ndarray]:
        """The initial float32 weights, keyed by canonical name, generated from the seed."""
        out: dict[str, np.ndarray] = {}
        for spec in self.parameters():
            if spec.init == "zeros":
                out[spec.name] = np.zeros(spec.shape, np.float32)
            elif spec.init == "ones":
                out[spec.name] = np.ones(spec.shape, np.float32)
            else:
                rng = np.random.default_rng([self.seed, zlib.crc32(spec.name.encode())])
                limit = np.sqrt(self.init_magnitude / ((spec.fan_in + spec.fan_out) / 2.0))
                w = rng.uniform(-limit, limit, spec.shape) * self.init_scale
                out[spec.name] = w.astype(np.float32)
        return out

    def batch(self, step: int) -> Batch:
        """The micro-batch fed at micro-step ``step`` (0-based)."""
        spec = self.input
        index = step % spec.distinct_batches if spec.distinct_batches else step
        rng = np.random.default_rng([self.seed, 0xBA7C, index])
        b = spec.batch_size
        padding = None
        if spec.kind == "tokens":
            inputs = rng.integers(0, spec.vocab, (b, spec.seq_len), dtype=np.int64)
            label_shape: tuple[int, ...] = (b, spec.seq_len)
            if spec.min_len:
                lengths = rng.integers(spec.min_len, spec.seq_len + 1, b)
                padding = np.arange(spec.seq_len)[None, :] >= lengths[:, None]
                inputs[padding] = 0
        else:
            noise = rng.standard_normal((b, spec.features))
            if spec.spread:
                base = np.random.default_rng([self.seed, 0xBA5E]).standard_normal(spec.features)
                noise = base + spec.spread * noise
            inputs = (noise * spec.scale).astype(np.float32)
            label_shape = (b,)
        classes = self.num_classes
        if spec.labels == "alternate":
            first = index * int(np.prod(label_shape))
            labels = (np.arange(first, first + int(np.prod(label_shape))) % classes).reshape(label_shape)
        else:
            labels = rng.integers(0, classes, label_shape)
        labels = labels.astype(np.int64)
        if padding is not None:
            labels[padding] = IGNORE_LABEL
        return Batch(inputs=inputs, labels=labels, index=index)

    def all_layers(self) -> list[Layer]:
        """Every layer, blocks' bodies included, in the order of the layers (depth first)."""
        found: list[Layer] = []

        def visit(layers: tuple[Layer, ...]) -> None:
            for layer in layers:
                found.append(layer)
                visit(layer.body)

        visit(self.layers)
        return found

    def conditional_layers(self) -> list[Layer]:
        """The conditional layers, in the order of the layers (depth first)."""
        return [layer for layer in self.all_layers() if layer.type == "conditional"]

    def gates(self, index: int) -> list[bool]:
        """For micro-batch ``index``: whether each conditional layer (in order) takes its branch."""
        return [branch_active(layer, index) for layer in self.conditional_layers()]

    def token_count(self, steps: int) -> int:
        """Labelled positions (padding excluded) over the first ``steps`` micro-batches: what a
        token-normalised loss divides by."""
        return int(sum((self.batch(k).labels != IGNORE_LABEL).sum() for k in range(steps)))

    def to_document(self) -> dict[str, Any]:
        """The case as a TOML-ready document; ``parse_case`` of its TOML gives this case back."""
        spec = self.input
        if spec.kind == "tokens":
            inp: dict[str, Any] = {"kind": "tokens", "vocab": spec.vocab, "seq_len": spec.seq_len,
                                   "min_len": spec.min_len}
        else:
            inp = {"kind": "features", "features": spec.features, "scale": spec.scale, "spread": spec.spread}
        inp.update(batch_size=spec.batch_size, labels=spec.labels, distinct_batches=spec.distinct_batches)
        return {"name": self.name, "description": self.description, "seed": self.seed,
                "accum_steps": self.accum_steps, "input": inp,
                "loss": {"kind": "softmax_cross_entropy", "reduction": self.loss_reduction},
                "init": {"scheme": "xavier", "magnitude": self.init_magnitude, "scale": self.init_scale},
                "layers": [_layer_document(layer) for layer in self.layers]}

    def fingerprint(self) -> str:
        """A short hash of the case definition, to tell two runs of different cases apart."""
        return hashlib.sha256(self.text.encode()).hexdigest()[:12]


def branch_active(layer: Layer, index: int) -> bool:
    """Whether conditional ``layer`` applies its body to micro-batch ``index``."""
    return index % layer.options["every"] == 0


def _layer_document(layer: Layer) -> dict[str, Any]:
    doc: dict[str, Any] = {"type": layer.type, "name": layer.name}
    doc.update({k: list(v) if isinstance(v, tuple) else v for k, v in layer.options.items()})
    if layer.body:
        doc["body"] = [_layer_document(child) for child in layer.body]
    return doc


# ----------------------------------------------------------------------------- shape walking


def _walk(layers: tuple[Layer, ...], inp: InputSpec, specs: list[ParamSpec], prefix: str,
          dim: int | None = None, embeddings: dict[str, tuple[int, int]] | None = None) -> tuple[int, dict]:
    """Walk the layers, appending ParamSpecs; return the output feature size."""
    if embeddings is None:
        embeddings = {}
    if dim is None:
        dim = 0 if inp.kind == "tokens" else inp.features
    for layer in layers:
        name = prefix + layer.name
        o = layer.options
        if layer.type == "embedding":
            specs.append(ParamSpec(f"{name}.weight", (inp.vocab, o["dim"]), "embedding", "xavier",
                                   fan_in=inp.vocab, fan_out=o["dim"]))
            embeddings[layer.name] = (inp.vocab, o["dim"])
            dim = o["dim"]
        elif layer.type in ("dense", "shared_dense"):
            specs.append(ParamSpec(f"{name}.weight", (o["units"], dim), "weight", "xavier",
                                   fan_in=dim, fan_out=o["units"]))
            if o["bias"]:
                specs.append(ParamSpec(f"{name}.bias", (o["units"],), "bias", "zeros"))
            dim = o["units"]
        elif layer.type == "layernorm":
            specs.append(ParamSpec(f"{name}.gamma", (dim,), "norm", "ones"))
            specs.append(ParamSpec(f"{name}.beta", (dim,), "norm", "zeros"))
        elif layer.type == "attention":
            projections = ("q", "k", "v", "o") if o["out_proj"] else ("q", "k", "v")
            for proj in projections:
                specs.append(ParamSpec(f"{name}.{proj}.weight", (dim, dim), "weight", "xavier",
                                       fan_in=dim, fan_out=dim))
                if o["bias"]:
                    specs.append(ParamSpec(f"{name}.{proj}.bias", (dim,), "bias", "zeros"))
        elif layer.type == "residual":
            _walk(layer.body, inp, specs, prefix, dim, embeddings)
        elif layer.type in ("block", "conditional"):
            dim, _ = _walk(layer.body, inp, specs, name + ".", dim, embeddings)
        elif layer.type == "tied_output":
            vocab, _ = embeddings[o["tie"]]
            if o["bias"]:
                specs.append(ParamSpec(f"{name}.bias", (vocab,), "bias", "zeros"))
            dim = vocab
    return dim, embeddings




def infer_kind(name: str, ndim: int) -> str:
    """The kind of a user model's parameter, from its name: embedding, norm, bias or weight."""
    lowered = name.lower()
    if "embed" in lowered and ndim == 2:
        return "embedding"
    if any(word in lowered for word in ("norm", "gamma", "beta", "ln_", "bn_")) and ndim == 1:
        return "norm"
    if lowered.endswith("bias") or ndim == 1:
        return "bias"
    return "weight"
