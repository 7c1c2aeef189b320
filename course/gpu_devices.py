"""The devices the GPU tier times on: one class per library the labs launch with.

:class:`CupyDevice`, :class:`NumbaDevice` and :class:`TorchDevice` give a GPU-tier
harness function what it needs, whichever library launches its kernels: arrays (``xp``,
``empty``, ``hashed``, ``take``, ``to_host``), timing (``event``,
``elapsed_s``, ``synchronize``, ``host_clock``, ``flush_l2``) and the
``record`` that goes with every result (``course.gpu_timing`` says what
``bench`` does with them). On the CPU tier :func:`device` builds the same
classes on the stand-ins of ``course.gpu_stand_in``, so that their code runs
before a GPU does.

A module apart from ``course.gpu_timing``, which the grader imports too (its
floors, seeds and oracles' inputs): grading a lab that times nothing brings
neither these nor numba along.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict

import numpy as np

from course.gpu_timing import DeviceInfo, _fmix, _key, hashed, hashed_ints, library_versions, peaks


class Device:
    """What a GPU-tier harness function needs from a device, whichever library launches:
    arrays (``xp``, ``empty``, ``hashed``, ``take``, ``to_host``), timing (``event``,
    ``elapsed_s``, ``synchronize``, ``host_clock``, ``flush_l2``) and the ``record``."""

    xp = None  # the array module (CuPy or its stand-in, torch); None for numba
    torch_device = "cuda"  # where torch puts the tensors that share this device's memory
    clock = staticmethod(time.perf_counter)

    def __init__(self):
        self._flush = None
        self.flushes = 0  # how many times the L2 was flushed (bench's record of it)

    @property
    def info(self) -> DeviceInfo:
        if getattr(self, "_info", None) is None:
            self._info = self._read_info()
        return self._info

    def record(self) -> dict:
        """The record that goes with every result."""
        record = asdict(self.info)
        record["compute_capability"] = list(self.info.compute_capability or ()) or None
        record["libraries"] = library_versions()
        record.update({f"peak_{k}": v for k, v in peaks(record).items()})
        record["l2_flush_bytes"] = self.flush_bytes
        return record

    @property
    def flush_bytes(self) -> int:
        """Twice the card's L2, or Triton's 256 MiB where the L2's size is unknown."""
        return 2 * self.info.l2_bytes if self.info.l2_bytes else 256 << 20

    def host_clock(self) -> float:
        return self.clock()

    def flush_l2(self) -> None:
        """Write every word of a buffer twice the L2's size, so the next run finds nothing
        of the last one's in the cache (the value changes each time: nothing skips it)."""
        if self._flush is None:
            self._flush = self.empty(self.flush_bytes // 4, np.uint32)
        self.flushes += 1
        self._write(self._flush, self.flushes)


class CupyDevice(Device):
    """CuPy's device: CuPy arrays, CuPy's events on the current stream. ``cp`` is CuPy or its
    stand-in (``course.gpu_stand_in.StandIn.cupy``)."""

    def __init__(self, cp=None):
        super().__init__()
        if cp is None:
            import cupy as cp
        self.xp = self.cp = cp
        self.stand_in = getattr(cp, "STAND_IN", None)
        if self.stand_in is not None:
            self.clock, self.torch_device = self.stand_in.clock, "cpu"

    def _read_info(self) -> DeviceInfo:
        runtime = self.cp.cuda.runtime
        index = self.cp.cuda.Device().id
        props = runtime.getDeviceProperties(index)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])

        def attribute(code):  # cudaDevAttr*: CUDA 13's cudaDeviceProp has no clock fields
            try:
                return int(runtime.deviceGetAttribute(code, index))
            except Exception:  # noqa: BLE001 - unreadable: None in the record
                return None

        return DeviceInfo(name, (int(props["major"]), int(props["minor"])), attribute(16), attribute(38),
                          attribute(13), attribute(36), attribute(37), _version(runtime.driverGetVersion()),
                          _version(runtime.runtimeGetVersion()), self.stand_in is not None,
                          self.stand_in.clocks_now() if self.stand_in else _nvml_clocks(index))

    def empty(self, shape, dtype):
        return self.cp.empty(shape, dtype)

    def hashed(self, seed, shape, low=0.0, high=1.0, dtype=np.float32, stream=0):
        return hashed(self.cp, seed, shape, low, high, dtype, stream)

    def hashed_ints(self, seed, shape, bound, stream=0):
        return hashed_ints(self.cp, seed, shape, bound, stream)

    def to_host(self, a) -> np.ndarray:
        return self.cp.asnumpy(a)

    def take(self, a, positions) -> np.ndarray:
        """The values of ``a`` at flat ``positions``, on the host (only they cross the bus)."""
        return self.cp.asnumpy(a.reshape(-1)[self.cp.asarray(positions)])

    def event(self):
        return self.cp.cuda.Event()

    def elapsed_s(self, start, stop) -> float:
        stop.synchronize()
        return self.cp.cuda.get_elapsed_time(start, stop) / 1e3

    def synchronize(self) -> None:
        self.cp.cuda.Device().synchronize()

    def _write(self, buffer, value) -> None:
        buffer.fill(value)

    def streams(self):
        """``course.streams``' backend on this device."""
        from course import streams

        return streams.CupyStreams(self.cp, self.stand_in.cupyx if self.stand_in else None)

    def torch_synchronize(self) -> None:
        if self.stand_in is None:
            import torch

            torch.cuda.synchronize()


