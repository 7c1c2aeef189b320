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
- Weight layouts (the grader gives rank r its slice of a dense torch model
  and copies it into your parameters, so names and shapes matter):
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
- No rank holds a full weight matrix, not even for a moment while the module
  is built: create only this rank's shard (the grader reads each rank's peak
  memory, from outside, on a large ``ParallelMLP``).
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
    """f: every rank already has the whole input; each rank's gradient is a partial sum.

    ``forward(ctx, x, group)`` returns a view of ``x`` (autograd needs a new
    tensor object); ``backward`` returns the summed gradient, a new tensor made
    from a contiguous copy, and None for the group.
    """

    @staticmethod
    def forward(ctx, x, group):
        # BEGIN SOLUTION: Keep the group for backward; the forward passes the input through unchanged (a view, not the same object).
        ctx.group = group
        return x.view_as(x)
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION: Each rank holds a partial gradient: sum a copy of it over the group; the group itself gets no gradient.
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
        # END SOLUTION


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: sum the ranks' partial outputs; the gradient of a sum is the same on every rank.

    The forward returns the sum in a new contiguous tensor and leaves ``x``
    untouched (autograd may still need it); the group gets no gradient.
    """

    @staticmethod
    def forward(ctx, x, group):
        # BEGIN SOLUTION: Sum a copy of the input over the group; never reduce the input tensor in place.
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION: The gradient of a sum reaches every rank unchanged; the group gets no gradient.
        return grad, None
        # END SOLUTION


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather the sequence shards along dim 0; backward reduce-scatters the gradient.

    A shard of shape ``[s/t, ...]`` becomes ``[s, ...]``: rank r's shard lands in
    rows ``r*s/t .. (r+1)*s/t``; dtype and device are the input's. Backward turns
    a ``[s, ...]`` gradient into this rank's ``[s/t, ...]`` block of its sum over
    the ranks. Collectives take contiguous tensors.
    """

    @staticmethod
    def forward(ctx, x, group):
        # BEGIN SOLUTION: Keep the group for backward, then stack every rank's shard, in rank order, into one tensor t times as long.
        ctx.group = group
        stacked = list(x.shape)
        stacked[0] *= dist.get_world_size(group)
        whole = x.new_empty(stacked)
        dist.all_gather_single(whole, x.contiguous(), group=group)
        return whole
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION: The transpose of a gather: sum the gradient over the ranks and keep only this rank's block of the sequence.
        block = list(grad.shape)
        block[0] //= dist.get_world_size(ctx.group)
        mine = grad.new_empty(block)
        dist.reduce_scatter_single(mine, grad.contiguous(), group=ctx.group)
        return mine, None
        # END SOLUTION


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Sum the ranks' partial outputs and keep this rank's sequence shard; backward all-gathers.

    ``[s, ...]`` partial sums become this rank's ``[s/t, ...]`` block (rows
    ``r*s/t ..``) of their sum, same dtype and device; a length t does not divide
    raises ``ValueError`` (use ``divide``). Backward stacks the ranks' gradient
    blocks back into ``[s, ...]`` in rank order.
    """

    @staticmethod
    def forward(ctx, x, group):
        # BEGIN SOLUTION: Keep the group for backward, then sum over the ranks and keep this rank's block of the sequence.
        ctx.group = group
        block = list(x.shape)
        block[0] = divide(x.shape[0], dist.get_world_size(group), "sequence length")
        mine = x.new_empty(block)
        dist.reduce_scatter_single(mine, x.contiguous(), group=group)
        return mine
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION: The transpose of a reduce-scatter: stack every rank's gradient block back into the whole sequence.
        stacked = list(grad.shape)
        stacked[0] *= dist.get_world_size(ctx.group)
        whole = grad.new_empty(stacked)
        dist.all_gather_single(whole, grad.contiguous(), group=ctx.group)
        return whole, None
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
    torch.nn.init.normal_(weight, std=cols ** -0.5)  # the grader overwrites it; any init of the shard will do
    return torch.nn.Parameter(weight)


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dimension; backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.rank, ctx.local = dist.get_rank(group), y.shape[-1]
        pieces = [torch.empty_like(y) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, y.contiguous(), group=group)  # the list form: one tensor per rank
        return torch.cat(pieces, dim=-1)

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
    ``gather_output`` together with ``sequence_parallel`` raises ``ValueError``;
    so does an ``out_features`` t does not divide. ``bias=False`` registers
    ``bias`` as None. The gathered output's features are in rank order (the
    provided ``_GatherLastDim`` does it).
    """

    def __init__(self, in_features, out_features, bias=True, *, gather_output=False, sequence_parallel=False,
                 group=None, communicate_input=True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.group, self.communicate_input = group, communicate_input
        # BEGIN SOLUTION: Create this rank's slice of the weight and bias as the layout in the module docstring says.
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
        # BEGIN SOLUTION: Bring the input into the region unless told not to, apply this rank's slice of the layer, then gather the features if asked.
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
    on every rank; it enters the region through f and each rank uses its slice
    of the features. An ``in_features`` t does not divide raises ``ValueError``.
    With ``sequence_parallel`` the bias sees only this rank's sequence shard, so
    its gradient is partial: it carries ``sequence_parallel = True``.
    """

    def __init__(self, in_features, out_features, bias=True, *, input_is_parallel=True, sequence_parallel=False,
                 group=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel, self.group = input_is_parallel, sequence_parallel, group
        # BEGIN SOLUTION: Create this rank's columns of the weight and the whole bias; mark the bias when its gradient will be partial.
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
        # BEGIN SOLUTION: Take this rank's features if the input is whole, multiply without the bias, sum the partial products, then add the bias.
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
        # BEGIN SOLUTION: Pair a column layer that leaves its output split with a row layer that takes it split, both on this group.
        self.fc1 = ColumnParallelLinear(hidden, ffn_hidden, sequence_parallel=sequence_parallel, group=group)
        self.fc2 = RowParallelLinear(ffn_hidden, hidden, sequence_parallel=sequence_parallel, group=group)
        # END SOLUTION

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))  # the dense MLP's forward: the layers do the parallel work


class ParallelSelfAttention(torch.nn.Module):
    """Multi-head self-attention with the heads split across ranks.

    q, k and v are column-parallel (rank r computes heads r*n_heads/t ..),
    attention runs on the local heads only, and ``out`` is row-parallel. The
    input goes through f (or the sequence gather) once, for q, k and v, which
    are built with ``communicate_input=False``; only ``out`` takes
    ``sequence_parallel``. ``hidden`` not divisible by ``n_heads``, or
    ``n_heads`` by t, raises ``ValueError``. Head j of a ``[s, b, features]``
    projection is its features ``j*head_dim .. (j+1)*head_dim``; attention is
    ``F.scaled_dot_product_attention`` on ``[b, heads, s, head_dim]`` tensors,
    causal when ``causal``; the merged heads go back to ``[s, b, features]``
    in head order before ``out``.
    """

    def __init__(self, hidden, n_heads, *, causal=True, sequence_parallel=False, group=None):
        super().__init__()
        self.causal, self.sequence_parallel, self.group = causal, sequence_parallel, group
        # BEGIN SOLUTION: Split the heads across the ranks and build the four projections; q, k and v leave the input communication to the caller.
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
        # BEGIN SOLUTION: Communicate the input once, attend over this rank's heads only, then merge them and let the output layer sum the ranks.
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
    this rank's sequence shard ``[s/t, b, h]``; the LayerNorms run on the shard,
    so with ``sequence_parallel`` the weight and bias of both norms carry
    ``sequence_parallel = True`` (``False`` otherwise).
    """

    def __init__(self, hidden, n_heads, ffn_hidden, *, sequence_parallel=False, group=None):
        super().__init__()
        # BEGIN SOLUTION: Build the two norms, attention and the MLP on this group; mark the norms' parameters under sequence parallelism.
        self.ln1 = torch.nn.LayerNorm(hidden)
        self.attn = ParallelSelfAttention(hidden, n_heads, sequence_parallel=sequence_parallel, group=group)
        self.ln2 = torch.nn.LayerNorm(hidden)
        self.mlp = ParallelMLP(hidden, ffn_hidden, sequence_parallel=sequence_parallel, group=group)
        for norm in (self.ln1, self.ln2):
            for p in norm.parameters():
                p.sequence_parallel = sequence_parallel
        # END SOLUTION

    def forward(self, x):
        # BEGIN SOLUTION: A pre-norm residual block: add attention of the first norm of x to x, then add the MLP of the second norm of that.
        y = x + self.attn(self.ln1(x))
        return y + self.mlp(self.ln2(y))
        # END SOLUTION


def allreduce_sequence_parallel_grads(module, group=None):
    """Sum over the group the gradients of the parameters marked
    ``sequence_parallel`` (whole on every rank, applied to a sequence shard).
    The training loop calls it after backward, as DDP syncs gradients."""
    # BEGIN SOLUTION: Sum over the group the gradient of every marked parameter that has one.
    marked = [param for param in module.parameters() if getattr(param, "sequence_parallel", False)]
    for grad in [param.grad for param in marked if param.grad is not None]:
        dist.all_reduce(grad, group=group)
    # END SOLUTION


# --- 4. Vocabulary-parallel embedding and cross-entropy ------------------------------------


class VocabParallelEmbedding(torch.nn.Module):
    """Rank r holds embedding rows r*vocab/t .. (r+1)*vocab/t; ids of other ranks
    give zero rows here, and the all-reduce (g) fills them in.

    ``self.weight`` is ``[vocab/t, hidden]`` and ``self.start`` the first id this
    rank owns; a vocabulary t does not divide raises ``ValueError``. The output
    is ``[..., hidden]`` for ids ``[...]``, the same on every rank.
    """

    def __init__(self, vocab_size, hidden, *, group=None):
        super().__init__()
        self.group = group
        # BEGIN SOLUTION: Hold this rank's block of vocabulary rows and remember where the block starts.
        t, rank = dist.get_world_size(group), dist.get_rank(group)
        self.local = divide(vocab_size, t, "vocab_size")
        self.start = rank * self.local
        self.weight = _init_weight(self.local, hidden)
        # END SOLUTION

    def forward(self, ids):
        # BEGIN SOLUTION: Look up only the ids this rank owns, zero the rows of the others, and let the reduction fill them in.
        outside = (ids < self.start) | (ids >= self.start + self.local)
        local_ids = (ids - self.start).masked_fill(outside, 0)
        rows = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region(rows, self.group)
        # END SOLUTION


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits split along the vocabulary, without gathering them.

    Rank r's slice holds the logits of ids ``r*local .. (r+1)*local``. Forward
    all-reduces three per-token quantities (the max, with ``ReduceOp.MAX``; the
    sum of exponentials of the shifted logits; the target's shifted logit, zero
    on the ranks that do not own it) and returns the mean of
    ``log(sum_exp) - target_logit``. Backward needs no collective: it returns
    the gradient of the local logits and None for ``target`` and ``group``.
    """

    @staticmethod
    def forward(ctx, local_logits, target, group):
        # BEGIN SOLUTION: Shift by the global max, then combine the global sum of exponentials with the target's logit; keep what backward needs.
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
        # BEGIN SOLUTION: The softmax minus one at the targets this rank owns, scaled by the incoming gradient over the number of tokens.
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
