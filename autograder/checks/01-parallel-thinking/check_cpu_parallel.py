"""Checks for lab 01: prange loops against NumPy, races under contention, and
Amdahl's law against its formula and synthetic timings. Every input, and every
fraction and time the fits must recover, is drawn from the grading's secret seed."""
import numpy as np
import pytest

from autograder.grading import seeds
from autograder.grading.checking import expect_array, expect_close

CONTENDED = 1 << 22  # big enough that two or more threads racing lose updates


@pytest.mark.points(2)
def check_saxpy_matches_numpy(submission, seed):
    """parallel_saxpy equals a*x + y"""
    rng = seeds.rng(seed, "01", "saxpy")
    a, x, y = float(rng.uniform(-4, 4)), rng.standard_normal(1_000_003), rng.standard_normal(1_000_003)
    got = submission.call("cpu_parallel.parallel_saxpy", a, x, y)
    expect_array(got, a * x + y, f"parallel_saxpy({a:g}, x, y)", rtol=1e-12)


@pytest.mark.points(2)
def check_sum_matches_numpy(submission, seed):
    """parallel_sum equals the exact sum of integer-valued data"""
    x = seeds.rng(seed, "01", "sum").integers(-1000, 1000, 999_999).astype(np.float64)
    got = submission.call("cpu_parallel.parallel_sum", x)
    assert got == x.sum(), f"parallel_sum(x): expected {x.sum():g}, got {got!r}"


@pytest.mark.points(2)
def check_sum_loses_no_updates(submission, seed):
    """parallel_sum loses no updates when many threads add at once"""
    found = submission.harness("races", "parallel_sum",
                               seeds.rng(seed, "01", "races").integers(0, 9, 300).astype(np.float64))
    assert not found, (
        "parallel_sum has a data race: " + found[0] + (f" (and {len(found) - 1} more)" if len(found) > 1 else "")
        + ". Accumulate into a scalar with += so numba makes it a reduction")
    ones = np.ones(CONTENDED)
    runs = submission.harness("call_repeatedly", "parallel_sum", 3, ones)
    for got in runs:
        assert got == CONTENDED, (
            f"parallel_sum of {CONTENDED} ones returned {got!r} (runs: {runs}): updates were lost. "
            "Threads adding into one shared array element race; accumulate into a scalar with += "
            "so numba makes it a reduction")


HISTOGRAM_CASES = {"20 bins": (20, 0.0, 100.0), "7 bins": (7, -3.0, 4.0)}
LOOP_ARGS = {"parallel_saxpy": (2.0, np.arange(1000.0), np.arange(1000.0)), "parallel_sum": (np.arange(1000.0),),
             "parallel_histogram": (np.arange(1000.0), 10, 0.0, 1000.0)}


def _histogram_input(n_bins, lo, hi, seed, k):
    # Integer-valued data and bin edges that are exact in binary, so the oracle is unambiguous.
    x = seeds.rng(seed, "01", "histogram", k).integers(int(lo) - 5, int(hi) + 5, 100_000).astype(np.float64)
    x[:3] = [lo, hi, (lo + hi) / 2]
    return x


def _contended_input():
    """Four bins that every thread hits: (x, n_bins, lo, hi)."""
    return np.random.default_rng(11).integers(0, 4, CONTENDED).astype(np.float64), 4, 0.0, 4.0


def _histogram_runs(submission, seed):
    """parallel_histogram on the inputs of every histogram check, in one call (harness.histogram_runs):
    numba compiles a parallel function anew in each call, in seconds."""
    cases = [(_histogram_input(*case, seed, k), *case) for k, case in enumerate(HISTOGRAM_CASES.values())]
    return submission.harness_once("histogram", "histogram_runs", cases, _contended_input(), 3,
                                   LOOP_ARGS["parallel_histogram"])


@pytest.mark.points(3)
@pytest.mark.parametrize("case", list(HISTOGRAM_CASES))
def check_histogram_matches_numpy(submission, seed, case):
    """parallel_histogram equals np.histogram, edges and out-of-range values included"""
    index = list(HISTOGRAM_CASES).index(case)
    n_bins, lo, hi = HISTOGRAM_CASES[case]
    want, _ = np.histogram(_histogram_input(n_bins, lo, hi, seed, index), n_bins, (lo, hi))
    got = _histogram_runs(submission, seed)["cases"][index]
    expect_array(got, want, f"parallel_histogram(x, {n_bins}, {lo}, {hi})", exact=True)


