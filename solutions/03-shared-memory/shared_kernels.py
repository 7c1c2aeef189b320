"""Lab 03 — shared memory, synchronization and atomics (numba.cuda).

In lab 02 every thread worked alone. Here the threads of a block cooperate
through *shared memory*: a small scratchpad, private to the block, that is about
as fast as registers. Cooperation needs two tools:

* ``cuda.syncthreads()`` — a barrier: no thread of the block goes past it until
  every thread has reached it, so what was written before it can be read after.
* ``cuda.atomic.add`` — a read-modify-write that no other thread can interleave.

The 32 threads of a *warp* can also exchange values without shared memory:
``cuda.shfl_down_sync(mask, value, delta)`` hands each lane the ``value`` of the
lane ``delta`` above it, for the lanes ``mask`` names, all of which must make the
call (``block_sum_warp_kernel``).

Forget either and the kernel has a *race*: its answer depends on the order
threads happen to run in. Races often give the right answer anyway, so the
grader does not trust the answer alone: it records every memory access your
kernel makes (``course.cuda_audit``) and looks for two threads that touch one
element with no barrier between them.

Sizes are fixed at compile time, as shared arrays need: ``THREADS`` threads per
block for the 1-D kernels, ``TILE`` x ``TILE`` threads per block for the matmul.
Run the checks with ``k2c grade 03`` (from the repository root).
"""
import numpy as np
from numba import cuda, float32, int32

THREADS = 128  # threads per block of the reductions, scan_block_kernel and histogram_kernel
WARP = 32  # lanes of a warp (cuda.warpsize)
FULL_MASK = 0xFFFFFFFF  # a warp function's mask naming all 32 lanes
SCAN_SPAN = 2 * THREADS  # elements one block of scan_block_kernel scans (two per thread)
TILE = 16  # tiled_matmul_kernel: a TILE x TILE block of threads computes a TILE x TILE tile of C
MAX_BINS = 256  # histogram_kernel: shared-memory bins per block


# -- 1. Reduction ---------------------------------------------------------------

@cuda.jit
def block_sum_kernel(partial, x):
    """``partial[b]`` = the sum of the elements block ``b`` is responsible for.

    The grid may be smaller than the data. Thread ``g`` of the grid (global
    index ``g``, grid size ``G = gridDim.x * blockDim.x``) first adds up
    ``x[g], x[g + G], x[g + 2G], ...`` on its own (a *grid-stride loop*); then
    the block adds up its threads' sums in shared memory, as a tree: half the
    threads add in the other half's values, then a quarter, ... with a barrier
    between levels. Thread 0 writes the block's result.
    """
    # BEGIN SOLUTION: Each thread first sums its strided share alone; the block then combines those sums as a tree in shared memory, a barrier per level.
    cache = cuda.shared.array(THREADS, dtype=float32)
    tid = cuda.threadIdx.x
    total = float32(0.0)
    g = cuda.grid(1)
    stride = cuda.gridsize(1)
    while g < x.size:
        total += x[g]
        g += stride
    cache[tid] = total
    cuda.syncthreads()
    half = THREADS // 2
    while half > 0:
        if tid < half:
            cache[tid] += cache[tid + half]  # sequential addressing: no bank conflicts
        cuda.syncthreads()
        half //= 2
    if tid == 0:
        partial[cuda.blockIdx.x] = cache[0]
    # END SOLUTION


