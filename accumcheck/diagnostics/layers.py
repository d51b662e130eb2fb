"""Which parameters make a layer, and which layers to watch (no framework imports)."""

from __future__ import annotations

import fnmatch
import os
import re
from typing import Sequence

import numpy as np

from ..errors import AccumcheckError

DEFAULT_LAYERS = "0,1,n//2,-2,-1"

def _numbered(name: str) -> list[tuple[str, str, int]]:
    """Every numbered component of a name, as (layer key, stem, number): "enc.layers.3.w" gives
    ("enc.layers.3", "enc.layers.", 3); "block0.attn.w" gives ("block0", "block", 0)."""
    sep = _separator(name)
    parts = name.split(sep)
    found = []
    for j, part in enumerate(parts[:-1]):
        if part.isdigit():
            found.append((sep.join(parts[: j + 1]), sep.join(parts[:j]) + sep, int(part)))
            continue
        match = re.fullmatch(r"([A-Za-z_]+?)(\d+)", part)
        if match:
            found.append((sep.join(parts[: j + 1]), sep.join(parts[:j] + [match.group(1)]), int(match.group(2))))
    return found


def _separator(name: str) -> str:
    """PyTorch names are dotted ("layers.0.weight"); Gluon 1.x joins with "_" ("dense0_weight")."""
    return "." if "." in name else "_"


def layer_groups(names: Sequence[str]) -> tuple[dict[str, list[int]], list[str]]:
    """Group parameter indices by layer. Returns (layer -> parameter indices, in model order) and
    the repeated blocks, in order of their number: the numbered layers of the stem with the most
    of them ("layers.0" ... "layers.11"), which is what layer indices count."""
    # A prefix every name shares ("net0_" in Gluon, "model." in a wrapper) names no layer.
    common = os.path.commonprefix(list(names)) if len(names) > 1 else ""
    cut = max(common.rfind("."), common.rfind("_")) + 1
    if not all("." in n[cut:] or "_" in n[cut:] for n in names):
        cut = 0
    short = [n[cut:] for n in names]
    stems: dict[str, dict[str, int]] = {}
    for name in short:
        for key, stem, number in _numbered(name):
            stems.setdefault(stem, {})[key] = number
    members = max(stems.values(), key=len) if stems else {}
    if len(members) < 2:
        members = {}
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(short):
        key = next((k for k, _, _ in _numbered(name) if k in members), None)
        if key is None:
            sep = _separator(name)
            key = name.rsplit(sep, 1)[0] if sep in name else name
        groups.setdefault(key, []).append(i)
    return groups, sorted(members, key=members.get)


def select_layers(names: Sequence[str], spec: str | Sequence[int] | Sequence[str] | None = DEFAULT_LAYERS) -> list[str]:
    """The layers to watch. ``spec``: "all"; indices over the repeated blocks, negative ones
    counting from the end ("0,1,n//2,-2,-1" or [0, -1]); or name globs ("*.attn*"). Without
    repeated blocks, index specs watch every layer. Raises AccumcheckError for a bad spec."""
    groups, blocks = layer_groups(names)
    if spec is None or spec == "all":
        return list(groups)
    items = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    if all(isinstance(i, int) or _is_index(i) for i in items):
        if not blocks:
            return list(groups)
        n = len(blocks)
        chosen = []
        for item in items:
            index = item if isinstance(item, int) else _index(item, n)
            if not -n <= index < n:
                raise AccumcheckError(f"layers: index {item} is out of range for {n} repeated blocks")
            key = blocks[index]
            if key not in chosen:
                chosen.append(key)
        return chosen
    chosen = [key for key in groups if any(fnmatch.fnmatch(key, str(p)) or
                                           any(fnmatch.fnmatch(names[i], str(p)) for i in groups[key]) for p in items)]
    if not chosen:
        raise AccumcheckError(f"layers: no layer matches {spec!r}; layers are {', '.join(groups)}")
    return chosen


def _is_index(item: object) -> bool:
    return isinstance(item, str) and re.fullmatch(r"-?\d+|n//\d+|n-\d+", item.replace(" ", "")) is not None


def _index(item: str, n: int) -> int:
    item = item.replace(" ", "")
    if item.startswith("n//"):
        return n // int(item[3:])
    if item.startswith("n-"):
        return n - int(item[2:])
    return int(item)


def layer_norms(names: Sequence[str], grads: Sequence[np.ndarray]) -> dict[str, float]:
    """Per-layer L2 norms of gradients held on the host, layer by layer in model order."""
    groups, _ = layer_groups(list(names))
    return {key: float(np.sqrt(sum(float(np.square(grads[i], dtype=np.float64).sum()) for i in idx)))
            for key, idx in groups.items()}
