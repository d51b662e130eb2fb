"""Compiled host-side sums the backends share (numba; no framework imports)."""

import numba
import numpy as np


# Serial on purpose: it runs between two backward passes, where waking a second thread pool
# next to torch's (still spinning) OpenMP threads costs more than the loop itself.
@numba.njit(cache=True, nogil=True)
def add_step(grad, manual, exact, absum):
    """One fused pass: manual += grad (in manual's dtype), exact += grad and absum += |grad|
    (in float64). All arrays are flat and of the same length."""
    for i in range(grad.size):
        g = grad[i]
        manual[i] += g
        wide = np.float64(g)
        exact[i] += wide
        absum[i] += abs(wide)
