"""See what a CUDA kernel does to memory, whatever order its threads run in.

A race in a kernel often gives the right answer anyway: whether a thread reads
a shared-memory element before or after its neighbour writes it depends on
scheduling, which differs from run to run (on a GPU) or barely at all (in
numba's simulator, which runs threads almost in order). So we do not look at
results; we look at *accesses*.

Inside ``with audit() as log:`` every kernel launched in numba's CUDA simulator
records each element it reads or writes — which block, which thread, how many
``syncthreads()`` that thread had passed (its *epoch*), and whether the access
was atomic. From that record alone, with no timing involved:

* **races** — two threads of a block touch one element in the same epoch (no
  barrier between them), at least one of them writes, and not both atomically;
  or two blocks touch one global element, one writing, not atomically (blocks
  never wait for each other inside a kernel);
* **shared-memory bank conflicts** — for the k-th shared access of every thread
  of a warp, how many distinct 4-byte words fall into the busiest of the 32
  banks (1 is conflict-free; equal words are a broadcast);
* **global-memory coalescing** — for the k-th global access of a warp, how many
  32-byte sectors it touches compared with the fewest that could hold the bytes
  it asked for;
* **global loads per array** — e.g. how often a matmul reads each input element,
  which tells a tiled kernel from one that reads global memory every time;
* **lane use** — for the k-th shared (or global) access of a warp, how many of
  its lanes took part: a warp whose lanes take different branches runs each
  branch with the others idle (*divergence*), which shows as requests with few
  lanes;
* **warp functions and barriers** — every completed warp function (shuffle,
  vote, ``syncwarp``: ``course.cuda_sim``) with the lanes that took part and any
  read of a lane that took none, and how many ``syncthreads()`` each block
  passed.

A ``syncwarp()`` orders the accesses of the lanes it names, as a barrier does
for a block: two accesses of one warp's lanes in the same epoch do not race when
a ``syncwarp()`` both lanes took part in falls between them.

Shared arrays are also poisoned (NaN, or a sentinel for integers) instead of
the simulator's uninitialised memory, so reading an element nobody wrote shows.
A kernel that turns a device array into a NumPy array (``np.asarray(x)``,
``np.sum(x)``), whose reads would escape the record and which no GPU compiles,
raises ``TypeError`` inside an audit.

A negative index wraps around in NumPy, and so in the simulator: ``out[-t]``
lands on ``out[n - t]``, which can leave the output right. Each access records
whether its index wrapped, so a check can name the mistake.

``with launches() as found:`` records only the grid and block of every kernel
launch, e.g. to check that host code launches with the configuration it should.

Both work only in the simulator (``NUMBA_ENABLE_CUDASIM=1``), by wrapping a few
of its internals for the duration of the ``with`` block.
"""
from __future__ import annotations

import contextlib
import math
import sys
import threading
from collections import defaultdict
from dataclasses import dataclass, field, replace

import numpy as np

WARP = 32
BANKS = 32
SECTOR_BYTES = 32
INT_POISON = -(2**31) + 7


@dataclass(frozen=True)
class Access:
    space: str  # "shared" or "global"
    array: str  # the shared array's allocation site, or the global array's name
    offset: int  # byte offset of the element in its array
    itemsize: int
    kind: str  # "r", "w" or "a" (atomic)
    block: tuple
    thread: int  # linear thread index within the block
    epoch: int  # syncthreads() calls this thread had passed
    k: int  # this thread's k-th access to this memory space within the epoch
    launch: int  # which kernel launch inside the audit (1, 2, ...)
    wrapped: bool = False  # a negative index, which NumPy (and the simulator) wrapped around
    warp_sync: int = 0  # syncwarp() calls this thread had passed in this epoch


@dataclass(frozen=True)
class Launch:
    kernel: str  # the kernel function's name
    grid: tuple  # blocks along (x, y, z)
    block: tuple  # threads per block along (x, y, z)


