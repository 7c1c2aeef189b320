"""Lab 03's oracles, in the grader's process: NumPy's answers to what the
kernels compute, and readers of the record of a host function's launches
(``harness.recorded``).

- ``grid_stride_block_sums``: each block's sum when thread ``g`` of a grid of
  ``blocks * threads`` adds up ``x[g], x[g + G], ...`` (float64).
- ``exclusive``: the exclusive prefix sum of an int32 array.
- ``with_offsets``: ``out[i] + offsets[i // span]``.
- ``launches_of``: a kernel's launches in a record, as (index, grid, block).
- ``holds``: whether a value is what some of the recorded launches left in an
  array they wrote, which a value computed on the host beside them is not.
- ``sum_recheck``, ``matmul_recheck``, ``histogram_recheck``: the GPU tier's
  rechecks of a timed run's output, from its seed alone (``timed.judge``).
"""
import math

import numpy as np

from autograder.grading import timed
from course import gpu_timing


def grid_stride_block_sums(x, blocks, threads):
    grid = blocks * threads
    padded = np.zeros(math.ceil(x.size / grid) * grid)
    padded[:x.size] = x
    per_thread = padded.reshape(-1, grid).sum(axis=0)
    return per_thread.reshape(blocks, threads).sum(axis=1)


def exclusive(x):
    return np.concatenate([[0], np.cumsum(x, dtype=np.int64)[:-1]]).astype(np.int32)


def with_offsets(out, offsets, span):
    return out + offsets[np.arange(out.size) // span]


def launches_of(run, kernel):
    """``[(index, grid, block), ...]`` of ``kernel``'s launches, in order; grid and block as (x, y, z)."""
    return [(i, tuple(grid), tuple(block)) for i, (name, grid, block) in enumerate(run["launches"]) if name == kernel]


def holds(run, value, launches) -> bool:
    """Whether ``value`` is what the launches ``launches`` (indices) left in an array
    they wrote. An array: it equals the corner of such an array its size (the
    whole array, or the part a padded one holds), as that array was when the last
    launch that wrote it ended, and the launches wrote each of its nonzero
    elements. A number: it equals an element such a launch wrote."""
    value = np.asarray(value)
    for out in run["outputs"]:
        if not set(out["by"]) & set(launches):
            continue
        contents, written = out["contents"], out["written"]
        if value.ndim == 0:
            if (contents[written].astype(np.float64) == value).any():
                return True
            continue
        if contents.ndim != value.ndim or any(c < v for c, v in zip(contents.shape, value.shape)):
            continue
        corner = tuple(slice(0, n) for n in value.shape)
        if np.array_equal(contents[corner], value) and (written[corner] | (value == 0)).all():
            return True
    return False


# --- the GPU tier: a timed run's output, from its seed -----------------------------------

def sum_recheck(n, base_seed):
    """A run's total against ``scale_of(seed)`` times the base's float64 sum."""
    base_total = gpu_timing.hashed_total(base_seed, n)

    def recheck(seed, kept):
        want = gpu_timing.scale_of(seed) * base_total
        error = abs(kept - want) / want
        return None if error <= 1e-4 else f"the sum is {kept:.7g}, expected {want:.7g} (relative error {error:.2g})"
    return recheck


def matmul_recheck(n):
    """A run's sampled C[i, j] against row i of its A times column j of its B, in float64."""
    def recheck(seed, kept):
        where = gpu_timing.sample_positions(seed, n * n)
        return timed.sample_problem(kept, gpu_timing.hashed_product_at(seed, n, where), where, rtol=1e-3)
    return recheck


def histogram_recheck(n, n_bins, base_seed):
    """A run's counts against the base's, rotated by ``shift_of(seed)``."""
    base = gpu_timing.hashed_counts(base_seed, n, n_bins)

    def recheck(seed, kept):
        want, kept = np.roll(base, gpu_timing.shift_of(seed, n_bins)), np.asarray(kept)
        if kept.shape != want.shape:
            return f"{kept.size} bins came back, expected {n_bins}"
        bad = np.flatnonzero(kept != want)
        return None if not bad.size else (f"bin {bad[0]} holds {kept[bad[0]]}, expected {want[bad[0]]} "
                                          f"({bad.size} of {n_bins} bins differ)")
    return recheck
