"""Checks for lab 09: sharded data parallelism (ZeRO).

Oracles:
- ``zero_bytes``: the closed forms 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N (for
  any K), and the numbers printed in the ZeRO paper (Rajbhandari et al. 2020):
  Figure 1 (Ψ = 7.5B, N = 64, K = 12: 120, 31.4, 16.6, 1.9 GB), Table 1
  (memory per device against DP degree for 7.5B, 128B and 1T models) and
  Table 2 (the largest model that fits 32 GB devices, at its precision).
- Training: single-process training of the same float64 MLP by the unsharded
  torch optimizer on the whole batch, computed in the same job before the
  student's code runs; after 3 steps every rank's full parameters must equal it
  to rounding (1e-9 relative).
- Memory: bytes of the tensor storages the student's objects hold, and the peak
  bytes of gathered parameters alive at once, both measured by the harness on
  every rank (see harness.py), against the unsharded counts divided by N.

World sizes 2 and 4 (the model's 967 parameters divide by neither, and no
layer's count divides by 4); every case of a world size runs in one
``course.dist`` job, shared by the checks. Both tiers grade the same way.
"""
import math

import numpy as np
import pytest

from autograder.grading.checking import expect_array, with_the_work
from autograder.grading.traffic import expect_crossed
from course.wire import gloo_bytes, gloo_messages
from autograder.grading.submission import failure_from, not_implemented_yet

WORLD_SIZES = (2, 4)
GB = 1e9
STEPS = 3


SHARDED = ("nothing sharded", "optimizer state / N", "optimizer state and gradients / N", "everything / N")


def closed_form(psi, n, stage, k):
    return [(4 + k) * psi, 4 * psi + k * psi / n, 2 * psi + (2 + k) * psi / n, (4 + k) * psi / n][stage]


# --- zero_bytes and flatten_padded: one sandboxed call for all the queries -------------

FIGURE_1 = [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)]  # GB, Ψ = 7.5B, N = 64, K = 12
# Table 1: GB per device for stages 1, 2, 3 (P_os, P_os+g, P_os+g+p), by DP degree and model size.
TABLE_1 = {
    7.5e9: {1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5), 64: (31.4, 16.6, 1.88),
            256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12)},
    128e9: {1: (2048, 2048, 2048), 4: (896, 704, 512), 16: (608, 368, 128), 64: (536, 284, 32),
            256: (518, 263, 8), 1024: (513, 257, 2)},
    1e12: {1: (16000, 16000, 16000), 4: (7000, 5500, 4000), 16: (4750, 2875, 1000), 64: (4187, 2218, 250),
           256: (4046, 2054, 62.5), 1024: (4011, 2013, 15.6)},
}
# Table 2: largest model (parameters) on 32 GB devices; MP-way model parallelism, DP degree 64 throughout.
TABLE_2 = {1: (2e9, 7.6e9, 14.4e9, 128e9), 2: (4e9, 15.2e9, 28.8e9, 256e9), 4: (8e9, 30.4e9, 57.6e9, 0.5e12),
           8: (16e9, 60.8e9, 115.2e9, 1e12), 16: (32e9, 121.6e9, 230.4e9, 2e12)}
# Fractional answers (an odd Ψ over N = 2 or 3, a fractional K as with 4-bit optimizer states) and N = 1.
CLOSED_FORM_CASES = [(psi, n, stage, k) for psi in (1e6, 3.3e9, 7) for n in (1, 2, 3, 8) for stage in range(4)
                     for k in (12, 8, 2.5)]
FLATTEN_CASES = [([3, 4], 4), ([5, 2, 6], 3), ([8], 4), ([2, 1], 5), ([7], 1)]


def _queries():
    zero_bytes = [(7.5e9, 64, stage, 12) for stage, _ in FIGURE_1]
    zero_bytes += [(psi, n, stage, 12) for psi, rows in TABLE_1.items() for n in rows for stage in (1, 2, 3)]
    zero_bytes += [(1, 64, stage, 12) for stage in range(4)]
    zero_bytes += CLOSED_FORM_CASES
    return {"zero_bytes": zero_bytes, "flatten_padded": FLATTEN_CASES}


def _answers(submission, name):
    """What the submission's ``name`` (zero_bytes or flatten_padded) gave for every query, in order."""
    got = submission.harness_once("formulas", "formulas", _queries())[name]
    if isinstance(got, dict):  # still a stub
        raise not_implemented_yet(got["not_implemented"])
    return got