class NumbaDevice(Device):
    """numba.cuda's device: its device arrays and events, and two small kernels of its own
    (the hashed inputs, the L2 flush). ``cuda`` is ``numba.cuda`` or its stand-in
    (``course.gpu_stand_in.StandIn.numba_cuda``: the simulator with host-clock events)."""

    def __init__(self, cuda=None):
        super().__init__()
        if cuda is None:
            from numba import cuda
        self.cuda = cuda
        self.stand_in = getattr(cuda, "STAND_IN", None)
        if self.stand_in is not None:
            self.clock, self.torch_device = self.stand_in.clock, "cpu"
        self._kernels = None

    def _read_info(self) -> DeviceInfo:
        dev = self.cuda.get_current_device()
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)

        def attribute(name):
            try:
                return int(getattr(dev, name))
            except Exception:  # noqa: BLE001 - unreadable: None in the record
                return None

        def version(read):
            try:
                found = read()
                return found if isinstance(found, str) else ".".join(map(str, found))
            except Exception:  # noqa: BLE001
                return None

        return DeviceInfo(name, tuple(dev.compute_capability), attribute("MULTIPROCESSOR_COUNT"),
                          attribute("L2_CACHE_SIZE"), attribute("CLOCK_RATE"), attribute("MEMORY_CLOCK_RATE"),
                          attribute("GLOBAL_MEMORY_BUS_WIDTH"), version(self.cuda.cudadrv.driver.driver.get_version),
                          version(self.cuda.runtime.get_version), self.stand_in is not None,
                          self.stand_in.clocks_now() if self.stand_in else _nvml_clocks(getattr(dev, "id", 0)))

    def _kernel(self, name):
        if self._kernels is None:
            self._kernels = _numba_kernels(self.cuda)
        return self._kernels[name]

    def empty(self, shape, dtype):
        return self.cuda.device_array(shape, dtype)

    def hashed(self, seed, shape, low=0.0, high=1.0, dtype=np.float32, stream=0):
        out = self.cuda.device_array(shape, dtype)
        flat = out.reshape(-1) if out.ndim > 1 else out
        key = np.uint64(_fmix(np, np.asarray(_key(seed, stream)))[()])
        self._kernel("hashed")[self._blocks(flat.size), 256](flat, key, np.float64(low), np.float64(high - low))
        return out

    def to_host(self, a) -> np.ndarray:
        return a.copy_to_host()

    def take(self, a, positions) -> np.ndarray:
        return a.copy_to_host().reshape(-1)[np.asarray(positions)]

    def event(self):
        return self.cuda.event(timing=True)

    def elapsed_s(self, start, stop) -> float:
        stop.synchronize()
        return self.cuda.event_elapsed_time(start, stop) / 1e3

    def synchronize(self) -> None:
        self.cuda.synchronize()

    def _write(self, buffer, value) -> None:
        self._kernel("fill")[self._blocks(buffer.size), 256](buffer, np.uint32(value))

    def _blocks(self, size: int, threads: int = 256) -> int:
        """Grid-stride launches: enough blocks to fill a card; one in the simulator, which
        starts a Python thread per thread of every block."""
        return 1 if self.stand_in else max(1, min(4096, math.ceil(size / threads)))


