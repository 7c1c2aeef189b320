"""The array module for this tier: CuPy on a GPU, NumPy standing in on the CPU."""
from __future__ import annotations

import types

from course.tier import gpu_available


def array_module() -> types.ModuleType:
    """``cupy`` when a GPU and CuPy are both usable, else ``numpy``."""
    if gpu_available():
        try:
            import cupy

            if cupy.is_available():
                return cupy
        except ImportError:
            pass
    import numpy

    return numpy
