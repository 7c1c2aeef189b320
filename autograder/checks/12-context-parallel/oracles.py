"""The public oracles of lab 12's checks, in the grader's process. None of them
computes what a lab function returns: the attention itself is torch's own, the
rest are checks of an answer, closed forms and tables.

- ``torch_attention``: torch's ``scaled_dot_product_attention`` and autograd in
  float64, the library's attention (which the lab does not refuse and does not
  ask for): the reference for every output and gradient.
- ``lse_problem``: a log-sum-exp is right when ``sum_j exp(score_ij - lse_i)``
  over the keys row i sees is 1 (checked, not computed).
- ``merge_problem``: a merge is right when the two blocks' weights
  ``exp(lse_a - lse)`` and ``exp(lse_b - lse)``, read off the student's merged
  log-sum-exp, add up to 1 and weigh ``out_a`` and ``out_b`` into the student's
  ``out``.
- ``ZIGZAG``: the documented layouts for the sizes the checks use, as a table;
  ``contiguous``: the layout without causal masking; ``causal_pairs``: the
  unmasked (query, key) pairs of a set of positions, sum of (i + 1).
- ``best_balance``: the best placement's busiest rank, by trying every placement
  (the lab's ``balance`` is greedy; this is the exhaustive search it is held to).
- ``sampled_causal_attention``: the GPU tier's timed runs' outputs at their sampled
  positions, by ``torch_attention`` of each sampled row against the keys it sees,
  from the inputs their seed names (``course.gpu_timing.hashed``).
- The inputs: seeded normal tensors, tensors whose scores are all near ±1e4, and
  position-encoded ones whose attention picks exactly one key per query (see
  ``position_encoded``).

The zigzag layout for any size, which is what ``zigzag_indices`` returns, is in
``oracles_hidden.py``, for the hidden check only.
"""
import itertools
import math

import numpy as np


def torch_attention(q, k, v, causal=False, upstream=None):
    """torch's attention of ``q`` ``[..., sq, d]`` against ``k``, ``v`` ``[..., sk, d]`` in
    float64: the output, or with ``upstream`` (out, dq, dk, dv) of ``sum(out * upstream)``."""
    import torch

    tensors = [torch.tensor(np.ascontiguousarray(x), dtype=torch.float64).requires_grad_(upstream is not None)
               for x in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*tensors, is_causal=causal)
    if upstream is None:
        return out.detach().numpy()
    out.backward(torch.tensor(np.ascontiguousarray(upstream), dtype=torch.float64))
    return (out.detach().numpy(), *(t.grad.numpy() for t in tensors))


# The ranges of the GPU tier's hashed q, k and v (harness.blockwise_vs_sdpa): (low, high, stream).
TIMED_INPUTS = {"q": (-2.0, 2.0, 0), "k": (-2.0, 2.0, 1), "v": (-1.0, 1.0, 2)}


def sampled_causal_attention(seed, shape, positions):
    """Causal attention of the float32 q, k, v of ``shape`` ``(b, h, s, d)`` that ``seed`` names
    (``TIMED_INPUTS``), at the flat output ``positions`` only: each sampled row's query against
    the keys up to its own, in float64; only those inputs are made."""
    from course.gpu_timing import hashed

    b, h, s, d = shape
    positions = np.asarray(positions, np.int64)
    rows, columns = np.divmod(positions, d)  # a row: (batch, head, query) flattened
    found = {}
    for row in np.unique(rows):
        head_start = (int(row) // s) * s * d
        query = int(row) % s

        def inputs(name, start, count):
            low, high, stream = TIMED_INPUTS[name]
            where = np.arange(start, start + count, dtype=np.int64)
            return hashed(np, seed, None, low, high, stream=stream, positions=where).astype(np.float64)

        q = inputs("q", int(row) * d, d).reshape(1, d)
        k, v = (inputs(name, head_start, (query + 1) * d).reshape(query + 1, d) for name in ("k", "v"))
        found[int(row)] = torch_attention(q, k, v)[0]
    return np.array([found[int(r)][int(c)] for r, c in zip(rows, columns)])


def _array(value, shape, what):
    try:
        found = np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        return None, f"{what} should be an array of numbers, got {str(value)[:120]}"
    if found.shape != tuple(shape):
        return None, f"{what} has shape {found.shape}, expected {tuple(shape)}"
    return found, None


def lse_problem(q, k, causal, lse, what, tolerance=1e-9):
    """None when ``lse`` is each query row's log-sum-exp of its scaled scores
    (``q k^T / sqrt(d)``, keys after the row hidden when causal); else what is
    wrong. Checked as ``sum_j exp(score_ij - lse_i) == 1``, which holds for one
    value of ``lse_i`` only."""
    found, problem = _array(lse, q.shape[:-1], what)
    if problem:
        return problem
    scores = np.einsum("...id,...jd->...ij", q, k) / math.sqrt(q.shape[-1])
    if causal:  # row i sees the keys j <= i, the lower triangle
        scores = np.where(np.tri(*scores.shape[-2:], dtype=bool), scores, -np.inf)
    with np.errstate(over="ignore", invalid="ignore"):
        total = np.exp(scores - found[..., None]).sum(axis=-1)
    at, count = _first_not_one(total, tolerance)
    if count:
        return (f"{what}{list(at)} = {found[at]!r}: the sum over the keys of exp(score - lse) is {total[at]:.12g}, "
                f"not 1 ({count} of {total.size} rows; lse is log of the sum of exp(score) over the keys the "
                "row sees, scores q·k / sqrt(d))")
    return None


def _first_not_one(total, tolerance):
    """The index of the first entry of ``total`` farther than ``tolerance`` from 1 (NaN included), and how many are."""
    wrong = np.argwhere(~(np.abs(total - 1) <= tolerance))
    return (tuple(int(i) for i in wrong[0]) if len(wrong) else None), len(wrong)


def merge_problem(out_a, lse_a, out_b, lse_b, out, lse, what, rtol, atol, tolerance=1e-9):
    """None when (``out``, ``lse``) merges two blocks' (out, lse): the weights
    ``exp(lse_a - lse)`` and ``exp(lse_b - lse)`` add up to 1 (``lse`` is the
    log-sum-exp over both blocks' keys) and weigh ``out_a`` and ``out_b`` into
    ``out``; else what is wrong."""
    from autograder.grading.checking import expect_array

    found_out, problem = _array(out, out_a.shape, f"{what}: out")
    found_lse, problem = (None, problem) if problem else _array(lse, lse_a.shape, f"{what}: lse")
    if problem:
        return problem
    with np.errstate(over="ignore", invalid="ignore"):
        weight_a, weight_b = np.exp(lse_a - found_lse), np.exp(lse_b - found_lse)
    total = weight_a + weight_b
    at, count = _first_not_one(total, tolerance)
    if count:
        return (f"{what}: lse{list(at)} = {found_lse[at]!r} for lse_a = {lse_a[at]!r}, lse_b = {lse_b[at]!r}: "
                f"exp(lse_a - lse) + exp(lse_b - lse) is {total[at]:.12g}, not 1 ({count} of {total.size}; "
                "the merged lse is the log-sum-exp over both blocks' keys)")
    try:
        expect_array(found_out, weight_a[..., None] * out_a + weight_b[..., None] * out_b, f"{what}: out",
                     rtol=rtol, atol=atol)
    except AssertionError as exc:
        return f"{exc} (each block weighs exp(its lse - the merged lse))"
    return None


# --- layouts and work ---------------------------------------------------------------------------

# The documented zigzag layout (rank r: chunks r and 2P-1-r of 2P) for every (sequence, P) the public
# checks use, written out.
ZIGZAG = {
    (2, 1): [[0, 1]],
    (4, 2): [[0, 3], [1, 2]],
    (8, 4): [[0, 7], [1, 6], [2, 5], [3, 4]],
    (16, 2): [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]],
    (16, 4): [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]],
    (24, 3): [[0, 1, 2, 3, 20, 21, 22, 23], [4, 5, 6, 7, 16, 17, 18, 19], [8, 9, 10, 11, 12, 13, 14, 15]],
}


