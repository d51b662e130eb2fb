"""Training stacks under accumcheck: one module per stack (``transformers``, ``accelerate``,
``lightning``, ``gluon``), each the public face of an adapter in its framework's package. A face
imports neither the framework nor the stack until one of its names is used; a missing one is then
one AccumcheckError saying what to install."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

from ..errors import AccumcheckError


def lazy_face(face: str, home: str, names: tuple[str, ...], needs: tuple[str, ...], what: str,
              install: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` (PEP 562) for the module ``face``: its ``names`` live in
    the module ``home``, which needs the modules ``needs`` (``what``, in words; ``install`` is
    the command that installs them)."""
    def getattr_(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {face!r} has no attribute {name!r}")
        try:
            module = importlib.import_module(home)
            for needed in needs:
                importlib.import_module(needed)
        except ModuleNotFoundError as exc:
            if (exc.name or "").startswith("accumcheck"):
                raise
            raise AccumcheckError(f"{face} needs {what} ({exc.name} is not installed); install them with "
                                  f"{install}") from None
        value = getattr(module, name)
        sys.modules[face].__dict__[name] = value  # loaded once
        return value

    def dir_() -> list[str]:
        return sorted(set(sys.modules[face].__dict__) | set(names))

    return getattr_, dir_
