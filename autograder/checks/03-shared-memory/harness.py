"""Grader code that runs next to the student's ``shared_kernels`` in the sandbox.

It launches the student's kernels itself, on poisoned outputs with canary
elements past the end. In numba's CUDA simulator every launch runs inside
``course.cuda_audit.audit()``, which records each memory access: the checks
then judge races, bank conflicts, coalescing and global loads from that record,
which does not depend on the order the simulator happened to run threads in.
The host functions run there too (``recorded``), with a record of every launch
they make and of what those launches wrote, so that a check can tell a host
function that returns its kernels' result from one that computes it itself.
On a GPU there is no record; the same launches check results at device sizes,
and the ``*_vs_*`` functions time the kernels against CuPy's (CUB, cuBLAS).
"""
import contextlib
import math
import os
from collections import defaultdict

import numpy as np
from numba import config, cuda

from autograder.grading.checking import INT_POISON, poisoned, unstubbed

CANARY = 64  # poisoned elements past the end of 1-D outputs


def _student():
    import shared_kernels
    return shared_kernels


def _kernel(name):
    return unstubbed(getattr(_student(), name))


def _recording():
    """In the simulator, an audit (which also poisons shared memory and allocates
    it safely across the block's threads); on a GPU, nothing."""
    if config.ENABLE_CUDASIM:
        from course.cuda_audit import audit
        return audit()
    return contextlib.nullcontext()


def _launch(kernel, grid, block, args, views=None, named=()):
    """Launch with device copies of ``args``; return the copies and what the audit saw.

    ``views`` maps an argument's position to the part of it the kernel is given
    (the rest of the buffer is canary, which on a GPU only a thread writing past
    the end can reach). ``named`` lists (position, name) pairs whose global
    accesses the audit reports by name.
    """
    d_args = [cuda.to_device(a) if isinstance(a, np.ndarray) else a for a in args]
    given = [d[views[i]] if views and i in views else d for i, d in enumerate(d_args)]
    error = None
    with _recording() as log:
        for position, name in named:
            if log is not None:
                log.name(d_args[position], name)
        try:
            kernel[grid, block](*given)
            cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - reported to the check as data
            error = f"{type(exc).__name__}: {str(exc)[:300]}"
    result = {"arrays": [d.copy_to_host() if isinstance(a, np.ndarray) else None for d, a in zip(d_args, args)],
              "launch_error": error, "audited": log is not None}
    if log is not None:
        result.update(races=[str(r) for r in log.races(limit=3)], banks=log.bank_conflicts(),
                      shared_arrays=sorted(log.shared_arrays()),
                      loads={name: log.loads(name) for _, name in named},
                      coalescing={name: log.coalescing(name) for _, name in named},
                      atomics={name: sum(1 for a in log.accesses if a.array == name and a.kind == "a")
                               for _, name in named})
    return result


# -- the four kernels, launched by the grader -----------------------------------

def block_sums(x, blocks):
    threads = _student().THREADS
    result = _launch(_kernel("block_sum_kernel"), blocks, threads, [poisoned(blocks + CANARY), x],
                     views={0: slice(0, blocks)})
    result["partial"] = result.pop("arrays")[0]
    result["threads"] = threads
    return result


def scan_segments(x):
    s = _student()
    blocks = math.ceil(x.size / s.SCAN_SPAN)
    result = _launch(_kernel("scan_block_kernel"), blocks, s.THREADS,
                     [poisoned(x.size + CANARY, np.int32), poisoned(blocks + CANARY, np.int32), x],
                     views={0: slice(0, x.size), 1: slice(0, blocks)})
    result["out"], result["sums"], _ = result.pop("arrays")
    result["span"] = s.SCAN_SPAN
    return result


