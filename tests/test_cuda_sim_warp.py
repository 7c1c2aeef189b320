"""course.cuda_sim's warp functions against CUDA's documented semantics.

The rules each test holds the simulator to, from the CUDA C++ Programming Guide
("Warp Shuffle Functions", "Warp Vote Functions", "Warp Match Functions",
``__syncwarp``) and PTX's ``shfl.sync``:

- "Each calling thread must have its own bit set in the mask and all non-exited
  threads named in mask must execute the same intrinsic with the same mask, or
  the result is undefined";
- ``__shfl_sync``: a ``srcLane`` outside ``[0, width)`` reads lane ``srcLane``
  modulo ``width``; ``__shfl_up_sync`` / ``__shfl_down_sync``: the source "will not
  wrap around", the lanes at the edge keep their own value; ``__shfl_xor_sync``:
  lane ``laneid ^ laneMask``; PTX uses the low five bits of the lane operand;
- a lane may read only from a lane that takes part: "If the target thread is
  inactive, the retrieved value is undefined";
- votes evaluate the predicate "for all non-exited threads in mask"; the ballot's
  Nth bit is set iff the Nth lane's predicate is non-zero "and the Nth thread is
  active".

Kernels run in blocks of 32 to 64 threads (every thread a Python thread). The same
kernels compile for a GPU with numba-cuda's compiler (the last test): the
simulator's functions have the real API's names and signatures.
"""
import inspect
import re
import sys

import numpy as np
import pytest
from numba import cuda

from course import cuda_sim

FULL = 0xFFFFFFFF


@pytest.fixture(scope="module", autouse=True)
def installed():
    assert cuda_sim.install(), "numba-cuda is not the version course.cuda_sim supports"


def recorded(kernel, config, *args):
    """Launch; return the WarpCalls the launch completed."""
    calls = []
    with cuda_sim.watch(lambda call, threads: calls.append(call)):
        kernel[config](*args)
    return calls


def launch_error(kernel, config, *args) -> str:
    with pytest.raises(cuda_sim.WarpError) as raised:
        kernel[config](*args)
    return str(raised.value)


# -- the kernels (each also compiled for a GPU below) ------------------------------------

@cuda.jit
def shuffle_each_way(out, x, arg):
    # out[0, t]: shfl_sync from lane arg; [1]: up by arg; [2]: down by arg; [3]: xor arg.
    t = cuda.threadIdx.x
    v = x[t]
    out[0, t] = cuda.shfl_sync(0xFFFFFFFF, v, arg)
    out[1, t] = cuda.shfl_up_sync(0xFFFFFFFF, v, arg)
    out[2, t] = cuda.shfl_down_sync(0xFFFFFFFF, v, arg)
    out[3, t] = cuda.shfl_xor_sync(0xFFFFFFFF, v, arg)


@cuda.jit
def rotate_by_lane(out, x):
    # Every lane names its own source: the next lane, wrapping at the warp.
    t = cuda.threadIdx.x
    out[t] = cuda.shfl_sync(0xFFFFFFFF, x[t], (cuda.laneid + 1) % 32)


@cuda.jit
def lower_half_shuffles(out, x, delta):
    # Only lanes 0-15 call, with a mask that names only them; lanes 16-31 wait at the barrier.
    t = cuda.threadIdx.x
    if cuda.laneid < 16:
        out[t] = cuda.shfl_down_sync(0x0000FFFF, x[t], delta)
    cuda.syncthreads()


@cuda.jit
def lanes_16_on_exit_first(out, x):
    t = cuda.threadIdx.x
    if cuda.laneid >= 16:
        return
    out[t] = cuda.shfl_down_sync(0xFFFFFFFF, x[t], 8)


@cuda.jit
def shuffle_in_a_branch_then_barrier(out, x):
    t = cuda.threadIdx.x
    v = x[t]
    if t < 16:
        v = cuda.shfl_down_sync(0xFFFFFFFF, v, 1)
    cuda.syncthreads()
    out[t] = v


@cuda.jit
def two_functions_one_mask(out, x):
    t = cuda.threadIdx.x
    if t < 16:
        out[t] = cuda.shfl_xor_sync(0xFFFFFFFF, x[t], 1)
    else:
        out[t] = cuda.ballot_sync(0xFFFFFFFF, x[t] > 0)


