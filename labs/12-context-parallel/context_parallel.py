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
    raise NotImplementedError("not implemented yet: local_attention: scale the scores, hide the upper triangle when causal, and keep each row's log-sum-exp")


def merge_partial_softmax(out_a, lse_a, out_b, lse_b):
    """``(out, lse)`` of attention over the keys of blocks a and b together, from
    each block's own ``(out, lse)``. Stable for log-sum-exps of any size (say
    ±1e4): never take ``exp`` of an ``lse`` itself.
    """
    raise NotImplementedError("not implemented yet: merge_partial_softmax: write block b's weight as a sigmoid of the difference of the two log-sum-exps")


def blockwise_attention(q, k, v, block, causal=False):
    """Attention of ``q`` over ``k``, ``v`` (all ``[..., s, d]``), equal to full
    attention, computed ``block`` queries by ``block`` keys at a time and merged
    with ``merge_partial_softmax``: no score matrix larger than a block is made.
    The last block may be shorter. With ``causal``, blocks above the diagonal
    are skipped. Raises ``ValueError`` when ``block < 1``.
    """
    raise NotImplementedError('not implemented yet: blockwise_attention: for each query block, merge the key blocks up to its own')


# --- 2. the sequence layout -----------------------------------------------------------------


def zigzag_indices(seq_len, P):
    """The positions rank r holds under causal context parallelism, for every rank:
    a list of P lists. The sequence is cut into 2P equal chunks; rank r holds
    chunk r, then chunk 2P-1-r. Raises ``ValueError`` when 2P does not divide
    ``seq_len``.
    """
    raise NotImplementedError('not implemented yet: zigzag_indices: cut the sequence into 2P chunks and give rank r chunk r and its mirror')


# --- 3. ring attention ----------------------------------------------------------------------


def _peer(group, rank):
    """The global rank of ``rank`` in ``group`` (point-to-point messages take global ranks)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def _start_shift(tensor, group):
    """Post sending ``tensor`` to the next rank and receiving the previous rank's:
    ``(buffer, requests)``; the buffer is ready once every request is waited for."""
    raise NotImplementedError('not implemented yet: _start_shift: post the send to the next rank and the receive from the previous one together, without blocking')


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
    raise NotImplementedError('not implemented yet: _attending_pairs: under causal, a key chunk after the query chunk is hidden, and the same chunk is a diagonal block')


def local_attention_backward(dout, q, k, v, lse, delta, causal=False):
    """``(dq, dk, dv)`` of one block, given the upstream ``dout`` of the *merged*
    output, that output's ``lse`` and ``delta = (dout * out).sum(-1)``: with
    ``p = exp(scores - lse)``, ``dv = p^T dout``, ``ds = p * (dout v^T - delta)``,
    ``dq = ds k / sqrt(d)``, ``dk = ds^T q / sqrt(d)``.
    """
    raise NotImplementedError("not implemented yet: local_attention_backward: recompute the block's probabilities from the merged lse, then follow the docstring")


class RingAttention(torch.autograd.Function):
    """Ring attention with a hand-written backward; call it through ``ring_attention``."""

    @staticmethod
    def forward(ctx, q, k, v, causal, group):
        raise NotImplementedError('not implemented yet: forward: post the shift of the K/V block before attending to it, and wait for it after')

    @staticmethod
    def backward(ctx, dout):
        raise NotImplementedError('not implemented yet: backward: run the ring again, with a dK/dV buffer travelling beside each K/V block')


def ring_attention(q, k, v, causal=False, group=None):
    """This rank's attention output ``[b, h, s/P, d]`` for its shard of the sequence
    (contiguous, or zigzag with ``causal``; see the module docstring), with
    gradients for q, k and v. Raises ``ValueError`` when, under ``causal``, the
    shard does not split into two equal chunks.
    """
    raise NotImplementedError('not implemented yet: ring_attention: check the shapes, then apply RingAttention')


# --- 4. Ulysses ----------------------------------------------------------------------------


class AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` of equal splits along dim 0, with its gradient
    (the same all-to-all, applied to the upstream gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError('not implemented yet: forward: all-to-all into a new tensor of the same shape')

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError('not implemented yet: backward: the gradient goes back the way the data came (mind its memory layout)')


def ulysses_attention(q, k, v, causal=False, group=None):
    """This rank's output ``[b, h, s/P, d]`` for its contiguous sequence shard: one
    all-to-all turns the stacked q, k, v from sequence-sharded ``[b, h, s/P, d]``
    into head-sharded ``[b, h/P, s, d]``, each rank attends over the whole
    sequence for its heads, and a second all-to-all turns the output back.
    Raises ``ValueError`` when P does not divide the heads.
    """
    raise NotImplementedError('not implemented yet: ulysses_attention: move the head groups first so that part i goes to rank i, then put the received sequence parts in order')


# --- 5. variable-length sequences ----------------------------------------------------------


def balance(seq_lens, P):
    """Place whole sequences on ``P`` ranks: a list of P lists of indexes into
    ``seq_lens``, each index exactly once. A sequence of length L attends
    causally within itself: L(L+1)/2 unmasked (query, key) pairs, its work.
    The busiest rank's work must be at most 4/3 of the best placement's
    (Graham's bound for placing the heaviest first on the least-loaded rank).
    """
    raise NotImplementedError('not implemented yet: balance: place the heaviest sequences first, each on the least-loaded rank')
