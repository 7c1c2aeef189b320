"""Lab 13 — hybrid parallelism: one GPT trained data- and tensor-parallel at once.

Lab 08 replicated a model over ranks (data parallelism, DP); lab 10 split each
layer's matrices over ranks (tensor parallelism, TP). A real job does both: its
``dp * tp`` ranks form a 2-D *device mesh*, a grid with ``dp`` rows and ``tp``
columns. Each row of the mesh holds ONE copy of the model, split over the row's
``tp`` ranks with lab 10's layers; each column holds the same shard on ``dp``
ranks, which average their gradients with lab 08's DDP. Rank ``d * tp + t``
sits at row ``d``, column ``t``::

        tp ->   t=0   t=1
    dp  d=0    r0    r1       tp groups: {r0, r1}, {r2, r3}  (activations, every layer)
     |  d=1    r2    r3       dp groups: {r0, r2}, {r1, r3}  (gradients, once per step)

This file composes YOUR lab 08 and lab 10 modules (``ddp.BucketedDDP``,
``tensor_parallel.ParallelTransformerLayer``, ``VocabParallelEmbedding``,
``vocab_parallel_cross_entropy``, ``copy_to_tensor_parallel_region``): when
graded, your ``08-data-parallel/ddp.py`` and ``10-tensor-parallel/tensor_parallel.py``
are copied next to this file. You write:

1. ``ParallelGPT`` — ``course.models.TinyGPT`` (read its docstring) split over
   the tp group: the vocabulary-parallel token embedding, whose weight is also
   the LM head (tied, as in TinyGPT), a whole position table, lab 10's
   transformer layers (``ffn_hidden = 4 * hidden``), a whole final LayerNorm,
   and the vocabulary-parallel cross-entropy. Activations are ``[seq, batch,
   hidden]`` (lab 10's layout); tokens and targets come in ``[batch, seq]``.
   A layer whose ``recompute`` entry is ``"full"`` runs under
   ``torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)``: only
   its input is kept, and it runs again during backward.
2. ``check_plan``, which refuses what run_plan cannot run (below), and
   ``run_plan(plan, model)`` — on every rank of an initialised process group
   of ``dp * tp`` ranks: the mesh, the model, lab 08's ``BucketedDDP`` over
   the dp group, and ``model["steps"]`` training steps with
   ``plan["microbatches"]`` gradient accumulation steps each, one
   ``optimizer.step()`` of a ``torch.optim`` optimizer per step.
   (``NaiveDDP`` gives the same numbers, but its one all-reduce per parameter
   pays the latency α each time; the cost model, and the grader's check of
   it against run_plan's measured step times, count the gradients as the few
   all-reduces of buckets.)

The plan and the model are the plain dicts the lab's cost model reads::

    plan = {"dp": 2, "tp": 2, "pp": 1, "microbatches": 1, "zero": 0, "schedule": "1f1b",
            "stages": [L], "recompute": ["none"] * L}
    model = {"layers": L, "hidden": h, "heads": a, "seq": s, "batch": B, "vocab": V,
             "dropout": 0.0, "precision": "fp32", "optimizer": "sgd",
             "steps": 2, "lr": 0.1, "seed": 0}          # these three: run_plan only, optional

``run_plan`` runs ``pp == 1`` and ``zero == 0`` only (pipelines are lab 11's
executor, ZeRO lab 09's, not composed here), ``recompute`` ``"none"`` or
``"full"`` per layer (``"selective"`` keeps part of a layer, which lab 10's
layers cannot), ``dropout == 0`` (lab 10's layers have none), precision
``"fp32"`` or ``"fp64"`` (float64, what the grader uses), optimizer ``"sgd"``,
``"sgd_momentum"`` (momentum 0.9) or ``"adam"`` (``torch.optim``'s, learning
rate ``model["lr"]``, by default 0.1 for SGD and 0.01 for Adam). Anything else,
a world size that is not ``dp * tp``, or sizes that do not divide raise
``ValueError`` before any communication.

Reproducible from the seed, so one process can check the run (the grader
does): the starting weights are those of ``dense_model(model)`` — after
``torch.manual_seed(seed)``, ``TinyGPT(GPTConfig(vocab, seq, hidden, heads,
layers, dropout))`` built in float32, then cast to the precision — and every
rank keeps its tp shard of them (``tp_shards``). The data are
``make_batches(model)``: ``torch.randint(0, V, (steps, B, s + 1))`` drawn from
``torch.Generator().manual_seed(seed + 1)``; step k's tokens are
``data[k, :, :-1]`` and its targets ``data[k, :, 1:]``. Step k's global batch
of B sequences is split in order: dp rank d takes sequences ``d*B/dp ..
(d+1)*B/dp``, and micro-batch i the i-th of ``microbatches`` equal consecutive
parts of those (any split into equal parts gives the same mean gradient).
Training on 4 ranks thus equals training TinyGPT in one process on the
whole batch, with the mean loss over its B*s tokens.

``run_plan`` returns, on every rank::

    {"losses": [float, ...],      # per step: the mean loss over the global batch (before the update)
     "step_time_s": float,        # mean seconds per step after the first (the slowest rank's)
     "parameters": {name: tensor},  # after the last step: this rank's shard of each TinyGPT parameter
     "dp_rank": d, "tp_rank": t}

``parameters`` is keyed by ``TinyGPT``'s parameter names, each value this
rank's part of that dense parameter as ``tp_shards`` cuts it. Grade with
``k2c grade 13`` from the repository root.
"""
import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from course.models import GPTConfig, TinyGPT
from course.siblings import import_lab_module

