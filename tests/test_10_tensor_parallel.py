"""Lab 10's grading pieces on one process: the collective recorder, the loader
that copies a rank's slice of a dense model into a student's module, and the
full-weight detector are right on their own before they judge anyone's code."""
import inspect
import types

import pytest

from conftest import load_check_file

torch = pytest.importorskip("torch")
import torch.distributed as tdist  # noqa: E402
from torch import nn  # noqa: E402

LAB = "10-tensor-parallel"
harness, checks = load_check_file(LAB, "harness"), load_check_file(LAB, "check_tensor_parallel")


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


# --- the loader -------------------------------------------------------------------------------------

class _Shard(nn.Module):
    def __init__(self, *weight_shape, bias=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(weight_shape, dtype=torch.float64))
        self.bias = None if bias is None else nn.Parameter(torch.zeros(bias, dtype=torch.float64))


def _linear(i, o):
    torch.manual_seed(0)
    return nn.Linear(i, o, dtype=torch.float64)


def test_column_shards_of_every_rank_stack_into_the_dense_weight():
    dense, t = _linear(6, 8), 4
    shards = [_Shard(2, 6, bias=2) for _ in range(t)]
    for rank, shard in enumerate(shards):
        harness.bind_column("ColumnParallelLinear", shard, dense.weight, dense.bias, rank, t)
    assert torch.equal(torch.cat([s.weight for s in shards]), dense.weight)
    assert torch.equal(torch.cat([s.bias for s in shards]), dense.bias)


def test_row_shards_split_the_columns_and_keep_the_bias_whole():
    dense, t = _linear(8, 6), 2
    shards = [_Shard(6, 4, bias=6) for _ in range(t)]
    for rank, shard in enumerate(shards):
        harness.bind_row("RowParallelLinear", shard, dense.weight, dense.bias, rank, t)
    assert torch.equal(torch.cat([s.weight for s in shards], dim=1), dense.weight)
    assert all(torch.equal(s.bias, dense.bias) for s in shards)


def test_wrong_shapes_and_dtypes_are_reported_with_the_expected_shard():
    dense = _linear(16, 16)
    with pytest.raises(harness.LoadError, match=r"ColumnParallelLinear.weight has shape \(16, 8\); rank 0's shard "
                       r"of a \(16, 16\) weight split by output features is \(8, 16\)"):
        harness.bind_column("ColumnParallelLinear", _Shard(16, 8, bias=8), dense.weight, dense.bias, 0, 2)
    with pytest.raises(harness.LoadError, match=r"RowParallelLinear.bias has shape \(8,\); the bias is whole"):
        harness.bind_row("RowParallelLinear", _Shard(16, 8, bias=8), dense.weight, dense.bias, 1, 2)
    with pytest.raises(harness.LoadError, match=r"ColumnParallelLinear.bias is None"):
        harness.bind_column("ColumnParallelLinear", _Shard(8, 16), dense.weight, dense.bias, 0, 2)
    single = _Shard(8, 16, bias=8).float()
    with pytest.raises(harness.LoadError, match="float64"):
        harness.bind_column("ColumnParallelLinear", single, dense.weight, dense.bias, 0, 2)


