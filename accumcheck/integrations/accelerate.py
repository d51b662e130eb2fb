"""accelerate under the training stack check: your own loop with ``Accelerator(
gradient_accumulation_steps=N)`` and ``accelerator.accumulate(model)``, each optimizer step's
gradient (read before clipping) against its window's micro-batches as one batch.

    from accumcheck.integrations.accelerate import AccumulationCheck

    check = AccumulationCheck(accelerator, model, optimizer, steps=3)
    with check:
        for batch in check.batches(dataloader):
            with accelerator.accumulate(model):
                ...  # your micro-step: forward, accelerator.backward, clip, optimizer.step, zero_grad
    print(accumcheck.render.render(check.report, "table"))

``run_case(case, accum_steps, batches=None, fault=None)`` runs a built-in case through such a run.
The names live in ``accumcheck.frameworks.torch.stacks.accelerate``; importing this module imports
neither PyTorch nor accelerate, using a name does (a missing one is one AccumcheckError saying how to
install it).
"""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import AccumcheckError

_NAMES = ("AccumulationCheck", "run_case")  # defined in _HOME, loaded when first used (PEP 562)
__all__ = [*_NAMES]
_HOME = "accumcheck.frameworks.torch.stacks.accelerate"
_STACK = "accelerate"


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