def matmul_tiles(A, B):
    tile = _student().TILE
    rows, cols = A.shape[0], B.shape[1]
    # Canary rows and columns around C: a thread without a guard writes there.
    C = poisoned((rows + tile, cols + tile), np.float32)
    grid = (math.ceil(cols / tile), math.ceil(rows / tile))
    result = _launch(_kernel("tiled_matmul_kernel"), grid, (tile, tile), [C, A, B],
                     views={0: (slice(0, rows), slice(0, cols))}, named=((1, "A"), (2, "B")))
    result["C"] = result.pop("arrays")[0]
    result["tile"] = tile
    return result


def histogram_blocks(values, n_bins, blocks):
    counts = np.concatenate([np.zeros(n_bins, np.int32), np.full(CANARY, INT_POISON, np.int32)])
    result = _launch(_kernel("histogram_kernel"), blocks, _student().THREADS, [counts, values],
                     views={0: slice(0, n_bins)}, named=((0, "counts"), (1, "values")))
    result["counts"] = result.pop("arrays")[0]
    return result


def add_offsets(out, offsets):
    """add_offsets_kernel on ``out`` with one thread per element (its canary past the end)."""
    threads = _student().THREADS
    buffer = np.concatenate([out, np.full(CANARY, INT_POISON, np.int32)])
    result = _launch(_kernel("add_offsets_kernel"), math.ceil(out.size / threads), threads, [buffer, offsets],
                     views={0: slice(0, out.size)})
    result["out"] = result.pop("arrays")[0]
    result["span"] = _student().SCAN_SPAN
    return result


# -- the host functions, with a record of their launches (simulator) ----------------

def recorded(func, calls):
    """The student's host function ``func`` on each argument tuple of ``calls``, in
    the simulator: what it returned, each launch it made (kernel, grid, block) and
    each device array those launches wrote (``_writes``), with the lab's sizes."""
    from course.cuda_audit import audit, launches

    s = _student()
    runs = []
    for args in calls:
        with audit() as log, launches() as found, _writes(log) as outputs:
            value = getattr(s, func)(*args)
        runs.append({"value": float(value) if func == "block_reduce" else value,
                     "launches": [[launch.kernel, list(launch.grid), list(launch.block)] for launch in found],
                     "outputs": outputs, "threads": s.THREADS, "span": s.SCAN_SPAN, "tile": s.TILE})
    return runs


@contextlib.contextmanager
def _writes(log):
    """For every device array a launch inside the block wrote (as the kernel was
    given it, a view or not): which launches wrote it (indices into the audit's
    launches), the elements they wrote, and its contents when the last of them
    ended, which later host code cannot change. Host arrays given to a launch
    are copied in and back, as numba does on a GPU, so they are recorded too."""
    from numba.cuda.simulator import kernel as sim_kernel

    from course.cuda_audit import _base_address, _host_view

    original = sim_kernel.FakeCUDAKernel.__call__
    arrays = {}  # (buffer, offset, shape, strides) -> what launches wrote to that view
    seen = [0]  # accesses of earlier launches in log.accesses

    def call(self, *args):
        if self._device or sim_kernel._kernel_context:
            return original(self, *args)
        given = [cuda.to_device(a) if isinstance(a, np.ndarray) and a.ndim else a for a in args]
        views = [_host_view(d) for d in given if hasattr(d, "copy_to_host")]
        for view in views:
            log.name(view, f"buffer@{_base_address(view):x}")
        original(self, *given)
        launch = log.launches - 1
        written = defaultdict(set)
        for access in log.accesses[seen[0]:]:
            if access.space == "global" and access.kind != "r":
                written[access.array].add(access.offset)
        seen[0] = len(log.accesses)
        for view in views:
            base = _base_address(view)
            start = view.__array_interface__["data"][0] - base
            offsets = start + sum(np.arange(n).reshape([-1 if d == axis else 1 for d in range(view.ndim)]) * stride
                                  for axis, (n, stride) in enumerate(zip(view.shape, view.strides)))
            mask = np.isin(offsets, list(written[f"buffer@{base:x}"]))
            if mask.any():
                entry = arrays.setdefault((base, start, view.shape, view.strides),
                                          {"by": [], "written": np.zeros(view.shape, bool)})
                entry["by"].append(launch)
                entry["written"] |= mask
                entry["contents"] = view.copy()
        for a, d in zip(args, given):
            if d is not a:
                d.copy_to_host(a)

    outputs = []
    sim_kernel.FakeCUDAKernel.__call__ = call
    try:
        yield outputs
    finally:
        sim_kernel.FakeCUDAKernel.__call__ = original
        outputs.extend(arrays.values())


