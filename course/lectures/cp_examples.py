"""What lecture 12 runs: attention over a sequence split among ranks, small.

Two halves. The first is plain NumPy and torch on one process: the softmax
average of one block of scores with its log-sum-exp, the merge of two blocks'
results, the online softmax over blocks of scores, the two sequence layouts
and their causal work per rank, a transformer block whose attention never
stores its score matrix (for the memory measurements), attention's backward
one block of keys at a time against torch's autograd, and the backward ring
simulated rank by rank in one process. The second runs on the
ranks of ``course.dist.run`` (each rank is a new Python process, so it lives
in a module, not in the notebook): the *communication patterns* of context
parallelism shown on other computations — a ring that passes blocks of points
around to sum a kernel over all pairs, and an all-to-all that swaps a sequence
shard for a channel shard to run a prefix sum — plus the all-gather-KV
variant of context-parallel attention, and ``experiments()``, which runs every
distributed measurement of the lecture for one world size in one job.

Attention tensors are ``[batch, heads, seq, head_dim]`` = ``[b, h, s, d]``,
torch's ``scaled_dot_product_attention`` layout, and scores are
``q kᵀ / √d``. The lab (``labs/12-context-parallel``) asks for the attention
versions of the ring and of Ulysses, with causal masks, the zigzag layout, a
hand-written backward and gradients through the all-to-alls.
"""
import math
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course.models import GPTBlock
from course.timing import measure
from course.torch_audit import OpLog, SavedActivations

# --- 1. one block of scores, and the merge (NumPy) --------------------------------------------------


def softmax_average(scores, values):
    """``(out, lse)`` for one block: the rows of ``values`` ``[..., n, e]`` averaged
    with weights softmax(``scores`` ``[..., r, n]``) over the last axis, and each
    row's log-sum-exp of its scores. The row maximum is taken out before ``exp``,
    so no score overflows."""
    top = scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores - top)
    total = weights.sum(axis=-1, keepdims=True)
    return (weights @ values) / total, (top + np.log(total))[..., 0]


def merge(out_a, lse_a, out_b, lse_b):
    """Two blocks' ``(out, lse)`` -> the result over both blocks' columns. The merged
    lse comes first, by ``logaddexp`` (stable); each block then weighs
    exp(its lse - the merged lse), a number in [0, 1]."""
    lse = np.logaddexp(lse_a, lse_b)
    return np.exp(lse_a - lse)[..., None] * out_a + np.exp(lse_b - lse)[..., None] * out_b, lse


def naive_merge(out_a, lse_a, out_b, lse_b):
    """The same merge written with the softmax denominators themselves, exp(lse)."""
    with np.errstate(over="ignore", invalid="ignore"):
        z_a, z_b = np.exp(lse_a), np.exp(lse_b)
        out = (z_a[..., None] * out_a + z_b[..., None] * out_b) / (z_a + z_b)[..., None]
        return out, np.log(z_a + z_b)


def online_softmax_average(scores, values, block, merge_fn=merge):
    """``softmax_average`` of all the columns of ``scores``, taking ``block`` columns
    (and the matching rows of ``values``) at a time: no more than ``block``
    columns of weights ever exist at once."""
    out = lse = None
    for start in range(0, scores.shape[-1], block):
        part = softmax_average(scores[..., start:start + block], values[..., start:start + block, :])
        out, lse = part if out is None else merge_fn(out, lse, *part)
    return out, lse


# --- 2. where the positions live ------------------------------------------------------------------


def owners(s, P, layout):
    """``owner[i]``: the rank holding position ``i``. ``contiguous``: P equal
    slices in order. ``zigzag``: 2P equal chunks, chunk c on rank min(c, 2P-1-c),
    so rank r holds chunks r and 2P-1-r."""
    if layout == "contiguous":
        return np.arange(s) * P // s
    chunk = np.arange(s) * 2 * P // s
    return np.minimum(chunk, 2 * P - 1 - chunk)


def causal_pairs(owner, P):
    """Unmasked causal (query, key) pairs per rank: the queries' rank does the work,
    and query i sees keys 0 .. i, i + 1 of them."""
    return np.bincount(owner, weights=np.arange(len(owner)) + 1, minlength=P).astype(int)


def ring_step_pairs(owner, P):
    """``table[r, t]``: the causal pairs rank r computes at ring step t, when it
    holds the K/V block of rank (r - t) mod P."""
    visible = np.tril(np.ones((len(owner), len(owner)), dtype=bool))   # key j visible to query i iff j <= i
    table = np.zeros((P, P), dtype=int)
    for r in range(P):
        for t in range(P):
            table[r, t] = visible[np.ix_(owner == r, owner == (r - t) % P)].sum()
    return table


