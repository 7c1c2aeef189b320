"""Checks for lab 03: shared memory, barriers and atomics.

Results are compared with NumPy on poisoned outputs with canaries, at sizes that
are not multiples of the block or the tile. Races, bank conflicts, coalescing
and global loads are judged from the record of every memory access the kernel
made in numba's simulator (``course.cuda_audit``) — never from whether a racy
kernel happened to give a wrong answer this time. Those checks run in the
simulator on both tiers; the GPU tier adds device sizes and speed as ratios of
CuPy's own kernels (CUB's sum, cuBLAS FP32, bincount) measured in the same run.
"""
import math

import numpy as np
import pytest

from autograder.grading.checking import (INT_POISON, by_tier, compiled_kernels, expect_array, expect_compiled,
                                 require_compiles)

SEED = 2026
CANARY = 64

# GPU-tier pass marks, as fractions of CuPy's time for the same work. Chosen from
# what a textbook kernel reaches, not yet validated on a GPU run; see
# docs/gpu-tier.md for recorded numbers.
REDUCE_TO_CUPY_SUM = 0.5  # two-pass grid-stride block reduction vs CUB's device reduce
MATMUL_TO_CUBLAS = 0.05  # 16x16 shared-memory tiles vs cuBLAS SGEMM (a 2-D register-tiled kernel gets ~0.5)
HISTOGRAM_TO_BINCOUNT = 0.5  # shared-memory privatised bins vs cupy.bincount


def _rng(k=0):
    return np.random.default_rng(SEED + k)


# Inputs at simulator sizes: not multiples of the block, the segment or the tile.
CASES = {
    "reduce, grid smaller than data": lambda: ("block_sums", _rng(1).standard_normal(1000).astype(np.float32), 3),
    "reduce, one element per thread": lambda: ("block_sums", _rng(2).standard_normal(1000).astype(np.float32), 8),
    "scan": lambda: ("scan_segments", _rng(3).integers(-9, 10, 1000).astype(np.int32)),
    # Two tiles along every dimension, the last one partial (the simulator runs all 256 threads of each block).
    "matmul, ragged": lambda: ("matmul_tiles", _rng(4).standard_normal((19, 21)).astype(np.float32),
                               _rng(5).standard_normal((21, 17)).astype(np.float32)),
    # Two blocks of C, two tiles along the shared dimension: access patterns repeat per warp and tile.
    "matmul, whole tiles": lambda: ("matmul_tiles", _rng(6).standard_normal((32, 32)).astype(np.float32),
                                    _rng(7).standard_normal((32, 16)).astype(np.float32)),
    "histogram, 7 bins": lambda: ("histogram_blocks", _rng(8).integers(0, 7, 1500).astype(np.int32), 7, 3),
    "histogram, 200 bins": lambda: ("histogram_blocks", (_rng(9).zipf(1.5, 1500) % 200).astype(np.int32), 200, 3),
}


# The kernels as the harness launches them, and which kernel each of CASES launches.
SIGNATURES = {"block_sum_kernel": "void(float32[:], float32[:])",
              "scan_block_kernel": "void(int32[:], int32[:], int32[:])",
              "add_offsets_kernel": "void(int32[:], int32[:])",
              "tiled_matmul_kernel": "void(float32[:, :], float32[:, :], float32[:, :])",
              "histogram_kernel": "void(int32[:], int32[:])"}
KERNEL_OF = {"reduce": "block_sum_kernel", "scan": "scan_block_kernel", "matmul": "tiled_matmul_kernel",
             "histogram": "histogram_kernel"}


@pytest.mark.points(1)
@pytest.mark.parametrize("kernel", SIGNATURES)
def check_compiles_for_a_gpu(submission, kernel, metrics):
    """compiles for sm_80 and sm_90 with numba's CUDA compiler (registers and shared memory from ptxas)"""
    expect_compiled(compiled_kernels(submission, "shared_kernels", SIGNATURES, kernel), kernel, metrics)


def simulated(submission, case):
    """Run one of CASES in the simulator with the audit on (whatever the tier), once per grading run.
    A kernel no GPU would compile loses the points of every check that launches it."""
    require_compiles(submission, "shared_kernels", SIGNATURES, KERNEL_OF[case.split(",")[0]])
    sim = submission if submission.tier == "cpu" else submission.in_simulator()
    return sim.harness_once(case, *CASES[case]())


def inputs(case):
    return CASES[case]()[1:]


def _launched(result, what):
    assert result["launch_error"] is None, (
        f"{what}: the launch failed — {result['launch_error']}. An index past the end of an array "
        "usually means a missing guard")


def _no_races(result, what):
    races = result["races"]
    assert not races, (f"{what} has a race: {races[0]}. Add a cuda.syncthreads() between the write and the read "
                       "(or make the update atomic). It may give the right answer by luck; on a GPU it will not")


