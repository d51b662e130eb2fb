"""Case files: read and validate case TOML (errors name the file, the key, the value and the fix),
and find the built-in cases."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import AccumcheckError
from ..files import MAX_CASE_BYTES, read_text
from ..options.choices import REDUCTIONS, SEED_LIMIT
from .definition import ACTIVATIONS, LAYER_TYPES, Case, CaseError, InputSpec, Layer

MAX_NESTING = 16  # blocks within blocks; the built-in cases nest 3 deep
_LAYER_NAME = re.compile(r"[A-Za-z0-9_-]+")


class _Reader:
    """Typed access to one TOML table, with errors that name file, key, value and fix."""

    def __init__(self, table: dict, where: str, source: str):
        self.table, self.where, self.source = table, where, source
        self.used: set[str] = set()

    def fail(self, key: str, problem: str) -> CaseError:
        return CaseError(f"{self.source}: {self.where}{key}: {problem}")

    def get(self, key: str, kind: type, default: Any = ..., choices: tuple = ()) -> Any:
        self.used.add(key)
        if key not in self.table:
            if default is ...:
                return self._missing(key, kind, choices)
            return default
        value = self.table[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is int and isinstance(value, bool) or not isinstance(value, kind):
            raise self.fail(key, f"expected {kind.__name__}, got {value!r}")
        if choices and value not in choices:
            raise self.fail(key, f"{value!r} is not one of {', '.join(map(repr, choices))}")
        if kind is float and not math.isfinite(value):
            raise self.fail(key, f"must be a finite number, got {value!r}")
        return value

    def positive(self, key: str, default: Any = ...) -> int:
        value = self.get(key, int, default)
        if value <= 0:
            raise self.fail(key, f"must be a positive integer, got {value!r}")
        return value

    def _missing(self, key: str, kind: type, choices: tuple) -> Any:
        hint = f" (one of {', '.join(map(repr, choices))})" if choices else f" ({kind.__name__})"
        typo = difflib.get_close_matches(key, [k for k in self.table if k not in self.used], 1)
        found = f"; is {typo[0]!r} a misspelling of it?" if typo else ""
        raise self.fail(key, f"missing required key; add {key} = ...{hint}{found}")

    def finish(self) -> None:
        unknown = sorted(set(self.table) - self.used)
        if unknown:
            raise self.fail(unknown[0], f"unknown key (known here: {', '.join(sorted(self.used))})")


def _parse_layers(raw: Any, where: str, source: str, names: set[str], depth: int = 1) -> tuple[Layer, ...]:
    if depth > MAX_NESTING:
        raise CaseError(f"{source}: {where}: layers nest more than {MAX_NESTING} deep; flatten the case")
    if not isinstance(raw, list) or not raw or not all(isinstance(x, dict) for x in raw):
        raise CaseError(f"{source}: {where}: expected a non-empty array of tables ([[{where}]])")
    layers = []
    for i, table in enumerate(raw):
        r = _Reader(table, f"{where}[{i}].", source)
        kind = r.get("type", str, choices=LAYER_TYPES)
        name = r.get("name", str)
        if not _LAYER_NAME.fullmatch(name):
            raise r.fail("name", f"{name!r} is not a layer name: use letters, digits, '_' and '-' "
                         "(no '.', '/' or spaces), as in 'block0' or 'ffn-in'")
        if name in names:
            raise r.fail("name", f"{name!r} is used twice; give every layer a distinct name")
        names.add(name)
        options: dict[str, Any] = {}
        body: tuple[Layer, ...] = ()
        if kind == "embedding":
            options["dim"] = r.positive("dim")
        elif kind in ("dense", "shared_dense"):
            options["units"] = r.positive("units")
            options["bias"] = r.get("bias", bool, True)
            if kind == "shared_dense":
                scales = r.get("scales", list)
                if not scales or not all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in scales):
                    raise r.fail("scales", f"expected a non-empty list of numbers, got {scales!r}")
                options["scales"] = tuple(float(s) for s in scales)
        elif kind == "activation":
            options["fn"] = r.get("fn", str, choices=ACTIVATIONS)
        elif kind == "attention":
            options["heads"] = r.positive("heads", 1)
            options["bias"] = r.get("bias", bool, False)
            options["out_proj"] = r.get("out_proj", bool, True)
        elif kind in ("residual", "block", "conditional"):
            if kind == "conditional":
                options["every"] = r.positive("every")
            r.used.add("body")
            # A residual shares its parent's namespace; a block opens a new one.
            scope = names if kind == "residual" else set()
            body = _parse_layers(table.get("body"), f"{where}[{i}].body", source, scope, depth + 1)
        elif kind == "tied_output":
            options["tie"] = r.get("tie", str)
            options["bias"] = r.get("bias", bool, False)
        r.finish()
        layers.append(Layer(kind, name, options, body))
    return tuple(layers)


def _check_shapes(layers: tuple[Layer, ...], inp: InputSpec, source: str, where: str = "layers",
                  dim: int | None = None, embeddings: dict | None = None) -> int:
    """Check that the layers fit together; return the output size."""
    embeddings = {} if embeddings is None else embeddings
    dim = (None if inp.kind == "tokens" else inp.features) if dim is None else dim
    for i, layer in enumerate(layers):
        at = f"{source}: {where}[{i}] ({layer.type} {layer.name!r})"
        if layer.type == "embedding":
            if inp.kind != "tokens" or dim is not None or where != "layers":
                raise CaseError(f"{at}: an embedding must be the first top-level layer and needs "
                                "[input] kind = 'tokens'")
            embeddings[layer.name] = (inp.vocab, layer.options["dim"])
            dim = layer.options["dim"]
            continue
        if dim is None:
            raise CaseError(f"{at}: token inputs must go through an embedding first")
        if layer.type in ("dense", "shared_dense"):
            dim = layer.options["units"]
        elif layer.type == "attention":
            if inp.kind != "tokens":
                raise CaseError(f"{at}: attention needs sequences; set [input] kind = 'tokens'")
            if dim % layer.options["heads"]:
                raise CaseError(f"{at}: heads = {layer.options['heads']} must divide the width {dim}")
        elif layer.type == "residual":
            out = _check_shapes(layer.body, inp, source, f"{where}[{i}].body", dim, embeddings)
            if out != dim:
                raise CaseError(f"{at}: its body maps width {dim} to {out}; a residual needs equal widths")
        elif layer.type == "block":
            dim = _check_shapes(layer.body, inp, source, f"{where}[{i}].body", dim, embeddings)
        elif layer.type == "conditional":
            out = _check_shapes(layer.body, inp, source, f"{where}[{i}].body", dim, embeddings)
            if out != dim:
                raise CaseError(f"{at}: its body maps width {dim} to {out}; a conditional branch needs equal widths")
        elif layer.type == "tied_output":
            tie = layer.options["tie"]
            if tie not in embeddings:
                raise CaseError(f"{at}: tie = {tie!r} names no earlier embedding layer")
            if embeddings[tie][1] != dim:
                raise CaseError(f"{at}: width {dim} differs from embedding {tie!r} dim {embeddings[tie][1]}")
            dim = embeddings[tie][0]
    return dim


def parse_case(text: str, source: str = "<memory>") -> Case:
    """Parse and validate case TOML text. Raises CaseError naming ``source``, the key and the fix."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CaseError(f"{source}: not valid TOML: {exc}") from None
    except RecursionError:
        raise CaseError(f"{source}: nests too deeply to be a case (layers nest {MAX_NESTING} deep at most)") from None
    top = _Reader(doc, "", source)
    name = top.get("name", str)
    if not name.strip() or not name.isprintable():
        raise top.fail("name", f"{name!r} must be printable text, not empty")
    description = top.get("description", str, "")
    seed = top.get("seed", int, 0)
    if not 0 <= seed < SEED_LIMIT:
        raise top.fail("seed", f"must be between 0 and 2**32 - 1, got {seed}")
    accum_steps = top.positive("accum_steps", 16)

    ri = _Reader(top.get("input", dict), "[input].", source)
    kind = ri.get("kind", str, choices=("tokens", "features"))
    if kind == "tokens":
        inp = InputSpec(kind, ri.positive("batch_size"), vocab=ri.positive("vocab"),
                        seq_len=ri.positive("seq_len"), min_len=ri.get("min_len", int, 0))
        if not 0 <= inp.min_len <= inp.seq_len:
            raise ri.fail("min_len", f"must be between 0 (no padding) and seq_len = {inp.seq_len}, got {inp.min_len}")
    else:
        inp = InputSpec(kind, ri.positive("batch_size"), features=ri.positive("features"),
                        scale=ri.get("scale", float, 1.0), spread=ri.get("spread", float, 0.0))
        if inp.spread < 0:
            raise ri.fail("spread", f"must be >= 0 (0: independent samples), got {inp.spread}")
    labels = ri.get("labels", str, "random", choices=("random", "alternate"))
    distinct = ri.get("distinct_batches", int, 0)
    if distinct < 0:
        raise ri.fail("distinct_batches", f"must be >= 0 (0 means a fresh batch every step), got {distinct}")
    ri.finish()
    inp = dataclasses.replace(inp, labels=labels, distinct_batches=distinct)

    rl = _Reader(top.get("loss", dict, {}), "[loss].", source)
    rl.get("kind", str, "softmax_cross_entropy", choices=("softmax_cross_entropy",))
    reduction = rl.get("reduction", str, "mean", choices=REDUCTIONS)
    rl.finish()

    rn = _Reader(top.get("init", dict, {}), "[init].", source)
    rn.get("scheme", str, "xavier", choices=("xavier",))
    magnitude = rn.get("magnitude", float, 3.0)
    scale = rn.get("scale", float, 1.0)
    if magnitude <= 0 or scale == 0:
        raise rn.fail("magnitude" if magnitude <= 0 else "scale", "must be non-zero and magnitude positive")
    rn.finish()

    top.used.add("layers")
    layers = _parse_layers(doc.get("layers"), "layers", source, set())
    top.finish()
    classes = _check_shapes(layers, inp, source)
    if classes < 2:
        raise CaseError(f"{source}: layers: the last layer has width {classes}; "
                        "softmax cross-entropy needs at least 2 classes")
    return Case(name, description, seed, accum_steps, inp, reduction, magnitude, scale, layers,
                source=source, text=text)


