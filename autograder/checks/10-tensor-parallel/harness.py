"""Grader code that runs next to the student's ``tensor_parallel`` module in the sandbox.

``cases_job(t)`` runs every case on ``t`` ranks in one ``course.dist`` job
(starting torch processes is the slow part). Before the student's module is
imported, ``CollectiveLog`` wraps the collectives of ``torch.distributed``
(all_reduce, all_gather_single, reduce_scatter_single, their older names
all_gather_into_tensor and reduce_scatter_tensor, all_gather, reduce_scatter,
broadcast) to record ``(kind, elements, phase)`` for every
call made while the harness runs a forward or a backward pass.

Each case builds, on every rank from a fixed seed, a dense float64 model out
of torch's own modules (``nn.Linear``, ``nn.MultiheadAttention``,
``nn.TransformerEncoderLayer`` with ``norm_first=True``, ``nn.Embedding``,
``F.cross_entropy``), builds the student's module, copies the rank's
documented slice of every dense parameter into it (``bind``: a shape that is
not the documented one is reported, never guessed at), runs both on the same
input and upstream gradient, and records (got, want) arrays for the output,
the gradient of the input and the gradient of every parameter shard (the
dense gradient sliced the same way). Sequence-parallel cases feed the rank's
sequence shard and call ``allreduce_sequence_parallel_grads`` after backward.
It also records the largest tensor reachable from the student's module and
the largest tensor saved for backward during its forward
(``saved_tensors_hooks``), next to the element count of the smallest full
weight matrix of that layer. ``course.torch_audit.OpLog`` watches every
operator the student's forward and backward run (modules and the
cross-entropy): the largest tensor any of them makes, factories included, kept
or not, and the collectives as torch's process group sees them (whichever API
called them).

Each rank writes a file per case as soon as it is done (``save_record``), so
when a rank raises or the job hangs the first unfinished case is reported and
the rest run again (``run_cases``). A stub (``NotImplementedError``) and a
parameter of the wrong shape are recorded per case on every rank alike.
"""
import contextlib
import functools
import inspect

from autograder.grading.checking import rank_records, run_cases, save_record
from course import dist as launcher

SEED = 2026
HIDDEN, HEADS, FFN, SEQ, BATCH, VOCAB = 32, 8, 48, 8, 2, 24
# Activations [SEQ, BATCH, HIDDEN] have 512 elements and [SEQ, BATCH, FFN] 768, fewer than the
# full weights of their layers (HIDDEN^2 = 1024, HIDDEN * FFN = 1536, VOCAB * HIDDEN = 768), and a
# shard of the MLP's weights (768 or 384) is smaller than attention's: a tensor that large is a weight.
ODD_HIDDEN, ODD_HEADS = 24, 6  # 6 heads: divisible by 2, not by 4
JOB_TIMEOUT_S = 40  # a correct job takes a few seconds; a deadlock ends sooner, when the job idles

OPERATORS = ("op_f", "op_g", "op_gather", "op_reduce_scatter")
MODULES = ("column", "column_gather", "row", "row_whole_input", "mlp", "mlp_sp", "attention_causal",
           "attention_full", "layer_tp", "layer_sp", "embedding")
CASES = OPERATORS + MODULES + ("cross_entropy", "heads_indivisible", "linear_indivisible")

# The old names (deprecated in torch 2.13) call the new ones inside distributed_c10d, not through
# torch.distributed, where these are wrapped: each call is recorded once, under either name.
COLLECTIVES = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
               "reduce_scatter_tensor", "all_gather", "reduce_scatter", "broadcast")
KIND = {"all_reduce": "all-reduce", "broadcast": "broadcast", "all_gather_single": "all-gather",
        "all_gather_into_tensor": "all-gather", "all_gather": "all-gather", "reduce_scatter_single": "reduce-scatter",
        "reduce_scatter_tensor": "reduce-scatter", "reduce_scatter": "reduce-scatter"}


# --- the collective recorder ----------------------------------------------------------------

