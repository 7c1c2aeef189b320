"""Lab 10 — tensor and sequence parallelism (Megatron style).

Tensor parallelism splits every weight matrix of a transformer layer across
the t ranks of a group, so no rank holds a full matrix (Shoeybi et al. 2019,
"Megatron-LM"). Sequence parallelism (Korthikanti et al. 2022) also splits
the activations of the parts tensor parallelism leaves whole (LayerNorm,
dropout) along the sequence. You write, from the bottom up:

1. The conjugate operators, each a ``torch.autograd.Function``:
   ``copy_to_tensor_parallel_region`` (f: identity forward, all-reduce
   backward), ``reduce_from_tensor_parallel_region`` (g: all-reduce forward,
   identity backward), ``gather_from_sequence_parallel_region`` (all-gather
   along dim 0 forward, reduce-scatter backward) and
   ``reduce_scatter_to_sequence_parallel_region`` (the reverse).
2. ``ColumnParallelLinear`` and ``RowParallelLinear``.
3. ``ParallelMLP``, ``ParallelSelfAttention`` and ``ParallelTransformerLayer``
   (tensor parallel, and with ``sequence_parallel=True``), and
   ``allreduce_sequence_parallel_grads``.
4. ``VocabParallelEmbedding`` and ``vocab_parallel_cross_entropy``.

Conventions the grader relies on:

- Activations are laid out ``[sequence, batch, hidden]``, as in Megatron;
  sequence parallelism shards dim 0: rank r holds rows ``r*s/t .. (r+1)*s/t``.
- ``t = dist.get_world_size(group)``, ``rank = dist.get_rank(group)``
  (``group=None``: the default group). Every rank runs the same code.
- Weight layouts (the grader copies rank r's slice of a dense torch model
  into your parameters, so names and shapes matter):
  ``ColumnParallelLinear.weight`` is ``[out/t, in]``, rows ``r*out/t ..`` of the
  dense ``[out, in]`` weight, ``.bias`` ``[out/t]`` (or None);
  ``RowParallelLinear.weight`` is ``[out, in/t]`` (columns ``r*in/t ..``),
  ``.bias`` is the whole ``[out]``, added once, after the reduction;
  ``ParallelMLP.fc1`` (column) and ``.fc2`` (row); ``ParallelSelfAttention.q``,
  ``.k``, ``.v`` (column: rank r holds heads ``r*n_heads/t ..``) and ``.out``
  (row); ``ParallelTransformerLayer.ln1``, ``.attn``, ``.ln2`` (``nn.LayerNorm``
  with default eps) and ``.mlp``; ``VocabParallelEmbedding.weight`` is
  ``[vocab/t, hidden]``, rows ``r*vocab/t ..``. A size t does not divide raises
  ``ValueError``.
- Collectives: ``dist.all_reduce``, ``dist.all_gather_single`` and
  ``dist.reduce_scatter_single``, called as attributes of
  ``torch.distributed`` (the grader counts them, and their older names
  ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` too). One tensor-parallel
  transformer layer makes exactly 2 all-reduces in forward and 2 in backward;
  attention applies f (or the sequence gather) ONCE for q, k and v together,
  as Megatron's fused QKV layer does, so ``q``, ``k`` and ``v`` are built with
  ``communicate_input=False``.
- The vocabulary pair never makes a whole ``[tokens, vocab]`` or
  ``[vocab, hidden]`` tensor on a rank, not even for a moment (the grader
  sees every tensor they make and every collective): the embedding looks up
  its own rows and all-reduces the result once; the cross-entropy all-reduces
  per-token values only (the max, the sum of exps, the target's logit).
- With ``sequence_parallel=True``, parameters that every rank holds whole
  but applies to its own sequence shard (the LayerNorms, the row layers'
  bias) get partial gradients; mark them ``param.sequence_parallel = True``
  and ``allreduce_sequence_parallel_grads`` sums them over the group.

Run the checks with ``k2c grade 10``.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F


def divide(total, t, what):
    """``total // t``; a ValueError that names the size when t does not divide it."""
    if total % t:
        raise ValueError(f"{what}={total} is not divisible by the tensor-parallel size {t}: every rank "
                         "must hold an equal slice")
    return total // t