def _zero_bytes(submission, psi, n, stage, k=12):
    return dict(zip(_queries()["zero_bytes"], _answers(submission, "zero_bytes")))[(psi, n, stage, k)]


@pytest.mark.points(1)
def check_zero_bytes_closed_forms(submission):
    """zero_bytes(psi, n, stage, k) equals (4+K)Ψ, 4Ψ + KΨ/N, 2Ψ + (2+K)Ψ/N, (4+K)Ψ/N (K = 12, 8, 2.5; N = 1 to 8; odd Ψ)"""
    for psi, n, stage, k in CLOSED_FORM_CASES:
        got, want = _zero_bytes(submission, psi, n, stage, k), closed_form(psi, n, stage, k)
        assert got is not None and math.isclose(got, want, rel_tol=1e-9), (
            f"zero_bytes(psi={psi:g}, n={n}, stage={stage}, k={k}) = {got!r}, expected {want:.6g} bytes "
            f"({SHARDED[stage]})")


@pytest.mark.points(2)
def check_zero_bytes_paper_figure_1(submission):
    """zero_bytes reproduces the ZeRO paper's Figure 1: 120, 31.4, 16.6, 1.9 GB (7.5B parameters, N = 64)"""
    for stage, paper_gb in FIGURE_1:
        got = _zero_bytes(submission, 7.5e9, 64, stage)
        assert got is not None and round(got / GB, 1) == paper_gb, (
            f"zero_bytes(7.5e9, 64, {stage}) = {got!r} bytes; the paper's Figure 1 says {paper_gb} GB "
            "(1 GB = 1e9 bytes; 2 bytes of fp16 weights, 2 of gradients, 12 of Adam state per parameter)")


@pytest.mark.points(1)
def check_zero_bytes_paper_tables(submission):
    """zero_bytes reproduces the paper's Table 1 (GB per device by DP degree) and Table 2 (largest model on 32 GB)"""
    for psi, rows in TABLE_1.items():
        for n, per_stage in rows.items():
            for stage, paper in zip((1, 2, 3), per_stage):
                got = _zero_bytes(submission, psi, n, stage) / GB
                # The paper prints three significant figures, some truncated rather than rounded.
                assert abs(got - paper) <= max(0.006 * paper, 0.011), (
                    f"Table 1, {psi / 1e9:g}B parameters, DP degree {n}, stage {stage}: zero_bytes gives "
                    f"{got:.4g} GB, the paper prints {paper} GB")
    per_param = [_zero_bytes(submission, 1, 64, stage) for stage in range(4)]
    for mp, paper_row in TABLE_2.items():
        for stage, paper in enumerate(paper_row):
            got = mp * 32 * GB / per_param[stage]
            # Printed to 0.1B, except 0.5T, 1T and 2T (one digit of trillions).
            assert abs(got - paper) <= (0.05 if paper >= 0.5e12 else 0.01) * paper, (
                f"Table 2, MP = {mp}, DP = 64, stage {stage}: 32 GB / zero_bytes(1, 64, {stage}) x MP = "
                f"{got / 1e9:.4g}B parameters, the paper prints {paper / 1e9:g}B")


@pytest.mark.points(1)
def check_flatten_padded(submission):
    """flatten_padded(tensors, n) concatenates in order and zero-pads to n * ceil(numel / n)"""
    for (sizes, n), got in zip(FLATTEN_CASES, _answers(submission, "flatten_padded")):
        want = np.concatenate([np.arange(1, s + 1) + 1000.0 * i for i, s in enumerate(sizes)])
        want = np.concatenate([want, np.zeros(n * math.ceil(want.size / n) - want.size)])
        assert got is not None, f"flatten_padded(tensors of sizes {sizes}, n={n}) returned None or not a tensor"
        expect_array(np.asarray(got), want, f"flatten_padded(tensors of sizes {sizes}, n={n})", exact=True)


# --- training on 2 and 4 ranks ------------------------------------------------------------

def _case(submission, name):
    """{n: the case's outcome on n ranks}, or the error that says why there is none."""
    found = {}
    for n in WORLD_SIZES:
        outcome = submission.harness_once(("training_job", n), "training_job", n)[name]
        if outcome["status"] != "ok":
            raise failure_from(outcome, f"{name} on {n} ranks")
        found[n] = outcome
    return found


def _where(layout, index):
    for name, size in layout:
        if index < size:
            return f"{name}[{index}]"
        index -= size
    return f"element {index} past the end"


