"""One roofline for every way of splitting training (lectures 08-13, lab 13's planner).

Each parallelism sends bytes while devices compute, and it is *compute-bound*
when the arithmetic of the phase that must hide a collective lasts at least as
long as the collective. The question is always which phase hides which
collective, so each function below names it:

- data parallelism, ZeRO-1 and ZeRO-2 (lecture 08): the gradients exist only
  as backward makes them, so backward (4Ψ flops a token) hides the gradient
  all-reduce;
- ZeRO-3 / FSDP (lecture 09): each microbatch's forward (2Ψ a token) hides one
  all-gather of the weights, its backward (4Ψ) an all-gather and a
  reduce-scatter: the same ratio as data parallelism's, so the same tokens
  per device, counted per microbatch;
- tensor parallelism (lecture 10): attention's forward projections hide the
  all-reduce that closes them, the tightest region of a layer;
- context parallelism (lecture 12): a ring step's attention hides the next
  K/V block's transfer.

Part 1 is the α-β time of the collectives (module 06); part 2 says how many
seconds a byte costs on a flat ring or on a hierarchical all-reduce across
nodes; part 3 has the thresholds. Pure arithmetic: no torch, no numpy.
"""

# --- 1. the collectives, α-β (module 06) -----------------------------------------------------------------


def ring_allreduce_s(nbytes, n, alpha, beta):
    """A ring all-reduce of ``nbytes`` over ``n`` devices: ``2(n - 1)(α + β·nbytes/n)`` seconds
    (a reduce-scatter, then an all-gather), 0 for one device."""
    return 2 * (n - 1) * (alpha + beta * nbytes / n) if n > 1 else 0.0


def reduce_scatter_s(nbytes, n, alpha, beta):
    """A ring reduce-scatter of ``nbytes`` over ``n`` devices: half of the all-reduce."""
    return ring_allreduce_s(nbytes, n, alpha, beta) / 2


def all_gather_s(nbytes, n, alpha, beta):
    """A ring all-gather of ``nbytes`` (the whole, gathered) over ``n`` devices: the other half."""
    return ring_allreduce_s(nbytes, n, alpha, beta) / 2


def hierarchical_allreduce_s(nbytes, per_node, nodes, inside, across, streamed=False):
    """An all-reduce of ``nbytes`` over ``nodes`` nodes of ``per_node`` devices, hierarchically:
    reduce-scatter inside each node, so each device holds 1/``per_node`` of the sum; all-reduce
    that 1/``per_node`` across the nodes, each device over its own network card; all-gather
    inside the node. ``inside`` and ``across`` are ``(α, β)`` of the two kinds of link.

    One buffer alone takes the three phases one after another (``streamed=False``). A step's
    many buckets (or FSDP's layers) are *streamed*: while one bucket crosses the nodes the next
    is reduce-scattered inside them, so the links work at once and the busier one sets the
    pace: the larger of the node-internal phases and the cross-node phase (``streamed=True``)."""
    inside_s = reduce_scatter_s(nbytes, per_node, *inside) + all_gather_s(nbytes, per_node, *inside)
    across_s = ring_allreduce_s(nbytes / per_node, nodes, *across)
    return max(inside_s, across_s) if streamed else inside_s + across_s


# --- 2. seconds per byte all-reduced, bandwidth terms only (α = 0) ------------------------------------------
# The thresholds compare bandwidth terms: a step's buckets are large, their latencies small next to them.


def flat_ring(bandwidth, devices=None):
    """Seconds per byte all-reduced by one ring over ``devices`` devices, each sending over a link
    of ``bandwidth`` bytes/s one way: ``2(d - 1)/d / W``; ``devices=None`` is the large ring, 2/W.
    Across nodes a flat ring sends every byte through each GPU's own network card (the naive
    case of lectures 06 and 08)."""
    if devices is None:
        return 2 / bandwidth
    return ring_allreduce_s(1.0, devices, 0.0, 1 / bandwidth)


