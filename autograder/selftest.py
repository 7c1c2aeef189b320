"""``k2c selftest [LAB]``: run, once and for real, the stack that grading a lab needs.

``k2c doctor`` reads versions; this runs what a check would: the readiness proof
(a fresh Python in the sandbox's isolation layer, as the student's user, imports
what the lab's calls need) and one call through the sandbox; from calls in the
sandbox, two MPI ranks that all-reduce and two torch processes that all-reduce over
gloo; one kernel compiled for every GPU architecture the compile checks target
(``course.gpu_compile.TARGETS``); each only where the lab needs it (its
``lab.toml`` requires). Gradescope's ``setup.sh`` runs it, so a missing piece fails the image build with its
reason instead of every student's grade. Exit status 0 when every probe
passed, 2 otherwise (the status of a usage error: the machine, not a
submission, is at fault).
"""
from __future__ import annotations

import platform
import tempfile
import time

from autograder.grading.labs import Lab, all_labs

SANDBOX_TIMEOUT_S = 60
JOB_CALL_TIMEOUT_S = 300  # the job's own limit (autograder.sandbox.stack_probes), and starting the sandbox


def check_sandbox(labs: list[Lab]) -> str:
    """The layer grading gets here, proven: a fresh Python in it, as the student's user,
    imports what the labs' calls need (autograder.sandbox.readiness); then one call."""
    from autograder.grading.runner import proven_layer
    from autograder.sandbox import Limits, Sandbox

    layer = proven_layer(labs)  # raises with the cause and the remedy when student code could not run
    with tempfile.TemporaryDirectory(prefix="k2c-selftest-") as folder:
        with Sandbox(folder, Limits(timeout_s=SANDBOX_TIMEOUT_S, memory_mb=1024)) as box:
            outcome = box.call({"submission": folder, "target": {"kind": "module", "module": "math", "func": "hypot"},
                                "args": [3.0, 4.0], "kwargs": {}, "simulator": False})
    if outcome.status != "ok" or outcome.value != 5.0:
        raise RuntimeError(f"a call through the {layer.layer.value} layer came back {outcome.status}: {outcome.message}")
    return f"{layer.layer.value}: {layer.describe()}"


def _in_sandbox(func: str, env: dict[str, str] | None = None):
    """Run ``autograder.sandbox.stack_probes.func`` as a call into student code is run."""
    from autograder.sandbox import Limits, run_call

    with tempfile.TemporaryDirectory(prefix="k2c-selftest-") as folder:
        outcome = run_call({"submission": folder, "target": {"kind": "module", "module": "autograder.sandbox.stack_probes",
                                                             "func": func}, "args": [], "kwargs": {}},
                           Limits(timeout_s=JOB_CALL_TIMEOUT_S, memory_mb=4096), env)
    if outcome.status == "raised":
        raise RuntimeError(outcome.message)
    if outcome.status != "ok":
        raise RuntimeError(f"in the sandbox: {outcome.status}: {outcome.message} {outcome.output[-300:]}".strip())
    return outcome.value


def check_mpi(labs: list[Lab]) -> str:
    from autograder.grading.runner import child_environment

    mpich = next((lab for lab in labs if "mpich" in (lab.requires or ())), None)
    done = _in_sandbox("mpi_job", child_environment("cpu", mpich))
    if done["results"] != [3, 3]:
        raise RuntimeError(f"2 ranks all-reduced 1 + 2 into {done['results']}")
    return f"2 ranks all-reduced in the sandbox in {done['seconds']:.1f} s ({done['launcher']})"


def check_gloo(labs: list[Lab]) -> str:
    done = _in_sandbox("gloo_job", {"K2C_PRELOAD": "torch,torch.distributed", "OMP_NUM_THREADS": "1"})
    if [r[0] for r in done["results"]] != [3.0, 3.0]:
        raise RuntimeError(f"2 processes all-reduced 1 + 2 into {done['results']}")
    return f"2 processes all-reduced over {done['results'][0][1]} in the sandbox in {done['seconds']:.1f} s"


