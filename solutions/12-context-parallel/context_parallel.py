"""Lab 12 — context parallelism: attention over sequences too long for one device.

Attention's scores grow with the square of the sequence, and its activations
with the sequence: at some length one device cannot hold them. Context
parallelism shards the *sequence* over P ranks. You write, from the bottom up:

1. ``local_attention(q, k, v, causal)`` — exact attention of queries against
   one block of keys, returning the output and the log-sum-exp of each row.
2. ``merge_partial_softmax(out_a, lse_a, out_b, lse_b)`` — combine the
   results of two key blocks as if the softmax had seen both at once.
3. ``blockwise_attention(q, k, v, block, causal)`` — one process, key blocks
   one at a time (online softmax): the full score matrix never exists.
4. ``zigzag_indices(seq_len, P)`` — which positions each rank holds under
   causal masking, so that every rank has the same work.
5. ``ring_attention(q, k, v, causal, group)`` and its ``RingAttention``
   autograd function — K/V blocks travel around the ring of ranks.
6. ``ulysses_attention(q, k, v, causal, group)`` — two all-to-alls swap a
   sequence shard for a head shard and back.
7. ``balance(seq_lens, P)`` — place whole sequences of different lengths on
   ranks so that the attention work is even.

Conventions the grader relies on:

- Tensors are ``[batch, heads, seq, head_dim]`` (torch's
  ``scaled_dot_product_attention`` layout), any float dtype (graded in
  float64). Scores are ``q @ k^T / sqrt(head_dim)``. ``lse`` is
  ``[batch, heads, seq]``: the natural log of the sum over keys of
  ``exp(score)``. ``causal`` hides key j from query i when j > i.
- Sequence shards: without ``causal``, rank r holds positions
  ``r*s/P .. (r+1)*s/P`` (contiguous). With ``causal``, the sequence is cut
  into 2P equal chunks and rank r holds chunk r followed by chunk 2P-1-r
  (the zigzag layout); a sequence that does not divide into 2P chunks raises
  ``ValueError``. A rank's output has its input's layout.
- Ring attention: ``P - 1`` steps, each sending this rank's current K/V block
  to rank r+1 and receiving rank r-1's with ``dist.batch_isend_irecv`` (or
  ``isend``/``irecv``), posted *before* the current block is computed and
  waited for after, so the transfer overlaps the compute. Autograd cannot
  differentiate through send and receive, so you write the backward by hand
  (``RingAttention.backward``): a second ring in which dK and dV travel with
  their blocks and are sent home at the end.
- Ulysses: q, k and v are stacked into ONE tensor for the first all-to-all
  (``dist.all_to_all_single``), so the forward makes exactly 2 all-to-alls;
  gradients come from autograd through an all-to-all autograd function (the
  backward of an all-to-all is an all-to-all), 2 more. Heads that do not
  divide by P raise ``ValueError``.
- ``group=None`` is the default group. No rank may ever hold the whole K or V.

Grade with ``k2c grade 12`` from the repository root.
"""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

# --- 1. attention of one block, and the merge ----------------------------------------------


def local_attention(q, k, v, causal=False):
    """``(out, lse)`` of queries ``q`` ``[..., sq, d]`` against the keys and values
    ``k``, ``v`` ``[..., sk, d]`` of one block. ``causal`` is for a block on the
    diagonal (``sq == sk``): key j is hidden from query i when j > i.
    ``out`` is ``[..., sq, d]``; ``lse`` is ``[..., sq]``.
    """
    # BEGIN SOLUTION: scale the scores, hide the upper triangle when causal, and keep each row's log-sum-exp
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse
    # END SOLUTION


def merge_partial_softmax(out_a, lse_a, out_b, lse_b):
    """``(out, lse)`` of attention over the keys of blocks a and b together, from
    each block's own ``(out, lse)``. Stable for log-sum-exps of any size (say
    ±1e4): never take ``exp`` of an ``lse`` itself.
    """
    # BEGIN SOLUTION: write block b's weight as a sigmoid of the difference of the two log-sum-exps
    weight_b = torch.sigmoid(lse_b - lse_a).unsqueeze(-1)
    return out_a - weight_b * (out_a - out_b), lse_a - F.logsigmoid(lse_a - lse_b)
    # END SOLUTION


