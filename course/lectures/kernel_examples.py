"""What lectures 02 and 04 use to see a kernel as a GPU runs it, from a notebook that runs numba's simulator.

- ``ptx``: the PTX that numba's CUDA compiler makes of kernels given as source
  text, compiled in a process of its own with the simulator off (the same
  compile step as ``course.gpu_compile``, which the grader runs; no GPU needed);
- ``float_instructions``: which floating-point arithmetic instructions that PTX
  holds (``fma.rn.f32``, ``add.f64``, ...), and so how many flops an element costs;
- ``fma_float32``: ``a * x + y`` in float32 rounded once, as a GPU's fused
  multiply-add rounds it, computed exactly with fractions: the simulator, which
  runs the kernel's Python with NumPy, rounds the product and then the sum.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from fractions import Fraction

import numpy as np

_COMPILE = r'''
import json, sys
from course import gpu_compile, numba_internals
request = json.loads(sys.stdin.read())
why = gpu_compile.unavailable()
if why:
    print(json.dumps({"unavailable": why}))
    raise SystemExit
cc = tuple(request["cc"])
found = {}
for name, (source, signature) in request["kernels"].items():
    namespace = {}
    exec(request["prelude"] + source, namespace)
    kernel = namespace[name]
    library = numba_internals.lower_kernel(getattr(kernel, "py_func", kernel), signature, cc)
    found[name] = numba_internals.ptx_for(library, cc)
print(json.dumps(found))
'''
_PRELUDE = "import math\nimport numpy as np\nfrom numba import cuda, float32, float64, int32, int64\n"


def ptx(kernels: dict, cc=(9, 0), header: str = "") -> dict:
    """``{name: PTX}`` for each of ``kernels``, ``{name: (source, signature)}``, compiled
    for ``cc`` (default sm_90: H100, H200) in one process with the simulator off; or
    ``{"unavailable": why}`` where kernels cannot be compiled here (no CUDA compiler,
    not Linux). ``header`` runs before each source (constants the kernels use)."""
    import course

    package_root = os.path.dirname(os.path.dirname(os.path.abspath(course.__file__)))  # where `course` is imported from
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0",
               PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    request = {"kernels": kernels, "cc": list(cc), "prelude": _PRELUDE + header + "\n"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], input=json.dumps(request), env=env,
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"compiling failed: {done.stderr.strip()[-1500:]}")
    return json.loads(done.stdout.splitlines()[-1])


# An arithmetic instruction on floats, with its rounding and type: add.f32, fma.rn.f32, ex2.approx.ftz.f32 ...
_FLOAT_OP = re.compile(r"^\s*(?:@!?%\w+\s+)?((?:add|sub|mul|fma|div|min|max|neg|abs|sqrt|rcp|ex2|lg2)(?:\.\w+)*?\.f(?:32|64))\s",
                       re.M)


def float_instructions(ptx_text: str) -> Counter:
    """How often each floating-point arithmetic instruction occurs in ``ptx_text``:
    ``Counter({"fma.rn.f32": 1, "add.f32": 1})``. Conversions, loads and stores are not
    arithmetic and are not counted (``cvt.f64.f32`` shows in the PTX, not here)."""
    return Counter(_FLOAT_OP.findall(ptx_text))


def flops(ptx_text: str) -> int:
    """Floating-point operations per pass through the PTX: a fused multiply-add counts two."""
    return sum(count * (2 if op.startswith("fma") else 1) for op, count in float_instructions(ptx_text).items())


def _round_to_float32(exact: Fraction) -> np.float32:
    """The float32 nearest ``exact``, ties to an even last bit (IEEE round-to-nearest)."""
    near = np.float32(float(exact))  # within one float32 step of the answer: try it and its neighbours
    candidates = [np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))]
    return min(candidates, key=lambda c: (abs(Fraction(float(c)) - exact), int(np.float32(c).view(np.uint32)) & 1))


def fma_float32(a, x, y) -> np.ndarray:
    """``a * x + y`` for float32 arrays (they broadcast), rounded once to float32 from
    the exact value, as the ``fma.rn.f32`` instruction does: exact arithmetic in
    ``fractions.Fraction``, so the result depends on no hardware's multiply-add."""
    a, x, y = np.broadcast_arrays(*(np.asarray(v, dtype=np.float32) for v in (a, x, y)))
    exact = (Fraction(float(p)) * Fraction(float(q)) + Fraction(float(s)) for p, q, s in zip(a.flat, x.flat, y.flat))
    return np.array([_round_to_float32(e) for e in exact], dtype=np.float32).reshape(a.shape)
