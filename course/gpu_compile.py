"""Compile numba kernels for real GPUs on a machine without one.

numba's CUDA simulator runs a kernel as Python, so lists, ``np.zeros``, plain
Python helpers and shared arrays of a size known only at run time all "work"
there and fail on a device. This module compiles each kernel with numba-cuda's
real compiler (NVVM, from PyPI's CUDA 13.0 wheels) for every architecture the
course supports (``ARCHITECTURES``: T4's sm_75 to RTX 50xx's sm_120), then
assembles the PTX with ``ptxas -v`` for what the hardware will see: registers
per thread, shared memory per block, bytes spilled to local memory. No GPU and
no driver are needed; it must run in a process where the simulator is off
(``NUMBA_ENABLE_CUDASIM`` is read when ``numba.cuda`` is first imported).

    from course import gpu_compile
    gpu_compile.compile_for_targets(saxpy_kernel, "void(float32[:], float32, float32[:], float32[:])")
    # {"sm_75": {"ok": True, "registers": 10, "shared_bytes": 0, "spill_bytes": 0, ...}, ..., "sm_120": {...}}

A kernel is typed and lowered once, then NVVM compiles it for each target and
ptxas assembles every target at once. Compiling without a device replaces
numba-cuda's device lookups and relies on its lowering step: those internals
live in ``course.numba_internals``, pinned to the version they were written for,
and ``unavailable()`` says so on any other.

CuPy's kernels are CUDA C: ``capture_cupy_kernels`` records them without CuPy,
``elementwise_source`` writes the loop an ``ElementwiseKernel`` stands for, and
``compile_cuda_c_for_targets`` compiles it with NVRTC. ``build_on_host`` builds that same
loop for the CPU with a C++ compiler and ``run_elementwise_on_host`` runs it on
NumPy arrays, so its arithmetic can be checked with no GPU; what only a GPU has
(warp functions, atomics, shared memory) does not build there (``HOST_PRELUDE``).
"""
from __future__ import annotations

import functools
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from course import numba_internals


@dataclass(frozen=True)
class Architecture:
    """A GPU architecture a course meets: its compute capability, the cards that have
    it and where students find them. ``left_out`` says why the compile checks do not
    build for it ("" when they do)."""
    cc: tuple[int, int]
    cards: str
    where: str
    left_out: str = ""

    @property
    def sm(self) -> str:
        return sm(self.cc)


def sm(cc) -> str:
    """``(8, 6)`` -> ``"sm_86"``."""
    return f"sm_{cc[0]}{cc[1]}"


_BELOW_FLOOR = "below the course's floor: CUDA 13 dropped Maxwell, Pascal and Volta"
# The one list of the GPUs the course supports. Every compile check builds for each
# architecture without a ``left_out`` reason (``TARGETS``); docs/gpus.md shows the table
# (scripts/compile_matrix.py writes it from this list; a test checks it is current).
ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture((6, 0), "P100", "Kaggle", _BELOW_FLOOR + (
        "; on Kaggle's P100 today's torch allocates, then every operation fails (cudaErrorNoKernelImageForDevice)")),
    Architecture((7, 0), "V100", "older clusters, AWS p3", _BELOW_FLOOR),
    Architecture((7, 5), "T4", "Colab's free tier, Kaggle, AWS g4dn, GCP"),
    Architecture((8, 0), "A100", "clusters, AWS p4d, GCP a2, Colab's paid tiers"),
    Architecture((8, 6), "A10G, RTX 30xx, RTX A6000", "AWS g5, desktops and laptops"),
    Architecture((8, 9), "L4, L40S, RTX 40xx", "GCP g2, Colab's paid tiers, AWS g6, desktops"),
    Architecture((9, 0), "H100, H200", "clusters, cloud GPU instances"),
    Architecture((10, 0), "B200", "new clusters, cloud GPU instances"),
    Architecture((11, 0), "Jetson AGX Thor", "robotics labs"),
    Architecture((12, 0), "RTX 50xx, RTX Pro 6000", "desktops, Kaggle"),
)
TARGETS = tuple(a.cc for a in ARCHITECTURES if not a.left_out)
WRITTEN_FOR = numba_internals.WRITTEN_FOR  # numba-cuda
INSTALL = ("pip install 'numba-cuda==0.30.4' 'cuda-bindings>=13.0.3,<14' 'nvidia-cuda-nvcc==13.0.88' "
           "'nvidia-nvvm==13.0.88' 'nvidia-cuda-nvrtc==13.0.88' 'nvidia-cuda-runtime==13.0.96'")