# --- 1. The conjugate operators ---------------------------------------------------------


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """f: every rank already has the whole input; each rank's gradient is a partial sum."""

    @staticmethod
    def forward(ctx, x, group):
        # BEGIN SOLUTION: keep the group on ctx for backward; the forward is the identity (return a view of x, not x itself)
        ctx.group = group
        return x.view_as(x)
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION: every rank holds a partial gradient: sum a contiguous copy of it over ctx.group (all-reduce); group gets no gradient
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
        # END SOLUTION


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: sum the ranks' partial outputs; the gradient of a sum is the same on every rank."""

    @staticmethod
    def forward(ctx, x, group):
        # BEGIN SOLUTION: sum a contiguous copy of x over the group (all-reduce the copy, never x itself)
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION: the identity: the gradient passes through unchanged; group gets no gradient
        return grad, None
        # END SOLUTION


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather the sequence shards along dim 0; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        # BEGIN SOLUTION: ctx.group = group; out = torch.empty((t * x.shape[0], *x.shape[1:])) like x; dist.all_gather_single(out, x.contiguous(), group=group)
        ctx.group = group
        t = dist.get_world_size(group)
        out = torch.empty((t * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION: shard = empty of shape (grad.shape[0] // t, *grad.shape[1:]); dist.reduce_scatter_single(shard, grad.contiguous(), group=ctx.group); return shard, None
        t = dist.get_world_size(ctx.group)
        shard = torch.empty((grad.shape[0] // t, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_single(shard, grad.contiguous(), group=ctx.group)
        return shard, None
        # END SOLUTION


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Sum the ranks' partial outputs and keep this rank's sequence shard; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        # BEGIN SOLUTION: ctx.group = group; shard of shape (x.shape[0] // t, *x.shape[1:]); dist.reduce_scatter_single(shard, x.contiguous(), group=group)
        ctx.group = group
        t = dist.get_world_size(group)
        divide(x.shape[0], t, "sequence length")
        shard = torch.empty((x.shape[0] // t, *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_single(shard, x.contiguous(), group=group)
        return shard
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION: full = empty of shape (t * grad.shape[0], *grad.shape[1:]); dist.all_gather_single(full, grad.contiguous(), group=ctx.group); return full, None
        t = dist.get_world_size(ctx.group)
        full = torch.empty((t * grad.shape[0], *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        dist.all_gather_single(full, grad.contiguous(), group=ctx.group)
        return full, None
        # END SOLUTION


def copy_to_tensor_parallel_region(x, group=None):
    """f: identity forward, all-reduce (sum) of the gradient backward."""
    return _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x, group=None):
    """g: all-reduce (sum) forward, identity backward."""
    return _ReduceFromTensorParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x, group=None):
    """[s/t, ...] shard -> [s, ...] whole (all-gather along dim 0); backward reduce-scatters."""
    return _GatherFromSequenceParallelRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x, group=None):
    """[s, ...] partial sums -> this rank's [s/t, ...] shard of their sum; backward all-gathers."""
    return _ReduceScatterToSequenceParallelRegion.apply(x, group)


# --- 2. Column- and row-parallel linear layers --------------------------------------------


def _init_weight(rows, cols):
    weight = torch.empty(rows, cols, dtype=torch.get_default_dtype())
    torch.nn.init.normal_(weight, std=cols ** -0.5)  # the grader overwrites it; any init will do
    return torch.nn.Parameter(weight)


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dimension; backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.group, ctx.rank, ctx.local = group, dist.get_rank(group), y.shape[-1]
        t = dist.get_world_size(group)
        moved = y.movedim(-1, 0).contiguous()
        out = torch.empty((t * moved.shape[0], *moved.shape[1:]), dtype=y.dtype, device=y.device)
        dist.all_gather_single(out, moved, group=group)
        return out.movedim(0, -1).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return grad[..., ctx.rank * ctx.local:(ctx.rank + 1) * ctx.local].contiguous(), None


class ColumnParallelLinear(torch.nn.Module):
    """Y_r = X A_r^T + b_r: rank r holds output features r*out/t .. (r+1)*out/t.

    The input must be the same on every rank, so it goes through f (or, with
    ``sequence_parallel``, the sequence all-gather of this rank's shard).
    ``gather_output=True`` all-gathers the output features so every rank gets
    the whole ``[..., out]`` (not with ``sequence_parallel``).
    ``communicate_input=False`` skips f / the gather: the caller did it once
    for several layers that read the same input (attention's q, k and v).
    """

    def __init__(self, in_features, out_features, bias=True, *, gather_output=False, sequence_parallel=False,
                 group=None, communicate_input=True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.group, self.communicate_input = group, communicate_input
        # BEGIN SOLUTION: t = dist.get_world_size(group); local = divide(out_features, t, "out_features"); self.weight = Parameter [local, in_features]; self.bias = Parameter [local] or None (register_parameter("bias", None))
        self.t, self.rank = dist.get_world_size(group), dist.get_rank(group)
        local = divide(out_features, self.t, "out_features")
        self.weight = _init_weight(local, in_features)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(local, dtype=torch.get_default_dtype()))
        else:
            self.register_parameter("bias", None)
        if gather_output and sequence_parallel:
            raise ValueError("gather_output and sequence_parallel together are not supported")
        # END SOLUTION

    def forward(self, x):
        # BEGIN SOLUTION: if communicate_input: x = gather_from_sequence_parallel_region(x) when sequence_parallel else copy_to_tensor_parallel_region(x); y = F.linear(x, weight, bias); if gather_output: all-gather the last dim (a Function, or all-gather dim 0 of y.movedim(-1, 0))
        if self.communicate_input:
            if self.sequence_parallel:
                x = gather_from_sequence_parallel_region(x, self.group)
            else:
                x = copy_to_tensor_parallel_region(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            # Features to dim 0, gather there, and back: [out/t, ...] shards stack into [out, ...].
            y = _GatherLastDim.apply(y, self.group)
        return y
        # END SOLUTION


class RowParallelLinear(torch.nn.Module):
    """Y = sum_r X_r A_r^T + b: rank r holds input features r*in/t .. (r+1)*in/t.

    The partial products are summed by g (or, with ``sequence_parallel``,
    reduce-scattered along the sequence); the bias, whole on every rank, is
    added once after the sum. ``input_is_parallel=False``: the input is whole
    on every rank and each rank uses its slice of the features.
    """

    def __init__(self, in_features, out_features, bias=True, *, input_is_parallel=True, sequence_parallel=False,
                 group=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel, self.group = input_is_parallel, sequence_parallel, group
        # BEGIN SOLUTION: local = divide(in_features, t, "in_features"); self.weight = Parameter [out_features, local]; self.bias = Parameter [out_features] or None; with sequence_parallel mark self.bias.sequence_parallel = True (its gradient comes from this rank's shard only)
        self.t, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.local = divide(in_features, self.t, "in_features")
        self.weight = _init_weight(out_features, self.local)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=torch.get_default_dtype()))
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.register_parameter("bias", None)
        # END SOLUTION

    def forward(self, x):
        # BEGIN SOLUTION: if not input_is_parallel: x = copy_to_tensor_parallel_region(x)[..., rank slice]; partial = F.linear(x, weight) (no bias); y = reduce_scatter_to_sequence_parallel_region(partial) if sequence_parallel else reduce_from_tensor_parallel_region(partial); then + bias
        if not self.input_is_parallel:
            x = copy_to_tensor_parallel_region(x, self.group)[..., self.rank * self.local:(self.rank + 1) * self.local]
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.group)
        else:
            y = reduce_from_tensor_parallel_region(partial, self.group)
        return y + self.bias if self.bias is not None else y
        # END SOLUTION


# --- 3. Parallel MLP, attention and transformer layer --------------------------------------


class ParallelMLP(torch.nn.Module):
    """fc1 (column, no gather) -> GELU -> fc2 (row): one all-reduce forward, one backward."""

    def __init__(self, hidden, ffn_hidden, *, sequence_parallel=False, group=None):
        super().__init__()
        # BEGIN SOLUTION: self.fc1 = ColumnParallelLinear(hidden, ffn_hidden, sequence_parallel=..., group=...); self.fc2 = RowParallelLinear(ffn_hidden, hidden, input_is_parallel=True, sequence_parallel=..., group=...)
        self.fc1 = ColumnParallelLinear(hidden, ffn_hidden, sequence_parallel=sequence_parallel, group=group)
        self.fc2 = RowParallelLinear(ffn_hidden, hidden, sequence_parallel=sequence_parallel, group=group)
        # END SOLUTION

    def forward(self, x):
        # BEGIN SOLUTION: fc2(F.gelu(fc1(x)))
        return self.fc2(F.gelu(self.fc1(x)))
        # END SOLUTION


class ParallelSelfAttention(torch.nn.Module):
    """Multi-head self-attention with the heads split across ranks.

    q, k and v are column-parallel (rank r computes heads r*n_heads/t ..),
    attention runs on the local heads only, and ``out`` is row-parallel. The
    input goes through f (or the sequence gather) once, for q, k and v.
    """

    def __init__(self, hidden, n_heads, *, causal=True, sequence_parallel=False, group=None):
        super().__init__()
        self.causal, self.sequence_parallel, self.group = causal, sequence_parallel, group
        # BEGIN SOLUTION: t = world size; self.local_heads = divide(n_heads, t, "n_heads") (raises ValueError); head_dim = hidden // n_heads; q, k, v = ColumnParallelLinear(hidden, hidden, group=group, communicate_input=False); out = RowParallelLinear(hidden, hidden, sequence_parallel=..., group=group)
        t = dist.get_world_size(group)
        if hidden % n_heads:
            raise ValueError(f"hidden={hidden} is not divisible by n_heads={n_heads}")
        self.local_heads = divide(n_heads, t, "n_heads")
        self.head_dim = hidden // n_heads
        self.q, self.k, self.v = (ColumnParallelLinear(hidden, hidden, group=group, communicate_input=False)
                                  for _ in range(3))
        self.out = RowParallelLinear(hidden, hidden, sequence_parallel=sequence_parallel, group=group)
        # END SOLUTION

    def forward(self, x):
        # BEGIN SOLUTION: x = gather (sequence_parallel) or f, once; q, k, v = self.q(x) ... each [s, b, local_heads*head_dim] -> [b, local_heads, s, head_dim]; F.scaled_dot_product_attention(q, k, v, is_causal=self.causal); back to [s, b, local_heads*head_dim]; self.out(...)
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.group)
        else:
            x = copy_to_tensor_parallel_region(x, self.group)
        s, b = x.shape[0], x.shape[1]

        def heads(y):  # [s, b, local_heads * head_dim] -> [b, local_heads, s, head_dim]
            return y.reshape(s, b, self.local_heads, self.head_dim).permute(1, 2, 0, 3)

        context = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)),
                                                 is_causal=self.causal)
        return self.out(context.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.head_dim))
        # END SOLUTION


