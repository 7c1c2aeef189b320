"""What lecture 10 runs on every rank: Megatron-style tensor and sequence parallelism, small.

Each rank is a new process (``course.dist.run``), so these functions live in a
module the ranks can import. Everything is float64 and tiny, so a parallel
result and the dense one it copies agree to rounding (~1e-15), and any real
mistake shows up as an error of order one.

Tensors are laid out ``[sequence, batch, hidden]`` as in Megatron-LM. The
dense oracles are torch's own modules (``nn.Linear``, ``nn.LayerNorm``,
``nn.MultiheadAttention``, ``nn.Embedding``, ``F.cross_entropy``); the
parallel versions are built here from the same weights, each rank taking its
block. ``experiments()`` runs every demonstration of the lecture for one world
size in one job (starting the processes is the slow part).

The names are the lecture's: ``f`` and ``g`` are Megatron's conjugate
operators, ``gather_seq`` and ``scatter_seq`` their sequence-parallel
counterparts. Here f and g are built from a gradient hook and a detached
offset; the lab (``labs/10-tensor-parallel``) asks for all four as
``autograd.Function``s, with process groups, under Megatron's names.
"""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course.roofline import tp_widest  # noqa: F401 (lecture 10's bound, with the other rooflines)
from course.timing import allreduce_seconds, matmul_flops  # noqa: F401 (the lecture calls ex.matmul_flops)
from course.torch_audit import SavedActivations

S, B, H, HEADS, VOCAB = 8, 2, 16, 4, 32   # sequence, batch, hidden, attention heads, vocabulary
FFN = 4 * H
DTYPE = torch.float64
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


def world():
    return dist.get_world_size()


# --- the communication operators ------------------------------------------------------------------

def all_reduce(x, op=dist.ReduceOp.SUM):
    x = x.clone()  # never overwrite a tensor autograd may still need
    dist.all_reduce(x, op=op)
    return x


def all_gather_seq(x):
    """Concatenate every rank's ``x`` along the sequence (first) dimension."""
    out = torch.empty((world() * x.shape[0], *x.shape[1:]), dtype=x.dtype)
    dist.all_gather_into_tensor(out, x.contiguous())
    return out


def reduce_scatter_seq(x):
    """Sum ``x`` over ranks and keep this rank's block of the sequence dimension."""
    out = torch.empty((x.shape[0] // world(), *x.shape[1:]), dtype=x.dtype)
    dist.reduce_scatter_tensor(out, x.contiguous())
    return out


def f_by_hook(x):
    """f: identity forward, all-reduce backward (enters a tensor-parallel region).

    Built without an ``autograd.Function``: a new view of ``x`` whose gradient, on
    its way back to ``x``, passes through a hook that all-reduces it."""
    y = x.view_as(x)
    if y.requires_grad:
        y.register_hook(all_reduce)
    return y


def g_straight_through(x):
    """g: all-reduce forward, identity backward (leaves a tensor-parallel region).

    The sum enters as ``x`` plus a constant (the sum minus ``x``, detached): the
    value is the sum, and autograd sees only ``x``, so the gradient passes unchanged."""
    return x + (all_reduce(x.detach()) - x.detach())


class _GatherSeq(torch.autograd.Function):
    """Sequence parallel's f: all-gather the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x):
        return all_gather_seq(x)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(grad)


class _ScatterSeq(torch.autograd.Function):
    """Sequence parallel's g: reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x):
        return reduce_scatter_seq(x)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad)


class _AllReduceBothWays(torch.autograd.Function):
    """A wrong g, for the lecture: all-reduce forward AND backward."""

    @staticmethod
    def forward(ctx, x):
        return all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad)


f, g = f_by_hook, g_straight_through
gather_seq, scatter_seq = _GatherSeq.apply, _ScatterSeq.apply


