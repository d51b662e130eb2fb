"""Your parameter pytree as the check reads it: each array's name (from its path), dtype and kind,
and the structure to rebuild it around new arrays."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from ..case.definition import infer_kind
from ..errors import USER_EXCEPTIONS, AccumcheckError, UserCodeError, first_line
from .devices import device_name
from .library import enable_x64

FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")


class ParamTree:
    """The user's parameter pytree: each array leaf's name (from its path), dtype and kind, and
    the tree's structure to rebuild it. Raises AccumcheckError for a tree that is not one of
    float arrays."""

    def __init__(self, params: Any) -> None:
        try:
            leaves, self.treedef = jax.tree_util.tree_flatten_with_path(params)
        except USER_EXCEPTIONS as exc:
            raise UserCodeError(f"check: params could not be flattened as a pytree ({type(exc).__name__}: "
                                  f"{first_line(exc)}); pass a pytree of arrays such as a dict") from exc
        if not leaves:
            raise AccumcheckError("check: params holds no arrays; pass the parameter pytree your loss_fn takes "
                                  "(e.g. a dict of jax arrays)")
        self.names = unique_names([path for path, _ in leaves])
        self.leaves = [leaf for _, leaf in leaves]
        self.dtypes = {name: _float_dtype(name, leaf) for name, leaf in zip(self.names, self.leaves)}
        self.kinds = {name: infer_kind(name, len(leaf.shape)) for name, leaf in zip(self.names, self.leaves)}
        counts = Counter(self.dtypes.values())
        self.param_dtype = max(counts, key=counts.__getitem__)  # the most common; each judged by its own
        # The manual buffer: float32, or float64 where any parameter is float64 (then in JAX's x64 mode).
        self.accum_dtype = "float64" if "float64" in counts else "float32"
        self.device: Any = None  # where ``arrays`` puts them (None: where they are, NumPy ones on the default)

    def place(self, device: Any) -> None:
        """Run on ``device``: params' jax arrays must be there already (as a model must be on the
        device PyTorch's check names); NumPy arrays are put there."""
        on = {device_name(d) for leaf in self.leaves if isinstance(leaf, jax.Array) for d in leaf.devices()}
        elsewhere = sorted(on - {device_name(device)})
        if elsewhere:
            raise AccumcheckError(f"check: params' arrays are on {', '.join(elsewhere)}, not {device_name(device)}; "
                                  f"pass device={elsewhere[0]!r}, or jax.device_put(params, device) first")
        self.device = device

    def wide(self) -> Any:
        """JAX's x64 mode where a parameter is float64 (a context: switched back on leaving it)."""
        return enable_x64() if self.accum_dtype == "float64" else contextlib.nullcontext()

    def arrays(self, dtype: Any = None) -> dict[str, Any]:
        """name -> the leaf as a jax array, in its own dtype or ``dtype`` (new arrays; the user's
        stay as they are). A NumPy leaf is copied: on the CPU ``jnp.asarray`` would share its
        memory, which the user's code could then change under the check."""
        arrays = {name: jnp.array(leaf, dtype=dtype or leaf.dtype, copy=True) if isinstance(leaf, np.ndarray)
                  else jnp.asarray(leaf, dtype=dtype or leaf.dtype) for name, leaf in zip(self.names, self.leaves)}
        return arrays if self.device is None else jax.device_put(arrays, self.device)

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        """Afterwards, also when the check raises: the values of params' NumPy arrays as they were
        (jax arrays cannot change; the user's own code may edit NumPy ones it holds)."""
        saved = [(leaf, leaf.copy()) for leaf in self.leaves if isinstance(leaf, np.ndarray)]
        try:
            yield
        finally:
            for leaf, value in saved:
                if leaf.flags.writeable:
                    leaf[...] = value

    def tree(self, flat: dict[str, Any]) -> Any:
        """The user's structure with the arrays of ``flat``."""
        return self.treedef.unflatten([flat[name] for name in self.names])

    def flat(self, grads: Any) -> dict[str, Any]:
        """A gradient pytree (params' structure) as name -> array."""
        return dict(zip(self.names, self.treedef.flatten_up_to(grads)))


def key_text(key: Any) -> str:
    """One step of a pytree path as a name part: a dict key, a list index, an attribute."""
    for field in ("key", "idx", "name"):  # DictKey, FlattenedIndexKey / SequenceKey / GetAttrKey
        if hasattr(key, field):
            return str(getattr(key, field))
    return str(key)


def unique_names(paths: list[tuple[Any, ...]]) -> list[str]:
    """Dotted names ("params.Dense_0.kernel", "layers.0.w"); where two would read the same, the
    paths as ``jax.tree_util.keystr`` writes them."""
    names = [".".join(key_text(key) for key in path) or "params" for path in paths]
    counts = Counter(names)
    names = [jax.tree_util.keystr(path) if counts[name] > 1 else name for name, path in zip(names, paths)]
    seen: Counter[str] = Counter()
    unique = []
    for name in names:
        seen[name] += 1
        unique.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return unique


def _float_dtype(name: str, leaf: Any) -> str:
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")) or isinstance(leaf, np.generic):
        raise AccumcheckError(f"check: params leaf {name!r} is a {type(leaf).__name__}, not an array; params must be "
                              "a pytree of float arrays (jnp.asarray your values, keep other state out of params)")
    dtype = np.dtype(leaf.dtype).name
    if dtype not in FLOAT_DTYPES:
        raise AccumcheckError(f"check: params leaf {name!r} is {dtype}; every array in params must be float32, "
                              "bfloat16, float16 or float64 (keep non-trainable state out of params)")
    return dtype
