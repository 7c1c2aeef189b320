"""A faster block scheduler for numba's CUDA simulator, and the warp functions it lacks.

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

**Warps.** numba-cuda's simulator has ``cuda.laneid`` and ``cuda.warpsize`` but
none of the warp functions a GPU kernel calls. ``install()`` adds them, under
numba-cuda's own names and signatures, so the kernel that compiles for a GPU
runs here unchanged: ``shfl_sync(mask, value, src_lane)``, ``shfl_up_sync``,
``shfl_down_sync`` (``mask, value, delta``), ``shfl_xor_sync(mask, value,
lane_mask)``, ``all_sync``, ``any_sync``, ``eq_sync``, ``ballot_sync`` (``mask,
predicate``), ``match_any_sync``, ``match_all_sync`` (``mask, value``),
``syncwarp(mask=0xFFFFFFFF)``, ``activemask()`` and ``lanemask_lt()``. A warp is
32 consecutive threads of the block's linear thread index (x fastest), as on a
GPU. Each call is a rendezvous of the lanes its mask names, with the rules of
the CUDA C++ Programming Guide ("Warp Shuffle Functions", "Warp Vote
Functions", "Warp Match Functions", ``__syncwarp``) and of PTX's ``shfl.sync``:

* a thread whose own lane is not in the mask may not call it: ``WarpError``,
  naming the thread;
* every lane the mask names that has not exited must call the *same* function
  with the same mask (other arguments may differ per lane); the call completes
  when they all have. Lanes that never will — one waits at ``syncthreads()``,
  or in another warp function, while the others wait for it — make the block
  stuck, and the launch raises ``WarpError`` naming the lane (a warp function in
  a branch that only some of its lanes take: *divergent*). Lanes that exited
  are excused, as on a GPU;
* a shuffle computes its source lane as PTX does (``src_lane``, ``delta`` and
  ``lane_mask`` modulo 32; ``shfl_up_sync`` and ``shfl_down_sync`` keep their own
  value where the source falls off the warp's end), and reads it only from a
  lane that takes part: a source outside the mask, exited, or past the end of
  the block gives an *undefined* value, here NaN (or ``INT_POISON`` for an
  integer) so that a result built on it shows, and the call's record says
  which lane read what (``WarpCall.undefined``);
* the vote, match and shuffle functions check their argument types as
  numba-cuda's compiler does (shuffles: 32- and 64-bit ints and floats;
  predicates: integers or booleans), and return its types (``ballot_sync``: an
  int32; the votes: a bool).

``watch(callback)`` calls ``callback(call, threads)`` for every completed
rendezvous (a ``WarpCall``), which is how ``course.cuda_audit`` records them.

It replaces internals of numba-cuda 0.30.4 (pinned in pyproject.toml, and listed
with the course's other uses of numba-cuda's internals in ``course.numba_internals``);
with any other version it leaves the simulator as it is, only slower, and
without warp functions.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from dataclasses import dataclass

import numpy as np

from course import numba_internals

SUPPORTED = numba_internals.WRITTEN_FOR
WARP_SIZE = 32
FULL_MASK = 0xFFFFFFFF
INT_POISON = -(2**31) + 7  # an undefined integer (course.cuda_audit poisons shared arrays with it too)
SHUFFLES = ("shfl_sync", "shfl_up_sync", "shfl_down_sync", "shfl_xor_sync")
VOTES = ("all_sync", "any_sync", "eq_sync", "ballot_sync")
MATCHES = ("match_any_sync", "match_all_sync")
WARP_FUNCTIONS = (*SHUFFLES, *VOTES, *MATCHES, "syncwarp")
_installed = False
_observers: list = []


class WarpError(RuntimeError):
    """A warp function called against CUDA's rules, whose result CUDA leaves undefined."""


