"""Lab 10's grading pieces on one process: the collective recorder, the loader that puts a
rank's given slice into a student's module, the layouts the grader slices a dense model
by, what each rank receives (its own part, no answer), the full-weight detector, and how
the checks read the ranks' records (no property without the right values)."""
import inspect
import types

import numpy as np
import pytest

from conftest import load_check_file

torch = pytest.importorskip("torch")
import torch.distributed as tdist  # noqa: E402
from torch import nn  # noqa: E402

LAB = "10-tensor-parallel"
harness, checks = load_check_file(LAB, "harness"), load_check_file(LAB, "check_tensor_parallel")
oracles = checks.oracles


# --- the collective recorder --------------------------------------------------------------------

def _fake_distributed():
    """A stand-in for torch.distributed: its collectives' signatures, calls remembered, no process group."""
    called = []

    def fake(op):
        def collective(*args, **kwargs):
            called.append(op)
        collective.__signature__ = inspect.signature(getattr(tdist, op))
        return collective
    return types.SimpleNamespace(**{op: fake(op) for op in harness.COLLECTIVES}), called


def test_collective_log_records_kind_whole_elements_and_phase():
    module, called = _fake_distributed()
    log = harness.CollectiveLog(module).install()
    shard, whole = torch.zeros(2, 3), torch.zeros(8, 3)
    module.all_reduce(whole)  # outside any phase: passed through, not recorded
    with log.phase("forward"):
        module.all_reduce(tensor=whole)
        module.all_gather_single(whole, shard)
        module.reduce_scatter_single(output=shard, input=whole)
        module.all_gather_into_tensor(whole, shard)  # the old names (deprecated in torch 2.13) count alike
        module.reduce_scatter_tensor(output=shard, input=whole)
    with log.phase("backward"):
        module.all_gather([shard] * 4, shard)
        module.reduce_scatter(shard, [shard] * 4)
        module.broadcast(shard, 0)
    assert called == ["all_reduce", "all_reduce", "all_gather_single", "reduce_scatter_single",
                      "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather", "reduce_scatter", "broadcast"]
    assert log.calls == [("all-reduce", 24, "forward")] + [("all-gather", 24, "forward"),
                                                          ("reduce-scatter", 24, "forward")] * 2 + [
        ("all-gather", 24, "backward"), ("reduce-scatter", 24, "backward"), ("broadcast", 6, "backward")]
    assert harness.tally(log.calls, "forward") == {"all-reduce of 24": 1, "all-gather of 24": 2,
                                                   "reduce-scatter of 24": 2}
    assert harness.tally(log.calls, "sync") == {}
    log.uninstall()
    module.all_reduce(whole)
    assert len(log.calls) == 8 and called[-1] == "all_reduce"


# --- the layouts (grader) and the loader (sandbox) ------------------------------------------------

class _Shard(nn.Module):
    def __init__(self, *weight_shape, bias=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(weight_shape, dtype=torch.float64))
        self.bias = None if bias is None else nn.Parameter(torch.zeros(bias, dtype=torch.float64))


def _linear(i, o):
    torch.manual_seed(0)
    return nn.Linear(i, o, dtype=torch.float64)


def _load_all(module, slices, rank, label="Layer"):
    """What the harness does with a rank's part: each given slice into the student's parameter."""
    return [harness.load(module, f"{label}.{s.path}", s.path, s.dense.detach()[s.index].numpy(), s.expected(rank))
            for s in slices]


def test_column_shards_of_every_rank_stack_into_the_dense_weight():
    dense, t = _linear(6, 8), 4
    shards = [_Shard(2, 6, bias=2) for _ in range(t)]
    for rank, shard in enumerate(shards):
        _load_all(shard, oracles.column("", dense.weight, dense.bias, rank, t), rank)
    assert torch.equal(torch.cat([s.weight for s in shards]), dense.weight)
    assert torch.equal(torch.cat([s.bias for s in shards]), dense.bias)


def test_row_shards_split_the_columns_and_keep_the_bias_whole():
    dense, t = _linear(8, 6), 2
    shards = [_Shard(6, 4, bias=6) for _ in range(t)]
    for rank, shard in enumerate(shards):
        _load_all(shard, oracles.row("", dense.weight, dense.bias, rank, t), rank)
    assert torch.equal(torch.cat([s.weight for s in shards], dim=1), dense.weight)
    assert all(torch.equal(s.bias, dense.bias) for s in shards)


