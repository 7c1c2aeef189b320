"""The two numba kernels of ``course.gpu_devices.NumbaDevice``: hashed inputs and the L2 flush.

``hashed`` is ``course.gpu_timing.hashed`` element by element (the grader computes the
same numbers with NumPy). Imported only once numba.cuda may be imported.
"""
import numpy as np
from numba import cuda

from course.gpu_timing import _GOLDEN, _M32, _MIX1, _MIX2

MASK, GOLDEN, MIX1, MIX2 = _M32, _GOLDEN, _MIX1, _MIX2


@cuda.jit(device=True)
def _fmix(h):
    h = h ^ (h >> np.uint64(16))
    h = (h * MIX1) & MASK
    h = h ^ (h >> np.uint64(13))
    h = (h * MIX2) & MASK
    return h ^ (h >> np.uint64(16))


@cuda.jit
def hashed(values, key, low, span):
    # A grid-stride loop: any grid fills any size.
    position, stride = cuda.grid(1), cuda.gridsize(1)
    for slot in range(position, values.size, stride):
        bits = _fmix(((np.uint64(slot) & MASK) * GOLDEN + key) & MASK) >> np.uint64(8)
        values[slot] = np.float64(bits) * 2.0 ** -24 * span + low


@cuda.jit
def fill(buffer, value):
    position, stride = cuda.grid(1), cuda.gridsize(1)
    for slot in range(position, buffer.size, stride):
        buffer[slot] = value
