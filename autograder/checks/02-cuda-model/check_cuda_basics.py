"""Checks for lab 02: kernels against NumPy, on poisoned buffers with canaries.

CPU tier: the CUDA simulator, at sizes that are not multiples of the block.
GPU tier: the same checks at sizes that fill the device, and the saxpy kernel's
bandwidth as a ratio of a device-to-device copy measured in the same run, both
timed by ``course.gpu_timing`` and judged by ``autograder.grading.timed`` (new
inputs, a checked output and an L2 flush for every run, a floor at the card's
peak bandwidth). ``k2c grade 02 --dry-run-gpu`` runs that check on stand-ins.
"""
import functools

import numpy as np
import pytest

from autograder.grading import timed
from autograder.grading import seeds
from autograder.grading.checking import (by_tier, compiled_kernels, expect_array, expect_compiled, require_compiles,
                                         with_the_work)
from course import gpu_timing

SEED = 2026
BANDWIDTH_RATIO_TO_PASS = 0.6  # saxpy's effective bandwidth / device copy bandwidth
SAXPY_A = 2.5  # the a of the timed saxpy runs
# The kernels as the harness launches them: float32 arrays of any layout.
SIGNATURES = {"relu_kernel": "void(float32[:], float32[:])",
              "saxpy_kernel": "void(float32[:], float32, float32[:], float32[:])",
              "broadcast_add_kernel": "void(float32[:, :], float32[:], float32[:])"}


def _floats(n, seed=SEED):
    return seeds.rng(_GRADING_SEED[0], "02", seed).standard_normal(n).astype(np.float32)


# The graded inputs are drawn from the grading's secret seed (autograder.grading.seeds): each check
# sets it here before it draws, and every input of one grading comes from the same seed.
_GRADING_SEED = [0]


@pytest.fixture(autouse=True)
def _draw_from_the_grading_seed(seed):
    _GRADING_SEED[0] = seed


@functools.lru_cache(maxsize=4)
def _device_floats(seed):
    """10_000_019 random floats: a GPU-tier input, made when that tier asks for it."""
    return _floats(10_000_019, seed)


def _require_compiles(submission, kernel):
    # Compiled for a GPU, each kernel must store its output: the kernel a GPU runs is the one graded.
    require_compiles(submission, "cuda_basics", SIGNATURES, kernel, shows=("global_stores",))


@pytest.mark.points(1)
@pytest.mark.parametrize("kernel", SIGNATURES)
def check_compiles_for_a_gpu(submission, kernel, metrics):
    """compiles with numba's CUDA compiler for every GPU the course supports, sm_75 to sm_120 (registers, shared memory and spills from ptxas)"""
    expect_compiled(compiled_kernels(submission, "cuda_basics", SIGNATURES, kernel), kernel, metrics,
                    shows=("global_stores",))
    # A kernel that does nothing compiles too: the points need it to compute something right as well
    # (its own checks say how well).
    with_the_work(f"compiling {kernel}", lambda: _computes_something(submission, kernel))


def _computes_something(submission, kernel):
    """Some element of the kernel's plainest launch (in the simulator) is right."""
    x, y = _floats(256, SEED + 6), _floats(256, SEED + 7)
    launch, want = {"relu_kernel": (("relu_1d", x, 128), np.maximum(x, 0)),
                    "saxpy_kernel": (("saxpy_1d", 2.5, x, y, 128), np.float32(2.5) * x + y),
                    "broadcast_add_kernel": (("broadcast_add_2d", x[:16], y[:16], (16, 16)),
                                             x[:16, None] + y[None, :16])}[kernel]
    result = submission.in_simulator().harness(*launch)
    buffer = np.asarray(result["buffer"])
    got = buffer[:want.shape[0], :want.shape[1]] if want.ndim == 2 else buffer[:want.size]
    assert result["launch_error"] is None and np.isclose(got, want, rtol=1e-5).any(), (
        f"{kernel} wrote no right element of its output (a kernel that computes nothing compiles too)")


def _expect_launch(result, n_or_shape, want, what):
    """The output region must equal ``want``; the canary around it must be untouched."""
    assert result["launch_error"] is None, (
        f"{what}: the launch failed — {result['launch_error']}. An index past the end of the data "
        "usually means a thread without a bounds guard")
    buf = result["buffer"]
    if isinstance(n_or_shape, int):
        out, canary = buf[:n_or_shape], buf[n_or_shape:]
    else:
        rows, cols = n_or_shape
        out = buf[:rows, :cols]
        canary = np.concatenate([buf[rows:, :].ravel(), buf[:rows, cols:].ravel()])
    touched = np.flatnonzero(~np.isnan(canary))
    assert touched.size == 0, (
        f"{what}: {touched.size} element(s) past the end of the output were written: "
        "threads whose index is outside the data must do nothing (add the guard)")
    expect_array(out, want, what, rtol=1e-6, atol=1e-6)