def _grid_stride_block_sums(x, blocks, threads):
    grid = blocks * threads
    per_thread = np.zeros(grid)
    padded = np.zeros(math.ceil(x.size / grid) * grid)
    padded[:x.size] = x
    per_thread += padded.reshape(-1, grid).sum(axis=0)
    return per_thread.reshape(blocks, threads).sum(axis=1)


# -- reduction ---------------------------------------------------------------------

def _check_block_sums(result, x, blocks):
    _launched(result, "block_sum_kernel")
    partial = result["partial"]
    assert np.isnan(partial[blocks:]).all(), "block_sum_kernel wrote past partial[gridDim.x - 1]: one value per block"
    expect_array(partial[:blocks], _grid_stride_block_sums(x, blocks, result["threads"]),
                 "block_sum_kernel partial", rtol=1e-4, atol=1e-4)


@pytest.mark.points(2)
def check_block_sum_grid_stride(submission, tier):
    """block_sum_kernel: each block's sum when the grid is smaller than the data"""
    if tier == "gpu":
        x, blocks = _rng(10).standard_normal(10_000_019).astype(np.float32), 1000
        result = submission.harness("block_sums", x, blocks)
    else:
        case = "reduce, grid smaller than data"
        (x, blocks), result = inputs(case), simulated(submission, case)
    _check_block_sums(result, x, blocks)


@pytest.mark.points(1)
def check_block_sum_one_per_thread(submission):
    """block_sum_kernel: one element per thread, the last block partly idle"""
    case = "reduce, one element per thread"
    (x, blocks), result = inputs(case), simulated(submission, case)
    _check_block_sums(result, x, blocks)


@pytest.mark.points(2)
def check_block_sum_no_races(submission):
    """block_sum_kernel: a barrier between every level of the tree (no races)"""
    result = simulated(submission, "reduce, grid smaller than data")
    _launched(result, "block_sum_kernel")
    assert result["shared_arrays"], "block_sum_kernel does not use shared memory: the block must combine its sums there"
    _no_races(result, "block_sum_kernel")


@pytest.mark.points(1)
def check_block_sum_bank_conflicts(submission):
    """block_sum_kernel: the tree's shared-memory accesses are free of bank conflicts"""
    result = simulated(submission, "reduce, grid smaller than data")
    _launched(result, "block_sum_kernel")
    banks = result["banks"]
    assert banks["worst"] <= 2, (
        f"block_sum_kernel: a warp's shared-memory access hits one bank with {banks['worst']} different words "
        f"(mean {banks['mean']:.2f}; 1 is conflict-free): threads of a warp should touch consecutive elements, "
        "e.g. thread t adds element t + half to element t, rather than strided ones")


@pytest.mark.points(2)
def check_block_reduce(submission, tier):
    """block_reduce: the sum of arrays of awkward lengths"""
    sizes = by_tier(tier, cpu=[1, 127, 1000], gpu=[1, 10_000_019])
    arrays = [_rng(20 + k).standard_normal(n).astype(np.float32) for k, n in enumerate(sizes)]
    got = submission.harness("host_reduce", arrays)
    for x, total in zip(arrays, got):
        want = float(x.sum(dtype=np.float64))
        assert total is not None and abs(total - want) <= 1e-4 * max(1.0, float(np.abs(x).sum())), (
            f"block_reduce of {x.size} elements: expected {want:.6g}, got {total!r}")


# -- scan ----------------------------------------------------------------------------

def _exclusive(x):
    return np.concatenate([[0], np.cumsum(x, dtype=np.int64)[:-1]]).astype(np.int32)


@pytest.mark.points(2)
def check_scan_block_kernel(submission):
    """scan_block_kernel: each segment's exclusive scan and its total"""
    case = "scan"
    (x,), result = inputs(case), simulated(submission, case)
    _launched(result, "scan_block_kernel")
    span = result["span"]
    blocks = math.ceil(x.size / span)
    segments = [x[b * span:(b + 1) * span] for b in range(blocks)]
    expect_array(result["out"][:x.size], np.concatenate([_exclusive(s) for s in segments]),
                 "scan_block_kernel out (exclusive: out[i] leaves x[i] out)", exact=True)
    expect_array(result["sums"][:blocks], [int(s.sum()) for s in segments], "scan_block_kernel block_sums", exact=True)
    untouched = (result["out"][x.size:] == INT_POISON).all() and (result["sums"][blocks:] == INT_POISON).all()
    assert untouched, "scan_block_kernel wrote past the end of out or block_sums (guard the last segment)"


@pytest.mark.points(1)
def check_scan_no_races(submission):
    """scan_block_kernel: a barrier before every level of both sweeps (no races)"""
    result = simulated(submission, "scan")
    _launched(result, "scan_block_kernel")
    _no_races(result, "scan_block_kernel")