def hierarchical(inside, card, per_node, nodes=None):
    """Seconds per byte all-reduced hierarchically (``hierarchical_allreduce_s``, streamed) over
    nodes of ``per_node`` devices, ``inside`` bytes/s per device inside a node (NVLink), ``card``
    bytes/s per device across (its own network card); ``nodes=None`` is the large ring. Each card
    carries 1/``per_node`` of the bytes, so the node moves them at ``per_node`` times one card's
    bandwidth, unless the node-internal phases are the busier link."""
    if nodes is None:
        return max(2 * (per_node - 1) / per_node / inside, 2 / (per_node * card))
    return hierarchical_allreduce_s(1.0, per_node, nodes, (0.0, 1 / inside), (0.0, 1 / card), streamed=True)


# --- 3. the thresholds -------------------------------------------------------------------------------------


def dp_tokens(flops, allreduce_s_per_byte, bytes_per_number=2):
    """Tokens per device per step above which data parallelism (and ZeRO-1, ZeRO-2) is compute-bound.

    Phase: **backward hides the gradient all-reduce** (lecture 08, section 5). A device's backward
    on t tokens is 4Ψt flops, 4Ψt/C seconds; the gradients are Ψw bytes, all-reduced in
    Ψw·``allreduce_s_per_byte`` seconds (``flat_ring`` or ``hierarchical``). Ψ cancels:
    t ≥ w·C·s/4, which is C/W in 16-bit on a large flat ring (s = 2/W). ZeRO-1 and ZeRO-2 send the
    same bytes, a reduce-scatter and an all-gather, so they share the threshold. With gradient
    accumulation the all-reduce runs in the last microbatch's backward, which alone must hold
    these tokens to hide it completely."""
    return bytes_per_number * flops * allreduce_s_per_byte / 4


def zero3_tokens(flops, allreduce_s_per_byte, bytes_per_number=2):
    """Tokens per device *per microbatch* above which ZeRO-3 (FSDP) is compute-bound.

    Phases (lecture 09): **each microbatch's forward hides one all-gather of the weights**, 2Ψt/C
    seconds of arithmetic against half an all-reduce of Ψw bytes, and **its backward an all-gather
    and a reduce-scatter**, 4Ψt/C against a whole all-reduce's bytes. Both ratios are data
    parallelism's, so the threshold is ``dp_tokens``'s. What ZeRO-3 adds is that the gathers
    come back for every microbatch: the tokens count per microbatch, not per step."""
    forward = bytes_per_number * flops * (allreduce_s_per_byte / 2) / 2
    backward = bytes_per_number * flops * allreduce_s_per_byte / 4
    return max(forward, backward)


def tp_widest(h, ffn, flops, bandwidth, bytes_per_number=2):
    """The widest tensor-parallel size t (a real number) at which each region of a layer's forward
    still computes at least as long as the ring all-reduce that closes it (lecture 10).

    Phases: **attention's forward projections hide g's all-reduce** (8·T·h²/t flops against
    2(t - 1)/t·T·h·w bytes): t - 1 ≤ 4hW/(wC), 2hW/C in 16-bit; **the MLP's forward hides its
    all-reduce**: t - 1 ≤ 2FW/(wC). The tokens T cancel. The layer is compute-bound up to the
    smaller, attention's when F > 2h; backward has twice the arithmetic for the same bytes."""
    per_byte = bandwidth / (bytes_per_number * flops)
    return {"attention": 1 + 4 * h * per_byte, "mlp": 1 + 2 * ffn * per_byte}


def cp_ring_shard(flops, bandwidth, bytes_per_number=2, work=1.0, sent=1):
    """The shard length s/P (tokens per device) above which ring attention is compute-bound.

    Phase (lecture 12, Problem 1): **a ring step's attention hides the next K/V block's
    transfer**: 4·b·h·(s/P)²·d flops (times ``work``: 1/2 for a causal zigzag step, 2.5 in
    backward) against 2·b·h·(s/P)·d numbers of w bytes (times ``sent``: 2 in backward, K/V and
    dK/dV). All but one factor of s/P cancels: s/P ≥ (w/2)·(C/W)·sent/work, C/W in 16-bit."""
    return bytes_per_number / 2 * flops / bandwidth * sent / work