# Graded, your lab 08 and lab 10 files sit beside this one (a plain import finds them); in the
# handout and in solutions/ they are in the sibling folders ../08-data-parallel and ../10-tensor-parallel.
ddp = import_lab_module(__file__, "08-data-parallel", "ddp")
tensor_parallel = import_lab_module(__file__, "10-tensor-parallel", "tensor_parallel")

DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
OPTIMIZERS = ("sgd", "sgd_momentum", "adam")
DEFAULT_LR = {"sgd": 0.1, "sgd_momentum": 0.1, "adam": 0.01}
RECOMPUTE = ("none", "full")


# --- given: the dense model, the data, and how a tp rank's shards are cut ------------------------


def dense_model(model):
    """The single-process TinyGPT every rank starts from (see the module docstring)."""
    config = GPTConfig(vocab=model["vocab"], seq=model["seq"], hidden=model["hidden"], heads=model["heads"],
                       layers=model["layers"], dropout=model["dropout"])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        torch.manual_seed(model.get("seed", 0))
        gpt = TinyGPT(config)
    finally:
        torch.set_default_dtype(previous)
    return gpt.to(DTYPES[model["precision"]])


def make_batches(model):
    """``(tokens, targets)``, each int64 ``[steps, batch, seq]``: the targets are the next tokens."""
    generator = torch.Generator().manual_seed(model.get("seed", 0) + 1)
    data = torch.randint(0, model["vocab"], (model.get("steps", 2), model["batch"], model["seq"] + 1),
                         generator=generator)
    return data[..., :-1], data[..., 1:]


def tp_shards(dense, tp_rank, tp):
    """``{name: tensor}``: tp rank ``tp_rank``'s part of each parameter of the dense TinyGPT.

    Split by rows (lab 10's column-parallel layers, the vocabulary): ``tok.weight``
    (rows ``r*V/t ..``), ``fc1.weight`` and ``fc1.bias``; ``qkv.weight`` and
    ``qkv.bias`` are q, k and v stacked, each split by rows (heads ``r*a/t ..``),
    so rank r's part is its rows of q, then of k, then of v. Split by columns
    (row-parallel): ``proj.weight`` and ``fc2.weight``. Every other parameter
    (position table, LayerNorms, the row layers' biases) is whole.
    """
    def rows(tensor):
        part = tensor.shape[0] // tp
        return tensor[tp_rank * part:(tp_rank + 1) * part]

    shards = {}
    for name, param in dense.named_parameters():
        p = param.detach()
        if name == "tok.weight" or name.endswith(("fc1.weight", "fc1.bias")):
            shards[name] = rows(p)
        elif name.endswith(("qkv.weight", "qkv.bias")):
            shards[name] = torch.cat([rows(part) for part in p.chunk(3)])
        elif name.endswith(("proj.weight", "fc2.weight")):
            shards[name] = rows(p.t()).t()
        else:
            shards[name] = p
    return shards


