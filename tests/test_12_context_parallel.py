"""Lab 12's grader: its NumPy oracles agree with torch's own attention and
autograd, the layout facts its checks rely on hold (zigzag balances causal
work, contiguous chunks do not), and a ring that deadlocks costs its cases
only, within the timeout, with no process left behind."""
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from autograder.sandbox import Limits, run_call
from conftest import load_check_file

REPO = Path(__file__).resolve().parents[1]
LAB = "12-context-parallel"
CHECKS = REPO / "autograder" / "checks" / LAB
checks = load_check_file(LAB, "check_context_parallel")
oracles = checks.oracles


@pytest.mark.parametrize("causal", [False, True])
def test_attention_oracle_and_its_gradients_equal_torch(causal):
    inputs = oracles.qkv(5, (2, 3, 9, 6), scale=3.0)
    q, k, v = (torch.tensor(inputs[n], requires_grad=True) for n in ("q", "k", "v"))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(torch.tensor(inputs["upstream"]))
    want, lse = oracles.attention(inputs["q"], inputs["k"], inputs["v"], causal)
    np.testing.assert_allclose(want, out.detach().numpy(), rtol=1e-12, atol=1e-13)
    scores = (q @ k.transpose(-2, -1) / np.sqrt(6)).detach()
    if causal:
        scores = scores.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    np.testing.assert_allclose(lse, torch.logsumexp(scores, -1).numpy(), rtol=1e-12)
    grads = oracles.attention_grads(inputs["q"], inputs["k"], inputs["v"], causal, inputs["upstream"])
    for got, tensor in zip(grads, (q, k, v)):
        np.testing.assert_allclose(got, tensor.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_merge_oracle_is_attention_over_both_blocks_and_exact_at_huge_logits():
    inputs = oracles.qkv(6, (2, 2, 5, 6))
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    a, b = oracles.attention(q, k[..., :3, :], v[..., :3, :]), oracles.attention(q, k[..., 3:, :], v[..., 3:, :])
    out, lse = oracles.merge(*a, *b)
    want = oracles.attention(q, k, v)
    np.testing.assert_allclose(out, want[0], rtol=1e-12)
    np.testing.assert_allclose(lse, want[1], rtol=1e-12)
    out, lse = oracles.merge(np.ones((1, 2)), np.array([1e4]), np.zeros((1, 2)), np.array([1e4 + np.log(3)]))
    np.testing.assert_allclose(out, [[0.25, 0.25]], rtol=1e-12)
    np.testing.assert_allclose(lse, [1e4 + np.log(4)], rtol=1e-15)


@pytest.mark.parametrize("s, P", [(16, 2), (16, 4), (24, 3), (64, 8)])
def test_zigzag_balances_causal_work_and_contiguous_does_not(s, P):
    block = (s // (2 * P)) ** 2
    for layout, balanced in ((oracles.zigzag(s, P), True), (oracles.contiguous(s, P), False)):
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
        out, _ = oracles.attention(inputs["q"], inputs["k"], inputs["v"], causal)
        assert (out == inputs["v"]).all()
    assert oracles.where_from(inputs["v"][1, 2, 5, 3]) == (1, 2, 5)


def test_every_check_case_keeps_the_head_dimension_apart_from_sequence_lengths():
    """The full-K check reads 'last dimension 6' as q, k, v or an output, never scores."""
    for P in checks.WORLD_SIZES:
        for name, case in checks._cases(P).items():
            if "q" in case:
                assert case["q"].shape[-1] == checks.D and case["q"].shape[-2] // P != checks.D, name
    assert checks.D not in checks.BLOCKS and checks.BLOCKWISE_SHAPE[-2] != checks.D


@pytest.mark.slow
def test_a_ring_that_deadlocks_costs_its_cases_only_and_leaves_no_process(make_submission, our_processes):
    from fixtures.buggy_12 import RING_DEADLOCK

    folder = make_submission(LAB, RING_DEADLOCK.file, RING_DEADLOCK.edits)
    request = {"submission": str(folder), "target": {"kind": "harness", "path": str(CHECKS / "harness.py"),
                                                     "func": "cases_job"},
               "args": [2, checks._cases(2), 15], "kwargs": {}}  # 15 s: room for the Ulysses job on a busy machine
    start = time.monotonic()
    outcome = run_call(request, Limits(timeout_s=120, memory_mb=6144))
    elapsed = time.monotonic() - start
    assert outcome.status == "ok", outcome
    cases = outcome.value
    ring = [name for name in cases if name.startswith("ring") and name != "ring_odd_shard"]
    hung = [name for name in ring if cases[name]["status"] == "timeout"]
    assert hung == ring, cases  # the first hangs, the others are not run
    assert "no rank having used the CPU" in cases[ring[0]]["message"], cases[ring[0]]
    assert "not run" in cases[ring[1]]["message"]
    assert all(cases[n]["status"] == "ok" for n in cases if n.startswith("ulysses")), cases
    assert elapsed < 45, elapsed  # one idle stop, not a job timeout per case
    time.sleep(0.5)
    assert our_processes() == []
