"""accumcheck: does your gradient accumulation compute what you think it computes?

Runs the same seeded model with native accumulation (PyTorch ``.grad`` accumulating across
``backward()``, MXNet ``grad_req='add'``) and manual accumulation (zero/write each micro-step,
add into a buffer), and judges every parameter tensor against floating-point error bounds.

Importing the package imports nothing else (its names are loaded when first used, PEP 562), so
the pytest plugin costs a test run that does not use it next to nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

from .version import __version__

# name -> the module that defines it
_EXPORTS = {
    "compare": "api", "compare_frameworks": "api", "sweep": "api", "train": "api",
    "assert_faithful": "assertions", "AccumulationMismatch": "assertions",
    "AccumcheckError": "errors", "NothingJudgedError": "errors", "UserCodeError": "errors",
    "RunConfig": "run.config", "configure": "run.validation",
    "Report": "report", "TensorResult": "report", "CrossReport": "report", "load_report": "report",
    "Backend": "run.backend", "Capabilities": "run.backend", "register_backend": "run.registry",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
