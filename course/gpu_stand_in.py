"""Stand-ins for the CUDA calls of the GPU tier, so that its code runs on the CPU tier.

The GPU tier's harness functions and ``course.gpu_devices`` are written against
CuPy, numba.cuda and torch's CUDA calls. On a machine without a GPU they would
meet their first ``AttributeError`` on the first GPU run. A dry run instead runs
the same code on these stand-ins, at tiny sizes:

- :func:`StandIn.install_cupy`: a ``cupy`` made of NumPy, installed in
  ``sys.modules`` for the rest of the (forked, one-call) process, so that the
  student's CuPy path runs too. It offers only names CuPy has
  (:data:`CUPY_NAMES`, and ``cuda``: ``Event``, ``Stream``, ``Device``,
  ``get_elapsed_time``, ``runtime``'s attributes and versions). Its arrays are
  NumPy arrays with CuPy's ``get``, ``set``, ``data.ptr`` and CUDA array
  interface; its ``ElementwiseKernel`` builds the kernel's C for the host
  (``course.gpu_compile``) and runs it;
- :func:`StandIn.numba_cuda`: numba's simulator with the calls it lacks
  (``event_elapsed_time``, the device's attributes, the driver's and runtime's
  versions; ``as_cuda_array`` is added to the simulator module itself);
- :func:`StandIn.torch_cuda`: the ``torch.cuda`` calls the GPU tier times with
  (``Event``, ``synchronize``, ``current_device``, ``get_device_properties``),
  for torch's tensors on the CPU;
- events on an injectable clock (the host's, or a test's) and a small stand-in
  card (:data:`STAND_IN_CARD`), whose record says ``stand_in: true``.

Nothing timed on a stand-in says anything about a GPU: the grader awards nothing
for it (``autograder.grading.timed``).
"""
from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
import types

import numpy as np

from course.gpu_timing import DeviceInfo

# A card small enough that flushing its L2 costs the simulator little; its peaks (128 GB/s,
# 512 GFLOP/s FP32) are far above anything the simulator reaches, so no floor refuses a dry run.
STAND_IN_CARD = DeviceInfo("stand-in device (CPU tier dry run: nothing here ran on a GPU)", (9, 0),
                           multiprocessors=2, l2_bytes=32 << 10, sm_clock_max_khz=1_000_000,
                           memory_clock_max_khz=1_000_000, memory_bus_bits=512, driver="stand-in",
                           runtime="stand-in", stand_in=True)

# NumPy's functions the stand-in CuPy offers: each is a name of CuPy's top-level module too
# (tests/test_gpu_timing.py holds them to a real CuPy where one imports).
CUPY_NAMES = ("float16", "float32", "float64", "int32", "int64", "uint32", "uint64", "bool_", "ndarray",
              "asarray", "array", "empty", "empty_like", "zeros", "zeros_like", "ones", "full", "arange",
              "copyto", "matmul", "bincount", "allclose", "abs", "tanh", "exp", "sqrt", "sum", "multiply", "add",
              "remainder", "maximum", "isnan", "where", "concatenate")
# cudaDevAttr* codes CupyDevice reads: SMs, L2 bytes, SM clock (kHz), memory clock (kHz), bus width.
ATTRIBUTES = {16: "multiprocessors", 38: "l2_bytes", 13: "sm_clock_max_khz", 36: "memory_clock_max_khz",
              37: "memory_bus_bits"}


