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
    # BEGIN SOLUTION: Round the division up, in integer arithmetic.
    blocks = (n + threads_per_block - 1) // threads_per_block
    return blocks, threads_per_block
    # END SOLUTION


@cuda.jit
def relu_kernel(out, x):
    """The ReLU of ``x`` into ``out`` (same size): each element of ``x``, or zero
    where it is negative. A map: one thread per element."""
    # BEGIN SOLUTION: Find this thread's element, guard against the end of the data, and write it.
    i = cuda.grid(1)
    if i < x.size:
        out[i] = max(x[i], 0.0)
    # END SOLUTION


@cuda.jit
def saxpy_kernel(out, a, x, y):
    """SAXPY into ``out``: the scalar ``a`` times each element of ``x``, plus the
    element of ``y`` at the same position. A zip of two arrays."""
    # BEGIN SOLUTION: Build the global index by hand from the block's position, the block size and the thread's position; guard; write.
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < out.size:
        out[i] = a * x[i] + y[i]
    # END SOLUTION


@cuda.jit
def broadcast_add_kernel(out, col, row):
    """The addition table of ``col`` and ``row``: ``out`` has shape
    ``(col.size, row.size)``, and its entry in row ``i``, column ``j`` is element
    ``i`` of ``col`` plus element ``j`` of ``row``.

    Convention: the grid's *x* dimension runs along the columns ``j`` (the
    fast-moving index in memory, so neighbouring threads touch neighbouring
    addresses) and *y* along the rows ``i``.
    """
    # BEGIN SOLUTION: A 2-D global index with x along the columns, and a guard on both dimensions.
    j, i = cuda.grid(2)
    if i < out.shape[0] and j < out.shape[1]:
        out[i, j] = col[i] + row[j]
    # END SOLUTION


def relu(x, threads_per_block=256):
    """Host side: copy ``x`` to the device, launch ``relu_kernel``, return a NumPy array."""
    # BEGIN SOLUTION: Copy the input to the device, allocate the output there, launch with launch_config, and copy the result back.
    d_x = cuda.to_device(np.ascontiguousarray(x))
    d_out = cuda.device_array_like(d_x)
    blocks, threads = launch_config(x.size, threads_per_block)
    relu_kernel[blocks, threads](d_out, d_x)
    return d_out.copy_to_host()
    # END SOLUTION


def saxpy(a, x, y, threads_per_block=256):
    """Host side: ``a * x + y`` computed by ``saxpy_kernel``; returns a NumPy array."""
    # BEGIN SOLUTION: Copy both inputs in, allocate the output on the device, launch, and copy the output back.
    d_x = cuda.to_device(np.ascontiguousarray(x))
    d_y = cuda.to_device(np.ascontiguousarray(y))
    d_out = cuda.device_array_like(d_x)
    blocks, threads = launch_config(x.size, threads_per_block)
    saxpy_kernel[blocks, threads](d_out, x.dtype.type(a), d_x, d_y)
    return d_out.copy_to_host()
    # END SOLUTION


def broadcast_add(col, row, block=(16, 16)):
    """Host side: the addition table of ``col`` and ``row`` (see ``broadcast_add_kernel``),
    as a NumPy array of shape ``(col.size, row.size)``.

    ``block`` is ``(threads along x, threads along y)``.
    """
    # BEGIN SOLUTION: A 2-D grid that covers the whole table, x along its columns; launch, then copy the table back.
    d_col = cuda.to_device(np.ascontiguousarray(col))
    d_row = cuda.to_device(np.ascontiguousarray(row))
    dtype = np.result_type(col.dtype, row.dtype)
    d_out = cuda.device_array((col.size, row.size), dtype=dtype)
    grid = (launch_config(row.size, block[0])[0], launch_config(col.size, block[1])[0])
    broadcast_add_kernel[grid, block](d_out, d_col, d_row)
    return d_out.copy_to_host()
    # END SOLUTION