def _not_linux() -> str:
    """Why this platform has no CUDA compilers ("" on Linux): their wheels are Linux-only
    (pyproject.toml's markers), so off Linux the compile checks skip with this reason."""
    import sys

    if sys.platform.startswith("linux"):
        return ""
    return (f"the CUDA compilers (NVVM, ptxas, NVRTC) come as Linux wheels only, and this is {sys.platform}: "
            "the kernels still run in numba's simulator, and a Linux machine grades the compile checks")


def ptxas() -> str | None:
    """``ptxas`` from the ``nvidia-cuda-nvcc`` wheel (``nvidia/cu13/bin``), else from PATH."""
    try:
        import nvidia.cu13 as cuda_13

        for folder in cuda_13.__path__:
            candidate = os.path.join(folder, "bin", "ptxas")
            if os.path.exists(candidate):
                return candidate
    except ImportError:
        pass
    import shutil

    return shutil.which("ptxas")


def unavailable() -> str:
    """Why kernels cannot be compiled here ("" when they can)."""
    from importlib import metadata

    from numba import config

    if _not_linux():
        return _not_linux()
    if config.ENABLE_CUDASIM:
        return "numba's CUDA simulator is on in this process; compile in a process of its own (NUMBA_ENABLE_CUDASIM=0)"
    try:
        version = metadata.version("numba-cuda")
    except metadata.PackageNotFoundError:
        return f"numba-cuda is not installed ({INSTALL})"
    if version != WRITTEN_FOR:
        return f"the compile step was written for numba-cuda {WRITTEN_FOR}, and this is {version}"
    try:
        from numba.cuda.cudadrv import nvvm

        nvvm.NVVM()
    except Exception as exc:  # noqa: BLE001 - whatever stops NVVM loading is the reason
        return f"no CUDA compiler (NVVM) here: {str(exc).strip().splitlines()[0]}; install it with {INSTALL}"
    if not ptxas():
        return f"no ptxas here; install it with {INSTALL}"
    return _gaps_reason()


def _gaps_reason() -> str:
    gaps = compiler_gaps()
    if not gaps:
        return ""
    return ("the CUDA compilers here cannot build " + "; ".join(f"{sm(cc)} ({why})" for cc, why in gaps.items())
            + f", which the compile checks target: install the pinned ones ({INSTALL})")


@functools.cache
def _ptxas_architectures() -> frozenset[str]:
    """The ``sm_XX`` values this ptxas accepts for ``-arch`` (from its ``--help``)."""
    done = subprocess.run([ptxas(), "--help"], capture_output=True, text=True, timeout=60)
    allowed = done.stdout.split("--gpu-name", 1)[-1].split("Default value", 1)[0]
    return frozenset(re.findall(r"'(sm_\d+)'", allowed))


@functools.cache
def nvrtc_architectures() -> frozenset[int]:
    """The architectures this NVRTC compiles for (``nvrtcGetSupportedArchs``, e.g. 75, 80)."""
    from cuda.bindings import nvrtc

    status, archs = nvrtc.nvrtcGetSupportedArchs()
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"nvrtcGetSupportedArchs failed: {status}")
    return frozenset(archs)


def compiler_gaps(targets=None) -> dict:
    """``{cc: why}`` for each of ``targets`` (default ``TARGETS``) that the compilers here
    cannot build: ptxas does not know it, or NVRTC does not (numba-cuda then compiles
    for the closest architecture NVRTC knows instead, silently). {} with the pinned ones."""
    gaps = {}
    for cc in targets if targets is not None else TARGETS:
        missing = [name for name, knows in (("ptxas", sm(cc) in _ptxas_architectures()),
                                            ("NVRTC", cc[0] * 10 + cc[1] in nvrtc_architectures())) if not knows]
        if missing:
            gaps[tuple(cc)] = f"{' and '.join(missing)} here {'do' if len(missing) > 1 else 'does'} not know it"
    return gaps


