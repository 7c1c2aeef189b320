"""Lab 01 — parallel thinking on a multicore CPU.

Fill in the functions below. Each loop you parallelise uses numba's ``prange``:
numba splits its iterations between threads, so an iteration must not depend on
another one, and two iterations must never write to the same place unless numba
knows it is a reduction (a scalar updated with ``+=``).

Run the checks with ``k2c grade 01`` (from the repository root).
"""
import numba
import numpy as np
from numba import njit, prange


@njit(parallel=True)
def parallel_saxpy(a, x, y):
    """Return ``a * x + y`` for 1-D arrays ``x`` and ``y`` (a *map*: every
    element is independent of every other)."""
    out = np.empty_like(x)
    # BEGIN SOLUTION: Every element is independent: split the loop over them between threads.
    for i in prange(x.size):
        out[i] = a * x[i] + y[i]
    # END SOLUTION
    return out


@njit(parallel=True)
def parallel_sum(x):
    """Return the sum of a 1-D array (a *reduction*).

    Accumulate into a local scalar with ``+=`` inside ``prange``; numba turns
    that into one private partial sum per thread, combined at the end. An array
    element used as the accumulator is *not* recognised and races.
    """
    # BEGIN SOLUTION: Keep the running total in a plain local number inside the parallel loop, which numba treats as a reduction.
    total = 0.0
    for i in prange(x.size):
        total += x[i]
    return total
    # END SOLUTION


@njit(parallel=True)
def parallel_histogram(x, n_bins, lo, hi):
    """Count the values of ``x`` in ``n_bins`` equal-width bins over ``[lo, hi]``.

    Same convention as ``np.histogram(x, n_bins, (lo, hi))``: every bin is
    half-open ``[left, right)`` except the last, which also holds ``hi``; values
    outside ``[lo, hi]`` are not counted. Return an int64 array.

    Threads that increment a shared ``counts[b] += 1`` lose updates. Give each
    chunk of the input its own private row of counts, then add the rows up.
    """
    # BEGIN SOLUTION: Give each thread a chunk of the input and a private row of counts, then add the rows together.
    n_chunks = numba.get_num_threads()
    chunk = (x.size + n_chunks - 1) // n_chunks
    private = np.zeros((n_chunks, n_bins), dtype=np.int64)
    width = (hi - lo) / n_bins
    for c in prange(n_chunks):
        for i in range(c * chunk, min((c + 1) * chunk, x.size)):
            v = x[i]
            if v < lo or v > hi:
                continue
            b = int((v - lo) / width)
            if b >= n_bins:  # v == hi belongs to the last bin
                b = n_bins - 1
            private[c, b] += 1
    return private.sum(axis=0)
    # END SOLUTION


def amdahl_speedup(serial_fraction, p):
    """Amdahl: speedup on ``p`` workers of a job whose ``serial_fraction`` cannot
    be parallelised, at a fixed problem size."""
    # BEGIN SOLUTION: On p workers the serial share of the time stays as it is; only the parallel share is divided among them.
    return 1.0 / (serial_fraction + (1.0 - serial_fraction) / np.asarray(p, dtype=float))
    # END SOLUTION


def gustafson_speedup(serial_fraction, p):
    """Gustafson: scaled speedup on ``p`` workers when the parallel part grows
    with ``p`` and ``serial_fraction`` is measured on the parallel run."""
    # BEGIN SOLUTION: The serial share stays fixed while the parallel share does p times the work in the same time.
    return serial_fraction + (1.0 - serial_fraction) * np.asarray(p, dtype=float)
    # END SOLUTION


def fit_amdahl(p, t):
    """Fit Amdahl's law ``t(p) = t1 * (f + (1 - f) / p)`` to measured times.

    ``p``: worker counts; ``t``: the time measured with each count.
    Return ``(f, t1)``: the serial fraction and the fitted one-worker time.
    Hint: the model is a straight line in ``1/p``.
    """
    # BEGIN SOLUTION: Fit a straight line in 1/p by least squares, then read the serial fraction and t1 off its intercept and slope.
    p = np.asarray(p, dtype=float)
    t = np.asarray(t, dtype=float)
    design = np.column_stack([np.ones_like(p), 1.0 / p])
    (a, b), *_ = np.linalg.lstsq(design, t, rcond=None)
    t1 = a + b
    return float(a / t1), float(t1)
    # END SOLUTION