def check_compile(labs: list[Lab]) -> str:
    from course import gpu_compile

    kernel = ("@cuda.jit\ndef scale(values):\n    for slot in range(cuda.grid(1), values.shape[0], cuda.gridsize(1)):\n"
              "        values[slot] *= 2\n")
    done = gpu_compile.compile_source(kernel, {"scale": "void(float32[:])"})
    if "unavailable" in done:
        raise RuntimeError(done["unavailable"])
    return f"a kernel compiled for {_every_target(done['scale'])}"


def _every_target(results: dict) -> str:
    """``sm_75, ..., sm_120 (7 architectures)``, or raise with the first target that failed."""
    for target, result in results.items():
        if not result.get("ok"):
            raise RuntimeError(f"{target}: {result.get('error', 'the compile failed')}")
    return f"{', '.join(results)} ({len(results)} architectures)"


def check_nvrtc(labs: list[Lab]) -> str:
    from course import gpu_compile

    why = gpu_compile.nvrtc_unavailable()
    if why:
        raise RuntimeError(why)
    results = gpu_compile.compile_cuda_c_for_targets(
        'extern "C" __global__ void scale(float *x) { x[threadIdx.x] *= 2; }')
    return f"CUDA C compiled with NVRTC for {_every_target(results)}"


def check_torch(labs: list[Lab]) -> str:
    import torch

    if float(torch.ones(4).sum()) != 4.0:
        raise RuntimeError("torch.ones(4).sum() is not 4")
    return f"torch {torch.__version__}"


# (name, the lab.toml requires that call for it, the course module it goes through, the probe).
# A probe whose module this install leaves out is not one the lab needs: Gradescope's wheel
# holds only the course modules its lab imports (lab 07 trains in one process: no course.dist).
PROBES = (
    ("sandbox", None, None, check_sandbox),
    ("MPI", {"mpich", "mpi4py"}, "course.mpi", check_mpi),
    ("torch", {"torch"}, None, check_torch),
    ("torch gloo", {"torch"}, "course.dist", check_gloo),
    ("GPU compiler (NVVM, ptxas)", {"nvidia-cuda-nvcc", "nvidia-nvvm"}, "course.gpu_compile", check_compile),
    ("GPU compiler (NVRTC)", {"nvidia-cuda-nvrtc"}, "course.gpu_compile", check_nvrtc),
)


def probes_for(labs: list[Lab]):
    import importlib.util

    wanted = set().union(*(set(lab.requires) if lab.requires is not None else {"*"} for lab in labs))
    return [(name, needs or set(), probe) for name, needs, module, probe in PROBES
            if (needs is None or "*" in wanted or needs & wanted)
            and (module is None or importlib.util.find_spec(module) is not None)]


def run(labs: list[Lab] | None = None, stream=None) -> bool:
    """Run the probes ``labs`` (default: every lab) need; print one line each. True when all passed."""
    import sys

    from autograder.grading.runner import for_this_platform

    stream = stream or sys.stdout
    labs = labs if labs is not None else all_labs()
    healthy, sandbox_works = True, True
    for name, needs, probe in probes_for(labs):
        if needs and not any(for_this_platform(dist) for dist in needs):
            stream.write(f"  - {name}: not on this platform ({platform.system()}); its checks skip with the reason\n")
            continue
        if probe in (check_mpi, check_gloo) and not sandbox_works:
            stream.write(f"  ✗ {name}: not run: it runs in the sandbox, which does not work here (above)\n")
            continue
        started = time.monotonic()
        try:
            line = f"  ✓ {name}: {probe(labs)}"
        except Exception as exc:  # noqa: BLE001 - whatever stops a probe is the reason to report
            healthy = False
            sandbox_works &= probe is not check_sandbox
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            line = f"  ✗ {name}: {reason}"
        stream.write(f"{line}  ({time.monotonic() - started:.1f} s)\n")
        stream.flush()
    stream.write("Everything grading needs ran.\n" if healthy
                 else "Something grading needs did not run: see ✗ above ('k2c doctor' says what to install).\n")
    return healthy