@cuda.jit
def half_mask_for_a_whole_warp(out, x):
    t = cuda.threadIdx.x
    out[t] = cuda.shfl_down_sync(0x0000FFFF, x[t], 1)


@cuda.jit
def votes(out, x):
    # out[0]: all, [1]: any, [2]: eq, [3]: ballot, [4]: popc of a full ballot
    t = cuda.threadIdx.x
    p = x[t] > 0
    out[0, t] = cuda.all_sync(0xFFFFFFFF, p)
    out[1, t] = cuda.any_sync(0xFFFFFFFF, p)
    out[2, t] = cuda.eq_sync(0xFFFFFFFF, p)
    out[3, t] = cuda.ballot_sync(0xFFFFFFFF, p)
    out[4, t] = cuda.popc(cuda.ballot_sync(0xFFFFFFFF, True))


@cuda.jit
def ballot_after_exits(out):
    t = cuda.threadIdx.x
    if t >= 20:
        return
    out[0, t] = cuda.ballot_sync(0xFFFFFFFF, True)
    out[1, t] = cuda.activemask()
    out[2, t] = cuda.lanemask_lt()


@cuda.jit
def four_disjoint_ballots(out):
    # numba-cuda's own test of independent scheduling: four groups, four disjoint masks.
    t = cuda.threadIdx.x
    if t % 4 == 0:
        b = cuda.ballot_sync(0x11111111, True)
    elif t % 4 == 1:
        b = cuda.ballot_sync(0x22222222, True)
    elif t % 4 == 2:
        b = cuda.ballot_sync(0x44444444, True)
    else:
        b = cuda.ballot_sync(0x88888888, True)
    out[t] = b


@cuda.jit
def matches(out, x):
    t = cuda.threadIdx.x
    out[0, t] = cuda.match_any_sync(0xFFFFFFFF, x[t])
    mask, same = cuda.match_all_sync(0xFFFFFFFF, x[t])
    out[1, t] = mask if same else 0


@cuda.jit
def broadcast_then_syncwarp(out):
    t = cuda.threadIdx.x
    if cuda.laneid == 0:
        out[t] = 42
    cuda.syncwarp(0xFFFFFFFF)
    out[t] = out[t - cuda.laneid]


KERNELS = {"shuffle_each_way": "void(float32[:, :], float32[:], int32)", "rotate_by_lane": "void(int64[:], int64[:])",
           "lower_half_shuffles": "void(float32[:], float32[:], int32)",
           "lanes_16_on_exit_first": "void(float32[:], float32[:])",
           "shuffle_in_a_branch_then_barrier": "void(float32[:], float32[:])",
           "two_functions_one_mask": "void(int32[:], int32[:])", "votes": "void(int64[:, :], float32[:])",
           "ballot_after_exits": "void(uint32[:, :])", "four_disjoint_ballots": "void(uint32[:])",
           "matches": "void(int32[:, :], int32[:])", "broadcast_then_syncwarp": "void(int32[:])"}


# -- shuffles ---------------------------------------------------------------------------

def test_each_shuffle_reads_the_lane_the_guide_defines_within_each_warp():
    x = np.arange(64, dtype=np.float32) * 10
    lanes = np.arange(64) % 32
    for arg in (4, 36):  # 36: PTX takes the low five bits, the guide says modulo width: 4 again
        out = np.full((4, 64), -1, np.float32)
        shuffle_each_way[1, 64](out, x, arg)
        base = np.arange(64) - lanes  # warp 1 shuffles among threads 32-63 only
        d = arg % 32
        np.testing.assert_array_equal(out[0], x[base + d])
        np.testing.assert_array_equal(out[1], x[np.where(lanes >= d, np.arange(64) - d, np.arange(64))])
        np.testing.assert_array_equal(out[2], x[np.where(lanes + d < 32, np.arange(64) + d, np.arange(64))])
        np.testing.assert_array_equal(out[3], x[base + (lanes ^ d)])
    assert out.dtype == np.float32


