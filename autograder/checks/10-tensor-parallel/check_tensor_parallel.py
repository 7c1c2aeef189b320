"""Checks for lab 10: tensor and sequence parallelism (Megatron style).

Every input is drawn in the grader from the grading's secret seed, and every answer is
computed here (``oracles.py``): a dense float64 model of torch's own modules
(``nn.Linear``, ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` with
``norm_first=True``, ``nn.Embedding``, ``F.cross_entropy``), run forward and backward
in the grader. Each rank of a rank job receives only its own part (see harness.py): its
documented slice of every dense weight, its input and its upstream gradient; for the
conjugate operators its own input and upstream gradient alone, so that the sum or
concatenation over ranks exists only if the ranks communicate.

- Values: every rank's output and every gradient (input, parameter slices, LayerNorms
  after ``allreduce_sequence_parallel_grads``) must equal the dense model's, sliced by
  the layout, to 1e-9 relative.
- Communication: what crossed between the ranks in each pass, as the kernel counted it
  (in all and per rank, each rank's own sockets), must be the bytes of the pattern the
  lab asks for (one collective in each conjugate operator's forward or backward; a
  tensor-parallel layer's 2 all-reduces of s*b*h each way; a sequence-parallel layer's
  2 all-gathers and 2 reduce-scatters; the vocabulary pair's). The in-process
  ``CollectiveLog`` and ``OpLog`` name the collectives in the messages, and must agree
  (gloo's reduce-scatter moves an all-reduce's bytes: only they tell the two apart).
  Each counts only with the right values (``with_the_work``): the output and the input's
  gradient, which the passes' communication decides; collectives on zeros earn nothing.
- Memory: one large ``ParallelMLP(2048, 8192)`` on 4 ranks (full float64 weights of
  128 MiB, 32 MiB per rank) is built and runs a forward pass, after a small one; the
  launcher reads how far each rank's memory rises in it, from outside, which must stay
  below the rank's own slices plus half a full weight (measured margins: ``MEMORY_MEASURED``). At the small
  sizes, in-process records name a tensor as large as a full weight (held by a module,
  saved for backward, made by the vocabulary pair). Credited only with the right values.

World sizes 2 and 4; every case of a world size runs in one rank job, shared by the
checks; the memory case in one more. Both tiers grade the same way (gloo).
"""
import pytest

from autograder.grading.checking import expect_array, load_beside, with_the_work
from autograder.grading.rank_jobs import peak_in_phase
from autograder.grading.submission import failure_from
from autograder.grading.traffic import expect_crossed, expect_sent_by_rank
from course.wire import gloo_bytes, gloo_messages

oracles = load_beside(__file__, "oracles")

WORLD_SIZES = (2, 4)
RTOL, ATOL = 1e-9, 1e-10
PHASES = oracles.PHASES
# What the passes' communication alone decides: the output, and the gradient the backward pass hands on.
PASSED_ON = ("output", "gradient of the input")


# --- the jobs' outcomes ------------------------------------------------------------------------

def _case(submission, seed, name, sizes=WORLD_SIZES):
    """{t: (case, outcome)}, the outcome's "records" one per rank; or the error that says why not."""
    found = {}
    for t in sizes:
        cases, outcomes = oracles.run(submission, seed, t)
        outcome = outcomes[name]
        if outcome["status"] == "wrong_shape":
            raise AssertionError(f"on {t} ranks: {outcome['message']}")
        if outcome["status"] != "ok":
            raise failure_from(outcome, f"{name} on {t} ranks")
        found[t] = (cases[name], outcome)
    return found


def _expect_dense(submission, seed, name, what, hint="", grad_hint="", labels=None):
    """Every rank's output and gradients (or those named in ``labels``) equal the dense model's,
    sliced; ``grad_hint`` is added to the message when only a gradient differs."""
    for t, (case, outcome) in _case(submission, seed, name).items():
        for rank, (record, want) in enumerate(zip(outcome["records"], case["want"])):
            for label, expected in want.items():
                if labels is not None and label not in labels:
                    continue
                extra = hint + (grad_hint if label.startswith("gradient") else "")
                where = f"{what} on {t} ranks, rank {rank}: {label}"
                got = record.get(label)
                if got is None:
                    raise AssertionError(f"{where} is None (no gradient reached it: is it used, and does every "
                                         f"operator on its path return a gradient?){extra}")
                try:
                    expect_array(got, expected, where, rtol=RTOL, atol=ATOL)
                except AssertionError as exc:
                    raise AssertionError(f"{exc}{extra}") from None