@dataclass(frozen=True)
class WarpCall:
    """One completed rendezvous of a warp function."""
    function: str  # "shfl_down_sync", "ballot_sync", "syncwarp", ...
    mask: int
    block: tuple  # blockIdx as (x, y, z)
    warp: int  # linear thread index // 32
    lanes: tuple  # the lanes that took part
    undefined: tuple = ()  # (lane, source lane, why) for each shuffle read of a lane that took no part
    launch: int = 0  # set by course.cuda_audit: which launch of an audit

    def __str__(self) -> str:
        lanes = f"lanes {lanes_text(self.lanes)}" if len(self.lanes) > 1 else f"lane {lanes_text(self.lanes)}"
        return f"cuda.{self.function}(mask {self.mask:#010x}) by {lanes} of warp {self.warp}"


def lanes_text(lanes) -> str:
    """``0-15, 17``: lanes as ranges."""
    lanes, parts = sorted(lanes), []
    for lane in lanes:
        if parts and parts[-1][1] == lane - 1:
            parts[-1][1] = lane
        else:
            parts.append([lane, lane])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in parts) or "none"


@contextlib.contextmanager
def watch(callback):
    """Inside: ``callback(call, threads)`` for every completed warp function, with the
    ``WarpCall`` and ``{lane: the simulator's thread}`` of the lanes that took part. It
    runs in a thread of the block while the others wait, so it may read and set their
    attributes."""
    _observers.append(callback)
    try:
        yield
    finally:
        _observers.remove(callback)


def install() -> bool:
    """Switch the simulator to the event-driven scheduler and give it the warp functions
    (once per process); return whether it is in use. It imports the simulator's kernel
    module (and so ``numba.cuda``): call it once ``NUMBA_ENABLE_CUDASIM=1`` is set."""
    global _installed
    if _installed:
        return True
    if not numba_internals.written_for_installed():
        # The poll needs a short switch interval to get anywhere.
        sys.setswitchinterval(1e-4)
        return False
    from numba.cuda.simulator import kernel as sim_kernel
    from numba.cuda.simulator import kernelapi

    thread_cls, manager_cls = sim_kernel.BlockThread, sim_kernel.BlockManager
    original_thread_run = thread_cls.run

    def thread_run(self):
        try:
            original_thread_run(self)  # stores an exception in self.exception
        finally:
            block = self._manager
            with block._k2c_cond:
                block._k2c_ended += 1
                block._k2c_ended_ids.add(self.thread_id)
                if self.exception and block._k2c_failed is None:
                    block._k2c_failed = self
                if block._k2c_failed is None:
                    _excuse(block, self.thread_id)  # a lane that exits no longer holds its warp's calls
                block._k2c_cond.notify()

    def syncthreads(self):
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads call")
        block = self._manager
        with block._k2c_cond:
            block._k2c_waiting.append(self)
            if _blocked(block) == block._k2c_size:
                block._k2c_cond.notify()
        self.syncthreads_event.wait()
        self.syncthreads_event.clear()
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads clear")

    def run(self, grid_point, *args):
        points = list(np.ndindex(*self._block_dim))
        self._k2c_cond, self._k2c_waiting, self._k2c_ended = threading.Condition(), [], 0
        self._k2c_size, self._k2c_failed = len(points), None
        self._k2c_threads, self._k2c_ended_ids, self._k2c_warp_waiting = {}, set(), 0
        threads = []
        for block_point in points:
            thread = thread_cls(lambda: self._f(*args), self, grid_point, block_point, self._debug)
            thread._k2c_op = thread._k2c_result = None
            self._k2c_threads[thread.thread_id] = thread
            threads.append(thread)
            thread.start()

        def barrier_or_end():
            return self._k2c_failed is not None or _blocked(self) == self._k2c_size

        def abort_all():
            for thread in threads:
                thread.abort = True
                thread.syncthreads_event.set()

        with self._k2c_cond:
            while True:
                self._k2c_cond.wait_for(barrier_or_end)
                if self._k2c_failed is not None:
                    # As the simulator does: abort the others (they raise at their
                    # next barrier) and raise the first exception, without joining.
                    abort_all()
                    exc, tb = self._k2c_failed.exception
                    raise exc.with_traceback(tb)
                if self._k2c_ended == self._k2c_size:
                    return
                if self._k2c_warp_waiting:
                    # Every live thread waits, and some in a warp function that can never
                    # complete: a divergent call (or a barrier some lanes reached first).
                    abort_all()
                    raise WarpError(_stuck(self, grid_point))
                waiting, self._k2c_waiting = self._k2c_waiting, []
                for thread in waiting:
                    thread.syncthreads_event.set()

    thread_cls.run, thread_cls.syncthreads, manager_cls.run = thread_run, syncthreads, run
    for name, function in _warp_api().items():
        setattr(kernelapi.FakeCUDAModule, name, function)
    sys.setswitchinterval(0.005)  # Python's default: threads that wake when they should need no more
    _installed = True
    return True