def _elements(op, bound):
    """Elements of the whole (unsharded) tensor a collective call moves."""
    a = bound.arguments
    if op in ("all_reduce", "broadcast"):
        return a["tensor"].numel()
    if op in ("all_gather_single", "all_gather_into_tensor"):
        return a["output_tensor"].numel()
    if op in ("reduce_scatter_single", "reduce_scatter_tensor"):
        return a["input"].numel()
    if op == "all_gather":
        return sum(t.numel() for t in a["tensor_list"])
    return sum(t.numel() for t in a["input_list"])  # reduce_scatter


class CollectiveLog:
    """Wraps the collectives of ``module`` (``torch.distributed``) in place.
    ``calls`` gets ``(kind, elements, phase)`` for each call made inside
    ``with log.phase(name)``; calls outside a phase are not recorded."""

    def __init__(self, module):
        self.module, self.calls, self.current, self.originals = module, [], None, {}

    def install(self):
        for op in COLLECTIVES:
            original = getattr(self.module, op)
            self.originals[op] = original
            setattr(self.module, op, self._wrap(op, original))
        return self

    def uninstall(self):
        for op, original in self.originals.items():
            setattr(self.module, op, original)

    def _wrap(self, op, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            if self.current is not None:
                self.calls.append((KIND[op], _elements(op, signature.bind(*args, **kwargs)), self.current))
            return original(*args, **kwargs)
        return recorded

    @contextlib.contextmanager
    def phase(self, name):
        before, self.current = self.current, name
        try:
            yield
        finally:
            self.current = before


def tally(calls, phase):
    """{"kind of elements": count} of the calls recorded in ``phase``."""
    counts = {}
    for kind, elements, where in calls:
        if where == phase:
            key = f"{kind} of {elements}"
            counts[key] = counts.get(key, 0) + 1
    return counts


# --- loading the dense weights into the student's module ---------------------------------

class LoadError(Exception):
    """The student's parameter is missing or not the documented shard."""


class Binding:
    """A student parameter and the slice ``index`` of a dense parameter it must equal."""

    def __init__(self, label, student, dense, index):
        self.label, self.student, self.dense, self.index = label, student, dense, index


def bind(label, owner, attr, dense, index, what, how, rank):
    """Copy ``dense[index]`` into ``owner.<attr>``: a Binding, or LoadError that says
    what shape was expected. ``how`` says how the dense tensor is split ("whole" when it
    is not); ``what`` names it ("weight", "bias")."""
    import torch

    got = getattr(owner, attr, None)
    want = dense.detach()[index]
    if how == "whole":
        expected = f"the {what} is whole on every rank: {tuple(want.shape)}"
    else:
        expected = f"rank {rank}'s shard of a {how[1]} {what} split by {how[0]} is {tuple(want.shape)}"
    if not isinstance(got, torch.Tensor):
        raise LoadError(f"{label} is {got!r}, expected a parameter; {expected}")
    if tuple(got.shape) != tuple(want.shape):
        raise LoadError(f"{label} has shape {tuple(got.shape)}; {expected}")
    if got.dtype != torch.float64:
        raise LoadError(f"{label} is {got.dtype}, expected torch.float64: create parameters in torch's default "
                        "dtype (the grader sets it to float64)")
    with torch.no_grad():
        got.copy_(want)
    return Binding(label, got, dense, index)


def _child(owner, label, name):
    child = getattr(owner, name, None)
    if child is None:
        raise LoadError(f"{label} has no .{name}; the grader loads weights into the submodules the module "
                        "docstring names")
    return child


def _part(total, rank, t):
    size = total // t
    return slice(rank * size, (rank + 1) * size)


def bind_column(label, mod, weight, bias, rank, t, offset=0, out=None):
    """Rows ``rank*out/t ..`` of a dense [out, in] weight (rows offset .. offset+out of ``weight``)."""
    out = out or weight.shape[0]
    rows = slice(offset + rank * out // t, offset + (rank + 1) * out // t)
    shape = (out, weight.shape[1])
    found = [bind(f"{label}.weight", mod, "weight", weight, (rows,), "weight", ("output features", shape), rank)]
    if bias is not None:
        found.append(bind(f"{label}.bias", mod, "bias", bias, (rows,), "bias", ("output features", (out,)), rank))
    return found


def bind_row(label, mod, weight, bias, rank, t):
    cols = _part(weight.shape[1], rank, t)
    found = [bind(f"{label}.weight", mod, "weight", weight, (slice(None), cols), "weight",
                  ("input features", tuple(weight.shape)), rank)]
    if bias is not None:
        found.append(bind(f"{label}.bias", mod, "bias", bias, (Ellipsis,), "bias", "whole", rank))
    return found


def bind_layernorm(label, mod, norm, rank):
    return [bind(f"{label}.{name}", mod, name, getattr(norm, name), (Ellipsis,), name, "whole", rank)
            for name in ("weight", "bias")]


def bind_mlp(label, mod, fc1, fc2, rank, t):
    return (bind_column(f"{label}.fc1", _child(mod, label, "fc1"), fc1.weight, fc1.bias, rank, t)
            + bind_row(f"{label}.fc2", _child(mod, label, "fc2"), fc2.weight, fc2.bias, rank, t))


def bind_attention(label, mod, mha, rank, t):
    h, found = mha.embed_dim, []
    for i, name in enumerate("qkv"):  # in_proj_weight stacks the q, k and v weights: [3h, h]
        found += bind_column(f"{label}.{name}", _child(mod, label, name), mha.in_proj_weight, mha.in_proj_bias,
                             rank, t, offset=i * h, out=h)
    return found + bind_row(f"{label}.out", _child(mod, label, "out"), mha.out_proj.weight, mha.out_proj.bias,
                            rank, t)


def bind_layer(label, mod, enc, rank, t):
    return (bind_layernorm(f"{label}.ln1", _child(mod, label, "ln1"), enc.norm1, rank)
            + bind_attention(f"{label}.attn", _child(mod, label, "attn"), enc.self_attn, rank, t)
            + bind_layernorm(f"{label}.ln2", _child(mod, label, "ln2"), enc.norm2, rank)
            + bind_mlp(f"{label}.mlp", _child(mod, label, "mlp"), enc.linear1, enc.linear2, rank, t))


# --- what the student's module holds --------------------------------------------------------

def largest_held(root, student_module="tensor_parallel"):
    """(elements, path) of the largest tensor reachable from ``root``: through modules,
    dicts, lists, tuples and objects of the student's module (gradients not followed)."""
    import torch

    seen, best, todo = set(), (0, ""), [(root, type(root).__name__)]
    while todo:
        obj, path = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            best = max(best, (obj.numel(), path))
        elif isinstance(obj, torch.nn.Module):
            todo.append((vars(obj), path))
        elif isinstance(obj, dict):
            todo.extend((v, f"{path}.{k}" if not str(k).startswith("_") else path) for k, v in obj.items())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend((v, f"{path}[{i}]") for i, v in enumerate(obj))
        elif type(obj).__module__ == student_module and hasattr(obj, "__dict__"):
            todo.append((vars(obj), path))
    return best


class SavedWatch:
    """Inside ``with``, the largest tensor autograd saves for backward: (elements, shape)."""

    def __init__(self):
        self.largest = (0, ())

    def __enter__(self):
        import torch

        def pack(tensor):
            self.largest = max(self.largest, (tensor.numel(), tuple(tensor.shape)))
            return tensor

        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


# --- the cases ----------------------------------------------------------------------------------

def _np(tensor):
    return None if tensor is None else tensor.detach().cpu().numpy().copy()


def _operator_case(student, name, rank, t, log):
    """Forward and backward of one conjugate operator against the math, with every
    rank's input and upstream gradient known to every rank (seeded by rank), and
    the collectives each pass made."""
    import torch

    rows = 2
    shape_in = {"op_gather": (rows, 3, 5), "op_reduce_scatter": (rows * t, 3, 5)}.get(name, (4, 3, 5))
    shape_out = {"op_gather": (rows * t, 3, 5), "op_reduce_scatter": (rows, 3, 5)}.get(name, (4, 3, 5))
    xs = [torch.randn(shape_in, generator=torch.Generator().manual_seed(SEED + r)) for r in range(t)]
    ups = [torch.randn(shape_out, generator=torch.Generator().manual_seed(SEED + 100 + r)) for r in range(t)]
    mine = slice(rank * rows, (rank + 1) * rows)
    want_out, want_grad = {
        "op_f": (xs[rank], sum(ups)),
        "op_g": (sum(xs), ups[rank]),
        "op_gather": (torch.cat(xs), sum(ups)[mine]),
        "op_reduce_scatter": (sum(xs)[mine], torch.cat(ups)),
    }[name]
    function = {"op_f": "copy_to_tensor_parallel_region", "op_g": "reduce_from_tensor_parallel_region",
                "op_gather": "gather_from_sequence_parallel_region",
                "op_reduce_scatter": "reduce_scatter_to_sequence_parallel_region"}[name]
    x = xs[rank].clone().requires_grad_()
    with log.phase("forward"):
        out = getattr(student, function)(x)
    arrays = {"output": (_np(out), _np(want_out))}
    if tuple(out.shape) == shape_out and out.requires_grad:
        with log.phase("backward"):
            out.backward(ups[rank])
        arrays["gradient of the input"] = (_np(x.grad), _np(want_grad))
    else:
        arrays["gradient of the input"] = (None, _np(want_grad))
    return {"arrays": arrays, "function": function,
            "forward": tally(log.calls, "forward"), "backward": tally(log.calls, "backward")}


def _causal_mask(s):
    import torch

    return torch.ones(s, s, dtype=torch.bool).triu(1)  # True: may not attend


def _randn(*shape, salt=0):
    """The same numbers on every rank, whatever the student's code draws from torch's global generator."""
    import torch

    return torch.randn(shape, generator=torch.Generator().manual_seed(SEED + 1000 * salt + sum(shape)))


def _dense(module):
    """``module`` with every parameter drawn at random: torch starts attention biases at 0
    and LayerNorms at 1 and 0, values under which a misplaced bias or scale goes unseen."""
    import torch

    with torch.no_grad():
        for p in module.parameters():  # matrices scaled by 1/sqrt(fan in), vectors by 0.5
            p.copy_(torch.randn(p.shape) * (p.shape[-1] ** -0.5 if p.dim() == 2 else 0.5))
    return module


def _module_setup(student, name, rank, t):
    """(student module, dense function, bindings, input, upstream, input index, output index,
    sync, smallest full weight) for case ``name``."""
    import torch
    from torch import nn

    seq = (slice(rank * SEQ // t, (rank + 1) * SEQ // t),)
    features = lambda n: (Ellipsis, _part(n, rank, t))  # noqa: E731
    whole = (Ellipsis,)
    x = _randn(SEQ, BATCH, HIDDEN)
    sync = None
    if name in ("column", "column_gather"):
        dense = _dense(nn.Linear(HIDDEN, FFN))
        mod = student.ColumnParallelLinear(HIDDEN, FFN, gather_output=name == "column_gather")
        bound = bind_column("ColumnParallelLinear", mod, dense.weight, dense.bias, rank, t)
        out_index = whole if name == "column_gather" else features(FFN)
        return mod, dense, bound, x, _randn(SEQ, BATCH, FFN, salt=1), whole, out_index, sync, FFN * HIDDEN
    if name in ("row", "row_whole_input"):
        dense = _dense(nn.Linear(FFN, HIDDEN))
        parallel = name == "row"
        mod = student.RowParallelLinear(FFN, HIDDEN, input_is_parallel=parallel)
        bound = bind_row("RowParallelLinear", mod, dense.weight, dense.bias, rank, t)
        x = _randn(SEQ, BATCH, FFN)
        return mod, dense, bound, x, _randn(SEQ, BATCH, HIDDEN, salt=1), features(FFN) if parallel else whole, \
            whole, sync, FFN * HIDDEN
    if name in ("mlp", "mlp_sp"):
        dense = _dense(nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN)))
        sp = name == "mlp_sp"
        mod = student.ParallelMLP(HIDDEN, FFN, sequence_parallel=sp)
        bound = bind_mlp("ParallelMLP", mod, dense[0], dense[2], rank, t)
        if sp:
            sync = student.allreduce_sequence_parallel_grads
        index = seq if sp else whole
        return mod, dense, bound, x, _randn(SEQ, BATCH, HIDDEN, salt=1), index, index, sync, FFN * HIDDEN
    if name.startswith("attention"):
        mha = _dense(nn.MultiheadAttention(HIDDEN, HEADS))
        causal = name == "attention_causal"
        mask = _causal_mask(SEQ) if causal else None
        dense = lambda x: mha(x, x, x, attn_mask=mask, need_weights=False)[0]  # noqa: E731
        mod = student.ParallelSelfAttention(HIDDEN, HEADS, causal=causal)
        bound = bind_attention("ParallelSelfAttention", mod, mha, rank, t)
        return mod, dense, bound, x, _randn(SEQ, BATCH, HIDDEN, salt=1), whole, whole, sync, HIDDEN * HIDDEN
    if name in ("layer_tp", "layer_sp"):
        enc = _dense(nn.TransformerEncoderLayer(HIDDEN, HEADS, FFN, dropout=0.0, activation="gelu",
                                                norm_first=True))
        dense = lambda x: enc(x, src_mask=_causal_mask(SEQ))  # noqa: E731
        sp = name == "layer_sp"
        mod = student.ParallelTransformerLayer(HIDDEN, HEADS, FFN, sequence_parallel=sp)
        bound = bind_layer("ParallelTransformerLayer", mod, enc, rank, t)
        if sp:
            sync = student.allreduce_sequence_parallel_grads
        index = seq if sp else whole
        return mod, dense, bound, x, _randn(SEQ, BATCH, HIDDEN, salt=1), index, index, sync, HIDDEN * HIDDEN
    if name == "embedding":
        dense = _dense(nn.Embedding(VOCAB, HIDDEN))
        mod = student.VocabParallelEmbedding(VOCAB, HIDDEN)
        bound = [bind("VocabParallelEmbedding.weight", mod, "weight", dense.weight, (_part(VOCAB, rank, t),),
                      "weight", ("vocabulary rows", (VOCAB, HIDDEN)), rank)]
        ids = torch.randint(0, VOCAB, (SEQ, BATCH), generator=torch.Generator().manual_seed(SEED + 1))
        return mod, dense, bound, ids, _randn(SEQ, BATCH, HIDDEN, salt=1), whole, whole, sync, VOCAB * HIDDEN
    raise KeyError(name)


def _made(ops):
    """What the operators ``ops`` (an OpLog) saw: the largest tensor made, as [elements,
    shape], and each phase's collectives [[kind, elements], ...] in order."""
    return {"made": [ops.largest[0], list(ops.largest[1])],
            "dispatched": {phase: [[kind, n] for kind, n, p in ops.events
                                   if p == phase and kind not in ("compute", "wait")]
                           for phase in ("forward", "backward")}}


def _module_case(student, name, rank, t, log):
    import torch

    from course.torch_audit import OpLog

    torch.manual_seed(SEED + CASES.index(name))
    mod, dense, bound, x, upstream, in_index, out_index, sync, limit = _module_setup(student, name, rank, t)
    differentiable = x.is_floating_point()
    x_dense = x.clone().requires_grad_(differentiable)
    y_dense = dense(x_dense)
    y_dense.backward(upstream)
    x_mine = x[in_index].clone().requires_grad_(differentiable)
    upstream_mine = upstream[out_index]
    ops = OpLog()  # entered around the student's passes only: the grader's own tensors are not counted
    launcher.mark(f"{name}:start")  # what each pass sends, counted by the launcher
    with SavedWatch() as saved, log.phase("forward"), ops, ops.phase("forward"):
        y = mod(x_mine)
    launcher.mark(f"{name}:forward")
    want = y_dense[out_index]
    arrays = {"output": (_np(y), _np(want))}
    if isinstance(y, torch.Tensor) and y.shape == want.shape and y.requires_grad:
        with log.phase("backward"), ops, ops.phase("backward"):
            y.backward(upstream_mine)
    launcher.mark(f"{name}:backward")
    if isinstance(y, torch.Tensor) and y.shape == want.shape and y.requires_grad:
        if sync is not None:
            with log.phase("sync"):
                sync(mod)
        if differentiable:
            arrays["gradient of the input"] = (_np(x_mine.grad), _np(x_dense.grad[in_index]))
        for b in bound:
            arrays[f"gradient of {b.label}"] = (_np(b.student.grad), _np(b.dense.grad[b.index]))
    held, path = largest_held(mod)
    return {"arrays": arrays, "held": held, "held_at": path, "saved": saved.largest[0],
            "saved_shape": list(saved.largest[1]), "limit": limit,
            "forward": tally(log.calls, "forward"), "backward": tally(log.calls, "backward"),
            "activation": SEQ * BATCH * HIDDEN, **_made(ops)}


def _cross_entropy_case(student, rank, t, log):
    import torch

    from course.torch_audit import OpLog

    torch.manual_seed(SEED + CASES.index("cross_entropy"))
    logits = torch.randn(SEQ, BATCH, VOCAB) * 3
    target = torch.randint(0, VOCAB, (SEQ, BATCH))
    dense = logits.clone().requires_grad_()
    want = torch.nn.functional.cross_entropy(dense.reshape(-1, VOCAB), target.reshape(-1))
    want.backward()
    mine = (Ellipsis, _part(VOCAB, rank, t))
    local = logits[mine].clone().requires_grad_()
    ops = OpLog()
    launcher.mark("cross_entropy:start")
    with log.phase("forward"), ops, ops.phase("forward"):
        loss = student.vocab_parallel_cross_entropy(local, target)
    launcher.mark("cross_entropy:forward")
    arrays = {"loss": (_np(loss), _np(want))}
    backward = isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad
    if backward:
        with log.phase("backward"), ops, ops.phase("backward"):
            loss.reshape(()).backward()
    launcher.mark("cross_entropy:backward")
    if backward:
        arrays["gradient of the local logits"] = (_np(local.grad), _np(dense.grad[mine]))
    return {"arrays": arrays, "tokens": SEQ * BATCH, "limit": SEQ * BATCH * VOCAB, **_made(ops)}


def _raises_case(build, expect_error):
    """Build something: the ValueError's message, or None if it built."""
    try:
        build()
    except ValueError as exc:
        return {"raised": True, "message": str(exc), "expected": expect_error}
    return {"raised": False, "message": "", "expected": expect_error}


def _run_case(student, name, rank, t, log):
    if name in OPERATORS:
        return _operator_case(student, name, rank, t, log)
    if name in MODULES:
        return _module_case(student, name, rank, t, log)
    if name == "cross_entropy":
        return _cross_entropy_case(student, rank, t, log)
    if name == "heads_indivisible":  # divisible on 2 ranks: it must build; not on 4: ValueError
        return _raises_case(lambda: student.ParallelSelfAttention(ODD_HIDDEN, ODD_HEADS), ODD_HEADS % t != 0)
    if name == "linear_indivisible":  # 2t + 1 features never divide
        odd = 2 * t + 1
        column = _raises_case(lambda: student.ColumnParallelLinear(HIDDEN, odd), True)
        row = _raises_case(lambda: student.RowParallelLinear(odd, HIDDEN), True)
        return {"column": column, "row": row, "odd": odd}
    raise KeyError(name)


def rank_side(names, t_expected, folder):
    """Every rank: run each named case; write one file per case and rank."""
    import torch
    import torch.distributed as tdist

    log = CollectiveLog(tdist).install()  # before the student's module can import the collectives
    import tensor_parallel as student

    torch.set_default_dtype(torch.float64)
    rank, t = tdist.get_rank(), tdist.get_world_size()
    assert t == t_expected
    for name in names:
        log.calls = []
        try:
            record = _run_case(student, name, rank, t, log)
            record["status"] = "ok"
        except NotImplementedError as exc:  # a stub raises on every rank alike
            record = {"status": "not_implemented", "message": str(exc)}
        except LoadError as exc:
            record = {"status": "wrong_shape", "message": str(exc)}
        tdist.barrier()  # the next case starts together
        save_record(folder, name, rank, record)
    return None


def cases_job(t, names=CASES):
    """{case: outcome} for ``t`` ranks; see the module docstring."""
    # gloo on both tiers: the model is tiny and its tensors live on the CPU.
    start = lambda pending, folder: launcher.run(f"{__file__}:rank_side", t, list(pending), t, folder,  # noqa: E731
                                                 timeout=JOB_TIMEOUT_S, backend="gloo",
                                                 idle_timeout=launcher.IDLE_TIMEOUT_S, count_wire=True)
    return run_cases(start, names, t, rank_records, counted=("forward", "backward"))