# -- the host functions at GPU sizes (no record there) --------------------------------

def host_reduce(arrays):
    with _recording():
        return [float(_student().block_reduce(x)) for x in arrays]


def host_scan(arrays):
    with _recording():
        return [_student().exclusive_scan(x) for x in arrays]


def host_matmul(A, B):
    with _recording():
        return _student().tiled_matmul(A, B)


def host_histogram(values, n_bins):
    with _recording():
        return _student().histogram(values, n_bins)


# -- GPU tier: the same kernels against CuPy's, timed with CUDA events ---------------

def _timed(fn, repeats=20):
    import cupy
    fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    return float(np.median(times))


def _device_name():
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def _blocks_to_fill(threads):
    """Enough blocks to fill every SM several times over (for grid-stride kernels)."""
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    return sms * max(1, 2048 // threads) * 2


def reduce_vs_cupy_sum(n):
    import cupy
    s = _student()
    kernel = _kernel("block_sum_kernel")
    x = cupy.random.default_rng(1).standard_normal(n, dtype=cupy.float32)
    blocks = _blocks_to_fill(s.THREADS)
    partial, total = cupy.empty(blocks, cupy.float32), cupy.empty(1, cupy.float32)

    def two_passes():
        kernel[blocks, s.THREADS](partial, x)
        kernel[1, s.THREADS](total, partial)

    t_ours, t_cupy = _timed(two_passes), _timed(lambda: x.sum())
    want = float(x.sum(dtype=cupy.float64))
    return {"ours_gbs": 4 * n / t_ours / 1e9, "cupy_gbs": 4 * n / t_cupy / 1e9, "device": _device_name(),
            "rel_error": abs(float(total[0]) - want) / max(abs(want), 1.0)}


def matmul_vs_cublas(n):
    os.environ["CUPY_TF32"] = "0"  # cuBLAS in plain FP32, as the kernel computes
    import cupy
    s = _student()
    kernel = _kernel("tiled_matmul_kernel")
    rng = cupy.random.default_rng(2)
    A, B = rng.standard_normal((n, n), dtype=cupy.float32), rng.standard_normal((n, n), dtype=cupy.float32)
    C = cupy.empty((n, n), cupy.float32)
    grid = (math.ceil(n / s.TILE), math.ceil(n / s.TILE))
    t_ours = _timed(lambda: kernel[grid, (s.TILE, s.TILE)](C, A, B), repeats=5)
    t_cublas = _timed(lambda: A @ B, repeats=5)
    ref = A @ B
    flops = 2 * n**3
    return {"ours_tflops": flops / t_ours / 1e12, "cublas_tflops": flops / t_cublas / 1e12, "device": _device_name(),
            "rel_error": float(cupy.abs(C - ref).max() / cupy.abs(ref).max())}


def histogram_vs_bincount(n, n_bins):
    import cupy
    s = _student()
    kernel = _kernel("histogram_kernel")
    values = cupy.random.default_rng(3).integers(0, n_bins, n, dtype=cupy.int32)
    counts = cupy.zeros(n_bins, cupy.int32)
    blocks = _blocks_to_fill(s.THREADS)

    def ours():
        counts.fill(0)
        kernel[blocks, s.THREADS](counts, values)

    t_ours = _timed(ours)
    t_cupy = _timed(lambda: cupy.bincount(values, minlength=n_bins))
    return {"ours_gvals": n / t_ours / 1e9, "cupy_gvals": n / t_cupy / 1e9, "device": _device_name(),
            "correct": bool((counts == cupy.bincount(values, minlength=n_bins)).all())}