def test_attention_bindings_slice_q_k_v_out_of_in_proj_by_heads():
    torch.manual_seed(1)
    h, t = 8, 2
    mha = nn.MultiheadAttention(h, 4, dtype=torch.float64)
    ranks = []
    for rank in range(t):
        student = nn.Module()
        for name in "qkv":
            setattr(student, name, _Shard(h // t, h, bias=h // t))
        student.out = _Shard(h, h // t, bias=h)
        harness.bind_attention("ParallelSelfAttention", student, mha, rank, t)
        ranks.append(student)
    for i, name in enumerate("qkv"):
        stacked = torch.cat([getattr(s, name).weight for s in ranks])
        assert torch.equal(stacked, mha.in_proj_weight[i * h:(i + 1) * h])
    assert torch.equal(torch.cat([s.out.weight for s in ranks], dim=1), mha.out_proj.weight)
    with pytest.raises(harness.LoadError, match="has no .out"):
        del ranks[0].out
        harness.bind_attention("ParallelSelfAttention", ranks[0], mha, 0, t)


def test_the_bound_slices_make_a_tensor_parallel_mlp_equal_the_dense_one():
    """The grader's slicing is the math of Megatron's MLP: sum over ranks of
    fc2_r(gelu(fc1_r(x))), plus fc2's bias once, is the dense MLP; and the dense
    gradients sliced by the bindings are the shards' gradients."""
    torch.manual_seed(2)
    t = 4
    dense = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6)).double()
    x = torch.randn(5, 6, dtype=torch.float64)
    dense(x).sum().backward()
    total, bindings = 0, []
    for rank in range(t):
        fc1, fc2 = _Shard(2, 6, bias=2), _Shard(6, 2, bias=6)
        mlp = nn.Module()
        mlp.fc1, mlp.fc2 = fc1, fc2
        bindings += harness.bind_mlp("ParallelMLP", mlp, dense[0], dense[2], rank, t)
        total = total + torch.nn.functional.gelu(x @ fc1.weight.T + fc1.bias) @ fc2.weight.T
    out = total + bindings[-1].student  # fc2's bias (the last rank's copy), added once
    torch.testing.assert_close(out, dense(x), rtol=1e-12, atol=1e-12)
    out.sum().backward()
    copies_unused = [b for b in bindings[:-1] if b.label == "ParallelMLP.fc2.bias"]
    assert len(copies_unused) == t - 1 and all(b.student.grad is None for b in copies_unused)
    for b in bindings:
        if b not in copies_unused:
            torch.testing.assert_close(b.student.grad, b.dense.grad[b.index], rtol=1e-12, atol=1e-12)


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


# --- the checks read the harness's records as intended ----------------------------------------------

class _FakeSubmission:
    def __init__(self, outcomes):
        self.outcomes, self.flags = outcomes, []

    def harness_once(self, key, func, t):
        return self.outcomes[t]


def _counted(outcome, t, forward_reduces, backward_reduces, nbytes):
    """``outcome`` with what the launcher would count for its all-reduces of ``nbytes`` on t ranks."""
    from course.wire import gloo_bytes

    wire = {"forward": forward_reduces * gloo_bytes("all_reduce", nbytes, t),
            "backward": backward_reduces * gloo_bytes("all_reduce", nbytes, t)}
    return {name: {**case, "wire": wire} for name, case in outcome.items()}


def test_heads_check_fails_with_no_error_raised_when_it_builds_silently():
    built = {"status": "ok", "ranks": [{"raised": False, "message": "", "expected": True}]}
    fine = {"status": "ok", "ranks": [{"raised": False, "message": "", "expected": False}]}
    submission = _FakeSubmission({2: {"heads_indivisible": fine}, 4: {"heads_indivisible": built}})
    with pytest.raises(AssertionError, match="no error raised"):
        checks.check_heads_not_divisible_raises(submission)


def test_collective_check_names_what_came_and_what_was_expected():
    record = {"activation": 512, "forward": {"all-reduce of 512": 2}, "backward": {"all-reduce of 512": 4}}
    outcome = {"layer_tp": {"status": "ok", "ranks": [record, record]}}
    counted = {t: _counted(outcome, t, 2, 2, 8 * 512) for t in (2, 4)}  # the kernel's count is right here
    with pytest.raises(AssertionError, match=r"backward: collectives \{'all-reduce of 512': 4\}, expected "
                                              r"\{'all-reduce of 512': 2\}"):
        checks.check_tensor_parallel_layer_collectives(_FakeSubmission(counted))
    counted = {t: _counted(outcome, t, 2, 4, 8 * 512) for t in (2, 4)}  # and here it is not
    with pytest.raises(AssertionError, match=r"backward: \d+ bytes crossed between the ranks"):
        checks.check_tensor_parallel_layer_collectives(_FakeSubmission(counted))


def test_sizes_keep_activations_below_every_full_weight():
    activation = harness.SEQ * harness.BATCH * max(harness.HIDDEN, harness.FFN)
    smallest_full = min(harness.HIDDEN ** 2, harness.HIDDEN * harness.FFN, harness.VOCAB * harness.HIDDEN)
    assert activation <= smallest_full and harness.SEQ * harness.BATCH * harness.HIDDEN < smallest_full
    assert harness.HIDDEN * harness.FFN // 2 < harness.HIDDEN ** 2  # an MLP shard on 2 ranks is no full weight


def test_the_vocabulary_pairs_own_tensors_stay_below_the_whole_logits_and_table():
    tokens = harness.SEQ * harness.BATCH
    assert tokens * harness.VOCAB // 2 < tokens * harness.VOCAB  # the local logits on 2 ranks: half of them
    assert tokens * harness.HIDDEN < harness.VOCAB * harness.HIDDEN  # the embedding's output is no table


def test_oplog_sees_a_tensor_made_and_dropped_at_once():
    from course.torch_audit import OpLog

    with OpLog() as log:
        torch.zeros(24, 32).sum()  # neither kept nor saved for backward: still made
    assert log.largest == (768, (24, 32))


def _vocab_record(dispatched, made, **more):
    return {"arrays": {}, "dispatched": dispatched, "made": made, **more}


def test_cross_entropy_audit_names_a_gather_and_a_whole_vocabulary_tensor():
    gathered = _vocab_record({"forward": [["all_gather", 192]], "backward": []}, [192, [8, 2, 12]],
                             tokens=16, limit=384)
    outcome = {"cross_entropy": {"status": "ok", "ranks": [gathered, gathered]}}
    with pytest.raises(AssertionError, match=r"forward: collectives \[\['all_gather', 192\]\]"):
        checks.check_vocab_parallel_cross_entropy_sends_per_token_values(_FakeSubmission({2: outcome, 4: outcome}))
    fused = {"forward": [["all_reduce", 16], ["all_reduce", 32]], "backward": []}  # max, then the two sums stacked
    wide = _vocab_record(fused, [384, [8, 2, 24]], tokens=16, limit=384)
    outcome = {"cross_entropy": {"status": "ok", "ranks": [wide, wide]}}
    with pytest.raises(AssertionError, match=r"makes a tensor of shape \(8, 2, 24\)"):
        checks.check_vocab_parallel_cross_entropy_sends_per_token_values(_FakeSubmission({2: outcome, 4: outcome}))
    fine = _vocab_record(fused, [192, [8, 2, 12]], tokens=16, limit=384)
    outcome = {"cross_entropy": {"status": "ok", "ranks": [fine, fine]}}
    checks.check_vocab_parallel_cross_entropy_sends_per_token_values(
        _FakeSubmission({t: _counted(outcome, t, 3, 0, 8 * 16) for t in (2, 4)}))


def test_vocab_audits_credit_nothing_when_the_values_are_wrong():
    record = _vocab_record({"forward": [["all_reduce", 512]], "backward": []}, [512, [8, 2, 32]], activation=512,
                           limit=768)
    record["arrays"] = {"output": (None, [0.0])}  # a forward that returned None makes no wrong collective
    outcome = {"embedding": {"status": "ok", "ranks": [record, record]}}
    with pytest.raises(AssertionError, match="not credited: the audit of the embedding's collectives and sizes"):
        checks.check_vocab_parallel_embedding_looks_up_locally(_FakeSubmission({2: outcome, 4: outcome}))
