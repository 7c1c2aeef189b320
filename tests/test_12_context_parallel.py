"""Lab 12's grader: its checks of a log-sum-exp and of a merge accept the right
answer (torch's) and refuse wrong ones, its zigzag table is the documented layout
(the hidden oracle's), the layout facts its checks rely on hold (zigzag balances
causal work, contiguous chunks do not), its GPU speed check's recheck of every timed
run accepts right attention and catches a stale run (on the stand-ins), and a ring
that deadlocks costs its cases only, within the timeout, with no process left behind."""
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from autograder.grading import timed
from autograder.sandbox import Limits
from conftest import load_check_file

REPO = Path(__file__).resolve().parents[1]
LAB = "12-context-parallel"
CHECKS = REPO / "autograder" / "checks" / LAB
checks = load_check_file(LAB, "check_context_parallel")
oracles, hidden = checks.oracles, load_check_file(LAB, "oracles_hidden")


def _torch_lse(q, k, causal):
    scores = torch.tensor(q) @ torch.tensor(k).transpose(-2, -1) / np.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.logsumexp(scores, -1).numpy()


@pytest.mark.parametrize("causal", [False, True])
def test_the_lse_check_accepts_torchs_logsumexp_and_nothing_else(causal):
    inputs = oracles.qkv(5, (2, 3, 9, 6), scale=3.0)
    q, k = inputs["q"], inputs["k"]
    lse = _torch_lse(q, k, causal)
    assert oracles.lse_problem(q, k, causal, lse, "lse") is None
    for wrong in (lse + 1e-8, lse - np.log(2), _torch_lse(q, k, not causal), lse[..., :-1]):
        assert oracles.lse_problem(q, k, causal, wrong, "lse") is not None
    wrong = lse.copy()
    wrong[1, 2, 4] += 1e-7
    assert oracles.lse_problem(q, k, causal, wrong, "lse").startswith("lse[1, 2, 4] = ")


def test_torch_attention_gives_the_output_and_autograds_gradients():
    inputs = oracles.qkv(7, (2, 2, 5, 6))
    out, dq, dk, dv = oracles.torch_attention(inputs["q"], inputs["k"], inputs["v"], True, inputs["upstream"])
    np.testing.assert_array_equal(out, oracles.torch_attention(inputs["q"], inputs["k"], inputs["v"], True))
    q = torch.tensor(inputs["q"], requires_grad=True)
    (torch.nn.functional.scaled_dot_product_attention(q, torch.tensor(inputs["k"]), torch.tensor(inputs["v"]),
                                                      is_causal=True) * torch.tensor(inputs["upstream"])).sum().backward()
    np.testing.assert_allclose(dq, q.grad.numpy(), rtol=1e-14)
    assert dk.shape == dv.shape == inputs["k"].shape


def _blocks(seed, centre=0.0):
    """Two blocks' (out, lse) of the same queries, from torch, and the attention over both."""
    inputs = oracles.qkv(seed, (2, 2, 5, 6))
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    halves = [(oracles.torch_attention(q, k[..., part, :], v[..., part, :]), _torch_lse(q, k[..., part, :], False))
              for part in (slice(0, 3), slice(3, None))]
    (out_a, lse_a), (out_b, lse_b) = halves
    return out_a, lse_a + centre, out_b, lse_b + centre, oracles.torch_attention(q, k, v), _torch_lse(q, k, False) + centre


@pytest.mark.parametrize("centre", [0.0, 1e4, -1e4])
def test_the_merge_check_accepts_attention_over_both_blocks_and_nothing_else(centre):
    out_a, lse_a, out_b, lse_b, out, lse = _blocks(6, centre)
    tolerances = {"rtol": checks.RTOL, "atol": checks.ATOL}
    assert oracles.merge_problem(out_a, lse_a, out_b, lse_b, out, lse, "merge", **tolerances) is None
    swapped_weights = np.exp(lse_b - lse)[..., None] * out_a + np.exp(lse_a - lse)[..., None] * out_b
    for wrong_out, wrong_lse in ((swapped_weights, lse), ((out_a + out_b) / 2, lse), (out, np.maximum(lse_a, lse_b)),
                                 (out, lse + 1e-8), (np.full_like(out, np.nan), lse)):
        assert oracles.merge_problem(out_a, lse_a, out_b, lse_b, wrong_out, wrong_lse, "merge", **tolerances)


def test_the_zigzag_table_is_the_documented_layout():
    for (s, P), layout in oracles.ZIGZAG.items():
        assert layout == hidden.zigzag(s, P)
    for query in checks._queries(0)["zigzag_indices"]:  # every size a public check asks for that divides
        s, P = query["seq_len"], query["P"]
        assert (s, P) in oracles.ZIGZAG or s % (2 * P)
    for P in checks.WORLD_SIZES:  # and every causal ring case
        for case in checks._cases(P, 0).values():
            if "q" in case and case["function"] == "ring" and case["causal"]:
                assert case["positions"] == hidden.zigzag(case["q"].shape[-2], P)


