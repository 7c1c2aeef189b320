"""Checks for lab 04: fused GELU, stable softmax, the stream pipeline, zero-copy, roofline.

The oracles (``oracles.py``) are independent of the reference and of torch's
GELU and softmax, which the lab refuses (``lab.toml``): GELU's formula in
float64, held to ``math.erf``'s exact GELU; a stable softmax in float64;
closed-form pipeline makespans; hand-computed roofline cases.

CPU tier: the NumPy paths; the fused kernel compiled with NVRTC, and its
generated loop built for the host with a C++ compiler and run at edge inputs
(what only a GPU has, such as warp functions, atomics or shared memory, does not
build there: that check is skipped, with the compiler's reason, never passed);
the pipeline's schedule as recorded by ``course.streams.RecordingStreams`` and
replayed on its model GPU. A pipeline check counts only for a run whose results
are right and came back by device-to-host copies (``with_the_work``).
GPU tier: the CuPy paths, and ratios measured in one run — fused against
unfused, pipelined against serial — plus the measured roofline, which
``scripts/gpu-check.sh`` records for the lecture.
"""
import numpy as np
import pytest

from autograder.grading import timed
from autograder.grading import seeds
from autograder.grading.checking import expect_array, expect_close, expect_compiled, load_beside, with_the_work
from course import gpu_timing

oracles = load_beside(__file__, "oracles")

SEED = 2026

# GPU-tier thresholds: conservative guesses from the model, not yet validated on hardware.
FUSED_SPEEDUP_TO_PASS = 2.0  # unfused bias+GELU makes ~9 passes over memory, fused 1
OVERLAP_SPEEDUP_TO_PASS = 1.4  # model: 8 chunks, compute = max(host staging, copy): ideal ~2.4-2.9

# A model GPU with round costs: every stage of a (32, 64) float32 chunk (8 KiB) takes 1 s.
CHUNK_SHAPE, CHUNK_BYTES = (32, 64), 32 * 64 * 4
BALANCED = {"h2d_s_per_byte": 1 / CHUNK_BYTES, "d2h_s_per_byte": 1 / CHUNK_BYTES,
            "compute_s_per_byte": 1 / CHUNK_BYTES}
COMPUTE_BOUND = dict(BALANCED, compute_s_per_byte=3 / CHUNK_BYTES)


def _rng(offset=0):
    return seeds.rng(_GRADING_SEED[0], "04", SEED + offset)


# The graded inputs are drawn from the grading's secret seed (autograder.grading.seeds): each check
# sets it here before it draws, and every input of one grading comes from the same seed.
_GRADING_SEED = [0]


@pytest.fixture(autouse=True)
def _draw_from_the_grading_seed(seed):
    _GRADING_SEED[0] = seed


def _expect_same_kind(got, x, what):
    assert isinstance(got, np.ndarray), f"{what}: expected a NumPy array for NumPy input, got {type(got).__name__}"
    assert got.dtype == x.dtype, (
        f"{what}: the input is {x.dtype} but the result is {got.dtype}. A NumPy float64 scalar such as "
        "np.sqrt(2 / np.pi) or np.pi promotes float32 arrays; use Python floats (math.sqrt, math.pi)")


# --- 1. Fused bias + GELU --------------------------------------------------

@pytest.mark.points(3)
def check_bias_gelu_on_numpy(submission):
    """bias_gelu(x, bias) on NumPy arrays equals GELU (tanh) of x + bias, from its formula in float64"""
    cases = [((37, 53), np.float32, 3.0), ((1, 1), np.float64, 1.0), ((5, 7, 129), np.float32, 8.0),
             ((300,), np.float64, 5.0)]
    for k, (shape, dtype, scale) in enumerate(cases):
        x = (scale * _rng(k).standard_normal(shape)).astype(dtype)
        bias = _rng(10 + k).standard_normal(shape[-1]).astype(dtype)
        got = submission.call("cupy_streams.bias_gelu", x, bias)
        what = f"bias_gelu on a {shape} {np.dtype(dtype).name} array"
        _expect_same_kind(got, x, what)
        tol = {"rtol": 2e-6, "atol": 1e-6} if dtype == np.float32 else {"rtol": 1e-12, "atol": 1e-12}
        expect_array(got, oracles.gelu_tanh(x + bias), what, **tol)


