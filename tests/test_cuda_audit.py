"""course.cuda_audit finds races, bank conflicts and uncoalesced loads from the
record of accesses, the same way on every run — and finds none in correct kernels."""
import numpy as np
import pytest
from numba import cuda

from course.cuda_audit import audit

N = 64


@cuda.jit
def reverse(out, x, barrier):
    # Each thread writes one element of a shared array and reads another's.
    buf = cuda.shared.array(N, dtype=np.float32)
    t = cuda.threadIdx.x
    buf[t] = x[t]
    if barrier:
        cuda.syncthreads()
    out[t] = buf[N - 1 - t]


@cuda.jit
def count(counts, values, atomic):
    i = cuda.grid(1)
    if i < values.size:
        if atomic:
            cuda.atomic.add(counts, values[i], 1)
        else:
            counts[values[i]] += 1


@cuda.jit
def strided_shared(out, stride):
    buf = cuda.shared.array(32 * 32, dtype=np.float32)
    t = cuda.threadIdx.x
    buf[t * stride] = t
    cuda.syncthreads()
    out[t] = buf[t * stride]


@cuda.jit
def copy_rows_or_columns(out, x, by_rows):
    t = cuda.threadIdx.x
    for j in range(x.shape[0]):
        out[t, j] = x[j, t] if by_rows else x[t, j]


def _run(kernel, grid, block, *args):
    with audit() as log:
        d_args = [cuda.to_device(a) if isinstance(a, np.ndarray) else a for a in args]
        kernel[grid, block](*d_args)
    return log, [d.copy_to_host() if isinstance(a, np.ndarray) else None for d, a in zip(d_args, args)]


def test_missing_barrier_is_a_race_every_time():
    x = np.arange(N, dtype=np.float32)
    for _ in range(3):
        log, (out, _, _) = _run(reverse, 1, N, np.zeros(N, np.float32), x, False)
        races = log.races()
        assert races and races[0].space == "shared"
        assert "no syncthreads()" in str(races[0])


def test_barrier_orders_the_accesses():
    x = np.arange(N, dtype=np.float32)
    log, (out, _, _) = _run(reverse, 1, N, np.zeros(N, np.float32), x, True)
    assert log.races() == []
    np.testing.assert_array_equal(out, x[::-1])
    assert log.launches == 1 and len(log.shared_arrays()) == 1


@cuda.jit
def read_unwritten(out):
    buf = cuda.shared.array(4, dtype=np.float32)
    out[0] = buf[3]


def test_shared_memory_starts_poisoned():
    # Read before anyone writes: a GPU gives whatever was there, the audit NaN.
    log, (out,) = _run(read_unwritten, 1, 1, np.zeros(1, np.float32))
    assert np.isnan(out[0])


def test_atomics_do_not_race_but_plain_updates_do():
    values = np.random.default_rng(0).integers(0, 4, 200).astype(np.int32)
    log, (counts, _, _) = _run(count, 4, 64, np.zeros(4, np.int32), values, True)
    assert log.races() == []
    np.testing.assert_array_equal(counts, np.bincount(values, minlength=4))
    log, _ = _run(count, 4, 64, np.zeros(4, np.int32), values, False)
    race = log.races()[0]
    assert race.space == "global"


def test_plain_writes_from_two_blocks_race():
    values = np.array([0, 1, 2, 3] * 2, np.int32)  # block 0 and block 1 both write bins 0..3
    log, _ = _run(count, 2, 4, np.zeros(4, np.int32), values, False)
    assert any(r.epoch is None for r in log.races())  # epoch None: different blocks


@pytest.mark.parametrize("stride, worst", [(1, 1), (2, 2), (32, 32)])
def test_bank_conflict_degree(stride, worst):
    log, _ = _run(strided_shared, 1, 32, np.zeros(32, np.float32), stride)
    assert log.bank_conflicts()["worst"] == worst


def test_coalescing_tells_rows_from_columns():
    x = np.zeros((32, 32), np.float32)
    with audit() as log:
        d_x = cuda.to_device(x)
        log.name(d_x, "x")
        copy_rows_or_columns[1, 32](cuda.to_device(np.zeros_like(x)), d_x, True)
    along_rows = log.coalescing("x")
    assert along_rows["efficiency"] == 1.0 and log.loads("x") == 32 * 32
    with audit() as log:
        d_x = cuda.to_device(x)
        log.name(d_x, "x")
        copy_rows_or_columns[1, 32](cuda.to_device(np.zeros_like(x)), d_x, False)
    assert log.coalescing("x")["efficiency"] == pytest.approx(1 / 8)  # 32 sectors where 4 would do


