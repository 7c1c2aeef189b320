"""What every device of the GPU tier offers (``course.gpu_devices``, ``course.torch_device``):
the record, the L2 flush, the host clock, and whether this is the CPU tier's simulator.

A module of its own so that a lab timing on torch's device alone (``course.torch_device``)
bundles none of the numba kernels ``course.gpu_devices`` reaches (a Gradescope wheel holds the
course modules its lab imports).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict

import numpy as np

from course.gpu_timing import DeviceInfo, library_versions, peaks


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