@pytest.mark.points(2)
def check_bias_gelu_kernel_compiles(submission, metrics):
    """bias_gelu_kernel's CUDA C compiles with NVRTC for every GPU the course supports, sm_75 to sm_120, float and double (no GPU needed)"""
    compiled = submission.call("autograder.grading.checking.compile_cupy_kernels", "cupy_streams", "bias_gelu_kernel")
    kernels = compiled.get("kernels", {})
    assert "kernels" not in compiled or len(kernels) == 1, (
        f"bias_gelu_kernel made {len(kernels)} kernels ({', '.join(kernels) or 'none'}): the fused kernel is one "
        "cupy.ElementwiseKernel")
    expect_compiled(compiled, next(iter(kernels), ""), metrics,
                    note="On the CPU tier bias_gelu runs its NumPy path; on a GPU CuPy compiles this C")


def _gelu_edge_cases(dtype):
    """(x, bias) pairs: x + bias at GELU's edges (x and bias 3:1 of each), and a 2-D x
    with a bias broadcast along its last axis."""
    edges = np.array(oracles.GELU_EDGES)
    x = (3 * _rng(80).standard_normal((37, 53))).astype(dtype)
    return [((0.75 * edges).astype(dtype), (0.25 * edges).astype(dtype)),
            (x, _rng(81).standard_normal(53).astype(dtype))]


@pytest.mark.points(2)
def check_bias_gelu_kernel_runs_on_host(submission):
    """bias_gelu_kernel's C, built for the host and run, equals GELU (tanh) at edge inputs, float and double (no GPU needed)"""
    cases = _gelu_edge_cases(np.float32) + _gelu_edge_cases(np.float64)
    ran = submission.harness("host_bias_gelu", cases)
    if "unavailable" in ran:
        pytest.skip(f"cannot build CUDA C for the host here: {ran['unavailable']}")
    assert "made" not in ran, (
        f"bias_gelu_kernel made {', '.join(ran['made']) or 'no kernel'}: the fused kernel is one "
        "cupy.ElementwiseKernel")
    if "not_built" in ran:  # what only a GPU has, or what no GPU compiles either: not for this check to say
        pytest.skip("the host build, which has no warp functions, atomics, shared memory, CuPy headers or CUDA "
                    "intrinsics beyond fast math, could not build this kernel: " +
                    "; ".join(dict.fromkeys(ran["not_built"].values())) +
                    ". bias_gelu_kernel_compiles says whether a GPU compiles it; the GPU tier runs it")
    for (x, bias), got in zip(cases, ran["outputs"]):
        problem = oracles.gelu_problem(got, x + bias)  # added in x's dtype, as the kernel adds them
        kind = "edge inputs" if x.ndim == 1 else f"a {x.shape} x and a bias along its last axis"
        assert problem is None, f"bias_gelu_kernel's C as {oracles.C_TYPE[x.dtype]} on {kind}: {problem}"


# --- 2. Backend-generic, stable softmax ------------------------------------

@pytest.mark.points(2)
def check_softmax_on_numpy(submission):
    """softmax_rows equals a stable softmax along the last axis, in float64 (odd shapes, float32 and float64)"""
    cases = [((37, 53), np.float32), ((1, 1), np.float64), ((4, 5, 129), np.float64), ((3, 2), np.float32)]
    for k, (shape, dtype) in enumerate(cases):
        x = (4 * _rng(20 + k).standard_normal(shape)).astype(dtype)
        got = submission.call("cupy_streams.softmax_rows", x)
        what = f"softmax_rows on a {shape} {np.dtype(dtype).name} array"
        _expect_same_kind(got, x, what)
        tol = {"rtol": 1e-5, "atol": 1e-7} if dtype == np.float32 else {"rtol": 1e-12, "atol": 1e-15}
        expect_array(got, oracles.softmax(x), what, **tol)