def test_separate_launches_are_ordered():
    # Kernel 2 reads what kernel 1 wrote: launches on one stream are ordered.
    x = np.arange(N, dtype=np.float32)
    with audit() as log:
        d_mid = cuda.to_device(np.zeros(N, np.float32))
        d_out = cuda.to_device(np.zeros(N, np.float32))
        reverse[1, N](d_mid, cuda.to_device(x), True)
        reverse[1, N](d_out, d_mid, True)
    assert log.launches == 2 and log.races() == []
    np.testing.assert_array_equal(d_out.copy_to_host(), x)


def test_audit_restores_the_simulator():
    with audit():
        pass
    x = np.arange(N, dtype=np.float32)
    out = cuda.to_device(np.zeros(N, np.float32))
    reverse[1, N](out, cuda.to_device(x), True)
    np.testing.assert_array_equal(out.copy_to_host(), x[::-1])
    with pytest.raises(RuntimeError, match="do not nest"):
        with audit():
            with audit():
                pass


@cuda.jit
def through_numpy(out, x):
    i = cuda.grid(1)
    if i < out.size:
        whole = np.asarray(x)  # the simulator allows it; no GPU compiles it, and its reads would go unrecorded
        out[i] = whole[i] * 2


def test_numpy_views_of_device_arrays_are_refused_inside_an_audit():
    x, out = np.arange(8.0), np.zeros(8)
    through_numpy[1, 8](out, x)  # outside an audit the simulator runs it
    assert out.tolist() == (2 * x).tolist()
    with pytest.raises(TypeError, match="element by element"):
        with audit():
            through_numpy[1, 8](out, x)


# -- warps: syncwarp orders accesses; warp calls, barriers and lane use are recorded --------

@cuda.jit
def exchange_in_halves(out, partner_xor, sync):
    # Lanes write buf[t], then read their partner's element. sync 0: nothing between; 1: a
    # syncwarp of each half-warp (0xFFFF and 0xFFFF0000); 2: a syncwarp of the whole warp.
    buf = cuda.shared.array(32, dtype=np.float32)
    t = cuda.threadIdx.x
    buf[t] = t
    if sync == 1:
        cuda.syncwarp(0x0000FFFF if t < 16 else 0xFFFF0000)
    elif sync == 2:
        cuda.syncwarp()
    out[t] = buf[t ^ partner_xor]


def test_a_syncwarp_orders_the_accesses_of_the_lanes_it_names():
    from course import cuda_sim

    assert cuda_sim.install()
    cases = {(1, 0): True, (1, 2): False, (1, 1): False, (16, 1): True, (16, 2): False}  # -> races?
    for (partner, sync), races in cases.items():
        log, (out, _, _) = _run(exchange_in_halves, 1, 32, np.zeros(32, np.float32), partner, sync)
        if not races:
            np.testing.assert_array_equal(out, np.arange(32) ^ partner)
        found = log.races()
        assert bool(found) == races, (partner, sync, found)
        if found:
            assert "nor a syncwarp() of both" in str(found[0])
    syncwarps = [c for c in log.warp_calls if c.function == "syncwarp"]
    assert len(syncwarps) == 1 and syncwarps[0].lanes == tuple(range(32)) and syncwarps[0].launch == 1


@cuda.jit
def branch_by(out, x, by_parity):
    # Half the lanes work: alternate lanes (every warp diverges) or the first half of the block.
    buf = cuda.shared.array(64, dtype=np.float32)
    t = cuda.threadIdx.x
    buf[t] = x[t]
    cuda.syncthreads()
    works = t % 2 == 0 if by_parity else t < 32
    if works:
        buf[t] += 1
    cuda.syncthreads()
    out[t] = cuda.shfl_xor_sync(0xFFFFFFFF, buf[t], 1)


def test_lane_use_measures_divergence_and_the_log_holds_barriers_and_warp_calls():
    from course import cuda_sim

    assert cuda_sim.install()
    x = np.arange(64, dtype=np.float32)
    use = {}
    for by_parity in (True, False):
        log, (out, _, _) = _run(branch_by, 1, 64, np.zeros(64, np.float32), x, by_parity)
        works = np.arange(64) % 2 == 0 if by_parity else np.arange(64) < 32
        np.testing.assert_array_equal(out, (x + works)[np.arange(64) ^ 1])
        use[by_parity] = log.lane_use()
        assert log.barriers() == {(1, (0, 0, 0)): 2}
        assert sorted((c.function, c.warp, len(c.lanes)) for c in log.warp_calls) == [
            ("shfl_xor_sync", 0, 32), ("shfl_xor_sync", 1, 32)]
        assert log.undefined_reads() == [] and log.races() == []
    # The fill and the final read: 2 warps x 2 full requests. The branch: alternate lanes give 2 warps x
    # 2 requests of 16 lanes; the first half of the block gives 1 warp x 2 requests of 32.
    assert use[True] == {"requests": 8, "active_lanes": 192, "lanes": 256, "efficiency": 0.75}
    assert use[False] == {"requests": 6, "active_lanes": 192, "lanes": 192, "efficiency": 1.0}