def _expect_oracle(submission, name, what):
    for n, case in _case(submission, name).items():
        want = np.asarray(case["oracle"])
        for rank, got in enumerate(case["params"]):
            if got is None:
                raise AssertionError(f"{what} on {n} ranks: rank {rank}'s parameters could not be rebuilt from "
                                     f"its shards (sizes {case['shard_sizes'][rank]}); expected one shard of "
                                     f"ceil(numel / {n}) elements per layer with parameters")
            got = np.asarray(got)
            assert got.shape == want.shape, (
                f"{what} on {n} ranks: rank {rank} has {got.size} parameters, expected {want.size}")
            bad = ~np.isclose(got, want, rtol=1e-9, atol=1e-12)
            if bad.any():
                i = int(np.argmax(bad))
                others = [r for r, p in enumerate(case["params"]) if p is not None and not np.array_equal(p, got)]
                hint = (f"; ranks differ from each other (rank {rank} vs {others}): were the updated shards "
                        "all-gathered back into every rank?") if others else ""
                raise AssertionError(
                    f"{what} on {n} ranks, after {STEPS} steps: rank {rank}'s {_where(case['layout'], i)} is "
                    f"{got[i]:.10g}, unsharded training on the whole batch gives {want[i]:.10g} "
                    f"({int(bad.sum())} of {want.size} parameters differ){hint}")


@pytest.mark.points(3)
def check_zero1_matches_unsharded_adam(submission):
    """ShardedOptimizer(Adam): every rank's parameters equal unsharded Adam on the whole batch (2 and 4 ranks)"""
    _expect_oracle(submission, "zero1_adam", "ShardedOptimizer(torch.optim.Adam, weight_decay=0.1)")


@pytest.mark.points(1)
def check_zero1_matches_unsharded_sgd_momentum(submission):
    """ShardedOptimizer(SGD with momentum): parameters equal unsharded SGD (gradients averaged, not summed)"""
    _expect_oracle(submission, "zero1_sgd", "ShardedOptimizer(torch.optim.SGD, momentum=0.9)")


@pytest.mark.points(2)
def check_zero1_optimizer_state_bytes(submission, metrics):
    """ShardedOptimizer: the inner optimizer's state and parameters take 1/N of the unsharded optimizer's bytes"""
    with_the_work("ZeRO-1's state bytes", lambda: check_zero1_matches_unsharded_adam(submission))
    for n, case in _case(submission, "zero1_adam").items():
        for rank in range(n):
            if not case["inner_ok"][rank]:
                raise AssertionError(f"on {n} ranks, rank {rank}: ShardedOptimizer.optimizer is a "
                                     f"{case['inner_class'][rank]}, expected the torch.optim.Adam it was asked for")
            got, full = case["state_bytes"][rank], case["unsharded_state_bytes"][rank]
            numel = sum(size for _, size in case["layout"])
            limit = full / n * (n * math.ceil(numel / n) / numel) + 64  # padding, and a scalar or two
            metrics[f"n{n}_rank{rank}_bytes"] = got
            assert got <= limit, (
                f"on {n} ranks, rank {rank}'s inner optimizer holds {got} bytes (its parameters and state); "
                f"unsharded Adam holds {full}, so a 1/{n} shard should hold at most {limit:.0f}. Keep only this "
                "rank's shard (a copy, not a view of a full-size buffer) in the inner optimizer")
            assert got >= 0.5 * full / n, (
                f"on {n} ranks, rank {rank}'s inner optimizer holds only {got} bytes, expected about "
                f"{full / n:.0f} (1/{n} of unsharded Adam's {full}): is the shard's state in self.optimizer?")