def draw_causal_layout(owner, P, ax, title):
    """The s x s causal mask (queries down, keys across), each unmasked cell in the
    colour of the rank that computes it (its query's rank); masked cells white."""
    from matplotlib.colors import ListedColormap

    from course.diagrams import BLOCK_COLOURS

    s = len(owner)
    grid = np.where(np.tril(np.ones((s, s), dtype=bool)), owner[:, None], np.nan).astype(float)
    ax.imshow(grid, cmap=ListedColormap(BLOCK_COLOURS[:P]), vmin=-0.5, vmax=P - 0.5, interpolation="nearest")
    for edge in np.flatnonzero(np.diff(owner)) + 0.5:   # where one rank's rows end and the next's begin
        ax.axhline(edge, color="k", lw=0.6)
        ax.axvline(edge, color="k", lw=0.3, ls=":")
    ax.set_xlabel("key position j")
    ax.set_ylabel("query position i")
    ax.set_title(title, fontsize=9)
    return ax


# --- 3. a transformer block whose attention keeps no score matrix ----------------------------------


class BlockwiseGPTBlock(GPTBlock):
    """``course.models.GPTBlock`` (same weights, same layout) with its attention
    done by ``F.scaled_dot_product_attention``: on the CPU that is a
    flash-attention kernel, which saves only q, k, v, the output and each row's
    log-sum-exp for backward, never the s x s probabilities. No dropout."""

    def forward(self, x):
        b, s, h = x.shape
        a, d = self.heads, h // self.heads
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, a, d).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def saved_bytes(module, x):
    """Bytes of the distinct storages autograd saves for backward while ``module(x)``
    runs, leaving out the module's parameters and buffers (lecture 07's tool)."""
    with SavedActivations(exclude=[*module.parameters(), *module.buffers()]) as saved:
        module(x)
    return saved.nbytes


# --- 4. attention's backward, one block of keys at a time, and its ring (NumPy, one process) ---------


def autograd_attention(q, k, v, dout, visible=None):
    """What torch's autograd finds for attention written out step by step, in float64:
    ``out``, each row's ``lse``, and the gradient of the loss ``(out * dout).sum()``
    with respect to the ``scores`` q·kᵀ/√d, the ``probs`` softmax(scores) and
    ``q``, ``k``, ``v``. ``visible[i, j]`` False hides key j from query i (every
    query must see a key). NumPy arrays ``[..., s, d]`` in, NumPy arrays out: the
    reference the lecture's formulas are checked against."""
    q, k, v = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    logits = torch.einsum("...id,...jd->...ij", q, k) / math.sqrt(q.shape[-1])
    if visible is not None:
        logits = logits.masked_fill(~torch.as_tensor(visible), float("-inf"))
    weights = torch.softmax(logits, dim=-1)
    for t in (logits, weights):
        t.retain_grad()
    out = weights @ v
    out.backward(torch.as_tensor(dout))
    found = {"out": out, "lse": torch.logsumexp(logits, dim=-1), "scores": logits.grad, "probs": weights.grad,
             "q": q.grad, "k": k.grad, "v": v.grad}
    return {name: t.detach().numpy() for name, t in found.items()}


def block_gradients(q, k, v, dout, lse, row_term, visible=None):
    """One (query block, key block) pair's share of attention's gradients: ``(dq, dk,
    dv)``. ``lse`` and ``row_term`` are the queries' *whole-row* log-sum-exp and
    D = rowsum(dout ∘ out), which the forward and the queries' own output give: the
    block recomputes its probabilities exp(scores - lse) from them and needs
    nothing from any other key block. Hidden pairs (``visible`` False) have
    probability 0."""
    scale = 1 / math.sqrt(q.shape[-1])
    logits = np.einsum("...id,...jd->...ij", q, k) * scale
    if visible is not None:
        logits = np.where(visible, logits, -np.inf)
    probs = np.exp(logits - lse[..., None])
    dlogits = probs * (np.einsum("...id,...jd->...ij", dout, v) - row_term[..., None])
    return (np.einsum("...ij,...jd->...id", dlogits, k) * scale, np.einsum("...ij,...id->...jd", dlogits, q) * scale,
            np.einsum("...ij,...id->...jd", probs, dout))