@pytest.mark.points(2)
def check_histogram_loses_no_updates(submission, seed):
    """parallel_histogram loses no counts when threads hit the same bins"""
    found = submission.harness("races", "parallel_histogram",
                               seeds.rng(seed, "01", "histogram races").integers(0, 4, 300).astype(np.float64), 4, 0.0, 4.0)
    assert not found, (
        "parallel_histogram has a data race: " + found[0] + (f" (and {len(found) - 1} more)" if len(found) > 1 else "")
        + ". Give each chunk of the input its own private counts, then add them up")
    want, _ = np.histogram(_contended_input()[0], 4, (0.0, 4.0))
    runs = _histogram_runs(submission, seed)["contended"]
    for got in runs:
        lost = int(want.sum() - np.asarray(got).sum())
        assert lost == 0 and np.array_equal(got, want), (
            f"parallel_histogram counted {np.asarray(got).tolist()}, expected {want.tolist()}"
            + (f": {lost} counts lost to a race on the shared bins; give each thread its own counts" if lost else ""))


READS = {"parallel_saxpy": ["x", "y"], "parallel_sum": ["x"], "parallel_histogram": ["x"]}  # the inputs the work reads


@pytest.mark.points(1)
@pytest.mark.parametrize("name", ["parallel_saxpy", "parallel_sum", "parallel_histogram"])
def check_loop_runs_in_parallel(submission, seed, name):
    """numba turned the loop that does the work into a parallel loop (prange), which reads the inputs"""
    if name == "parallel_histogram":
        found = _histogram_runs(submission, seed)["loops"]
    else:
        found = submission.harness("parallel_loops", name, *LOOP_ARGS[name])
    assert found["loops"] != -1, f"{name} is not compiled with @njit(parallel=True)"
    assert found["loops"] >= 1, (f"numba found no parallel prange loop in {name}: use prange for the loop that "
                                 "splits the work (parallel=True alone parallelises only whole-array NumPy)")
    unread = [arg for arg in READS[name] if arg not in found["reads"]]
    assert not unread, (
        f"{name}'s prange loop never reads {', '.join(unread)}: the work happens outside the parallel loop "
        f"(its body indexes only {', '.join(found['reads']) or 'arrays made in the function'}). The loop that "
        "splits the work between threads is the one that reads the inputs element by element")


@pytest.mark.points(1)
def check_speedup_laws(submission, seed):
    """amdahl_speedup and gustafson_speedup follow their formulas"""
    rng = seeds.rng(seed, "01", "laws")
    p = np.concatenate([[1, 2, 4, 8, 64, 1024], rng.integers(3, 5000, 4)])
    for f in (0.0, 0.05, 0.5, *(round(float(v), 4) for v in rng.uniform(0.001, 0.999, 2))):
        expect_array(submission.call("cpu_parallel.amdahl_speedup", f, p), 1 / (f + (1 - f) / p),
                     f"amdahl_speedup({f}, p)", rtol=1e-9)
        expect_array(submission.call("cpu_parallel.gustafson_speedup", f, p), f + (1 - f) * p,
                     f"gustafson_speedup({f}, p)", rtol=1e-9)


def _amdahl_times(f, t1, p):
    return t1 * (f + (1 - f) / p)


@pytest.mark.points(2)
def check_fit_amdahl_exact(submission, seed):
    """fit_amdahl recovers the serial fraction and one-worker time from exact timings"""
    # Fractional fractions and times; the smallest fit (two worker counts) and one without p = 1,
    # where t1 is not simply the first timing.
    typical = np.array([1, 2, 3, 4, 8, 16, 32])
    rng = seeds.rng(seed, "01", "amdahl")
    drawn = [(float(rng.uniform(0.01, 0.6)), float(rng.uniform(0.01, 20))) for _ in range(3)]
    for p, (f, t1) in zip((typical, typical, np.array([2, 6])), drawn):
        got = submission.call("cpu_parallel.fit_amdahl", p, _amdahl_times(f, t1, p))
        assert isinstance(got, (tuple, list)) and len(got) == 2, f"fit_amdahl should return (f, t1), got {got!r}"
        expect_close(got[0], f, f"fitted serial fraction for f={f}, p={p.tolist()}", rel=1e-6)
        expect_close(got[1], t1, f"fitted one-worker time for t1={t1}, p={p.tolist()}", rel=1e-6)


@pytest.mark.points(1)
def check_fit_amdahl_noisy(submission, seed):
    """fit_amdahl stays close on timings with 2% measurement noise"""
    p = np.repeat([1, 2, 4, 8, 16], 5)
    rng = seeds.rng(seed, "01", "amdahl noisy")
    f, t1 = float(rng.uniform(0.1, 0.4)), float(rng.uniform(1, 10))
    noise = 1 + 0.02 * rng.standard_normal(p.size)
    got = submission.call("cpu_parallel.fit_amdahl", p, _amdahl_times(f, t1, p) * noise)
    assert isinstance(got, (tuple, list)) and len(got) == 2, f"fit_amdahl should return (f, t1), got {got!r}"
    assert abs(got[0] - f) < 0.02, f"fitted serial fraction {got[0]:.4f}, expected {f:.4f} ± 0.02"
