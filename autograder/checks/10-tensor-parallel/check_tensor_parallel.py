"""Checks for lab 10: tensor and sequence parallelism (Megatron style).

Oracles:
- The conjugate operators: the math of their collectives on every rank's
  input and upstream gradient (each rank's are seeded, so every rank knows
  them all): f's backward is the sum of every rank's upstream gradient, g's
  forward the sum of every rank's input, and so on.
- Layers: a dense float64 model of torch's own modules on the same seed
  (``nn.Linear``, ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``
  with ``norm_first=True``, ``nn.Embedding``, ``F.cross_entropy``). The harness
  copies each rank's documented slice of the dense weights into the student's
  parameters, and the output and every gradient (input, parameter shards,
  LayerNorms after ``allreduce_sequence_parallel_grads``) must equal the dense
  ones sliced the same way, to 1e-9 relative.
- Communication: the harness wraps torch.distributed's collectives and counts
  the calls: one of the documented kind in each conjugate operator's forward
  or backward, and in a transformer layer's forward and backward: 2 all-reduces of
  s*b*h elements each way (tensor parallel); 2 all-gathers and 2
  reduce-scatters of s*b*h each way and no all-reduce (sequence parallel).
- Memory: no tensor the modules hold or autograd saves for backward is as
  large as a full weight matrix of the layer (sizes chosen so that
  activations are smaller than every full weight).
- The vocabulary pair, audited by ``course.torch_audit.OpLog`` over every
  operator they run (what they make, kept or not, and the collectives the
  process group sees): the embedding makes one all-reduce of its s*b*h
  output and no tensor as large as the [vocab, hidden] table; the
  cross-entropy's collectives are all-reduces of at most 3 values per token
  (max, sum of exps, target logit) each way, and it makes no [tokens, vocab]
  tensor.
- No property without the work (``with_the_work``): a check of what code never
  does (hold, save or make a tensor that large; gather the logits) credits a
  case only when its output and gradients are also right.

World sizes 2 and 4; every case of a world size runs in one ``course.dist``
job, shared by the checks. Both tiers grade the same way (gloo, tiny sizes).
"""
import pytest

from autograder.grading.checking import expect_array, with_the_work
from autograder.grading.submission import failure_from
from autograder.grading.traffic import expect_crossed
from course.wire import gloo_bytes, gloo_messages

WORLD_SIZES = (2, 4)
RTOL, ATOL = 1e-9, 1e-10


def _case(submission, name, sizes=WORLD_SIZES):
    """{t: the case's outcome on t ranks}, or the error that says why there is none."""
    found = {}
    for t in sizes:
        outcome = submission.harness_once(("cases_job", t), "cases_job", t)[name]
        status, message = outcome["status"], outcome.get("message", "")
        if status == "ok":
            found[t] = outcome
        elif status == "wrong_shape":
            raise AssertionError(f"on {t} ranks: {message}")
        else:
            raise failure_from(outcome, f"{name} on {t} ranks")
    return found


def _expect_dense(submission, name, what, hint="", grad_hint=""):
    """Every rank's output and gradients equal the oracle's (the dense model's, sliced);
    ``grad_hint`` is added to the message when only a gradient differs."""
    for t, case in _case(submission, name).items():
        for rank, record in enumerate(case["ranks"]):
            for label, (got, want) in record["arrays"].items():
                extra = hint + (grad_hint if label.startswith("gradient") else "")
                where = f"{what} on {t} ranks, rank {rank}: {label}"
                if got is None:
                    raise AssertionError(f"{where} is None (no gradient reached it: is it used, and does every "
                                         f"operator on its path return a gradient?){extra}")
                try:
                    expect_array(got, want, where, rtol=RTOL, atol=ATOL)
                except AssertionError as exc:
                    raise AssertionError(f"{exc}{extra}") from None


# --- 1. the conjugate operators --------------------------------------------------------------

