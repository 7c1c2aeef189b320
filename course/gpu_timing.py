"""How the GPU tier times a kernel: one helper that every performance check uses.

A time is worth grading only if noise and tricks cannot move it. For each
thing it times, :func:`bench` does what the public GPU-kernel graders learned
to do (GPU MODE's KernelBot, Tensara, KernelBench; Triton's ``do_bench``):

- **fresh inputs for every run**: the caller's ``make_inputs(seed)`` builds
  each run's arguments, untimed, from a seed the grader drew for that run, so
  an answer kept from an earlier run (or from the warm-up) is wrong;
- **warm-ups** first (JIT compilation, the memory pool), untimed and unchecked;
- **an L2 flush between runs**: a buffer twice the size of the card's L2
  (from the device's attributes) is written before each run, so no run reads
  what the previous one left in the cache;
- **CUDA events** around the run on its stream (or the host clock after a
  device-wide synchronize, for work spread over several streams);
- **what each run produced**, kept by the caller's ``keep(output, args, seed)``,
  goes back to the grader with the run's time;
- **a record** of the device with every result (``gpu_devices.Device.record``): name,
  compute capability, SMs, L2, peak clocks, the clocks now where NVML reads
  them, driver and runtime versions, and the versions of numba, numba-cuda,
  CuPy, torch and NumPy.

The median over the runs, and the floor at the physical limit, are the
grader's (``autograder.grading.timed``): :func:`floor_seconds` is the shared
arithmetic (bytes over the card's peak bandwidth, FLOPs over its peak FP32
rate, from its attributes or :data:`KNOWN_CARDS`, whichever is higher, so an
honest time is never refused).

**The split between the sandbox and the grader.** This module runs beside
the student's code and never knows an answer. Inputs are *named by their seed*:
:func:`hashed` fills an array from ``(seed, index)`` with an integer hash, and
gives bit-for-bit the same numbers in NumPy, in CuPy, in the numba kernel
of ``gpu_devices.NumbaDevice.hashed`` and in torch (``TorchDevice.hashed``), so the grader can compute any input element
itself, without the inputs crossing the sandbox. For each timed run the
harness returns a *sample* of the output: the values at :func:`sample_positions`
(the first and last element and ``SAMPLES`` more, drawn from the run's seed),
or the whole output where it is small (a sum, a histogram's bins). The grader
computes its oracle at those positions from the same seeds and compares. A
sample rather than whole outputs because outputs of device-filling size
(256 MiB) cannot cross the sandbox twenty times per check; the correctness
checks compare whole outputs at full size, once. Reductions, whose answer
depends on every input element, take a base array named by a seed and a
per-run factor (:func:`scale_of`) or rotation (:func:`shift_of`): every
element changes from run to run, and the grader computes the base's answer
once. Student code in the same process could read a seed, as it could read
anything of the harness's: this keeps out stale answers, skipped runs and
work done outside the timed window, not code written to defeat the harness
(the flags for the instructor are for that).

**Devices.** ``course.gpu_devices`` wraps the three libraries the labs launch
with (CuPy, numba.cuda, torch) in the operations ``bench`` needs; on the CPU
tier its ``device()`` builds them on the stand-ins of ``course.gpu_stand_in`` (a
CuPy made of NumPy, numba's simulator, torch's CPU tensors, events on the host
clock, a small stand-in card), so that every line above runs before a GPU does; their record says
``stand_in: true`` and the grader awards nothing for it. This module imports
only NumPy: the grader imports it for the floors, the seeds and the inputs of
its oracles.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

SAMPLES = 256  # output positions checked per timed run, besides the first and the last
WARMUP = 1

# --- A card's peaks ------------------------------------------------------------

# FP32 lanes (FMA units) per SM, by compute capability: what peak FP32 FLOP/s is
# made of (2 FLOPs per FMA per lane per clock). Unknown architectures get 256, more
# than any has: a peak set too high lowers the floor, which never refuses honest work.
FP32_LANES_PER_SM = {(7, 0): 64, (7, 5): 64, (8, 0): 64, (8, 6): 128, (8, 7): 128, (8, 9): 128, (9, 0): 128,
                     (10, 0): 128, (10, 3): 128, (12, 0): 128}
UNKNOWN_LANES = 256

# Peak DRAM bandwidth (GB/s) and FP32 rate without tensor cores (TFLOP/s) from the
# vendor's data sheets, for cards whose attributes are unreadable (CUDA 13 dropped the
# clock fields from cudaDeviceProp). Matched as whole words of the name, the longest first.
KNOWN_CARDS = {
    "H200": (4800, 67.0), "H100 NVL": (3900, 60.0), "H100 PCIe": (2000, 51.0), "H100": (3350, 67.0),
    "A100-SXM4-80GB": (2039, 19.5), "A100 80GB PCIe": (1935, 19.5), "A100": (1555, 19.5),
    "L40S": (864, 91.6), "L4": (300, 30.3), "T4": (320, 8.1), "RTX 4090": (1008, 82.6), "V100": (900, 15.7),
}


@dataclass(frozen=True)
class DeviceInfo:
    """What the record holds about a card, as its attributes give it (``None``: unreadable)."""
    name: str
    compute_capability: tuple[int, int] | None = None
    multiprocessors: int | None = None
    l2_bytes: int | None = None
    sm_clock_max_khz: int | None = None
    memory_clock_max_khz: int | None = None
    memory_bus_bits: int | None = None
    driver: str | None = None
    runtime: str | None = None
    stand_in: bool = False  # a stand-in of course.gpu_stand_in: a dry run, nothing measured on a GPU
    clocks_now: dict = field(default_factory=dict)  # NVML's current clocks, MHz, where readable


def peaks(record: dict) -> dict:
    """The card's peak DRAM bandwidth (bytes/s) and FP32 rate (FLOP/s), with where each
    came from: its attributes, :data:`KNOWN_CARDS`, or both (the higher is taken)."""
    found = {"bandwidth": [], "fp32": []}
    if record.get("memory_clock_max_khz") and record.get("memory_bus_bits"):
        # Double data rate: two transfers per memory clock, bus_bits / 8 bytes each.
        found["bandwidth"].append((2 * record["memory_clock_max_khz"] * 1e3 * record["memory_bus_bits"] / 8,
                                   "attributes"))
    cc = tuple(record["compute_capability"]) if record.get("compute_capability") else None
    if record.get("sm_clock_max_khz") and record.get("multiprocessors"):
        lanes = FP32_LANES_PER_SM.get(cc, UNKNOWN_LANES)
        found["fp32"].append((2 * lanes * record["multiprocessors"] * record["sm_clock_max_khz"] * 1e3,
                              "attributes"))
    for fragment in sorted(KNOWN_CARDS, key=len, reverse=True):
        # A whole word of the name: "L4" is not the "L4" of "NVIDIA L40", a card three times faster.
        if re.search(rf"(?<![\w-]){re.escape(fragment)}(?![\w])", str(record.get("name", "")), re.IGNORECASE):
            bandwidth_gbs, tflops = KNOWN_CARDS[fragment]
            found["bandwidth"].append((bandwidth_gbs * 1e9, f"data sheet of {fragment}"))
            found["fp32"].append((tflops * 1e12, f"data sheet of {fragment}"))
            break
    result = {}
    for kind, options in found.items():
        value, source = max(options) if options else (None, "unknown")
        result[kind], result[f"{kind}_source"] = value, source
    return result


def floor_seconds(record: dict, moved_bytes: float = 0, flops: float = 0) -> tuple[float, str]:
    """The least time the work can take on the card of ``record``: ``moved_bytes`` of DRAM
    traffic at its peak bandwidth, or ``flops`` at its peak FP32 rate, whichever is longer;
    and the reason in words. ``(0.0, why)`` when the card's peaks are unknown."""
    peak = peaks(record)
    limits = []
    if moved_bytes and peak["bandwidth"]:
        limits.append((moved_bytes / peak["bandwidth"],
                       f"{_si(moved_bytes, 'B')} at the card's peak {_si(peak['bandwidth'], 'B/s')} "
                       f"({peak['bandwidth_source']})"))
    if flops and peak["fp32"]:
        limits.append((flops / peak["fp32"],
                       f"{_si(flops, 'FLOP')} at the card's peak FP32 {_si(peak['fp32'], 'FLOP/s')} "
                       f"({peak['fp32_source']})"))
    if not limits:
        return 0.0, "no floor: the card's peak bandwidth and FP32 rate are unknown"
    return max(limits)


