"""Lab 10's answers, in the grader: the dense models, every rank's inputs, what each rank
must return, and the rank jobs that ask for it (``run``, ``run_memory``). Nothing here
reaches the sandbox.

``cases(t, seed)`` draws every graded case for ``t`` ranks from the grading's secret
seed (``autograder.grading.seeds``) and builds, with torch's own modules in float64,
the dense model each layer must equal (``nn.Linear``, ``nn.MultiheadAttention``,
``nn.TransformerEncoderLayer`` with ``norm_first=True``, ``nn.Embedding``,
``F.cross_entropy``), runs it forward and backward here, and cuts out of it:

- what rank r receives (its "part"): the student's class to build, rank r's documented
  slice of every dense parameter as a NumPy array (``Slice``: where it goes in the
  student's module, and the sentence that names its expected shape if it does not fit),
  rank r's input (the whole input, or its sequence or feature shard) and its upstream
  gradient; for the conjugate operators, rank r's own input and upstream gradient only;
- what rank r must give back (its "want"): the dense output sliced the same way, the
  gradient of its input and of every parameter slice (the dense gradient sliced).

The layouts are the module docstring's (``ColumnParallelLinear.weight`` rows
``r*out/t ..``, ``RowParallelLinear.weight`` columns ``r*in/t ..`` and its bias whole,
q, k and v by heads out of ``in_proj_weight``, vocabulary rows ``r*vocab/t ..``).
``memory_case(seed)`` is one large ``ParallelMLP`` on 4 ranks whose weights dwarf what
the runtime holds, for the peak memory the launcher reads from outside (after a small one).
"""

from dataclasses import dataclass

from autograder.grading import seeds
from autograder.grading.checking import torch_on_one_thread
from autograder.grading.rank_jobs import crossed_in_phases, per_rank_in_phase, run_cases

HIDDEN, HEADS, FFN, SEQ, BATCH, VOCAB = 32, 8, 48, 8, 2, 24
# Activations [SEQ, BATCH, HIDDEN] have 512 elements and [SEQ, BATCH, FFN] 768, fewer than the
# full weights of their layers (HIDDEN^2 = 1024, HIDDEN * FFN = 1536, VOCAB * HIDDEN = 768), and a
# shard of the MLP's weights (768 or 384) is smaller than attention's: a tensor that large is a weight.
ODD_HIDDEN, ODD_HEADS = 24, 6  # 6 heads: divisible by 2, not by 4
OPERATOR_ROWS = 2  # the sequence operators' shard: [2, 3, 5]; f and g move [4, 3, 5]
# The memory case: ParallelMLP(2048, 8192) on 4 ranks, 4 tokens. Each full weight is 128 MiB of
# float64 and a rank's shard 32 MiB; activations are a few KiB (measured peaks: check file).
BIG_HIDDEN, BIG_FFN, BIG_SEQ, BIG_BATCH, BIG_T = 2048, 8192, 4, 1, 4
# A small MLP runs first in the same job (full weights of 2 MiB): what any first forward pass
# allocates (gloo's and MKL's buffers) is allocated before the large one's peak is read.
WARM_UP_HIDDEN, WARM_UP_FFN = 256, 1024

OPERATORS = {"op_f": "copy_to_tensor_parallel_region", "op_g": "reduce_from_tensor_parallel_region",
             "op_gather": "gather_from_sequence_parallel_region",
             "op_reduce_scatter": "reduce_scatter_to_sequence_parallel_region"}
MODULES = ("column", "column_gather", "row", "row_whole_input", "mlp", "mlp_sp", "attention_causal",
           "attention_full", "layer_tp", "layer_sp", "embedding")
CASES = (*OPERATORS, *MODULES, "cross_entropy", "heads_indivisible", "linear_indivisible")
PHASES = ("forward", "backward")  # each rank marks the start of a case and the end of each pass
JOB_TIMEOUT_S = 40  # a correct job takes a few seconds; a deadlock ends sooner, when the job idles
IDLE_TIMEOUT_S = 5
MEMORY_TIMEOUT_S = 60


# --- where each rank's slice of a dense parameter lies --------------------------------------