class TorchDevice(Device):
    """torch's CUDA device: tensors on it, ``torch.cuda``'s events on the current stream.
    ``cuda`` is ``torch.cuda`` or its stand-in (``course.gpu_stand_in.StandIn.torch_cuda``:
    CPU tensors, events on the stand-in's clock)."""

    def __init__(self, cuda=None):
        super().__init__()
        import torch

        self.torch = self.xp = torch
        self.cuda = torch.cuda if cuda is None else cuda
        self.stand_in = getattr(self.cuda, "STAND_IN", None)
        if self.stand_in is not None:
            self.clock, self.torch_device = self.stand_in.clock, "cpu"

    def _read_info(self) -> DeviceInfo:
        index = self.cuda.current_device()
        props = self.cuda.get_device_properties(index)

        def field(name):  # not every torch has every field (the clocks came late): None in the record
            found = getattr(props, name, None)
            return int(found) if found is not None else None

        card = self.stand_in.card if self.stand_in else None
        return DeviceInfo(str(props.name), (int(props.major), int(props.minor)), field("multi_processor_count"),
                          field("L2_cache_size"), field("clock_rate"), field("memory_clock_rate"),
                          field("memory_bus_width"), card.driver if card else _cuda_driver_version(),
                          card.runtime if card else self.torch.version.cuda, card is not None,
                          self.stand_in.clocks_now() if card else _nvml_clocks(index))

    def _dtype(self, dtype):
        return dtype if isinstance(dtype, self.torch.dtype) else self.torch.from_numpy(np.empty(0, dtype)).dtype

    def empty(self, shape, dtype):
        return self.torch.empty(shape, dtype=self._dtype(dtype), device=self.torch_device)

    def hashed(self, seed, shape, low=0.0, high=1.0, dtype=np.float32, stream=0):
        """``gpu_timing.hashed``, bit for bit, made on the device in int64 arithmetic (every
        product kept below 2**63: torch's unsigned integers lack the operations)."""
        torch, size = self.torch, int(np.prod(shape))
        key = int(_fmix(np, np.asarray(_key(seed, stream)))[()])
        index = torch.arange(size, dtype=torch.int64, device=self.torch_device)
        bits = _fmix_int64((_mul32(index & _M32, _GOLDEN) + key) & _M32) >> 8
        values = bits.to(torch.float64) * 2.0 ** -24 * (high - low) + low
        return values.to(self._dtype(dtype)).reshape(shape)

    def to_host(self, a) -> np.ndarray:
        return a.detach().cpu().numpy()

    def take(self, a, positions) -> np.ndarray:
        """The values of ``a`` at flat ``positions``, on the host (only they cross the bus)."""
        where = self.torch.as_tensor(np.asarray(positions, np.int64), device=a.device)
        return a.detach().reshape(-1)[where].cpu().numpy()

    def event(self):
        return self.cuda.Event(enable_timing=True)

    def elapsed_s(self, start, stop) -> float:
        stop.synchronize()
        return start.elapsed_time(stop) / 1e3

    def synchronize(self) -> None:
        self.cuda.synchronize()

    def _write(self, buffer, value) -> None:
        buffer.view(self.torch.int32).fill_(value)  # the same bits; torch's uint32 has few kernels


# gpu_timing's hash in int64 arithmetic (torch): a 32-bit product split in 16-bit halves, so no
# intermediate passes 2**49 and nothing relies on signed overflow.
_M32, _GOLDEN, _MIX1, _MIX2 = 0xFFFFFFFF, 0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35


def _mul32(h, constant: int):
    """``(h * constant) mod 2**32`` for int64 ``h`` below 2**32."""
    return (h * (constant & 0xFFFF) + (((h * (constant >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix_int64(h):
    h = h ^ (h >> 16)
    h = _mul32(h, _MIX1)
    h = h ^ (h >> 13)
    h = _mul32(h, _MIX2)
    return h ^ (h >> 16)


def _cuda_driver_version() -> str | None:
    """The CUDA driver's version (``cuDriverGetVersion``), as ``"major.minor"``; None if unreadable."""
    try:
        import ctypes

        found = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(found)) == 0:
            return _version(found.value)
    except OSError:
        pass
    return None


def _numba_kernels(cuda) -> dict:
    """The numba kernels of :class:`NumbaDevice` (``course._gpu_kernels``): imported on first
    use, so that importing this module does not import numba.cuda (the simulator must be
    chosen before that). The simulator runs a kernel by swapping the ``numba.cuda`` its
    module holds, so they live in a module of their own, whatever ``cuda`` stands in."""
    from course import _gpu_kernels

    return {"hashed": _gpu_kernels.hashed, "fill": _gpu_kernels.fill}


def _version(encoded) -> str | None:
    """CUDA's ``1000 * major + 10 * minor`` as ``"major.minor"`` (a stand-in's words as they are)."""
    if isinstance(encoded, str):
        return encoded
    try:
        return f"{int(encoded) // 1000}.{int(encoded) % 1000 // 10}"
    except (TypeError, ValueError):
        return None


def simulated() -> bool:
    """Whether numba.cuda is (or will be) its simulator here: the CPU tier."""
    if "numba.cuda" in sys.modules:
        from numba import config

        return bool(config.ENABLE_CUDASIM)
    return os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def device(library: str, clock=None, card: DeviceInfo | None = None) -> Device:
    """The device of ``library`` (``"cupy"``, ``"numba"`` or ``"torch"``) for this call: the
    real one on the GPU tier; on the CPU tier (numba's simulator) the same class on the
    stand-ins of ``course.gpu_stand_in``, with ``clock`` (default: the host's) and ``card``."""
    if library not in ("cupy", "numba", "torch"):
        raise ValueError(f"no device for {library!r}: the GPU tier times with 'cupy', 'numba' or 'torch'")
    if not simulated() and clock is None and card is None:
        return {"cupy": CupyDevice, "numba": NumbaDevice, "torch": TorchDevice}[library]()
    from course import gpu_stand_in

    stand_in = gpu_stand_in.StandIn(clock=clock, card=card)
    if library == "cupy":
        return CupyDevice(stand_in.install_cupy())
    if library == "torch":
        return TorchDevice(stand_in.torch_cuda())
    return NumbaDevice(stand_in.numba_cuda())


def _nvml_clocks(index: int) -> dict:
    """The SM and memory clocks now (MHz), from NVML where ``pynvml`` imports and reads them."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            return {"sm_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                    "memory_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM)}
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001 - the record says why instead
        return {"unreadable": f"{type(exc).__name__}: {str(exc)[:120]}"}
