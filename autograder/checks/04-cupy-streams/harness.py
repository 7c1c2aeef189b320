"""Grader code that runs next to the student's ``cupy_streams`` in the sandbox.

CPU tier: the fused kernel's generated loop (``course.gpu_compile.elementwise_source``,
the C that NVRTC compiles) built for the host with a C++ compiler and run on the
check's inputs. The stream pipeline runs on a ``course.streams.RecordingStreams``
that the harness builds with a cost model of its choosing; it returns the results,
the recorded schedule and what the model GPU made of it. Zero-copy is judged
by pointers and by a write through one side seen from the other.

GPU tier: the same functions on CuPy arrays, and measurements in one run —
fused against an unfused baseline written here, the pipeline against a serial
schedule written here, device copy bandwidth and cuBLAS FP32 matmul for the
roofline — all through ``course.gpu_timing.bench``. Kernel times come from CUDA
events; the pipelines run on several streams, which one event pair cannot
bracket, so they are timed by the host clock after a device-wide synchronize.
A dry run (``k2c grade 04 --dry-run-gpu``) runs these on the CPU tier's stand-ins.
"""
import math
import os
import shutil
import tempfile

import numpy as np

from course import gpu_compile, streams


def _student():
    import cupy_streams
    return cupy_streams


# --- CPU tier: the fused kernel, built for the host -------------------------

def host_bias_gelu(cases):
    """``bias_gelu_kernel``'s ElementwiseKernel, its loop built for the host as float and
    double, run on each ``(x, bias)`` of ``cases`` (by the dtype of ``x``): its outputs,
    or why it could not run (``unavailable``, ``made``: not one ElementwiseKernel,
    ``not_built``: the compiler's complaint)."""
    why = gpu_compile.host_unavailable()
    if why:
        return {"unavailable": why}
    made = gpu_compile.capture_cupy_kernels(_student().bias_gelu_kernel)  # a stub raises: not implemented yet
    if len(made) != 1 or made[0]["kind"] != "elementwise":
        return {"made": [f"{k['kind']} {k['name']}" for k in made]}
    kernel = made[0]
    folder = tempfile.mkdtemp(prefix="k2c-host-kernel-")  # in the call's private scratch
    try:
        built = gpu_compile.build_on_host(
            {p: gpu_compile.elementwise_source(kernel, p) for p in gpu_compile.HOST_DTYPES}, folder)
        failed = {p: b["error"] for p, b in built.items() if not b["ok"]}
        if failed:
            return {"not_built": failed}
        placeholder = {np.dtype(d): p for p, d in gpu_compile.HOST_DTYPES.items()}
        outputs = []
        for x, bias in cases:
            p = placeholder[x.dtype]
            outputs.append(gpu_compile.run_elementwise_on_host(kernel, built[p]["library"], p, [x, bias])[0])
        return {"outputs": outputs}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# --- CPU tier (and GPU tier): the schedule on the recording stand-in --------

FUNCTIONS = {  # what the pipeline applies; written with the array module of the argument
    "affine": lambda d: 2 * d + 1,
    "row_sums": lambda d: d.sum(axis=-1, dtype=np.float64),  # another shape and dtype than the input
}


def recorded_pipeline(chunks, n_streams, function="affine", costs=None):
    """Run the student's ``pipelined_apply`` on a fresh recording backend."""
    gpu = streams.RecordingStreams(**(costs or {}))
    calls = []

    def f(d):
        calls.append(d.shape)
        return FUNCTIONS[function](d)

    results = _student().pipelined_apply(f, [np.array(c) for c in chunks], n_streams=n_streams, gpu=gpu)
    report = gpu.report()
    compute_ops = sum(1 for op in report["ops"] if op["kind"] == "compute")
    # A device array cannot be read here (nor carried back): which results are still on the device.
    on_device = [i for i, r in enumerate(results or ()) if isinstance(r, streams.DeviceArray)]
    return {"results": None if results is None else
            [None if i in on_device else np.asarray(r) for i, r in enumerate(results)],
            "on_device": on_device,
            "copied_back": sorted({op["chunk"] for op in report["ops"] if op["kind"] == "d2h"} - {None}),
            "f_calls": len(calls), "compute_ops": compute_ops,
            **{k: report[k] for k in ("makespan", "hazards", "copy_issued_before_wait",
                                      "streams_used", "pageable_copies")}}


def torch_view_of_numpy(values):
    """``to_torch`` on a NumPy array: a tensor, same memory, writes visible both ways."""
    import torch

    a = np.array(values)
    t = _student().to_torch(a)
    if not isinstance(t, torch.Tensor):
        return {"type": type(t).__name__}
    out = {"type": "Tensor", "same_pointer": t.data_ptr() == a.ctypes.data,
           "values": t.numpy().copy()}
    t[0] = 12345
    out["write_seen_by_numpy"] = bool(a[0] == 12345)
    return out