def _expect_wire(submission, outcome, t, phase, nbytes, messages, what, pattern, logged=None, most=None):
    """The bytes that crossed in ``phase``, in all and (where each rank has its own user) per
    rank: every pattern here is symmetric, each rank sends 1/t of the total."""
    where = f"{what} on {t} ranks, {phase}"
    expect_crossed(submission, outcome["wire"], phase, nbytes, messages, where, pattern, logged=logged, most=most)
    share = (nbytes if most is None else most) / t
    expect_sent_by_rank(outcome["sent"][phase], [share] * t, where, messages,
                        slack=0 if most is None else share - nbytes / t)


# --- 1. the conjugate operators --------------------------------------------------------------

def _op_pattern(name, elements, t):
    """(forward, backward) collectives of the operator on ``t`` ranks, each a list of (kind, elements
    each rank puts in: a gather's shard, a reduction's whole tensor); ``elements``: one rank's input."""
    whole = {"op_gather": elements * t}.get(name, elements)  # the gathered output / reduce-scattered input
    reduce, gather, scatter = ("all_reduce", whole), ("all_gather", whole // t), ("reduce_scatter", whole)
    return {"op_f": ([], [reduce]), "op_g": ([reduce], []), "op_gather": ([gather], [scatter]),
            "op_reduce_scatter": ([scatter], [gather])}[name]


_KIND = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter"}


def _expect_operator(submission, seed, name, what, hint):
    """Values first, then what crossed in each pass (the kernel's count) and the collective the
    in-process log saw: one of the documented kind each way."""
    with_the_work(f"{what}'s communication", lambda: _expect_dense(submission, seed, name, what, hint))
    for t, (case, outcome) in _case(submission, seed, name).items():
        for phase, pattern in zip(PHASES, _op_pattern(name, case["elements"], t)):
            expected = {f"{_KIND[kind]} of {n * t if kind == 'all_gather' else n}": 1 for kind, n in pattern}
            for rank, record in enumerate(outcome["records"]):
                got = record[phase]
                assert got == expected, (
                    f"{what} on {t} ranks, rank {rank}, {phase}: collectives {got or 'none'}, expected "
                    f"{expected or 'none'} (elements of the whole tensor); the values are right, but {what} "
                    "makes the collective its docstring names, once (dist.all_reduce, dist.all_gather_single, "
                    "dist.reduce_scatter_single)")
            nbytes = sum(gloo_bytes(kind, 8 * n, t) for kind, n in pattern)
            messages = sum(gloo_messages(kind, t) for kind, _ in pattern)
            described = " and ".join(f"one {_KIND[kind]}" for kind, _ in pattern) or "nothing"
            _expect_wire(submission, outcome, t, phase, nbytes, messages, what, described, logged=nbytes)


@pytest.mark.points(1)
def check_copy_to_tensor_parallel_region(submission, seed):
    """f: forward returns the input unchanged; backward sums every rank's gradient (all-reduce)"""
    _expect_operator(submission, seed, "op_f", "copy_to_tensor_parallel_region (f)",
                     "; f's backward all-reduces: each rank's input feeds every rank's partial results")


@pytest.mark.points(1)
def check_reduce_from_tensor_parallel_region(submission, seed):
    """g: forward sums every rank's input (all-reduce); backward passes the gradient through"""
    _expect_operator(submission, seed, "op_g", "reduce_from_tensor_parallel_region (g)",
                     "; g's forward all-reduces and its backward is the identity")


@pytest.mark.points(1)
def check_gather_from_sequence_parallel_region(submission, seed):
    """Sequence all-gather: forward concatenates the ranks' shards along dim 0; backward reduce-scatters"""
    _expect_operator(submission, seed, "op_gather", "gather_from_sequence_parallel_region",
                     "; forward: rank r's shard is rows r*s/t .. of the output; backward: this rank's rows of "
                     "the sum over ranks of the gradients")


@pytest.mark.points(1)
def check_reduce_scatter_to_sequence_parallel_region(submission, seed):
    """Sequence reduce-scatter: forward keeps this rank's rows of the sum over ranks; backward all-gathers"""
    _expect_operator(submission, seed, "op_reduce_scatter", "reduce_scatter_to_sequence_parallel_region",
                     "; forward: rows r*s/t .. of the sum over ranks; backward: every rank's gradient shard, "
                     "concatenated along dim 0")


# --- 2. column- and row-parallel linear layers ------------------------------------------------

@pytest.mark.points(2)
def check_column_parallel_linear(submission, seed):
    """ColumnParallelLinear (with and without gather_output): output and gradients equal nn.Linear's"""
    _expect_dense(submission, seed, "column", "ColumnParallelLinear(32, 48)")
    _expect_dense(submission, seed, "column_gather", "ColumnParallelLinear(32, 48, gather_output=True)")


@pytest.mark.points(2)
def check_row_parallel_linear(submission, seed):
    """RowParallelLinear (input parallel and whole): output and gradients equal nn.Linear's, bias added once"""
    hint = "; the bias is added once, after the all-reduce (on every rank before it, it is counted t times)"
    _expect_dense(submission, seed, "row", "RowParallelLinear(48, 32)", hint)
    _expect_dense(submission, seed, "row_whole_input", "RowParallelLinear(48, 32, input_is_parallel=False)", hint)


# --- 3. MLP, attention, transformer layer ------------------------------------------------------

@pytest.mark.points(1)
def check_parallel_mlp(submission, seed):
    """ParallelMLP: output and every gradient equal Linear -> GELU -> Linear"""
    _expect_dense(submission, seed, "mlp", "ParallelMLP(32, 48)")


@pytest.mark.points(1)
def check_parallel_mlp_sequence_parallel(submission, seed):
    """ParallelMLP(sequence_parallel=True): the rank's sequence shard in, its shard of the dense output out"""
    _expect_dense(submission, seed, "mlp_sp", "ParallelMLP(32, 48, sequence_parallel=True)",
                  grad_hint="; the row layer's bias gradient comes from this rank's shard only: mark the bias "
                  "sequence_parallel so allreduce_sequence_parallel_grads sums it")


@pytest.mark.points(2)
def check_parallel_self_attention(submission, seed):
    """ParallelSelfAttention (causal and not): output and every gradient equal nn.MultiheadAttention's"""
    _expect_dense(submission, seed, "attention_causal", "ParallelSelfAttention(32, 8 heads, causal=True)")
    _expect_dense(submission, seed, "attention_full", "ParallelSelfAttention(32, 8 heads, causal=False)")


@pytest.mark.points(2)
def check_transformer_layer_tensor_parallel(submission, seed):
    """ParallelTransformerLayer: output and every gradient equal nn.TransformerEncoderLayer(norm_first=True)'s"""
    _expect_dense(submission, seed, "layer_tp", "ParallelTransformerLayer(32, 8 heads, 48)")


@pytest.mark.points(2)
def check_transformer_layer_sequence_parallel(submission, seed):
    """ParallelTransformerLayer(sequence_parallel=True): shards, gradients and synced LayerNorm grads equal dense"""
    _expect_dense(submission, seed, "layer_sp", "ParallelTransformerLayer(32, 8 heads, 48, sequence_parallel=True)",
                  grad_hint="; LayerNorm weights and biases (and row biases) see only this rank's sequence shard: mark "
                  "them sequence_parallel so allreduce_sequence_parallel_grads sums their gradients")


# --- 4. communication per layer -----------------------------------------------------------------

def _expect_collectives(submission, seed, name, what, want, why, wire):
    """With the layer's values right: what the kernel counted crossing in each pass
    (``wire(t, s*b*h bytes)`` = (bytes, messages, pattern)), in all and per rank, and the
    collectives the in-process log saw (``want``, per rank and pass)."""
    with_the_work(f"{what}'s communication", lambda: _expect_dense(submission, seed, name, what, labels=PASSED_ON))
    for t, (case, outcome) in _case(submission, seed, name).items():
        activation = case["activation"]
        nbytes, messages, pattern = wire(t, 8 * activation)  # float64
        for phase in PHASES:
            logged = nbytes if all(record[phase] for record in outcome["records"]) else 0  # the log saw collectives
            _expect_wire(submission, outcome, t, phase, nbytes, messages, what, pattern, logged=logged)
        expected = {kind.replace("N", str(activation)): n for kind, n in want.items()}
        for rank, record in enumerate(outcome["records"]):
            for phase in PHASES:
                got = record[phase]
                assert got == expected, (
                    f"{what} on {t} ranks, rank {rank}, {phase}: collectives {got or 'none'}, expected "
                    f"{expected} (elements of the whole tensor, s*b*h = {activation}); {why}")


@pytest.mark.points(2)
def check_tensor_parallel_layer_collectives(submission, seed):
    """A tensor-parallel layer makes exactly 2 all-reduces of s*b*h elements in forward and 2 in backward"""
    _expect_collectives(submission, seed, "layer_tp", "ParallelTransformerLayer(32, 8 heads, 48)",
                        {"all-reduce of N": 2},
                        "forward: g after attention's out and after fc2; backward: f before q/k/v (applied once "
                        "for all three) and before fc1",
                        lambda t, n: (2 * gloo_bytes("all_reduce", n, t), 2 * gloo_messages("all_reduce", t),
                                      "2 all-reduces of s*b*h"))


@pytest.mark.points(2)
def check_sequence_parallel_layer_collectives(submission, seed):
    """A sequence-parallel layer: no all-reduce; 2 all-gathers and 2 reduce-scatters of s*b*h each way"""
    _expect_collectives(submission, seed, "layer_sp",
                        "ParallelTransformerLayer(32, 8 heads, 48, sequence_parallel=True)",
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
BIG = f"ParallelMLP({oracles.BIG_HIDDEN}, {oracles.BIG_FFN}) on {oracles.BIG_T} ranks"
# MEMORY_MEASURED: how far each rank's memory rises above what it held as the pass began (the launcher
# starts its high-water mark afresh there), building the module and a forward pass of 4 tokens, after a
# small MLP's pass has allocated what any first pass allocates (gloo's and MKL's buffers: ~31 MiB, and
# more on some machines). 2 cores, torch 2.13 CPU, MiB: its own slices take 64, a full weight 128; the
# limit is 64 + 64 = 128. The reference 65; an initialiser that makes a shard-sized temporary
# (randn * scale) 96; a full weight made and sliced at init, then dropped 160; the full master weight
# kept 193; the weight all-gathered in forward 320. What a rank held beyond its inputs as the pass began
# counts as well, under own slices + a full weight (192): the reference held 25 (90 in all); a full-size
# buffer touched at import, into which the weight is gathered, 154 (its rise 65, 219 in all).


def _peak_of_the_large_pass(submission, seed):
    """(case, each rank's peak memory above what it held as the large MLP's build and forward
    pass began, whether that peak is the pass's own, what each rank held then above what it held
    once it had its inputs): the launcher's readings of VmHWM, started afresh after a small MLP's
    pass (``harness.memory_rank``), whose output must also be right, and of VmRSS. The peaks and
    holdings are None where this machine gives no reading."""
    case, job = oracles.run_memory(submission, seed)
    if job.status != "ok":
        raise failure_from({"status": job.status, "message": job.explain()}, BIG)
    for rank, (records, want) in enumerate(zip(job.outputs, case["want"])):
        record = records[-1]
        if record["status"] == "wrong_shape":
            raise AssertionError(f"{BIG}: {record['message']}")
        if record["status"] != "ok":
            raise failure_from(record, BIG)
        for label, expected in want.items():
            expect_array(record.get(label), expected, f"{BIG}, rank {rank}: {label}", rtol=RTOL, atol=ATOL)
    found = peak_in_phase(job, "memory:start", "memory:done")
    if found is None or None in found[0]:
        return case, None, False, None
    held = [None if at is None or base is None else at[0] - base
            for at, base in zip(job.memory["memory:start"], job.baseline_bytes)]
    return case, *found, None if None in held else held


@pytest.mark.points(2)
def check_no_rank_holds_a_full_weight(submission, seed, metrics):
    """No rank holds a full weight matrix: its peak memory, read from outside, and what its modules hold or save"""
    for name, what in LAYERS.items():
        with_the_work(f"the memory audit of {what}", lambda: _expect_dense(submission, seed, name, what))
    measured = []
    with_the_work(f"the peak memory of {BIG}", lambda: measured.extend(_peak_of_the_large_pass(submission, seed)))
    case, peaks, own, held = measured
    own_bytes, full = case["shard_bytes"], case["full_weight_bytes"]
    limit = own_bytes + full // 2  # see MEMORY_MEASURED
    if peaks is not None:
        metrics.update(peak_mib=[round(p / 2**20, 1) for p in peaks], limit_mib=limit / 2**20)
    if held is not None:
        metrics.update(held_before_mib=[round(h / 2**20, 1) for h in held])
    for name, what in LAYERS.items():  # the in-process records at small sizes name the tensor
        for t, (small, outcome) in _case(submission, seed, name).items():
            for rank, record in enumerate(outcome["records"]):
                _expect_no_full_weight(what, t, rank, record, small["limit"])
    if peaks is None:
        pytest.skip("this machine gives the launcher no reading of a process's memory (/proc/PID/status)")
    for rank, peak in enumerate(peaks):
        if peak >= limit and not own:  # a peak that may be the small pass's: no verdict either way
            pytest.skip(f"the launcher could not start the ranks' peak memory afresh here (it may not write their "
                        f"/proc/PID/clear_refs), and rank {rank}'s peak, {peak / 2**20:.0f} MiB, may be an earlier "
                        "pass's")
        assert peak < limit, (
            f"{BIG}, rank {rank}: its memory rose by {peak / 2**20:.0f} MiB building the module and running a "
            f"forward pass (the kernel's count of its memory, after a small MLP's pass); its own slices take "
            f"{own_bytes / 2**20:.0f} MiB, a full weight matrix {full / 2**20:.0f} MiB: keep only this rank's "
            "shard, and never gather the weights")
    # What a rank already held as the pass began (its import, the small pass) counts too: a buffer
    # touched before the pass does not rise in it. See MEMORY_MEASURED.
    for rank, (before, peak) in enumerate(zip(held or [], peaks)):
        assert before + peak < own_bytes + full, (
            f"{BIG}, rank {rank}: it held {before / 2**20:.0f} MiB beyond its inputs before the pass and its memory "
            f"rose by {peak / 2**20:.0f} MiB in it; its own slices take {own_bytes / 2**20:.0f} MiB, a full weight "
            f"matrix {full / 2**20:.0f} MiB: keep no buffer of a full weight's size, and never gather the weights")


def _expect_no_full_weight(what, t, rank, record, limit):
    assert record["held"] < limit, (
        f"{what} on {t} ranks, rank {rank}: {record['held_at']} has {record['held']} elements; a full weight matrix "
        f"of this layer has {limit} (its shard {limit // t}). Keep only this rank's shard")
    assert record["saved"] < limit, (
        f"{what} on {t} ranks, rank {rank}: a tensor of shape {tuple(record['saved_shape'])} ({record['saved']} "
        f"elements) is saved for backward; a full weight matrix of this layer has {limit}. Gathering the weights "
        "defeats tensor parallelism: multiply by the shard")


# --- 6. sizes that do not divide --------------------------------------------------------------------

@pytest.mark.points(1)
def check_heads_not_divisible_raises(submission, seed):
    """ParallelSelfAttention(hidden=24, n_heads=6) raises ValueError on 4 ranks (and builds on 2)"""
    for t, (case, outcome) in _case(submission, seed, "heads_indivisible").items():
        record = outcome["records"][0]["attention"]
        if case["expected"]["attention"]:
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
def check_linear_sizes_not_divisible_raise(submission, seed):
    """ColumnParallelLinear / RowParallelLinear raise ValueError when t does not divide the split features"""
    for t, (case, outcome) in _case(submission, seed, "linear_indivisible").items():
        record, odd = outcome["records"][0], case["odd"]
        for layer, built in ((f"ColumnParallelLinear(32, {odd})", record["column"]),
                             (f"RowParallelLinear({odd}, 32)", record["row"])):
            assert built["raised"], (
                f"no error raised: {layer} on {t} ranks built without a ValueError; {odd} features cannot be "
                f"split evenly over {t} ranks")


# --- 7. vocabulary-parallel embedding and cross-entropy -----------------------------------------------

@pytest.mark.points(1)
def check_vocab_parallel_embedding(submission, seed):
    """VocabParallelEmbedding: output and weight-shard gradient equal nn.Embedding's (vocab 24)"""
    _expect_dense(submission, seed, "embedding", "VocabParallelEmbedding(24, 32)",
                  "; ids outside rows r*vocab/t .. give zero rows on this rank before the all-reduce")


@pytest.mark.points(2)
def check_vocab_parallel_cross_entropy(submission, seed):
    """vocab_parallel_cross_entropy: loss and local-logit gradients equal F.cross_entropy of the gathered logits"""
    _expect_dense(submission, seed, "cross_entropy", "vocab_parallel_cross_entropy (vocab 24)",
                  "; max, sum of exp and the target's logit are each all-reduced; the gradient is "
                  "(softmax - one_hot(target)) / number of tokens on this rank's slice")


def _expect_made_below(what, t, rank, record, limit, of):
    elements, shape = record["made"]
    assert elements < limit, (
        f"{what} on {t} ranks, rank {rank}: it makes a tensor of shape {tuple(shape)} ({elements} elements); "
        f"the whole {of} is {limit} elements, and no rank makes a tensor that large, even for a moment")


@pytest.mark.points(1)
def check_vocab_parallel_embedding_looks_up_locally(submission, seed):
    """VocabParallelEmbedding: a local lookup, one all-reduce of s*b*h, none backward; never a table-sized tensor"""
    what = "VocabParallelEmbedding(24, 32)"
    with_the_work("the audit of the embedding's collectives and sizes",
                  lambda: _expect_dense(submission, seed, "embedding", what))
    for t, (case, outcome) in _case(submission, seed, "embedding").items():
        for rank, record in enumerate(outcome["records"]):
            want = {"forward": [["all_reduce", case["activation"]]], "backward": []}
            for phase, expected in want.items():
                got = record["dispatched"][phase]
                assert got == expected, (
                    f"{what} on {t} ranks, rank {rank}, {phase}: collectives {got or 'none'} ([kind, elements]), "
                    f"expected {expected or 'none'}: look up the ids in this rank's rows (zero rows for the "
                    "others' ids) and all-reduce the [s, b, h] result once (g); its backward is the identity")
            _expect_made_below(what, t, rank, record, case["limit"], "[vocab, hidden] table")
        nbytes = 8 * case["activation"]
        for phase, want in (("forward", gloo_bytes("all_reduce", nbytes, t)), ("backward", 0)):
            _expect_wire(submission, outcome, t, phase, want, gloo_messages("all_reduce", t) if want else 0, what,
                         "one all-reduce of s*b*h forward, nothing backward", logged=want)


@pytest.mark.points(2)
def check_vocab_parallel_cross_entropy_sends_per_token_values(submission, seed):
    """vocab_parallel_cross_entropy: only all-reduces of <= 3 values per token each way; no [tokens, vocab] tensor"""
    what = "vocab_parallel_cross_entropy (vocab 24)"
    with_the_work("the audit of the cross-entropy's collectives and sizes",
                  lambda: _expect_dense(submission, seed, "cross_entropy", what))
    for t, (case, outcome) in _case(submission, seed, "cross_entropy").items():
        for rank, record in enumerate(outcome["records"]):
            most = 3 * case["tokens"]
            for phase, got in record["dispatched"].items():
                moved = sum(n for _, n in got)
                assert all(kind == "all_reduce" for kind, _ in got) and moved <= most, (
                    f"{what} on {t} ranks, rank {rank}, {phase}: collectives {got} ([kind, elements]); only "
                    f"per-token values cross ranks, by all-reduce: the max, the sum of exps and the target's logit, "
                    f"at most {most} elements in all ({case['tokens']} tokens; two of them may share one "
                    "all-reduce). Gathering the logits defeats the vocabulary split")
            _expect_made_below(what, t, rank, record, case["limit"], "[tokens, vocab] logit matrix")
        tokens = 8 * case["tokens"]  # one float64 per token
        for phase, least in (("forward", 2), ("backward", 0)):
            _expect_wire(submission, outcome, t, phase, least * gloo_bytes("all_reduce", tokens, t),
                         3 * gloo_messages("all_reduce", t), what, "all-reduces of per-token values (at most 3 per "
                         "token)", most=3 * gloo_bytes("all_reduce", tokens, t))
