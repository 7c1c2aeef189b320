"""course.cuda_sim: the simulator's barriers wake the threads instead of polling
them, and follow the simulator's own rules."""
import threading
import time

import numpy as np
import pytest
from numba import cuda

from course import cuda_sim

THREADS = 128


@pytest.fixture(scope="module", autouse=True)
def installed():
    assert cuda_sim.install(), "numba-cuda is not the version course.cuda_sim supports"


@cuda.jit
def tree_sum(out, x):
    # A barrier per level of the tree, and threads that stop taking part halfway.
    buf = cuda.shared.array(THREADS, dtype=np.float32)
    t = cuda.threadIdx.x
    buf[t] = x[cuda.grid(1)]
    cuda.syncthreads()
    half = THREADS // 2
    while half > 0:
        if t < half:
            buf[t] += buf[t + half]
        cuda.syncthreads()
        half //= 2
    if t == 0:
        out[cuda.blockIdx.x] = buf[0]


@cuda.jit
def early_exit_then_count(out):
    # Threads that return before a barrier no longer hold it (the simulator's rule).
    t = cuda.threadIdx.x
    if t % 3 == 0:
        return
    cuda.syncthreads()
    out[t] = cuda.syncthreads_count(t % 2)


@cuda.jit
def one_thread_raises(out):
    t = cuda.threadIdx.x
    if t == 5:
        raise ValueError("thread 5 gives up")
    cuda.syncthreads()
    out[t] = 1


@cuda.jit
def one_thread_sleeps(out, cpu):
    t = cuda.threadIdx.x
    start = time.thread_time()  # the simulator runs kernels as Python, one thread each
    if t == 0:
        time.sleep(0.6)  # the others wait at the barrier
    cuda.syncthreads()
    out[t] = t
    cpu[t] = time.thread_time() - start


def test_barriers_order_a_tree_reduction_over_several_blocks():
    x = np.random.default_rng(0).standard_normal(3 * THREADS).astype(np.float32)
    out = np.zeros(3, np.float32)
    tree_sum[3, THREADS](out, x)
    np.testing.assert_allclose(out, x.reshape(3, THREADS).sum(axis=1), rtol=1e-5)


def test_threads_that_returned_do_not_hold_a_barrier():
    out = np.full(64, -1, np.int32)
    early_exit_then_count[1, 64](out)
    alive = [t for t in range(64) if t % 3]
    assert (out[[t for t in range(64) if t % 3 == 0]] == -1).all()
    assert set(out[alive]) == {sum(t % 2 for t in alive)}


def test_an_exception_in_one_thread_is_raised_from_the_launch():
    out = np.zeros(32, np.int32)
    done = []
    launcher = threading.Thread(target=lambda: done.append(pytest.raises(ValueError, one_thread_raises[1, 32], out)),
                                daemon=True)
    launcher.start()
    launcher.join(timeout=60)
    assert done, "the launch did not return within 60 s: the block's other threads were left waiting"
    assert "thread 5 gives up" in str(done[0].value)
    assert not out.any(), "no thread may pass a barrier the block never completed"


def test_waiting_at_a_barrier_costs_no_cpu():
    # numba's own block manager polls its threads from the launching thread while one of
    # them is busy; this one sleeps until woken. Only the block's threads are counted
    # (the launcher's and each kernel thread's own CPU time): a pytest worker may hold
    # other busy threads. Measured: about 0.01 s here, 0.61 s with numba's poll.
    out, cpu = np.zeros(THREADS, np.int32), np.zeros(THREADS)
    wall, launcher = time.perf_counter(), time.thread_time()
    one_thread_sleeps[1, THREADS](out, cpu)
    wall, launcher = time.perf_counter() - wall, time.thread_time() - launcher
    np.testing.assert_array_equal(out, np.arange(THREADS))
    used = launcher + cpu.sum()
    assert wall >= 0.6 and used < 0.2, f"{used:.2f} s of CPU while the block waited {wall:.2f} s for one thread"
