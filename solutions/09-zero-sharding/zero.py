"""Lab 09 — sharded data parallelism (ZeRO).

Plain data parallelism keeps a whole copy of the model, its gradients and its
optimizer state on every rank. ZeRO (Rajbhandari et al., 2020) cuts each of
them into N shards, one per rank, and gathers a full copy only for the moment
it is needed. You write three pieces:

1. ``zero_bytes(psi, n, stage, k=12)`` — bytes per rank of mixed-precision Adam
   training at ZeRO stage 0 (plain data parallelism), 1 (optimizer state
   sharded), 2 (+ gradients) or 3 (+ parameters), as in the paper's Figure 1;
   ``flatten_padded(tensors, n)`` — the flat, padded buffer every shard is cut from.
2. ``ShardedOptimizer`` — ZeRO stage 1: every rank keeps the optimizer state
   of its own shard only; ``step()`` reduce-scatters the gradients, updates the
   shard, and all-gathers the updated shards back into every rank's parameters.
3. ``Zero3Sequential`` — ZeRO stage 3: every rank stores only its shard of each
   layer's parameters; a layer's full parameters are all-gathered just before
   the layer runs and freed right after, in the forward pass and again in the
   backward pass, which reduce-scatters the layer's gradient into the shard.

The layout the grader relies on, for both classes: a list of tensors is
flattened in order (``torch.cat([t.reshape(-1) for t in tensors])``) and
zero-padded at the end to ``n * s`` elements, ``s = ceil(numel / n)``; rank r
owns elements ``[r * s, (r + 1) * s)``. Collectives: use
``dist.reduce_scatter_single`` and ``dist.all_gather_single`` (or their older
names ``reduce_scatter_tensor`` and ``all_gather_into_tensor``, deprecated
since torch 2.13), on the group you are given (``None``: the default group).
Every rank runs the same code (``course.dist.run`` starts them). Run the checks
with ``k2c grade 09``: it counts the bytes that cross between the ranks and
reads each rank's memory from outside its process, as the kernel counts them.
"""
import math

import torch
import torch.distributed as dist

# --- 1. Memory per rank, and the flat padded buffer ------------------------------------


def zero_bytes(psi, n, stage, k=12):
    """Bytes per rank to train a model of ``psi`` parameters on ``n`` ranks with
    mixed-precision Adam at ZeRO ``stage`` (0, 1, 2 or 3).

    Per parameter: 2 bytes of fp16 weights, 2 bytes of fp16 gradients and ``k``
    bytes of optimizer state (Adam: fp32 master weights, momentum and variance,
    k = 12). Stage 1 divides the optimizer state by ``n``, stage 2 also the
    gradients, stage 3 also the weights: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N
    for k = 12. Returns a float (bytes; the paper's GB are 1e9 bytes).
    """
    # BEGIN SOLUTION: Count weights, gradients and optimizer state per parameter, and divide by n the parts the stage shards.
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    weights, grads, state = 2.0 * psi, 2.0 * psi, float(k) * psi
    if stage >= 1:
        state /= n
    if stage >= 2:
        grads /= n
    if stage >= 3:
        weights /= n
    return weights + grads + state
    # END SOLUTION


def flatten_padded(tensors, n):
    """One new 1-D tensor: every element of ``tensors`` in order, then zeros up to
    ``n * ceil(numel / n)`` elements, so that it cuts into ``n`` equal shards.

    Dtype and device are those of the first tensor. ``numel`` is the total
    number of elements; when ``n`` divides it there is no padding. The inputs
    are copied (detached), never viewed: changing the result changes no input.
    """
    # BEGIN SOLUTION: Allocate the padded length in zeros, then copy each tensor's elements in order at a running offset.
    numel = sum(t.numel() for t in tensors)
    flat = torch.zeros(n * math.ceil(numel / n), dtype=tensors[0].dtype, device=tensors[0].device)
    offset = 0
    for t in tensors:
        flat[offset:offset + t.numel()] = t.detach().reshape(-1)
        offset += t.numel()
    return flat
    # END SOLUTION