def test_each_lane_may_name_its_own_source_and_types_are_kept():
    x = np.arange(32, dtype=np.int64) + (1 << 40)  # a 64-bit value survives the shuffle
    out = np.zeros(32, np.int64)
    rotate_by_lane[1, 32](out, x)
    np.testing.assert_array_equal(out, np.roll(x, -1))


def test_a_partial_mask_exchanges_among_its_lanes_and_an_outside_source_is_undefined_and_recorded():
    x = np.arange(32, dtype=np.float32)
    out = np.full(32, -1, np.float32)
    (call,) = recorded(lower_half_shuffles, (1, 32), out, x, 4)
    np.testing.assert_array_equal(out[:12], x[4:16])
    assert np.isnan(out[12:16]).all(), "lanes 12-15 read lanes 16-19, outside the mask: undefined"
    assert (out[16:] == -1).all()
    assert call.function == "shfl_down_sync" and call.lanes == tuple(range(16)) and call.mask == 0xFFFF
    assert call.undefined[0] == (12, 16, "lane 16 is not in the mask") and len(call.undefined) == 4
    assert str(call) == "cuda.shfl_down_sync(mask 0x0000ffff) by lanes 0-15 of warp 0"
    one_lane = cuda_sim.WarpCall("syncwarp", 1, (0, 0, 0), 1, (0,))
    assert str(one_lane) == "cuda.syncwarp(mask 0x00000001) by lane 0 of warp 1"


def test_lanes_that_exited_are_excused_and_reading_them_is_undefined():
    x = np.arange(32, dtype=np.float32)
    out = np.full(32, -1, np.float32)
    (call,) = recorded(lanes_16_on_exit_first, (1, 32), out, x)
    np.testing.assert_array_equal(out[:8], x[8:16])
    assert np.isnan(out[8:16]).all()
    assert call.lanes == tuple(range(16)) and (8, 16, "lane 16 had exited") in call.undefined


def test_a_partial_last_warp_has_no_lanes_past_the_block():
    x = np.arange(48, dtype=np.float32)
    out = np.full((4, 48), -1, np.float32)
    calls = recorded(shuffle_each_way, (1, 48), out, x, 8)
    np.testing.assert_array_equal(out[3, 32:], x[32 + (np.arange(16) ^ 8)])
    assert np.isnan(out[2, 40:48]).all() and (out[2, 32:40] == x[40:48]).all()
    warp1_down = next(c for c in calls if c.warp == 1 and c.function == "shfl_down_sync")
    assert warp1_down.lanes == tuple(range(16))
    assert (8, 16, "lane 16 is past the end of the block (48 threads)") in warp1_down.undefined


def test_a_thread_outside_its_own_mask_is_an_error_naming_it():
    x = np.ones(32, np.float32)
    message = launch_error(half_mask_for_a_whole_warp, (1, 32), np.zeros(32, np.float32), x)
    assert re.search(r"thread (\d+) \(lane \1 of warp 0\) called cuda\.shfl_down_sync with mask 0x0000ffff, "
                     r"which does not name its lane", message), message
    assert int(re.search(r"thread (\d+)", message).group(1)) >= 16


def test_a_divergent_shuffle_is_an_error_naming_the_lane_and_what_it_does():
    x = np.ones(32, np.float32)
    message = launch_error(shuffle_in_a_branch_then_barrier, (1, 32), np.zeros(32, np.float32), x)
    assert ("lanes 0-15 wait in cuda.shfl_down_sync (mask 0xffffffff) for lane 16 (thread 16), which waits at "
            "cuda.syncthreads() (and lanes 17-31)") in message, message
    message = launch_error(two_functions_one_mask, (1, 32), np.zeros(32, np.int32), np.ones(32, np.int32))
    assert re.search(r"wait in cuda\.(shfl_xor_sync|ballot_sync) \(mask 0xffffffff\) for lane \d+ \(thread \d+\), "
                     r"which waits in cuda\.(ballot_sync|shfl_xor_sync) with mask 0xffffffff", message), message


# -- votes, matches, syncwarp ------------------------------------------------------------