class StandIn:
    """One stand-in device: its card, its clock, and the stand-in modules built on them."""

    def __init__(self, clock=None, card: DeviceInfo | None = None):
        self.clock = clock or time.perf_counter
        self.card = dataclasses.replace(card or STAND_IN_CARD, stand_in=True)
        self.cupyx = types.SimpleNamespace(empty_pinned=lambda shape, dtype=np.float64: np.empty(shape, dtype))

    def clocks_now(self) -> dict:
        return {"unreadable": "a stand-in device has no clocks"}

    # -- CuPy ---------------------------------------------------------------------

    def cupy(self) -> types.ModuleType:
        """A ``cupy`` module made of NumPy and this device's events (not installed)."""
        return _fake_cupy(self)

    def install_cupy(self) -> types.ModuleType:
        """:meth:`cupy`, installed as ``cupy`` and ``cupyx`` in ``sys.modules``: for a
        dry run's one-call process, where the student's ``import cupy`` must find it."""
        module = self.cupy()
        sys.modules["cupy"] = module
        sys.modules["cupyx"] = types.ModuleType("cupyx")
        sys.modules["cupyx"].empty_pinned = self.cupyx.empty_pinned
        self._complete_simulator()  # CuPy arrays go to numba too (to_numba)
        return module

    # -- numba.cuda -----------------------------------------------------------------

    def numba_cuda(self):
        """numba's simulator (numba.cuda with ``NUMBA_ENABLE_CUDASIM=1``) with this device's
        events, attributes and versions; ``as_cuda_array`` added to the simulator."""
        from numba import cuda

        self._complete_simulator()
        return _FakeNumbaCuda(self, cuda)

    # -- torch.cuda -----------------------------------------------------------------

    def torch_cuda(self) -> types.SimpleNamespace:
        """What ``course.torch_device.TorchDevice`` calls of ``torch.cuda``, for CPU tensors:
        this device's events, its card's properties under torch's names."""
        card = self.card
        props = types.SimpleNamespace(
            name=card.name, major=card.compute_capability[0], minor=card.compute_capability[1],
            multi_processor_count=card.multiprocessors, L2_cache_size=card.l2_bytes, clock_rate=card.sm_clock_max_khz,
            memory_clock_rate=card.memory_clock_max_khz, memory_bus_width=card.memory_bus_bits,
            total_memory=1 << 30)

        def properties(device=None):
            return props

        return types.SimpleNamespace(
            STAND_IN=self, current_device=lambda: 0, get_device_properties=properties,
            synchronize=lambda device=None: None,
            get_device_name=lambda device=None: card.name, is_available=lambda: True,
            Event=lambda enable_timing=False, blocking=False, interprocess=False: _Event(self.clock))

    @staticmethod
    def _complete_simulator() -> None:
        """numba's simulator lacks ``as_cuda_array``: wrap the array's memory, as numba wraps
        a CuPy array's (the stand-in CuPy's arrays are host memory)."""
        from numba import config, cuda

        if config.ENABLE_CUDASIM and not hasattr(cuda, "as_cuda_array"):
            from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

            cuda.as_cuda_array = lambda obj, sync=True: FakeCUDAArray(np.asarray(obj))
            cuda.is_cuda_array = lambda obj: hasattr(obj, "__cuda_array_interface__")


class _Event:
    """An event that reads the stand-in's clock when recorded: work on a stand-in runs
    when it is called, so the clock between two records is the work's time."""

    def __init__(self, clock, *args, **kwargs):
        self._clock, self.time = clock, None

    def record(self, stream=None):
        self.time = self._clock()

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def elapsed_time(self, end) -> float:  # torch's: milliseconds from this event to ``end``
        return _elapsed_ms(self, end)


def _elapsed_ms(start: _Event, stop: _Event) -> float:
    if start.time is None or stop.time is None:
        raise RuntimeError("an event was never recorded (CUDA: cudaErrorInvalidResourceHandle)")
    return (stop.time - start.time) * 1e3


# -- CuPy ---------------------------------------------------------------------------