# --- 2. ZeRO stage 1: a sharded optimizer -------------------------------------------------


class ShardedOptimizer:
    """ZeRO stage 1 around any torch optimizer: ``ShardedOptimizer(model.parameters(),
    torch.optim.Adam, lr=1e-3)``.

    Every rank holds the full model and computes full gradients on its own
    part of the batch, as in plain data parallelism. Optimizer state is kept
    for this rank's shard only:

    - ``__init__`` flattens the parameters with ``flatten_padded`` (world size
      n), keeps a copy of shard ``rank`` as ``self.shard`` (a new tensor of
      ``ceil(numel / n)`` elements, not a view of a full-size buffer), and
      creates the inner optimizer ``self.optimizer = optimizer_class([self.shard],
      **kwargs)``: its state (Adam's two moments) is shard-sized.
    - ``step()`` flattens the gradients the same way (a parameter without a
      gradient counts as zeros), reduce-scatters them — averaged over the n
      ranks, as data parallelism averages — into ``self.shard.grad``, steps the
      inner optimizer, then all-gathers the updated shards and copies them back
      into every parameter, so all ranks end with the same full parameters.
    - ``zero_grad()`` sets every parameter's ``.grad`` to None.

    The updated values are copied into the parameters in place (their storage
    stays the same), each from its own slice of the gathered flat buffer.

    The grader reads from outside what a rank still holds after a step beyond
    its model's parameters: the shard, its gradient and the inner optimizer's
    state of it, about 1/N of what the unsharded optimizer holds.
    """

    def __init__(self, params, optimizer_class, group=None, **kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        # BEGIN SOLUTION: Flatten and pad the parameters, keep a copy of this rank's shard, and give only that shard to the inner optimizer.
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.numel = sum(p.numel() for p in self.params)
        self.shard_size = math.ceil(self.numel / self.world)
        start = self.rank * self.shard_size
        flat = flatten_padded([p.detach() for p in self.params], self.world)
        self.shard = flat[start:start + self.shard_size].clone()  # a copy: the full flat buffer is freed
        self.optimizer = optimizer_class([self.shard], **kwargs)
        # END SOLUTION

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        # BEGIN SOLUTION: Average the gradients into this rank's shard, step the shard, then gather the shards and copy them into the parameters.
        grads = flatten_padded([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params],
                               self.world)
        grads /= self.world  # the sum over ranks becomes the average data parallelism takes
        shard_grad = torch.empty_like(self.shard)
        dist.reduce_scatter_single(shard_grad, grads, group=self.group)
        self.shard.grad = shard_grad
        self.optimizer.step()
        full = torch.empty(self.shard_size * self.world, dtype=self.shard.dtype, device=self.shard.device)
        dist.all_gather_single(full, self.shard, group=self.group)
        offset = 0
        for p in self.params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        # END SOLUTION


# --- 3. ZeRO stage 3: parameters gathered layer by layer --------------------------------


def gather_flat(shard, group=None):
    """Every rank's ``shard`` concatenated in rank order: the full padded flat
    buffer (``dist.all_gather_single``), a new tensor of ``n * shard.numel()``
    elements with the shard's dtype and device. The shard is sent detached
    and contiguous, so the gather is invisible to autograd."""
    # BEGIN SOLUTION: Allocate room for every rank's shard and gather them into it, in rank order.
    full = torch.empty(shard.numel() * dist.get_world_size(group), dtype=shard.dtype, device=shard.device)
    dist.all_gather_single(full, shard.detach().contiguous(), group=group)
    return full
    # END SOLUTION


def _run_layer(layer, names, shapes, full, x):
    """``layer(x)`` with its parameters taken from views of ``full``."""
    params, offset = {}, 0
    for name, shape in zip(names, shapes):
        size = math.prod(shape)
        params[name] = full[offset:offset + size].view(shape)
        offset += size
    return torch.func.functional_call(layer, params, (x,))


class GatheredLayer(torch.autograd.Function):
    """Run one layer whose parameters exist only as shards.

    ``GatheredLayer.apply(x, shard, layer, names, shapes, group)``. Forward:
    gather the full flat parameters, run the layer with them, let them go
    (nothing of them is saved for backward). Backward: gather them again,
    recompute the layer with autograd on, take the gradients with respect to
    ``x`` and to the full flat parameters, and reduce-scatter the latter
    (averaged over the ranks) into the shard's gradient.

    Only ``x`` and ``shard`` are saved (``ctx.save_for_backward``); the layer,
    names, shapes and group ride on ``ctx``. ``backward`` returns the gradients
    of ``x`` and ``shard`` and None for the four other arguments.
    """

    @staticmethod
    def forward(ctx, x, shard, layer, names, shapes, group):
        # BEGIN SOLUTION: Gather the parameters, run the layer with them, and save only what backward can re-gather from.
        full = gather_flat(shard, group)
        out = _run_layer(layer, names, shapes, full, x)
        ctx.save_for_backward(x, shard)
        ctx.layer, ctx.names, ctx.shapes, ctx.group = layer, names, shapes, group
        return out
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad_out):
        # BEGIN SOLUTION: Gather and recompute with autograd on, differentiate by input and parameters, then average the latter into the shard.
        x, shard = ctx.saved_tensors
        full = gather_flat(shard, ctx.group).requires_grad_()
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            out = _run_layer(ctx.layer, ctx.names, ctx.shapes, full, x)
        grad_x, grad_full = torch.autograd.grad(out, (x, full), grad_out)
        grad_full /= dist.get_world_size(ctx.group)
        grad_shard = torch.empty_like(shard)
        dist.reduce_scatter_single(grad_shard, grad_full, group=ctx.group)
        return grad_x, grad_shard, None, None, None, None
        # END SOLUTION


