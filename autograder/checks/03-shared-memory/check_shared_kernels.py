"""Checks for lab 03: shared memory, barriers and atomics.

Results are compared with NumPy on poisoned outputs with canaries, at sizes that
are not multiples of the block or the tile. Races, bank conflicts, coalescing
and global loads are judged from the record of every memory access the kernel
made in numba's simulator (``course.cuda_audit``) — never from whether a racy
kernel happened to give a wrong answer this time. The warp-level reduction is
judged from the same record's warp functions and barriers, and from its
compiled form (``shfl.sync`` in its PTX). Those checks run in the
simulator on both tiers; the GPU tier adds device sizes and speed as ratios of
CuPy's own kernels (CUB's sum, cuBLAS FP32, bincount) measured in the same run.

No property without the work: a kernel that does nothing has no races, no
bank conflicts and reads nothing twice, so every check of what a kernel never
does (and its compile check) is credited only when the same launch also gave
the right answer (``with_the_work``). A host function is run in the simulator
with a record of its launches: it must launch the lab's kernels as its
docstring says and return what they wrote, not an answer of its own.
"""
import math

import numpy as np
import pytest

from autograder.grading import timed
from autograder.grading import seeds
from autograder.grading.checking import (INT_POISON, compiled_kernels, expect_array, expect_compiled, load_beside,
                                         require_compiles, with_the_work)

oracles = load_beside(__file__, "oracles")

SEED = 2026
CANARY = 64

# GPU-tier pass marks, as fractions of CuPy's time for the same work. Chosen from
# what a textbook kernel reaches, not yet validated on a GPU run; see
# docs/gpu-tier.md for recorded numbers.
REDUCE_TO_CUPY_SUM = 0.5  # two-pass grid-stride block reduction vs CUB's device reduce
MATMUL_TO_CUBLAS = 0.05  # 16x16 shared-memory tiles vs cuBLAS SGEMM (a 2-D register-tiled kernel gets ~0.5)
HISTOGRAM_TO_BINCOUNT = 0.5  # shared-memory privatised bins vs cupy.bincount


def _rng(k=0):
    return seeds.rng(_GRADING_SEED[0], "03", SEED + k)


# The graded inputs are drawn from the grading's secret seed (autograder.grading.seeds): each check
# sets it here before it draws, and every input of one grading comes from the same seed.
_GRADING_SEED = [0]


@pytest.fixture(autouse=True)
def _draw_from_the_grading_seed(seed):
    _GRADING_SEED[0] = seed


# Inputs at simulator sizes: not multiples of the block, the segment or the tile.
CASES = {
    "reduce, grid smaller than data": lambda: ("block_sums", _rng(1).standard_normal(1000).astype(np.float32), 3),
    "reduce, one element per thread": lambda: ("block_sums", _rng(2).standard_normal(1000).astype(np.float32), 8),
    # The same two cases for the warp-level reduction (its own draws).
    "warp reduce, grid smaller than data": lambda: ("warp_block_sums",
                                                    _rng(12).standard_normal(1000).astype(np.float32), 3),
    "warp reduce, one element per thread": lambda: ("warp_block_sums",
                                                    _rng(13).standard_normal(1000).astype(np.float32), 8),
    "scan": lambda: ("scan_segments", _rng(3).integers(-9, 10, 1000).astype(np.int32)),
    # Three segments, the last partial; more offsets than segments, whatever SCAN_SPAN is.
    "add offsets": lambda: ("add_offsets", _rng(10).integers(-9, 10, 517).astype(np.int32),
                            _rng(11).integers(-99, 100, 16).astype(np.int32)),
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
              "block_sum_warp_kernel": "void(float32[:], float32[:])",
              "scan_block_kernel": "void(int32[:], int32[:], int32[:])",
              "add_offsets_kernel": "void(int32[:], int32[:])",
              "tiled_matmul_kernel": "void(float32[:, :], float32[:, :], float32[:, :])",
              "histogram_kernel": "void(int32[:], int32[:])"}
