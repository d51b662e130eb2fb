"""MXNet Gluon's ``Trainer`` under the training stack check: at every ``trainer.step`` of your own
loop, the gradient the optimizer is about to apply against its window's micro-batches as one batch.

    from accumcheck.integrations.gluon import AccumulationCheck

    check = AccumulationCheck(net, trainer, loss_fn)
    with check:
        ...  # your loop: x, y = check.record(x, y) per micro-batch, trainer.step(N * b) per window
    print(accumcheck.render.render(check.report, "table"))

``run_case(case, accum_steps, batches=None, fault=None)`` runs a built-in case through such a loop.
The names live in ``accumcheck.frameworks.mxnet.stack``; importing this module does not import
MXNet, using a name does (a missing MXNet is one AccumcheckError saying how to install it).
"""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import AccumcheckError

_NAMES = ("AccumulationCheck", "run_case")  # defined in _HOME, loaded when first used (PEP 562)
__all__ = [*_NAMES]
_HOME = "accumcheck.frameworks.mxnet.stack"


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(_HOME)
    except ModuleNotFoundError as exc:
        if (exc.name or "").startswith("accumcheck"):
            raise
        raise AccumcheckError(f"accumcheck.integrations.gluon needs MXNet ({exc.name} is not installed); "
                              "pip install 'accumcheck[mxnet]'") from None
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES))