def ring_backward(q, k, v, out, lse, dout, owner, causal=False, keep_home=False):
    """Ring attention's backward, its P ranks simulated in one process: rank r holds
    the positions where ``owner == r`` (``owners`` above) of q, k, v and of what its
    forward left, ``out``, ``lse`` and the upstream ``dout``. Rank r first forms
    D = rowsum(dout ∘ out) of its rows. At each of P steps every rank takes the K/V
    block it holds through ``block_gradients``, adds dq to its own rows, and dk, dv
    to the accumulator that travels beside the block. Then the K/V blocks move on
    to rank r+1 (not after the last step: none is needed any more) and so do the
    accumulators, after every step: after P moves each is at its home rank.
    ``keep_home``: a rank keeps what it computes for its own block at step 0 and
    the accumulators start at step 1, one move fewer.

    Returns the gradients at global positions (``dq``, ``dk``, ``dv``), the block
    each rank holds at each step (``kv_at``, ``grad_at``: ``[rank, step]``, -1
    where it holds none) and the elements each rank sent (``sent``, per kind)."""
    P = int(owner.max()) + 1
    rows = [np.flatnonzero(owner == r) for r in range(P)]
    row_term = np.sum(dout * out, axis=-1)                       # D, of each rank's own rows
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    kv = [(r, k[..., rows[r], :], v[..., rows[r], :]) for r in range(P)]   # what rank r holds
    grads = [None] * P                                                      # and beside it
    kv_at, grad_at = np.full((P, P), -1), np.full((P, P), -1)
    sent = {"K/V": np.zeros(P, dtype=int), "dK/dV": np.zeros(P, dtype=int)}
    first = 1 if keep_home and P > 1 else 0
    for step in range(P):
        if step == first:
            grads = [(j, np.zeros_like(K), np.zeros_like(V)) for j, K, V in kv]
        for r, (j, K, V) in enumerate(kv):
            visible = rows[r][:, None] >= rows[j][None, :] if causal else None
            dq_part, dk_part, dv_part = block_gradients(q[..., rows[r], :], K, V, dout[..., rows[r], :],
                                                        lse[..., rows[r]], row_term[..., rows[r]], visible)
            dq[..., rows[r], :] += dq_part
            kv_at[r, step] = j
            if step < first:                 # my own block, kept at home
                dk[..., rows[r], :] += dk_part
                dv[..., rows[r], :] += dv_part
            else:
                grad_at[r, step] = grads[r][0]
                grads[r][1][...] += dk_part
                grads[r][2][...] += dv_part
        if step < P - 1:
            for r, (_, K, V) in enumerate(kv):
                sent["K/V"][r] += K.size + V.size
            kv = [kv[(r - 1) % P] for r in range(P)]        # rank r receives rank r-1's
        if step >= first and P > 1:
            for r, (_, gk, gv) in enumerate(grads):
                sent["dK/dV"][r] += gk.size + gv.size
            grads = [grads[(r - 1) % P] for r in range(P)]
    for r, (j, gk, gv) in enumerate(grads):
        if j != r:
            raise RuntimeError(f"rank {r} ended with the gradients of block {j}, not its own")
        dk[..., rows[r], :] += gk
        dv[..., rows[r], :] += gv
    return {"dq": dq, "dk": dk, "dv": dv, "kv_at": kv_at, "grad_at": grad_at, "sent": sent}


def draw_backward_ring(found, ax, title):
    """The schedule ``ring_backward`` ran, from its record: a column per step and one
    for the move home, a row per rank; each cell names the K/V block the rank
    holds and whether its dK/dV accumulator is beside it."""
    from matplotlib.colors import ListedColormap

    from course.diagrams import BLOCK_COLOURS

    kv_at, grad_at = found["kv_at"], found["grad_at"]
    P = len(kv_at)
    home = np.arange(P)[:, None]                                   # after the last move: each block at home
    blocks = np.hstack([np.where(kv_at >= 0, kv_at, grad_at), home]).astype(float)
    ax.imshow(blocks, cmap=ListedColormap(BLOCK_COLOURS[:P]), vmin=-0.5, vmax=P - 0.5, alpha=0.55)
    for r in range(P):
        for t in range(P + 1):
            if t < P:
                text = f"K,V {kv_at[r, t]}" + (f"\ndK,dV {grad_at[r, t]}" if grad_at[r, t] >= 0 else "\n(kept home)")
            else:
                text = f"dK,dV {r}\nhome"
            ax.text(t, r, text, ha="center", va="center", fontsize=7)
    for t in range(P):                         # each move: rank r to rank r+1 (the wrap from the last rank not drawn)
        for r in range(P - 1):
            ax.annotate("", xy=(t + 0.62, r + 0.62), xytext=(t + 0.38, r + 0.38),
                        arrowprops={"arrowstyle": "->", "lw": 0.8, "ls": "--" if t == P - 1 else "-"})
    ax.set_xticks(range(P + 1), [f"step {t}" for t in range(P)] + ["after the\nlast move"], fontsize=7)
    ax.set_yticks(range(P), [f"rank {r}" for r in range(P)], fontsize=7)
    ax.set_xlabel("arrows: what a rank holds moves to the next rank; after the last step only dK, dV (dashed)",
                  fontsize=7)
    ax.set_title(title, fontsize=9)
    return ax


