"""The devices the GPU tier times on: one class per library the labs launch with.

:class:`CupyDevice`, :class:`NumbaDevice` and :class:`TorchDevice` give a GPU-tier
harness function what it needs, whichever library launches its kernels: arrays (``xp``,
``empty``, ``hashed``, ``take``, ``to_host``), timing (``event``,
``elapsed_s``, ``synchronize``, ``host_clock``, ``flush_l2``) and the
``record`` that goes with every result (``course.gpu_timing`` says what
``bench`` does with them). On the CPU tier :func:`device` builds the same
classes on the stand-ins of ``course.gpu_stand_in``, so that their code runs
before a GPU does. What every device shares is ``course.gpu_device_base``'s;
``TorchDevice`` lives in ``course.torch_device``, so that a lab timing on torch
alone imports no numba kernels.

A module apart from ``course.gpu_timing``, which the grader imports too (its
floors, seeds and oracles' inputs): grading a lab that times nothing brings
neither these nor numba along.
"""
from __future__ import annotations

import math

import numpy as np

from course.gpu_device_base import Device, _nvml_clocks, _version, simulated  # noqa: F401  (re-exported)
from course.gpu_timing import DeviceInfo, _fmix, _key, hashed, hashed_ints
from course.torch_device import TorchDevice


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


def _numba_kernels(cuda) -> dict:
    """The numba kernels of :class:`NumbaDevice` (``course._gpu_kernels``): imported on first
    use, so that importing this module does not import numba.cuda (the simulator must be
    chosen before that). The simulator runs a kernel by swapping the ``numba.cuda`` its
    module holds, so they live in a module of their own, whatever ``cuda`` stands in."""
    from course import _gpu_kernels

    return {"hashed": _gpu_kernels.hashed, "fill": _gpu_kernels.fill}


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
        return TorchDevice(stand_in.torch_cuda())  # course.torch_device.device(), for a lab that times on torch alone
    return NumbaDevice(stand_in.numba_cuda())


