"""The judge: a finished run's plain arrays in, verdicts out, each made once.

``statistics`` (the compiled per-tensor pass), ``ratio`` (the one bound ratio), ``verdicts``
(tensor verdicts and the Report), ``dataparallel`` (ranks and the single-process reference),
``attribution`` and ``secondpass`` (why a tensor left its bound, and the statistical tier below
it, from the run's micro-gradients replayed), ``agreement`` (frameworks, pair by pair), ``fullbatch`` (the accumulated gradient against the whole
batch's: equivalent, a constant factor, or a weighting). Nothing here imports a deep-learning
framework.
"""

from .agreement import agreement, forward_agreement, odd_one_out
from .fullbatch import FACTOR_TOLERANCE, SEMANTIC_TOLERANCE, full_batch_verdict
from .verdicts import ILL_CONDITIONED, Judge, build_report, compare_tensor

__all__ = ["FACTOR_TOLERANCE", "ILL_CONDITIONED", "SEMANTIC_TOLERANCE", "Judge", "agreement", "build_report",
           "compare_tensor", "forward_agreement", "full_batch_verdict", "odd_one_out"]
