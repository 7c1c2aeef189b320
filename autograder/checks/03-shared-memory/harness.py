"""Grader code that runs next to the student's ``shared_kernels`` in the sandbox.

It launches the student's kernels itself, on poisoned outputs with canary
elements past the end. In numba's CUDA simulator every launch runs inside
``course.cuda_audit.audit()``, which records each memory access: the checks
then judge races, bank conflicts, coalescing and global loads from that record,
which does not depend on the order the simulator happened to run threads in.
The record also holds every warp function a block called (``course.cuda_sim``,
whose warp functions this module installs) and the barriers each block passed:
the warp-level reduction is judged from them.
The host functions run there too (``recorded``), with a record of every launch
they make and of what those launches wrote, so that a check can tell a host
function that returns its kernels' result from one that computes it itself.
On a GPU there is no record; the same launches check results at device sizes,
and the ``*_vs_*`` functions time the kernels against CuPy's (CUB, cuBLAS) with
``course.gpu_timing`` (in a dry run on the CPU tier, on its stand-ins).
"""
import contextlib
import math
import os
from collections import Counter, defaultdict

import numpy as np
from numba import config, cuda

from autograder.grading.checking import INT_POISON, poisoned, unstubbed

CANARY = 64  # poisoned elements past the end of 1-D outputs

if config.ENABLE_CUDASIM:
    from course import cuda_sim

    cuda_sim.install()  # the simulator's warp functions (and barriers that wake threads), whatever ran first


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
        blocks = {a.block for a in log.accesses}
        shuffles = Counter(c.block for c in log.warp_calls if c.function.startswith("shfl_"))
        result.update(barriers=max(log.barriers().values(), default=0),
                      shuffles_per_block=min((shuffles[b] for b in blocks), default=0),
                      warp_functions=sorted({c.function for c in log.warp_calls}),
                      undefined_reads=log.undefined_reads(limit=3))
        result.update(races=[str(r) for r in log.races(limit=3)], banks=log.bank_conflicts(),
                      shared_arrays=sorted(log.shared_arrays()),
                      loads={name: log.loads(name) for _, name in named},
                      coalescing={name: log.coalescing(name) for _, name in named},
                      atomics={name: sum(1 for a in log.accesses if a.array == name and a.kind == "a")
                               for _, name in named})
    return result


# -- the four kernels, launched by the grader -----------------------------------

def block_sums(x, blocks, kernel="block_sum_kernel"):
    """``kernel`` (block_sum_kernel, or block_sum_warp_kernel: the same contract) on ``blocks`` blocks."""
    s = _student()
    result = _launch(_kernel(kernel), blocks, s.THREADS, [poisoned(blocks + CANARY), x],
                     views={0: slice(0, blocks)})
    result["partial"] = result.pop("arrays")[0]
    result["threads"] = s.THREADS
    result["warp"] = getattr(s, "WARP", 32)
    return result


def warp_block_sums(x, blocks):
    return block_sums(x, blocks, "block_sum_warp_kernel")


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


# -- GPU tier: the same kernels against CuPy's, timed by course.gpu_timing -------------
#
# Every function below runs on the GPU tier, and in a dry run on the CPU tier on the
# stand-ins of course.gpu_stand_in (the kernels in numba's simulator). Each timed run
# gets inputs of its own, named by its seed, and sends back what the grader rechecks.

def _device():
    from course import gpu_devices

    return gpu_devices.device("cupy")


def _blocks_to_fill(dev, threads, n):
    """Enough blocks to fill every SM several times over (for grid-stride kernels), and
    no more than the data has blocks of threads."""
    return max(1, min(dev.info.multiprocessors * max(1, 2048 // threads) * 2, math.ceil(n / threads)))


def reduce_vs_cupy_sum(n, base_seed, seeds):
    """block_sum_kernel's two passes against CuPy's sum (CUB). Run k sums
    ``base * scale_of(seed_k)``: every element changes from run to run, and the
    grader, which knows the base's sum, knows each run's."""
    from course import gpu_timing

    dev = _device()
    cp, s, kernel = dev.xp, _student(), _kernel("block_sum_kernel")
    base = dev.hashed(base_seed, n)
    blocks = _blocks_to_fill(dev, s.THREADS, n)
    partial, total = cp.empty(blocks, cp.float32), cp.empty(1, cp.float32)

    def inputs(seed):
        return (base * cp.float32(gpu_timing.scale_of(seed)),)

    def two_passes(x):
        kernel[blocks, s.THREADS](partial, x)
        kernel[1, s.THREADS](total, partial)
        return total

    def the_sum(out, args, seed):
        return float(dev.to_host(out).reshape(-1)[0])

    return {"ours": gpu_timing.bench(dev, two_passes, inputs, the_sum, seeds),
            "cupy": gpu_timing.bench(dev, lambda x: x.sum(), inputs, the_sum, seeds)}


def matmul_vs_cublas(n, seeds, warmup=1):
    """tiled_matmul_kernel against cuBLAS FP32 (TF32 off) on new n x n A and B each run,
    with C's values at the sampled positions coming back."""
    os.environ["CUPY_TF32"] = "0"  # cuBLAS in plain FP32, as the kernel computes
    from course import gpu_timing

    dev = _device()
    cp, s, kernel = dev.xp, _student(), _kernel("tiled_matmul_kernel")
    grid = (math.ceil(n / s.TILE), math.ceil(n / s.TILE))

    def inputs(seed):
        return cp.empty((n, n), cp.float32), dev.hashed(seed, (n, n)), dev.hashed(seed, (n, n), stream=1)

    def ours(C, A, B):
        kernel[grid, (s.TILE, s.TILE)](C, A, B)
        return C

    def sampled(out, args, seed):
        return dev.take(out, gpu_timing.sample_positions(seed, n * n))

    return {"ours": gpu_timing.bench(dev, ours, inputs, sampled, seeds, warmup),
            "cublas": gpu_timing.bench(dev, lambda C, A, B: A @ B, inputs, sampled, seeds, warmup)}


def histogram_vs_bincount(n, n_bins, base_seed, seeds):
    """histogram_kernel against cupy.bincount. Run k counts ``(base + shift_of(seed_k)) %
    n_bins``: every value moves, and each run's counts (all of them come back) are the
    base's, rotated."""
    from course import gpu_timing

    dev = _device()
    cp, s, kernel = dev.xp, _student(), _kernel("histogram_kernel")
    base = dev.hashed_ints(base_seed, n, n_bins)
    blocks = _blocks_to_fill(dev, s.THREADS, n)

    def inputs(seed):
        shift = gpu_timing.shift_of(seed, n_bins)
        return cp.zeros(n_bins, cp.int32), ((base + shift) % n_bins).astype(cp.int32)

    def ours(counts, values):
        kernel[blocks, s.THREADS](counts, values)
        return counts

    def counts_of(out, args, seed):
        return dev.to_host(out).astype(np.int64)

    return {"ours": gpu_timing.bench(dev, ours, inputs, counts_of, seeds),
            "cupy": gpu_timing.bench(dev, lambda counts, values: cp.bincount(values, minlength=n_bins), inputs,
                                     counts_of, seeds)}