# The operators' inputs (harness._operator_case): [4, 3, 5] for f and g (60 elements); the sequence
# ones move [2t, 3, 5] whole (30t elements: the gathered output, the reduce-scattered input).
def _op_collectives(name, t):
    """(forward, backward) collectives {"kind of elements": calls} the operator makes on ``t`` ranks."""
    seq = 30 * t
    return {"op_f": ({}, {"all-reduce of 60": 1}), "op_g": ({"all-reduce of 60": 1}, {}),
            "op_gather": ({f"all-gather of {seq}": 1}, {f"reduce-scatter of {seq}": 1}),
            "op_reduce_scatter": ({f"reduce-scatter of {seq}": 1}, {f"all-gather of {seq}": 1})}[name]


def _expect_operator(submission, name, what, hint):
    """Values first (``_expect_dense``), then one collective of the documented kind each way."""
    _expect_dense(submission, name, what, hint)
    for t, case in _case(submission, name).items():
        for rank, record in enumerate(case["ranks"]):
            for phase, expected in zip(("forward", "backward"), _op_collectives(name, t)):
                got = record[phase]
                assert got == expected, (
                    f"{what} on {t} ranks, rank {rank}, {phase}: collectives {got or 'none'}, expected "
                    f"{expected or 'none'} (elements of the whole tensor); the values are right, but {what} "
                    "makes the collective its docstring names, once (dist.all_reduce, dist.all_gather_single, "
                    "dist.reduce_scatter_single)")


@pytest.mark.points(1)
def check_copy_to_tensor_parallel_region(submission):
    """f: forward returns the input unchanged; backward sums every rank's gradient (all-reduce)"""
    _expect_operator(submission, "op_f", "copy_to_tensor_parallel_region (f)",
                     "; f's backward all-reduces: each rank's input feeds every rank's partial results")


@pytest.mark.points(1)
def check_reduce_from_tensor_parallel_region(submission):
    """g: forward sums every rank's input (all-reduce); backward passes the gradient through"""
    _expect_operator(submission, "op_g", "reduce_from_tensor_parallel_region (g)",
                     "; g's forward all-reduces and its backward is the identity")


@pytest.mark.points(1)
def check_gather_from_sequence_parallel_region(submission):
    """Sequence all-gather: forward concatenates the ranks' shards along dim 0; backward reduce-scatters"""
    _expect_operator(submission, "op_gather", "gather_from_sequence_parallel_region",
                     "; forward: rank r's shard is rows r*s/t .. of the output; backward: this rank's rows of "
                     "the sum over ranks of the gradients")


@pytest.mark.points(1)
def check_reduce_scatter_to_sequence_parallel_region(submission):
    """Sequence reduce-scatter: forward keeps this rank's rows of the sum over ranks; backward all-gathers"""
    _expect_operator(submission, "op_reduce_scatter", "reduce_scatter_to_sequence_parallel_region",
                     "; forward: rows r*s/t .. of the sum over ranks; backward: every rank's gradient shard, "
                     "concatenated along dim 0")


# --- 2. column- and row-parallel linear layers ------------------------------------------------

@pytest.mark.points(2)
def check_column_parallel_linear(submission):
    """ColumnParallelLinear (with and without gather_output): output and gradients equal nn.Linear's"""
    _expect_dense(submission, "column", "ColumnParallelLinear(32, 48)")
    _expect_dense(submission, "column_gather", "ColumnParallelLinear(32, 48, gather_output=True)")


@pytest.mark.points(2)
def check_row_parallel_linear(submission):
    """RowParallelLinear (input parallel and whole): output and gradients equal nn.Linear's, bias added once"""
    hint = "; the bias is added once, after the all-reduce (on every rank before it, it is counted t times)"
    _expect_dense(submission, "row", "RowParallelLinear(48, 32)", hint)
    _expect_dense(submission, "row_whole_input", "RowParallelLinear(48, 32, input_is_parallel=False)", hint)


# --- 3. MLP, attention, transformer layer ------------------------------------------------------

@pytest.mark.points(1)
def check_parallel_mlp(submission):
    """ParallelMLP: output and every gradient equal Linear -> GELU -> Linear"""
    _expect_dense(submission, "mlp", "ParallelMLP(32, 48)")