@pytest.mark.points(2)
def check_exclusive_scan(submission, tier):
    """exclusive_scan: whole arrays over several segments"""
    sizes = by_tier(tier, cpu=[1, 255, 256, 257, 1000], gpu=[1, 257, 10_000_019])
    arrays = [_rng(30 + k).integers(-9, 10, n).astype(np.int32) for k, n in enumerate(sizes)]
    for x, got in zip(arrays, submission.harness("host_scan", arrays)):
        expect_array(got, _exclusive(x), f"exclusive_scan of {x.size} elements", exact=True)


# -- tiled matmul ------------------------------------------------------------------

@pytest.mark.points(3)
def check_tiled_matmul_kernel(submission, tier):
    """tiled_matmul_kernel: C = A @ B for shapes that are not multiples of the tile"""
    if tier == "gpu":
        A = _rng(40).standard_normal((1001, 517)).astype(np.float32)
        B = _rng(41).standard_normal((517, 763)).astype(np.float32)
        result = submission.harness("matmul_tiles", A, B)
    else:
        case = "matmul, ragged"
        (A, B), result = inputs(case), simulated(submission, case)
    _launched(result, "tiled_matmul_kernel")
    rows, cols = A.shape[0], B.shape[1]
    C = result["C"]
    canary = np.concatenate([C[rows:, :].ravel(), C[:rows, cols:].ravel()])
    assert np.isnan(canary).all(), "tiled_matmul_kernel wrote outside C: guard the write (row < rows and col < cols)"
    expect_array(C[:rows, :cols], A.astype(np.float64) @ B, "tiled_matmul_kernel C", rtol=1e-4, atol=1e-4)


@pytest.mark.points(2)
def check_tiled_matmul_reuses_tiles(submission):
    """tiled_matmul_kernel: reads each element of A and B once per tile, not once per product"""
    case = "matmul, ragged"
    (A, B), result = inputs(case), simulated(submission, case)
    _launched(result, "tiled_matmul_kernel")
    tile = result["tile"]
    (m, k), n = A.shape, B.shape[1]
    # A tiled kernel loads each element of A once per column of tiles of C (and B
    # once per row of tiles); one that reads global memory in its inner loop
    # loads it once per element of C in that row (column).
    for name, elements, tiles, naive in (("A", m * k, math.ceil(n / tile), n), ("B", k * n, math.ceil(m / tile), m)):
        per_element = result["loads"][name] / elements
        assert result["shared_arrays"] and per_element <= 1.5 * tiles, (
            f"tiled_matmul_kernel read each element of {name} {per_element:.1f} times from global memory "
            f"(a tiled kernel: {tiles}, one reading in its inner loop: {naive}). Load a tile into shared memory "
            "once, wait, and multiply from there")


@pytest.mark.points(1)
def check_tiled_matmul_no_races(submission):
    """tiled_matmul_kernel: barriers after loading a tile and after using it (no races)"""
    result = simulated(submission, "matmul, ragged")
    _launched(result, "tiled_matmul_kernel")
    _no_races(result, "tiled_matmul_kernel")


@pytest.mark.points(1)
def check_tiled_matmul_access_patterns(submission):
    """tiled_matmul_kernel: coalesced global loads, conflict-free shared accesses"""
    result = simulated(submission, "matmul, whole tiles")
    _launched(result, "tiled_matmul_kernel")
    for name in ("A", "B"):
        c = result["coalescing"][name]
        assert c["efficiency"] >= 0.8, (
            f"tiled_matmul_kernel's loads of {name} are not coalesced: warps touched {c['sectors']} 32-byte "
            f"sectors where {c['ideal_sectors']} would hold the data ({c['efficiency']:.0%}). Let threadIdx.x "
            "run along a row (the last index), so neighbouring threads load neighbouring addresses")
    banks = result["banks"]
    assert banks["worst"] <= 2, (
        f"tiled_matmul_kernel: a warp's shared-memory access hits one bank with {banks['worst']} different words "
        "(1 is conflict-free): store and read the tiles with threadIdx.x on the last index")


@pytest.mark.points(1)
def check_tiled_matmul(submission, tier):
    """tiled_matmul: the host function returns A @ B"""
    # rows and columns span different numbers of tiles (1 and 2): a grid with x and y swapped misses some of C.
    shape = by_tier(tier, cpu=(9, 20, 23), gpu=(2049, 1000, 3001))
    A = _rng(50).standard_normal(shape[:2]).astype(np.float32)
    B = _rng(51).standard_normal(shape[1:]).astype(np.float32)
    expect_array(submission.harness("host_matmul", A, B), A.astype(np.float64) @ B, "tiled_matmul(A, B)",
                 rtol=1e-4, atol=1e-4)