def numpy_view_of_torch(values):
    """``from_torch`` on a CPU tensor: a NumPy array, same memory, writes visible."""
    import torch

    t = torch.tensor(values)
    a = _student().from_torch(t)
    if not isinstance(a, np.ndarray):
        return {"type": type(a).__name__}
    out = {"type": "ndarray", "same_pointer": a.ctypes.data == t.data_ptr(), "values": a.copy()}
    t[0] = -777
    out["write_seen_by_numpy"] = bool(a.flat[0] == -777)
    return out


# --- GPU tier ---------------------------------------------------------------
#
# Every function below runs on the GPU tier, and in a dry run on the CPU tier on the
# stand-ins of course.gpu_stand_in (a CuPy made of NumPy whose ElementwiseKernel builds
# its C for the host, events on the host clock, torch on the CPU). Timed work goes
# through course.gpu_timing.bench: new inputs named by each run's seed, an L2 flush
# before each run, and what the grader rechecks coming back.

def _device():
    from course import gpu_devices

    return gpu_devices.device("cupy")


def _kind(result, device_input) -> str:
    """``"device"`` for an array of the device input's own kind (a CuPy array on a GPU),
    else the module the result's type comes from."""
    return "device" if type(result) is type(device_input) else type(result).__module__.split(".")[0]


def device_bias_gelu(x, bias):
    dev = _device()
    d_x = dev.xp.asarray(x)
    y = _student().bias_gelu(d_x, dev.xp.asarray(bias))
    return {"kind": _kind(y, d_x), "values": dev.to_host(y)}


def device_softmax(x):
    dev = _device()
    d_x = dev.xp.asarray(x)
    y = _student().softmax_rows(d_x)
    return {"kind": _kind(y, d_x), "values": dev.to_host(y)}


def _bias_gelu_unfused(x, bias):
    # One CuPy operation at a time: every line is a kernel that reads and writes whole arrays.
    import cupy as cp

    z = x + bias
    cube = z * z * z
    inner = (z + 0.044715 * cube) * math.sqrt(2 / math.pi)
    return 0.5 * z * (1 + cp.tanh(inner))


def fused_vs_unfused(rows, cols, seeds):
    """The student's fused bias_gelu, the unfused version above and a device copy of x,
    each on new x in [-4, 4) and bias in [-1, 1) every run, sampled outputs back."""
    from course import gpu_timing

    dev = _device()
    cp = dev.xp

    def inputs(seed):
        return dev.hashed(seed, (rows, cols), -4.0, 4.0), dev.hashed(seed, cols, -1.0, 1.0, stream=1)

    def copy_inputs(seed):
        return cp.empty((rows, cols), cp.float32), dev.hashed(seed, (rows, cols), -4.0, 4.0)

    def copy(dst, x):
        cp.copyto(dst, x)
        return dst

    def sampled(out, args, seed):
        return dev.take(out, gpu_timing.sample_positions(seed, rows * cols))

    # The baselines run before the student's module is imported (as in overlap_speedup and
    # roofline_measured): nothing it does at import, such as slowing cupy.tanh, can slow them.
    unfused = gpu_timing.bench(dev, _bias_gelu_unfused, inputs, sampled, seeds)
    copied = gpu_timing.bench(dev, copy, copy_inputs, sampled, seeds)
    return {"fused": gpu_timing.bench(dev, _student().bias_gelu, inputs, sampled, seeds),
            "unfused": unfused, "copy": copied}


_SPIN = None


def _spin_kernel():
    # Compute whose length we choose: `n` dependent multiply-adds per element. They converge
    # to 1 whatever x is, so y adds x back: each result still says which input it came from.
    global _SPIN
    if _SPIN is None:
        import cupy as cp

        _SPIN = cp.ElementwiseKernel(
            "T x, int32 n", "T y",
            "T v = x; for (int i = 0; i < n; ++i) { v = v * T(0.99) + T(0.01); } y = v + x;",
            "k2c_spin")
    return _SPIN


def _serial_schedule(gpu, f, chunks):
    # The baseline: one stream, and the host waits for each chunk before the next.
    stream, results = gpu.stream(), []
    for chunk in chunks:
        staged = gpu.pinned_empty(chunk.shape, chunk.dtype)
        staged[...] = chunk
        d_y = gpu.launch(f, gpu.to_device(staged, stream), stream=stream)
        out = gpu.pinned_empty(d_y.shape, d_y.dtype)
        gpu.to_host(d_y, out, stream)
        gpu.synchronize(stream)
        results.append(out)
    return results


def _calibration_ms(dev, fn, repeats=5):
    """Median of ``fn()`` between two events: the per-chunk costs that set the compute's
    length (not graded; the graded times are bench's)."""
    fn()
    dev.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = dev.event(), dev.event()
        start.record()
        fn()
        stop.record()
        times.append(dev.elapsed_s(start, stop) * 1e3)
    return float(np.median(times))


