"""Every internal of numba-cuda (and CuPy) that the course replaces or relies on, in one place.

numba-cuda went into maintenance mode in June 2026 (security and critical fixes
through CUDA 13's lifetime; new work is in numba-cuda-mlir, which has no
simulator). The course pins numba-cuda (pyproject.toml) and reaches past its
public API in a few places: to compile kernels for a GPU on a machine without
one, to make the simulator's barriers fast, and to record what a kernel does in
the simulator. Each such place is listed in ``INTERNALS`` with the version it
was written for, so that the day the installed version differs,
``tests/test_numba_internals.py`` fails naming each one and what to check.

The replacements ``course.gpu_compile`` makes live here (``fixed_device``,
``lower_kernel``, ``ptx_for``). The simulator's own stay next to the code they
serve (``course.cuda_sim``, ``course.cuda_audit``, lab 03's harness) and are
listed here. What the course will do when the pin must move is in the docs
(docs/gpus.md, "numba-cuda in maintenance mode").
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

WRITTEN_FOR = "0.30.4"  # numba-cuda: pyproject.toml pins this version, and every entry below was written for it
CUPY_WRITTEN_FOR = (13, 14)  # CuPy majors whose public kernel constructors capture_cupy_kernels stands in for
PIN_FILES = "pyproject.toml's numba-cuda pin and course/numba_internals.py's WRITTEN_FOR"

# Where typing and lowering in numba-cuda 0.30.4 read the compute capability: float64
# atomics become a native instruction at 6.0 (numba/cuda/nvvmutils.py) and fast-math
# tanh a native one at 7.5 (numba/cuda/mathimpl.py). Every target of the compile
# checks is 7.5 or newer, so one lowering serves them all and only NVVM and ptxas run
# per target (``lower_kernel``).
LOWERING_READS_CC_AT = ((6, 0), (7, 5))


@dataclass(frozen=True)
class Internal:
    owner: str  # the course's code that replaces or relies on it
    internal: str  # the dotted path in numba-cuda (or CuPy)
    kind: str  # "replaces" or "relies on"
    why: str  # what it does for the course
    check: str  # what to look at in a new version before moving the pin
    attributes: tuple[str, ...] = ()  # instance attributes (``self.x``) the course reads or sets on it
    package: str = "numba-cuda"


_SIM = "numba.cuda.simulator"
_DEVICE_LOOKUPS = ("every get_current_device() on the compile path (grep numba/cuda for it): a new caller needs "
                   "replacing too, a removed one no longer does")
_SIM_BARRIER = "the simulator's barrier (BlockThread.syncthreads) and its abort rules"
_SIM_LAUNCH = "that every launch in the simulator goes through FakeCUDAKernel.__call__"
INTERNALS: tuple[Internal, ...] = (
    # -- compiling for a GPU without one (course.gpu_compile) ---------------------------
    Internal("course.numba_internals.fixed_device", "numba.cuda.compiler.get_current_device", "replaces",
             "a kernel that calls a @cuda.jit(device=True) function asks the driver for the device's compute "
             "capability while it compiles; with no GPU there is none, so the target being compiled answers",
             _DEVICE_LOOKUPS),
    Internal("course.numba_internals.fixed_device", "numba.cuda.dispatcher.get_current_device", "replaces",
             "the device function's dispatcher compiles it for the current device (the same lookup)",
             _DEVICE_LOOKUPS),
    Internal("course.numba_internals.fixed_device", "numba.cuda.memory_management.nrt.get_current_device",
             "replaces", "the NRT module asks while a kernel is linked (the same lookup)", _DEVICE_LOOKUPS),
    Internal("course.numba_internals.lower_kernel", "numba.cuda.compiler._compile_pyfunc_with_fixup", "relies on",
             "types and lowers a kernel into a code library once, the step compile_ptx takes before NVVM, so "
             "NVVM and ptxas alone run per target",
             "compile_ptx still calls it (and only then NVVM); its arguments and its (library, return type) "
             "result; and whether typing or lowering read the compute capability at a new threshold above 7.5 "
             "(LOWERING_READS_CC_AT): then lower once per side of it"),
    Internal("course.numba_internals.ptx_for", "numba.cuda.codegen.CUDACodeLibrary.get_asm_str", "relies on",
             "NVVM on the lowered library for one target (cached per target by the library)",
             "its cc argument, and that it compiles for exactly that target: numba-cuda moves a target that "
             "NVRTC's nvrtcGetSupportedArchs lacks to the closest one it has, which course.gpu_compile's "
             "compiler_gaps checks first"),
    Internal("course.gpu_compile.unavailable", "numba.cuda.cudadrv.nvvm.NVVM", "relies on",
             "loading NVVM says whether the CUDA compiler is installed, before any student kernel is compiled",
             "that it still raises when libnvvm is missing"),
    # -- the simulator's barriers (course.cuda_sim) -----------------------------------
    Internal("course.cuda_sim.install", f"{_SIM}.kernel.BlockThread.run", "replaces",
             "a thread that ends says so, so the block manager waits on a condition instead of polling",
             "BlockThread.run's body (it stores an exception in self.exception)",
             ("_manager", "exception")),
    Internal("course.cuda_sim.install", f"{_SIM}.kernel.BlockThread.syncthreads", "replaces",
             "a thread at the barrier says so and waits on its event", _SIM_BARRIER,
             ("abort", "syncthreads_event", "_manager")),
    Internal("course.cuda_sim.install", f"{_SIM}.kernel.BlockManager.run", "replaces",
             "runs a block's threads and opens each barrier when every live thread waits at it",
             "how the simulator starts a block's threads (BlockThread's arguments) and raises the first exception",
             ("_block_dim", "_f", "_debug")),
    # -- the simulator's warp functions (course.cuda_sim) --------------------------------
    Internal("course.cuda_sim.install", f"{_SIM}.kernelapi.FakeCUDAModule", "relies on",
             "the cuda module a simulated kernel sees: install() adds numba-cuda's warp functions to it "
             "(shfl_sync, shfl_up_sync, shfl_down_sync, shfl_xor_sync, all_sync, any_sync, eq_sync, ballot_sync, "
             "match_any_sync, match_all_sync, syncwarp, activemask, lanemask_lt), which 0.30.4's simulator lacks",
             "whether the simulator now has warp functions of its own (then hold them to tests/test_cuda_sim_warp.py "
             "and drop ours), that kernels still see an instance of this class as `cuda`, and that its laneid is "
             "still thread_id % 32"),
    Internal("course.cuda_sim.install", f"{_SIM}.kernelapi.FakeCUDAModule.popc", "replaces",
             "counts the set bits of a negative integer in its own width (ballot_sync returns an int32: a full "
             "warp's is -1, whose popc is 32; the simulator's counted 1)", "whether its popc still uses bin(val)"),
    Internal("course.cuda_sim.install", f"{_SIM}.kernel.BlockThread.__init__", "relies on",
             "a warp function finds its lane, warp and block from the calling thread, and waits on its event",
             "that threads still carry their linear index (thread_id, x fastest) and blockIdx",
             ("thread_id", "blockIdx", "syncthreads_event", "abort", "_manager")),
    # -- recording a kernel's memory accesses (course.cuda_audit) ------------------------
    Internal("course.cuda_audit", f"{_SIM}.cudadrv.devicearray.FakeWithinKernelCUDAArray.__getitem__",
             "replaces", "records each global read", "that kernels still index global arrays through it"),
    Internal("course.cuda_audit", f"{_SIM}.cudadrv.devicearray.FakeWithinKernelCUDAArray.__setitem__",
             "replaces", "records each global write", "that kernels still index global arrays through it"),
    Internal("course.cuda_audit", f"{_SIM}.kernel.BlockThread.syncthreads", "replaces",
             "counts barriers, so that two accesses in the same epoch are a race", _SIM_BARRIER),
    Internal("course.cuda_audit", f"{_SIM}.kernelapi.FakeCUDAShared.array", "replaces",
             "a poisoned shared array per block and call site, recorded", "its arguments (shape, dtype, alignment)",
             ("_allocations",)),
    Internal("course.cuda_audit", f"{_SIM}.kernelapi.FakeCUDAAtomic.add", "replaces",
             "marks accesses made by atomics (and .sub, .max, .min, .inc, .dec, .exch, .cas, .and_, .or_, .xor)",
             "the names of the atomic methods"),
    Internal("course.cuda_audit", f"{_SIM}.kernel.FakeCUDAKernel.__call__", "replaces",
             "counts and records launches (grid and block)", _SIM_LAUNCH,
             ("_device", "fn", "grid_dim", "block_dim")),
    Internal("course.cuda_audit", f"{_SIM}.kernel._kernel_context", "relies on",
             "tells a launch from inside a kernel (a device function) from a host launch",
             "that it is still set while a kernel runs"),
    Internal("course.cuda_audit", "numba.cuda.errors.normalize_kernel_dimensions", "relies on",
             "grid and block as (x, y, z)", "its result"),
    Internal("course.cuda_audit", "numba.cuda.np.numpy_support.as_dtype", "relies on",
             "a shared array's numba type as a NumPy dtype", "that it still exists there"),
    Internal("autograder/checks/03-shared-memory/harness.py", f"{_SIM}.kernel.FakeCUDAKernel.__call__", "replaces",
             "records the launches a host function makes", _SIM_LAUNCH, ("_device",)),
    Internal("course.gpu_stand_in", f"{_SIM}.cudadrv.devicearray.FakeCUDAArray", "relies on",
             "the GPU tier's dry run wraps a host array as the simulator's device array, for the "
             "numba.cuda.as_cuda_array it adds to the simulator (which lacks one)",
             "that FakeCUDAArray still wraps a NumPy array, and whether the simulator now has as_cuda_array"),
    # -- CuPy's kernels without CuPy (course.gpu_compile) ---------------------------------
    Internal("course.gpu_compile.capture_cupy_kernels", "cupy.ElementwiseKernel", "relies on",
             "its public constructor (in_params, out_params, operation, name, preamble), recorded by a "
             "stand-in; elementwise_source writes the loop CuPy makes of it (one thread per element, raw "
             "parameters indexed by hand, type placeholders)",
             "CuPy's documentation of ElementwiseKernel, and the loop its _kernel module generates",
             package="cupy"),
    Internal("course.gpu_compile.capture_cupy_kernels", "cupy.RawKernel", "relies on",
             "its public constructor (code, name, options), recorded by a stand-in", "its documentation",
             package="cupy"),
)


def installed_version(dist: str = "numba-cuda") -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cupy_version() -> str | None:
    for dist in ("cupy-cuda12x", "cupy-cuda13x", "cupy"):
        version = installed_version(dist)
        if version:
            return version
    return None


def version_mismatches(numba_cuda: str | None = None, cupy: str | None = None) -> list[str]:
    """One line per internal written for another version than the one installed ([] when
    they agree, or the package is not installed: then nothing of it runs). The day a
    new numba-cuda is installed, this says what to check before moving the pin."""
    numba_cuda = numba_cuda if numba_cuda is not None else installed_version()
    cupy = cupy if cupy is not None else _cupy_version()
    lines = []
    for item in INTERNALS:
        if item.package == "numba-cuda" and numba_cuda and numba_cuda != WRITTEN_FOR:
            lines.append(f"numba-cuda {numba_cuda} is installed; {item.owner} {item.kind} {item.internal}, "
                         f"written for {WRITTEN_FOR}: check {item.check}, then update {PIN_FILES}")
        elif item.package == "cupy" and cupy and int(cupy.split(".")[0]) not in CUPY_WRITTEN_FOR:
            lines.append(f"CuPy {cupy} is installed; {item.owner} {item.kind} {item.internal}, written for CuPy "
                         f"{' and '.join(map(str, CUPY_WRITTEN_FOR))}: check {item.check}, then add its major "
                         "to course/numba_internals.py's CUPY_WRITTEN_FOR")
    return lines


def written_for_installed() -> bool:
    """Whether the installed numba-cuda is the one these internals were written for."""
    return installed_version() == WRITTEN_FOR


_MISSING = object()


def missing_internals() -> list[str]:
    """The numba-cuda internals of ``INTERNALS`` that the installed version lacks: a
    dotted path that does not resolve, or an instance attribute its class's source never
    sets or reads (``self.name``). [] on the version they were written for."""
    import importlib
    import inspect

    missing = []
    for item in INTERNALS:
        if item.package != "numba-cuda":
            continue
        parts = item.internal.split(".")
        found, error = _MISSING, "no module of it imports"
        for split in range(len(parts) - 1, 0, -1):  # the longest importable module, then attributes
            try:
                found = importlib.import_module(".".join(parts[:split]))
            except ImportError:
                continue
            try:
                for name in parts[split:]:
                    found = getattr(found, name)
            except AttributeError as exc:
                found, error = _MISSING, str(exc)
            break
        if found is _MISSING:
            missing.append(f"{item.internal} ({item.owner}): {error}")
            continue
        if item.attributes:
            owner_class = importlib.import_module(".".join(parts[:-2])) if len(parts) > 2 else None
            cls = getattr(owner_class, parts[-2], None) if owner_class else None
            source = inspect.getsource(cls) if inspect.isclass(cls) else ""
            for attribute in item.attributes:
                if f"self.{attribute}" not in source:
                    missing.append(f"{parts[-2]}.{attribute} ({item.owner}): no self.{attribute} in "
                                   f"{'.'.join(parts[:-1])}")
    return missing


# -- The replacements course.gpu_compile makes ---------------------------------------------

class _Device:
    """What the compiler asks of the current device, for a machine that has none."""

    def __init__(self, cc):
        self.compute_capability = tuple(cc)
        self.name = f"sm_{cc[0]}{cc[1]} (compiled without a device)"


@contextlib.contextmanager
def fixed_device(cc):
    """Inside: numba-cuda's compile path sees a device of compute capability ``cc``."""
    from numba.cuda import compiler, dispatcher
    from numba.cuda.memory_management import nrt

    modules = (compiler, dispatcher, nrt)
    saved = [m.get_current_device for m in modules]
    for m in modules:
        m.get_current_device = lambda: _Device(cc)
    try:
        yield
    finally:
        for m, original in zip(modules, saved):
            m.get_current_device = original


def lower_kernel(func, signature: str, cc):
    """Type and lower the Python function ``func`` as a kernel of ``signature``, as
    ``numba.cuda.compile_ptx`` would for ``cc``, up to NVVM: a code library that
    ``ptx_for`` compiles for each target. Raises the compiler's error (a TypeError for a
    kernel that returns a value)."""
    from numba.cuda import compiler

    if tuple(cc) < LOWERING_READS_CC_AT[-1]:
        raise ValueError(f"lowering once serves targets of {LOWERING_READS_CC_AT[-1]} and newer only, not {cc}")
    with fixed_device(cc):
        library, _ = compiler._compile_pyfunc_with_fixup(func, signature, device=False, cc=tuple(cc), abi="numba")
    return library


def ptx_for(library, cc) -> str:
    """NVVM's PTX of a ``lower_kernel`` library for ``cc``."""
    with fixed_device(cc):
        return library.get_asm_str(cc=tuple(cc))