# -- histogram -------------------------------------------------------------------------

HISTOGRAM_CASES = ["histogram, 7 bins", "histogram, 200 bins"]


@pytest.mark.points(1)
@pytest.mark.parametrize("case", HISTOGRAM_CASES, ids=["7 bins", "200 bins"])
def check_histogram_kernel(submission, case):
    """histogram_kernel: counts equal np.bincount (colliding values, more bins than threads)"""
    (values, n_bins, _), result = inputs(case), simulated(submission, case)
    _launched(result, "histogram_kernel")
    counts = result["counts"]
    assert (counts[n_bins:] == INT_POISON).all(), "histogram_kernel wrote past counts[n_bins - 1]"
    expect_array(counts[:n_bins], np.bincount(values, minlength=n_bins), "histogram_kernel counts", exact=True)


@pytest.mark.points(2)
def check_histogram_no_races(submission):
    """histogram_kernel: every shared update atomic, bins zeroed and read across barriers"""
    for case in HISTOGRAM_CASES:
        result = simulated(submission, case)
        _launched(result, "histogram_kernel")
        _no_races(result, "histogram_kernel")


@pytest.mark.points(1)
def check_histogram_privatised(submission):
    """histogram_kernel: bins privatised in shared memory, one global update per bin per block"""
    case = "histogram, 7 bins"
    (values, n_bins, blocks), result = inputs(case), simulated(submission, case)
    _launched(result, "histogram_kernel")
    updates = result["atomics"]["counts"] + result["loads"]["counts"]
    assert result["shared_arrays"] and updates <= blocks * n_bins, (
        f"histogram_kernel updated counts {updates} times for {values.size} values in {blocks} blocks: "
        f"count into a shared copy of the bins first, then add each block's bins to counts "
        f"(at most {blocks * n_bins} global atomics)")


@pytest.mark.points(1)
def check_histogram(submission, tier):
    """histogram: the host function equals np.bincount"""
    n = by_tier(tier, cpu=2000, gpu=10_000_019)
    values = _rng(60).integers(0, 50, n).astype(np.int32)
    expect_array(submission.harness("host_histogram", values, 50), np.bincount(values, minlength=50),
                 "histogram(values, 50)", exact=True)


# -- GPU tier: speed as ratios of CuPy's kernels, in one run ----------------------------

def _ratio_check(metrics, m, ours, theirs, threshold, what, hint):
    ratio = m[ours] / m[theirs]
    metrics.update({k: (round(v, 3) if isinstance(v, float) else v) for k, v in m.items()},
                   ratio=round(ratio, 3), threshold=threshold)
    assert ratio >= threshold, (f"{what} reached {ratio:.2f} of CuPy's speed on {m['device']} "
                                f"(needs {threshold}): {hint}")


@pytest.mark.gpu
@pytest.mark.points(2)
def check_reduce_speed(submission, metrics):
    """block_sum_kernel: bandwidth as a fraction of cupy.sum's (2^27 floats)"""
    m = submission.harness("reduce_vs_cupy_sum", 1 << 27)
    assert m["rel_error"] < 1e-3, f"the two-pass reduction is wrong at 2^27 elements (relative error {m['rel_error']:.2g})"
    _ratio_check(metrics, m, "ours_gbs", "cupy_gbs", REDUCE_TO_CUPY_SUM, "the reduction",
                 "does each thread first add up many elements with coalesced, grid-stride loads?")


@pytest.mark.gpu
@pytest.mark.points(2)
def check_matmul_speed(submission, metrics):
    """tiled_matmul_kernel: FLOP/s as a fraction of cuBLAS FP32 (TF32 off) at 4096 x 4096"""
    m = submission.harness("matmul_vs_cublas", 4096)
    assert m["rel_error"] < 1e-3, f"tiled_matmul_kernel is wrong at 4096 x 4096 (relative error {m['rel_error']:.2g})"
    _ratio_check(metrics, m, "ours_tflops", "cublas_tflops", MATMUL_TO_CUBLAS, "the tiled matmul",
                 "are the tile loads coalesced and the shared reads free of bank conflicts?")


@pytest.mark.gpu
@pytest.mark.points(2)
def check_histogram_speed(submission, metrics):
    """histogram_kernel: values per second as a fraction of cupy.bincount's (2^27 values, 256 bins)"""
    m = submission.harness("histogram_vs_bincount", 1 << 27, 256)
    assert m["correct"], "histogram_kernel's counts differ from cupy.bincount at 2^27 values"
    _ratio_check(metrics, m, "ours_gvals", "cupy_gvals", HISTOGRAM_TO_BINCOUNT, "the histogram",
                 "are the bins privatised in shared memory, with one global atomic per bin per block?")