# -- the warp functions ----------------------------------------------------------------

def _blocked(block) -> int:
    """Threads that wait (at the barrier or in a warp function) or have ended."""
    return len(block._k2c_waiting) + block._k2c_ended + block._k2c_warp_waiting


def _named(mask: int) -> list[int]:
    return [lane for lane in range(WARP_SIZE) if mask >> lane & 1]


def _integer(value, function: str, what: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"cuda.{function}: the {what} must be an integer, not {type(value).__name__} "
                        "(numba-cuda's compiler refuses it too)")
    return int(value)


_SHUFFLED = (np.int32, np.int64, np.float32, np.float64)


def _shuffled(value, function: str):
    if isinstance(value, (bool, np.bool_)) or not (type(value) in (int, float) or isinstance(value, _SHUFFLED)):
        raise TypeError(f"cuda.{function} only supports 32- and 64-bit ints and floats (numba-cuda's rule), "
                        f"not {type(value).__name__}")
    return value


def _predicate(value, function: str) -> bool:
    if not isinstance(value, (bool, int, np.bool_, np.integer)):
        raise TypeError(f"cuda.{function}: the predicate must be an integer or boolean (numba-cuda's rule), "
                        f"not {type(value).__name__}")
    return bool(value)


def _int32(bits: int) -> np.int32:
    """A 32-bit lane mask as numba types it: a signed int32."""
    return np.int32(bits - (1 << 32) if bits >= 1 << 31 else bits)


def _like(own, value):
    """``value`` as the type of the caller's own ``own`` (each lane's result has its own type)."""
    return value if type(value) is type(own) else type(own)(value)


def _undefined(own):
    kind = np.dtype(type(own)).kind if isinstance(own, np.generic) else ("f" if isinstance(own, float) else "i")
    return type(own)(np.nan if kind == "f" else INT_POISON)


def _source_lane(function: str, lane: int, arg: int) -> int:
    """The lane a shuffle reads, as PTX's shfl.sync computes it (b[4:0]; 32 lanes, no segments)."""
    b = arg & (WARP_SIZE - 1)
    if function == "shfl_sync":
        return b
    if function == "shfl_up_sync":
        return lane - b if lane - b >= 0 else lane  # falls off the warp's start: its own value
    if function == "shfl_down_sync":
        return lane + b if lane + b < WARP_SIZE else lane  # falls off the warp's end: its own value
    return lane ^ b


def _outcomes(function, mask, ops, base, size):
    """``({lane: result}, undefined reads)`` of one rendezvous: ``ops`` maps each lane that
    takes part to its (value or predicate, argument)."""
    if function == "syncwarp":
        return dict.fromkeys(ops), ()
    if function in SHUFFLES:
        results, undefined = {}, []
        for lane, (value, arg) in ops.items():
            src = _source_lane(function, lane, arg)
            if src in ops:
                results[lane] = _like(value, ops[src][0])
                continue
            results[lane] = _undefined(value)
            why = (f"lane {src} is past the end of the block ({size} threads)" if base + src >= size else
                   f"lane {src} is not in the mask" if not mask >> src & 1 else f"lane {src} had exited")
            undefined.append((lane, src, why))
        return results, tuple(undefined)
    if function in MATCHES:
        groups = {lane: sum(1 << other for other, (v, _) in ops.items() if v == value)
                  for lane, (value, _) in ops.items()}
        if function == "match_any_sync":
            return {lane: _int32(bits) for lane, bits in groups.items()}, ()
        # The lanes that take part, when they agree (numba-cuda's own test of a 10-thread block with a
        # full mask expects 0b1111111111, as the hardware gives), else 0.
        same = len({v for v, _ in ops.values()}) <= 1
        return dict.fromkeys(ops, (_int32(sum(1 << lane for lane in ops)), True) if same else (np.int32(0), False)), ()
    votes = {lane: bool(p) for lane, (p, _) in ops.items()}
    if function == "ballot_sync":
        result = _int32(sum(1 << lane for lane, p in votes.items() if p))
    elif function == "all_sync":
        result = all(votes.values())
    elif function == "any_sync":
        result = any(votes.values())
    else:  # eq_sync: the predicate is the same in every lane that takes part
        result = len(set(votes.values())) <= 1
    return dict.fromkeys(ops, result), ()


