"""A faster block scheduler for numba's CUDA simulator.

The simulator runs each CUDA thread of a block as a Python thread. To implement
``syncthreads()`` its block manager *polls*: the main thread loops over the
block's threads until every live one is waiting at the barrier, then lets them
all go. That loop competes for the GIL with the threads it waits for, and a
short switch interval (which the loop needs to get anywhere) makes every
thread pay for constant switching.

``install()`` replaces the poll with a condition variable: a thread that
reaches the barrier, or ends, says so; the last one wakes the manager, which
releases the barrier. The rules are the simulator's own (a barrier opens when
every thread still running waits at it; the first exception in a thread aborts
the block and is raised from the launch), so kernels compute what they did
before, with Python's default switch interval, several times faster.

It replaces internals of numba-cuda 0.30.4 (pinned in pyproject.toml, and listed
with the course's other uses of numba-cuda's internals in ``course.numba_internals``);
with any other version it leaves the simulator as it is, only slower.
"""
from __future__ import annotations

import sys
import threading

import numpy as np

from course import numba_internals

SUPPORTED = numba_internals.WRITTEN_FOR
_installed = False


def install() -> bool:
    """Switch the simulator to the event-driven scheduler (once per process);
    return whether it is in use. It imports the simulator's kernel module (and
    so ``numba.cuda``): call it once ``NUMBA_ENABLE_CUDASIM=1`` is set."""
    global _installed
    if _installed:
        return True
    if not numba_internals.written_for_installed():
        # The poll needs a short switch interval to get anywhere.
        sys.setswitchinterval(1e-4)
        return False
    from numba.cuda.simulator import kernel as sim_kernel

    thread_cls, manager_cls = sim_kernel.BlockThread, sim_kernel.BlockManager
    original_thread_run = thread_cls.run

    def thread_run(self):
        try:
            original_thread_run(self)  # stores an exception in self.exception
        finally:
            block = self._manager
            with block._k2c_cond:
                block._k2c_ended += 1
                if self.exception and block._k2c_failed is None:
                    block._k2c_failed = self
                block._k2c_cond.notify()

    def syncthreads(self):
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads call")
        block = self._manager
        with block._k2c_cond:
            block._k2c_waiting.append(self)
            if len(block._k2c_waiting) + block._k2c_ended == block._k2c_size:
                block._k2c_cond.notify()
        self.syncthreads_event.wait()
        self.syncthreads_event.clear()
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads clear")

    def run(self, grid_point, *args):
        points = list(np.ndindex(*self._block_dim))
        self._k2c_cond, self._k2c_waiting, self._k2c_ended = threading.Condition(), [], 0
        self._k2c_size, self._k2c_failed = len(points), None
        threads = []
        for block_point in points:
            thread = thread_cls(lambda: self._f(*args), self, grid_point, block_point, self._debug)
            threads.append(thread)
            thread.start()

        def barrier_or_end():
            return self._k2c_failed is not None or len(self._k2c_waiting) + self._k2c_ended == self._k2c_size

        with self._k2c_cond:
            while True:
                self._k2c_cond.wait_for(barrier_or_end)
                if self._k2c_failed is not None:
                    # As the simulator does: abort the others (they raise at their
                    # next barrier) and raise the first exception, without joining.
                    for thread in threads:
                        thread.abort = True
                        thread.syncthreads_event.set()
                    exc, tb = self._k2c_failed.exception
                    raise exc.with_traceback(tb)
                if self._k2c_ended == self._k2c_size:
                    return
                waiting, self._k2c_waiting = self._k2c_waiting, []
                for thread in waiting:
                    thread.syncthreads_event.set()

    thread_cls.run, thread_cls.syncthreads, manager_cls.run = thread_run, syncthreads, run
    sys.setswitchinterval(0.005)  # Python's default: threads that wake when they should need no more
    _installed = True
    return True