def _si(value: float, unit: str) -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


LIBRARIES = ("numpy", "numba", "numba-cuda", "cupy-cuda13x", "cupy-cuda12x", "cupy", "torch", "cuda-bindings")


def library_versions() -> dict:
    """The installed versions of the libraries a GPU-tier result depends on."""
    from importlib import metadata

    found = {}
    for dist in LIBRARIES:
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return found


# --- Inputs the grader can name ------------------------------------------------

_M32 = np.uint64(0xFFFFFFFF)
_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B1), np.uint64(0x85EBCA6B), np.uint64(0xC2B2AE35)
STREAM_STEP = 0x632BE5AB  # one seed names several arrays: stream k adds k * STREAM_STEP


def _fmix(xp, h):
    """MurmurHash3's 32-bit finalizer on uint64 values below 2**32 (every step masked to 32 bits)."""
    h = h ^ (h >> np.uint64(16))
    h = (h * _MIX1) & _M32
    h = h ^ (h >> np.uint64(13))
    h = (h * _MIX2) & _M32
    return h ^ (h >> np.uint64(16))


def _key(seed: int, stream: int) -> np.uint64:
    return np.uint64((int(seed) + stream * STREAM_STEP) & 0xFFFFFFFF)


def hashed_bits(xp, seed: int, index, stream: int = 0):
    """32 hashed bits (as uint64) for each element index of ``index`` (an integer array of ``xp``)."""
    key = _fmix(np, np.asarray(_key(seed, stream)))[()]
    # Below 2**32 every product and sum fits in 64 bits: the same in NumPy, CuPy and numba.
    return _fmix(xp, ((index.astype(np.uint64) & _M32) * _GOLDEN + key) & _M32)