def blockwise_attention(q, k, v, block, causal=False):
    """Attention of ``q`` over ``k``, ``v`` (all ``[..., s, d]``), equal to full
    attention, computed ``block`` queries by ``block`` keys at a time and merged
    with ``merge_partial_softmax``: no score matrix larger than a block is made.
    The last block may be shorter. With ``causal``, blocks above the diagonal
    are skipped. Raises ``ValueError`` when ``block < 1``.
    """
    # BEGIN SOLUTION: for each query block, merge the key blocks up to its own
    if block < 1:
        raise ValueError(f"block must be at least 1, got {block}")
    s, outs = q.shape[-2], []
    for start in range(0, s, block):
        rows = slice(start, start + block)
        out = lse = None
        for key_start in range(0, s, block):
            if causal and key_start > start:
                break
            keys = slice(key_start, key_start + block)
            o, l = local_attention(q[..., rows, :], k[..., keys, :], v[..., keys, :],
                                   causal=causal and key_start == start)
            out, lse = (o, l) if out is None else merge_partial_softmax(out, lse, o, l)
        outs.append(out)
    return torch.cat(outs, dim=-2)
    # END SOLUTION


# --- 2. the sequence layout -----------------------------------------------------------------


def zigzag_indices(seq_len, P):
    """The positions rank r holds under causal context parallelism, for every rank:
    a list of P lists. The sequence is cut into 2P equal chunks; rank r holds
    chunk r, then chunk 2P-1-r. Raises ``ValueError`` when 2P does not divide
    ``seq_len``.
    """
    # BEGIN SOLUTION: cut the sequence into 2P chunks and give rank r chunk r and its mirror
    if seq_len % (2 * P):
        raise ValueError(f"a sequence of {seq_len} positions does not divide into 2P = {2 * P} equal chunks")
    chunk = seq_len // (2 * P)
    return [list(range(r * chunk, (r + 1) * chunk)) + list(range((2 * P - 1 - r) * chunk, (2 * P - r) * chunk))
            for r in range(P)]
    # END SOLUTION


# --- 3. ring attention ----------------------------------------------------------------------


def _peer(group, rank):
    """The global rank of ``rank`` in ``group`` (point-to-point messages take global ranks)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def _start_shift(tensor, group):
    """Post sending ``tensor`` to the next rank and receiving the previous rank's:
    ``(buffer, requests)``; the buffer is ready once every request is waited for."""
    # BEGIN SOLUTION: post the send to the next rank and the receive from the previous one together, without blocking
    rank, P = dist.get_rank(group), dist.get_world_size(group)
    buffer = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, _peer(group, (rank + 1) % P), group),
           dist.P2POp(dist.irecv, buffer, _peer(group, (rank - 1) % P), group)]
    return buffer, dist.batch_isend_irecv(ops)
    # END SOLUTION


def _finish_shift(requests):
    for request in requests:
        request.wait()


def _chunks_of(rank, P, causal):
    """The global chunks a rank holds, in order: its own; zigzag's two under causal."""
    return [rank, 2 * P - 1 - rank] if causal else [rank]


def _attending_pairs(query_chunks, key_chunks, causal):
    """``(a, b, diagonal)`` for the query chunk ``a`` and key chunk ``b`` (positions in
    the lists) that see each other: all pairs, or under causal those with the key chunk
    at or before the query chunk (the same chunk: a causal diagonal block)."""
    # BEGIN SOLUTION: under causal, a key chunk after the query chunk is hidden, and the same chunk is a diagonal block
    for a, query in enumerate(query_chunks):
        for b, key in enumerate(key_chunks):
            if not causal or key < query:
                yield a, b, False
            elif key == query:
                yield a, b, True
    # END SOLUTION