_RESOURCES = {"registers": r"Used (\d+) registers", "shared_bytes": r"(\d+) bytes smem",
              "spill_bytes": r"(\d+) bytes spill stores", "stack_bytes": r"(\d+) bytes stack frame"}


def resources(ptx: str, cc) -> dict:
    """``ptxas -v`` on ``ptx`` for ``cc``: registers, shared memory, spills and stack of its kernel."""
    found = resources_for_targets({tuple(cc): ptx})[tuple(cc)]
    if isinstance(found, Exception):
        raise found
    return found


def resources_for_targets(ptxes: dict) -> dict:
    """``ptxas -v`` on each ``{cc: ptx}``, all targets at once (one ptxas each):
    ``{cc: resources}``, or ``{cc: RuntimeError}`` with ptxas's words where it refused."""
    with tempfile.TemporaryDirectory(prefix="k2c-ptxas-") as folder:
        running = {}
        for cc, ptx in ptxes.items():
            source = os.path.join(folder, f"{sm(cc)}.ptx")
            with open(source, "w") as f:
                f.write(ptx)
            running[cc] = subprocess.Popen([ptxas(), "-v", f"-arch={sm(cc)}", source, "-o", os.devnull],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        found = {}
        for cc, proc in running.items():
            try:
                _, log = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                found[cc] = RuntimeError("ptxas took over 60 s")
                continue
            if proc.returncode != 0:
                found[cc] = RuntimeError(f"ptxas rejected the PTX: {log.strip()[:500]}")
                continue
            found[cc] = {key: int(match.group(1)) if (match := re.search(pattern, log)) else 0
                         for key, pattern in _RESOURCES.items()}
    return found


# The compiler's words for mistakes the simulator lets through, and what to do instead.
_ALLOCATING = r"(zeros|empty|ones|full|array|asarray|ascontiguousarray|arange|linspace|copy|\w+_like)"
_ADVICE = [
    (rf"Use of unsupported NumPy function 'numpy\.(\w+)'|Function\(<built-in function {_ALLOCATING}>\)",
     "np.{0} is not available inside a CUDA kernel: allocate arrays on the host, pass them in, and compute "
     "each element with scalar arithmetic"),
    (r"NRT required|_ol_array_allocate",
     "this creates a new array inside the kernel ({0}), which a GPU kernel cannot do: allocate it on the host "
     "and pass it in, and compute each element with scalar arithmetic"),
    (r"Untyped global name '(\w+)': Cannot determine Numba type of <class 'function'>",
     "{0} is a plain Python function: mark it @cuda.jit(device=True) to call it from a kernel"),
    (r"Unknown attribute '(append|extend|pop|insert)' of type list|Cannot type empty list|reflected list|"
     r"list\(undefined\)",
     "Python lists are not available inside a CUDA kernel: use an array passed in, or cuda.local.array "
     "with a constant size"),
    (r"Function\(<function (?:shared|local)\.array|shape must be|must be a constant",
     "cuda.shared.array and cuda.local.array need a size fixed when the kernel compiles (a module-level "
     "constant), not one computed from the arguments"),
    (r"No conversion from \w+ to none for '\$\w*return_value|must have void return type",
     "a kernel cannot return a value: write the result into an output array"),
    (r"No implementation of function Function\(<(?:built-in )?function (\w+)",
     "{0}(...) has no CUDA version for these arguments: inside a kernel, use scalar arithmetic, math functions "
     "and cuda.* calls, one element at a time"),
    (r"Untyped global name '(\w+)'",
     "{0} is a Python object the CUDA compiler cannot use inside a kernel: pass it in as an argument, or make "
     "it a module-level constant of a number"),
]


def _student_line(message: str) -> str:
    """``line N: code`` of the user's source the compiler points at (its caret), if it says."""
    found = ""
    for match in re.finditer(r'File "([^"]+)", line (\d+):\n((?:.*\n)*?)\s*\^', message):
        if "site-packages" in match.group(1):
            continue
        code = [line.strip() for line in match.group(3).splitlines() if line.strip() and "<source" not in line]
        found = f"line {match.group(2)}: {code[-1]}" if code else f"line {match.group(2)}"
    return found


def explain(message: str, source: str = "") -> str:
    """The compiler's complaint in a student's words, and the line it points at.
    ``source`` (the kernel's) names what allocated when the compiler does not."""
    where = _student_line(message)
    for pattern, advice in _ADVICE:
        match = re.search(pattern, message)
        if match:
            names = [g for g in match.groups() if g]
            if not names:  # the compiler did not say which call allocated: the kernel's source does
                used = sorted(set(re.findall(rf"\bnp\.{_ALLOCATING}\(", source)))
                names = [", ".join(f"np.{n}" for n in used) or "np.zeros, np.asarray and the like"]
            text = advice.format(*names)
            break
    else:
        lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
        text = "the CUDA compiler refused it: " + (" / ".join(lines[:2])[:300] if lines else "no message")
    return text + (f" ({where})" if where else "")


def _source(func) -> str:
    try:
        import inspect

        return inspect.getsource(func)
    except (OSError, TypeError):
        return ""


def compile_kernel(kernel, signature: str, cc) -> dict:
    """Compile ``kernel`` (a ``@cuda.jit`` function) for ``cc``; what ptxas says of it, or why it failed."""
    return compile_for_targets(kernel, signature, [cc])[sm(cc)]


def _lowering_group(cc) -> int:
    """Targets in one group share a lowering: typing and lowering read the compute
    capability only at these thresholds (``numba_internals.LOWERING_READS_CC_AT``)."""
    return sum(tuple(cc) >= gate for gate in numba_internals.LOWERING_READS_CC_AT)


def compile_for_targets(kernel, signature: str, targets=None) -> dict:
    """Compile ``kernel`` (a ``@cuda.jit`` function) for each of ``targets`` (default
    ``TARGETS``): ``{"sm_75": result, ...}``, each what ptxas says of it (registers,
    shared_bytes, spill_bytes, stack_bytes) or why it failed (``ok`` False, ``error`` in a
    student's words, ``compiler``'s own). Typed and lowered once (per group of targets
    that lower alike), then NVVM per target, then ptxas for every target at once."""
    func = getattr(kernel, "py_func", kernel)
    targets = [tuple(cc) for cc in (targets if targets is not None else TARGETS)]
    results, ptxes, started = {}, {}, {}

    def failed(exc, since):
        return {"ok": False, "error": explain(str(exc), _source(func)), "compiler": str(exc).strip()[:1500],
                "seconds": round(time.monotonic() - since, 3)}

    groups = {}
    for cc in targets:
        groups.setdefault(_lowering_group(cc), []).append(cc)
    for group in groups.values():
        start = time.monotonic()
        try:
            library = numba_internals.lower_kernel(func, signature, min(group))
        except Exception as exc:  # noqa: BLE001 - a compile error is the answer, reported as data
            results.update({cc: failed(exc, start) for cc in group})
            continue
        shared = (time.monotonic() - start) / len(group)  # the lowering's time, shared by its targets
        for cc in group:
            started[cc] = time.monotonic() - shared
            try:
                ptxes[cc] = numba_internals.ptx_for(library, cc)
            except Exception as exc:  # noqa: BLE001 - as above
                results[cc] = failed(exc, started[cc])
    for cc, found in resources_for_targets(ptxes).items():
        if isinstance(found, Exception):
            results[cc] = failed(found, started[cc])
        else:
            results[cc] = {"ok": True, **found, "ptx_bytes": len(ptxes[cc]), "work": ptx_work(ptxes[cc]),
                           "seconds": round(time.monotonic() - started[cc], 3)}
    return {sm(cc): results[cc] for cc in targets}


_WORK = {  # PTX instructions by what they do (``ptx_work``)
    # global or generic (numba addresses arrays generically): any store but to shared, local or parameter space
    "global_stores": re.compile(r"^\s*(?:@!?%?\w+\s+)?st\.(?!shared|local|param)", re.M),
    "shared_accesses": re.compile(r"^\s*(?:@!?%?\w+\s+)?(?:ld|st)\.shared\b", re.M),
    "barriers": re.compile(r"^\s*(?:@!?%?\w+\s+)?(?:bar|barrier)\.(?:sync|red|arrive)\b", re.M),
    "atomics": re.compile(r"^\s*(?:@!?%?\w+\s+)?(?:atom|red)\.", re.M),
    # warp functions: cuda.shfl_*_sync (a 64-bit value is two shuffles), and the votes all/any/eq/ballot_sync
    "warp_shuffles": re.compile(r"^\s*(?:@!?%?\w+\s+)?shfl\.sync\.", re.M),
    "warp_votes": re.compile(r"^\s*(?:@!?%?\w+\s+)?vote\.sync\.", re.M),
}


def ptx_work(ptx: str) -> dict:
    """How many instructions of the compiled kernel store to global memory, touch shared
    memory, wait at a barrier, update atomically, shuffle values between the lanes of a
    warp or take a warp vote: what a GPU would run, whatever the simulator ran (a kernel
    whose branches depend on where it runs compiles to less)."""
    return {what: len(pattern.findall(ptx)) for what, pattern in _WORK.items()}


def warm_up() -> None:
    """Load NVVM and numba's CUDA target by compiling a trivial kernel for every
    target: the first compile in a process takes about a second more than the
    next. The grader's compiling server does it once, before it forks a call
    per check. Does nothing where kernels cannot be compiled."""
    if unavailable():
        return

    def warm(flags):
        from numba import cuda

        k = cuda.grid(1)
        if k < flags.shape[0]:
            flags[k] = 0

    compile_for_targets(warm, "void(float32[:])")


_COMPILE_SOURCE = r'''
import json, sys
from course import gpu_compile
request = json.loads(sys.stdin.read())
namespace = {}
exec(request["source"], namespace)
print(json.dumps({"unavailable": gpu_compile.unavailable()} if gpu_compile.unavailable() else {
    name: gpu_compile.compile_for_targets(namespace[name], signature, request["targets"])
    for name, signature in request["signatures"].items()}))
'''


def compile_source(source: str, signatures: dict, header: str = "", targets=None) -> dict:
    """Compile kernels given as source text (``inspect.getsource`` of a notebook's
    kernel, say) in a process of their own with the simulator off, so a notebook
    that runs its kernels in the simulator can still see what a GPU would make of
    them: ``{name: {"sm_90": result, ...}}`` for ``targets`` (default ``TARGETS``),
    or ``{"unavailable": why}``. ``header`` runs first (imports and constants the
    kernels use)."""
    import json
    import sys

    prelude = "import math\nimport numpy as np\nfrom numba import cuda, float32, float64, int32, int64\n"
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0",
               PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", _COMPILE_SOURCE], env=env, capture_output=True, text=True,
                          timeout=300, input=json.dumps({"source": prelude + header + "\n" + source,
                                                         "signatures": signatures,
                                                         "targets": [list(cc) for cc in targets or TARGETS]}))
    if done.returncode != 0:
        raise RuntimeError(f"compiling failed: {done.stderr.strip()[-1500:]}")
    return json.loads(done.stdout.splitlines()[-1])