@pytest.mark.points(1)
def check_parallel_mlp_sequence_parallel(submission):
    """ParallelMLP(sequence_parallel=True): the rank's sequence shard in, its shard of the dense output out"""
    _expect_dense(submission, "mlp_sp", "ParallelMLP(32, 48, sequence_parallel=True)",
                  grad_hint="; the row layer's bias gradient comes from this rank's shard only: mark the bias "
                  "sequence_parallel so allreduce_sequence_parallel_grads sums it")


@pytest.mark.points(2)
def check_parallel_self_attention(submission):
    """ParallelSelfAttention (causal and not): output and every gradient equal nn.MultiheadAttention's"""
    _expect_dense(submission, "attention_causal", "ParallelSelfAttention(32, 8 heads, causal=True)")
    _expect_dense(submission, "attention_full", "ParallelSelfAttention(32, 8 heads, causal=False)")


@pytest.mark.points(2)
def check_transformer_layer_tensor_parallel(submission):
    """ParallelTransformerLayer: output and every gradient equal nn.TransformerEncoderLayer(norm_first=True)'s"""
    _expect_dense(submission, "layer_tp", "ParallelTransformerLayer(32, 8 heads, 48)")


@pytest.mark.points(2)
def check_transformer_layer_sequence_parallel(submission):
    """ParallelTransformerLayer(sequence_parallel=True): shards, gradients and synced LayerNorm grads equal dense"""
    _expect_dense(submission, "layer_sp", "ParallelTransformerLayer(32, 8 heads, 48, sequence_parallel=True)",
                  grad_hint="; LayerNorm weights and biases (and row biases) see only this rank's sequence shard: mark "
                  "them sequence_parallel so allreduce_sequence_parallel_grads sums their gradients")


# --- 4. communication per layer -----------------------------------------------------------------

def _expect_collectives(submission, name, what, want, why, wire):
    """The collectives the in-process log saw (``want``, per rank and pass), and what the
    kernel counted crossing in each pass: ``wire(t, s*b*h)`` = (bytes, messages, pattern)."""
    for t, case in _case(submission, name).items():
        nbytes, messages, pattern = wire(t, 8 * case["ranks"][0]["activation"])  # float64
        for phase in ("forward", "backward"):
            logged = nbytes if all(record[phase] for record in case["ranks"]) else 0  # the log saw collectives
            expect_crossed(submission, case["wire"], phase, nbytes, messages, f"{what} on {t} ranks, {phase}",
                           pattern, logged=logged)
        for rank, record in enumerate(case["ranks"]):
            expected = {kind.replace("N", str(record["activation"])): n for kind, n in want.items()}
            for phase in ("forward", "backward"):
                got = record[phase]
                assert got == expected, (
                    f"{what} on {t} ranks, rank {rank}, {phase}: collectives {got or 'none'}, expected "
                    f"{expected} (elements of the whole tensor, s*b*h = {record['activation']}); {why}")


@pytest.mark.points(2)
def check_tensor_parallel_layer_collectives(submission):
    """A tensor-parallel layer makes exactly 2 all-reduces of s*b*h elements in forward and 2 in backward"""
    _expect_collectives(submission, "layer_tp", "ParallelTransformerLayer", {"all-reduce of N": 2},
                        "forward: g after attention's out and after fc2; backward: f before q/k/v (applied once "
                        "for all three) and before fc1",
                        lambda t, n: (2 * gloo_bytes("all_reduce", n, t), 2 * gloo_messages("all_reduce", t),
                                      "2 all-reduces of s*b*h"))