# --- 5. the ring, on another computation: a kernel summed over all pairs of points -------------------


def gaussian_kernel_sums(x, y):
    """For each row of ``x`` ``[n, d]``: the sum over the rows of ``y`` of exp(-|x - y|² / 2)."""
    return torch.exp(-0.5 * torch.cdist(x, y) ** 2).sum(dim=1)


def ring_kernel_sums(points):
    """This rank's kernel sums over *all* ranks' points, though it holds only its own
    ``[n/P, d]``. P rounds: add the sums against the block it holds, then hand the
    block to rank r+1 and take rank r-1's. The hand-over of the next block is
    started before the current one is used, so the two can overlap; no rank ever
    holds more than two blocks."""
    rank, P = dist.get_rank(), dist.get_world_size()
    visiting, sums = points, torch.zeros(len(points), dtype=points.dtype)
    for hop in range(P):
        if hop < P - 1:
            arriving = torch.empty_like(visiting)
            sending = dist.isend(visiting, dst=(rank + 1) % P)
            receiving = dist.irecv(arriving, src=(rank - 1) % P)
        sums += gaussian_kernel_sums(points, visiting)   # work on what is here while the next block travels
        if hop < P - 1:
            sending.wait()
            receiving.wait()
            visiting = arriving
    return sums


# --- 6. the all-to-all, on another computation: a prefix sum along a sharded sequence ---------------


def reshard(x, cut):
    """The all-to-all as a re-sharding: cut ``x`` into P parts along dim ``cut``, part j
    to rank j, and join what arrives along the other dim, in rank order. On this
    rank's ``[s/P, c]`` rows of a sequence, ``cut=1`` gives the whole sequence of
    its c/P channels, ``[s, c/P]``; ``cut=0`` on that gives the rows back."""
    outgoing = [part.contiguous() for part in x.chunk(dist.get_world_size(), dim=cut)]
    incoming = [torch.empty_like(part) for part in outgoing]   # every part has one shape
    dist.all_to_all(incoming, outgoing)
    return torch.cat(incoming, dim=1 - cut)


def channel_sharded_cumsum(x):
    """The running sum along the sequence of this rank's rows ``[s/P, c]``, as if one
    process held the whole sequence: re-shard to whole sequences of c/P channels,
    sum locally, re-shard back. Channels that do not divide among the ranks raise
    ``ValueError``."""
    P = dist.get_world_size()
    if x.shape[1] % P:
        raise ValueError(f"{x.shape[1]} channels do not split among {P} ranks")
    return reshard(torch.cumsum(reshard(x, cut=1), dim=0), cut=0)


# --- 7. context-parallel attention by all-gathering K and V ----------------------------------------


def all_gather_kv_attention(q, k, v):
    """This rank's output for its contiguous shard ``[b, h, s/P, d]`` (no mask, forward
    only): gather every rank's K and V into the whole ``[b, h, s, d]`` (one
    all-gather of the two stacked), then attend locally with torch's own kernel.
    Simple, and one collective, but every rank holds all of K and V."""
    P = dist.get_world_size()
    mine = torch.stack([k, v])                                       # [2, b, h, s/P, d]
    gathered = torch.empty((P * 2, *mine.shape[1:]), dtype=mine.dtype)
    dist.all_gather_into_tensor(gathered, mine)                      # rank j's K, V at rows 2j, 2j + 1
    whole = torch.cat(gathered.view(P, *mine.shape).unbind(0), dim=-2)   # [2, b, h, s, d], positions in order
    return F.scaled_dot_product_attention(q, whole[0], whole[1])


# --- 8. the lecture's distributed measurements, one job per world size --------------------------------