# -- CuPy kernels: CUDA C through NVRTC -------------------------------------------------

_C_TYPES = {"float16": "half", "float32": "float", "float64": "double", "int8": "signed char", "int16": "short",
            "int32": "int", "int64": "long long", "uint8": "unsigned char", "uint32": "unsigned int",
            "uint64": "unsigned long long", "bool": "bool", "float": "float", "double": "double", "int": "int"}


def capture_cupy_kernels(build) -> list[dict]:
    """Call ``build()`` (code that makes ``cupy.ElementwiseKernel`` or ``cupy.RawKernel``
    objects) against a stand-in ``cupy`` that records what each kernel was made of,
    so it can be compiled where CuPy cannot run (no GPU, or no CuPy at all)."""
    import sys
    import types

    made = []

    class ElementwiseKernel:
        def __init__(self, in_params, out_params, operation, name="kernel", preamble="", **kwargs):
            made.append({"kind": "elementwise", "in_params": in_params, "out_params": out_params,
                         "operation": operation, "name": name, "preamble": preamble})

        def __call__(self, *args, **kwargs):
            raise RuntimeError("the stand-in cupy only records kernels; it cannot run them")

    class RawKernel(ElementwiseKernel):
        def __init__(self, code, name, options=(), **kwargs):
            made.append({"kind": "raw", "code": code, "name": name})

    stand_in = types.ModuleType("cupy")
    stand_in.ElementwiseKernel, stand_in.RawKernel = ElementwiseKernel, RawKernel
    saved = sys.modules.get("cupy")
    sys.modules["cupy"] = stand_in
    try:
        build()
    finally:
        if saved is None:
            sys.modules.pop("cupy", None)
        else:
            sys.modules["cupy"] = saved
    return made