@pytest.mark.parametrize("s, P", [(16, 2), (16, 4), (24, 3), (64, 8)])
def test_zigzag_balances_causal_work_and_contiguous_does_not(s, P):
    block = (s // (2 * P)) ** 2
    for layout, balanced in ((hidden.zigzag(s, P), True), (oracles.contiguous(s, P), False)):
        assert sorted(sum(layout, [])) == list(range(s))
        work = [oracles.causal_pairs(positions) for positions in layout]
        spread = max(abs(w - sum(work) / P) for w in work)
        assert (spread <= block) == balanced, (layout, work)


def test_best_balance_is_the_brute_force_optimum():
    assert oracles.best_balance([3, 3], 2) == 6  # one each
    assert oracles.best_balance([4, 2, 2, 1], 2) == 10  # [4] | [2, 2, 1] = 10 | 7
    assert oracles.best_balance([5], 3) == 15
    assert oracles.best_balance([], 2) == 0


def test_position_encoding_makes_attention_copy_each_value_exactly():
    inputs = oracles.position_encoded(2, 4, 16, 6)
    for causal in (False, True):
        out = oracles.torch_attention(inputs["q"], inputs["k"], inputs["v"], causal)
        assert (out == inputs["v"]).all()
    assert oracles.where_from(inputs["v"][1, 2, 5, 3]) == (1, 2, 5)


def test_every_check_case_keeps_the_head_dimension_apart_from_sequence_lengths():
    """The full-K check reads 'last dimension 6' as q, k, v or an output, never scores."""
    for P in checks.WORLD_SIZES:
        for name, case in checks._cases(P, 0).items():
            if "q" in case:
                assert case["q"].shape[-1] == checks.D and case["q"].shape[-2] // P != checks.D, name
    assert checks.D not in checks.BLOCKS and checks.BLOCKWISE_SHAPE[-2] != checks.D


def test_the_speed_checks_timed_runs_are_rechecked_from_their_seeds_alone(monkeypatch):
    """The harness's timed runs on the stand-ins (course.gpu_stand_in), judged as the check
    judges them: SDPA's float32 outputs at the sampled positions equal the grader's float64
    attention of the inputs their seeds name, and a blockwise_attention that hands back its
    first timed run's output in the third is caught, naming that run."""
    calls = []

    def blockwise_attention(q, k, v, block, causal=False):
        calls.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
        return calls[1] if len(calls) == 4 else calls[-1]  # the warm-up, then timed runs 1, 2, 3

    monkeypatch.setitem(sys.modules, "context_parallel", types.SimpleNamespace(blockwise_attention=blockwise_attention))
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")  # the CPU tier: gpu_devices.device gives the stand-ins
    shape = (1, 2, 96, 8)
    measured = load_check_file(LAB, "harness").blockwise_vs_sdpa(
        shape[2], 32, timed.draw_seeds(3, 12, "test"), batch=1, heads=shape[1], head_dim=shape[3],
        samples=checks.SPEED_SAMPLES)
    recheck = checks._speed_recheck(shape)
    sdpa = timed.judge(measured["sdpa"], "sdpa", recheck, moved_bytes=1, dry_run=True)
    assert sdpa.runs == 3 and sdpa.stand_in and measured["sdpa"]["record"]["stand_in"] is True
    with pytest.raises(AssertionError, match=r"blockwise: the output of timed run 3 of 3 is wrong: at flat position"):
        timed.judge(measured["ours"], "blockwise", recheck, dry_run=True)


@pytest.mark.slow
def test_a_ring_that_deadlocks_costs_its_cases_only_and_leaves_no_process(make_submission, our_processes):
    from autograder.grading.labs import find_lab
    from autograder.grading.runner import child_environment
    from autograder.grading.submission import Submission
    from fixtures.buggy_12 import RING_DEADLOCK

    folder = make_submission(LAB, RING_DEADLOCK.file, RING_DEADLOCK.edits)
    submission = Submission(folder, CHECKS / "harness.py", "cpu", Limits(timeout_s=120, memory_mb=6144),
                            child_environment("cpu", find_lab(LAB)))
    start = time.monotonic()
    try:
        _, cases = checks._job(submission, 0, 2)
    finally:
        submission.close()
    elapsed = time.monotonic() - start
    ring = [name for name in cases if name.startswith("ring") and name != "ring_odd_shard"]
    hung = [name for name in ring if cases[name]["status"] == "timeout"]
    assert hung == ring, cases  # the first hangs, the others are not run
    assert "no rank having used the CPU" in cases[ring[0]]["message"], cases[ring[0]]
    assert "not run" in cases[ring[1]]["message"]
    assert all(cases[n]["status"] == "ok" for n in cases if n.startswith("ulysses")), cases
    assert elapsed < 45, elapsed  # one idle stop, not a job timeout per case
    time.sleep(0.5)
    assert our_processes() == []


def test_traffic_the_op_log_never_saw_is_counted_and_flagged(tmp_path):
    # The op log switched off from inside (the shortcut of buggy_12) does not hide what crossed:
    # the launcher's kernel count fails the volume check and flags the difference for the instructor.
    from conftest import build_submission, grade_json
    from fixtures.buggy_12 import BUGS

    bug = next(b for b in BUGS if b.name.startswith("ring all-gathers q, k, v with the op log off"))
    submission = build_submission(tmp_path / LAB, LAB, bug.file, bug.edits)
    report, _ = grade_json(submission, LAB, "-k", "sends")
    (check,) = report["tests"]
    assert check["status"] == "failed" and "bytes crossed between the ranks" in check["feedback"]
    kinds = {flag["kind"] for flag in report["flags"]}
    assert {"unlogged", "private"} <= kinds, report["flags"]