@pytest.mark.points(2)
def check_sequence_parallel_layer_collectives(submission):
    """A sequence-parallel layer: no all-reduce; 2 all-gathers and 2 reduce-scatters of s*b*h each way"""
    _expect_collectives(submission, "layer_sp", "ParallelTransformerLayer(sequence_parallel=True)",
                        {"all-gather of N": 2, "reduce-scatter of N": 2},
                        "each all-reduce becomes a reduce-scatter plus an all-gather of the same volume: gather "
                        "the sequence once before q/k/v and once before fc1, reduce-scatter after out and fc2",
                        lambda t, n: (2 * gloo_bytes("all_gather", n // t, t) + 2 * gloo_bytes("reduce_scatter", n, t),
                                      2 * gloo_messages("all_gather", t) + 2 * gloo_messages("reduce_scatter", t),
                                      "2 all-gathers and 2 reduce-scatters of s*b*h (gloo's moves an all-reduce's "
                                      "bytes)"))


# --- 5. memory: no full weight anywhere ------------------------------------------------------------

LAYERS = {"column": "ColumnParallelLinear", "row": "RowParallelLinear", "mlp": "ParallelMLP",
          "mlp_sp": "ParallelMLP(sequence_parallel=True)", "attention_causal": "ParallelSelfAttention",
          "layer_tp": "ParallelTransformerLayer", "layer_sp": "ParallelTransformerLayer(sequence_parallel=True)",
          "embedding": "VocabParallelEmbedding"}


@pytest.mark.points(2)
def check_no_rank_holds_a_full_weight(submission):
    """No tensor a module holds, or saves for backward, is as large as a full weight matrix of the layer"""
    for name, what in LAYERS.items():
        with_the_work(f"the memory audit of {what}", lambda: _expect_dense(submission, name, what))
        for t, case in _case(submission, name).items():
            for rank, record in enumerate(case["ranks"]):
                limit = record["limit"]
                assert record["held"] < limit, (
                    f"{what} on {t} ranks, rank {rank}: {record['held_at']} has {record['held']} elements; a full "
                    f"weight matrix of this layer has {limit} (its shard {limit // t}). Keep only this rank's shard")
                assert record["saved"] < limit, (
                    f"{what} on {t} ranks, rank {rank}: a tensor of shape {tuple(record['saved_shape'])} "
                    f"({record['saved']} elements) is saved for backward; a full weight matrix of this layer has "
                    f"{limit}. Gathering the weights defeats tensor parallelism: multiply by the shard")


# --- 6. sizes that do not divide --------------------------------------------------------------------

@pytest.mark.points(1)
def check_heads_not_divisible_raises(submission):
    """ParallelSelfAttention(hidden=24, n_heads=6) raises ValueError on 4 ranks (and builds on 2)"""
    for t, case in _case(submission, "heads_indivisible").items():
        record = case["ranks"][0]
        if record["expected"]:
            assert record["raised"], (
                f"no error raised: ParallelSelfAttention(24, n_heads=6) on {t} ranks built without a ValueError; "
                f"6 heads cannot be split evenly over {t} ranks")
            assert "6" in record["message"] and str(t) in record["message"], (
                f"ParallelSelfAttention(24, n_heads=6) on {t} ranks: the ValueError says {record['message']!r}; "
                f"say which size does not divide (n_heads=6) and by what (the tensor-parallel size {t})")
        else:
            assert not record["raised"], (
                f"ParallelSelfAttention(24, n_heads=6) on {t} ranks raised ValueError({record['message']!r}); "
                f"6 heads split evenly over {t} ranks")


@pytest.mark.points(1)
def check_linear_sizes_not_divisible_raise(submission):
    """ColumnParallelLinear / RowParallelLinear raise ValueError when t does not divide the split features"""
    for t, case in _case(submission, "linear_indivisible").items():
        record, odd = case["ranks"][0], case["ranks"][0]["odd"]
        for layer, built in (("ColumnParallelLinear(32, %d)" % odd, record["column"]),
                             ("RowParallelLinear(%d, 32)" % odd, record["row"])):
            assert built["raised"], (
                f"no error raised: {layer} on {t} ranks built without a ValueError; {odd} features cannot be "
                f"split evenly over {t} ranks")


# --- 7. vocabulary-parallel embedding and cross-entropy -----------------------------------------------

@pytest.mark.points(1)
def check_vocab_parallel_embedding(submission):
    """VocabParallelEmbedding: output and weight-shard gradient equal nn.Embedding's (vocab 24)"""
    _expect_dense(submission, "embedding", "VocabParallelEmbedding(24, 32)",
                  "; ids outside rows r*vocab/t .. give zero rows on this rank before the all-reduce")


@pytest.mark.points(2)
def check_vocab_parallel_cross_entropy(submission):
    """vocab_parallel_cross_entropy: loss and local-logit gradients equal F.cross_entropy of the gathered logits"""
    _expect_dense(submission, "cross_entropy", "vocab_parallel_cross_entropy (vocab 24)",
                  "; max, sum of exp and the target's logit are each all-reduced; the gradient is "
                  "(softmax - one_hot(target)) / number of tokens on this rank's slice")


def _expect_made_below(what, t, rank, record, limit, of):
    elements, shape = record["made"]
    assert elements < limit, (
        f"{what} on {t} ranks, rank {rank}: it makes a tensor of shape {tuple(shape)} ({elements} elements); "
        f"the whole {of} is {limit} elements, and no rank makes a tensor that large, even for a moment")


@pytest.mark.points(1)
def check_vocab_parallel_embedding_looks_up_locally(submission):
    """VocabParallelEmbedding: a local lookup, one all-reduce of s*b*h, none backward; never a table-sized tensor"""
    what = "VocabParallelEmbedding(24, 32)"
    with_the_work("the audit of the embedding's collectives and sizes",
                  lambda: _expect_dense(submission, "embedding", what))
    for t, case in _case(submission, "embedding").items():
        for rank, record in enumerate(case["ranks"]):
            want = {"forward": [["all_reduce", record["activation"]]], "backward": []}
            for phase, expected in want.items():
                got = record["dispatched"][phase]
                assert got == expected, (
                    f"{what} on {t} ranks, rank {rank}, {phase}: collectives {got or 'none'} ([kind, elements]), "
                    f"expected {expected or 'none'}: look up the ids in this rank's rows (zero rows for the "
                    "others' ids) and all-reduce the [s, b, h] result once (g); its backward is the identity")
            _expect_made_below(what, t, rank, record, record["limit"], "[vocab, hidden] table")
        nbytes = 8 * case["ranks"][0]["activation"]
        for phase, want in (("forward", gloo_bytes("all_reduce", nbytes, t)), ("backward", 0)):
            expect_crossed(submission, case["wire"], phase, want, gloo_messages("all_reduce", t) if want else 0,
                           f"{what} on {t} ranks, {phase}", "one all-reduce of s*b*h forward, nothing backward",
                           logged=want)


@pytest.mark.points(2)
def check_vocab_parallel_cross_entropy_sends_per_token_values(submission):
    """vocab_parallel_cross_entropy: only all-reduces of <= 3 values per token each way; no [tokens, vocab] tensor"""
    what = "vocab_parallel_cross_entropy (vocab 24)"
    with_the_work("the audit of the cross-entropy's collectives and sizes",
                  lambda: _expect_dense(submission, "cross_entropy", what))
    for t, case in _case(submission, "cross_entropy").items():
        for rank, record in enumerate(case["ranks"]):
            most = 3 * record["tokens"]
            for phase, got in record["dispatched"].items():
                moved = sum(n for _, n in got)
                assert all(kind == "all_reduce" for kind, _ in got) and moved <= most, (
                    f"{what} on {t} ranks, rank {rank}, {phase}: collectives {got} ([kind, elements]); only "
                    f"per-token values cross ranks, by all-reduce: the max, the sum of exps and the target's logit, "
                    f"at most {most} elements in all ({record['tokens']} tokens; two of them may share one "
                    "all-reduce). Gathering the logits defeats the vocabulary split")
            _expect_made_below(what, t, rank, record, record["limit"], "[tokens, vocab] logit matrix")
        tokens = 8 * case["ranks"][0]["tokens"]  # one float64 per token
        for phase, least in (("forward", 2), ("backward", 0)):
            expect_crossed(submission, case["wire"], phase, least * gloo_bytes("all_reduce", tokens, t),
                           3 * gloo_messages("all_reduce", t), f"{what} on {t} ranks, {phase}",
                           "all-reduces of per-token values (at most 3 per token)",
                           most=3 * gloo_bytes("all_reduce", tokens, t))
