"""Framework backends, one module each, imported only when asked for.

Rules of this package: the core never imports a framework; a backend module imports its framework
inside its functions, so that listing or detecting backends stays cheap; a framework that is
missing or broken becomes one AccumcheckError that says how to install it. Adding a framework
means adding one module and one line in ``_BACKENDS``.
"""

from __future__ import annotations

import importlib
import importlib.util

from ..errors import AccumcheckError
from .base import Backend, ParamAccumulation, RunResult

# framework name -> (backend module, the framework's import name, pip extra)
_BACKENDS = {
    "torch": ("accumcheck.backends.torch_backend", "torch", "torch"),
    "mxnet": ("accumcheck.backends.mxnet_backend", "mxnet", "mxnet"),
}
FRAMEWORKS = tuple(_BACKENDS)

__all__ = ["Backend", "ParamAccumulation", "RunResult", "FRAMEWORKS", "get_backend", "installed_frameworks"]


def installed_frameworks() -> list[str]:
    """Frameworks whose package can be found, without importing them."""
    return [name for name, (_, package, _) in _BACKENDS.items() if importlib.util.find_spec(package)]


def get_backend(name: str) -> Backend:
    """The backend for ``name``. Raises AccumcheckError if unknown or not installed."""
    if name not in _BACKENDS:
        raise AccumcheckError(f"--framework: unknown framework {name!r}; choose one of {', '.join(FRAMEWORKS)}")
    module_name, package, extra = _BACKENDS[name]
    if importlib.util.find_spec(package) is None:
        raise AccumcheckError(f"--framework {name}: {package} is not installed; "
                              f"pip install 'accumcheck[{extra}]'")
    module = importlib.import_module(module_name)
    return module.BACKEND_CLASS()