@pytest.mark.points(2)
def check_softmax_stable_for_huge_inputs(submission, seed):
    """softmax_rows stays finite and correct for inputs around 1e4 (no overflow)"""
    rng = seeds.rng(seed, "04", "huge softmax")
    drawn = rng.choice([-1.0, 1.0], (2, 1)) * rng.uniform(1e3, 3e4, (2, 1)) + rng.uniform(-3.0, 3.0, (2, 4))
    x = np.concatenate([[[1e4, 1e4 - 1, 1e4 - 2, -1e4], [-1e4, -1e4, -1e4, -1e4], [3e4, 0.0, -3e4, 2.9999e4],
                         [800.0, 801.0, 799.0, 0.0]], drawn])
    for dtype in (np.float64, np.float32):
        xs = x.astype(dtype)
        got = submission.call("cupy_streams.softmax_rows", xs)
        what = f"softmax_rows on inputs near ±1e4 ({np.dtype(dtype).name})"
        _expect_same_kind(got, xs, what)
        bad = int((~np.isfinite(got)).sum())
        assert bad == 0, (f"{what}: {bad} of {got.size} results are NaN or inf: exp(1e4) overflows. "
                          "Softmax does not change if each row is shifted by a constant; which constant "
                          "keeps every exponent at or below 0?")
        expect_array(got, oracles.softmax(xs), what, rtol=1e-5, atol=1e-7)


# --- 3. The stream pipeline, on the recording stand-in ---------------------

def _chunks(sizes, offset=0, cols=CHUNK_SHAPE[1]):
    return [_rng(40 + offset + i).standard_normal((rows, cols)).astype(np.float32) for i, rows in enumerate(sizes)]


def _expect_results(run, chunks, n_streams, function):
    """The run returned f of every chunk, each come back by a device-to-host copy (the
    stand-in's device arrays cannot be read on the host, so nothing else can bring it)."""
    where = f"with {n_streams} stream(s)"
    got = run["results"]
    assert got is not None, "pipelined_apply returned None: return the list of host results"
    assert len(got) == len(chunks), f"{where}: {len(chunks)} chunks in, {len(got)} results out"
    assert not run["on_device"], (
        f"{where}: result(s) {run['on_device']} are device arrays (what gpu.launch returns), which the host "
        "cannot read: copy each into a buffer from gpu.pinned_empty with gpu.to_host(d_result, out, stream), "
        "and return those buffers once the host has waited")
    missing = [i for i in range(len(chunks)) if i not in run["copied_back"]]
    assert not missing, (
        f"{where}: the event log has no device-to-host copy of chunk(s) {missing}: each result comes back "
        "with gpu.to_host(d_result, out, stream), into a buffer from gpu.pinned_empty")
    for i, (chunk, result) in enumerate(zip(chunks, got)):
        expect_array(result, oracles.PIPELINE_FUNCTIONS[function](chunk), f"{where}: result {i}",
                     rtol=1e-6, atol=1e-6)


def _pipeline(submission, chunks, n_streams, function="affine", costs=None, claim=None):
    """The recorded run; with ``claim``, credited only if its results are right (no
    schedule property without the work: doing nothing has no hazards and a short makespan)."""
    run = submission.harness("recorded_pipeline", chunks, n_streams, function, costs)
    assert run["f_calls"] == run["compute_ops"] == len(chunks), (
        f"f ran {run['f_calls']} times, {run['compute_ops']} of them through gpu.launch, for {len(chunks)} "
        "chunks: run f once per chunk, with gpu.launch(f, device_array, stream=...)")
    if claim:
        with_the_work(claim, lambda: _expect_results(run, chunks, n_streams, function))
    return run


@pytest.mark.points(2)
@pytest.mark.parametrize("function", ["affine", "row_sums"], ids=["same shape", "row sums"])
def check_pipeline_results(submission, function):
    """pipelined_apply returns f of every chunk, in order, copied back to the host (chunks of unequal size; one chunk on one stream)"""
    unequal = _chunks([32, 32, 17, 32, 1, 32, 9])
    for n_streams, chunks in ((2, unequal), (3, unequal), (1, unequal[2:3])):  # and the smallest pipeline
        _expect_results(_pipeline(submission, chunks, n_streams, function), chunks, n_streams, function)