@pytest.mark.points(2)
def check_launch_config(submission, seed):
    """launch_config gives every element a thread, with the fewest blocks"""
    rng = seeds.rng(seed, "02", "launch config")
    cases = [(1, 32), (31, 32), (32, 32), (33, 32), (1000, 128), (1024, 256), (10_000_019, 256), (7, 1)]
    cases += [(int(rng.integers(1, 10**7)), int(2 ** rng.integers(5, 11))) for _ in range(4)]
    got = submission.harness("launch_configs", cases)
    for (n, tpb), (blocks, threads) in zip(cases, got):
        want = -(-n // tpb)
        assert threads == tpb, f"launch_config({n}, {tpb}) returned {threads} threads per block, expected {tpb}"
        assert blocks * threads >= n, (
            f"launch_config({n}, {tpb}) = ({blocks}, {threads}) gives only {blocks * threads} threads "
            f"for {n} elements (round the division up)")
        assert blocks == want, f"launch_config({n}, {tpb}) = {blocks} blocks, expected {want} (the fewest that cover n)"


@pytest.mark.points(2)
def check_relu_every_element(submission, tier):
    """relu_kernel writes every element (size a multiple of the block)"""
    _require_compiles(submission, "relu_kernel")
    n = by_tier(tier, cpu=1024, gpu=1 << 24)
    x = _floats(n)
    result = submission.harness("relu_1d", x, 128)
    _expect_launch(result, n, np.maximum(x, 0), "relu_kernel output")


@pytest.mark.points(2)
def check_relu_guard(submission, tier):
    """relu_kernel guards the last, partial block (size not a multiple of the block)"""
    _require_compiles(submission, "relu_kernel")
    n = by_tier(tier, cpu=1001, gpu=10_000_019)
    x = _floats(n, SEED + 1)
    result = submission.harness("relu_1d", x, 128)
    _expect_launch(result, n, np.maximum(x, 0), "relu_kernel output")


@pytest.mark.points(3)
def check_saxpy_kernel(submission, tier):
    """saxpy_kernel computes a*x + y for every element, with a guard"""
    _require_compiles(submission, "saxpy_kernel")
    n = by_tier(tier, cpu=999, gpu=10_000_019)
    x, y = _floats(n, SEED + 2), _floats(n, SEED + 3)
    result = submission.harness("saxpy_1d", 2.5, x, y, 64)
    _expect_launch(result, n, np.float32(2.5) * x + y, "saxpy_kernel output")


@pytest.mark.points(2)
@pytest.mark.parametrize("block", [(16, 16), (32, 4)], ids=["block 16x16", "block 32x4"])
def check_broadcast_add_kernel(submission, tier, block):
    """broadcast_add_kernel fills a non-square table, x along columns"""
    _require_compiles(submission, "broadcast_add_kernel")
    rows, cols = by_tier(tier, cpu=(37, 53), gpu=(4099, 4101))
    col, row = _floats(rows, SEED + 4), _floats(cols, SEED + 5)
    result = submission.harness("broadcast_add_2d", col, row, block)
    _expect_launch(result, (rows, cols), col[:, None] + row[None, :], "broadcast_add_kernel output")


def _expect_own_elements(result, what, element_of, one_d):
    """Every output element written once, by the thread ``element_of`` maps to it."""
    assert result["launch_error"] is None, f"{what}: the launch failed — {result['launch_error']}"
    writes = result["writes"]
    assert len(writes), (f"{what}: no thread wrote a single element of the output: whole-array or NumPy "
                         "operations inside a kernel run only in the simulator; each thread writes out[its index]")
    threads = {(int(x), int(y)) for x, y, *_ in writes}
    if len(threads) == 1:
        x, y = next(iter(threads))
        raise AssertionError(f"{what}: every write came from one thread ({_at(x, y, one_d)}); on a GPU each thread "
                             "computes its own element, which is what makes the kernel parallel")
    for x, y, i, j, wrapped in writes:
        want = element_of(int(x), int(y))
        # A negative index wraps around (in NumPy and in the simulator), which can leave the output right.
        how = " through a negative index, which wraps around to the end" if wrapped else ""
        assert (int(i), int(j)) == want, (
            f"{what}: the thread with global index {_at(x, y, one_d)} wrote out{_at(j, i, one_d, True)}{how}, "
            f"expected out{_at(want[1], want[0], one_d, True)} — each thread writes the element at its own global index")
    per_element = {}
    for _, _, i, j, _ in writes:
        per_element[(int(i), int(j))] = per_element.get((int(i), int(j)), 0) + 1
    twice = [e for e, count in per_element.items() if count > 1]
    i, j = twice[0] if twice else (0, 0)
    assert not twice, f"{what}: out{_at(j, i, one_d, True)} was written {per_element[twice[0]]} times"


def _at(x, y, one_d, element=False):
    """``i`` (1-D) or ``(x, y)``; as an element, ``[i]`` or ``[row, column]``."""
    if element:
        return f"[{x}]" if one_d else f"[{y}, {x}]"
    return f"{x}" if one_d else f"(x={x}, y={y})"


@pytest.mark.points(2)
@pytest.mark.parametrize("kernel", ["relu_kernel", "saxpy_kernel"])
def check_each_thread_writes_its_own_element(submission, kernel):
    """the thread with global index i writes out[i], and no thread writes another's (seen in the simulator)"""
    n, x = 300, _floats(300, SEED + 11)
    inputs = (x,) if kernel == "relu_kernel" else (2.0, x, _floats(300, SEED + 12))
    _require_compiles(submission, kernel)
    result = submission.in_simulator().harness("thread_writes", kernel, n, 64, *inputs)
    _expect_own_elements(result, kernel, lambda gx, gy: (0, gx), one_d=True)


@pytest.mark.points(2)
def check_broadcast_add_thread_mapping(submission):
    """broadcast_add_kernel: the thread at global (x, y) writes out[y, x], x along columns (seen in the simulator)"""
    _require_compiles(submission, "broadcast_add_kernel")
    col, row = _floats(13, SEED + 13), _floats(21, SEED + 14)
    result = submission.in_simulator().harness("thread_writes", "broadcast_add_kernel", (13, 21), (8, 4), col, row)
    _expect_own_elements(result, "broadcast_add_kernel", lambda gx, gy: (gy, gx), one_d=False)


def _host(submission, tier, func, args, config_sizes, device_args=None):
    """The host function run in the simulator (what it returns and how it
    launched), and on the GPU tier its result at device size as well, on the
    arguments ``device_args()`` makes (only there: 10^7 random floats take 0.2 s
    each to make)."""
    run = submission.in_simulator().harness("host_launches", func, config_sizes, *args)
    device = submission.harness(f"host_{func}", *device_args()) if tier == "gpu" and device_args else None
    return run, device


def _expect_launches(run, kernel, grid, block, how):
    """One launch of ``kernel``, with exactly this grid and block (each x, y, z)."""
    launched = [(k, tuple(g), tuple(b)) for k, g, b in run["launches"]]
    ours = [launch for launch in launched if launch[0] == kernel]
    assert len(ours) == 1, f"expected one launch of {kernel}, saw {len(ours)} (all launches: {launched})"
    _, got_grid, got_block = ours[0]
    assert (got_grid, got_block) == (grid, block), (
        f"{kernel} was launched with {got_grid[:len(how)]} blocks of {got_block[:len(how)]} threads "
        f"(x, y); expected {grid[:len(how)]} blocks of {block[:len(how)]}: {how}. An over-sized grid "
        "still gives the right answer thanks to the guard, but it starts threads that do nothing")


@pytest.mark.points(1)
def check_host_relu(submission, tier):
    """relu() launches relu_kernel once, with the blocks and threads launch_config gives, and returns relu(x)"""
    _require_compiles(submission, "relu_kernel")
    x = _floats(777, SEED + 6)
    x[-1] = 1 + abs(x[-1])  # relu's 0 would pass for an unwritten last element, where new memory is zeros
    run, device = _host(submission, tier, "relu", (x, 64), [(777, 64)], lambda: (_device_floats(SEED + 6), 64))
    expect_array(run["value"], np.maximum(x, 0), "relu(x)")
    blocks, threads = run["configs"][0]
    _expect_launches(run, "relu_kernel", (blocks, 1, 1), (threads, 1, 1),
                     f"launch_config(777, 64) = ({blocks}, {threads}) is (blocks, threads per block)")
    if device is not None:
        expect_array(device, np.maximum(_device_floats(SEED + 6), 0), "relu(x) on the GPU")


@pytest.mark.points(1)
def check_host_saxpy(submission, tier):
    """saxpy() launches saxpy_kernel once, with launch_config's blocks and threads, and returns a*x + y"""
    _require_compiles(submission, "saxpy_kernel")
    x, y = _floats(555, SEED + 7), _floats(555, SEED + 8)
    run, device = _host(submission, tier, "saxpy", (-1.5, x, y, 128), [(555, 128)],
                        lambda: (-1.5, _device_floats(SEED + 7), _device_floats(SEED + 8), 128))
    expect_array(run["value"], np.float32(-1.5) * x + y, "saxpy(a, x, y)", atol=1e-6)
    blocks, threads = run["configs"][0]
    _expect_launches(run, "saxpy_kernel", (blocks, 1, 1), (threads, 1, 1),
                     f"launch_config(555, 128) = ({blocks}, {threads}) is (blocks, threads per block)")
    if device is not None:
        expect_array(device, np.float32(-1.5) * _device_floats(SEED + 7) + _device_floats(SEED + 8),
                     "saxpy(a, x, y) on the GPU", atol=1e-6)


@pytest.mark.points(1)
def check_host_broadcast_add(submission, tier):
    """broadcast_add() launches the fewest blocks of the given shape that cover the table (x along columns) and returns it"""
    _require_compiles(submission, "broadcast_add_kernel")
    col, row = _floats(19, SEED + 9), _floats(48, SEED + 10)  # 48 columns: exactly 3 blocks of 16
    big = (_floats(3001, SEED + 9), _floats(2999, SEED + 10))
    run, device = _host(submission, tier, "broadcast_add", (col, row, (16, 8)), [], (*big, (16, 8)))
    expect_array(run["value"], col[:, None] + row[None, :], "broadcast_add(col, row)")
    _expect_launches(run, "broadcast_add_kernel", (3, 3, 1), (16, 8, 1),
                     "a 19 x 48 table in blocks of 16 x 8 needs ceil(48 / 16) = 3 blocks along x (the columns) "
                     "and ceil(19 / 8) = 3 along y (the rows)")
    if device is not None:
        expect_array(device, big[0][:, None] + big[1][None, :], "broadcast_add(col, row) on the GPU")


def _saxpy_recheck(n, a):
    """A timed saxpy run's sampled output against a*x + y, its x and y named by the run's seed."""
    def recheck(seed, kept):
        where = gpu_timing.sample_positions(seed, n)
        x = gpu_timing.hashed(np, seed, None, positions=where)
        y = gpu_timing.hashed(np, seed, None, stream=1, positions=where)
        return timed.sample_problem(kept, np.float32(a) * x + y, where, rtol=1e-6, atol=1e-6)
    return recheck


def _copy_recheck(n):
    def recheck(seed, kept):
        where = gpu_timing.sample_positions(seed, n)
        return timed.sample_problem(kept, gpu_timing.hashed(np, seed, None, positions=where), where, rtol=0)
    return recheck


@pytest.mark.gpu
@pytest.mark.points(3)
def check_saxpy_bandwidth(submission, metrics, gpu_dry_run, seed):
    """saxpy_kernel streams at a good fraction of device-copy bandwidth"""
    n, runs = (1000, 2) if gpu_dry_run else (1 << 26, 10)
    m = submission.harness("saxpy_bandwidth", n, timed.draw_seeds(runs, seed, "saxpy_bandwidth"), SAXPY_A)
    saxpy = timed.judge(m["saxpy"], "saxpy_kernel", _saxpy_recheck(n, SAXPY_A), moved_bytes=3 * 4 * n,
                        dry_run=gpu_dry_run)
    copy = timed.judge(m["copy"], "device-to-device copy", _copy_recheck(n), moved_bytes=2 * 4 * n,
                       dry_run=gpu_dry_run)
    saxpy_gbs, copy_gbs = 3 * 4 * n / saxpy.median_s / 1e9, 2 * 4 * n / copy.median_s / 1e9
    ratio = saxpy_gbs / copy_gbs
    metrics.update(saxpy_gbs=round(saxpy_gbs, 1), copy_gbs=round(copy_gbs, 1), ratio=round(ratio, 3),
                   threshold=BANDWIDTH_RATIO_TO_PASS, **timed.metrics(m["saxpy"]["record"], saxpy=saxpy, copy=copy))
    timed.expect(ratio >= BANDWIDTH_RATIO_TO_PASS, gpu_dry_run,
                 f"saxpy reached {saxpy_gbs:.0f} GB/s, {ratio:.2f} of a device copy's {copy_gbs:.0f} GB/s on "
                 f"{m['saxpy']['record']['name']} (needs {BANDWIDTH_RATIO_TO_PASS}): is every access coalesced "
                 f"(thread i touches element i)? Measured: {saxpy.describe()}; {copy.describe()}")