class ParallelTransformerLayer(torch.nn.Module):
    """Pre-LayerNorm transformer layer: y = x + attn(ln1(x)); z = y + mlp(ln2(y)).

    Attention is causal. With ``sequence_parallel`` the input and output are
    this rank's sequence shard ``[s/t, b, h]``; the LayerNorms run on the shard.
    """

    def __init__(self, hidden, n_heads, ffn_hidden, *, sequence_parallel=False, group=None):
        super().__init__()
        # BEGIN SOLUTION: ln1, ln2 = nn.LayerNorm(hidden); with sequence_parallel mark their weight and bias .sequence_parallel = True; attn = ParallelSelfAttention(hidden, n_heads, sequence_parallel=..., group=...); mlp = ParallelMLP(hidden, ffn_hidden, ...)
        self.ln1 = torch.nn.LayerNorm(hidden)
        self.attn = ParallelSelfAttention(hidden, n_heads, sequence_parallel=sequence_parallel, group=group)
        self.ln2 = torch.nn.LayerNorm(hidden)
        self.mlp = ParallelMLP(hidden, ffn_hidden, sequence_parallel=sequence_parallel, group=group)
        for norm in (self.ln1, self.ln2):
            for p in norm.parameters():
                p.sequence_parallel = sequence_parallel
        # END SOLUTION

    def forward(self, x):
        # BEGIN SOLUTION: a pre-norm residual block: add attention of the first norm of x to x, then add the MLP of the second norm of that
        y = x + self.attn(self.ln1(x))
        return y + self.mlp(self.ln2(y))
        # END SOLUTION