def load_case(path: str | Path) -> Case:
    """Load a case TOML file. Raises CaseError when it is missing or malformed."""
    try:
        text = read_text(path, "case file", MAX_CASE_BYTES)
    except AccumcheckError as exc:
        raise CaseError(str(exc)) from None
    return parse_case(text, str(path))


def builtin_case_names() -> list[str]:
    """Names of the built-in cases, sorted."""
    folder = resources.files("accumcheck.builtin_cases")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))


def builtin_cases() -> list[Case]:
    """Every built-in case, by name."""
    return [builtin_case(name) for name in builtin_case_names()]


@functools.cache  # a Case is immutable; parsing and checking its TOML takes milliseconds
def builtin_case(name: str) -> Case:
    folder = resources.files("accumcheck.builtin_cases")
    entry = folder / f"{name}.toml"
    if not entry.is_file():
        raise CaseError(f"unknown case {name!r}; built-in cases: {', '.join(builtin_case_names())} "
                        "(or pass the path of a case .toml file)")
    return parse_case(entry.read_text(), f"case {name!r}")


def resolve_case(case: "str | Path | Case") -> Case:
    """A Case from a Case, a built-in name, or a path to a TOML file."""
    if isinstance(case, Case):
        return case
    text = str(case)
    if text.endswith(".toml") or "/" in text or Path(text).is_file():
        return load_case(text)
    return builtin_case(text)


