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
    # BEGIN SOLUTION: round the division up, in integer arithmetic
    blocks = (n + threads_per_block - 1) // threads_per_block
    return blocks, threads_per_block
    # END SOLUTION


@cuda.jit
def relu_kernel(out, x):
    """``out[i] = max(x[i], 0)`` — a map: one thread per element."""
    # BEGIN SOLUTION: find this thread's element, guard against the end of the data, write it
    i = cuda.grid(1)
    if i < x.size:
        out[i] = max(x[i], 0.0)
    # END SOLUTION


@cuda.jit
def saxpy_kernel(out, a, x, y):
    """``out[i] = a * x[i] + y[i]`` — a zip of two arrays."""
    # BEGIN SOLUTION: global index from blockIdx, blockDim and threadIdx; guard; write
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < out.size:
        out[i] = a * x[i] + y[i]
    # END SOLUTION


@cuda.jit
def broadcast_add_kernel(out, col, row):
    """``out[i, j] = col[i] + row[j]`` for ``out`` of shape ``(col.size, row.size)``.

    Convention: the grid's *x* dimension runs along the columns ``j`` (the
    fast-moving index in memory, so neighbouring threads touch neighbouring
    addresses) and *y* along the rows ``i``.
    """
    # BEGIN SOLUTION: a 2-D global index (x along columns), a guard on both dimensions
    j, i = cuda.grid(2)
    if i < out.shape[0] and j < out.shape[1]:
        out[i, j] = col[i] + row[j]
    # END SOLUTION


def relu(x, threads_per_block=256):
    """Host side: copy ``x`` to the device, launch ``relu_kernel``, return a NumPy array."""
    # BEGIN SOLUTION: cuda.to_device, cuda.device_array_like, launch with launch_config, copy_to_host
    d_x = cuda.to_device(np.ascontiguousarray(x))
    d_out = cuda.device_array_like(d_x)
    blocks, threads = launch_config(x.size, threads_per_block)
    relu_kernel[blocks, threads](d_out, d_x)
    return d_out.copy_to_host()
    # END SOLUTION


def saxpy(a, x, y, threads_per_block=256):
    """Host side: ``a * x + y`` computed by ``saxpy_kernel``; returns a NumPy array."""
    # BEGIN SOLUTION: copy x and y in, allocate out on the device, launch, copy out back
    d_x = cuda.to_device(np.ascontiguousarray(x))
    d_y = cuda.to_device(np.ascontiguousarray(y))
    d_out = cuda.device_array_like(d_x)
    blocks, threads = launch_config(x.size, threads_per_block)
    saxpy_kernel[blocks, threads](d_out, x.dtype.type(a), d_x, d_y)
    return d_out.copy_to_host()
    # END SOLUTION


def broadcast_add(col, row, block=(16, 16)):
    """Host side: the ``(col.size, row.size)`` table ``col[i] + row[j]``.

    ``block`` is ``(threads along x, threads along y)``.
    """
    # BEGIN SOLUTION: a 2-D grid that covers the table (x along columns), launch, copy back
    d_col = cuda.to_device(np.ascontiguousarray(col))
    d_row = cuda.to_device(np.ascontiguousarray(row))
    dtype = np.result_type(col.dtype, row.dtype)
    d_out = cuda.device_array((col.size, row.size), dtype=dtype)
    grid = (launch_config(row.size, block[0])[0], launch_config(col.size, block[1])[0])
    broadcast_add_kernel[grid, block](d_out, d_col, d_row)
    return d_out.copy_to_host()
    # END SOLUTION
