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

from . import lazy_face

_NAMES = ("AccumulationCheck", "run_case")  # defined in accumcheck.frameworks.torch.stacks.accelerate, loaded when first used
__all__ = [*_NAMES]
__getattr__, __dir__ = lazy_face(__name__, "accumcheck.frameworks.torch.stacks.accelerate", _NAMES, needs=("accelerate",),
                                 what="accelerate and PyTorch", install="pip install 'accumcheck[accelerate]'")
