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
roofline. Kernel times come from CUDA events; the pipelines run on several
streams, which one event pair cannot bracket, so they are timed by the host
clock after a device-wide synchronize.
"""
import math
import shutil
import tempfile
import time

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

def _device_ms(fn, repeats=10):
    """Median time of ``fn()`` on the current stream, from CUDA events."""
    import cupy as cp

    fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(repeats):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def _device_name():
    import cupy as cp

    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def device_bias_gelu(x, bias):
    import cupy as cp

    y = _student().bias_gelu(cp.asarray(x), cp.asarray(bias))
    return {"module": type(y).__module__.split(".")[0], "values": cp.asnumpy(y)}


def device_softmax(x):
    import cupy as cp

    y = _student().softmax_rows(cp.asarray(x))
    return {"module": type(y).__module__.split(".")[0], "values": cp.asnumpy(y)}


def _bias_gelu_unfused(x, bias):
    # One CuPy operation at a time: every line is a kernel that reads and writes whole arrays.
    import cupy as cp

    z = x + bias
    cube = z * z * z
    inner = (z + 0.044715 * cube) * math.sqrt(2 / math.pi)
    return 0.5 * z * (1 + cp.tanh(inner))


def fused_vs_unfused(rows, cols, repeats=20):
    import cupy as cp

    cp.random.seed(0)
    x = cp.random.standard_normal((rows, cols), dtype=cp.float32)
    bias = cp.random.standard_normal(cols, dtype=cp.float32)
    fused = _student().bias_gelu
    same = bool(cp.allclose(fused(x, bias), _bias_gelu_unfused(x, bias), rtol=1e-5, atol=1e-6))
    t_fused = _device_ms(lambda: fused(x, bias), repeats)
    t_unfused = _device_ms(lambda: _bias_gelu_unfused(x, bias), repeats)
    dst = cp.empty_like(x)
    t_copy = _device_ms(lambda: cp.copyto(dst, x), repeats)
    nbytes = 2 * x.nbytes  # read x, write y (bias is small)
    return {"device": _device_name(), "same_values": same, "fused_ms": t_fused, "unfused_ms": t_unfused,
            "fused_gbs": nbytes / t_fused / 1e6, "copy_gbs": nbytes / t_copy / 1e6}


_SPIN = None


def _spin_kernel():
    # Compute whose length we choose: `n` dependent multiply-adds per element.
    global _SPIN
    if _SPIN is None:
        import cupy as cp

        _SPIN = cp.ElementwiseKernel(
            "T x, int32 n", "T y",
            "T v = x; for (int i = 0; i < n; ++i) { v = v * T(0.999) + T(0.001); } y = v;",
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


def _wall(fn, repeats):
    import cupy as cp

    times = []
    for _ in range(repeats):
        cp.cuda.Device().synchronize()
        start = time.perf_counter()
        result = fn()
        cp.cuda.Device().synchronize()
        times.append(time.perf_counter() - start)
        del result
    return float(np.median(times))


def overlap_speedup(n_chunks=8, chunk_mb=32, n_streams=3, repeats=3):
    """Serial against the student's pipeline, with compute as long as the longest
    of a chunk's copy and its staging into pinned memory (balanced load)."""
    import cupy as cp

    gpu = streams.CupyStreams()
    elems = chunk_mb * 2**20 // 4
    chunks = [np.random.default_rng(i).random(elems, dtype=np.float32) for i in range(n_chunks)]
    pinned = gpu.pinned_empty(chunks[0].shape, chunks[0].dtype)
    t_stage = []
    for chunk in chunks[:3]:  # host memcpy into pinned memory: the pipeline's host-side work per chunk
        start = time.perf_counter()
        pinned[...] = chunk
        t_stage.append((time.perf_counter() - start) * 1e3)
    t_stage = float(np.median(t_stage))
    d = cp.empty(chunks[0].shape, chunks[0].dtype)
    t_h2d = _device_ms(lambda: d.set(pinned), 5)
    t_d2h = _device_ms(lambda: d.get(out=pinned), 5)
    base = 256
    t_base = _device_ms(lambda: _spin_kernel()(d, np.int32(base)), 5)
    spins = max(1, round(base * max(t_h2d, t_stage) / t_base))
    t_comp = _device_ms(lambda: _spin_kernel()(d, np.int32(spins)), 5)

    def f(x):
        return _spin_kernel()(x, np.int32(spins))

    serial = _serial_schedule(gpu, f, chunks)
    piped = _student().pipelined_apply(f, chunks, n_streams=n_streams, gpu=gpu)
    same = len(piped) == len(serial) and all(np.array_equal(np.asarray(a), b) for a, b in zip(piped, serial))
    del serial, piped
    t_serial = _wall(lambda: _serial_schedule(gpu, f, chunks), repeats)
    t_pipe = _wall(lambda: _student().pipelined_apply(f, chunks, n_streams=n_streams, gpu=gpu), repeats)
    return {"device": _device_name(), "same_values": same, "stage_ms": t_stage, "h2d_ms": t_h2d,
            "compute_ms": t_comp, "d2h_ms": t_d2h, "serial_ms": t_serial * 1e3, "pipelined_ms": t_pipe * 1e3}