def _complete(block, warp: int, function: str, mask: int) -> bool:
    """Complete the call ``(function, mask)`` of ``warp`` if every lane it names has made it
    or exited (under the block's lock); whether it did."""
    base, lanes = warp * WARP_SIZE, []
    for lane in _named(mask):
        tid = base + lane
        if tid >= block._k2c_size or tid in block._k2c_ended_ids:
            continue
        thread = block._k2c_threads.get(tid)
        op = thread._k2c_op if thread is not None else None
        if op is None or op[0] != function or op[1] != mask:
            return False
        lanes.append(lane)
    threads = {lane: block._k2c_threads[base + lane] for lane in lanes}
    results, undefined = _outcomes(function, mask, {lane: t._k2c_op[2:] for lane, t in threads.items()}, base,
                                   block._k2c_size)
    for lane, thread in threads.items():
        thread._k2c_result, thread._k2c_op = results[lane], None
    block._k2c_warp_waiting -= len(threads)
    call = WarpCall(function, mask, tuple(threads[lanes[0]].blockIdx), warp, tuple(lanes), undefined)
    for observer in list(_observers):
        observer(call, threads)
    me = threading.current_thread()
    for thread in threads.values():
        if thread is not me:
            thread.syncthreads_event.set()
    return True


def _excuse(block, tid: int) -> None:
    """Thread ``tid`` has exited: complete the calls of its warp that waited only for it."""
    warp, lane = divmod(tid, WARP_SIZE)
    pending = {block._k2c_threads[t]._k2c_op[:2] for t in range(warp * WARP_SIZE, (warp + 1) * WARP_SIZE)
               if t in block._k2c_threads and block._k2c_threads[t]._k2c_op is not None}
    for function, mask in pending:
        if mask >> lane & 1:
            _complete(block, warp, function, mask)


def _doing(block, thread) -> str:
    if thread._k2c_op is not None:
        function, mask = thread._k2c_op[:2]
        return f"waits in cuda.{function} with mask {mask:#010x}"
    return "waits at cuda.syncthreads()" if thread in block._k2c_waiting else "is still running"


def _stuck(block, grid_point) -> str:
    """Why a block whose live threads all wait cannot go on: the first warp call that waits
    for a lane that will never make it, and what that lane does instead."""
    waiting = sorted(tid for tid, t in block._k2c_threads.items() if t._k2c_op is not None)
    first = block._k2c_threads[waiting[0]]
    function, mask = first._k2c_op[:2]
    warp = waiting[0] // WARP_SIZE
    base = warp * WARP_SIZE
    live = [lane for lane in _named(mask)
            if base + lane < block._k2c_size and base + lane not in block._k2c_ended_ids]
    there = [lane for lane in live if (block._k2c_threads[base + lane]._k2c_op or (None, None))[:2] == (function, mask)]
    missing = [lane for lane in live if lane not in there]
    lane = missing[0]
    others = f" (and lanes {lanes_text(missing[1:])})" if len(missing) > 1 else ""
    return (f"warp {warp} of block {tuple(grid_point)} is stuck: lanes {lanes_text(there)} wait in "
            f"cuda.{function} (mask {mask:#010x}) for lane {lane} (thread {base + lane}), which "
            f"{_doing(block, block._k2c_threads[base + lane])}{others}. Every lane a warp function's mask names "
            "must call that function with the same mask, or have exited: a warp function in a branch that only "
            "some of those lanes take is divergent, and CUDA leaves the result undefined")


