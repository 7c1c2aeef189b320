"""What the handout runs on every rank: your ``ring_attention`` and
``ulysses_attention`` on this rank's shard of the sequence, next to torch's
``scaled_dot_product_attention`` (and autograd) on the whole sequence.

You do not need to edit this file. ``course.dist.run(try_attention, p, cases)``
returns, per rank, ``{(function, causal): {...}}`` for each ``(function,
causal)`` in ``cases`` (``function`` is ``"ring"`` or ``"ulysses"``): the
largest difference between this rank's output and the rows of the whole
sequence's attention it holds, and the same for the gradients of q, k and v
(the loss is ``(out * upstream).sum()`` for a random ``upstream``). Every rank
builds the same float64 q, k and v from a seed and takes its shard: contiguous,
or zigzag for causal ring attention (the documented layout, written out below
for 16 positions). A function you have not written yet
comes back as ``{"not_written": message}``.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

BATCH, HEADS, SEQ, HEAD_DIM = 2, 4, 16, 8  # 4 heads: Ulysses gives each of 2 ranks 2 whole heads


def whole_sequence(seed=0):
    """q, k, v and the upstream gradient of the output, ``[batch, heads, seq, head_dim]``, float64."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=g, dtype=torch.float64) for _ in range(4)]


# Rank r's positions under causal context parallelism, chunks r and 2p-1-r of 2p, for the
# 16 positions of ``whole_sequence`` (a table: computing it is your ``zigzag_indices``).
ZIGZAG = {1: [list(range(16))],
          2: [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]],
          4: [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]}


def contiguous(seq_len, p):
    """Rank r's positions without causal masking: the r-th of p equal slices."""
    size = seq_len // p
    return [list(range(r * size, (r + 1) * size)) for r in range(p)]


def layout(cp, function, causal, p):
    """The documented layout (this file's, as the grader's: a wrong ``zigzag_indices``
    of yours is reported by section 3, not mistaken here for a wrong ring)."""
    return ZIGZAG[p] if function == "ring" and causal else contiguous(SEQ, p)


def _largest(a, b):
    return float((a - b).abs().max()) if a is not None else float("inf")  # no gradient reached it


def _compare(cp, function, causal):
    rank, p = dist.get_rank(), dist.get_world_size()
    q, k, v, upstream = whole_sequence()
    mine = layout(cp, function, causal, p)[rank]
    # The whole sequence on one process: torch's attention and autograd.
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*whole, is_causal=causal)
    want.backward(upstream)
    # This rank's shard through your function.
    shard = [t[..., mine, :].clone().requires_grad_() for t in (q, k, v)]
    attend = cp.ring_attention if function == "ring" else cp.ulysses_attention
    out = attend(*shard, causal=causal)
    out.backward(upstream[..., mine, :])
    result = {"output": _largest(out, want[..., mine, :])}
    for name, a, b in zip(("dq", "dk", "dv"), shard, whole):
        result[name] = _largest(a.grad, b.grad[..., mine, :])
    return result


def try_attention(cases):
    """Each ``(function, causal)`` of ``cases`` on this rank; see the module docstring."""
    import context_parallel as cp

    out = {}
    for function, causal in cases:
        try:
            out[function, causal] = _compare(cp, function, causal)
        except NotImplementedError as err:  # a stub: every rank raises at the same point
            out[function, causal] = {"not_written": str(err)}
    return out
