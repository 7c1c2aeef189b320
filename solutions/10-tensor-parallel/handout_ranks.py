"""What the handout runs on every rank: your tensor-parallel layers next to
the same dense layers of torch, with the collectives each one makes.

You do not need to edit this file. ``course.dist.run(try_tensor_parallel, t)``
returns, per rank, ``{part: {...}}`` for the parts ``mlp``, ``layer``
(tensor parallel), ``layer_sp`` (sequence parallel) and ``cross_entropy``:
the largest difference from the dense model in the output and in any
gradient, and the collectives called in forward and in backward. A part you
have not written yet comes back as ``{"not_written": message}``.
"""
import contextlib

import torch
import torch.distributed as dist
from torch import nn

HIDDEN, HEADS, FFN, SEQ, BATCH, VOCAB = 16, 4, 32, 8, 2, 12


@contextlib.contextmanager
def counting_collectives(counts):
    """Count calls of the three collectives the lab uses: {name: [calls, elements]}.
    The older names (deprecated since torch 2.13) count under the new ones."""
    names = {"all_reduce": "all_reduce", "all_gather_single": "all_gather_single",
             "reduce_scatter_single": "reduce_scatter_single",
             "all_gather_into_tensor": "all_gather_single", "reduce_scatter_tensor": "reduce_scatter_single"}
    originals = {name: getattr(dist, name) for name in names}

    def counted(name):
        def call(*args, **kwargs):
            whole = args[1] if names[name] == "reduce_scatter_single" else args[0]  # the unsharded tensor
            entry = counts.setdefault(names[name], [0, 0])
            entry[0] += 1
            entry[1] += whole.numel()
            return originals[name](*args, **kwargs)
        return call
    for name in names:
        setattr(dist, name, counted(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def random_dense(module, seed):
    """Random values everywhere (torch starts attention biases at 0, LayerNorms at 1 and 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5 if p.dim() == 2 else 0.5))
    return module


def rows(total):
    """This rank's slice of ``total`` rows (or features, or sequence positions)."""
    size = total // dist.get_world_size()
    return slice(dist.get_rank() * size, (dist.get_rank() + 1) * size)


def load_column(mod, weight, bias, offset=0, out=None):
    """Rows ``offset + rank*out/t ..`` of ``weight`` (rows offset .. offset+out are this layer's)."""
    out = out or weight.shape[0]
    part = rows(out)
    part = slice(offset + part.start, offset + part.stop)
    mod.weight.data.copy_(weight[part])
    mod.bias.data.copy_(bias[part])
    return [(mod.weight, weight, (part,)), (mod.bias, bias, (part,))]


def load_row(mod, weight, bias):
    mod.weight.data.copy_(weight[:, rows(weight.shape[1])])
    mod.bias.data.copy_(bias)
    return [(mod.weight, weight, (slice(None), rows(weight.shape[1]))), (mod.bias, bias, (Ellipsis,))]


def load_layer(mod, dense):
    """Copy this rank's slices of an ``nn.TransformerEncoderLayer`` into a ParallelTransformerLayer;
    returns (your parameter, dense parameter, slice) triples to compare gradients."""
    h, pairs = HIDDEN, []
    for mine, theirs in ((mod.ln1, dense.norm1), (mod.ln2, dense.norm2)):
        for name in ("weight", "bias"):
            getattr(mine, name).data.copy_(getattr(theirs, name))
            pairs.append((getattr(mine, name), getattr(theirs, name), (Ellipsis,)))
    w, b = dense.self_attn.in_proj_weight, dense.self_attn.in_proj_bias
    for i, name in enumerate("qkv"):  # in_proj_weight stacks q, k and v: [3h, h]
        pairs += load_column(getattr(mod.attn, name), w, b, offset=i * h, out=h)
    pairs += load_row(mod.attn.out, dense.self_attn.out_proj.weight, dense.self_attn.out_proj.bias)
    pairs += load_column(mod.mlp.fc1, dense.linear1.weight, dense.linear1.bias)
    pairs += load_row(mod.mlp.fc2, dense.linear2.weight, dense.linear2.bias)
    return pairs


def compare(dense_fn, make, x, in_part, out_part, sync=None):
    """Run ``make()`` (your module, its (param, dense param, slice) triples) on ``x[in_part]``
    and the dense function on ``x``; the largest differences and the collectives."""
    upstream = torch.randn(dense_fn(x).shape, generator=torch.Generator().manual_seed(7))
    x_dense = x.clone().requires_grad_()
    dense_fn(x_dense).backward(upstream)
    module, pairs = make()
    x_mine = x[in_part].clone().requires_grad_()
    forward, backward = {}, {}
    with counting_collectives(forward):
        y = module(x_mine)
    with counting_collectives(backward):
        y.backward(upstream[out_part])
    if sync is not None:
        sync(module)
    want = dense_fn(x)
    grad_diff = max(float((x_mine.grad - x_dense.grad[in_part]).abs().max()),
                    *(float((p.grad - full.grad[part]).abs().max()) for p, full, part in pairs))
    return {"output_diff": float((y - want[out_part]).abs().max()), "grad_diff": grad_diff,
            "forward": forward, "backward": backward}


def _mlp(tp):
    torch.manual_seed(0)
    dense = random_dense(nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN)), 1)

    def make():
        mod = tp.ParallelMLP(HIDDEN, FFN)
        return mod, load_column(mod.fc1, dense[0].weight, dense[0].bias) + load_row(mod.fc2, dense[2].weight,
                                                                                  dense[2].bias)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(3))
    return compare(dense, make, x, (Ellipsis,), (Ellipsis,))


def _layer(tp, sequence_parallel):
    dense = random_dense(nn.TransformerEncoderLayer(HIDDEN, HEADS, FFN, dropout=0.0, activation="gelu",
                                                    norm_first=True), 2)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)  # causal

    def make():
        mod = tp.ParallelTransformerLayer(HIDDEN, HEADS, FFN, sequence_parallel=sequence_parallel)
        return mod, load_layer(mod, dense)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(4))
    part = (rows(SEQ),) if sequence_parallel else (Ellipsis,)
    sync = tp.allreduce_sequence_parallel_grads if sequence_parallel else None
    return compare(lambda x: dense(x, src_mask=mask), make, x, part, part, sync)


def _cross_entropy(tp):
    g = torch.Generator().manual_seed(5)
    logits, target = torch.randn(SEQ, BATCH, VOCAB, generator=g), torch.randint(0, VOCAB, (SEQ, BATCH), generator=g)
    dense = logits.clone().requires_grad_()
    want = nn.functional.cross_entropy(dense.reshape(-1, VOCAB), target.reshape(-1))
    want.backward()
    mine = logits[..., rows(VOCAB)].clone().requires_grad_()
    loss = tp.vocab_parallel_cross_entropy(mine, target)
    loss.backward()
    return {"output_diff": float((loss - want).abs()),
            "grad_diff": float((mine.grad - dense.grad[..., rows(VOCAB)]).abs().max()), "forward": {},
            "backward": {}}


def try_tensor_parallel():
    """Every part on this rank; see the module docstring."""
    import tensor_parallel as tp

    torch.set_default_dtype(torch.float64)
    out = {}
    for name, part in (("mlp", _mlp), ("layer", lambda tp: _layer(tp, False)),
                       ("layer_sp", lambda tp: _layer(tp, True)), ("cross_entropy", _cross_entropy)):
        try:
            out[name] = part(tp)
        except NotImplementedError as err:  # a stub: every rank raises before any collective
            out[name] = {"not_written": str(err)}
    return out