@pytest.mark.points(2)
def check_pipeline_issues_next_copy_before_waiting(submission):
    """The copy of chunk i+1 is issued before the host waits for the compute of chunk i"""
    for n_streams in (2, 3):
        run = _pipeline(submission, _chunks([32] * 6), n_streams, claim="issuing the next copy before waiting")
        early = run["copy_issued_before_wait"]
        late = [i for i, ok in enumerate(early) if not ok]
        assert not late, (
            f"with {n_streams} streams, the host waited for the compute of chunk(s) {late} before issuing the "
            "next chunk's copy to the device, so that copy cannot overlap it: do not synchronize (or copy "
            "into pageable memory, which waits too) inside the loop")


@pytest.mark.points(2)
@pytest.mark.parametrize("n_streams, costs", [(2, BALANCED), (3, BALANCED), (3, COMPUTE_BOUND)],
                         ids=["2 streams", "3 streams", "3 streams, compute-bound"])
def check_pipeline_overlaps(submission, n_streams, costs):
    """On the model GPU the pipeline beats the serial makespan as the formula predicts"""
    chunks = _chunks([CHUNK_SHAPE[0]] * 8, offset=20)
    run = _pipeline(submission, chunks, n_streams, costs=costs, claim="beating the serial makespan")
    t_serial, t_pipe = oracles.pipe_bound(len(chunks), {k: CHUNK_BYTES * costs[f"{k}_s_per_byte"]
                                                        for k in ("h2d", "compute", "d2h")})
    got = run["makespan"]
    # Two streams hold two chunks in flight, so three engines cannot all be busy: about 1.5 stages per chunk.
    limit = 0.6 * t_serial if n_streams == 2 else 1.02 * t_pipe
    assert got <= limit, (
        f"{len(chunks)} chunks on {n_streams} streams took {got:.3g} s on the model GPU; serial is "
        f"T_serial = ΣT_h2d + ΣT_comp + ΣT_d2h = {t_serial:.3g} s, a full pipeline "
        f"T_pipe = max(ΣT_h2d, ΣT_comp, ΣT_d2h) + one chunk's other stages = {t_pipe:.3g} s "
        f"(needed ≤ {limit:.3g} s). Chunk i goes to stream i % n_streams, copies use pinned buffers, "
        "and the host waits once, at the end")


@pytest.mark.points(1)
def check_pipeline_uses_n_streams(submission):
    """pipelined_apply spreads the chunks over n_streams streams"""
    chunks = _chunks([8] * 6, offset=30)
    for n_streams in (1, 2, 3, 5):
        run = _pipeline(submission, chunks, n_streams, claim="spreading the chunks over the streams")
        want = min(n_streams, len(chunks))
        assert run["streams_used"] == want, (
            f"n_streams={n_streams}: the work went to {run['streams_used']} stream(s), expected {want}")


@pytest.mark.points(1)
def check_pipeline_uses_pinned_buffers(submission):
    """Every copy goes through a page-locked buffer from gpu.pinned_empty"""
    run = _pipeline(submission, _chunks([16] * 4, offset=50), 2, claim="copying through pinned buffers")
    assert run["pageable_copies"] == 0, (
        f"{run['pageable_copies']} copies used pageable host memory (an ordinary NumPy array): such a copy "
        "blocks the host until it is done, so nothing overlaps. Stage each chunk into gpu.pinned_empty "
        "and copy results back into pinned buffers")


@pytest.mark.points(2)
def check_pipeline_no_hazards(submission):
    """No device array is used out of stream order, and no result is read before it has arrived"""
    for n_streams in (2, 3):
        run = _pipeline(submission, _chunks([16, 16, 16, 5], offset=60), n_streams,
                        claim="a schedule without hazards")
        assert not run["hazards"], f"with {n_streams} streams: " + "; ".join(run["hazards"][:3])


# --- 4. Zero-copy ------------------------------------------------------------

@pytest.mark.points(1)
def check_to_torch_shares_memory(submission):
    """to_torch(numpy_array) is a tensor on the same memory (DLPack), not a copy"""
    values = np.arange(7, dtype=np.float32) / 3
    got = submission.harness("torch_view_of_numpy", values)
    assert got["type"] == "Tensor", f"to_torch returned a {got['type']}, expected a torch.Tensor"
    expect_array(got["values"], values, "to_torch(x) values")
    assert got["same_pointer"] and got["write_seen_by_numpy"], (
        "the tensor does not share the array's memory (a write through it is not seen by NumPy): "
        "torch.tensor copies; DLPack wraps the same buffer")


