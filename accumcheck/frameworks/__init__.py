"""Framework packages: the only place torch, mxnet and jax are named.

Rules of this package: one package per framework; its ``backend`` module declares the backend
(found through the ``accumcheck.backends`` entry-point group) and imports its framework only
inside its methods, so that finding and listing backends never imports a framework. The other
modules of a framework package may import it at the top: they are loaded only when it is used.
Frameworks share ``hostsums`` (compiled host-side sums) and the core; a framework package may
borrow from another only inside a function, where that framework may be missing.

The public paths ``accumcheck.<framework>`` (``accumcheck.torch``, ``accumcheck.jax``, ...) and
``accumcheck.diagnostics.torch`` and ``.mxnet`` are modules of these packages under shorter names:
``public_target`` maps them, and ``install_public_paths`` (run by ``import accumcheck``) lets the
import system find them, as the same module objects.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

PUBLIC_PATHS = {
    "accumcheck.diagnostics.torch": "accumcheck.frameworks.torch.diagnostics",
    "accumcheck.diagnostics.mxnet": "accumcheck.frameworks.mxnet.diagnostics",
}
FRAMEWORKS = Path(__file__).resolve().parent


def public_target(name: str) -> str | None:
    """The module a public path names: ``accumcheck.<framework>`` is the framework's package here
    (a new framework package gets its public path without an edit), the others PUBLIC_PATHS'."""
    if name in PUBLIC_PATHS:
        return PUBLIC_PATHS[name]
    package, _, framework = name.partition(".")
    if package == "accumcheck" and framework.isidentifier() and (FRAMEWORKS / framework / "__init__.py").is_file():
        return f"accumcheck.frameworks.{framework}"
    return None


class _PublicPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a public path and hands out the module it names (imported under its own name)."""

    def __init__(self) -> None:
        self._own_specs: dict[str, Any] = {}

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(name, self) if public_target(name) else None

    def create_module(self, spec: Any) -> ModuleType:
        module = importlib.import_module(public_target(spec.name))
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