class _GatherLinear(torch.autograd.Function):
    """``linear(all_gather_seq(x), w, b)`` that keeps only the shard ``x`` for backward
    and gathers it again there (Megatron's choice under sequence parallelism):
    one more all-gather, s·b·h·(t−1)/t fewer numbers stored per linear layer."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return F.linear(all_gather_seq(x), w, b)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        total = all_gather_seq(x)
        grad_w = grad.reshape(-1, grad.shape[-1]).T @ total.reshape(-1, total.shape[-1])
        return reduce_scatter_seq(grad @ w), grad_w, grad.sum((0, 1))


# --- counting: collectives and saved activations ----------------------------------------------------

class CollectiveLog:
    """Wraps ``torch.distributed``'s collectives; ``calls`` lists (phase, name, bytes), where
    bytes is the whole vector involved: the all-reduced tensor, the all-gather's output,
    the reduce-scatter's input. Set ``phase`` ("forward", "backward", ...) as you go."""

    def __enter__(self):
        self.calls, self.phase, self.originals = [], "forward", {}
        for name in COLLECTIVES:
            self.originals[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, self.originals[name]))
        return self

    def _wrap(self, name, original):
        def counted(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            vector = tensors[1] if name == "reduce_scatter_tensor" else tensors[0]
            self.calls.append((self.phase, name, vector.numel() * vector.element_size()))
            return original(*args, **kwargs)
        return counted

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(dist, name, original)


def ring_bytes_sent(calls, t):
    """Bytes one rank sends with ring algorithms (module 06): all-reduce 2(t−1)/t
    of the vector, all-gather and reduce-scatter (t−1)/t."""
    return sum((2 if name == "all_reduce" else 1) * (t - 1) / t * nbytes for _, name, nbytes in calls)


def max_error(a, b):
    return float((a - b).abs().max())


# --- 1. the MLP: column-parallel, then row-parallel ---------------------------------------------------

def dense_mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(H, FFN), torch.nn.GELU(), torch.nn.Linear(FFN, H)).to(DTYPE)