def test_wrong_shapes_and_dtypes_are_reported_with_the_expected_shard():
    dense = _linear(16, 16)
    column = lambda rank: oracles.column("", dense.weight, dense.bias, rank, 2)  # noqa: E731
    with pytest.raises(harness.LoadError, match=r"ColumnParallelLinear.weight has shape \(16, 8\); rank 0's shard "
                       r"of a \(16, 16\) weight split by output features is \(8, 16\)"):
        _load_all(_Shard(16, 8, bias=8), column(0), 0, "ColumnParallelLinear")
    with pytest.raises(harness.LoadError, match=r"RowParallelLinear.bias has shape \(8,\); the bias is whole"):
        _load_all(_Shard(16, 8, bias=8), oracles.row("", dense.weight, dense.bias, 1, 2), 1, "RowParallelLinear")
    with pytest.raises(harness.LoadError, match=r"ColumnParallelLinear.bias is None"):
        _load_all(_Shard(8, 16), column(0), 0, "ColumnParallelLinear")
    with pytest.raises(harness.LoadError, match="float64"):
        _load_all(_Shard(8, 16, bias=8).float(), column(0), 0, "ColumnParallelLinear")


def test_attention_slices_q_k_v_out_of_in_proj_by_heads():
    torch.manual_seed(1)
    h, t = 8, 2
    mha = nn.MultiheadAttention(h, 4, dtype=torch.float64)
    ranks = []
    for rank in range(t):
        student = nn.Module()
        for name in "qkv":
            setattr(student, name, _Shard(h // t, h, bias=h // t))
        student.out = _Shard(h, h // t, bias=h)
        _load_all(student, oracles.attention("", mha, rank, t), rank, "ParallelSelfAttention")
        ranks.append(student)
    for i, name in enumerate("qkv"):
        stacked = torch.cat([getattr(s, name).weight for s in ranks])
        assert torch.equal(stacked, mha.in_proj_weight[i * h:(i + 1) * h])
    assert torch.equal(torch.cat([s.out.weight for s in ranks], dim=1), mha.out_proj.weight)
    del ranks[0].out
    with pytest.raises(harness.LoadError, match="ParallelSelfAttention has no .out"):
        _load_all(ranks[0], oracles.attention("", mha, 0, t), 0, "ParallelSelfAttention")


def test_the_slices_make_a_tensor_parallel_mlp_equal_the_dense_one():
    """The grader's slicing is the math of Megatron's MLP: sum over ranks of
    fc2_r(gelu(fc1_r(x))), plus fc2's bias once, is the dense MLP; and the dense
    gradients sliced the same way are the shards' gradients."""
    torch.manual_seed(2)
    t = 4
    dense = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6)).double()
    x = torch.randn(5, 6, dtype=torch.float64)
    dense(x).sum().backward()
    total, loaded = 0, []
    for rank in range(t):
        mlp = nn.Module()
        mlp.fc1, mlp.fc2 = _Shard(2, 6, bias=2), _Shard(6, 2, bias=6)
        slices = oracles.mlp("", dense[0], dense[2], rank, t)
        loaded += list(zip(slices, _load_all(mlp, slices, rank, "ParallelMLP")))
        total = total + torch.nn.functional.gelu(x @ mlp.fc1.weight.T + mlp.fc1.bias) @ mlp.fc2.weight.T
    out = total + loaded[-1][1]  # fc2's bias (the last rank's copy), added once
    torch.testing.assert_close(out, dense(x), rtol=1e-12, atol=1e-12)
    out.sum().backward()
    unused = [param for s, param in loaded[:-1] if s.path == "fc2.bias"]
    assert len(unused) == t - 1 and all(param.grad is None for param in unused)
    for s, param in loaded:
        if all(param is not other for other in unused):
            torch.testing.assert_close(param.grad, s.dense.grad[s.index], rtol=1e-12, atol=1e-12)


# --- what each rank receives ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def four_ranks():
    return oracles.cases(4, seed=12345)


def test_each_rank_receives_only_its_own_part_and_no_answer(four_ranks):
    for name, case in four_ranks.items():
        for part in case["parts"]:
            assert set(part) <= {"kind", "function", "x", "upstream", "build", "sync", "shards", "logits", "target",
                                 "builds"}, name
    f = four_ranks["op_f"]  # f's backward is the sum of every rank's upstream: no rank holds it
    total = sum(part["upstream"] for part in f["parts"])
    for rank, (part, want) in enumerate(zip(f["parts"], f["want"])):
        np.testing.assert_allclose(want["gradient of the input"], total)
        assert not np.allclose(part["upstream"], total)
    layer = four_ranks["layer_sp"]  # the sequence shard in, and only this rank's slices of the weights
    for rank, part in enumerate(layer["parts"]):
        assert part["x"].shape == (oracles.SEQ // 4, oracles.BATCH, oracles.HIDDEN)
        q = next(array for label, _, array, _ in part["shards"] if label.endswith("attn.q.weight"))
        assert q.shape == (oracles.HIDDEN // 4, oracles.HIDDEN)


def test_inputs_come_from_the_grading_seed(four_ranks):
    again, other = oracles.cases(4, seed=12345), oracles.cases(4, seed=54321)
    for name in ("op_g", "mlp", "embedding", "cross_entropy"):
        first = four_ranks[name]["parts"][1]
        key = "logits" if name == "cross_entropy" else "x"
        np.testing.assert_array_equal(first[key], again[name]["parts"][1][key])
        assert not np.array_equal(first[key], other[name]["parts"][1][key])


def test_sizes_keep_activations_below_every_full_weight():
    activation = oracles.SEQ * oracles.BATCH * max(oracles.HIDDEN, oracles.FFN)
    smallest_full = min(oracles.HIDDEN ** 2, oracles.HIDDEN * oracles.FFN, oracles.VOCAB * oracles.HIDDEN)
    assert activation <= smallest_full and oracles.SEQ * oracles.BATCH * oracles.HIDDEN < smallest_full
    assert oracles.HIDDEN * oracles.FFN // 2 < oracles.HIDDEN ** 2  # an MLP shard on 2 ranks is no full weight
    tokens = oracles.SEQ * oracles.BATCH
    assert tokens * oracles.HIDDEN < oracles.VOCAB * oracles.HIDDEN  # the embedding's output is no table
    # The memory case: a full weight (128 MiB) is four times the runtime's own buffers (~31 MiB measured)
    # and twice a rank's slices; a few tokens of activations are nothing beside it.
    full = 8 * oracles.BIG_HIDDEN * oracles.BIG_FFN
    assert full == 128 * 2**20 and 8 * oracles.BIG_SEQ * oracles.BIG_BATCH * oracles.BIG_FFN < 2**20


# --- the full-weight detector -------------------------------------------------------------------------

def test_largest_held_finds_a_full_weight_kept_anywhere_in_the_module():
    module = _Shard(2, 6, bias=2)
    assert harness.largest_held(module) == (12, "_Shard.weight")
    module.cache = [torch.zeros(8, 6)]  # a full [8, 6] weight kept in a list attribute
    assert harness.largest_held(module) == (48, "_Shard.cache[0]")
    module.helper = types.SimpleNamespace(full=torch.zeros(100))  # not an object of the student's module
    assert harness.largest_held(module)[0] == 48
    assert harness.largest_held(module, student_module="types")[0] == 100


def test_saved_watch_sees_what_autograd_saves_for_backward():
    weight = torch.randn(8, 6, requires_grad=True)
    x = torch.randn(3, 6, requires_grad=True)
    with harness.SavedWatch() as watch:
        torch.nn.functional.linear(x, weight)
    assert watch.largest[0] == 48  # the weight (transposed), larger than the input
    with harness.SavedWatch() as watch, torch.no_grad():
        torch.nn.functional.linear(x, weight)
    assert watch.largest == (0, ())


def test_oplog_sees_a_tensor_made_and_dropped_at_once():
    from course.torch_audit import OpLog

    with OpLog() as log:
        torch.zeros(24, 32).sum()  # neither kept nor saved for backward: still made
    assert log.largest == (768, (24, 32))


# --- the checks read the ranks' records as intended ----------------------------------------------

class _FakeSubmission:
    """The jobs' results, as ``submission.once`` would hold them."""

    def __init__(self, jobs):
        self.jobs, self.flags = jobs, []

    def once(self, key, compute):
        return self.jobs[key]


def _record(want, **more):
    return {"status": "ok", **want, **more}


def _outcome(records, forward=0, backward=0, t=2):
    """Records as a job returns them, with what the kernel counted in each pass, in all and per rank."""
    return {"status": "ok", "records": records, "wire": {"forward": forward, "backward": backward},
            "sent": {"forward": [forward // t] * t, "backward": [backward // t] * t}}


def _jobs(cases_by_t, outcomes_by_t):
    return {("cases_job", t): (cases_by_t[t], outcomes_by_t[t]) for t in cases_by_t}


def _layer_tp(t, values_right=True, forward_reduces=2, backward_reduces=2, logged_backward=2):
    """The tensor-parallel layer case on t ranks: its values right or zero, the kernel's count of
    ``forward_reduces`` / ``backward_reduces`` all-reduces of s*b*h, the log's count."""
    from course.wire import gloo_bytes

    n = oracles.SEQ * oracles.BATCH * oracles.HIDDEN
    want = [{"output": np.full((oracles.SEQ, oracles.BATCH, oracles.HIDDEN), 1.0 + rank)} for rank in range(t)]
    case = {"want": want, "activation": n}
    records = [_record({k: v if values_right else np.zeros_like(v) for k, v in w.items()},
                       forward={f"all-reduce of {n}": 2}, backward={f"all-reduce of {n}": logged_backward})
               for w in want]
    nbytes = gloo_bytes("all_reduce", 8 * n, t)
    return case, _outcome(records, forward_reduces * nbytes, backward_reduces * nbytes, t)


def _tp_submission(**layer):
    cases, outcomes = {}, {}
    for t in checks.WORLD_SIZES:
        case, outcome = _layer_tp(t, **layer)
        cases[t], outcomes[t] = {"layer_tp": case}, {"layer_tp": outcome}
    return _FakeSubmission(_jobs(cases, outcomes))


def test_layer_collectives_pass_with_the_values_and_the_bytes_right():
    checks.check_tensor_parallel_layer_collectives(_tp_submission(), seed=0)


def test_collective_check_names_what_came_and_what_was_expected():
    with pytest.raises(AssertionError, match=r"backward: collectives \{'all-reduce of 512': 4\}, expected "
                                              r"\{'all-reduce of 512': 2\}"):
        checks.check_tensor_parallel_layer_collectives(_tp_submission(logged_backward=4), seed=0)
    with pytest.raises(AssertionError, match=r"backward: \d+ bytes crossed between the ranks"):
        checks.check_tensor_parallel_layer_collectives(_tp_submission(backward_reduces=4), seed=0)


def test_collectives_on_zeros_earn_nothing():
    """The log and the kernel's count both right, the values wrong: not credited."""
    with pytest.raises(AssertionError, match="not credited: ParallelTransformerLayer.*'s communication"):
        checks.check_tensor_parallel_layer_collectives(_tp_submission(values_right=False), seed=0)


def test_an_operator_check_reads_the_bytes_of_each_pass_per_rank():
    from course.wire import gloo_bytes

    def submission(sent_backward):
        cases, outcomes = {}, {}
        for t in checks.WORLD_SIZES:
            want = [{"output": np.ones(60), "gradient of the input": np.ones(60)}] * t
            cases[t] = {"op_f": {"want": want, "elements": 60}}
            nbytes = gloo_bytes("all_reduce", 8 * 60, t)
            outcome = _outcome([_record(w, forward={}, backward={"all-reduce of 60": 1}) for w in want], 0, nbytes, t)
            outcome["sent"]["backward"] = sent_backward(nbytes, t)
            outcomes[t] = {"op_f": outcome}
        return _FakeSubmission(_jobs(cases, outcomes))
    checks.check_copy_to_tensor_parallel_region(submission(lambda n, t: [n // t] * t), seed=0)
    with pytest.raises(AssertionError, match="the ranks sent"):  # one rank sent it all
        checks.check_copy_to_tensor_parallel_region(submission(lambda n, t: [n] + [0] * (t - 1)), seed=0)


def test_heads_check_fails_with_no_error_raised_when_it_builds_silently():
    built = {"status": "ok", "attention": {"raised": False, "message": ""}}
    cases = {t: {"heads_indivisible": {"expected": {"attention": t == 4}}} for t in checks.WORLD_SIZES}
    outcomes = {t: {"heads_indivisible": {"status": "ok", "records": [built] * t}} for t in checks.WORLD_SIZES}
    with pytest.raises(AssertionError, match="no error raised"):
        checks.check_heads_not_divisible_raises(_FakeSubmission(_jobs(cases, outcomes)), seed=0)


def _cross_entropy(dispatched, made, values_right=True):
    from course.wire import gloo_bytes

    cases, outcomes = {}, {}
    for t in checks.WORLD_SIZES:
        want = [{"loss": np.array(2.5), "gradient of the local logits": np.ones((8, 2, 24 // t))}] * t
        cases[t] = {"cross_entropy": {"want": want, "tokens": 16, "limit": 384}}
        records = [_record({k: v if values_right else v * 0 for k, v in w.items()}, dispatched=dispatched, made=made)
                   for w in want]
        outcomes[t] = {"cross_entropy": _outcome(records, 3 * gloo_bytes("all_reduce", 8 * 16, t), 0, t)}
    return _FakeSubmission(_jobs(cases, outcomes))


def test_cross_entropy_audit_names_a_gather_and_a_whole_vocabulary_tensor():
    check = checks.check_vocab_parallel_cross_entropy_sends_per_token_values
    with pytest.raises(AssertionError, match=r"forward: collectives \[\['all_gather', 192\]\]"):
        check(_cross_entropy({"forward": [["all_gather", 192]], "backward": []}, [192, [8, 2, 12]]), seed=0)
    fused = {"forward": [["all_reduce", 16], ["all_reduce", 32]], "backward": []}  # max, then the two sums stacked
    with pytest.raises(AssertionError, match=r"makes a tensor of shape \(8, 2, 24\)"):
        check(_cross_entropy(fused, [384, [8, 2, 24]]), seed=0)
    check(_cross_entropy(fused, [192, [8, 2, 12]]), seed=0)
    with pytest.raises(AssertionError, match="not credited: the audit of the cross-entropy"):
        check(_cross_entropy(fused, [192, [8, 2, 12]], values_right=False), seed=0)


def test_the_memory_check_reads_each_ranks_peak_from_outside():
    """The small layers' values and audits fine; the large MLP's peak (the launcher's reading) decides."""
    from autograder.grading.rank_jobs import RankJob

    small = np.ones(3)
    cases, outcomes = {}, {}
    for t in checks.WORLD_SIZES:
        cases[t] = {name: {"want": [{"output": small}] * t, "limit": 1536} for name in checks.LAYERS}
        outcomes[t] = {name: _outcome([_record({"output": small}, held=768, held_at="m.weight", saved=512,
                                               saved_shape=[16, 32])] * t) for name in checks.LAYERS}
    mib, output = 2**20, np.arange(4.0)
    big = {"want": [{"output": output}] * 4, "shard_bytes": 64 * mib, "full_weight_bytes": 128 * mib}

    def graded(peak_mib, fresh=True, held_mib=25):
        # The launcher's readings, [VmRSS, VmHWM], at the marks around the large MLP's pass, and
        # VmRSS once each rank had its inputs.
        at_start = (300 + held_mib) * mib
        memory = {"memory:start": [[at_start, at_start]] * 4,
                  "memory:done": [[at_start, at_start + p * mib] for p in peak_mib]}
        job = RankJob("torch", 4, "ok", outputs=[[{"case": "memory", "status": "ok", "output": output}]] * 4,
                      memory=memory, fresh_peaks={"memory:start"} if fresh else set(), baseline_bytes=[300 * mib] * 4)
        jobs = {**_jobs(cases, outcomes), "memory_job": (big, job)}
        metrics = {}
        checks.check_no_rank_holds_a_full_weight(_FakeSubmission(jobs), seed=0, metrics=metrics)
        return metrics

    assert graded([65, 65, 66, 65])["peak_mib"] == [65, 65, 66, 65]
    # A full weight's buffer touched before the pass does not rise in it; what was held then counts.
    with pytest.raises(AssertionError, match=r"rank 0: it held 154 MiB beyond its inputs before the pass"):
        graded([65, 65, 66, 65], held_mib=154)
    with pytest.raises(AssertionError, match=r"rank 2: its memory rose by 160 MiB .* full weight matrix 128 MiB"):
        graded([65, 65, 160, 65])
    # Where the peaks could not start afresh, a high one may be the small pass's: no verdict.
    assert graded([65, 65, 66, 65], fresh=False)["peak_mib"] == [65, 65, 66, 65]
    with pytest.raises(pytest.skip.Exception, match="rank 2's peak, 160 MiB, may be an earlier pass's"):
        graded([65, 65, 160, 65], fresh=False)
