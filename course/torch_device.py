"""torch's CUDA device for the GPU tier's timing: ``course.gpu_devices``' interface on torch
tensors and ``torch.cuda``'s events (lab 12 times blockwise attention against SDPA on it).

A module of its own, beside ``course.gpu_devices``, so that a lab that times on torch alone
bundles neither numba nor its kernels.
"""
from __future__ import annotations

import numpy as np

from course.gpu_device_base import Device, _nvml_clocks, _version, simulated
from course import gpu_timing
from course.gpu_timing import DeviceInfo, _fmix, _key


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
_M32, _GOLDEN, _MIX1, _MIX2 = (int(c) for c in (gpu_timing._M32, gpu_timing._GOLDEN, gpu_timing._MIX1, gpu_timing._MIX2))


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


def device(clock=None, card: DeviceInfo | None = None) -> TorchDevice:
    """torch's device for this call: the real one on the GPU tier; on the CPU tier (numba's
    simulator) the same class on ``course.gpu_stand_in``'s stand-in of ``torch.cuda``, with
    ``clock`` (default: the host's) and ``card``."""
    if not simulated() and clock is None and card is None:
        return TorchDevice()
    from course import gpu_stand_in

    return TorchDevice(gpu_stand_in.StandIn(clock=clock, card=card).torch_cuda())