KERNEL_OF = {"reduce": "block_sum_kernel", "warp reduce": "block_sum_warp_kernel", "scan": "scan_block_kernel",
             "add offsets": "add_offsets_kernel",
             "matmul": "tiled_matmul_kernel", "histogram": "histogram_kernel"}
# The launch whose answer credits a kernel's compile check.
WORKS_IN = {"block_sum_kernel": "reduce, grid smaller than data",
            "block_sum_warp_kernel": "warp reduce, grid smaller than data", "scan_block_kernel": "scan",
            "add_offsets_kernel": "add offsets", "tiled_matmul_kernel": "matmul, ragged",
            "histogram_kernel": "histogram, 7 bins"}


# What each kernel compiled for a GPU must show it does (course.gpu_compile.ptx_work): the kernel graded
# in the simulator is the kernel a GPU runs. Every one writes its output (the histogram by atomic updates);
# the cooperative ones use shared memory and barriers, and the warp-level reduction warp shuffles.
SHOWS = {"block_sum_kernel": ("global_stores", "shared_accesses", "barriers"),
         "block_sum_warp_kernel": ("global_stores", "shared_accesses", "barriers", "warp_shuffles"),
         "scan_block_kernel": ("global_stores", "shared_accesses", "barriers"),
         "add_offsets_kernel": ("global_stores",),
         "tiled_matmul_kernel": ("global_stores", "shared_accesses", "barriers"),
         "histogram_kernel": ("shared_accesses", "barriers", "atomics")}


@pytest.mark.points(1)
@pytest.mark.parametrize("kernel", SIGNATURES)
def check_compiles_for_a_gpu(submission, kernel, metrics):
    """compiles with numba's CUDA compiler for every GPU the course supports, sm_75 to sm_120 (registers, shared memory and spills from ptxas), credited once it computes its result"""
    expect_compiled(compiled_kernels(submission, "shared_kernels", SIGNATURES, kernel), kernel, metrics,
                    shows=SHOWS[kernel])
    _credited(submission, WORKS_IN[kernel], f"compiling {kernel}")


def simulated(submission, case):
    """Run one of CASES in the simulator with the audit on (whatever the tier), once per grading run.
    A kernel no GPU would compile loses the points of every check that launches it."""
    kernel = KERNEL_OF[case.split(",")[0]]
    require_compiles(submission, "shared_kernels", SIGNATURES, kernel, shows=SHOWS[kernel])
    sim = submission if submission.tier == "cpu" else submission.in_simulator()
    return sim.harness_once(case, *CASES[case]())


def inputs(case):
    return CASES[case]()[1:]


def _launched(result, what):
    error = result["launch_error"]
    hint = ". An index past the end of an array usually means a missing guard" if "IndexError" in (error or "") else ""
    assert error is None, f"{what}: the launch failed — {error}{hint}"


def _no_races(result, what):
    races = result["races"]
    assert not races, (f"{what} has a race: {races[0]}. Add a cuda.syncthreads() between the write and the read "
                       "(or make the update atomic). It may give the right answer by luck; on a GPU it will not")


def _credited(submission, case, claim):
    """``claim`` counts only if the launch of ``case`` also gave the right answer."""
    with_the_work(claim, lambda: RIGHT_ANSWER[KERNEL_OF[case.split(",")[0]]](simulated(submission, case),
                                                                               *inputs(case)))


def _expect_launches(run, kernel, what, grid=None, block=None):
    """``kernel``'s launches in a host function's record, each with ``block`` (and
    ``grid``) when given, as (x, y, z); at least one."""
    ours = oracles.launches_of(run, kernel)
    everything = [(name, tuple(g), tuple(b)) for name, g, b in run["launches"]]
    assert ours, (f"{what} launched no {kernel} (its launches: {everything or 'none'}): the host function "
                  "computes its answer with the kernels, on the device")
    for _, got_grid, got_block in ours:
        for want, got, which in ((grid, got_grid, "blocks"), (block, got_block, "threads per block")):
            assert want is None or got == want, (
                f"{what} launched {kernel} with {got} {which} (x, y, z); the lab's contract is {want}")
    return ours


