"""What lecture 12 runs: attention over a sequence split among ranks, small.

Two halves. The first is plain torch on one process: attention of one block
of keys with its log-sum-exp, the merge of two blocks' results, blockwise
attention over key blocks, the two sequence layouts and their causal work
per rank, and a transformer block whose attention never stores its score
matrix (for the memory measurements). The second runs on the ranks of
``course.dist.run`` (each rank is a new Python process, so it lives in a
module, not in the notebook): ring attention and Ulysses attention, forward
only and without a causal mask, and ``experiments()``, which runs every
distributed measurement of the lecture for one world size in one job.

Tensors are ``[batch, heads, seq, head_dim]`` = ``[b, h, s, d]``, torch's
``scaled_dot_product_attention`` layout, and scores are ``q kᵀ / √d``. The
lab (``labs/12-context-parallel``) asks for the full versions: causal masks,
the zigzag ring, a hand-written backward, gradients through Ulysses.
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

# --- 1. one block of keys, and the merge ----------------------------------------------------------


def block_attention(q, k, v):
    """``(out, lse)``: attention of ``q`` over one block of keys ``k``, ``v`` and the
    log-sum-exp of each query's scores over that block (``[b, h, s_q]``)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(scores, dim=-1)   # torch subtracts the row's max inside: no overflow
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def merge(out_a, lse_a, out_b, lse_b):
    """Two blocks' ``(out, lse)`` -> the result over both blocks' keys, in the
    sigmoid form: only *differences* of log-sum-exps are exponentiated."""
    out = (out_a * torch.sigmoid(lse_a - lse_b).unsqueeze(-1)
           + out_b * torch.sigmoid(lse_b - lse_a).unsqueeze(-1))
    return out, lse_a - F.logsigmoid(lse_a - lse_b)


def naive_merge(out_a, lse_a, out_b, lse_b):
    """The same merge written with the softmax denominators themselves, exp(lse)."""
    z_a, z_b = torch.exp(lse_a), torch.exp(lse_b)
    out = (z_a.unsqueeze(-1) * out_a + z_b.unsqueeze(-1) * out_b) / (z_a + z_b).unsqueeze(-1)
    return out, torch.log(z_a + z_b)


def blockwise_attention(q, k, v, block, merge_fn=merge):
    """Attention of all of ``q`` over ``k``, ``v``, taking ``block`` keys at a time
    (online softmax): no score matrix wider than ``block`` keys ever exists."""
    out = lse = None
    for start in range(0, k.shape[-2], block):
        o, l = block_attention(q, k[..., start:start + block, :], v[..., start:start + block, :])
        out, lse = (o, l) if out is None else merge_fn(out, lse, o, l)
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


def ring_attention(q, k, v):
    """This rank's output for its contiguous shard ``[b, h, s/P, d]`` (no mask,
    forward only). P steps: attend to the K/V block held, merge, pass the block
    on to rank r+1 and take rank r-1's. The next transfer is posted before the
    current block is computed, so that the two can overlap."""
    rank, P = dist.get_rank(), dist.get_world_size()
    kv = torch.stack([k, v])   # one message per step instead of two
    out = lse = None
    for step in range(P):
        if step < P - 1:
            incoming = torch.empty_like(kv)
            requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (rank + 1) % P),
                                               dist.P2POp(dist.irecv, incoming, (rank - 1) % P)])
        o, l = block_attention(q, kv[0], kv[1])
        out, lse = (o, l) if out is None else merge(out, lse, o, l)
        if step < P - 1:
            for request in requests:
                request.wait()
            kv = incoming
    return out


def all_to_all(x):
    """Part i of ``x`` (along dim 0) goes to rank i; part j of the result came from rank j."""
    x = x.contiguous()   # the collective reads and writes raw row-major memory
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x)
    return out


