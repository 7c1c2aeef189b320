"""course.races finds races in prange loops whatever the thread schedule."""
import numba
import numpy as np
from numba import njit, prange

from course.races import find_races


@njit(parallel=True)
def shared_accumulator(x):
    acc = np.zeros(1)
    for i in prange(x.size):
        acc[0] += x[i]
    return acc[0]


@njit(parallel=True)
def scalar_reduction(x):
    total = 0.0
    for i in prange(x.size):
        total += x[i]
    return total


@njit(parallel=True)
def shared_bins(x, n_bins):
    counts = np.zeros(n_bins, np.int64)
    for i in prange(x.size):
        counts[int(x[i])] += 1
    return counts


@njit(parallel=True)
def bins_per_thread(x, n_bins):
    private = np.zeros((numba.get_num_threads(), n_bins), np.int64)
    for i in prange(x.size):
        private[numba.get_thread_id(), int(x[i])] += 1
    return private.sum(axis=0)


@njit(parallel=True)
def prefix_sum_in_prange(x):
    out = np.empty_like(x)
    out[0] = x[0]
    for i in prange(1, x.size):
        out[i] = out[i - 1] + x[i]
    return out


@njit(parallel=True)
def elementwise(x):
    out = np.empty_like(x)
    for i in prange(x.size):
        out[i] = 2 * x[i]
    return out


X = np.random.default_rng(0).integers(0, 4, 64).astype(np.float64)


def test_clean_loops_have_no_race():
    assert find_races(scalar_reduction, X) == []
    assert find_races(elementwise, X) == []
    assert find_races(bins_per_thread, X, 4) == []


def test_two_writers_of_one_element_are_found():
    (race,) = find_races(shared_accumulator, X)
    assert "both write element [0] of a (1,) float64 array" in race and "test_races.py:" in race
    assert len(find_races(shared_bins, X, 4)) == 4


def test_a_read_of_another_threads_write_is_found():
    races = find_races(prefix_sum_in_prange, X)
    assert races and all("reads" in r for r in races)


def test_the_inputs_are_left_alone():
    x = X.copy()
    find_races(prefix_sum_in_prange, x)
    assert np.array_equal(x, X) and type(x) is np.ndarray