def _expect_returns_what_it_wrote(run, value, launches, kernel, what):
    assert oracles.holds(run, value, [i for i, _, _ in launches]), (
        f"{what} returned the right answer, but not what {kernel} wrote: no array its launches wrote holds it "
        "(as the last launch left it). Return the kernels' result, copied back from the device, not an answer "
        "computed beside them")


# -- reduction ---------------------------------------------------------------------

def _expect_block_sums(result, x, blocks, kernel="block_sum_kernel"):
    _launched(result, kernel)
    partial = result["partial"]
    assert np.isnan(partial[blocks:]).all(), f"{kernel} wrote past partial[gridDim.x - 1]: one value per block"
    undefined = result.get("undefined_reads")
    try:
        expect_array(partial[:blocks], oracles.grid_stride_block_sums(x, blocks, result["threads"]),
                     f"{kernel} partial", rtol=1e-4, atol=1e-4)
    except AssertionError as exc:
        if not undefined:
            raise
        # A shuffle read a lane that took no part (here NaN): say which, the likely cause.
        raise AssertionError(f"{exc}. In the simulator's record, {undefined[0]}: every lane a shuffle reads "
                             "must make the same call (is the shuffle in a branch only some lanes of its mask "
                             "take?)") from None


@pytest.mark.points(2)
def check_block_sum_grid_stride(submission, tier):
    """block_sum_kernel: each block's sum when the grid is smaller than the data"""
    if tier == "gpu":
        x, blocks = _rng(10).standard_normal(10_000_019).astype(np.float32), 1000
        result = submission.harness("block_sums", x, blocks)
    else:
        case = "reduce, grid smaller than data"
        (x, blocks), result = inputs(case), simulated(submission, case)
    _expect_block_sums(result, x, blocks)


@pytest.mark.points(1)
def check_block_sum_one_per_thread(submission):
    """block_sum_kernel: one element per thread, the last block partly idle"""
    case = "reduce, one element per thread"
    (x, blocks), result = inputs(case), simulated(submission, case)
    _expect_block_sums(result, x, blocks)


@pytest.mark.points(2)
def check_block_sum_no_races(submission):
    """block_sum_kernel: a barrier between every level of the tree (no races)"""
    result = simulated(submission, "reduce, grid smaller than data")
    _launched(result, "block_sum_kernel")
    assert result["shared_arrays"], "block_sum_kernel does not use shared memory: the block must combine its sums there"
    _no_races(result, "block_sum_kernel")
    _credited(submission, "reduce, grid smaller than data", "a tree without races")


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
    _credited(submission, "reduce, grid smaller than data", "a tree free of bank conflicts")


def _expect_sum(total, x, what):
    want = float(x.sum(dtype=np.float64))
    assert total is not None and abs(total - want) <= 1e-4 * max(1.0, float(np.abs(x).sum())), (
        f"{what}: expected {want:.6g}, got {total!r}")


@pytest.mark.points(2)
def check_block_reduce(submission, tier):
    """block_reduce: the sum of arrays of awkward lengths, as block_sum_kernel's last launch (one block) wrote it"""
    arrays = [_rng(20 + k).standard_normal(n).astype(np.float32) for k, n in enumerate([1, 127, 1000])]
    runs = submission.in_simulator().harness("recorded", "block_reduce", [(x,) for x in arrays])
    for x, run in zip(arrays, runs):
        what = f"block_reduce of {x.size} elements"
        _expect_sum(run["value"], x, what)
        threads = run["threads"]
        ours = _expect_launches(run, "block_sum_kernel", what, block=(threads, 1, 1))
        blocks = min(max(1, math.ceil(x.size / threads)), 1024)
        assert ours[0][1] == (blocks, 1, 1) and ours[-1][1] == (1, 1, 1), (
            f"{what} launched block_sum_kernel on {[grid[0] for _, grid, _ in ours]} blocks; expected {blocks} "
            "(the default: one per THREADS elements, at most 1024), then 1 to add up the partial sums")
        _expect_returns_what_it_wrote(run, run["value"], ours[-1:], "the last launch of block_sum_kernel", what)
    if tier == "gpu":
        arrays = [_rng(20 + k).standard_normal(n).astype(np.float32) for k, n in enumerate([1, 10_000_019])]
        for x, total in zip(arrays, submission.harness("host_reduce", arrays)):
            _expect_sum(total, x, f"block_reduce of {x.size} elements on the GPU")


