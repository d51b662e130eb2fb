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

from . import lazy_face

_NAMES = ("AccumulationCheck", "run_case")  # defined in accumcheck.frameworks.torch.stacks.lightning, loaded when first used
__all__ = [*_NAMES]
__getattr__, __dir__ = lazy_face(__name__, "accumcheck.frameworks.torch.stacks.lightning", _NAMES, needs=("lightning",),
                                 what="lightning and PyTorch", install="pip install 'accumcheck[lightning]'")