@dataclass(frozen=True)
class Slice:
    """Rank r's part of a dense parameter: ``dense[index]`` goes to the student's ``path``."""
    path: str  # from the student's module: "fc1.weight", "attn.q.bias"
    dense: object  # the dense torch parameter
    index: tuple
    what: str  # "weight" or "bias"
    how: object  # "whole", or (split by what, the dense shape)

    def expected(self, rank: int) -> str:
        """The sentence a loading error ends with: this slice's shape and why."""
        shape = tuple(self.dense[self.index].shape)
        if self.how == "whole":
            return f"the {self.what} is whole on every rank: {shape}"
        return f"rank {rank}'s shard of a {self.how[1]} {self.what} split by {self.how[0]} is {shape}"


def part(total: int, rank: int, t: int) -> slice:
    size = total // t
    return slice(rank * size, (rank + 1) * size)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def column(prefix, weight, bias, rank, t, offset=0, out=None) -> list[Slice]:
    """Rows ``rank*out/t ..`` of a dense [out, in] weight (rows offset .. offset+out of ``weight``)."""
    out = out or weight.shape[0]
    rows = slice(offset + rank * out // t, offset + (rank + 1) * out // t)
    found = [Slice(_join(prefix, "weight"), weight, (rows,), "weight", ("output features", (out, weight.shape[1])))]
    if bias is not None:
        found.append(Slice(_join(prefix, "bias"), bias, (rows,), "bias", ("output features", (out,))))
    return found


def row(prefix, weight, bias, rank, t) -> list[Slice]:
    """Columns ``rank*in/t ..`` of a dense [out, in] weight; the bias whole."""
    found = [Slice(_join(prefix, "weight"), weight, (slice(None), part(weight.shape[1], rank, t)), "weight",
                   ("input features", tuple(weight.shape)))]
    if bias is not None:
        found.append(Slice(_join(prefix, "bias"), bias, (Ellipsis,), "bias", "whole"))
    return found


def layernorm(prefix, norm) -> list[Slice]:
    return [Slice(_join(prefix, name), getattr(norm, name), (Ellipsis,), name, "whole") for name in ("weight", "bias")]


def mlp(prefix, fc1, fc2, rank, t) -> list[Slice]:
    return column(_join(prefix, "fc1"), fc1.weight, fc1.bias, rank, t) + row(_join(prefix, "fc2"), fc2.weight,
                                                                             fc2.bias, rank, t)


def attention(prefix, mha, rank, t) -> list[Slice]:
    h, found = mha.embed_dim, []
    for i, name in enumerate("qkv"):  # in_proj_weight stacks the q, k and v weights: [3h, h]
        found += column(_join(prefix, name), mha.in_proj_weight, mha.in_proj_bias, rank, t, offset=i * h, out=h)
    return found + row(_join(prefix, "out"), mha.out_proj.weight, mha.out_proj.bias, rank, t)


def layer(prefix, enc, rank, t) -> list[Slice]:
    return (layernorm(_join(prefix, "ln1"), enc.norm1) + attention(_join(prefix, "attn"), enc.self_attn, rank, t)
            + layernorm(_join(prefix, "ln2"), enc.norm2) + mlp(_join(prefix, "mlp"), enc.linear1, enc.linear2, rank, t))


# --- the dense models -----------------------------------------------------------------------

def _generator(seed, *names):
    import torch

    return torch.Generator().manual_seed(int(seeds.rng(seed, "10", *names).integers(2**62)))


def _randn(gen, *shape, scale=1.0):
    import torch

    return torch.randn(shape, generator=gen, dtype=torch.float64).mul_(scale)


def _drawn(module, gen, uniform=False):
    """``module`` with every parameter drawn at random: torch starts attention biases at 0
    and LayerNorms at 1 and 0, values under which a misplaced bias or scale goes unseen.
    ``uniform``: of the same spread, four times cheaper to draw (the memory case's)."""
    import torch

    with torch.no_grad():
        for p in module.parameters():  # matrices scaled by 1/sqrt(fan in), vectors by 0.5
            scale = p.shape[-1] ** -0.5 if p.dim() == 2 else 0.5
            if uniform:
                p.uniform_(-scale * 3 ** 0.5, scale * 3 ** 0.5, generator=gen)
            else:
                p.normal_(0.0, scale, generator=gen)
    return module


def _linear(i, o):
    """``nn.Linear(i, o)`` in float64 without torch's own initialisation (``_drawn`` draws it):
    built on the meta device, given empty parameters."""
    import torch
    from torch import nn

    layer = nn.Linear(i, o, dtype=torch.float64, device="meta")
    layer.weight = nn.Parameter(torch.empty(o, i, dtype=torch.float64))
    layer.bias = nn.Parameter(torch.empty(o, dtype=torch.float64))
    return layer


def causal_mask(s):
    import torch

    return torch.ones(s, s, dtype=torch.bool).triu(1)  # True: may not attend


@dataclass
class Dense:
    """One module case: the student's class and arguments, the dense function, each rank's
    slices, the input and upstream gradient, and which part of them each rank gets."""
    build: list  # [class name, args, kwargs]
    function: object
    slices: object  # rank -> [Slice]
    x: object
    upstream: object
    in_index: object  # rank -> index into x
    out_index: object  # rank -> index into the output
    sync: bool  # allreduce_sequence_parallel_grads after backward
    limit: int  # elements of the layer's smallest full weight matrix


def _dense(name, t, gen, hidden=HIDDEN, ffn=FFN, seq=SEQ, batch=BATCH) -> Dense:
    import torch
    from torch import nn

    f64 = {"dtype": torch.float64}
    whole = lambda rank: (Ellipsis,)  # noqa: E731
    seq_shard = lambda rank: (part(seq, rank, t),)  # noqa: E731
    x, up = _randn(gen, seq, batch, hidden), _randn(gen, seq, batch, hidden)
    if name in ("column", "column_gather"):
        dense = _drawn(_linear(hidden, ffn), gen)
        gather = name == "column_gather"
        return Dense(["ColumnParallelLinear", [hidden, ffn], {"gather_output": gather}], dense,
                     lambda rank: column("", dense.weight, dense.bias, rank, t), x, _randn(gen, seq, batch, ffn),
                     whole, whole if gather else (lambda rank: (Ellipsis, part(ffn, rank, t))), False, ffn * hidden)
    if name in ("row", "row_whole_input"):
        dense = _drawn(_linear(ffn, hidden), gen)
        parallel = name == "row"
        return Dense(["RowParallelLinear", [ffn, hidden], {"input_is_parallel": parallel}], dense,
                     lambda rank: row("", dense.weight, dense.bias, rank, t), _randn(gen, seq, batch, ffn), up,
                     (lambda rank: (Ellipsis, part(ffn, rank, t))) if parallel else whole, whole, False, ffn * hidden)
    if name in ("mlp", "mlp_sp"):
        big = hidden * ffn > HIDDEN * FFN
        dense = _drawn(nn.Sequential(_linear(hidden, ffn), nn.GELU(), _linear(ffn, hidden)), gen, uniform=big)
        sp = name == "mlp_sp"
        index = seq_shard if sp else whole
        return Dense(["ParallelMLP", [hidden, ffn], {"sequence_parallel": sp}], dense,
                     lambda rank: mlp("", dense[0], dense[2], rank, t), x, up, index, index, sp, ffn * hidden)
    if name.startswith("attention"):
        mha = _drawn(nn.MultiheadAttention(hidden, HEADS, **f64), gen)
        causal = name == "attention_causal"
        mask = causal_mask(seq) if causal else None
        return Dense(["ParallelSelfAttention", [hidden, HEADS], {"causal": causal}],
                     lambda x: mha(x, x, x, attn_mask=mask, need_weights=False)[0],
                     lambda rank: attention("", mha, rank, t), x, up, whole, whole, False, hidden * hidden)
    if name in ("layer_tp", "layer_sp"):
        enc = _drawn(nn.TransformerEncoderLayer(hidden, HEADS, ffn, dropout=0.0, activation="gelu", norm_first=True,
                                                **f64), gen)
        sp = name == "layer_sp"
        index = seq_shard if sp else whole
        return Dense(["ParallelTransformerLayer", [hidden, HEADS, ffn], {"sequence_parallel": sp}],
                     lambda x: enc(x, src_mask=causal_mask(seq)), lambda rank: layer("", enc, rank, t), x, up,
                     index, index, sp, hidden * hidden)
    if name == "embedding":
        dense = _drawn(nn.Embedding(VOCAB, hidden, **f64), gen)
        ids = torch.randint(0, VOCAB, (seq, batch), generator=gen)
        return Dense(["VocabParallelEmbedding", [VOCAB, hidden], {}], dense,
                     lambda rank: [Slice("weight", dense.weight, (part(VOCAB, rank, t),), "weight",
                                         ("vocabulary rows", (VOCAB, hidden)))], ids, up, whole, whole, False,
                     VOCAB * hidden)
    raise KeyError(name)


def _np(tensor):
    """The tensor's values (its own memory: the codec copies what it sends)."""
    return tensor.detach().numpy()


def module_case(dense: Dense, t: int, gradients=True) -> dict:
    """Run ``dense`` forward and backward (or forward only) here; each rank's part and want."""
    differentiable = dense.x.is_floating_point() and gradients
    x = dense.x.clone().requires_grad_(differentiable)
    y = dense.function(x)
    if gradients:  # the same gradients as y.backward(upstream), which imports sympy (a second, once)
        (y * dense.upstream).sum().backward()
    cls = dense.build[0]
    parts, wants = [], []
    for rank in range(t):
        slices = dense.slices(rank)
        inside, outside = dense.in_index(rank), dense.out_index(rank)
        parts.append({"kind": "module", "build": dense.build, "sync": dense.sync,
                      "shards": [[f"{cls}.{s.path}", s.path, _np(s.dense[s.index]), s.expected(rank)] for s in slices],
                      "x": _np(dense.x[inside]), "upstream": _np(dense.upstream[outside])})
        want = {"output": _np(y[outside])}
        if differentiable:
            want["gradient of the input"] = _np(x.grad[inside])
        if gradients:
            want.update({f"gradient of {cls}.{s.path}": _np(s.dense.grad[s.index]) for s in slices})
        wants.append(want)
    return {"parts": parts, "want": wants, "limit": dense.limit}


# --- the operators and the cross-entropy ------------------------------------------------------

def operator_case(name, t, gen) -> dict:
    """Each rank's own input and upstream gradient, and the math of the collectives on all of them."""
    import torch

    rows = OPERATOR_ROWS
    shape_in = {"op_gather": (rows, 3, 5), "op_reduce_scatter": (rows * t, 3, 5)}.get(name, (2 * rows, 3, 5))
    shape_out = {"op_gather": (rows * t, 3, 5), "op_reduce_scatter": (rows, 3, 5)}.get(name, (2 * rows, 3, 5))
    xs = [_randn(gen, *shape_in) for _ in range(t)]
    ups = [_randn(gen, *shape_out) for _ in range(t)]
    parts, wants = [], []
    for rank in range(t):
        mine = slice(rank * rows, (rank + 1) * rows)
        out, grad = {"op_f": (xs[rank], sum(ups)), "op_g": (sum(xs), ups[rank]),
                     "op_gather": (torch.cat(xs), sum(ups)[mine]),
                     "op_reduce_scatter": (sum(xs)[mine], torch.cat(ups))}[name]
        parts.append({"kind": "operator", "function": OPERATORS[name], "x": _np(xs[rank]),
                      "upstream": _np(ups[rank])})
        wants.append({"output": _np(out), "gradient of the input": _np(grad)})
    return {"parts": parts, "want": wants, "elements": xs[0].numel()}


def cross_entropy_case(t, gen) -> dict:
    """Rank r gets its vocabulary slice of the logits and every target; F.cross_entropy of them all."""
    import torch

    logits = _randn(gen, SEQ, BATCH, VOCAB, scale=3.0)
    target = torch.randint(0, VOCAB, (SEQ, BATCH), generator=gen)
    dense = logits.clone().requires_grad_()
    loss = torch.nn.functional.cross_entropy(dense.reshape(-1, VOCAB), target.reshape(-1))
    loss.backward()
    parts, wants = [], []
    for rank in range(t):
        mine = (Ellipsis, part(VOCAB, rank, t))
        parts.append({"kind": "cross_entropy", "logits": _np(logits[mine]), "target": _np(target)})
        wants.append({"loss": _np(loss), "gradient of the local logits": _np(dense.grad[mine])})
    return {"parts": parts, "want": wants, "tokens": SEQ * BATCH, "limit": SEQ * BATCH * VOCAB}


def raises_case(name, t) -> dict:
    """Constructors that must raise ValueError (``expected``), or must build."""
    if name == "heads_indivisible":  # divisible on 2 ranks: it must build; not on 4: ValueError
        builds = {"attention": ["ParallelSelfAttention", [ODD_HIDDEN, ODD_HEADS], {}]}
        expected = {"attention": ODD_HEADS % t != 0}
    else:  # 2t + 1 features never divide
        odd = 2 * t + 1
        builds = {"column": ["ColumnParallelLinear", [HIDDEN, odd], {}],
                  "row": ["RowParallelLinear", [odd, HIDDEN], {}]}
        expected = {"column": True, "row": True}
    return {"parts": [{"kind": "builds", "builds": builds}] * t, "expected": expected, "odd": 2 * t + 1}


def cases(t: int, seed: int) -> dict:
    """{name: case} of every graded case on ``t`` ranks: ``parts`` (rank r's inputs, which it
    alone receives), ``want`` (what rank r must return), and what the checks read."""
    found = {}
    with torch_on_one_thread():
        for name in CASES:
            found[name] = _case(name, t, seed)
    return found


def _case(name, t, seed):
    gen = _generator(seed, name, t)
    if name in OPERATORS:
        case = operator_case(name, t, gen)
    elif name in MODULES:
        case = module_case(_dense(name, t, gen), t)
    elif name == "cross_entropy":
        case = cross_entropy_case(t, gen)
    else:
        case = raises_case(name, t)
    return {**case, "activation": SEQ * BATCH * HIDDEN}


def memory_case(seed: int, hidden=BIG_HIDDEN, ffn=BIG_FFN, name="memory") -> dict:
    """ParallelMLP(hidden, ffn) on BIG_T ranks, a forward pass: each rank's shards and
    tokens, and its output."""
    with torch_on_one_thread():
        dense = _dense("mlp", BIG_T, _generator(seed, name), hidden=hidden, ffn=ffn, seq=BIG_SEQ,
                       batch=BIG_BATCH)
        case = module_case(dense, BIG_T, gradients=False)
    case["full_weight_bytes"] = 8 * hidden * ffn
    case["shard_bytes"] = sum(shard[2].nbytes for shard in case["parts"][0]["shards"])
    return case


# --- the jobs ----------------------------------------------------------------------------------

def run(submission, seed: int, t: int):
    """(cases, {name: outcome}) of every case on ``t`` ranks, in as few rank jobs as it takes
    (``harness.cases_rank``), once per grading. An outcome that is ok holds each rank's record
    ("records"), what crossed between the ranks in each pass ("wire") and what each rank
    sent ("sent"; None where the ranks share a user)."""
    def job():
        drawn = cases(t, seed)
        found = run_cases(submission, "torch", "cases_rank", list(drawn), lambda name: t,
                          lambda name, rank: drawn[name]["parts"][rank], timeout=JOB_TIMEOUT_S,
                          idle_timeout=IDLE_TIMEOUT_S, count_wire=True)
        for name, outcome in found.items():
            failed = outcome["status"] == "ok" and next((r for r in outcome["records"] if r["status"] != "ok"), None)
            if failed:  # a stub, or a parameter of the wrong shape: every rank alike
                found[name] = {"status": failed["status"], "message": failed["message"]}
            elif outcome["status"] == "ok":
                done = outcome["job"]
                outcome["wire"] = crossed_in_phases(done, name, PHASES)
                outcome["sent"] = {phase: per_rank_in_phase(done, name, phase, before)
                                   for phase, before in zip(PHASES, ("start", "forward"))}
        return drawn, found
    return submission.once(("cases_job", t), job)


def run_memory(submission, seed: int):
    """(case, job) of a small MLP's forward pass and then the large one's in a rank job of its
    own (``harness.memory_rank``), once per grading: the job holds each rank's memory as the
    launcher read it at the marks around each ("memory:start" starts the peaks afresh)."""
    def job():
        warm_up = memory_case(seed, WARM_UP_HIDDEN, WARM_UP_FFN, "warm-up")
        case = memory_case(seed)
        parts = [[{"case": "warm-up", **small}, {"case": "memory", **large}]
                 for small, large in zip(warm_up["parts"], case["parts"])]
        return case, submission.rank_job("torch", "memory_rank", parts, timeout=MEMORY_TIMEOUT_S,
                                         idle_timeout=IDLE_TIMEOUT_S)
    return submission.once("memory_job", job)
