"""Lab 02 — the CUDA programming model with numba.cuda.

Every kernel here gives one thread one output element. A launch starts a *grid*
of *blocks* of *threads*; a thread finds its element from its global index, and
threads whose index falls past the end of the data must do nothing (the guard).

On a machine without a GPU, start Python with ``NUMBA_ENABLE_CUDASIM=1`` (the
handout and the grader do it for you): the same code then runs in numba's CUDA
simulator, slowly, one Python thread per CUDA thread.

Run the checks with ``k2c grade 02`` (from the repository root).
"""
import numpy as np
from numba import cuda


def launch_config(n, threads_per_block=256):
    """Return ``(blocks_per_grid, threads_per_block)`` for a 1-D launch that gives
    at least one thread to each of ``n`` elements, with as few blocks as possible."""
    raise NotImplementedError('not implemented yet: launch_config: round the division up, in integer arithmetic')


@cuda.jit
def relu_kernel(out, x):
    """``out[i] = max(x[i], 0)`` — a map: one thread per element."""
    raise NotImplementedError("not implemented yet: relu_kernel: find this thread's element, guard against the end of the data, write it")


@cuda.jit
def saxpy_kernel(out, a, x, y):
    """``out[i] = a * x[i] + y[i]`` — a zip of two arrays."""
    raise NotImplementedError('not implemented yet: saxpy_kernel: global index from blockIdx, blockDim and threadIdx; guard; write')


@cuda.jit
def broadcast_add_kernel(out, col, row):
    """``out[i, j] = col[i] + row[j]`` for ``out`` of shape ``(col.size, row.size)``.

    Convention: the grid's *x* dimension runs along the columns ``j`` (the
    fast-moving index in memory, so neighbouring threads touch neighbouring
    addresses) and *y* along the rows ``i``.
    """
    raise NotImplementedError('not implemented yet: broadcast_add_kernel: a 2-D global index (x along columns), a guard on both dimensions')


def relu(x, threads_per_block=256):
    """Host side: copy ``x`` to the device, launch ``relu_kernel``, return a NumPy array."""
    raise NotImplementedError('not implemented yet: relu: cuda.to_device, cuda.device_array_like, launch with launch_config, copy_to_host')


def saxpy(a, x, y, threads_per_block=256):
    """Host side: ``a * x + y`` computed by ``saxpy_kernel``; returns a NumPy array."""
    raise NotImplementedError('not implemented yet: saxpy: copy x and y in, allocate out on the device, launch, copy out back')


def broadcast_add(col, row, block=(16, 16)):
    """Host side: the ``(col.size, row.size)`` table ``col[i] + row[j]``.

    ``block`` is ``(threads along x, threads along y)``.
    """
    raise NotImplementedError('not implemented yet: broadcast_add: a 2-D grid that covers the table (x along columns), launch, copy back')