@pytest.mark.points(1)
def check_zero1_traffic(submission):
    """ShardedOptimizer: per step, a reduce-scatter of the gradients and an all-gather of the parameters cross (the kernel's count)"""
    with_the_work("ZeRO-1's traffic", lambda: check_zero1_matches_unsharded_adam(submission))
    for n, case in _case(submission, "zero1_adam").items():
        numel = sum(size for _, size in case["layout"])
        padded = 8 * n * math.ceil(numel / n)  # float64
        # gloo runs a reduce-scatter as a whole all-reduce (course.wire.gloo_bytes)
        want = STEPS * (gloo_bytes("reduce_scatter", 8 * numel, n) + gloo_bytes("all_gather", padded // n, n))
        messages = STEPS * (gloo_messages("reduce_scatter", n) + gloo_messages("all_gather", n))
        expect_crossed(submission, case["wire"], "steps", want, messages,
                       f"ShardedOptimizer(Adam) on {n} ranks, {STEPS} steps",
                       f"a reduce-scatter of the {numel} gradients and an all-gather of the padded parameters per step")


@pytest.mark.points(3)
def check_zero3_matches_unsharded_adam(submission):
    """Zero3Sequential + Adam on the shards: full parameters equal unsharded Adam (2 and 4 ranks)"""
    _expect_oracle(submission, "zero3_adam", "Zero3Sequential with torch.optim.Adam on its shards")


@pytest.mark.points(1)
def check_zero3_stores_only_shards(submission):
    """Zero3Sequential holds one ceil(numel/N) shard per layer: about 1/N of the model's bytes per rank"""
    with_the_work("ZeRO-3's stored bytes", lambda: check_zero3_matches_unsharded_adam(submission))
    for n, case in _case(submission, "zero3_adam").items():
        sizes = case["layer_sizes"][0]
        want_sizes = [math.ceil(s / n) for s in sizes]
        for rank in range(n):
            assert case["shard_sizes"][rank] == want_sizes, (
                f"on {n} ranks, rank {rank}: shards of {case['shard_sizes'][rank]} elements, expected "
                f"{want_sizes} (ceil(numel / {n}) for layers of {sizes} parameters)")
            stored, limit = case["stored_bytes"][rank], 8 * sum(want_sizes) + 64
            assert stored <= limit, (
                f"on {n} ranks, rank {rank}: the wrapper keeps {stored} bytes of tensors, expected about "
                f"{8 * sum(want_sizes)} (its float64 shards); the full model is {8 * sum(sizes)}. Are full "
                "parameters kept somewhere (the layers themselves, a cache)?")


@pytest.mark.points(1)
def check_zero3_traffic(submission):
    """Zero3Sequential: per step, each layer gathered in forward and in backward, its gradient reduce-scattered (the kernel's count)"""
    with_the_work("ZeRO-3's traffic", lambda: check_zero3_matches_unsharded_adam(submission))
    for n, case in _case(submission, "zero3_adam").items():
        padded = [8 * n * math.ceil(s / n) for s in case["layer_sizes"][0]]  # float64, each layer's
        per_step = sum(2 * gloo_bytes("all_gather", layer // n, n) + gloo_bytes("reduce_scatter", layer, n)
                       for layer in padded)
        gathers = sum(case["gathers"]) / (2 * len(padded) * STEPS * n)  # the in-process watch's share
        messages = STEPS * len(padded) * (2 * gloo_messages("all_gather", n) + gloo_messages("reduce_scatter", n))
        expect_crossed(submission, case["wire"], "steps", STEPS * per_step, messages,
                       f"Zero3Sequential on {n} ranks, {STEPS} steps",
                       "every layer all-gathered twice and its gradient reduce-scattered once per step",
                       logged=STEPS * per_step * min(1.0, gathers))


@pytest.mark.points(2)
def check_zero3_peak_gathered_bytes(submission, metrics):
    """Zero3Sequential: gathered parameters are freed after each layer (peak about one layer, not the model)"""
    with_the_work("ZeRO-3's peak", lambda: check_zero3_matches_unsharded_adam(submission))
    for n, case in _case(submission, "zero3_adam").items():
        sizes = case["layer_sizes"][0]
        layer_bytes = [8 * n * math.ceil(s / n) for s in sizes]
        # One layer in use, and room for another: prefetching the next one is fair. (The grader gathers
        # into a buffer of its own and copies, so c10d's hold on that buffer is not counted.)
        limit = 2 * max(layer_bytes)
        for rank in range(n):
            peak, gathers = case["peak_gathered"][rank], case["gathers"][rank]
            metrics[f"n{n}_rank{rank}_peak_bytes"] = peak
            assert peak <= limit, (
                f"on {n} ranks, rank {rank}: up to {peak} bytes of gathered parameters were alive at once; one "
                f"layer is at most {max(layer_bytes)} bytes and the whole model {sum(layer_bytes)}. Free each "
                "layer's gathered parameters after use (save only the input and the shard for backward, and "
                "gather again there)")
            assert gathers >= 2 * len(sizes) * STEPS, (
                f"on {n} ranks, rank {rank}: {gathers} calls of dist.all_gather_single in {STEPS} steps, "
                f"expected at least {2 * len(sizes) * STEPS} (each of {len(sizes)} layers gathered in forward and "
                "again in backward); gather with dist.all_gather_single (or all_gather_into_tensor), which the grader "
                "watches")
            assert case["live_after"][rank] == 0, (
                f"on {n} ranks, rank {rank}: {case['live_after'][rank]} bytes of gathered parameters are still "
                "alive after training; nothing gathered should outlive the step that used it")
