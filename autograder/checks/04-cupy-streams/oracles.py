"""The oracles of lab 04's checks, in the grader's process. None of them is torch's
GELU or softmax (the lab refuses those, so the answer cannot be handed back) nor
the reference's code.

- ``gelu_tanh``: GELU's tanh approximation in float64, in its logistic form
  ``z / (1 + exp(-2u))`` (``0.5 (1 + tanh u) = 1 / (1 + exp(-2u))``), which keeps
  its relative accuracy where ``1 + tanh u`` cancels (large negative ``z``). At
  import it is held to the exact GELU, ``z Φ(z)`` with ``math.erf``, which the
  approximation follows to within 5e-4 (0.0044715 for 0.044715 is 60 times that).
- ``GELU_EDGES``: the inputs where a GELU goes wrong: far out on both sides,
  around 0, tiny, and NaN; ``gelu_problem``: what is wrong with a GELU computed
  in float32 or float64, within what rounding allows.
- ``softmax``: ``exp(x - logsumexp(x))`` along the last axis, in float64.
- ``PIPELINE_FUNCTIONS``: what ``f`` of each chunk is, for the pipeline's results;
  ``pipe_bound``: the closed-form serial and pipelined makespans.
- ``ROOFLINE_CASES``: hand-worked roofline answers.
- ``gelu_recheck``, ``copy_recheck``, ``spin_recheck``, ``sampled_recheck``: the GPU
  tier's rechecks of a timed run's output, from its seed alone (``timed.judge``).
"""
import math

import numpy as np

from autograder.grading import timed
from course import gpu_timing

SQRT_2_OVER_PI = math.sqrt(2 / math.pi)


def gelu_tanh(z):
    """GELU (tanh approximation) of ``z``, in float64."""
    z = np.asarray(z, dtype=np.float64)
    u = SQRT_2_OVER_PI * (z + 0.044715 * z**3)
    with np.errstate(over="ignore"):  # exp(-2u) = inf far left: z / inf = -0, as it should
        return z / (1 + np.exp(-2 * u))


def _gelu_exact(z: float) -> float:
    return 0.5 * z * (1 + math.erf(z / math.sqrt(2)))


def _held_to_exact_gelu():
    grid = np.linspace(-8, 8, 1601)
    worst = max(abs(a - _gelu_exact(z)) for a, z in zip(gelu_tanh(grid), grid))
    assert worst < 1e-3, f"the GELU oracle is {worst:.2g} from z Φ(z): its formula is wrong"


_held_to_exact_gelu()

C_TYPE = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}


def gelu_problem(got, z):
    """What is wrong with ``got`` as GELU of ``z`` (float32 or float64), or None: NaN
    must stay NaN; the rest be within 16 eps of the oracle, relative, and 4 eps |z|
    besides, what rounding ``1 + tanh`` costs where tanh is near -1."""
    want, eps, nan = gelu_tanh(z), np.finfo(z.dtype).eps, np.isnan(z)
    with np.errstate(invalid="ignore"):
        far = ~(np.abs(got - want) <= 16 * eps * np.abs(want) + 4 * eps * np.abs(z))
    bad = np.where(nan, ~np.isnan(got), far)
    if not bad.any():
        return None
    i = int(np.flatnonzero(bad.ravel())[0])
    z_i, want_i, got_i = (float(a.ravel()[i]) for a in (z, want, got))  # plain numbers, not np.float32(...)
    return f"at x + bias = {z_i!r} GELU is {want_i!r}, it gave {got_i!r}; {int(bad.sum())} of {bad.size} elements differ"


# x + bias at the edges: far left (where 1 + tanh cancels to 0), far right (gelu(z) = z),
# either side of 0 and at 0, tiny values (gelu(z) ≈ z / 2, normal in float32 too), NaN.
GELU_EDGES = (-1e4, -100.0, -20.0, -8.0, -5.0, -3.0, -1.0, -0.5, -1e-3, -1e-20, -1e-30, 0.0,
              1e-30, 1e-20, 1e-3, 0.5, 1.0, 3.0, 5.0, 8.0, 20.0, 100.0, 1e4, math.nan)


def softmax(x):
    """Softmax along the last axis, in float64, as ``exp(x - logsumexp(x))``: ``np.logaddexp``
    combines the row in log space, so no exponent is ever taken of a large number."""
    x = np.asarray(x, dtype=np.float64)
    return np.exp(x - np.logaddexp.reduce(x, axis=-1, keepdims=True))


PIPELINE_FUNCTIONS = {  # the harness's f, by name, applied to one host chunk
    "affine": lambda c: 2 * c + 1,
    "row_sums": lambda c: c.sum(axis=-1, dtype=np.float64),
}


def pipe_bound(n_chunks, stage_s):
    """Closed form for ``n_chunks`` equal chunks on three engines, ``stage_s`` the seconds
    of one chunk's h2d, compute and d2h: (serial makespan, the busiest engine's total plus
    the other two stages of one chunk, for filling and draining the pipeline)."""
    total = {k: v * n_chunks for k, v in stage_s.items()}
    busiest = max(total, key=total.get)
    return sum(total.values()), total[busiest] + sum(v for k, v in stage_s.items() if k != busiest)


