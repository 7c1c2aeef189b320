"""Lab 04 — CuPy, streams and performance engineering.

Five small pieces of GPU performance work, each written once for both tiers:

1. ``bias_gelu`` — a *fused* kernel: bias add and GELU in one pass over memory,
   as a ``cupy.ElementwiseKernel`` on a GPU (NumPy computes the same formula on
   the CPU tier);
2. ``softmax_rows`` — one function for NumPy and CuPy arrays
   (``get_array_module``), numerically stable for any input;
3. ``pipelined_apply`` — overlap host-to-device copies, compute and
   device-to-host copies with streams and pinned memory, through the small
   stream API of ``course.streams`` (on the CPU tier a recording stand-in runs
   your schedule on a model GPU, so the grader can see whether it overlaps);
4. ``to_torch`` / ``from_torch`` / ``to_numba`` — hand an array to another
   library without copying it (DLPack, ``__cuda_array_interface__``);
5. ``arithmetic_intensity`` and ``roofline`` — is a kernel memory- or
   compute-bound, and how fast can it be?

CuPy is optional: this file imports it only inside functions that receive CuPy
arrays. Run the checks with ``k2c grade 04`` (from the repository root). While
it grades, torch's own ``gelu`` and ``softmax`` are refused here: write the
formulas with the array module.
"""
import math

import numpy as np

from course import streams
from course.arrays import get_array_module

# --- 1. A fused kernel -------------------------------------------------------

_compiled_bias_gelu = None  # the ElementwiseKernel, compiled on first use


def bias_gelu_kernel():
    """The ``cupy.ElementwiseKernel`` for ``y = gelu(x + bias)``, built once and cached.

    Inputs ``x`` and ``bias`` share one type ``T`` (float or double) and
    broadcast like NumPy arrays; the output ``y`` has type ``T``. The body is
    CUDA C for *one element*; CuPy wraps it in a kernel with one thread per
    element of the output. GELU, tanh approximation::

        gelu(z) = 0.5 * z * (1 + tanh(sqrt(2 / pi) * (z + 0.044715 * z**3)))

    It holds for every input, far from 0 (``z = -1e4`` gives 0, ``1e4`` gives
    1e4), tiny or 0, and NaN stays NaN. The CPU tier builds this C for the CPU
    and runs it there at such inputs, as float and double.
    """
    global _compiled_bias_gelu
    if _compiled_bias_gelu is None:
        import cupy

        raise NotImplementedError('not implemented yet: bias_gelu_kernel: Declare the inputs, the output and a C body for one element; write every constant in type T so float inputs stay in float.')
    return _compiled_bias_gelu


def bias_gelu(x, bias):
    """``gelu(x + bias)``, tanh approximation, with ``bias`` broadcast along the last axis.

    CuPy arrays: one launch of :func:`bias_gelu_kernel` (read ``x`` once, write
    the result once). NumPy arrays: the same formula with NumPy. The result has
    the shape and dtype of ``x`` (``bias`` is cast to ``x.dtype``).
    """
    xp = get_array_module(x)
    raise NotImplementedError('not implemented yet: bias_gelu: CuPy arrays go to the kernel; NumPy ones get the same formula, with plain Python constants so a float32 input stays float32.')


# --- 2. A backend-generic, stable softmax ------------------------------------

def softmax_rows(x):
    """Softmax along the last axis: ``exp(x[..., j]) / sum_k exp(x[..., k])``.

    Works on NumPy and CuPy arrays alike (returns the same kind and dtype as
    ``x``) and never overflows: ``x = 1e4`` gives a finite answer.
    """
    raise NotImplementedError('not implemented yet: softmax_rows: Shifting a row by a constant leaves its softmax unchanged; choose the shift that makes every exponent at most zero.')


# --- 3. Overlapping copies with compute --------------------------------------

def serial_apply(f, host_chunks, gpu=None):
    """The baseline (given): copy in, compute, copy out, wait — one chunk at a time."""
    gpu = gpu or streams.backend()
    stream = gpu.stream()
    results = []
    for chunk in host_chunks:
        staged = gpu.pinned_empty(chunk.shape, chunk.dtype)
        staged[...] = chunk
        d_result = gpu.launch(f, gpu.to_device(staged, stream), stream=stream)
        out = gpu.pinned_empty(d_result.shape, d_result.dtype)
        gpu.to_host(d_result, out, stream)
        gpu.synchronize(stream)  # nothing else is issued until this chunk is back
        results.append(out)
    return results


def pipelined_apply(f, host_chunks, n_streams=2, gpu=None):
    """``[f(chunk) for chunk in host_chunks]`` computed on the device, with the
    copies of one chunk overlapping the compute of another.

    ``f`` takes one device array and returns one (it is written with the array
    module of its argument, so it runs on CuPy and on NumPy). ``host_chunks``
    are ordinary (pageable) NumPy arrays of any shapes. Use ``n_streams``
    streams, chunk ``i`` on stream ``i % n_streams``; copy through page-locked
    buffers from ``gpu.pinned_empty``, and keep each one alive until the host
    has waited for its copy; run ``f`` with ``gpu.launch``. Return the results
    as host arrays, in order, and only once they have arrived: a device array
    (what ``gpu.launch`` returns) cannot be read on the host, so each result
    comes back with ``gpu.to_host`` into a pinned buffer.
    ``gpu`` is a backend from ``course.streams`` (default: ``streams.backend()``).
    """
    gpu = gpu or streams.backend()
    raise NotImplementedError('not implemented yet: pipelined_apply: Start from serial_apply: find the line that keeps chunk i+1 waiting on chunk i, and hand the chunks to the streams in turn.')


# --- 4. Zero-copy exchange ---------------------------------------------------

def to_torch(array):
    """A ``torch.Tensor`` that shares memory with ``array`` (NumPy on the CPU,
    CuPy on the GPU): writing through one is visible through the other."""
    import torch

    raise NotImplementedError('not implemented yet: to_torch: Use DLPack, the exchange protocol torch can wrap without copying.')


def from_torch(tensor):
    """The array sharing memory with ``tensor``: NumPy for a CPU tensor, CuPy for a CUDA one."""
    raise NotImplementedError('not implemented yet: from_torch: The same protocol the other way, choosing NumPy or CuPy by the device the tensor lives on.')


def to_numba(array):
    """A ``numba.cuda`` device array sharing memory with the CuPy ``array`` (GPU only)."""
    from numba import cuda

    raise NotImplementedError('not implemented yet: to_numba: numba.cuda can wrap any object that exposes the CUDA array interface.')


# --- 5. The roofline -----------------------------------------------------------

def arithmetic_intensity(flops, bytes_moved):
    """Floating-point operations per byte moved to or from device memory."""
    raise NotImplementedError('not implemented yet: arithmetic_intensity: Work per unit of traffic.')


def roofline(flops, bytes_moved, peak_flops, peak_bandwidth):
    """Where a kernel sits on the roofline of a device.

    Returns ``(attainable, bound)``: the best FLOP/s the kernel can reach,
    ``min(peak_flops, I * peak_bandwidth)`` with ``I`` its arithmetic intensity,
    and ``"memory-bound"`` or ``"compute-bound"``. Peaks are in FLOP/s and
    bytes/s. A kernel exactly at the ridge point counts as compute-bound.
    """
    raise NotImplementedError('not implemented yet: roofline: the two roofs meet at the ridge point, in flop per byte: which side of it is the kernel?')
