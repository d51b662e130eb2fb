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

from . import lazy_face

_NAMES = ("check", "run_case")  # defined in accumcheck.frameworks.torch.stacks.transformers, loaded when first used
__all__ = [*_NAMES]
__getattr__, __dir__ = lazy_face(__name__, "accumcheck.frameworks.torch.stacks.transformers", _NAMES,
                                 needs=("transformers", "accelerate"), what="transformers, accelerate and PyTorch",
                                 install="pip install 'accumcheck[transformers]'")