H200 = (67e12, 4.8e12)  # FP32 FLOP/s, HBM B/s (datasheet); ridge ~14 flop/B
SMALL = (10e12, 1e12)  # a made-up card with ridge 10 flop/B
ROOFLINE_CASES = [  # (name, flops, bytes, device, attainable, bound), worked by hand
    ("SAXPY, n = 1e6, H200", 2e6, 12e6, H200, 4.8e12 / 6, "memory-bound"),
    ("matmul n = 4096, H200", 2 * 4096**3, 3 * 4 * 4096**2, H200, 67e12, "compute-bound"),
    ("I = 10 on H200", 10e9, 1e9, H200, 48e12, "memory-bound"),
    ("I = 20 on H200", 20e9, 1e9, H200, 67e12, "compute-bound"),
    ("I = 5, ridge 10", 5e9, 1e9, SMALL, 5e12, "memory-bound"),
    ("I = 12, ridge 10", 12e9, 1e9, SMALL, 10e12, "compute-bound"),
    ("I = 10.5, ridge 10", 10.5e9, 1e9, SMALL, 10e12, "compute-bound"),
    ("I = 2.5, ridge 10", 5e9, 2e9, SMALL, 2.5e12, "memory-bound"),
    ("I = ridge = 10", 10e9, 1e9, SMALL, 10e12, "compute-bound"),  # at the ridge: compute-bound
]
INTENSITY_CASES = [(2e6, 12e6, 1 / 6), (2 * 4096**3, 3 * 4 * 4096**2, 4096 / 6), (7, 2, 3.5), (2.5, 0.5, 5.0),
                   (1, 3, 1 / 3)]  # (flops, bytes, flop per byte)


def drawn_roofline_cases(rng, count=6):
    """ROOFLINE_CASES' kind for made-up cards, from the grading's seed: peaks of 1-100 TFLOP/s,
    bandwidths of 0.1-8 TB/s, an intensity a factor of 1.5 to 20 either side of the ridge."""
    cases = []
    for k in range(count):
        peak, bandwidth = float(rng.uniform(1e12, 100e12)), float(rng.uniform(0.1e12, 8e12))
        ridge = peak / bandwidth
        intensity = ridge * float(rng.uniform(1.5, 20)) ** (1 if k % 2 else -1)
        nbytes = float(rng.uniform(1e6, 1e10))
        flops = intensity * nbytes
        bound = "compute-bound" if flops / nbytes >= ridge else "memory-bound"
        cases.append((f"I = {intensity:.4g} on a card of {peak:.4g} FLOP/s and {bandwidth:.4g} B/s", flops, nbytes,
                      (peak, bandwidth), min(peak, flops / nbytes * bandwidth), bound))
    return cases


# --- the GPU tier: a timed run's output, from its seed -----------------------------------

def gelu_recheck(size, cols):
    """A run's sampled bias_gelu (``size`` elements in rows of ``cols``) against GELU of its
    x + bias, both named by the run's seed."""
    def recheck(seed, kept):
        where = gpu_timing.sample_positions(seed, size)
        x = gpu_timing.hashed(np, seed, None, -4.0, 4.0, positions=where)
        bias = gpu_timing.hashed(np, seed, None, -1.0, 1.0, stream=1, positions=where % cols)
        return timed.sample_problem(kept, gelu_tanh(x + bias), where, rtol=1e-5, atol=1e-6)
    return recheck


def copy_recheck(size):
    def recheck(seed, kept):
        where = gpu_timing.sample_positions(seed, size)
        return timed.sample_problem(kept, gpu_timing.hashed(np, seed, None, -4.0, 4.0, positions=where), where, rtol=0)
    return recheck


def spin_recheck(n_chunks, chunk_elems, base_seed, spins):
    """A run's sampled results against the harness's spin loop in float32 on its chunks (the
    base chunks times the run's scale). The loop ends within about 1e-5 of 1 (each step's
    rounding, amplified 100 times; the GPU fuses each multiply-add), plus x: an absolute
    tolerance of 1e-4 tells a run's results from the last run's, whose x differ by a factor.
    The serial schedule and the pipeline run on the same seeds: each oracle is made once."""
    oracles_of = {}

    def want(seed, where):
        if seed not in oracles_of:
            scale = np.float32(gpu_timing.scale_of(seed))
            x = np.stack([gpu_timing.hashed(np, base_seed, None, stream=j, positions=where) * scale
                          for j in range(n_chunks)])
            v = x
            for _ in range(spins):
                v = v * np.float32(0.99) + np.float32(0.01)
            oracles_of[seed] = v + x
        return oracles_of[seed]

    def recheck(seed, kept):
        if len(kept) != n_chunks:
            return f"{len(kept)} results came back for {n_chunks} chunks"
        where = gpu_timing.sample_positions(seed, chunk_elems, count=64)
        for j, (got, expected) in enumerate(zip(kept, want(seed, where))):
            problem = timed.sample_problem(got, expected, where, rtol=0, atol=1e-4)
            if problem:
                return f"chunk {j}: {problem}"
        return None
    return recheck


def sampled_recheck(size, want_at):
    def recheck(seed, kept):
        where = gpu_timing.sample_positions(seed, size)
        return timed.sample_problem(kept, want_at(seed, where), where, rtol=1e-3, atol=1e-6)
    return recheck
