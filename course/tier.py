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
DRIVERS = ("libcuda.so.1", "libcuda.so", "nvcuda.dll")


@functools.cache
def gpu_available() -> bool:
    """True when the CUDA driver loads and reports at least one device (``cuda_devices``)."""
    return bool(cuda_devices()[0])


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


def cuda_devices() -> tuple[list[str], str]:
    """The CUDA devices this process may use, by the driver's names for them
    (``CUDA_VISIBLE_DEVICES`` applies, as to any CUDA program: on SLURM, the GPUs
    the job was granted), or no names and why there are none, in words."""
    if os.environ.get(SIMULATOR_VAR) == "1" and "numba.cuda" in sys.modules:
        return [], "numba's CUDA simulator is on in this process"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    for name in DRIVERS:
        try:
            driver = ctypes.CDLL(name)
        except OSError:
            continue
        try:
            status = driver.cuInit(0)
            if status != 0:
                return [], f"the CUDA driver did not start: {_cuda_error(driver, status)}{shown}"
            count = ctypes.c_int(0)
            status = driver.cuDeviceGetCount(ctypes.byref(count))
            if status != 0 or count.value <= 0:
                return [], f"the CUDA driver sees no device{shown}"
            names = []
            for ordinal in range(count.value):
                device, text = ctypes.c_int(0), ctypes.create_string_buffer(256)
                ok = driver.cuDeviceGet(ctypes.byref(device), ordinal) == 0 and \
                    driver.cuDeviceGetName(text, len(text), device) == 0
                names.append(text.value.decode(errors="replace") if ok and text.value else f"CUDA device {ordinal}")
            return names, ""
        except AttributeError:
            return [], f"{name} is not a CUDA driver"
    return [], "no CUDA driver: libcuda.so.1 is not installed"


def _cuda_error(driver, status: int) -> str:
    """The driver's words for a CUresult (cuGetErrorString works before cuInit)."""
    text = ctypes.c_char_p()
    try:
        if driver.cuGetErrorString(status, ctypes.byref(text)) == 0 and text.value:
            return f"{text.value.decode(errors='replace')} (error {status})"
    except AttributeError:
        pass
    return f"error {status}"


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


_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 75, 76


def device_identity(driver=None) -> dict | None:
    """The first CUDA device as the driver names it, without any library of the course:
    ``{"name": "Tesla T4", "cc": (7, 5), "driver": "13.0"}``, or None with no usable
    driver or device. ``driver``: a loaded ``libcuda`` (tests pass a stand-in)."""
    if driver is None:
        for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
            try:
                driver = ctypes.CDLL(name)
                break
            except OSError:
                continue
        else:
            return None
    try:
        device, major, minor, version = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
        name = ctypes.create_string_buffer(256)
        if (driver.cuInit(0) != 0 or driver.cuDeviceGet(ctypes.byref(device), 0) != 0
                or driver.cuDeviceGetName(name, 256, device) != 0
                or driver.cuDeviceGetAttribute(ctypes.byref(major), _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                                               device) != 0
                or driver.cuDeviceGetAttribute(ctypes.byref(minor), _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                                               device) != 0):
            return None
        driver_version = (f"{version.value // 1000}.{version.value % 1000 // 10}"
                          if driver.cuDriverGetVersion(ctypes.byref(version)) == 0 else "?")
    except AttributeError:
        return None
    return {"name": name.value.decode(errors="replace"), "cc": (major.value, minor.value), "driver": driver_version}