def overlap_speedup(n_chunks, chunk_elems, n_streams, base_seed, seeds, max_spins=1 << 16):
    """Serial against the student's pipeline, with compute as long as the longest of a
    chunk's copy and its staging into pinned memory (balanced load). Run k's chunks are
    the base chunks (stream j of ``base_seed``) times ``scale_of(seed_k)``; each result's
    values at the sampled positions come back, with the number of spins."""
    from course import gpu_timing

    dev = _device()
    cp, gpu = dev.xp, dev.streams()
    base = [dev.to_host(dev.hashed(base_seed, chunk_elems, stream=j)) for j in range(n_chunks)]
    pinned = gpu.pinned_empty(base[0].shape, base[0].dtype)
    t_stage = []
    for chunk in base[:3]:  # host memcpy into pinned memory: the pipeline's host-side work per chunk
        began = dev.host_clock()
        pinned[...] = chunk
        t_stage.append((dev.host_clock() - began) * 1e3)
    t_stage = float(np.median(t_stage))
    d = cp.empty(base[0].shape, base[0].dtype)
    t_h2d = _calibration_ms(dev, lambda: d.set(pinned))
    t_d2h = _calibration_ms(dev, lambda: d.get(out=pinned))
    spin_base = 256
    t_base = _calibration_ms(dev, lambda: _spin_kernel()(d, np.int32(spin_base)))
    spins = int(min(max_spins, max(1, round(spin_base * max(t_h2d, t_stage) / t_base))))
    t_comp = _calibration_ms(dev, lambda: _spin_kernel()(d, np.int32(spins)))

    def f(x):
        return _spin_kernel()(x, np.int32(spins))

    def inputs(seed):
        scale = np.float32(gpu_timing.scale_of(seed))
        return ([chunk * scale for chunk in base],)

    def sampled(results, args, seed):
        where = gpu_timing.sample_positions(seed, chunk_elems, count=64)
        return [np.asarray(r).reshape(-1)[where] for r in results]

    serial = gpu_timing.bench(dev, lambda chunks: _serial_schedule(gpu, f, chunks), inputs, sampled, seeds,
                              timer="host")
    piped = gpu_timing.bench(dev, lambda chunks: _student().pipelined_apply(f, chunks, n_streams=n_streams, gpu=gpu),
                             inputs, sampled, seeds, timer="host")
    return {"serial": serial, "pipelined": piped, "spins": spins, "stage_ms": t_stage, "h2d_ms": t_h2d,
            "compute_ms": t_comp, "d2h_ms": t_d2h}


def zero_copy_device():
    """CuPy, torch and numba sharing one array's memory: pointers, and a write through
    each seen by the others (on the stand-ins: host memory, torch on the CPU)."""
    import torch

    from course.gpu_timing import pointer

    dev = _device()
    cp, student = dev.xp, _student()
    a = cp.arange(16, dtype=cp.float32)
    t = student.to_torch(a)
    device = getattr(getattr(t, "device", None), "type", None)
    out = {"torch_on_device": device == dev.torch_device, "torch_same_pointer": pointer(t) == pointer(a)}
    if out["torch_on_device"]:
        t[0] = 42
        dev.torch_synchronize()
        out["torch_write_seen"] = float(a[0]) == 42.0
    n = student.to_numba(a)
    out["numba_same_pointer"] = pointer(n) == pointer(a)
    if out["numba_same_pointer"]:
        n[1] = 7
        out["numba_write_seen"] = float(a[1]) == 7.0
    tt = torch.arange(8, device=dev.torch_device, dtype=torch.float32)
    back = student.from_torch(tt)
    out["from_torch_is_cupy"] = isinstance(back, cp.ndarray)
    out["from_torch_same_pointer"] = out["from_torch_is_cupy"] and pointer(back) == tt.data_ptr()
    return out


def roofline_measured(n, m, seeds):
    """Device copy bandwidth (n floats), cuBLAS FP32 matmul (m x m, TF32 off) and the
    student's fused bias_gelu (n floats in rows of 1024), each on new inputs every run,
    sampled outputs back. The grader puts the medians into the student's ``roofline``."""
    os.environ["CUPY_TF32"] = "0"  # FP32, so the peak it is held to is FP32's
    from course import gpu_timing

    dev = _device()
    cp = dev.xp

    def sampled(out, args, seed):
        return dev.take(out, gpu_timing.sample_positions(seed, out.size))

    def copy(src, dst):
        cp.copyto(dst, src)
        return dst

    return {
        "copy": gpu_timing.bench(dev, copy, lambda seed: (dev.hashed(seed, n), cp.empty(n, cp.float32)),
                                 sampled, seeds),
        "matmul": gpu_timing.bench(dev, lambda a, b, c: cp.matmul(a, b, out=c),
                                   lambda seed: (dev.hashed(seed, (m, m)), dev.hashed(seed, (m, m), stream=1),
                                                 cp.empty((m, m), cp.float32)), sampled, seeds),
        "bias_gelu": gpu_timing.bench(dev, _student().bias_gelu,
                                      lambda seed: (dev.hashed(seed, (n // 1024, 1024), -4.0, 4.0),
                                                    dev.hashed(seed, 1024, -1.0, 1.0, stream=1)), sampled, seeds)}
