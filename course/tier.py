"""Which tier are we on: a real CUDA GPU, or the CPU with numba's CUDA simulator.

The check asks the CUDA driver directly (through ctypes) instead of importing
``numba.cuda``: the simulator has to be switched on *before* numba.cuda is first
imported, so we must know the answer before that import happens.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys

SIMULATOR_VAR = "NUMBA_ENABLE_CUDASIM"


@functools.cache
def gpu_available() -> bool:
    """True when the CUDA driver loads and reports at least one device."""
    if os.environ.get(SIMULATOR_VAR) == "1" and "numba.cuda" in sys.modules:
        return False
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            driver = ctypes.CDLL(name)
        except OSError:
            continue
        try:
            if driver.cuInit(0) != 0:
                return False
            count = ctypes.c_int(0)
            return driver.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0
        except AttributeError:
            return False
    return False


def current_tier() -> str:
    """``"gpu"`` on a machine with a CUDA device, else ``"cpu"``."""
    return "gpu" if gpu_available() else "cpu"


def use_simulator_if_no_gpu() -> str:
    """Switch numba.cuda to its simulator when there is no GPU; return the tier.

    Call this before ``from numba import cuda``. Lectures and handouts start
    with it so the same notebook runs on a laptop and on a GPU node.
    """
    tier = current_tier()
    if tier == "cpu":
        if "numba.cuda" in sys.modules and os.environ.get(SIMULATOR_VAR) != "1":
            raise RuntimeError(
                "numba.cuda was imported before the simulator was switched on; "
                "restart the kernel and call course.use_simulator_if_no_gpu() first"
            )
        os.environ[SIMULATOR_VAR] = "1"
        from course import cuda_sim

        cuda_sim.install()  # its barriers wake threads instead of polling them: several times faster
    return tier


def describe_gpu() -> str:
    """A one-line description of the device, or of the simulator."""
    if not gpu_available():
        return "CPU tier: CUDA simulator (NUMBA_ENABLE_CUDASIM=1), NumPy for CuPy"
    try:
        from numba import cuda

        dev = cuda.get_current_device()
        name = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
        return f"GPU tier: {name} (compute capability {dev.compute_capability[0]}.{dev.compute_capability[1]})"
    except Exception as exc:  # driver present but numba cannot use it
        return f"GPU tier: a CUDA device is present, but numba.cuda failed: {exc}"
