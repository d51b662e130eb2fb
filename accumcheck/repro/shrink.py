"""``accumcheck compare --repro FILE.py --shrink``: the smallest case that still shows the finding,
as a test-case reducer finds it.

From the case and N of a flagged run, each reduction is tried in turn: halve N (not below the
smallest the fault needs, 2), drop a layer (a block with its body), halve a width everywhere it
occurs and then one layer's width (units, dims), halve attention heads, drop one use of a shared
weight, halve the vocabulary, the features, the batch and the sequence length. A reduction is
kept when the case still builds and a run (``trial``: the same framework, device, fault and
options) still flags the tensor the report was about, or else a tensor of the same kind; the
reductions then start again from the smaller case (those that lost the finding once are tried
last), until none helps or the trials run out. Every kept case is no larger than the one before
in every measure (``size``) and smaller in one.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ..case.definition import Case, CaseError
from ..case.reading import parse_case
from ..errors import AccumcheckError

MAX_TRIALS = 48  # runs a shrink may spend
MIN_STEPS = 2  # below it no running total exists for a fault (or a bug) to act on

Trial = Callable[[Case, int], Any]  # (case, N) -> the run's Report; AccumcheckError where it cannot run
MEASURES = ("parameters", "N", "layers", "batch", "sequence", "heads", "uses")


# ----------------------------------------------------------------------------- the case as TOML


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


def _layer_lines(layer: dict[str, Any], header: str, depth: int) -> list[str]:
    pad = "  " * depth
    lines = ["", f"{pad}[[{header}]]"]
    lines += [f"{pad}{key} = {_value(value)}" for key, value in layer.items() if key != "body"]
    for child in layer.get("body", []):
        lines += _layer_lines(child, header + ".body", depth + 1)
    return lines


def case_toml(doc: dict[str, Any]) -> str:
    """A case document (``Case.to_document()``) as case-file TOML (``accumcheck compare --case``)."""
    lines = [f"{key} = {_value(doc[key])}" for key in ("name", "description", "seed", "accum_steps") if key in doc]
    for table in ("input", "loss", "init"):
        if table in doc:
            lines += ["", f"[{table}]"] + [f"{key} = {_value(value)}" for key, value in doc[table].items()]
    for layer in doc["layers"]:
        lines += _layer_lines(layer, "layers", 0)
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- measures


def size(case: Case, accum_steps: int) -> dict[str, int]:
    """What a shrink makes smaller: parameters, N, layers, batch size, sequence length, heads and
    the uses of shared weights."""
    layers = case.all_layers()
    return {"parameters": sum(p.numel for p in case.parameters()), "N": accum_steps, "layers": len(layers),
            "batch": case.input.batch_size, "sequence": case.input.seq_len,
            "heads": sum(layer.options.get("heads", 0) for layer in layers),
            "uses": sum(len(layer.options.get("scales", ())) for layer in layers)}


def smaller(new: dict[str, int], old: dict[str, int]) -> bool:
    """No measure larger, and one smaller."""
    return all(new[m] <= old[m] for m in MEASURES) and any(new[m] < old[m] for m in MEASURES)


def summary(before: dict[str, int], after: dict[str, int]) -> str:
    """``parameters 1234 -> 56, N 16 -> 2, ...``: the measures that changed (parameters and N always)."""
    words = [f"{before['parameters']} -> {after['parameters']} parameters", f"N {before['N']} -> {after['N']}"]
    words += [f"{m} {before[m]} -> {after[m]}" for m in MEASURES[2:] if before[m] != after[m]]
    return ", ".join(words)


# ----------------------------------------------------------------------------- the reductions


def _layers(layers: list[dict[str, Any]], path: tuple[int, ...] = ()) -> Iterator[tuple[tuple[int, ...], dict]]:
    """Every layer document with its path (indices from the top), parents before their bodies."""
    for i, layer in enumerate(layers):
        yield path + (i,), layer
        yield from _layers(layer.get("body", []), path + (i,))


def _at(doc: dict[str, Any], path: tuple[int, ...]) -> tuple[list[dict[str, Any]], int]:
    """The list holding the layer at ``path``, and its index there."""
    layers = doc["layers"]
    for i in path[:-1]:
        layers = layers[i]["body"]
    return layers, path[-1]


def _edited(doc: dict[str, Any], edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    new = copy.deepcopy(doc)
    edit(new)
    return new


def reductions(doc: dict[str, Any], accum_steps: int, min_steps: int) -> Iterator[tuple[str, dict[str, Any], int]]:
    """(what, the reduced document, N) for every reduction of ``doc`` at ``accum_steps``, the
    ones that cut most first; some may not build (the caller checks)."""
    half = accum_steps // 2
    if half >= min_steps:
        yield f"N {accum_steps} -> {half}", doc, half
    for path, layer in _layers(doc["layers"]):
        def drop(new: dict[str, Any], path: tuple[int, ...] = path) -> None:
            layers, i = _at(new, path)
            del layers[i]
        yield f"drop {layer['type']} layer {layer['name']!r}", _edited(doc, drop), accum_steps
    widths = sorted({layer[k] for _, layer in _layers(doc["layers"]) for k in ("dim", "units") if k in layer},
                    reverse=True)
    for width in widths:
        if width >= 2:
            def halve_all(new: dict[str, Any], width: int = width) -> None:
                for _, layer in _layers(new["layers"]):
                    for key in ("dim", "units"):
                        if layer.get(key) == width:
                            layer[key] = width // 2
            yield f"width {width} -> {width // 2} in every layer", _edited(doc, halve_all), accum_steps
    for path, layer in _layers(doc["layers"]):
        for key in ("dim", "units", "heads"):
            if layer.get(key, 0) >= 2:
                def halve(new: dict[str, Any], path: tuple[int, ...] = path, key: str = key) -> None:
                    layers, i = _at(new, path)
                    layers[i][key] //= 2
                yield f"{key} of {layer['name']!r} {layer[key]} -> {layer[key] // 2}", _edited(doc, halve), accum_steps
        for j, scale in enumerate(layer.get("scales", [])):
            if len(layer["scales"]) >= 2:
                def unscale(new: dict[str, Any], path: tuple[int, ...] = path, j: int = j) -> None:
                    layers, i = _at(new, path)
                    del layers[i]["scales"][j]
                yield f"drop use {j} (scale {scale}) of {layer['name']!r}", _edited(doc, unscale), accum_steps
    inp = doc["input"]
    for key in ("vocab", "features", "batch_size", "seq_len"):
        if inp.get(key, 0) >= 2:
            def halve_input(new: dict[str, Any], key: str = key) -> None:
                new["input"][key] //= 2
                if key == "seq_len":
                    new["input"]["min_len"] = min(new["input"].get("min_len", 0), new["input"]["seq_len"])
            yield f"{key} {inp[key]} -> {inp[key] // 2}", _edited(doc, halve_input), accum_steps


# ----------------------------------------------------------------------------- the loop


@dataclass
class ShrinkResult:
    """Where a shrink ended: the case (``case.text`` its TOML), N, the tensor still flagged
    (name, kind), the last kept run's report (None when nothing was kept), the reductions kept
    and the trials spent."""

    case: Case
    accum_steps: int
    target: tuple[str, str]
    report: Any = None
    kept: list[str] = field(default_factory=list)
    trials: int = 0
    before: dict[str, int] = field(default_factory=dict)
    after: dict[str, int] = field(default_factory=dict)

    def line(self, original: str) -> str:
        return f"shrunk {original}: {summary(self.before, self.after)} ({len(self.kept)} reductions kept, " \
               f"{self.trials} trials)"


def still_flagged(report: Any, target: tuple[str, str]) -> tuple[str, str] | None:
    """The tensor ``report`` flags for ``target`` (name, kind): the same name, else the first
    flagged tensor of the same kind; None when neither is flagged."""
    flagged = list(report.flagged)
    same = next((t for t in flagged if t.name == target[0]), None)
    same = same or next((t for t in flagged if t.kind == target[1]), None)
    return None if same is None else (same.name, same.kind)


def shrink(case: Case, accum_steps: int, trial: Trial, target: tuple[str, str], source: str,
           min_steps: int = MIN_STEPS, max_trials: int = MAX_TRIALS,
           log: Callable[[str], None] | None = None) -> ShrinkResult:
    """Reduce ``case`` at ``accum_steps`` while ``trial`` still flags ``target`` (name, kind).
    Candidates are parsed as case files from ``source`` (where the result will be written)."""
    doc = case.to_document()
    doc.update(name=f"{case.name}-shrunk", accum_steps=accum_steps,
               description=f"{case.name} shrunk by accumcheck compare --shrink while {target[0]} stayed flagged.")
    before = size(case, accum_steps)
    result = ShrinkResult(case, accum_steps, target, before=before, after=before)
    rejected: set[tuple[str, int]] = set()
    failed: set[str] = set()  # reductions that lost the finding once are tried after the others
    while result.trials < max_trials:
        candidates = sorted(reductions(doc, result.accum_steps, min_steps), key=lambda c: c[0] in failed)
        for what, reduced, n in candidates:
            reduced = dict(reduced, accum_steps=n)
            try:
                candidate = parse_case(case_toml(reduced), source)
            except CaseError:
                continue  # the layers no longer fit together
            measures = size(candidate, n)
            if (candidate.text, n) in rejected or not smaller(measures, result.after):
                continue
            result.trials += 1
            try:
                report = trial(candidate, n)
                hit = still_flagged(report, result.target)
            except AccumcheckError:
                hit = None
            if hit is None:
                rejected.add((candidate.text, n))
                failed.add(what)
                if result.trials >= max_trials:
                    break
                continue
            if log is not None:
                renamed = f" (now {hit[0]})" if hit[0] != result.target[0] else ""
                log(f"shrink: kept {what}: {summary(result.after, measures)}; {hit[0]} still flagged{renamed}")
            doc, result.case, result.accum_steps, result.target = reduced, candidate, n, hit
            result.report, result.after = report, measures
            result.kept.append(what)
            break
        else:
            break  # no reduction kept the finding
    if result.kept:  # the case says where it came from
        doc["description"] = (f"{case.name} shrunk by accumcheck compare --shrink: {summary(before, result.after)}; "
                              f"{result.target[0]} still flagged.")
        result.case = parse_case(case_toml(doc), source)
    return result