def contiguous(seq_len, P):
    part = seq_len // P
    return [list(range(r * part, (r + 1) * part)) for r in range(P)]


def causal_pairs(positions):
    """Unmasked (query, key) pairs of these query positions under causal masking: query i sees i + 1 keys."""
    return sum(i + 1 for i in positions)


def sequence_work(length):
    return length * (length + 1) // 2


def best_balance(seq_lens, P):
    """The smallest possible work of the busiest rank, over every placement."""
    work = [sequence_work(n) for n in seq_lens]
    best = math.inf
    for placement in itertools.product(range(P), repeat=len(work)):
        if placement and placement[0] != 0:  # rank labels are interchangeable: the first sequence on rank 0
            break
        loads = [0] * P
        for w, rank in zip(work, placement):
            loads[rank] += w
        best = min(best, max(loads))
    return best if work else 0


# --- inputs -------------------------------------------------------------------------------------

def randn(seed, *shape, scale=1.0):
    return np.random.default_rng(seed).standard_normal(shape) * scale


def qkv(seed, shape, scale=1.0):
    """q, k, v and an upstream gradient of ``shape``; ``scale`` multiplies q and k."""
    return {"q": randn(seed, *shape, scale=scale), "k": randn(seed + 1, *shape, scale=scale),
            "v": randn(seed + 2, *shape), "upstream": randn(seed + 3, *shape)}


def near_huge(seed, shape, score=1e4):
    """Like ``qkv``, but every score is within a few units of +``score`` (batch 0)
    or -``score`` (batch 1): q and k share a large first component (negated in k
    for batch 1) and are random in the others. The softmax is not saturated, so
    the gradients are not small, yet ``exp`` of any log-sum-exp overflows (+) or
    underflows to 0 (-)."""
    found = qkv(seed, shape)
    big = math.sqrt(score * math.sqrt(shape[-1]))
    found["q"][..., 0] = big
    found["k"][..., 0] = big
    found["k"][1::2, ..., 0] = -big
    return found


RADIUS = 160.0  # see position_encoded


def position_encoded(b, h, s, d):
    """q = k = RADIUS * (cos, sin) of angle 2 pi i / s at position i, so query i's
    score is largest at key i, every other key at least RADIUS^2 (1 - cos(2 pi / s))
    / sqrt(d) lower (796 for s = 16, d = 6: exp(-796) is 0 in float64). Attention,
    causal or not, copies v[i] to output i exactly. v says where it came from:
    ``batch * 10000 + head * 1000 + position * 10 + element``."""
    angle = 2 * np.pi * np.arange(s) / s
    q = np.zeros((b, h, s, d))
    q[..., 0], q[..., 1] = RADIUS * np.cos(angle), RADIUS * np.sin(angle)
    v = (np.arange(b)[:, None, None, None] * 10000 + np.arange(h)[None, :, None, None] * 1000
         + np.arange(s)[None, None, :, None] * 10 + np.arange(d)[None, None, None, :]).astype(float)
    return {"q": q, "k": q.copy(), "v": v, "upstream": np.zeros((b, h, s, d))}


def where_from(value):
    """(batch, head, position) that ``position_encoded``'s v value came from, or None."""
    if not np.isfinite(value) or value != round(value) or value < 0:
        return None
    value = int(round(value))
    return value // 10000, value % 10000 // 1000, value % 1000 // 10