def random_qkv(shape, dtype=torch.float64, seed=0):
    """The same global q, k, v on every rank (a seeded generator)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=dtype) for _ in range(3)]


def my_shard(x, dim=-2):
    rank, P = dist.get_rank(), dist.get_world_size()
    return x.chunk(P, dim=dim)[rank].contiguous()


def warm_up_links():
    """Gloo opens a connection at the first message between two ranks, and the
    first collective of each kind is slow too: run each once before anything is measured."""
    rank, P = dist.get_rank(), dist.get_world_size()
    token, back = torch.zeros(P), torch.empty(P)
    sending = dist.isend(token, dst=(rank + 1) % P)
    dist.recv(back, src=(rank - 1) % P)
    sending.wait()
    dist.all_to_all(list(torch.zeros(P, 1).unbind(0)), list(token.reshape(P, 1).unbind(0)))
    dist.all_gather_into_tensor(torch.empty(P * P), token)


def slowest_rank_times(fn, repeats):
    """Seconds of ``fn`` on the slowest rank, each run started together at a barrier."""
    runs = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        runs.append(float(elapsed))
    return runs


POINTS = (48, 3)                 # n, d of the ring's kernel sums (float64)
SEQ = (16, 12)                   # s, c of the re-sharded prefix sum (float64)
CHANNELS = (1, 2, 3, 4, 6, 8)    # channel counts to try, s unchanged
SHAPE = (2, 4, 16, 8)            # b, h, s, d of the all-gather-KV attention (float64)
TIME_SHAPE = (1, 8, 1024, 32)    # b, h, s, d of the timings (float32)


def experiments(repeats=5):
    """On every rank: each pattern's largest error against one process (float64), the
    communication it ran (``OpLog``: element counts of each send, receive,
    all-to-all and all-gather), which channel counts the all-to-all accepts, and
    float32 timings: all-gather-KV attention, and one ring step's two halves —
    the attention of one block pair, and the shift of one K/V block."""
    rank, P = dist.get_rank(), dist.get_world_size()
    warm_up_links()
    result = {"error": {}, "comm": {}, "channels": {}, "time": {}}
    points = random_qkv(POINTS)[0]
    sequence = random_qkv(SEQ)[0]
    q, k, v = random_qkv(SHAPE)
    runs = {"ring": (lambda: ring_kernel_sums(my_shard(points, 0)),
                     lambda: my_shard(gaussian_kernel_sums(points, points), 0)),
            "all-to-all": (lambda: channel_sharded_cumsum(my_shard(sequence, 0)),
                           lambda: my_shard(torch.cumsum(sequence, dim=0), 0)),
            "all-gather": (lambda: all_gather_kv_attention(my_shard(q), my_shard(k), my_shard(v)),
                           lambda: my_shard(F.scaled_dot_product_attention(q, k, v)))}
    for name, (distributed, one_process) in runs.items():
        with OpLog() as log, log.phase(name):
            out = distributed()
        result["error"][name] = float((out - one_process()).abs().max())
        result["comm"][name] = {kind: log.elements(kind, name) for kind in ("send", "recv", "all_to_all", "all_gather")}

    for c in CHANNELS:   # the same sequence length, other channel counts
        seq_c = random_qkv((SEQ[0], c), seed=c)[0]
        try:
            out = channel_sharded_cumsum(my_shard(seq_c, 0))
            result["channels"][c] = float((out - my_shard(torch.cumsum(seq_c, dim=0), 0)).abs().max())
        except ValueError as error:
            result["channels"][c] = str(error)

    q, k, v = random_qkv(TIME_SHAPE, dtype=torch.float32)
    if rank == 0:   # one process, the whole sequence, the same kernel; the others wait
        result["time"]["one process"] = measure(lambda: F.scaled_dot_product_attention(q, k, v),
                                                repeat=repeats).runs
    dist.barrier()
    mine = [my_shard(t) for t in (q, k, v)]
    all_gather_kv_attention(*mine)   # warm-up
    result["time"]["all-gather"] = slowest_rank_times(lambda: all_gather_kv_attention(*mine), repeats)
    # One ring step, its two halves apart: attention of my queries on one K/V block, and the shift of a block.
    block = torch.stack(mine[1:])
    result["time"]["step compute"] = measure(lambda: F.scaled_dot_product_attention(*mine), repeat=repeats).runs

    def shift():
        arriving = torch.empty_like(block)
        sending = dist.isend(block, dst=(rank + 1) % P)
        dist.recv(arriving, src=(rank - 1) % P)
        sending.wait()
    shift()
    result["time"]["step transfer"] = slowest_rank_times(shift, repeats)
    result["time"]["block bytes"] = block.numel() * block.element_size()
    return result
