"""Checks for lab 02: kernels against NumPy, on poisoned buffers with canaries.

CPU tier: the CUDA simulator, at sizes that are not multiples of the block.
GPU tier: the same checks at sizes that fill the device, and the saxpy kernel's
bandwidth as a ratio of a device-to-device copy measured in the same run.
"""
import numpy as np
import pytest

from autograder.checking import by_tier, expect_array

SEED = 2026
BANDWIDTH_RATIO_TO_PASS = 0.6  # saxpy's effective bandwidth / device copy bandwidth


def _floats(n, seed=SEED):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def _expect_launch(result, n_or_shape, want, what):
    """The output region must equal ``want``; the canary around it must be untouched."""
    assert result["launch_error"] is None, (
        f"{what}: the launch failed — {result['launch_error']}. An index past the end of the data "
        "usually means a thread without a bounds guard")
    buf = result["buffer"]
    if isinstance(n_or_shape, int):
        out, canary = buf[:n_or_shape], buf[n_or_shape:]
    else:
        rows, cols = n_or_shape
        out = buf[:rows, :cols]
        canary = np.concatenate([buf[rows:, :].ravel(), buf[:rows, cols:].ravel()])
    touched = np.flatnonzero(~np.isnan(canary))
    assert touched.size == 0, (
        f"{what}: {touched.size} element(s) past the end of the output were written: "
        "threads whose index is outside the data must do nothing (add the guard)")
    expect_array(out, want, what, rtol=1e-6, atol=1e-6)


@pytest.mark.points(2)
def check_launch_config(submission):
    """launch_config gives every element a thread, with the fewest blocks"""
    cases = [(1, 32), (31, 32), (32, 32), (33, 32), (1000, 128), (1024, 256), (10_000_019, 256), (7, 1)]
    got = submission.harness("launch_configs", cases)
    for (n, tpb), (blocks, threads) in zip(cases, got):
        want = -(-n // tpb)
        assert threads == tpb, f"launch_config({n}, {tpb}) returned {threads} threads per block, expected {tpb}"
        assert blocks * threads >= n, (
            f"launch_config({n}, {tpb}) = ({blocks}, {threads}) gives only {blocks * threads} threads "
            f"for {n} elements (round the division up)")
        assert blocks == want, f"launch_config({n}, {tpb}) = {blocks} blocks, expected {want} (the fewest that cover n)"


@pytest.mark.points(2)
def check_relu_every_element(submission, tier):
    """relu_kernel writes every element (size a multiple of the block)"""
    n = by_tier(tier, cpu=1024, gpu=1 << 24)
    x = _floats(n)
    result = submission.harness("relu_1d", x, 128)
    _expect_launch(result, n, np.maximum(x, 0), "relu_kernel output")


@pytest.mark.points(2)
def check_relu_guard(submission, tier):
    """relu_kernel guards the last, partial block (size not a multiple of the block)"""
    n = by_tier(tier, cpu=1001, gpu=10_000_019)
    x = _floats(n, SEED + 1)
    result = submission.harness("relu_1d", x, 128)
    _expect_launch(result, n, np.maximum(x, 0), "relu_kernel output")


@pytest.mark.points(3)
def check_saxpy_kernel(submission, tier):
    """saxpy_kernel computes a*x + y for every element, with a guard"""
    n = by_tier(tier, cpu=999, gpu=10_000_019)
    x, y = _floats(n, SEED + 2), _floats(n, SEED + 3)
    result = submission.harness("saxpy_1d", 2.5, x, y, 64)
    _expect_launch(result, n, np.float32(2.5) * x + y, "saxpy_kernel output")


@pytest.mark.points(2)
@pytest.mark.parametrize("block", [(16, 16), (32, 4)], ids=["block 16x16", "block 32x4"])
def check_broadcast_add_kernel(submission, tier, block):
    """broadcast_add_kernel fills a non-square table, x along columns"""
    rows, cols = by_tier(tier, cpu=(37, 53), gpu=(4099, 4101))
    col, row = _floats(rows, SEED + 4), _floats(cols, SEED + 5)
    result = submission.harness("broadcast_add_2d", col, row, block)
    _expect_launch(result, (rows, cols), col[:, None] + row[None, :], "broadcast_add_kernel output")


@pytest.mark.points(1)
def check_host_relu(submission, tier):
    """relu() copies in, launches with launch_config and copies the result back"""
    n = by_tier(tier, cpu=777, gpu=10_000_019)
    x = _floats(n, SEED + 6)
    expect_array(submission.harness("host_relu", x, 64), np.maximum(x, 0), "relu(x)")


@pytest.mark.points(1)
def check_host_saxpy(submission, tier):
    """saxpy() returns a*x + y as a NumPy array"""
    n = by_tier(tier, cpu=555, gpu=10_000_019)
    x, y = _floats(n, SEED + 7), _floats(n, SEED + 8)
    expect_array(submission.harness("host_saxpy", -1.5, x, y, 128), np.float32(-1.5) * x + y,
                 "saxpy(a, x, y)", atol=1e-6)


@pytest.mark.points(1)
def check_host_broadcast_add(submission, tier):
    """broadcast_add() returns the (col.size, row.size) table"""
    rows, cols = by_tier(tier, cpu=(19, 45), gpu=(3001, 2999))
    col, row = _floats(rows, SEED + 9), _floats(cols, SEED + 10)
    expect_array(submission.harness("host_broadcast_add", col, row, (16, 8)), col[:, None] + row[None, :],
                 "broadcast_add(col, row)")


@pytest.mark.gpu
@pytest.mark.points(3)
def check_saxpy_bandwidth(submission, metrics):
    """saxpy_kernel streams at a good fraction of device-copy bandwidth"""
    m = submission.harness("saxpy_bandwidth", 1 << 26)
    ratio = m["saxpy_gbs"] / m["copy_gbs"]
    metrics.update(device=m["device"], saxpy_gbs=round(m["saxpy_gbs"], 1), copy_gbs=round(m["copy_gbs"], 1),
                   ratio=round(ratio, 3), threshold=BANDWIDTH_RATIO_TO_PASS)
    assert ratio >= BANDWIDTH_RATIO_TO_PASS, (
        f"saxpy reached {m['saxpy_gbs']:.0f} GB/s, {ratio:.2f} of a device copy's {m['copy_gbs']:.0f} GB/s "
        f"on {m['device']} (needs {BANDWIDTH_RATIO_TO_PASS}): is every access coalesced (thread i touches element i)?")