def _params(text: str) -> list[tuple[str, str, bool]]:
    """``"T x, raw float32 y"`` -> ``[("T", "x", False), ("float32", "y", True)]``."""
    found = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        words = part.split()
        raw = words[0] == "raw"
        if raw:
            words = words[1:]
        if len(words) != 2:
            raise ValueError(f"cannot read the parameter {part!r}: expected 'type name' or 'raw type name'")
        found.append((words[0], words[1], raw))
    return found


def elementwise_source(kernel: dict, placeholder: str = "float") -> str:
    """The CUDA C a ``cupy.ElementwiseKernel`` stands for, one thread per element (a
    grid-stride loop), with its type placeholders (``T``) made ``placeholder``."""
    ins, outs = _params(kernel["in_params"]), _params(kernel["out_params"])
    names = {t for t, _, _ in ins + outs if t not in _C_TYPES}
    ctype = {t: _C_TYPES.get(t, t) for t, _, _ in ins + outs}
    args, loads = [], []
    for (t, name, raw), is_in in [(p, True) for p in ins] + [(p, False) for p in outs]:
        const = "const " if is_in else ""
        if raw:
            args.append(f"{const}{ctype[t]}* {name}")
        else:
            args.append(f"{const}{ctype[t]}* __restrict__ {name}_")
            loads.append(f"{const}{ctype[t]} {'&' if not is_in else ''}{name} = {name}_[i];")
    typedefs = "".join(f"typedef {placeholder} {t};\n" for t in sorted(names))
    body = "\n    ".join(loads)
    return (f"{typedefs}{kernel['preamble']}\n"
            f"extern \"C\" __global__ void {kernel['name']}({', '.join(args)}, long long _n) {{\n"
            f"  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < _n;\n"
            f"       i += (long long)gridDim.x * blockDim.x) {{\n"
            f"    {body}\n"
            f"    {kernel['operation']}\n"
            f"  }}\n}}\n")