@dataclass(frozen=True)
class Race:
    space: str
    array: str
    index: int  # element index (flat) in the array
    accesses: tuple  # ((block, thread, kind), ...) a few of the conflicting accesses
    epoch: int | None

    def __str__(self) -> str:
        who = ", ".join(f"thread {t} of block {b} {'writes' if k == 'w' else 'reads' if k == 'r' else 'atomically updates'}"
                        for b, t, k in self.accesses[:3])
        same_warp = self.epoch is not None and len({t // WARP for _, t, _ in self.accesses[:2]}) == 1
        nor = " nor a syncwarp() of both" if same_warp else ""
        when = (f" with no syncthreads(){nor} between them (epoch {self.epoch})" if self.epoch is not None
                else " (different blocks)")
        return f"{self.space} {self.array}[{self.index}]: {who}{when}"


@dataclass
class AuditLog:
    accesses: list = field(default_factory=list)
    names: dict = field(default_factory=dict)  # data address of a device array -> its name
    launches: int = 0
    warp_calls: list = field(default_factory=list)  # course.cuda_sim.WarpCall, each with its launch
    syncwarps: dict = field(default_factory=dict)  # (launch, block, thread, epoch) -> ids of the syncwarps it passed
    barriers_passed: dict = field(default_factory=dict)  # (launch, block, thread) -> syncthreads() passed
    block_threads: dict = field(default_factory=dict)  # launch -> threads per block

    def name(self, device_array, name: str) -> None:
        """Label a device array so its global accesses are reported under ``name``."""
        self.names[_base_address(_host_view(device_array))] = name

    # -- what the log shows ----------------------------------------------------

    def shared_arrays(self) -> set[str]:
        return {a.array for a in self.accesses if a.space == "shared"}

    def loads(self, array: str) -> int:
        """How many element reads the kernel made from a named global array."""
        return sum(1 for a in self.accesses if a.space == "global" and a.array == array and a.kind == "r")

    def races(self, limit: int = 20) -> list[Race]:
        found: list[Race] = []
        by_element = defaultdict(list)
        for a in self.accesses:
            scope = a.block if a.space == "shared" else None  # each block has its own shared memory
            by_element[(a.launch, a.space, a.array, scope, a.offset // a.itemsize)].append(a)
        for (_, space, array, _, index), group in by_element.items():
            race = _race_in(space, array, index, group, self.syncwarps)
            if race:
                found.append(race)
                if len(found) >= limit:
                    break
        return found

    def bank_conflicts(self) -> dict:
        """Worst and mean conflict degree over the warps' shared-memory requests."""
        degrees = []
        for group in _warp_requests(self.accesses, "shared").values():
            words_per_bank = defaultdict(set)
            for a in group:
                word = a.offset // 4
                words_per_bank[word % BANKS].add((a.array, word))
            degrees.append(max(len(w) for w in words_per_bank.values()))
        return {"requests": len(degrees), "worst": max(degrees, default=1),
                "mean": float(np.mean(degrees)) if degrees else 1.0}

    def barriers(self) -> dict:
        """``{(launch, block): the most syncthreads() a thread of that block passed}``, for every
        block of every launch whose threads made an access or passed a barrier."""
        found = defaultdict(int)
        for a in self.accesses:
            found[(a.launch, a.block)] = max(found[(a.launch, a.block)], a.epoch)
        for (launch, block, _), passed in self.barriers_passed.items():
            found[(launch, block)] = max(found[(launch, block)], passed)
        return dict(found)

    def lane_use(self, space: str = "shared") -> dict:
        """How many lanes took part in the warps' requests to ``space``: ``requests`` (the
        k-th access of a warp between two barriers), ``active_lanes`` summed over them,
        ``lanes`` (the warps' lanes, 32 but in a block's partial last warp) and
        ``efficiency`` = active / lanes. Divergent branches and idle lanes lower it."""
        requests = active = lanes = 0
        for (launch, _, warp, _, _), group in _warp_requests(self.accesses, space).items():
            threads = self.block_threads.get(launch, WARP * (warp + 1))
            requests += 1
            active += len({a.thread for a in group})
            lanes += min(WARP, threads - warp * WARP)
        return {"requests": requests, "active_lanes": active, "lanes": lanes,
                "efficiency": active / lanes if lanes else 1.0}

    def undefined_reads(self, limit: int = 20) -> list[str]:
        """Shuffles that read a lane that took no part (undefined on a GPU), in words."""
        found = []
        for call in self.warp_calls:
            for lane, source, why in call.undefined:
                found.append(f"lane {lane} of warp {call.warp} in block {call.block} read lane {source} in "
                             f"cuda.{call.function} (mask {call.mask:#010x}), but {why}: the value is undefined")
                if len(found) >= limit:
                    return found
        return found

    def coalescing(self, array: str | None = None) -> dict:
        """Sectors touched per warp request vs the fewest needed: 1.0 is perfect."""
        touched = needed = requests = 0
        for group in _warp_requests(self.accesses, "global").values():
            if array is not None:
                group = [a for a in group if a.array == array]
            if not group:
                continue
            requests += 1
            sectors = len({(a.array, a.offset // SECTOR_BYTES) for a in group})
            # What the warp asked for, packed: one item per thread (threads reading
            # the same address get it broadcast, so never count more than touched).
            touched += sectors
            needed += min(sectors, math.ceil(len(group) * group[0].itemsize / SECTOR_BYTES))
        return {"requests": requests, "sectors": touched, "ideal_sectors": needed,
                "efficiency": needed / touched if touched else 1.0}


def _race_in(space, array, index, group, syncwarps=None) -> Race | None:
    """Two accesses race when nothing orders them, one writes, and not both are atomic.

    Within a block, syncthreads() orders accesses of different epochs, and a syncwarp()
    that both threads passed, one after its access and the other before, orders two
    accesses of one epoch; accesses of different blocks (global memory only) are never
    ordered within one launch.
    """
    if all(a.kind == "r" for a in group):
        return None
    syncwarps = syncwarps or {}

    def syncwarp_between(a, b):
        first = syncwarps.get((a.launch, a.block, a.thread, a.epoch), ())[a.warp_sync:]
        second = syncwarps.get((b.launch, b.block, b.thread, b.epoch), ())[:b.warp_sync]
        return bool(set(first) & set(second))

    def unordered(a, b):
        if a.launch != b.launch or (a.block, a.thread) == (b.block, b.thread):
            return False
        if a.block != b.block:
            return True
        return a.epoch == b.epoch and not (syncwarp_between(a, b) or syncwarp_between(b, a))

    writers = [a for a in group if a.kind != "r"]
    for w in writers:
        for other in group:
            if other is not w and unordered(w, other) and not (w.kind == "a" and other.kind == "a"):
                return Race(space, array, index, ((w.block, w.thread, w.kind), (other.block, other.thread, other.kind)),
                            w.epoch if w.block == other.block else None)
    return None


def _warp_requests(accesses, space) -> dict:
    """Group the k-th access (per epoch) of every thread of a warp: one request."""
    groups = defaultdict(list)
    for a in accesses:
        if a.space == space and a.kind != "a":
            groups[(a.launch, a.block, a.thread // WARP, a.epoch, a.k)].append(a)
    return groups


# -- recording inside the simulator ---------------------------------------------

_state = threading.local()
_log: AuditLog | None = None
_lock = threading.Lock()


def _host_view(array) -> np.ndarray:
    """The NumPy array behind a simulator device array (or the array itself)."""
    while not isinstance(array, np.ndarray):
        array = getattr(array, "_item", None) or getattr(array, "_ary")
    return array


def _base_address(array: np.ndarray) -> int:
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array.__array_interface__["data"][0]


def _element_offset(array: np.ndarray, index) -> tuple[int, bool] | None:
    """(byte offset from the start of the array's buffer, whether a negative index
    wrapped around), or None if not one element."""
    if not isinstance(index, tuple):
        index = (index,)
    if len(index) != array.ndim:
        return None
    offset, wrapped = array.__array_interface__["data"][0] - _base_address(array), False
    for i, n, stride in zip(index, array.shape, array.strides):
        if not isinstance(i, (int, np.integer)):
            return None
        i = int(i)
        wrapped = wrapped or i < 0
        offset += (i + n if i < 0 else i) * stride
    return offset, wrapped


def _record(space, name, array, index, kind) -> None:
    thread = threading.current_thread()
    if _log is None or not hasattr(thread, "thread_id"):
        return  # host code, or no audit running
    found = _element_offset(array, index)
    if found is None:
        return
    offset, wrapped = found
    if getattr(_state, "atomic", False):
        if _state.atomic_recorded:
            return  # the simulator's atomic reads and writes the element: one access
        _state.atomic_recorded = True
        kind = "a"
    epoch = getattr(thread, "_k2c_epoch", 0)
    counters = thread.__dict__.setdefault("_k2c_counters", defaultdict(int))
    k = counters[(space, epoch)]
    counters[(space, epoch)] += 1
    block = tuple(thread.blockIdx)
    warp_sync = len(_log.syncwarps.get((_log.launches, block, thread.thread_id, epoch), ()))
    access = Access(space, name, offset, array.itemsize, kind, block, thread.thread_id, epoch, k,
                    _log.launches, wrapped, warp_sync)
    with _lock:
        _log.accesses.append(access)


class SharedArray:
    """A shared array that records each element access (and starts poisoned)."""

    def __init__(self, array: np.ndarray, name: str):
        self._array, self._name = array, name
        self.shape, self.size, self.dtype, self.ndim = array.shape, array.size, array.dtype, array.ndim

    def __len__(self):
        return len(self._array)

    def __getitem__(self, index):
        value = self._array[index]
        _record("shared", self._name, self._array, index, "r")
        return value

    def __setitem__(self, index, value):
        _record("shared", self._name, self._array, index, "w")
        self._array[index] = value


def _patched_simulator():
    """(object, attribute, replacement) triples: what the audit swaps in the simulator."""
    from numba.cuda.simulator import kernel as sim_kernel
    from numba.cuda.simulator import kernelapi
    from numba.cuda.simulator.cudadrv import devicearray

    within = devicearray.FakeWithinKernelCUDAArray
    original_get, original_set = within.__getitem__, within.__setitem__
    original_getattr = within.__getattr__
    original_sync = sim_kernel.BlockThread.syncthreads
    original_call = sim_kernel.FakeCUDAKernel.__call__

    def global_name(fake):
        array = _host_view(fake)
        return array, _log.names.get(_base_address(array), f"array@{_base_address(array):x}")

    def get(self, index):
        value = original_get(self, index)
        if _log is not None:
            array, name = global_name(self)
            _record("global", name, array, index, "r")
        return value

    def set_(self, index, value):
        if _log is not None:
            array, name = global_name(self)
            _record("global", name, array, index, "w")
        original_set(self, index, value)

    def whole_array(self, name):
        # NumPy's way in to a device array as a whole (np.asarray, np.sum(x)...): its reads would
        # escape this record, and no GPU compiles it; inside a kernel it is refused, saying so.
        if name in ("__array__", "__array_interface__", "__array_struct__") \
                and hasattr(threading.current_thread(), "thread_id"):
            raise TypeError(f"a kernel made a NumPy array of a device array ({name}): index device arrays "
                            "element by element (x[i]); whole-array NumPy in a kernel does not compile for a GPU")
        return original_getattr(self, name)

    def syncthreads(self):
        self._k2c_epoch = getattr(self, "_k2c_epoch", 0) + 1
        if _log is not None:
            _log.barriers_passed[(_log.launches, tuple(self.blockIdx), self.thread_id)] = self._k2c_epoch
        original_sync(self)

    def shared_array(self, shape, dtype, alignment=None):
        from numba.cuda.np import numpy_support
        from numba.cuda import types

        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        dtype = np.dtype(dtype)
        caller = sys._getframe(1)
        # One array per call site, as the simulator does, but fresh (poisoned) for
        # every block: on a GPU a block never sees another block's shared memory.
        site = (caller.f_code.co_filename, caller.f_lineno, tuple(threading.current_thread().blockIdx))
        with _lock:  # the block's threads all ask at once: exactly one of them allocates
            if site not in self._allocations:
                fill = np.nan if dtype.kind == "f" else INT_POISON
                name = f"{caller.f_code.co_name}:{caller.f_lineno}"
                self._allocations[site] = SharedArray(np.full(shape, fill, dtype=dtype), name)
            return self._allocations[site]

    def call(self, *args):
        if _log is not None and not (self._device or sim_kernel._kernel_context):
            _log.launches += 1
            _log.block_threads[_log.launches] = math.prod(self.block_dim or (1,))
        return original_call(self, *args)

    swaps = [(within, "__getitem__", get), (within, "__setitem__", set_), (within, "__getattr__", whole_array),
             (sim_kernel.BlockThread, "syncthreads", syncthreads),
             (kernelapi.FakeCUDAShared, "array", shared_array),
             (sim_kernel.FakeCUDAKernel, "__call__", call)]
    for name in ("add", "sub", "max", "min", "inc", "dec", "exch", "cas", "and_", "or_", "xor"):
        original = getattr(kernelapi.FakeCUDAAtomic, name)

        def atomic(self, *args, _original=original):
            _state.atomic, _state.atomic_recorded = True, False
            try:
                return _original(self, *args)
            finally:
                _state.atomic = False

        swaps.append((kernelapi.FakeCUDAAtomic, name, atomic))
    return swaps


def _require_simulator() -> None:
    from numba import config

    if not config.ENABLE_CUDASIM:
        raise RuntimeError("course.cuda_audit needs numba's CUDA simulator: set NUMBA_ENABLE_CUDASIM=1 "
                           "before numba.cuda is imported (course.use_simulator_if_no_gpu() does it)")


@contextlib.contextmanager
def launches():
    """Record the grid and block (each as (x, y, z)) of every kernel launched in
    the simulator inside the block, as a list of ``Launch``."""
    from numba.cuda.simulator import kernel as sim_kernel
    from numba.cuda.errors import normalize_kernel_dimensions

    _require_simulator()
    found: list[Launch] = []
    original = sim_kernel.FakeCUDAKernel.__call__

    def call(self, *args):
        if not (self._device or sim_kernel._kernel_context):
            grid, block = normalize_kernel_dimensions(self.grid_dim, self.block_dim)
            found.append(Launch(self.fn.__name__, tuple(grid), tuple(block)))
        return original(self, *args)

    sim_kernel.FakeCUDAKernel.__call__ = call
    try:
        yield found
    finally:
        sim_kernel.FakeCUDAKernel.__call__ = original


@contextlib.contextmanager
def audit():
    """Record the memory accesses of every simulated kernel launched inside the block."""
    global _log

    _require_simulator()
    if _log is not None:
        raise RuntimeError("audits do not nest")
    from course import cuda_sim

    swaps = _patched_simulator()
    saved = [(obj, attr, obj.__dict__[attr]) for obj, attr, _ in swaps]
    _log = log = AuditLog()
    for obj, attr, new in swaps:
        setattr(obj, attr, new)
    try:
        with cuda_sim.watch(_warp_call):
            yield log
    finally:
        for obj, attr, old in saved:
            setattr(obj, attr, old)
        _log = None


def _warp_call(call, threads) -> None:
    """Record a completed warp function; a syncwarp() also joins each lane's list of
    syncwarps passed in its epoch (which orders accesses, see ``_race_in``)."""
    log = _log
    if log is None:
        return
    with _lock:
        log.warp_calls.append(replace(call, launch=log.launches))
        if call.function == "syncwarp":
            for thread in threads.values():
                key = (log.launches, tuple(thread.blockIdx), thread.thread_id, getattr(thread, "_k2c_epoch", 0))
                log.syncwarps.setdefault(key, []).append(len(log.warp_calls))
