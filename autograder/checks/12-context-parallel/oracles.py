"""The oracles of lab 12's checks, in NumPy float64, in the grader's process.

- ``attention``: dense attention from its definition (softmax of the scaled
  scores, the causal mask as -inf), with each row's log-sum-exp;
  ``attention_grads``: its gradients, the softmax's Jacobian written out.
  tests/test_12_context_parallel.py holds both to torch's
  ``scaled_dot_product_attention`` and autograd.
- ``merge``: two blocks' partial results combined from the definition,
  normalised by the larger log-sum-exp (NumPy's ``logaddexp``).
- ``zigzag``/``contiguous``: the documented layouts; ``causal_pairs``: the
  unmasked (query, key) pairs of a set of positions, sum of (i + 1).
- ``best_balance``: the best placement's busiest rank, by trying every placement.
- The inputs: seeded normal tensors, tensors whose scores are all near ±1e4, and
  position-encoded ones whose attention picks exactly one key per query (see
  ``position_encoded``).
"""
import itertools
import math

import numpy as np


def attention(q, k, v, causal=False):
    """(out, lse) of ``q`` ``[..., sq, d]`` against ``k``, ``v`` ``[..., sk, d]``."""
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = np.where(np.triu(np.ones(scores.shape[-2:], dtype=bool), 1), -np.inf, scores)
    top = scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores - top)
    total = weights.sum(axis=-1, keepdims=True)
    return (weights / total) @ v, (top + np.log(total))[..., 0]


def attention_grads(q, k, v, causal, upstream):
    """(dq, dk, dv) of ``sum(attention(q, k, v) * upstream)``."""
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = attention(q, k, v, causal)
    scores = q @ np.swapaxes(k, -1, -2) * scale
    if causal:
        scores = np.where(np.triu(np.ones(scores.shape[-2:], dtype=bool), 1), -np.inf, scores)
    p = np.exp(scores - lse[..., None])
    dv = np.swapaxes(p, -1, -2) @ upstream
    dp = upstream @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    return ds @ k * scale, np.swapaxes(ds, -1, -2) @ q * scale, dv


def merge(out_a, lse_a, out_b, lse_b):
    """(out, lse) over both blocks' keys: each block weighted by exp(lse - the larger lse)."""
    top = np.maximum(lse_a, lse_b)
    wa, wb = np.exp(lse_a - top), np.exp(lse_b - top)
    return (wa[..., None] * out_a + wb[..., None] * out_b) / (wa + wb)[..., None], np.logaddexp(lse_a, lse_b)


# --- layouts and work ---------------------------------------------------------------------------

def zigzag(seq_len, P):
    chunk = seq_len // (2 * P)
    return [list(range(r * chunk, (r + 1) * chunk)) + list(range((2 * P - 1 - r) * chunk, (2 * P - r) * chunk))
            for r in range(P)]


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