def nvrtc_unavailable() -> str:
    """Why CUDA C cannot be compiled here ("" when it can): NVRTC or ptxas missing, or they
    do not know an architecture the compile checks target (``compiler_gaps``)."""
    if _not_linux():
        return _not_linux()
    try:
        from cuda.bindings import nvrtc

        status, _, _ = nvrtc.nvrtcVersion()
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return f"NVRTC did not load ({status}); install it with {INSTALL}"
    except Exception as exc:  # noqa: BLE001 - whatever stops NVRTC loading is the reason
        return f"no NVRTC here ({str(exc).strip().splitlines()[0]}); install it with {INSTALL}"
    return _gaps_reason() if ptxas() else f"no ptxas here; install it with {INSTALL}"


def compile_cuda_c(source: str, cc) -> dict:
    """Compile CUDA C with NVRTC for ``cc``; ptxas's resources, or NVRTC's log."""
    return compile_cuda_c_for_targets(source, [cc])[sm(cc)]


def _nvrtc_ptx(nvrtc, source: str, cc):
    """NVRTC's PTX of ``source`` for ``cc``, or (None, its log)."""
    _, program = nvrtc.nvrtcCreateProgram(source.encode(), b"kernel.cu", 0, [], [])
    try:
        options = [f"--gpu-architecture=compute_{cc[0]}{cc[1]}".encode(), b"-default-device"]
        (status,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
        _, size = nvrtc.nvrtcGetProgramLogSize(program)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(program, log)
        log = log.decode(errors="replace").rstrip("\x00 \n")
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return None, log
        _, size = nvrtc.nvrtcGetPTXSize(program)
        ptx = b" " * size
        nvrtc.nvrtcGetPTX(program, ptx)
        return ptx.decode().rstrip("\x00"), log
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def compile_cuda_c_for_targets(source: str, targets=None) -> dict:
    """Compile CUDA C with NVRTC (the ``nvidia-cuda-nvrtc`` wheel, through
    cuda-bindings) for each of ``targets`` (default ``TARGETS``), as CuPy compiles for
    the device it runs on: ``{"sm_75": result, ...}``, each ptxas's resources or NVRTC's
    errors. ptxas assembles every target at once."""
    targets = [tuple(cc) for cc in (targets if targets is not None else TARGETS)]
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        failure = {"ok": False, "error": f"no NVRTC here ({exc}); install it with {INSTALL}", "compiler": str(exc),
                   "seconds": 0.0}
        return {sm(cc): failure for cc in targets}
    results, ptxes, started = {}, {}, {}
    for cc in targets:
        started[cc] = time.monotonic()
        ptx, log = _nvrtc_ptx(nvrtc, source, cc)
        if ptx is None:
            errors = [line.split("error:", 1)[1].strip() for line in log.splitlines() if "error:" in line]
            results[cc] = {"ok": False, "error": "; ".join(errors[:3]) or log[:300], "compiler": log[:1500],
                           "seconds": round(time.monotonic() - started[cc], 3)}
        else:
            ptxes[cc] = ptx
    for cc, found in resources_for_targets(ptxes).items():
        if isinstance(found, Exception):
            results[cc] = {"ok": False, "error": str(found)[:300], "compiler": str(found)[:1500],
                           "seconds": round(time.monotonic() - started[cc], 3)}
        else:
            results[cc] = {"ok": True, **found, "seconds": round(time.monotonic() - started[cc], 3)}
    return {sm(cc): results[cc] for cc in targets}


# -- CuPy kernels on the host: the same generated loop, built with a C++ compiler -------

# What the loop of ``elementwise_source`` needs of CUDA to build and run on the host, on
# one thread: the qualifiers mean nothing here, and a grid of one block of one thread
# makes the grid-stride loop visit every element in turn. CUDA's fast-math intrinsics
# become the accurate host functions they approximate (macros: glibc declares some of
# those names itself); CUDA's rsqrt and normcdf, which C lacks, are written out.
# Anything else only a GPU has (warp functions, atomics, shared memory, __syncthreads,
# half, CuPy's headers) is not here: such a kernel does not build for the host, and
# ``build_on_host`` says which name it lacked. Needs ``host_unavailable() == ""``.
HOST_PRELUDE = r"""
#include <math.h>
#include <algorithm>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
struct k2c_dim3 { unsigned int x, y, z; };
static const k2c_dim3 threadIdx = {0, 0, 0}, blockIdx = {0, 0, 0}, blockDim = {1, 1, 1}, gridDim = {1, 1, 1};
using std::min;
using std::max;
#define __expf(x) expf(x)
#define __exp10f(x) powf(10.0f, (x))
#define __logf(x) logf(x)
#define __log2f(x) log2f(x)
#define __log10f(x) log10f(x)
#define __powf(x, y) powf((x), (y))
#define __sinf(x) sinf(x)
#define __cosf(x) cosf(x)
#define __tanf(x) tanf(x)
#define __fdividef(x, y) ((x) / (y))
#define __saturatef(x) fminf(fmaxf((x), 0.0f), 1.0f)
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline double rsqrt(double x) { return 1.0 / sqrt(x); }
static inline float normcdff(float x) { return 0.5f * erfcf(-x * 0.70710678118654752f); }
static inline double normcdf(double x) { return 0.5 * erfc(-x * 0.70710678118654752); }
"""
HOST_DTYPES = {"float": np.float32, "double": np.float64}  # placeholders: the NumPy dtype each stands for
# The C names of _C_TYPES that are not NumPy's names for the same type.
_NUMPY_NAMES = {"float": "float32", "double": "float64", "int": "int32", "half": "float16"}


def host_compiler() -> str | None:
    """The C++ compiler that builds CuPy kernels for the host: ``g++``, else ``c++``."""
    import shutil

    return shutil.which("g++") or shutil.which("c++")


def host_unavailable() -> str:
    """Why CUDA C cannot be built for the host here ("" when it can)."""
    return "" if host_compiler() else "no C++ compiler here (g++ or c++ on PATH; on Debian: apt-get install g++)"


def build_on_host(sources: dict, folder: str) -> dict:
    """Build each CUDA C source (``elementwise_source``'s) into a shared library in
    ``folder``, all at once: ``{key: {"ok": True, "library": path}}``, or
    ``{"ok": False, "error": the compiler's first errors, "compiler": its log}``."""
    started = {}
    for key, source in sources.items():
        # A name of its own: the loader hands back a library already loaded from the same path.
        handle, path = tempfile.mkstemp(suffix=".cpp", prefix="kernel-", dir=folder)
        stem = path[:-len(".cpp")]
        with os.fdopen(handle, "w") as f:
            f.write(HOST_PRELUDE + '#line 1 "kernel.cu"\n' + source)
        started[key] = (stem + ".so", subprocess.Popen(
            [host_compiler(), "-x", "c++", "-std=c++14", "-O1", "-fPIC", "-shared", "-o", stem + ".so", stem + ".cpp"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    built = {}
    for key, (library, proc) in started.items():
        try:
            _, log = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            built[key] = {"ok": False, "error": "the host compiler took over 60 s", "compiler": ""}
            continue
        if proc.returncode != 0:
            errors = [line.split("error:", 1)[1].strip() for line in log.splitlines() if "error:" in line]
            built[key] = {"ok": False, "error": "; ".join(errors[:3]) or log.strip()[:300], "compiler": log[:1500]}
        else:
            built[key] = {"ok": True, "library": library}
    return built


def _host_dtype(type_name: str, placeholder: str):
    if type_name not in _C_TYPES:
        return np.dtype(HOST_DTYPES[placeholder])
    return np.dtype(_NUMPY_NAMES.get(type_name, type_name))


def run_elementwise_on_host(kernel: dict, library: str, placeholder: str, inputs: list) -> list:
    """Run a captured ``cupy.ElementwiseKernel`` built by ``build_on_host`` (from
    ``elementwise_source(kernel, placeholder)``) on NumPy ``inputs``, in the order of
    its in_params: broadcast together as CuPy broadcasts them, cast to each
    parameter's type. Returns its outputs, of the broadcast shape, which start as NaN
    (or 0 for integers), so an element the kernel never writes shows."""
    import ctypes

    ins, outs = _params(kernel["in_params"]), _params(kernel["out_params"])
    if len(inputs) != len(ins):
        raise ValueError(f"{kernel['name']} takes {len(ins)} inputs ({kernel['in_params']}), given {len(inputs)}")
    if any(raw for _, _, raw in outs):
        raise ValueError(f"{kernel['name']} has a raw output, which the host run cannot size")
    shape = np.broadcast_shapes(*(np.shape(a) for a, (_, _, raw) in zip(inputs, ins) if not raw))
    args = [np.ascontiguousarray(a if raw else np.broadcast_to(a, shape), dtype=_host_dtype(t, placeholder))
            for a, (t, _, raw) in zip(inputs, ins)]
    results = []
    for t, _, _ in outs:
        dtype = _host_dtype(t, placeholder)
        results.append(np.full(shape, np.nan if dtype.kind == "f" else 0, dtype))
    function = getattr(ctypes.CDLL(library), kernel["name"])
    function.restype = None
    function.argtypes = [ctypes.c_void_p] * (len(args) + len(results)) + [ctypes.c_longlong]
    function(*(a.ctypes.data for a in args + results), int(np.prod(shape, dtype=np.int64)))
    return results
