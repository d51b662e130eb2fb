"""Hugging Face ``Trainer`` under the training stack check: K optimizer steps of your Trainer as
configured, each step's gradient (read before clipping) against its window's micro-batches as one
batch.

    from accumcheck.integrations.transformers import check

    report = check(trainer, steps=3)
    print(accumcheck.render.render(report, "table"))

``run_case(case, accum_steps, batches=None, fault=None)`` runs a built-in case through a Trainer.
The names live in ``accumcheck.frameworks.torch.stacks.transformers``; importing this module
imports neither torch nor transformers, using a name does (a missing one is one AccumcheckError
saying how to install it).
"""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import AccumcheckError

_NAMES = ("check", "run_case")
__all__ = [*_NAMES]
_HOME = "accumcheck.frameworks.torch.stacks.transformers"


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(_HOME)
    except ModuleNotFoundError as exc:
        if (exc.name or "").startswith("accumcheck"):
            raise
        raise AccumcheckError(f"accumcheck.integrations.transformers needs PyTorch ({exc.name} is not installed); "
                              "pip install 'accumcheck[transformers]'") from None
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
