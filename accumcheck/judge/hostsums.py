"""Compiled host-side sums the backends share (numba; no framework imports)."""

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

from .compiled import njit


# Serial on purpose: it runs between two backward passes, where waking a second thread pool
# next to torch's (still spinning) OpenMP threads costs more than the loop itself.
@njit()
def add_step(grad, manual, exact, absum):
    """One fused pass: manual += grad (in manual's dtype), exact += grad and absum += |grad|
    (in float64). All arrays are flat and of the same length."""
    for i in range(grad.size):
        g = grad[i]
        manual[i] += g
        wide = np.float64(g)
        exact[i] += wide
        absum[i] += abs(wide)


@njit()
def add_eight_steps(g0, g1, g2, g3, g4, g5, g6, g7, manual, exact, absum):
    """``add_step`` for eight micro-steps in their order, in one pass: every element's sums take
    the same additions in the same order (bit for bit), but manual, E and S are read and written
    once instead of eight times."""
    for i in range(manual.size):
        x0, x1, x2, x3, x4, x5, x6, x7 = g0[i], g1[i], g2[i], g3[i], g4[i], g5[i], g6[i], g7[i]
        manual[i] = manual[i] + x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7
        w0, w1, w2, w3 = np.float64(x0), np.float64(x1), np.float64(x2), np.float64(x3)
        w4, w5, w6, w7 = np.float64(x4), np.float64(x5), np.float64(x6), np.float64(x7)
        exact[i] = exact[i] + w0 + w1 + w2 + w3 + w4 + w5 + w6 + w7
        absum[i] = absum[i] + abs(w0) + abs(w1) + abs(w2) + abs(w3) + abs(w4) + abs(w5) + abs(w6) + abs(w7)


@intrinsic
def _float32_at(typingctx, address):
    """The float32 pointer to an integer address (a tensor's ``data_ptr()``)."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
    return types.CPointer(types.float32)(types.int64), codegen


@njit()
def add_held(addresses, spans, manual, exact, absum):
    """Held micro-steps into flat manual, E and S in one call: ``addresses[j, k]`` is the address
    of micro-step k's gradient of parameter j, ``spans[j]:spans[j + 1]`` its slice of the flat
    buffers. Each gradient must be float32, contiguous, of its slice's length, and alive for the
    call. Eight steps at a time in one pass (``add_eight_steps``), the rest one by one: the same
    additions in the same order as ``add_step`` step after step (one Python call, not one per
    parameter and step)."""
    steps = addresses.shape[1]
    for j in range(spans.size - 1):
        lo, hi = spans[j], spans[j + 1]
        n = hi - lo
        m, e, s = manual[lo:hi], exact[lo:hi], absum[lo:hi]
        k = 0
        while steps - k >= 8:
            add_eight_steps(numba.carray(_float32_at(addresses[j, k]), n),
                            numba.carray(_float32_at(addresses[j, k + 1]), n),
                            numba.carray(_float32_at(addresses[j, k + 2]), n),
                            numba.carray(_float32_at(addresses[j, k + 3]), n),
                            numba.carray(_float32_at(addresses[j, k + 4]), n),
                            numba.carray(_float32_at(addresses[j, k + 5]), n),
                            numba.carray(_float32_at(addresses[j, k + 6]), n),
                            numba.carray(_float32_at(addresses[j, k + 7]), n), m, e, s)
            k += 8
        while k < steps:
            add_step(numba.carray(_float32_at(addresses[j, k]), n), m, e, s)
            k += 1


@njit()
def add_squares(grad, total, first=False):
    """total += grad in float64, element by element (total = grad with ``first``: a total that
    holds nothing yet is written, not read), and the sum of grad's squares in float64, in one pass
    over ``grad`` (flat arrays of one length; four running sums of the squares, each element's
    square in one of them, so the pass is not one chain of dependent additions)."""
    n = grad.size
    s0 = s1 = s2 = s3 = 0.0
    head = n - n % 4
    for i in range(0, head, 4):
        w0, w1, w2, w3 = np.float64(grad[i]), np.float64(grad[i + 1]), np.float64(grad[i + 2]), np.float64(grad[i + 3])
        if first:
            total[i], total[i + 1], total[i + 2], total[i + 3] = w0, w1, w2, w3
        else:
            total[i] += w0
            total[i + 1] += w1
            total[i + 2] += w2
            total[i + 3] += w3
        s0 += w0 * w0
        s1 += w1 * w1
        s2 += w2 * w2
        s3 += w3 * w3
    for i in range(head, n):
        w = np.float64(grad[i])
        total[i] = w if first else total[i] + w
        s0 += w * w
    return (s0 + s1) + (s2 + s3)


@njit()
def add_ranks(own, addresses, total, mean, manual, world_size):
    """Rank 0's sums of one micro-step of W ranks: ``total`` += each rank's micro-gradient in rank
    order (float32, rounded after each addition, as ``.grad`` accumulates in one process) and
    ``manual`` += their mean (their float32 sum in rank order, divided by W, as an all-reduce of
    them gives). ``own`` is rank 0's flat float32 step and ``addresses[r - 1]`` the address of rank
    r's, of the same length, alive for the call; ``mean`` a float32 scratch array of that length
    (unused for two ranks, whose sums take one pass)."""
    n = own.size
    w = np.float32(world_size)
    last = addresses.size - 1
    for r in range(addresses.size):
        other = numba.carray(_float32_at(addresses[r]), n)
        if r == 0 and r == last:
            for i in range(n):
                g0, g1 = own[i], other[i]
                total[i] = total[i] + g0 + g1
                manual[i] += (g0 + g1) / w
        elif r == 0:
            for i in range(n):
                g0, g1 = own[i], other[i]
                total[i] = total[i] + g0 + g1
                mean[i] = g0 + g1
        elif r == last:
            for i in range(n):
                g = other[i]
                total[i] += g
                manual[i] += (mean[i] + g) / w
        else:
            for i in range(n):
                g = other[i]
                total[i] += g
                mean[i] += g
