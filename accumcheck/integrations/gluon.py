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

from . import lazy_face

_NAMES = ("AccumulationCheck", "run_case")  # defined in accumcheck.frameworks.mxnet.stack, loaded when first used
__all__ = [*_NAMES]
__getattr__, __dir__ = lazy_face(__name__, "accumcheck.frameworks.mxnet.stack", _NAMES, needs=(),
                                 what="MXNet", install="pip install 'accumcheck[mxnet]'")