def hashed(xp, seed: int, shape, low: float = 0.0, high: float = 1.0, dtype=np.float32, stream: int = 0,
           positions=None):
    """Numbers in ``[low, high)`` named by ``(seed, stream)``: the element at flat index ``i``
    is the same in NumPy, CuPy and ``gpu_devices.NumbaDevice.hashed`` (24 hashed bits, scaled in
    float64, then cast). ``positions``: only those flat indices (NumPy, in the grader).
    Keep ``high - low`` a power of two: then the scaling is exact, and a GPU compiler that
    fuses the multiply and the add into one FMA cannot change a bit."""
    index = xp.arange(int(np.prod(shape)), dtype=np.int64) if positions is None else xp.asarray(positions)
    bits = hashed_bits(xp, seed, index, stream) >> np.uint64(8)
    values = (bits.astype(np.float64) * 2.0 ** -24 * (high - low) + low).astype(dtype)
    return values.reshape(shape) if positions is None else values


def hashed_ints(xp, seed: int, shape, bound: int, stream: int = 0, positions=None):
    """Integers in ``[0, bound)`` named by ``(seed, stream)``, as int32 (see :func:`hashed`)."""
    index = xp.arange(int(np.prod(shape)), dtype=np.int64) if positions is None else xp.asarray(positions)
    values = (hashed_bits(xp, seed, index, stream) % np.uint64(bound)).astype(np.int32)
    return values.reshape(shape) if positions is None else values


def hashed_total(seed: int, size: int, low: float = 0.0, high: float = 1.0, stream: int = 0,
                 chunk: int = 1 << 22) -> float:
    """The float64 sum of ``hashed(np, seed, size, ...)`` as float32, in chunks (the grader's
    side of a reduction over 2^27 elements takes about a second)."""
    total = 0.0
    for start in range(0, size, chunk):
        positions = np.arange(start, min(start + chunk, size), dtype=np.int64)
        total += float(hashed(np, seed, None, low, high, stream=stream, positions=positions).sum(dtype=np.float64))
    return total


def hashed_counts(seed: int, size: int, bound: int, stream: int = 0, chunk: int = 1 << 22) -> np.ndarray:
    """``np.bincount`` of ``hashed_ints(np, seed, size, bound)``, in chunks."""
    counts = np.zeros(bound, np.int64)
    for start in range(0, size, chunk):
        positions = np.arange(start, min(start + chunk, size), dtype=np.int64)
        counts += np.bincount(hashed_ints(np, seed, None, bound, stream, positions), minlength=bound)
    return counts