# -- the warp-level stage ----------------------------------------------------------------

def _expect_warp_block_sums(result, x, blocks):
    _expect_block_sums(result, x, blocks, "block_sum_warp_kernel")


@pytest.mark.points(2)
def check_block_sum_warp(submission, tier):
    """block_sum_warp_kernel: each block's sum, grid smaller than the data and one element per thread"""
    for case in ("warp reduce, grid smaller than data", "warp reduce, one element per thread"):
        (x, blocks), result = inputs(case), simulated(submission, case)
        _expect_warp_block_sums(result, x, blocks)
    if tier == "gpu":
        x, blocks = _rng(14).standard_normal(10_000_019).astype(np.float32), 1000
        _expect_warp_block_sums(submission.harness("warp_block_sums", x, blocks), x, blocks)


@pytest.mark.points(2)
def check_block_sum_warp_stage(submission):
    """block_sum_warp_kernel: the tree's last five levels are warp shuffles, with no barrier (no races)"""
    case = "warp reduce, grid smaller than data"
    result = simulated(submission, case)
    _launched(result, "block_sum_warp_kernel")
    threads, warp = result["threads"], result["warp"]
    levels = int(math.log2(warp))
    assert result["shuffles_per_block"] >= levels, (
        f"block_sum_warp_kernel: a block made {result['shuffles_per_block']} warp shuffles (warp functions it "
        f"called: {result['warp_functions'] or 'none'}); the last {levels} levels of the tree, {warp} values "
        "down to 1, are warp shuffles (cuda.shfl_down_sync), one per level")
    most = int(math.log2(threads // warp)) + 1
    assert result["barriers"] <= most, (
        f"block_sum_warp_kernel: a block passed {result['barriers']} barriers; with {threads} threads, "
        f"{most} are enough (after the grid-stride sums, and after each level while more than {warp} values "
        "remain): the warp's own levels need none")
    assert result["shared_arrays"], "block_sum_warp_kernel does not use shared memory: the tree's first levels are there"
    _no_races(result, "block_sum_warp_kernel")
    _credited(submission, case, "a warp-level stage")


# -- scan ----------------------------------------------------------------------------

def _expect_scan(result, x):
    _launched(result, "scan_block_kernel")
    span = result["span"]
    blocks = math.ceil(x.size / span)
    segments = [x[b * span:(b + 1) * span] for b in range(blocks)]
    expect_array(result["out"][:x.size], np.concatenate([oracles.exclusive(s) for s in segments]),
                 "scan_block_kernel out (exclusive: out[i] leaves x[i] out)", exact=True)
    expect_array(result["sums"][:blocks], [int(s.sum()) for s in segments], "scan_block_kernel block_sums", exact=True)
    untouched = (result["out"][x.size:] == INT_POISON).all() and (result["sums"][blocks:] == INT_POISON).all()
    assert untouched, "scan_block_kernel wrote past the end of out or block_sums (guard the last segment)"


def _expect_offsets_added(result, out, offsets):
    _launched(result, "add_offsets_kernel")
    assert (result["out"][out.size:] == INT_POISON).all(), "add_offsets_kernel wrote past the end of out (guard i)"
    expect_array(result["out"][:out.size], oracles.with_offsets(out, offsets, result["span"]),
                 "add_offsets_kernel out (each element plus its segment's offset)", exact=True)


@pytest.mark.points(2)
def check_scan_block_kernel(submission):
    """scan_block_kernel: each segment's exclusive scan and its total"""
    case = "scan"
    _expect_scan(simulated(submission, case), *inputs(case))


@pytest.mark.points(1)
def check_scan_no_races(submission):
    """scan_block_kernel: a barrier before every level of both sweeps (no races)"""
    result = simulated(submission, "scan")
    _launched(result, "scan_block_kernel")
    _no_races(result, "scan_block_kernel")
    _credited(submission, "scan", "a scan without races")


@pytest.mark.points(2)
def check_exclusive_scan(submission, tier):
    """exclusive_scan: whole arrays over several segments, as scan_block_kernel and add_offsets_kernel wrote them"""
    arrays = [_rng(30 + k).integers(-9, 10, n).astype(np.int32) for k, n in enumerate([1, 255, 256, 257, 1000])]
    runs = submission.in_simulator().harness("recorded", "exclusive_scan", [(x,) for x in arrays])
    for x, run in zip(arrays, runs):
        what = f"exclusive_scan of {x.size} elements"
        expect_array(run["value"], oracles.exclusive(x), what, exact=True)
        segments = math.ceil(x.size / run["span"])
        # The first scan is of x itself (the later ones, of the segments' sums).
        first = _expect_launches(run, "scan_block_kernel", what, block=(run["threads"], 1, 1))[:1]
        assert first[0][1] == (segments, 1, 1), (
            f"{what} first launched scan_block_kernel on {first[0][1][0]} blocks; expected {segments}, "
            "one per SCAN_SPAN-element segment")
        if segments > 1:
            _expect_launches(run, "add_offsets_kernel", f"{what} ({segments} segments)")
        _expect_returns_what_it_wrote(run, run["value"], first, "scan_block_kernel (then add_offsets_kernel)", what)
    if tier == "gpu":
        arrays = [_rng(30 + k).integers(-9, 10, n).astype(np.int32) for k, n in enumerate([1, 257, 10_000_019])]
        for x, got in zip(arrays, submission.harness("host_scan", arrays)):
            expect_array(got, oracles.exclusive(x), f"exclusive_scan of {x.size} elements on the GPU", exact=True)


# -- tiled matmul ------------------------------------------------------------------

def _expect_matmul(result, A, B):
    _launched(result, "tiled_matmul_kernel")
    rows, cols = A.shape[0], B.shape[1]
    C = result["C"]
    canary = np.concatenate([C[rows:, :].ravel(), C[:rows, cols:].ravel()])
    assert np.isnan(canary).all(), "tiled_matmul_kernel wrote outside C: guard the write (row < rows and col < cols)"
    expect_array(C[:rows, :cols], A.astype(np.float64) @ B, "tiled_matmul_kernel C", rtol=1e-4, atol=1e-4)


@pytest.mark.points(3)
def check_tiled_matmul_kernel(submission, tier):
    """tiled_matmul_kernel: C = A @ B for shapes that are not multiples of the tile"""
    if tier == "gpu":
        A = _rng(40).standard_normal((1001, 517)).astype(np.float32)
        B = _rng(41).standard_normal((517, 763)).astype(np.float32)
        _expect_matmul(submission.harness("matmul_tiles", A, B), A, B)
    else:
        case = "matmul, ragged"
        _expect_matmul(simulated(submission, case), *inputs(case))


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
    _credited(submission, case, "reading each element once per tile")


@pytest.mark.points(1)
def check_tiled_matmul_no_races(submission):
    """tiled_matmul_kernel: barriers after loading a tile and after using it (no races)"""
    result = simulated(submission, "matmul, ragged")
    _launched(result, "tiled_matmul_kernel")
    _no_races(result, "tiled_matmul_kernel")
    _credited(submission, "matmul, ragged", "tiles without races")


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
    _credited(submission, "matmul, whole tiles", "coalesced, conflict-free accesses")


def _matrices(shape, seed):
    return (_rng(seed).standard_normal(shape[:2]).astype(np.float32),
            _rng(seed + 1).standard_normal(shape[1:]).astype(np.float32))


@pytest.mark.points(1)
def check_tiled_matmul(submission, tier):
    """tiled_matmul: the host function returns A @ B as tiled_matmul_kernel wrote it, one block per tile of C"""
    # rows and columns span different numbers of tiles (1 and 2): a grid with x and y swapped misses some of C.
    A, B = _matrices((9, 20, 23), 50)
    (run,) = submission.in_simulator().harness("recorded", "tiled_matmul", [(A, B)])
    what = "tiled_matmul(A, B)"
    expect_array(run["value"], A.astype(np.float64) @ B, what, rtol=1e-4, atol=1e-4)
    tile = run["tile"]
    ours = _expect_launches(run, "tiled_matmul_kernel", what, grid=(math.ceil(23 / tile), math.ceil(9 / tile), 1),
                            block=(tile, tile, 1))
    _expect_returns_what_it_wrote(run, run["value"], ours, "tiled_matmul_kernel", what)
    if tier == "gpu":
        A, B = _matrices((2049, 1000, 3001), 50)
        expect_array(submission.harness("host_matmul", A, B), A.astype(np.float64) @ B, f"{what} on the GPU",
                     rtol=1e-4, atol=1e-4)


# -- histogram -------------------------------------------------------------------------

HISTOGRAM_CASES = ["histogram, 7 bins", "histogram, 200 bins"]


def _expect_histogram(result, values, n_bins, _blocks):
    _launched(result, "histogram_kernel")
    counts = result["counts"]
    assert (counts[n_bins:] == INT_POISON).all(), "histogram_kernel wrote past counts[n_bins - 1]"
    expect_array(counts[:n_bins], np.bincount(values, minlength=n_bins), "histogram_kernel counts", exact=True)


@pytest.mark.points(1)
@pytest.mark.parametrize("case", HISTOGRAM_CASES, ids=["7 bins", "200 bins"])
def check_histogram_kernel(submission, case):
    """histogram_kernel: counts equal np.bincount (colliding values, more bins than threads)"""
    _expect_histogram(simulated(submission, case), *inputs(case))


@pytest.mark.points(2)
def check_histogram_no_races(submission):
    """histogram_kernel: every shared update atomic, bins zeroed and read across barriers"""
    for case in HISTOGRAM_CASES:
        result = simulated(submission, case)
        _launched(result, "histogram_kernel")
        _no_races(result, "histogram_kernel")
    for case in HISTOGRAM_CASES:
        _credited(submission, case, "atomic updates across barriers")


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
    _credited(submission, case, "privatised bins")


@pytest.mark.points(1)
def check_histogram(submission, tier):
    """histogram: the host function returns np.bincount as histogram_kernel counted it"""
    values = _rng(60).integers(0, 50, 2000).astype(np.int32)
    (run,) = submission.in_simulator().harness("recorded", "histogram", [(values, 50)])
    what = "histogram(values, 50)"
    expect_array(run["value"], np.bincount(values, minlength=50), what, exact=True)
    threads = run["threads"]
    blocks = min(max(1, math.ceil(values.size / threads)), 256)
    ours = _expect_launches(run, "histogram_kernel", what, grid=(blocks, 1, 1), block=(threads, 1, 1))
    _expect_returns_what_it_wrote(run, run["value"], ours, "histogram_kernel", what)
    if tier == "gpu":
        values = _rng(60).integers(0, 50, 10_000_019).astype(np.int32)
        expect_array(submission.harness("host_histogram", values, 50), np.bincount(values, minlength=50),
                     f"{what} on the GPU", exact=True)


# The answer each kernel's launch must give, for with_the_work: (result, *inputs of its case).
RIGHT_ANSWER = {"block_sum_kernel": _expect_block_sums, "block_sum_warp_kernel": _expect_warp_block_sums,
                "scan_block_kernel": _expect_scan,
                "add_offsets_kernel": _expect_offsets_added, "tiled_matmul_kernel": _expect_matmul,
                "histogram_kernel": _expect_histogram}


# -- GPU tier: speed as ratios of CuPy's kernels, in one run ----------------------------
#
# Timed by course.gpu_timing in the sandbox and judged here (autograder.grading.timed):
# every timed run's output is rechecked against an oracle computed from its seed (the
# rechecks are in oracles.py), and a
# run faster than the card's peak allows is refused. With --dry-run-gpu on the CPU tier
# they run at tiny sizes on stand-ins and award nothing.

def _ratio_check(metrics, ours, theirs, names, work, unit, threshold, what, hint, dry_run, record):
    """Ours against CuPy's on the same work: the ratio of their rates, with what was measured."""
    ours_rate, theirs_rate = work / ours.median_s, work / theirs.median_s
    ratio = ours_rate / theirs_rate
    metrics.update({f"{names[0]}_{unit}": round(ours_rate, 3), f"{names[1]}_{unit}": round(theirs_rate, 3),
                    "ratio": round(ratio, 3), "threshold": threshold},
                   **timed.metrics(record, **{names[0]: ours, names[1]: theirs}))
    timed.expect(ratio >= threshold, dry_run,
                 f"{what} reached {ratio:.2f} of CuPy's speed on {record['name']} (needs {threshold}): {hint} "
                 f"Measured: {ours.describe()}; {theirs.describe()}")


@pytest.mark.gpu
@pytest.mark.points(2)
def check_reduce_speed(submission, metrics, gpu_dry_run, seed):
    """block_sum_kernel: bandwidth as a fraction of cupy.sum's (2^27 floats)"""
    n, runs = (512, 2) if gpu_dry_run else (1 << 27, 10)
    base_seed, *seeds = timed.draw_seeds(runs + 1, seed, "reduce_speed")
    m = submission.harness("reduce_vs_cupy_sum", n, base_seed, seeds)
    recheck = oracles.sum_recheck(n, base_seed)
    ours = timed.judge(m["ours"], "block_sum_kernel (two passes)", recheck, moved_bytes=4 * n, dry_run=gpu_dry_run)
    cupy = timed.judge(m["cupy"], "cupy.sum", recheck, moved_bytes=4 * n, dry_run=gpu_dry_run)
    _ratio_check(metrics, ours, cupy, ("ours", "cupy"), 4 * n / 1e9, "gbs", REDUCE_TO_CUPY_SUM, "the reduction",
                 "does each thread first add up many elements with coalesced, grid-stride loads?", gpu_dry_run,
                 m["ours"]["record"])


@pytest.mark.gpu
@pytest.mark.points(2)
def check_matmul_speed(submission, metrics, gpu_dry_run, seed):
    """tiled_matmul_kernel: FLOP/s as a fraction of cuBLAS FP32 (TF32 off) at 4096 x 4096"""
    n, runs = (16, 2) if gpu_dry_run else (4096, 5)
    m = submission.harness("matmul_vs_cublas", n, timed.draw_seeds(runs, seed, "matmul_speed"))
    recheck = oracles.matmul_recheck(n)
    work = {"flops": 2 * n**3, "moved_bytes": 3 * 4 * n * n}
    ours = timed.judge(m["ours"], "tiled_matmul_kernel", recheck, dry_run=gpu_dry_run, **work)
    cublas = timed.judge(m["cublas"], "cuBLAS SGEMM (A @ B)", recheck, dry_run=gpu_dry_run, **work)
    _ratio_check(metrics, ours, cublas, ("ours", "cublas"), 2 * n**3 / 1e12, "tflops", MATMUL_TO_CUBLAS,
                 "the tiled matmul", "are the tile loads coalesced and the shared reads free of bank conflicts?",
                 gpu_dry_run, m["ours"]["record"])


@pytest.mark.gpu
@pytest.mark.points(2)
def check_histogram_speed(submission, metrics, gpu_dry_run, seed):
    """histogram_kernel: values per second as a fraction of cupy.bincount's (2^27 values, 256 bins)"""
    (n, runs), n_bins = ((1024, 2) if gpu_dry_run else (1 << 27, 10)), 256
    base_seed, *seeds = timed.draw_seeds(runs + 1, seed, "histogram_speed")
    m = submission.harness("histogram_vs_bincount", n, n_bins, base_seed, seeds)
    recheck = oracles.histogram_recheck(n, n_bins, base_seed)
    ours = timed.judge(m["ours"], "histogram_kernel", recheck, moved_bytes=4 * n, dry_run=gpu_dry_run)
    cupy = timed.judge(m["cupy"], "cupy.bincount", recheck, moved_bytes=4 * n, dry_run=gpu_dry_run)
    _ratio_check(metrics, ours, cupy, ("ours", "cupy"), n / 1e9, "gvals", HISTOGRAM_TO_BINCOUNT, "the histogram",
                 "are the bins privatised in shared memory, with one global atomic per bin per block?", gpu_dry_run,
                 m["ours"]["record"])
