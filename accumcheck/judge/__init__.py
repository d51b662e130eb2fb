"""The judge: a finished run's plain arrays in, verdicts out, each made once.

``statistics`` (the compiled per-tensor pass), ``ratio`` (the one bound ratio), ``verdicts``
(tensor verdicts and the Report), ``dataparallel`` (ranks and the single-process reference),
``agreement`` (two frameworks). Nothing here imports a deep-learning framework.
"""

from .agreement import agreement, forward_agreement
from .verdicts import ILL_CONDITIONED, SEMANTIC_TOLERANCE, build_report, compare_tensor

__all__ = ["ILL_CONDITIONED", "SEMANTIC_TOLERANCE", "agreement", "build_report", "compare_tensor",
           "forward_agreement"]