class Zero3Sequential(torch.nn.Module):
    """``torch.nn.Sequential(*layers)`` with every layer's parameters sharded (ZeRO stage 3).

    For each layer that has parameters, ``__init__`` flattens
    ``list(layer.parameters())`` with ``flatten_padded`` and keeps shard
    ``rank`` as a ``torch.nn.Parameter`` in ``self.shards`` (a
    ``torch.nn.ParameterList``, one entry per layer with parameters, in order);
    the layer's own parameters are emptied, so the full ones exist nowhere
    between uses. ``self.parameters()`` is then just the shards, and any
    torch optimizer on them steps this rank's shard only. ``self.specs`` has
    one entry per layer: None for a layer without parameters, otherwise
    ``(index into self.shards, parameter names, parameter shapes)`` in
    ``named_parameters()`` order; an emptied parameter keeps its dtype and
    device but holds no elements. ``forward`` runs the layers in order, each
    one with parameters through ``GatheredLayer``.
    """

    def __init__(self, layers, group=None):
        super().__init__()
        self.group = group
        self.layers = list(layers)  # a plain list: their emptied parameters are not the model's
        self.shards = torch.nn.ParameterList()
        self.specs = []  # per layer: None (no parameters) or (index in shards, names, shapes)
        # BEGIN SOLUTION: For each layer with parameters, record its layout, keep this rank's shard as a Parameter, and empty the originals.
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        for layer in self.layers:
            named = list(layer.named_parameters())
            if not named:
                self.specs.append(None)
                continue
            flat = flatten_padded([p.detach() for _, p in named], n)
            size = flat.numel() // n
            self.specs.append((len(self.shards), [name for name, _ in named], [tuple(p.shape) for _, p in named]))
            self.shards.append(torch.nn.Parameter(flat[rank * size:(rank + 1) * size].clone()))
            for _, p in named:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        # END SOLUTION

    def forward(self, x):
        # BEGIN SOLUTION: Run the layers in order, sending each one that has parameters through GatheredLayer.
        for layer, spec in zip(self.layers, self.specs):
            if spec is None:
                x = layer(x)
            else:
                index, names, shapes = spec
                x = GatheredLayer.apply(x, self.shards[index], layer, names, shapes, self.group)
        return x
        # END SOLUTION