def block_reduce(x, blocks=None):
    """Host side: the sum of ``x`` (float32) in two launches of ``block_sum_kernel``:
    ``blocks`` blocks make one partial sum each, then a single block adds those up.
    ``blocks`` defaults to one block per ``THREADS`` elements, capped at 1024.
    Return the number that last launch wrote (the grader records the launches)."""
    # BEGIN SOLUTION: Two launches of the kernel: the first leaves one partial per block, the second lets a single block combine them.
    d_x = cuda.to_device(np.ascontiguousarray(x, dtype=np.float32))
    if blocks is None:
        blocks = min(max(1, -(-x.size // THREADS)), 1024)
    d_partial = cuda.device_array(blocks, dtype=np.float32)
    block_sum_kernel[blocks, THREADS](d_partial, d_x)
    d_total = cuda.device_array(1, dtype=np.float32)
    block_sum_kernel[1, THREADS](d_total, d_partial)
    return float(d_total.copy_to_host()[0])
    # END SOLUTION


@cuda.jit
def block_sum_warp_kernel(partial, x):
    """``partial[b]``: the same sums as ``block_sum_kernel``, its last levels in one warp.

    A tree's last five levels, 32 values down to 1, need no shared memory and no
    barrier: a warp's lanes can read each other's registers. Sum with the grid-stride
    loop and the shared-memory tree (a barrier per level) only while more than
    ``WARP`` values remain; then warp 0 takes the last ``WARP`` values, one per lane,
    and adds them with warp shuffles, ``cuda.shfl_down_sync(FULL_MASK, value, delta)``
    for ``delta`` = 16, 8, 4, 2, 1; lane 0 writes the block's sum. Every lane a
    shuffle's mask names must make that call. ``THREADS`` is a power of two, at
    least ``WARP``.
    """
    # BEGIN SOLUTION: Grid-stride sums, the shared tree while over WARP values remain, then warp 0 shuffles them down: no barrier.
    cache = cuda.shared.array(THREADS, dtype=float32)
    tid = cuda.threadIdx.x
    total = float32(0.0)
    g = cuda.grid(1)
    while g < x.size:
        total += x[g]
        g += cuda.gridsize(1)
    cache[tid] = total
    cuda.syncthreads()
    half = THREADS // 2
    while half >= WARP:  # levels with more than a warp's worth of values: shared memory and barriers
        if tid < half:
            cache[tid] += cache[tid + half]
        cuda.syncthreads()
        half //= 2
    if tid < WARP:  # warp 0, all 32 lanes: each takes one of the last WARP values
        total = cache[tid]
        delta = WARP // 2
        while delta > 0:
            total += cuda.shfl_down_sync(FULL_MASK, total, delta)
            delta //= 2
        if tid == 0:
            partial[cuda.blockIdx.x] = total
    # END SOLUTION


# -- 2. Scan ----------------------------------------------------------------------

@cuda.jit
def scan_block_kernel(out, block_sums, x):
    """Exclusive prefix sum of each ``SCAN_SPAN``-element segment of ``x`` (int32).

    Block ``b`` scans ``x[b * SCAN_SPAN : (b + 1) * SCAN_SPAN]`` (elements past
    the end count as 0): ``out[i]`` = the sum of the segment's elements *before*
    ``i``, and ``block_sums[b]`` = the whole segment's sum. Use Blelloch's
    work-efficient scan in shared memory: an up-sweep that builds partial sums in
    a tree, then a down-sweep that pushes prefixes back down it.
    """
    # BEGIN SOLUTION: Stage two elements per thread, sweep up, save and clear the root, sweep down; every level reads the last one's writes, so wait first.
    temp = cuda.shared.array(SCAN_SPAN, dtype=int32)
    tid = cuda.threadIdx.x
    base = cuda.blockIdx.x * SCAN_SPAN
    for half in range(2):  # a range, not a tuple: a GPU kernel cannot loop over (int32, int64)
        i = tid + half * THREADS
        temp[i] = x[base + i] if base + i < x.size else 0
    offset = 1
    active = THREADS
    while active > 0:  # up-sweep: temp[j] becomes the sum of a subtree ending at j
        cuda.syncthreads()
        if tid < active:
            left = offset * (2 * tid + 1) - 1
            right = offset * (2 * tid + 2) - 1
            temp[right] += temp[left]
        offset *= 2
        active //= 2
    if tid == 0:
        block_sums[cuda.blockIdx.x] = temp[SCAN_SPAN - 1]
        temp[SCAN_SPAN - 1] = 0
    active = 1
    while active < SCAN_SPAN:  # down-sweep: each node passes its prefix to its children
        offset //= 2
        cuda.syncthreads()
        if tid < active:
            left = offset * (2 * tid + 1) - 1
            right = offset * (2 * tid + 2) - 1
            carried = temp[left]
            temp[left] = temp[right]
            temp[right] += carried
        active *= 2
    cuda.syncthreads()
    for half in range(2):
        i = tid + half * THREADS
        if base + i < out.size:
            out[base + i] = temp[i]
    # END SOLUTION


@cuda.jit
def add_offsets_kernel(out, offsets):
    """Add to every element of ``out`` the offset of its segment: element ``i``
    lies in segment ``b`` when ``b * SCAN_SPAN <= i < (b + 1) * SCAN_SPAN``, and
    ``offsets[b]`` is the sum of all the segments before it. The grader launches
    it with one thread per element, the grid possibly longer than ``out``."""
    # BEGIN SOLUTION: One thread per element: find which segment the element belongs to and add that segment's offset.
    i = cuda.grid(1)
    if i < out.size:
        out[i] += offsets[i // SCAN_SPAN]
    # END SOLUTION


def exclusive_scan(x):
    """Host side: the exclusive prefix sum of ``x`` (int32) of any length.

    Scan every segment (``scan_block_kernel``, one block of ``THREADS`` threads
    per segment), scan the segments' sums (the same problem, ``SCAN_SPAN`` times
    smaller: recurse), then add each segment's offset (``add_offsets_kernel``).
    Return what the kernels wrote (the grader records the launches).
    """
    # BEGIN SOLUTION: Scan each segment, scan the segment totals by calling yourself when there are several, then shift each segment by its offset.
    x = np.ascontiguousarray(x, dtype=np.int32)
    blocks = max(1, -(-x.size // SCAN_SPAN))
    d_out = cuda.device_array(x.size, dtype=np.int32)
    d_sums = cuda.device_array(blocks, dtype=np.int32)
    scan_block_kernel[blocks, THREADS](d_out, d_sums, cuda.to_device(x))
    if blocks > 1:
        offsets = exclusive_scan(d_sums.copy_to_host())
        add_offsets_kernel[-(-x.size // THREADS), THREADS](d_out, cuda.to_device(offsets))
    return d_out.copy_to_host()
    # END SOLUTION


# -- 3. Tiled matrix multiply -----------------------------------------------------

@cuda.jit
def tiled_matmul_kernel(C, A, B):
    """``C = A @ B`` for float32 matrices of any shape, one TILE x TILE tile of C per block.

    Thread ``(tx, ty)`` of block ``(bx, by)`` computes ``C[by*TILE + ty, bx*TILE + tx]``
    (x runs along columns). The block walks along the shared dimension one tile
    at a time: each thread loads *one* element of A's tile and one of B's into
    shared memory (0 outside the matrices), the block waits, every thread adds
    TILE products from shared memory, the block waits again, next tile. So each
    element of A and B is read from global memory once per tile of C that needs
    it, not once per element of C.
    """
    # BEGIN SOLUTION: Per step along K each thread stages one element of each tile (zero outside), the block waits, accumulates, then waits again.
    sA = cuda.shared.array((TILE, TILE), dtype=float32)
    sB = cuda.shared.array((TILE, TILE), dtype=float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    row = cuda.blockIdx.y * TILE + ty
    col = cuda.blockIdx.x * TILE + tx
    acc = float32(0.0)
    for t in range((A.shape[1] + TILE - 1) // TILE):
        k = t * TILE
        sA[ty, tx] = A[row, k + tx] if row < A.shape[0] and k + tx < A.shape[1] else 0.0
        sB[ty, tx] = B[k + ty, col] if k + ty < B.shape[0] and col < B.shape[1] else 0.0
        cuda.syncthreads()
        for j in range(TILE):
            acc += sA[ty, j] * sB[j, tx]
        cuda.syncthreads()  # nobody overwrites the tiles while others still read them
    if row < C.shape[0] and col < C.shape[1]:
        C[row, col] = acc
    # END SOLUTION


def tiled_matmul(A, B):
    """Host side: ``A @ B`` (float32) with ``tiled_matmul_kernel``, one block per tile
    of C; returns the C it wrote as a NumPy array (the grader records the launch)."""
    # BEGIN SOLUTION: One block of TILE by TILE threads per tile of C, with the grid's x running along C's columns.
    A = np.ascontiguousarray(A, dtype=np.float32)
    B = np.ascontiguousarray(B, dtype=np.float32)
    d_C = cuda.device_array((A.shape[0], B.shape[1]), dtype=np.float32)
    grid = (-(-B.shape[1] // TILE), -(-A.shape[0] // TILE))
    tiled_matmul_kernel[grid, (TILE, TILE)](d_C, cuda.to_device(A), cuda.to_device(B))
    return d_C.copy_to_host()
    # END SOLUTION


# -- 4. Histogram -------------------------------------------------------------------

@cuda.jit
def histogram_kernel(counts, values):
    """Add one to ``counts[v]`` for every ``v`` in ``values`` (int32, each in
    ``[0, counts.size)``, ``counts.size <= MAX_BINS``); ``counts`` starts at zero.

    Many threads hit the same bin at once, so updates must be atomic. Atomics on
    global memory from the whole grid are slow when they collide; give each block
    its own copy of the bins in shared memory (*privatisation*), fill it with
    atomics there (grid-stride over the values), then add each of the block's
    bins to ``counts`` with one global atomic.
    """
    # BEGIN SOLUTION: Clear the block's shared bins, wait, count into them atomically, wait, then fold each non-empty bin into the global counts atomically.
    bins = cuda.shared.array(MAX_BINS, dtype=int32)
    tid = cuda.threadIdx.x
    n_bins = counts.size
    for b in range(tid, n_bins, cuda.blockDim.x):
        bins[b] = 0
    cuda.syncthreads()
    i = cuda.grid(1)
    while i < values.size:
        cuda.atomic.add(bins, values[i], 1)
        i += cuda.gridsize(1)
    cuda.syncthreads()
    for b in range(tid, n_bins, cuda.blockDim.x):
        if bins[b] != 0:
            cuda.atomic.add(counts, b, bins[b])
    # END SOLUTION


def histogram(values, n_bins, blocks=None):
    """Host side: ``np.bincount(values, minlength=n_bins)`` computed by
    ``histogram_kernel`` (int32 counts): return the counts it wrote (the grader
    records the launch). ``blocks`` defaults to one per ``THREADS`` values,
    capped at 256."""
    # BEGIN SOLUTION: Give the kernel counts that start at zero on the device, launch blocks of THREADS threads, and bring the counts back.
    values = np.ascontiguousarray(values, dtype=np.int32)
    if blocks is None:
        blocks = min(max(1, -(-values.size // THREADS)), 256)
    d_counts = cuda.to_device(np.zeros(n_bins, dtype=np.int32))
    histogram_kernel[blocks, THREADS](d_counts, cuda.to_device(values))
    return d_counts.copy_to_host()
    # END SOLUTION
