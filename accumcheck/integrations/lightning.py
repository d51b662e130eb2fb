"""Lightning under the training stack check: a callback for ``Trainer(accumulate_grad_batches=N)``
that sets each optimizer step's gradient (read before clipping) against its window's micro-batches
as one batch.

    from accumcheck.integrations.lightning import AccumulationCheck

    check = AccumulationCheck(steps=3)
    Trainer(accumulate_grad_batches=4, callbacks=[check]).fit(module, dataloader)
    print(accumcheck.render.render(check.report, "table"))

``run_case(case, accum_steps, batches=None, fault=None)`` runs a built-in case through such a run.
The names live in ``accumcheck.frameworks.torch.stacks.lightning``; importing this module imports
neither PyTorch nor lightning, using a name does (a missing one is one AccumcheckError saying how to
install it).
"""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import AccumcheckError

_NAMES = ("AccumulationCheck", "run_case")  # defined in _HOME, loaded when first used (PEP 562)
__all__ = [*_NAMES]
_HOME = "accumcheck.frameworks.torch.stacks.lightning"
_STACK = "lightning"


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(_HOME)
        importlib.import_module(_STACK)
    except ModuleNotFoundError as exc:
        if (exc.name or "").startswith("accumcheck"):
            raise
        raise AccumcheckError(f"accumcheck.integrations.{_STACK} needs {_STACK} and PyTorch ({exc.name} is not "
                              f"installed); install them with pip install 'accumcheck[{_STACK}]'") from None
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES))
