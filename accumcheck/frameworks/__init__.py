"""Framework packages: the only place torch and mxnet (and later jax) are named.

Rules of this package: one package per framework; its ``backend`` module declares the backend
(found through the ``accumcheck.backends`` entry-point group) and imports its framework only
inside its methods, so that finding and listing backends never imports a framework. The other
modules of a framework package may import it at the top: they are loaded only when it is used.
Frameworks share ``hostsums`` (compiled host-side sums) and the core; a framework package may
borrow from another only inside a function, where that framework may be missing.

The public paths ``accumcheck.torch``, ``accumcheck.mxnet``, ``accumcheck.jax`` and ``accumcheck.diagnostics.torch``
and ``.mxnet`` are modules of these packages under their older, shorter names: PUBLIC_PATHS maps
them, and ``install_public_paths`` (run by ``import accumcheck``) lets the import system find them,
as the same module objects.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any

PUBLIC_PATHS = {
    "accumcheck.torch": "accumcheck.frameworks.torch",
    "accumcheck.mxnet": "accumcheck.frameworks.mxnet",
    "accumcheck.jax": "accumcheck.frameworks.jax",
    "accumcheck.diagnostics.torch": "accumcheck.frameworks.torch.diagnostics",
    "accumcheck.diagnostics.mxnet": "accumcheck.frameworks.mxnet.diagnostics",
}


class _PublicPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a public path and hands out the module it names (imported under its own name)."""

    def __init__(self) -> None:
        self._own_specs: dict[str, Any] = {}

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(name, self) if name in PUBLIC_PATHS else None

    def create_module(self, spec: Any) -> ModuleType:
        module = importlib.import_module(PUBLIC_PATHS[spec.name])
        self._own_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system has just stamped the public path's spec on the module: give it back
        # its own, so that it still reloads and pickles as what it is.
        module.__spec__ = self._own_specs.pop(module.__spec__.name)


def install_public_paths() -> None:
    """Let ``import accumcheck.torch`` (and the other public paths) work; idempotent."""
    if not any(isinstance(finder, _PublicPaths) for finder in sys.meta_path):
        sys.meta_path.append(_PublicPaths())