def ulysses_attention(q, k, v):
    """This rank's output for its contiguous shard ``[b, h, s/P, d]`` (no mask,
    forward only). One all-to-all trades the sequence shard of all heads for the
    whole sequence of h/P heads; attention runs locally; a second all-to-all
    trades back."""
    P = dist.get_world_size()
    b, h, s_local, d = q.shape
    if h % P:
        raise ValueError(f"{h} heads do not split among {P} ranks")
    qkv = torch.stack([q, k, v]).reshape(3, b, P, h // P, s_local, d).movedim(2, 0)   # [P, 3, b, h/P, s/P, d]
    qkv = all_to_all(qkv).movedim(0, 3).reshape(3, b, h // P, P * s_local, d)         # my heads, all positions
    out, _ = block_attention(qkv[0], qkv[1], qkv[2])
    out = all_to_all(out.reshape(b, h // P, P, s_local, d).movedim(2, 0))             # [P, b, h/P, s/P, d]
    return out.movedim(0, 1).reshape(b, h, s_local, d)


# --- 5. the lecture's distributed measurements, one job per world size --------------------------------


def random_qkv(shape, dtype=torch.float64, seed=0):
    """The same global q, k, v on every rank (a seeded generator)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=dtype) for _ in range(3)]


def my_shard(x):
    rank, P = dist.get_rank(), dist.get_world_size()
    return x.chunk(P, dim=-2)[rank].contiguous()


def warm_up_links():
    """Gloo opens a connection at the first message between two ranks, and the
    first all-to-all is slow too: run each once before anything is measured."""
    rank, P = dist.get_rank(), dist.get_world_size()
    token = torch.zeros(P)
    requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, token[:1], (rank + 1) % P),
                                       dist.P2POp(dist.irecv, torch.empty(1), (rank - 1) % P)])
    for request in requests:
        request.wait()
    all_to_all(token)


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


METHODS = {"ring": ring_attention, "ulysses": ulysses_attention}
SHAPE = (2, 4, 16, 8)            # b, h, s, d of the exactness and volume runs (float64)
HEADS = (1, 2, 3, 4, 6, 8)       # head counts to try, the rest of SHAPE unchanged
TIME_SHAPE = (1, 8, 1024, 32)    # b, h, s, d of the timings (float32)


def experiments(shape=SHAPE, heads=HEADS, time_shape=TIME_SHAPE, repeats=5):
    """On every rank: each method's largest error against full attention (float64),
    the communication it ran (``OpLog``: element counts of each send, receive and
    all-to-all), which head counts each accepts, and float32 timings."""
    rank, P = dist.get_rank(), dist.get_world_size()
    warm_up_links()
    q, k, v = random_qkv(shape)
    full = F.scaled_dot_product_attention(q, k, v)   # torch's own attention: the oracle
    result = {"error": {}, "comm": {}, "heads": {}, "time": {}}
    for name, method in METHODS.items():
        with OpLog() as log, log.phase(name):
            out = method(my_shard(q), my_shard(k), my_shard(v))
        result["error"][name] = float((out - my_shard(full)).abs().max())
        result["comm"][name] = {kind: log.elements(kind, name) for kind in ("send", "recv", "all_to_all")}

    for h in heads:   # the same sequence, other head counts
        qh, kh, vh = random_qkv((shape[0], h, *shape[2:]), seed=h)
        full_h = my_shard(F.scaled_dot_product_attention(qh, kh, vh))
        for name, method in METHODS.items():
            try:
                out = method(my_shard(qh), my_shard(kh), my_shard(vh))
                result["heads"][name, h] = float((out - full_h).abs().max())
            except ValueError as error:
                result["heads"][name, h] = str(error)

    q, k, v = random_qkv(time_shape, dtype=torch.float32)
    if rank == 0:   # one process, the whole sequence, the same kernel; the others wait
        result["time"]["one process"] = measure(lambda: block_attention(q, k, v), repeat=repeats).runs
    dist.barrier()
    mine = [my_shard(t) for t in (q, k, v)]
    for name, method in METHODS.items():
        method(*mine)   # warm-up
        result["time"][name] = slowest_rank_times(lambda: method(*mine), repeats)
    return result