class FakeDeviceArray(np.ndarray):
    """A NumPy array with what CuPy's arrays have and NumPy's lack."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])

    @property
    def __cuda_array_interface__(self):
        interface = self.__array_interface__
        return {"shape": interface["shape"], "typestr": interface["typestr"], "data": interface["data"],
                "strides": interface["strides"], "version": 3, "stream": None}

    def get(self, stream=None, out=None, blocking=True):
        return _asnumpy(self, stream, out)

    def set(self, arr, stream=None):
        self[...] = arr


def _device(value):
    """A result made by the stand-in CuPy, as a device array (scalars stay scalars)."""
    return value.view(FakeDeviceArray) if isinstance(value, np.ndarray) and value.ndim else value


def _asnumpy(a, stream=None, out=None, blocking=True):
    if out is not None:
        out[...] = np.asarray(a)
        return out
    return np.array(a)


def _fake_cupy(stand_in: StandIn) -> types.ModuleType:
    cp = types.ModuleType("cupy")
    cp.STAND_IN = stand_in
    for name in CUPY_NAMES:
        member = getattr(np, name)
        if callable(member) and not isinstance(member, type):
            def wrapped(*args, _numpy=member, **kwargs):
                return _device(_numpy(*args, **kwargs))
            wrapped.__name__ = name
            member = wrapped
        setattr(cp, name, member)
    cp.ndarray = np.ndarray  # a host array stands for a device array
    # A host array given to CuPy is copied to the device; a device array stays itself.
    cp.asarray = lambda a, dtype=None: (a.astype(dtype, copy=False) if dtype else a) \
        if isinstance(a, FakeDeviceArray) else _device(np.array(a, dtype=dtype))
    cp.asnumpy = _asnumpy
    cp.is_available = lambda: True
    cp.get_array_module = lambda *arrays: cp if any(isinstance(a, FakeDeviceArray) for a in arrays) else np
    cp.from_dlpack = lambda obj: _device(np.from_dlpack(obj))
    cp.ElementwiseKernel = _ElementwiseKernel
    card = stand_in.card

    class Device:
        def __init__(self, device=None):
            self.id = 0 if device is None else int(device)

        def synchronize(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Stream(Device):
        def __init__(self, null=False, non_blocking=False, ptds=False):
            self.id, self.ptr = 0, 0

        def wait_event(self, event):
            pass

    def device_properties(index):
        return {"name": card.name.encode(), "major": card.compute_capability[0],
                "minor": card.compute_capability[1], "multiProcessorCount": card.multiprocessors,
                "l2CacheSize": card.l2_bytes, "totalGlobalMem": 1 << 30}

    def attribute(code, index):
        if code not in ATTRIBUTES:
            raise ValueError(f"the stand-in CuPy reads no device attribute {code} (cudaErrorInvalidValue)")
        return getattr(card, ATTRIBUTES[code])

    runtime = types.SimpleNamespace(getDeviceProperties=device_properties, deviceGetAttribute=attribute,
                                    driverGetVersion=lambda: card.driver, runtimeGetVersion=lambda: card.runtime)
    cp.cuda = types.SimpleNamespace(
        Device=Device, Stream=Stream, runtime=runtime, get_elapsed_time=_elapsed_ms,
        Event=lambda block=False, disable_timing=False, interprocess=False: _Event(stand_in.clock))
    return cp


class _ElementwiseKernel:
    """``cupy.ElementwiseKernel``, its C built for the host with a C++ compiler (one build
    per type: float, double) and run on NumPy arrays (``course.gpu_compile``)."""

    def __init__(self, in_params, out_params, operation, name="kernel", preamble="", **kwargs):
        self.kernel = {"kind": "elementwise", "in_params": in_params, "out_params": out_params,
                       "operation": operation, "name": name, "preamble": preamble}
        self._libraries = {}

    def __call__(self, *args, size=None, **kwargs):
        from course import gpu_compile

        n_in = len(gpu_compile._params(self.kernel["in_params"]))
        inputs, given = args[:n_in], args[n_in:]
        arrays = [a for a in inputs if isinstance(a, np.ndarray)]
        placeholder = "double" if arrays and arrays[0].dtype == np.float64 else "float"
        if placeholder not in self._libraries:
            why = gpu_compile.host_unavailable()
            if why:
                raise RuntimeError(f"the stand-in CuPy cannot run {self.kernel['name']}: {why}")
            built = gpu_compile.build_on_host(
                {placeholder: gpu_compile.elementwise_source(self.kernel, placeholder)}, tempfile.mkdtemp())
            if not built[placeholder]["ok"]:
                raise RuntimeError(f"{self.kernel['name']} does not build for the host: {built[placeholder]['error']}")
            self._libraries[placeholder] = built[placeholder]["library"]
        outputs = gpu_compile.run_elementwise_on_host(self.kernel, self._libraries[placeholder], placeholder,
                                                      [np.asarray(a) if isinstance(a, np.ndarray) else a
                                                       for a in inputs])
        for out, result in zip(given, outputs):
            out[...] = result
        results = [_device(r) for r in (given or outputs)]
        return results[0] if len(results) == 1 else tuple(results)


# -- numba.cuda -----------------------------------------------------------------------

class _FakeNumbaDevice:
    """The simulator's device with a card's attributes, under numba's names."""

    def __init__(self, card: DeviceInfo):
        self.name, self.id = card.name.encode(), 0
        self.compute_capability = card.compute_capability
        self.MULTIPROCESSOR_COUNT, self.L2_CACHE_SIZE = card.multiprocessors, card.l2_bytes
        self.CLOCK_RATE, self.MEMORY_CLOCK_RATE = card.sm_clock_max_khz, card.memory_clock_max_khz
        self.GLOBAL_MEMORY_BUS_WIDTH = card.memory_bus_bits


class _FakeNumbaCuda:
    """numba.cuda as the simulator has it, and what the simulator lacks from the stand-in."""

    def __init__(self, stand_in: StandIn, simulator):
        self.STAND_IN, self._simulator = stand_in, simulator
        card = stand_in.card
        self.cudadrv = types.SimpleNamespace(driver=types.SimpleNamespace(
            driver=types.SimpleNamespace(get_version=lambda: card.driver)))
        self.runtime = types.SimpleNamespace(get_version=lambda: card.runtime)

    def __getattr__(self, name):
        return getattr(self._simulator, name)

    def event(self, timing=True):
        return _Event(self.STAND_IN.clock)

    def event_elapsed_time(self, start, stop):
        return _elapsed_ms(start, stop)

    def get_current_device(self):
        return _FakeNumbaDevice(self.STAND_IN.card)