def mlp_shard(tensors, rank, t):
    """This rank's block of each MLP tensor: rows of W1 (an output column block of
    X·W1ᵀ) and of b1, columns of W2 (the matching input block); b2 whole."""
    w1, b1, w2, b2 = tensors
    cols = slice(rank * FFN // t, (rank + 1) * FFN // t)
    return w1[cols], b1[cols], w2[:, cols], b2


def mlp_variants():
    """The parallel MLP with the right f and g and with three mistakes, against the
    dense ``nn.Sequential`` from the same weights: largest error of the output, of
    the input's gradient and of each weight gradient (this rank's block), and the
    collectives of the correct one."""
    rank, t = dist.get_rank(), world()
    dense = dense_mlp()
    gen = torch.Generator().manual_seed(1)
    x_full = torch.randn(S, B, H, generator=gen, dtype=DTYPE)
    upstream = torch.randn(S, B, H, generator=gen, dtype=DTYPE)  # dL/dY, the same on every rank
    x_dense = x_full.clone().requires_grad_()
    y_dense = dense(x_dense)
    (y_dense * upstream).sum().backward()
    dense_grads = mlp_shard([p.grad for p in dense.parameters()], rank, t)
    weights = mlp_shard([p.detach() for p in dense.parameters()], rank, t)
    variants = {"f and g (Megatron)": (f, g),
                "no f: identity both ways": (lambda x: x, g),
                "g all-reduces backward too": (f, _AllReduceBothWays.apply),
                "no g: identity both ways": (f, lambda y: y)}
    out = {}
    for label, (enter, leave) in variants.items():
        w1, b1, w2, b2 = (w.clone().requires_grad_() for w in weights)
        x = x_full.clone().requires_grad_()
        with CollectiveLog() as log:
            y = leave(F.linear(F.gelu(F.linear(enter(x), w1, b1)), w2)) + b2
            log.phase = "backward"
            (y * upstream).sum().backward()
        out[label] = {"output": max_error(y, y_dense), "input grad": max_error(x.grad, x_dense.grad),
                      **{name: max_error(p.grad, want) for name, p, want in
                         zip(("W1 grad", "b1 grad", "W2 grad", "b2 grad"), (w1, b1, w2, b2), dense_grads)},
                      "calls": log.calls}
    return out


# --- 2. the transformer layer: attention heads split, MLP split; TP and TP+SP -------------------

def dense_layer(seed=0):
    """A pre-LayerNorm transformer layer from torch's own modules (no dropout)."""
    torch.manual_seed(seed)
    layer = torch.nn.ModuleDict({"ln1": torch.nn.LayerNorm(H), "attn": torch.nn.MultiheadAttention(H, HEADS),
                                 "ln2": torch.nn.LayerNorm(H), "fc1": torch.nn.Linear(H, FFN),
                                 "fc2": torch.nn.Linear(FFN, H)}).to(DTYPE)
    with torch.no_grad():  # not the default 1, 0: their gradients would be too easy to get right by accident
        for p in (layer.ln1.weight, layer.ln2.weight):
            p.normal_(1.0, 0.2)
        for p in (layer.ln1.bias, layer.ln2.bias, layer.attn.in_proj_bias, layer.attn.out_proj.bias):
            p.normal_(0.0, 0.2)
    return layer


def dense_forward(layer, x):
    y = layer.ln1(x)
    x = x + layer.attn(y, y, y, need_weights=False)[0]
    return x + layer.fc2(F.gelu(layer.fc1(layer.ln2(x))))


def layer_tensors(layer, grad=False):
    """The dense layer's tensors (or their gradients) by the names the shards use."""
    get = (lambda p: p.grad) if grad else (lambda p: p.detach())
    a = layer.attn
    return {"ln1_w": get(layer.ln1.weight), "ln1_b": get(layer.ln1.bias), "qkv_w": get(a.in_proj_weight),
            "qkv_b": get(a.in_proj_bias), "out_w": get(a.out_proj.weight), "out_b": get(a.out_proj.bias),
            "ln2_w": get(layer.ln2.weight), "ln2_b": get(layer.ln2.bias), "fc1_w": get(layer.fc1.weight),
            "fc1_b": get(layer.fc1.bias), "fc2_w": get(layer.fc2.weight), "fc2_b": get(layer.fc2.bias)}


def layer_shard(tensors, rank, t):
    """This rank's blocks: the Q, K and V rows of its heads (column-parallel), the
    matching columns of the output projection (row-parallel), the MLP as above;
    LayerNorms and the biases added after a reduction are whole, on every rank."""
    heads = slice(rank * H // t, (rank + 1) * H // t)   # heads are contiguous blocks of H/HEADS rows
    ffn = slice(rank * FFN // t, (rank + 1) * FFN // t)
    shard = dict(tensors)
    shard["qkv_w"] = torch.cat([w[heads] for w in tensors["qkv_w"].chunk(3)])
    shard["qkv_b"] = torch.cat([b[heads] for b in tensors["qkv_b"].chunk(3)])
    shard["out_w"] = tensors["out_w"][:, heads]
    shard["fc1_w"], shard["fc1_b"] = tensors["fc1_w"][ffn], tensors["fc1_b"][ffn]
    shard["fc2_w"] = tensors["fc2_w"][:, ffn]
    return shard


# Replicated parameters used on a rank's slice of the sequence only under sequence parallelism:
# their gradients are partial sums there and must be all-reduced over the tensor-parallel group.
SEQUENCE_PARALLEL_PARAMS = ("ln1_w", "ln1_b", "out_b", "ln2_w", "ln2_b", "fc2_b")


def attention(qkv, heads):
    """Softmax attention of this rank's ``heads``: ``qkv`` is [s, b, 3·heads·d]."""
    s, b, _ = qkv.shape
    d = H // HEADS
    q, k, v = (z.reshape(s, b * heads, d).transpose(0, 1) for z in qkv.chunk(3, dim=-1))
    probs = torch.softmax(torch.bmm(q, k.transpose(1, 2)) / math.sqrt(d), dim=-1)
    return torch.bmm(probs, v).transpose(0, 1).reshape(s, b, heads * d)


def parallel_layer(p, x, mode="tp"):
    """The layer on this rank. ``mode``: "tp" (x is [s, b, h], whole, on every rank);
    "sp" (x is this rank's [s/t, b, h] block of the sequence; the column-parallel
    inputs are all-gathered and kept); "sp_regather" (as "sp", but the linear layers
    keep only the shard and gather it again in backward)."""
    t = world()

    def column(y, w, b):                     # enter the tensor-parallel region
        if mode == "sp_regather":
            return _GatherLinear.apply(y, w, b)
        return F.linear(gather_seq(y) if mode == "sp" else f(y), w, b)

    def row(z, w, b):                        # leave it: sum the ranks' partial outputs
        partial = F.linear(z, w)
        return (g(partial) if mode == "tp" else scatter_seq(partial)) + b

    y = F.layer_norm(x, (H,), p["ln1_w"], p["ln1_b"])
    x = x + row(attention(column(y, p["qkv_w"], p["qkv_b"]), HEADS // t), p["out_w"], p["out_b"])
    y = F.layer_norm(x, (H,), p["ln2_w"], p["ln2_b"])
    return x + row(F.gelu(column(y, p["fc1_w"], p["fc1_b"])), p["fc2_w"], p["fc2_b"])


def layer_run(mode, s=S, b=B):
    """One forward and backward of the parallel layer against the dense layer:
    largest errors (output, input gradient, every parameter gradient: this rank's
    block), the collectives by phase, the activation bytes saved for backward, the
    numbers in this rank's parameters and in the dense layer's."""
    rank, t = dist.get_rank(), world()
    dense = dense_layer()
    gen = torch.Generator().manual_seed(2)
    x_full = torch.randn(s, b, H, generator=gen, dtype=DTYPE)
    upstream = torch.randn(s, b, H, generator=gen, dtype=DTYPE)
    x_dense = x_full.clone().requires_grad_()
    y_dense = dense_forward(dense, x_dense)
    (y_dense * upstream).sum().backward()

    params = {k: v.clone().requires_grad_() for k, v in layer_shard(layer_tensors(dense), rank, t).items()}
    rows = slice(rank * s // t, (rank + 1) * s // t) if mode != "tp" else slice(None)
    x = x_full[rows].clone().requires_grad_()
    with CollectiveLog() as log:
        with SavedActivations(exclude=params.values()) as saved:
            y = parallel_layer(params, x, mode)
        log.phase = "backward"
        (y * upstream[rows]).sum().backward()
        if mode != "tp":
            log.phase = "after backward"
            for name in SEQUENCE_PARALLEL_PARAMS:
                dist.all_reduce(params[name].grad)
    want = layer_shard(layer_tensors(dense, grad=True), rank, t)
    return {"output": max_error(y, y_dense[rows]), "input grad": max_error(x.grad, x_dense.grad[rows]),
            "param grads": max(max_error(params[k].grad, want[k]) for k in params),
            "calls": log.calls, "saved_bytes": saved.nbytes, "sbh_bytes": s * b * H * 8,
            "param_numbers": sum(v.numel() for v in params.values()),
            "dense_param_numbers": sum(v.numel() for v in dense.parameters())}


# --- 3. all-reduce = reduce-scatter + all-gather -------------------------------------------------

def allreduce_identity(n=8):
    """Largest difference between all_reduce(x) and all_gather(reduce_scatter(x)) on this rank."""
    x = torch.randn(n * world(), 3, generator=torch.Generator().manual_seed(dist.get_rank()), dtype=DTYPE)
    return max_error(all_reduce(x), all_gather_seq(reduce_scatter_seq(x)))


# --- 4. vocab-parallel embedding and cross-entropy -----------------------------------------------

def vocab_embedding(tokens, w_local):
    """The embedding as a row-parallel layer: E[tokens] = one_hot(tokens) · E with E cut by rows, so
    this rank multiplies its V/t columns of the one-hot by its V/t rows of the table, and g sums the
    partial products. (A [s, b, V/t] one-hot: fine here, wasteful at a real vocabulary.)"""
    per = w_local.shape[0]
    first = dist.get_rank() * per
    one_hot = F.one_hot(tokens, per * world())[..., first:first + per].to(w_local.dtype)
    return g(one_hot @ w_local)


def vocab_cross_entropy(logits_local, targets):
    """Mean cross-entropy from this rank's [s, b, V/t] block of the logits. The logits
    are never gathered: three all-reduces of s·b numbers (max, sum of exponentials,
    target logit). g's identity backward is right because the loss is the same on every rank."""
    per = logits_local.shape[-1]
    top = all_reduce(logits_local.detach().max(-1, keepdim=True).values, op=dist.ReduceOp.MAX)
    z = logits_local - top  # softmax does not change under a shift: no gradient through the max
    sum_exp = g(z.exp().sum(-1))
    local = targets - dist.get_rank() * per
    inside = (local >= 0) & (local < per)
    target_z = g(torch.where(inside, z.gather(-1, local.clamp(0, per - 1)[..., None]).squeeze(-1), 0.0))
    return (sum_exp.log() - target_z).mean()


def vocab_checks():
    """Embedding and cross-entropy against nn.Embedding and F.cross_entropy, and the
    collectives of the cross-entropy's forward and backward."""
    rank, t = dist.get_rank(), world()
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(VOCAB, (S, B), generator=gen)
    table = torch.nn.Embedding(VOCAB, H).to(DTYPE)
    torch.nn.init.normal_(table.weight, generator=gen)
    upstream = torch.randn(S, B, H, generator=gen, dtype=DTYPE)
    (table(tokens) * upstream).sum().backward()
    block = slice(rank * VOCAB // t, (rank + 1) * VOCAB // t)
    w_local = table.weight.detach()[block].clone().requires_grad_()
    emb = vocab_embedding(tokens, w_local)
    (emb * upstream).sum().backward()

    logits = torch.randn(S, B, VOCAB, generator=gen, dtype=DTYPE, requires_grad=True)
    targets = torch.randint(VOCAB, (S, B), generator=gen)
    loss_dense = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    loss_dense.backward()
    local = logits.detach()[..., block].clone().requires_grad_()
    with CollectiveLog() as log:
        loss = vocab_cross_entropy(local, targets)
        log.phase = "backward"
        loss.backward()
    return {"embedding output": max_error(emb, table(tokens)),
            "embedding grad": max_error(w_local.grad, table.weight.grad[block]),
            "loss": abs(float(loss) - float(loss_dense)), "logits grad": max_error(local.grad, logits.grad[..., block]),
            "calls": log.calls, "logits_bytes": logits.numel() * 8}


# --- all of it, one job per world size ----------------------------------------------------------

def experiments():
    """Every demonstration of the lecture for this world size, on this rank."""
    out = {"layer": {mode: layer_run(mode) for mode in ("tp", "sp", "sp_regather")},
           "allreduce = reduce-scatter + all-gather": allreduce_identity(), "vocab": vocab_checks()}
    if world() > 1:
        out["mlp"] = mlp_variants()
        out["allreduce_s"] = allreduce_seconds()
    return out


# --- on the notebook's side: the tensor-parallel roofline ---------------------------------------------

def tp_mlp_times(tokens, h, ffn, t, flops, bandwidth, bytes_per_number=2):
    """Seconds of one tensor-parallel MLP forward on one rank: (math, communication).

    Math: two matrix products of ``tokens × h × ffn/t``, 2 flops per multiply-add, so
    4·tokens·h·ffn/t flops at ``flops`` per second. Communication: g's ring all-reduce
    of the [tokens, h] output, 2(t−1)/t of it sent per rank at ``bandwidth`` bytes/s."""
    math_s = 4 * tokens * h * ffn / t / flops
    comm_s = 2 * (t - 1) / t * tokens * h * bytes_per_number / bandwidth
    return math_s, comm_s


def tp_attention_times(tokens, h, t, flops, bandwidth, bytes_per_number=2):
    """Seconds of one tensor-parallel attention forward's projections on one rank: (math, communication).

    Math: the Q, K, V and output projections, four ``tokens × h × h/t`` products, 8·tokens·h²/t
    flops (the s² score products left out: they only add arithmetic). Communication: g's ring
    all-reduce of the [tokens, h] output, as for the MLP."""
    math_s = 8 * tokens * h * h / t / flops
    comm_s = 2 * (t - 1) / t * tokens * h * bytes_per_number / bandwidth
    return math_s, comm_s


# --- on the notebook's side: formulas ---------------------------------------------------------------

def korthikanti_bytes(s, b, h, a, t, sequence_parallel):
    """Activation bytes per layer per rank, 16-bit, with dropout (Korthikanti et al., 2022):
    sbh(10 + 24/t + 5as/(ht)) with tensor parallelism, sbh/t·(34 + 5as/h) with sequence parallelism too."""
    if sequence_parallel:
        return s * b * h / t * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def our_layer_numbers(s, b, h, a, t, mode):
    """Numbers the layer of this module saves for backward (no dropout), per rank:
    LayerNorm inputs and outputs 4sbh (1/t under sequence parallelism, unless the
    gathered outputs are kept: then 2sbh/t + 2sbh), Q, K, V, attention output,
    fc1 output, GELU output 12sbh/t, softmax output a·s²·b/t, LayerNorm statistics 4sb."""
    parallel = 12 * s * b * h / t + a * s * s * b / t
    if mode == "tp":
        return 4 * s * b * h + 4 * s * b + parallel
    if mode == "sp":
        return 2 * s * b * h / t + 2 * s * b * h + 4 * s * b / t + parallel
    return 4 * s * b * h / t + 4 * s * b / t + parallel