# --- 1. the GPT, split over the tp group --------------------------------------------------------------


class ParallelGPT(torch.nn.Module):
    """TinyGPT over the tp group ``group``; ``forward(tokens, targets)`` is the mean loss."""

    def __init__(self, model, group, recompute):
        super().__init__()
        self.group, self.recompute = group, list(recompute)
        h, V, s = model["hidden"], model["vocab"], model["seq"]
        raise NotImplementedError('not implemented yet: __init__: build the parts item 1 of the module docstring names, from your lab 10 modules')

    def forward(self, tokens, targets):
        """Mean cross-entropy over the tokens of ``tokens`` ``[b, s]`` against ``targets`` ``[b, s]``."""
        raise NotImplementedError("not implemented yet: forward: follow TinyGPT's forward, with lab 10's pieces wherever the vocabulary is split")

    def _parameters_of(self):
        """{TinyGPT name: [parameters of this module whose concatenation is its shard]}."""
        found = {"tok.weight": [self.tok.weight], "pos": [self.pos],
                 "ln_f.weight": [self.ln_f.weight], "ln_f.bias": [self.ln_f.bias]}
        for i, block in enumerate(self.blocks):
            attn, mlp, prefix = block.attn, block.mlp, f"blocks.{i}."
            for dense, part in (("ln1", block.ln1), ("ln2", block.ln2), ("proj", attn.out), ("fc1", mlp.fc1),
                                ("fc2", mlp.fc2)):
                found[prefix + dense + ".weight"], found[prefix + dense + ".bias"] = [part.weight], [part.bias]
            found[prefix + "qkv.weight"] = [attn.q.weight, attn.k.weight, attn.v.weight]
            found[prefix + "qkv.bias"] = [attn.q.bias, attn.k.bias, attn.v.bias]
        return found

    def load_shards(self, shards):
        """Copy ``tp_shards(...)`` into this module's parameters."""
        with torch.no_grad():
            for name, params in self._parameters_of().items():
                for param, part in zip(params, shards[name].split([p.shape[0] for p in params])):
                    param.copy_(part)

    def shards(self):
        """``{TinyGPT name: this rank's shard}``, as ``tp_shards`` cuts them (copies)."""
        return {name: torch.cat([p.detach() for p in params]).clone()
                for name, params in self._parameters_of().items()}


# --- 2. the training run --------------------------------------------------------------------------------


def check_plan(plan, model, world):
    """Raise ValueError for what ``run_plan`` does not run (see the module docstring)."""
    dp, tp, m, L = plan["dp"], plan["tp"], plan.get("microbatches", 1), model["layers"]
    raise NotImplementedError('not implemented yet: check_plan: refuse each case the module docstring rules out, saying why')


def make_optimizer(model, params):
    kind = model.get("optimizer", "sgd")
    lr = model.get("lr", DEFAULT_LR[kind])
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=0.9 if kind == "sgd_momentum" else 0.0)


def run_plan(plan, model):
    """Train ``model`` on this process group by ``plan``; see the module docstring."""
    check_plan(plan, model, dist.get_world_size())
    dp, tp, m = plan["dp"], plan["tp"], plan.get("microbatches", 1)
    steps, dtype = model.get("steps", 2), DTYPES[model["precision"]]
    recompute = plan.get("recompute", ["none"] * model["layers"])
    raise NotImplementedError("not implemented yet: run_plan: set up the mesh, then this rank's shard of the model, as item 2 of the docstring says")

    tokens, targets = make_batches(model)
    per_rank = model["batch"] // dp
    micro = per_rank // m
    losses, times = [], []
    raise NotImplementedError("not implemented yet: run_plan: accumulate this replica's microbatches and synchronise the gradients only once a step")
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the same number on every rank
    timed = slowest[1:] if steps > 1 else slowest
    return {"losses": losses, "step_time_s": float(timed.mean()), "parameters": net.shards(),
            "dp_rank": dp_rank, "tp_rank": tp_rank}