@pytest.mark.points(1)
def check_from_torch_shares_memory(submission):
    """from_torch(cpu_tensor) is a NumPy array on the same memory, not a copy"""
    values = [1.5, 2.5, -3.0, 4.0]
    got = submission.harness("numpy_view_of_torch", values)
    assert got["type"] == "ndarray", f"from_torch returned a {got['type']}, expected a NumPy array"
    expect_array(got["values"], np.array(values, dtype=np.float32), "from_torch(t) values")
    assert got["same_pointer"] and got["write_seen_by_numpy"], (
        "the array does not share the tensor's memory (a write to the tensor is not seen): "
        "np.array(t) copies; DLPack wraps the same buffer")


# --- 5. Roofline -------------------------------------------------------------

@pytest.mark.points(1)
def check_arithmetic_intensity(submission, seed):
    """arithmetic_intensity is flops per byte"""
    drawn = [(c[1], c[2], c[1] / c[2]) for c in oracles.drawn_roofline_cases(seeds.rng(seed, "04", "intensity"), 3)]
    for flops, nbytes, want in oracles.INTENSITY_CASES + drawn:
        got = submission.call("cupy_streams.arithmetic_intensity", flops, nbytes)
        expect_close(got, want, f"arithmetic_intensity({flops:g}, {nbytes:g})", rel=1e-9)


def _roofline(submission, name, flops, nbytes, device):
    got = submission.call("cupy_streams.roofline", flops, nbytes, *device)
    assert isinstance(got, (tuple, list)) and len(got) == 2, (
        f"roofline should return (attainable, bound), got {got!r}")
    return got


def _roofline_cases(seed):
    """The hand-worked cases and as many made-up cards drawn from the grading's seed."""
    return oracles.ROOFLINE_CASES + oracles.drawn_roofline_cases(seeds.rng(seed, "04", "roofline"))


@pytest.mark.points(2)
def check_roofline_classifies(submission, seed):
    """roofline says memory-bound left of the ridge point, compute-bound on and right of it"""
    for name, flops, nbytes, device, _, bound in _roofline_cases(seed):
        _, got = _roofline(submission, name, flops, nbytes, device)
        ridge = device[0] / device[1]
        assert got == bound, (f"{name}: I = {flops / nbytes:.3g} flop/B against a ridge point of "
                              f"{ridge:.3g} flop/B (peak FLOP/s / bandwidth) is {bound}, got {got!r}")


@pytest.mark.points(1)
def check_roofline_attainable(submission, seed):
    """roofline's attainable FLOP/s is min(peak, I x bandwidth)"""
    for name, flops, nbytes, device, attainable, _ in _roofline_cases(seed):
        got, _ = _roofline(submission, name, flops, nbytes, device)
        expect_close(got, attainable, f"{name}: attainable FLOP/s", rel=1e-9)


# --- GPU tier ----------------------------------------------------------------
#
# Each of these runs on the GPU tier, and with --dry-run-gpu on the CPU tier at tiny
# sizes on stand-ins (course.gpu_stand_in), awarding nothing. Times come from
# course.gpu_timing in the sandbox and are judged here (autograder.grading.timed): every
# timed run's sampled output against an oracle computed from its seed, and a floor at
# the card's peak.

