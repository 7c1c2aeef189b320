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


def get_array_module(*arrays) -> types.ModuleType:
    """The module that owns ``arrays``: ``cupy`` for CuPy arrays, ``numpy`` for anything else.

    It is ``cupy.get_array_module`` when CuPy imports; without CuPy nothing can
    be a CuPy array, so the answer is NumPy. Code that calls ``xp =
    get_array_module(x)`` and then only ``xp.exp``, ``xp.sum``… runs on both.
    """
    try:
        import cupy
    except ImportError:
        import numpy

        return numpy
    return cupy.get_array_module(*arrays)