def allreduce_sequence_parallel_grads(module, group=None):
    """Sum over the group the gradients of the parameters marked
    ``sequence_parallel`` (whole on every rank, applied to a sequence shard).
    The training loop calls it after backward, as DDP syncs gradients."""
    # BEGIN SOLUTION: all-reduce over the group the gradient of every parameter marked sequence_parallel (skip those with no gradient)
    for p in module.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            dist.all_reduce(p.grad, group=group)
    # END SOLUTION


# --- 4. Vocabulary-parallel embedding and cross-entropy ------------------------------------


class VocabParallelEmbedding(torch.nn.Module):
    """Rank r holds embedding rows r*vocab/t .. (r+1)*vocab/t; ids of other ranks
    give zero rows here, and the all-reduce (g) fills them in."""

    def __init__(self, vocab_size, hidden, *, group=None):
        super().__init__()
        self.group = group
        # BEGIN SOLUTION: local = divide(vocab_size, t, "vocab_size"); self.start = rank * local; self.weight = Parameter [local, hidden]
        t, rank = dist.get_world_size(group), dist.get_rank(group)
        self.local = divide(vocab_size, t, "vocab_size")
        self.start = rank * self.local
        self.weight = _init_weight(self.local, hidden)
        # END SOLUTION

    def forward(self, ids):
        # BEGIN SOLUTION: outside = (ids < start) | (ids >= start + local); local_ids = (ids - start) with outside set to 0; rows = F.embedding(local_ids, weight) * ~outside[..., None]; return reduce_from_tensor_parallel_region(rows)
        outside = (ids < self.start) | (ids >= self.start + self.local)
        local_ids = (ids - self.start).masked_fill(outside, 0)
        rows = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region(rows, self.group)
        # END SOLUTION


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits split along the vocabulary, without gathering them."""

    @staticmethod
    def forward(ctx, local_logits, target, group):
        # BEGIN SOLUTION: max over the local vocab, all_reduce(op=MAX); shifted = logits - max; this rank's target logit (0 where the target is another rank's), all_reduce; sum of exp, all_reduce; loss = log(sum_exp) - target_logit, mean; save softmax, the mask and the local target for backward
        rank, local = dist.get_rank(group), local_logits.shape[-1]
        start = rank * local
        logits_max = local_logits.detach().amax(dim=-1)
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = local_logits.detach() - logits_max.unsqueeze(-1)
        outside = (target < start) | (target >= start + local)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(target_logit, group=group)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        losses = sum_exp.log() - target_logit
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), outside, local_target)
        return losses.mean()
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad_loss):
        # BEGIN SOLUTION: grad = softmax, minus 1 at the local target where it is this rank's; times grad_loss / number of tokens; return grad, None, None
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(~outside).unsqueeze(-1).to(grad.dtype))
        return grad * (grad_loss / outside.numel()), None, None
        # END SOLUTION


def vocab_parallel_cross_entropy(local_logits, target, group=None):
    """Mean over tokens of the cross-entropy of ``local_logits`` ``[..., vocab/t]``
    (this rank's slice of the vocabulary) against ``target`` ``[...]`` (global
    ids); equals ``F.cross_entropy`` of the gathered logits on every rank."""
    return _VocabParallelCrossEntropy.apply(local_logits, target, group)
