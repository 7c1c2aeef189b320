"""What ``k2c selftest`` runs inside the sandbox, as student code would run: two MPI
ranks and two gloo processes, started from a call, each summing its rank into all.
They return what the ranks returned and how long the job took; the self-test, in the
grader, decides whether that is right."""
from __future__ import annotations

JOB_TIMEOUT_S = 120  # a cold start of torch or MPI on a small machine takes seconds, not minutes


def _mpi_rank(comm):
    return comm.allreduce(comm.Get_rank() + 1)


def _gloo_rank():
    import torch
    import torch.distributed as dist

    x = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(x)
    return [float(x.item()), dist.get_backend()]


def mpi_job() -> dict:
    from course import mpi

    job = mpi.run("autograder.sandbox.stack_probes:_mpi_rank", 2, timeout=JOB_TIMEOUT_S)
    job.check()
    return {"results": list(job.results), "seconds": job.duration_s, "launcher": mpi.mpiexec()}


def gloo_job() -> dict:
    from course import dist

    job = dist.run("autograder.sandbox.stack_probes:_gloo_rank", 2, timeout=JOB_TIMEOUT_S, backend="gloo")
    job.check()
    return {"results": list(job.results), "seconds": job.duration_s}


# -- The GPU tier's preflight (autograder.grading.preflight) ---------------------------
#
# One tiny kernel through each stack a lab runs on the device, in the sandbox, as the
# lab's checks would: an installed build can lack this card's kernels (torch built without
# sm_60 on Kaggle's P100 allocates, then every operation fails). Each probe returns what it
# saw, never raises: the grader decides what the failure means.

DEVICE_STACKS = ("numba", "cupy", "torch")
PREFLIGHT_N = 32


def _numba_kernel(cuda) -> str:
    """A kernel of the course's own, compiled by numba-cuda for this card and launched."""
    import numpy as np

    @cuda.jit
    def add_one(values):
        for slot in range(cuda.grid(1), values.shape[0], cuda.gridsize(1)):
            values[slot] += 1

    device = cuda.to_device(np.zeros(PREFLIGHT_N, np.float32))
    add_one[1, PREFLIGHT_N](device)
    got = device.copy_to_host()
    if not (got == 1).all():
        raise RuntimeError(f"a kernel adding 1 to zeros gave {got[:4]}…")
    return "a numba kernel ran"


def _numba_build(cuda) -> str:
    """numba-cuda's version and what its compiler targets: the NVRTC it asks for the
    architectures it knows (a newer card gets PTX for the newest of them)."""
    from importlib import metadata

    from course import gpu_compile

    try:
        archs = ", ".join(f"sm_{a}" for a in sorted(gpu_compile.nvrtc_architectures()))
    except Exception as exc:  # noqa: BLE001 - the build is described as far as it can be
        archs = f"unknown ({type(exc).__name__}: {exc})"
    return f"numba-cuda {metadata.version('numba-cuda')}, compiling with NVRTC and NVVM for {archs}"


def _cupy_kernel(cupy) -> str:
    """CuPy's elementwise kernels (compiled by NVRTC for this card), a reduction and cuBLAS."""
    add_one = cupy.ElementwiseKernel("float32 x", "float32 y", "y = x + 1", "k2c_preflight_add_one")
    x = add_one(cupy.zeros(PREFLIGHT_N, dtype=cupy.float32))
    total = float(x.sum())
    square = cupy.ones((PREFLIGHT_N, PREFLIGHT_N), dtype=cupy.float32)
    product = float((square @ square)[0, 0])
    if total != PREFLIGHT_N or product != PREFLIGHT_N:
        raise RuntimeError(f"CuPy summed {PREFLIGHT_N} ones into {total} and multiplied ones into {product}")
    return "a CuPy kernel, a reduction and a matrix product ran"


def _cupy_build(cupy) -> str:
    runtime = cupy.cuda.runtime.runtimeGetVersion()
    return f"CuPy {cupy.__version__} for CUDA {runtime // 1000}.{runtime % 1000 // 10}"


def _torch_kernel(torch) -> str:
    x = torch.ones(PREFLIGHT_N, device="cuda")
    total = float((x + 1).sum())
    square = torch.ones(PREFLIGHT_N, PREFLIGHT_N, device="cuda")
    product = float((square @ square)[0, 0])
    torch.cuda.synchronize()
    if total != 2 * PREFLIGHT_N or product != PREFLIGHT_N:
        raise RuntimeError(f"torch summed ones + 1 into {total} and multiplied ones into {product}")
    return "torch's kernels and a matrix product ran"


def _torch_build(torch) -> str:
    archs = " ".join(torch.cuda.get_arch_list()) or "none listed"
    return f"torch {torch.__version__} for CUDA {torch.version.cuda}, with kernels for {archs}"


_PROBES = {"numba": ("numba.cuda", _numba_kernel, _numba_build), "cupy": ("cupy", _cupy_kernel, _cupy_build),
           "torch": ("torch", _torch_kernel, _torch_build)}


def device_kernels(stacks, modules=None) -> dict:
    """Run one tiny kernel through each of ``stacks`` (of ``DEVICE_STACKS``) on the GPU:
    ``{"device": {"name", "cc", "driver"} or None, "stacks": {stack: {"ok", "ran" or "error",
    "error_type", "build", "warnings"}}}``. ``modules`` stands in for the imported libraries
    ({"numba.cuda": ..., "cupy": ..., "torch": ...}) in tests without a GPU."""
    import importlib
    import traceback
    import warnings

    from course.tier import device_identity

    found = {"device": device_identity(), "stacks": {}}
    if found["device"]:
        found["device"]["cc"] = list(found["device"]["cc"])
    for stack in stacks:
        module_name, kernel, build = _PROBES[stack]
        record = {"ok": False, "build": "", "warnings": []}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                module = (modules or {}).get(module_name) or importlib.import_module(module_name)
            except Exception as exc:  # noqa: BLE001 - what stops the import is the answer
                record.update(error=f"{type(exc).__name__}: {exc}", error_type="import")
            else:
                try:
                    record["build"] = build(module)
                except Exception as exc:  # noqa: BLE001 - as far as it can be described
                    record["build"] = f"(not described: {type(exc).__name__}: {exc})"
                try:
                    record.update(ok=True, ran=kernel(module))
                except Exception as exc:  # noqa: BLE001 - the failure is the answer
                    message = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                    record.update(error=message[-2000:], error_type=type(exc).__name__)
        record["warnings"] = [str(w.message).strip()[:1000] for w in caught]
        found["stacks"][stack] = record
    return found
