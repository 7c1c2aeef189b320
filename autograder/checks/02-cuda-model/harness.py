"""Grader code that runs next to the student's ``cuda_basics`` in the sandbox.

It launches the student's kernels itself, with a launch configuration it
computes (so a kernel is judged apart from the student's ``launch_config``),
on output buffers that are poisoned and longer than the data: the tail past
the end is a canary that only an unguarded thread can overwrite. Launch errors
(the simulator raises IndexError for an out-of-bounds access) come back as
data, so the check can say what they mean.
"""
import math

import numpy as np
from numba import cuda

from autograder.grading.checking import poisoned, unstubbed

CANARY = 64  # poisoned elements past the end of every 1-D output


def _student():
    import cuda_basics
    return cuda_basics


def _kernel(name):
    return unstubbed(getattr(_student(), name))


def _launch(kernel, grid, block, out_buffer, out_view, *args):
    d_buffer = cuda.to_device(out_buffer)
    d_args = [cuda.to_device(a) if isinstance(a, np.ndarray) else a for a in args]
    error = None
    try:
        kernel[grid, block](out_view(d_buffer), *d_args)
        cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - reported to the check as data
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    return {"buffer": d_buffer.copy_to_host(), "launch_error": error}


def thread_writes(kernel_name, n_or_shape, block, *inputs):
    """In the simulator, under ``course.cuda_audit``: for every write the kernel makes
    to its output, the writing thread's global (x, y) index and the element's (row,
    column). The grid covers the output exactly as in the other launches."""
    from course.cuda_audit import audit

    kernel = _kernel(kernel_name)
    if isinstance(n_or_shape, int):
        shape, grid, bx, by = (1, n_or_shape), math.ceil(n_or_shape / block), block, 1
    else:
        shape, (bx, by) = tuple(n_or_shape), block
        grid = (math.ceil(shape[1] / bx), math.ceil(shape[0] / by))
    dtype = inputs[-1].dtype
    d_out = cuda.to_device(poisoned(shape if not isinstance(n_or_shape, int) else n_or_shape, dtype))
    args = [cuda.to_device(a) if isinstance(a, np.ndarray) else np.asarray(a, dtype)[()] for a in inputs]
    try:
        with audit() as log:
            log.name(d_out, "out")
            kernel[grid, block if isinstance(block, int) else tuple(block)](d_out, *args)
    except Exception as exc:  # noqa: BLE001 - reported to the check as data
        return {"writes": np.zeros((0, 4), np.int64), "launch_error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    writes = [(a.block[0] * bx + a.thread % bx, (a.block[1] if len(a.block) > 1 else 0) * by + a.thread // bx,
               *divmod(a.offset // a.itemsize, shape[1]), a.wrapped)
              for a in log.accesses if a.array == "out" and a.kind == "w"]
    return {"writes": np.array(writes, np.int64).reshape(-1, 5), "launch_error": None}


def host_launches(func, config_sizes, *args):
    """In the simulator: what the student's host function ``func`` returns, the
    (kernel, grid, block) of every launch it made, and what their launch_config
    gives for each ``(n, threads_per_block)`` of ``config_sizes``."""
    from course.cuda_audit import launches

    student = _student()
    with launches() as found:
        value = getattr(student, func)(*args)
    return {"value": value, "launches": [(launch.kernel, list(launch.grid), list(launch.block)) for launch in found],
            "configs": [[int(v) for v in student.launch_config(n, tpb)] for n, tpb in config_sizes]}


def launch_configs(cases):
    fn = _student().launch_config
    return [tuple(int(v) for v in fn(n, tpb)) for n, tpb in cases]


def relu_1d(x, threads_per_block):
    n = x.size
    return _launch(_kernel("relu_kernel"), math.ceil(n / threads_per_block), threads_per_block,
                   poisoned(n + CANARY, x.dtype), lambda d: d[:n], x)


def saxpy_1d(a, x, y, threads_per_block):
    n = x.size
    return _launch(_kernel("saxpy_kernel"), math.ceil(n / threads_per_block), threads_per_block,
                   poisoned(n + CANARY, x.dtype), lambda d: d[:n], np.asarray(a, x.dtype)[()], x, y)


def broadcast_add_2d(col, row, block):
    rows, cols = col.size, row.size
    grid = (math.ceil(cols / block[0]), math.ceil(rows / block[1]))
    # Canary rows and columns around the output: an unguarded thread writes there.
    buffer = poisoned((rows + block[1], cols + block[0]), col.dtype)
    return _launch(_kernel("broadcast_add_kernel"), grid, tuple(block), buffer,
                   lambda d: d[:rows, :cols], col, row)


def host_relu(x, threads_per_block):
    return _student().relu(x, threads_per_block)


def host_saxpy(a, x, y, threads_per_block):
    return _student().saxpy(a, x, y, threads_per_block)


def host_broadcast_add(col, row, block):
    return _student().broadcast_add(col, row, tuple(block))


def saxpy_bandwidth(n, seeds, a, warmup=1):
    """GPU tier (and its dry run on stand-ins): the student's saxpy_kernel and a
    device-to-device copy of an array of the same size, each timed by
    ``course.gpu_timing.bench``: new x and y for every run (hashed from the run's
    seed), the L2 flushed before it, CUDA events around it, and the output at the
    positions the grader checks coming back."""
    from course import gpu_devices, gpu_timing

    dev = gpu_devices.device("numba")
    kernel = _kernel("saxpy_kernel")
    block = 256
    grid = math.ceil(n / block)
    a = np.float32(a)

    def inputs(seed):
        return dev.empty(n, np.float32), dev.hashed(seed, n), dev.hashed(seed, n, stream=1)

    def saxpy(out, x, y):
        kernel[grid, block](out, a, x, y)
        return out

    def copy(out, x, y):
        out.copy_to_device(x)
        return out

    def sampled(out, args, seed):
        return dev.take(out, gpu_timing.sample_positions(seed, n))

    return {"saxpy": gpu_timing.bench(dev, saxpy, inputs, sampled, seeds, warmup),
            "copy": gpu_timing.bench(dev, copy, inputs, sampled, seeds, warmup)}
