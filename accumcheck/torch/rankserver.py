"""What the fork server that starts data-parallel ranks (``forkserver``) loads once, so that no rank
loads it again: PyTorch and the runner (this module's import), ``torch._dynamo`` (which
DistributedDataParallel's constructor imports on first use, to read its optimizer mode), and the
compiled kernels each rank's micro-steps call (``hostsums.add_held``, ``add_step`` and ``add_ranks``,
read from numba's cache).
Calling a numba kernel runs no PyTorch operation: the server still has no thread a fork could break.
Then every object the server holds is moved out of the garbage collector's sight (``gc.freeze``): a
rank inherits them and never frees them, and its collections, the full one before it leaves the
process group included, look only at its own objects."""

from __future__ import annotations

import gc

import numpy as np
import torch._dynamo  # noqa: F401  (DistributedDataParallel's constructor reads it)

from ..judge.hostsums import add_held, add_ranks, add_step
from . import distributed  # noqa: F401  (imported here once, for every rank)

_step = np.zeros(1, np.float32)
add_held(np.array([[_step.ctypes.data]], np.int64), np.array([0, 1], np.int64), np.zeros(1, np.float32), np.zeros(1),
         np.zeros(1))
add_step(_step, np.zeros(1, np.float32), np.zeros(1), np.zeros(1))
for _manual in (np.zeros(1, np.float32), np.zeros(1)):  # rank 0's sums, for either manual buffer
    add_ranks(_step, np.array([_step.ctypes.data], np.int64), np.zeros(1, np.float32), _step, _manual, 2)
gc.freeze()