def hashed_product_at(seed: int, n: int, positions) -> np.ndarray:
    """``A @ B`` in float64 at the flat ``positions`` of the n x n product, where A is
    ``hashed(np, seed, (n, n))`` and B the same on stream 1: the grader's side of a timed
    matmul's sampled outputs, a row of A and a column of B each."""
    rows, cols = np.divmod(np.asarray(positions, dtype=np.int64), n)
    k = np.arange(n)
    a = hashed(np, seed, None, positions=(rows[:, None] * n + k).ravel()).reshape(-1, n)
    b = hashed(np, seed, None, stream=1, positions=(k[None, :] * n + cols[:, None]).ravel()).reshape(-1, n)
    return (a.astype(np.float64) * b).sum(axis=1)


def scale_of(seed: int) -> float:
    """A run's factor in [1, 2), exact in float32: a reduction's input is ``base * scale_of(seed)``."""
    return 1.0 + (int(seed) % 1024) / 1024


def shift_of(seed: int, bound: int) -> int:
    """A run's rotation of values in ``[0, bound)``: a histogram's input is ``(base + shift) % bound``."""
    return int(seed) % bound


def sample_positions(seed: int, size: int, count: int = SAMPLES) -> np.ndarray:
    """The flat positions of an output of ``size`` elements that a run's check reads: the
    first, the last, and ``count`` drawn from the seed (in order, repeats removed)."""
    drawn = hashed_bits(np, seed, np.arange(count, dtype=np.int64), stream=7) % np.uint64(max(size, 1))
    return np.unique(np.concatenate([[0, size - 1], drawn.astype(np.int64)]))


def pointer(array) -> int:
    """The address of an array's first element (-1: none found): a torch tensor's
    ``data_ptr``, else the CUDA array interface (CuPy, numba), else NumPy's, else the
    NumPy array inside numba's simulated device arrays."""
    if hasattr(array, "data_ptr"):
        return int(array.data_ptr())
    for protocol in ("__cuda_array_interface__", "__array_interface__"):
        interface = getattr(array, protocol, None)
        if interface:
            return int(interface["data"][0])
    inner = getattr(array, "_ary", None)
    return pointer(inner) if inner is not None else -1


# --- Timing --------------------------------------------------------------------

def bench(dev, run, make_inputs, keep, seeds, warmup: int = WARMUP, timer: str = "events") -> dict:
    """Time ``run(*make_inputs(seed))`` on ``dev`` (a ``course.gpu_devices.Device``) once for
    each seed of ``seeds``, after ``warmup`` untimed runs on inputs of their own. Each timed
    run gets new inputs (made untimed), an L2 flush before it, and CUDA events around it on
    the current stream (``timer="host"``: the host clock between two device-wide
    synchronizations, for work on several streams).
    ``keep(output, args, seed)`` says what of each run's output goes back to the grader.

    Returns plain data: ``{"runs": [{"seed", "seconds", "kept"}, ...], "warmup", "timer",
    "flushes", "record"}``. The grader takes the median and applies the floor."""
    for i in range(warmup):
        run(*make_inputs((int(seeds[0]) * 2654435761 + i + 1) & 0xFFFFFFFF))
        dev.synchronize()
    runs, flushed = [], dev.flushes
    for seed in seeds:
        args = make_inputs(seed)
        dev.synchronize()  # the inputs are ready before the flush and the clock
        dev.flush_l2()
        if timer == "events":
            start, stop = dev.event(), dev.event()
            start.record()  # queued behind the flush: the run starts when the flush ends
            output = run(*args)
            stop.record()
            seconds = dev.elapsed_s(start, stop)
        else:
            dev.synchronize()
            began = dev.host_clock()
            output = run(*args)
            dev.synchronize()
            seconds = dev.host_clock() - began
        runs.append({"seed": int(seed), "seconds": float(seconds), "kept": keep(output, args, seed)})
    return {"runs": runs, "warmup": warmup, "timer": timer, "flushes": dev.flushes - flushed,
            "record": dev.record()}