def test_votes_over_a_full_warp():
    out = np.zeros((5, 32), np.int64)
    x = np.ones(32, np.float32)
    votes[1, 32](out, x)
    assert (out[0] == 1).all() and (out[1] == 1).all() and (out[2] == 1).all() and (out[3] == -1).all()
    assert (out[4] == 32).all(), "popc of a full ballot (an int32 of -1)"
    x[[3, 30]] = -1
    votes[1, 32](out, x)
    assert (out[0] == 0).all() and (out[1] == 1).all() and (out[2] == 0).all()
    assert (out[3] == np.int32(np.uint32(0xFFFFFFFF & ~(1 << 3 | 1 << 30)).view(np.int32))).all()
    x[:] = -1
    votes[1, 32](out, x)
    assert (out[1] == 0).all() and (out[2] == 1).all() and (out[3] == 0).all()


def test_a_ballot_counts_active_lanes_only_and_activemask_names_them():
    out = np.zeros((3, 32), np.uint32)  # a ballot's int32 -1 stored as numba stores it: 0xFFFFFFFF
    ballot_after_exits[1, 32](out)
    assert (out[0, :20] == 0xFFFFF).all()
    # activemask: the caller's lane, never one that exited before; which others are still there is up to
    # scheduling, on a GPU as here (the guide: lanes converged at the call need not stay converged).
    assert all(out[1, t] >> t & 1 and out[1, t] >> 20 == 0 for t in range(20)), out[1, :20]
    np.testing.assert_array_equal(out[2, :20], (1 << np.arange(20)) - 1)


def test_disjoint_masks_complete_independently():
    out = np.zeros(32, np.uint32)
    four_disjoint_ballots[1, 32](out)
    np.testing.assert_array_equal(out, [0x11111111 << (t % 4) for t in range(32)])


def test_match_functions_as_numba_cuda_tests_them():
    out = np.zeros((2, 10), np.int32)
    matches[1, 10](out, np.arange(10, dtype=np.int32) % 2)
    np.testing.assert_array_equal(out[0], np.tile((0b0101010101, 0b1010101010), 5))
    assert (out[1] == 0).all()
    matches[1, 10](out, np.zeros(10, np.int32))
    assert (out[1] == 0b1111111111).all()


def test_syncwarp_is_a_rendezvous_of_the_warp():
    out = np.zeros(64, np.int32)
    calls = recorded(broadcast_then_syncwarp, (1, 64), out)
    assert (out == 42).all()
    assert sorted((c.function, c.warp, len(c.lanes)) for c in calls) == [("syncwarp", 0, 32), ("syncwarp", 1, 32)]


def test_argument_types_are_numba_cudas():
    @cuda.jit
    def shuffles_a_bool(out):
        out[0] = cuda.shfl_sync(0xFFFFFFFF, True, 0)

    @cuda.jit
    def votes_on_a_float(out):
        out[0] = cuda.all_sync(0xFFFFFFFF, 0.5)

    @cuda.jit
    def float_mask(out):
        out[0] = cuda.any_sync(1.0, 1)

    for kernel, says in ((shuffles_a_bool, "only supports 32- and 64-bit ints and floats"),
                         (votes_on_a_float, "the predicate must be an integer or boolean"),
                         (float_mask, "the mask must be an integer")):
        with pytest.raises(TypeError, match=says):
            kernel[1, 1](np.zeros(1, np.int32))


def test_the_same_kernels_compile_for_a_gpu():
    """numba-cuda's real compiler takes every kernel above: the simulator's names and signatures are its own."""
    from course import gpu_compile

    module = sys.modules[__name__]
    source = "\n\n".join(inspect.getsource(getattr(module, name).py_func) for name in KERNELS)
    found = gpu_compile.compile_source(source, KERNELS, targets=[(9, 0)])  # in a process with the simulator off
    if "unavailable" in found:
        pytest.skip(f"cannot compile for a GPU here: {found['unavailable']}")
    failed = {name: r["sm_90"].get("error") for name, r in found.items() if not r["sm_90"]["ok"]}
    assert not failed, failed
    assert found["shuffle_each_way"]["sm_90"]["work"]["warp_shuffles"] == 4
    assert found["votes"]["sm_90"]["work"]["warp_votes"] >= 4