@pytest.mark.gpu
@pytest.mark.points(2)
def check_bias_gelu_kernel_on_device(submission, gpu_dry_run):
    """bias_gelu on CuPy arrays (the ElementwiseKernel) equals GELU (tanh) from its formula"""
    x = (3 * _rng(70).standard_normal((19, 31) if gpu_dry_run else (4099, 1031))).astype(np.float32)
    bias = _rng(71).standard_normal(x.shape[1]).astype(np.float32)
    got = submission.harness("device_bias_gelu", x, bias)
    assert got["kind"] == "device", f"bias_gelu on CuPy input returned a {got['kind']} array, not a CuPy array"
    expect_array(got["values"], oracles.gelu_tanh(x + bias), "bias_gelu on the device", rtol=2e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.points(1)
def check_softmax_on_device(submission, gpu_dry_run):
    """softmax_rows on CuPy arrays returns CuPy arrays, stable and correct"""
    x = (1e4 * _rng(72).standard_normal((17, 23) if gpu_dry_run else (2049, 1000))).astype(np.float32)
    got = submission.harness("device_softmax", x)
    assert got["kind"] == "device", f"softmax_rows on CuPy input returned a {got['kind']} array, not a CuPy array"
    expect_array(got["values"], oracles.softmax(x), "softmax_rows on the device", rtol=1e-4, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.points(2)
def check_fused_faster_than_unfused(submission, metrics, gpu_dry_run, seed):
    """The fused bias+GELU kernel beats the one-operation-at-a-time version"""
    (rows, cols), runs = ((32, 64), 2) if gpu_dry_run else ((8192, 8192), 10)
    size = rows * cols
    m = submission.harness("fused_vs_unfused", rows, cols, timed.draw_seeds(runs, seed, "fused_faster_than_unfused"))
    gelu = oracles.gelu_recheck(size, cols)
    fused = timed.judge(m["fused"], "bias_gelu (fused)", gelu, moved_bytes=2 * 4 * size, dry_run=gpu_dry_run)
    unfused = timed.judge(m["unfused"], "bias + GELU, one CuPy operation at a time", gelu,
                          moved_bytes=2 * 4 * size, dry_run=gpu_dry_run)
    copy = timed.judge(m["copy"], "device copy of x", oracles.copy_recheck(size), moved_bytes=2 * 4 * size,
                       dry_run=gpu_dry_run)
    speedup = unfused.median_s / fused.median_s
    fused_gbs, copy_gbs = 2 * 4 * size / fused.median_s / 1e9, 2 * 4 * size / copy.median_s / 1e9
    metrics.update(speedup=round(speedup, 2), fused_gbs=round(fused_gbs, 1), copy_gbs=round(copy_gbs, 1),
                   threshold=FUSED_SPEEDUP_TO_PASS,
                   **timed.metrics(m["fused"]["record"], fused=fused, unfused=unfused, copy=copy))
    timed.expect(speedup >= FUSED_SPEEDUP_TO_PASS, gpu_dry_run,
                 f"fused {fused.median_s * 1e3:.3f} ms vs unfused {unfused.median_s * 1e3:.3f} ms: {speedup:.2f}x, "
                 f"needs {FUSED_SPEEDUP_TO_PASS}x. Is bias_gelu one ElementwiseKernel launch (not several CuPy "
                 f"operations)? Measured: {fused.describe()}; {unfused.describe()}; {copy.describe()}")


@pytest.mark.gpu
@pytest.mark.points(3)
def check_pipeline_overlap_speedup(submission, metrics, gpu_dry_run, seed):
    """On the GPU, the pipeline beats the serial schedule when copies and compute are balanced"""
    n_chunks, chunk_elems, runs, max_spins = (4, 256, 2, 8) if gpu_dry_run else (8, 32 * 2**20 // 4, 3, 1 << 16)
    base_seed, *seeds = timed.draw_seeds(runs + 1, seed, "pipeline_overlap_speedup")
    m = submission.harness("overlap_speedup", n_chunks, chunk_elems, 3, base_seed, seeds, max_spins)
    recheck = oracles.spin_recheck(n_chunks, chunk_elems, base_seed, m["spins"])
    work = {"flops": 2 * m["spins"] * chunk_elems * n_chunks, "moved_bytes": 2 * 4 * chunk_elems * n_chunks}
    serial = timed.judge(m["serial"], "serial schedule", recheck, dry_run=gpu_dry_run, **work)
    piped = timed.judge(m["pipelined"], "pipelined_apply on 3 streams", recheck, dry_run=gpu_dry_run, **work)
    speedup = serial.median_s / piped.median_s
    metrics.update(**{k: round(m[k], 3) for k in ("stage_ms", "h2d_ms", "compute_ms", "d2h_ms")},
                   spins=m["spins"], speedup=round(speedup, 2), threshold=OVERLAP_SPEEDUP_TO_PASS,
                   **timed.metrics(m["serial"]["record"], serial=serial, pipelined=piped))
    timed.expect(speedup >= OVERLAP_SPEEDUP_TO_PASS, gpu_dry_run,
                 f"serial {serial.median_s * 1e3:.1f} ms, pipelined {piped.median_s * 1e3:.1f} ms: {speedup:.2f}x, "
                 f"needs {OVERLAP_SPEEDUP_TO_PASS}x (per chunk: stage {m['stage_ms']:.2f}, H→D {m['h2d_ms']:.2f}, "
                 f"compute {m['compute_ms']:.2f}, D→H {m['d2h_ms']:.2f} ms). Measured: {serial.describe()}; "
                 f"{piped.describe()}")


@pytest.mark.gpu
@pytest.mark.points(2)
def check_zero_copy_on_device(submission, gpu_dry_run):
    """CuPy, torch and numba.cuda share device memory without copies"""
    m = submission.harness("zero_copy_device")
    problems = [what for key, what in [
        ("torch_on_device", "to_torch(cupy array) is not a tensor on the array's device"),
        ("torch_same_pointer", "to_torch(cupy array) does not point at the array's memory"),
        ("torch_write_seen", "a write through the tensor is not seen by CuPy"),
        ("numba_same_pointer", "to_numba(cupy array) does not point at the array's memory"),
        ("numba_write_seen", "a write through numba is not seen by CuPy"),
        ("from_torch_is_cupy", "from_torch(cuda tensor) is not a CuPy array"),
        ("from_torch_same_pointer", "from_torch(cuda tensor) does not point at the tensor's memory"),
    ] if not m.get(key)]
    assert not problems, "; ".join(problems)


@pytest.mark.gpu
@pytest.mark.points(1)
def check_roofline_measured(submission, metrics, gpu_dry_run, seed):
    """The measured roofline of this GPU places bias+GELU and matmul on the right side of the ridge"""
    (n, m_size), runs = ((4096, 32), 2) if gpu_dry_run else ((1 << 26, 8192), 5)
    got = submission.harness("roofline_measured", n, m_size, timed.draw_seeds(runs, seed, "roofline_measured"))
    copy = timed.judge(got["copy"], "device copy", oracles.sampled_recheck(n, lambda seed, where: gpu_timing.hashed(
        np, seed, None, positions=where)), moved_bytes=2 * 4 * n, dry_run=gpu_dry_run)
    matmul = timed.judge(got["matmul"], "cuBLAS FP32 matmul (TF32 off)",
                         oracles.sampled_recheck(m_size**2, lambda seed, where: gpu_timing.hashed_product_at(seed, m_size, where)), flops=2 * m_size**3,
                         moved_bytes=3 * 4 * m_size**2, dry_run=gpu_dry_run)
    gelu = timed.judge(got["bias_gelu"], "bias_gelu", oracles.gelu_recheck(n, 1024), moved_bytes=2 * 4 * n,
                       dry_run=gpu_dry_run)
    copy_bw, matmul_flops = 2 * 4 * n / copy.median_s, 2 * m_size**3 / matmul.median_s
    gelu_flops_per_element, gelu_bytes_per_element = 10, 8  # add, 3 mul-adds, tanh ~ 10; read x, write y
    kernels = {"bias_gelu": (gelu_flops_per_element * n, gelu_bytes_per_element * n),
               "fp32_matmul": (2 * m_size**3, 3 * 4 * m_size**2)}
    bounds = {name: submission.call("cupy_streams.roofline", fl, by, matmul_flops, copy_bw)[1]
              for name, (fl, by) in kernels.items()}
    metrics.update(copy_gbs=round(copy_bw / 1e9, 1), fp32_matmul_tflops=round(matmul_flops / 1e12, 2),
                   bias_gelu_gflops=round(gelu_flops_per_element * n / gelu.median_s / 1e9, 1),
                   bias_gelu_intensity=gelu_flops_per_element / gelu_bytes_per_element,
                   matmul_intensity=round(2 * m_size**3 / (3 * 4 * m_size**2), 1),
                   **timed.metrics(got["copy"]["record"], copy=copy, matmul=matmul, bias_gelu=gelu))
    timed.expect(bounds == {"bias_gelu": "memory-bound", "fp32_matmul": "compute-bound"}, gpu_dry_run,
                 f"on the measured roof (ridge {matmul_flops / copy_bw:.3g} flop/B) roofline says {bounds}. "
                 f"Measured: {copy.describe()}; {matmul.describe()}; {gelu.describe()}")