def zero_copy_device():
    import cupy as cp
    import torch

    student = _student()
    a = cp.arange(16, dtype=cp.float32)
    t = student.to_torch(a)
    out = {"torch_is_cuda": bool(getattr(t, "is_cuda", False)),
           "torch_same_pointer": getattr(t, "data_ptr", lambda: -1)() == a.data.ptr}
    if out["torch_is_cuda"]:
        t[0] = 42
        torch.cuda.synchronize()
        out["torch_write_seen"] = float(a[0]) == 42.0
    n = student.to_numba(a)
    interface = getattr(n, "__cuda_array_interface__", {"data": (-1, False)})
    out["numba_same_pointer"] = interface["data"][0] == a.data.ptr
    if out["numba_same_pointer"]:
        n[1] = 7
        out["numba_write_seen"] = float(a[1]) == 7.0
    tt = torch.arange(8, device="cuda", dtype=torch.float32)
    back = student.from_torch(tt)
    out["from_torch_is_cupy"] = isinstance(back, cp.ndarray)
    out["from_torch_same_pointer"] = out["from_torch_is_cupy"] and back.data.ptr == tt.data_ptr()
    return out


def roofline_measured(n=1 << 26, m=8192):
    """Device copy bandwidth, cuBLAS FP32 matmul FLOP/s, the student's fused
    kernel on that roof, and the student's ``roofline`` on the measured peaks."""
    import cupy as cp

    student = _student()
    src = cp.ones(n, dtype=cp.float32)
    dst = cp.empty_like(src)
    copy_bw = 2 * src.nbytes / (_device_ms(lambda: cp.copyto(dst, src)) / 1e3)
    cp.random.seed(1)
    a = cp.random.standard_normal((m, m), dtype=cp.float32)
    b = cp.random.standard_normal((m, m), dtype=cp.float32)
    c = cp.empty_like(a)
    matmul_flops = 2 * m**3 / (_device_ms(lambda: cp.matmul(a, b, out=c), 5) / 1e3)
    bias = cp.zeros(1024, dtype=cp.float32)
    x = src.reshape(-1, 1024)
    gelu_s = _device_ms(lambda: student.bias_gelu(x, bias)) / 1e3
    gelu_flops_per_element, gelu_bytes_per_element = 10, 8  # add, 3 mul-adds, tanh ~ 10; read x, write y
    kernels = {"bias_gelu": (gelu_flops_per_element * n, gelu_bytes_per_element * n),
               "fp32_matmul": (2 * m**3, 3 * 4 * m * m)}
    bounds = {name: student.roofline(fl, by, matmul_flops, copy_bw)[1] for name, (fl, by) in kernels.items()}
    return {"device": _device_name(), "copy_bw": copy_bw, "matmul_flops": matmul_flops,
            "bias_gelu_flops": gelu_flops_per_element * n / gelu_s,
            "bias_gelu_intensity": gelu_flops_per_element / gelu_bytes_per_element,
            "matmul_intensity": 2 * m**3 / (3 * 4 * m * m), "bounds": bounds}