def _call(function: str, mask, payload=None, arg=0):
    """One lane's part in a warp function: wait for the lanes ``mask`` names, return its result."""
    thread = threading.current_thread()
    block = getattr(thread, "_manager", None)
    if not hasattr(block, "_k2c_cond"):
        raise RuntimeError(f"cuda.{function} runs in numba's simulator only with course.cuda_sim.install() "
                           "(course.use_simulator_if_no_gpu() calls it)")
    mask = _integer(mask, function, "mask") & FULL_MASK
    warp, lane = divmod(thread.thread_id, WARP_SIZE)
    if not mask >> lane & 1:
        raise WarpError(f"thread {thread.thread_id} (lane {lane} of warp {warp}) called cuda.{function} with mask "
                        f"{mask:#010x}, which does not name its lane: every thread that calls a warp function "
                        "must have its own bit set in the mask")
    if thread.abort:
        raise RuntimeError(f"abort flag set on cuda.{function} call")
    with block._k2c_cond:
        thread._k2c_op = (function, mask, payload, arg)
        block._k2c_warp_waiting += 1
        done = _complete(block, warp, function, mask)
        if not done and _blocked(block) == block._k2c_size:
            block._k2c_cond.notify()  # everyone waits: the manager says who holds up whom
    if not done:
        thread.syncthreads_event.wait()
        thread.syncthreads_event.clear()
        if thread.abort:
            raise RuntimeError(f"abort flag set in cuda.{function}")
    result, thread._k2c_result = thread._k2c_result, None
    return result


def _warp_api() -> dict:
    """numba-cuda's warp functions, as methods of the simulator's ``cuda`` module."""

    def shuffle(function, what):
        def shuffled(self, mask, value, lane_arg):
            return _call(function, mask, _shuffled(value, function), _integer(lane_arg, function, what))
        shuffled.__name__ = function
        shuffled.__doc__ = f"cuda.{function}(mask, value, {what}), as numba-cuda's"
        return shuffled

    def vote(function):
        def voted(self, mask, predicate):
            return _call(function, mask, _predicate(predicate, function))
        voted.__name__ = function
        voted.__doc__ = f"cuda.{function}(mask, predicate), as numba-cuda's"
        return voted

    def match(function):
        def matched(self, mask, value):
            return _call(function, mask, _shuffled(value, function))
        matched.__name__ = function
        matched.__doc__ = f"cuda.{function}(mask, value), as numba-cuda's"
        return matched

    def syncwarp(self, mask=FULL_MASK):
        """cuda.syncwarp(mask=0xFFFFFFFF): wait for the lanes the mask names."""
        _call("syncwarp", mask)

    def activemask(self):
        """The lanes of this warp that have not exited yet: its own, and others as scheduling has it (on a
        GPU, those converged at the call; the guide promises neither that they stay so)."""
        thread = threading.current_thread()
        block, base = thread._manager, thread.thread_id // WARP_SIZE * WARP_SIZE
        with block._k2c_cond:
            bits = sum(1 << lane for lane in range(WARP_SIZE)
                       if base + lane < block._k2c_size and base + lane not in block._k2c_ended_ids)
        return np.uint32(bits)

    def lanemask_lt(self):
        """The lanes below this one."""
        return np.uint32((1 << threading.current_thread().thread_id % WARP_SIZE) - 1)

    def popc(self, value):
        """Set bits of ``value`` in its own width (the simulator's counted a negative int32's sign only)."""
        bits = np.dtype(type(value)).itemsize * 8 if isinstance(value, np.integer) else 64
        return bin(int(value) & ((1 << bits) - 1)).count("1")

    api = {name: shuffle(name, what) for name, what in zip(SHUFFLES, ("src_lane", "delta", "delta", "lane_mask"))}
    api.update({name: vote(name) for name in VOTES})
    api.update({name: match(name) for name in MATCHES})
    api.update(syncwarp=syncwarp, activemask=activemask, lanemask_lt=lanemask_lt, popc=popc)
    return api