def local_attention_backward(dout, q, k, v, lse, delta, causal=False):
    """``(dq, dk, dv)`` of one block, given the upstream ``dout`` of the *merged*
    output, that output's ``lse`` and ``delta = (dout * out).sum(-1)``: with
    ``p = exp(scores - lse)``, ``dv = p^T dout``, ``ds = p * (dout v^T - delta)``,
    ``dq = ds k / sqrt(d)``, ``dk = ds^T q / sqrt(d)``.
    """
    # BEGIN SOLUTION: recompute the block's probabilities from the merged lse, then follow the docstring
    scale = 1 / math.sqrt(q.shape[-1])
    scores = q @ k.transpose(-2, -1) * scale
    if causal:
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    p = torch.exp(scores - lse.unsqueeze(-1))
    ds = p * (dout @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ dout
    # END SOLUTION


class RingAttention(torch.autograd.Function):
    """Ring attention with a hand-written backward; call it through ``ring_attention``."""

    @staticmethod
    def forward(ctx, q, k, v, causal, group):
        # BEGIN SOLUTION: post the shift of the K/V block before attending to it, and wait for it after
        rank, P = dist.get_rank(group), dist.get_world_size(group)
        n = 2 if causal else 1
        queries = q.chunk(n, dim=-2)
        outs, lses = [None] * n, [None] * n
        block = torch.stack([k, v])
        for step in range(P):
            if step < P - 1:
                incoming, requests = _start_shift(block, group)
            keys, values = block[0].chunk(n, dim=-2), block[1].chunk(n, dim=-2)
            source = (rank - step) % P
            for a, b, diagonal in _attending_pairs(_chunks_of(rank, P, causal), _chunks_of(source, P, causal),
                                                   causal):
                o, l = local_attention(queries[a], keys[b], values[b], causal=diagonal)
                outs[a], lses[a] = (o, l) if outs[a] is None else merge_partial_softmax(outs[a], lses[a], o, l)
            if step < P - 1:
                _finish_shift(requests)
                block = incoming
        out, lse = torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.group = causal, group
        return out
        # END SOLUTION

    @staticmethod
    def backward(ctx, dout):
        # BEGIN SOLUTION: run the ring again, with a dK/dV buffer travelling beside each K/V block
        q, k, v, out, lse = ctx.saved_tensors
        causal, group = ctx.causal, ctx.group
        rank, P = dist.get_rank(group), dist.get_world_size(group)
        n = 2 if causal else 1
        delta = (dout * out).sum(-1)
        queries, douts = q.chunk(n, dim=-2), dout.chunk(n, dim=-2)
        lses, deltas = lse.chunk(n, dim=-1), delta.chunk(n, dim=-1)
        dq = torch.zeros_like(q)
        dqs = dq.chunk(n, dim=-2)  # views: adding to them adds to dq
        block = torch.stack([k, v])
        dblock = torch.zeros_like(block)
        for step in range(P):
            if step < P - 1:
                incoming, requests = _start_shift(block, group)
            keys, values = block[0].chunk(n, dim=-2), block[1].chunk(n, dim=-2)
            dkeys, dvalues = dblock[0].chunk(n, dim=-2), dblock[1].chunk(n, dim=-2)
            source = (rank - step) % P
            for a, b, diagonal in _attending_pairs(_chunks_of(rank, P, causal), _chunks_of(source, P, causal),
                                                   causal):
                dq_, dk_, dv_ = local_attention_backward(douts[a], queries[a], keys[b], values[b], lses[a],
                                                         deltas[a], causal=diagonal)
                dqs[a].add_(dq_)
                dkeys[b].add_(dk_)
                dvalues[b].add_(dv_)
            if step < P - 1:
                _finish_shift(requests)
                block = incoming
            if P > 1:  # the gradient of the block follows it; after P shifts it is home
                dblock, shift = _start_shift(dblock, group)
                _finish_shift(shift)
        return dq, dblock[0], dblock[1], None, None
        # END SOLUTION


def ring_attention(q, k, v, causal=False, group=None):
    """This rank's attention output ``[b, h, s/P, d]`` for its shard of the sequence
    (contiguous, or zigzag with ``causal``; see the module docstring), with
    gradients for q, k and v. Raises ``ValueError`` when, under ``causal``, the
    shard does not split into two equal chunks.
    """
    # BEGIN SOLUTION: check the shapes, then apply RingAttention
    if not q.shape == k.shape == v.shape:
        raise ValueError(f"q, k and v must have one shape; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if causal and q.shape[-2] % 2:
        P = dist.get_world_size(group)
        raise ValueError(f"under causal masking each rank holds 2 of the sequence's 2P = {2 * P} chunks, but this "
                         f"rank's shard of {q.shape[-2]} positions does not split in two")
    return RingAttention.apply(q, k, v, causal, group)
    # END SOLUTION


# --- 4. Ulysses ----------------------------------------------------------------------------


class AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` of equal splits along dim 0, with its gradient
    (the same all-to-all, applied to the upstream gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        # BEGIN SOLUTION: all-to-all into a new tensor of the same shape
        ctx.group = group
        x = x.contiguous()  # the collective writes and reads raw, row-major memory
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION: the gradient goes back the way the data came (mind its memory layout)
        grad = grad.contiguous()  # autograd's gradients are often strided views
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None
        # END SOLUTION


def ulysses_attention(q, k, v, causal=False, group=None):
    """This rank's output ``[b, h, s/P, d]`` for its contiguous sequence shard: one
    all-to-all turns the stacked q, k, v from sequence-sharded ``[b, h, s/P, d]``
    into head-sharded ``[b, h/P, s, d]``, each rank attends over the whole
    sequence for its heads, and a second all-to-all turns the output back.
    Raises ``ValueError`` when P does not divide the heads.
    """
    # BEGIN SOLUTION: move the head groups first so that part i goes to rank i, then put the received sequence parts in order
    P = dist.get_world_size(group)
    b, h, s, d = q.shape
    if h % P:
        raise ValueError(f"{h} heads do not divide among {P} ranks: Ulysses gives each rank h/P whole heads")
    qkv = torch.stack([q, k, v]).reshape(3, b, P, h // P, s, d).movedim(2, 0)  # [P, 3, b, h/P, s/P, d]
    qkv = AllToAll.apply(qkv.contiguous(), group)  # part i: sequence part i of my heads
    qkv = qkv.movedim(0, 3).reshape(3, b, h // P, P * s, d)
    out, _ = local_attention(qkv[0], qkv[1], qkv[2], causal=causal)
    out = out.reshape(b, h // P, P, s, d).movedim(2, 0)  # [P, b, h/P, s/P, d]: part i goes to rank i
    out = AllToAll.apply(out.contiguous(), group)  # part i: head group i of my sequence part
    return out.movedim(0, 1).reshape(b, h, s, d)
    # END SOLUTION


# --- 5. variable-length sequences ----------------------------------------------------------


def balance(seq_lens, P):
    """Place whole sequences on ``P`` ranks: a list of P lists of indexes into
    ``seq_lens``, each index exactly once. A sequence of length L attends
    causally within itself: L(L+1)/2 unmasked (query, key) pairs, its work.
    The busiest rank's work must be at most 4/3 of the best placement's
    (Graham's bound for placing the heaviest first on the least-loaded rank).
    """
    # BEGIN SOLUTION: place the heaviest sequences first, each on the least-loaded rank
    work = [length * (length + 1) // 2 for length in seq_lens]
    ranks, loads = [[] for _ in range(P)], [0] * P
    for index in sorted(range(len(work)), key=lambda i: -work[i]):
        lightest = min(range(P), key=lambda r: loads[r])
        ranks[lightest].append(index)
        loads[lightest] += work[index]
    return ranks
    # END SOLUTION
