"""The GPU tier's preflight: before any check of a lab, one tiny kernel through each
stack the lab runs on the device (its lab.toml's ``device_stacks``: numba, CuPy, torch).

An installed build can lack the card's kernels: on Kaggle's P100 today's torch
allocates, then every operation fails with ``cudaErrorNoKernelImageForDevice``.
Graded as it is, every check would fail and the student would get a zero for the
machine's software. The preflight runs the kernels in the sandbox, as the checks
would, and a failure stops grading with ``IncompleteEnvironment`` (exit 2), naming
the card (name, compute capability) and the build (torch's ``get_arch_list()``,
CuPy's CUDA version, numba-cuda's compiler targets) and the remedy.
"""
from __future__ import annotations

import re
import tempfile

from autograder.grading.labs import Lab

PREFLIGHT_TIMEOUT_S = 240  # a cold import of torch and CuPy, and NVRTC's first compile, on a slow node
MEMORY_MB = 8192

# What each library says when the build has no kernel for this card (the same words whether
# the runtime or the driver reports it) or cannot compile for it.
NO_KERNEL_IMAGE = (
    "no kernel image is available",  # cudaGetErrorString / cuGetErrorString: torch, CuPy, numba
    "cudaErrorNoKernelImageForDevice",  # CuPy's CUDARuntimeError: "cudaErrorNoKernelImageForDevice: no kernel …"
    "CUDA_ERROR_NO_BINARY_FOR_GPU",  # the driver's name: CuPy's CUDADriverError, numba-cuda's CudaAPIError
    "is not compatible with the current PyTorch installation",  # torch's warning at its first CUDA call
    "PyTorch no longer supports this GPU",  # older torch's warning
    r"compute capability \(CC\) \d+\.\d+\.",  # torch 2.13's warning: "Found GPU0 … which is of compute capability (CC) 6.0."
    r"compute capability \d+\.\d+ is not supported",  # numba-cuda's CCSupportError: below its NVRTC's oldest target
    "invalid value for --gpu-architecture",  # NVRTC asked for an architecture it does not know (CuPy's compile)
    r"Value 'sm_\d+' is not defined for option 'gpu-name'",  # ptxas, likewise
)
# What they say when the driver is older than the build needs.
DRIVER_TOO_OLD = (
    "CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "the provided PTX was compiled with an unsupported toolchain",
    "cudaErrorInsufficientDriver", "driver version is insufficient", "CUDA_ERROR_INSUFFICIENT_DRIVER",
    "The NVIDIA driver on your system is too old",
)
REMEDY = {
    "torch": "a torch wheel whose torch.cuda.get_arch_list() includes {sm} (https://pytorch.org/get-started/locally/)",
    "cupy": "a CuPy wheel (cupy-cuda12x or cupy-cuda13x) for a CUDA that knows {sm}",
    "numba": "numba-cuda with CUDA compilers that know {sm} (pyproject.toml pins them)",
}
NAMES = {"numba": "numba.cuda", "cupy": "CuPy", "torch": "torch"}

_proven: set[str] = set()  # stacks whose tiny kernel ran in this process: each is proven once per process


def kind_of_failure(text: str) -> str:
    """``"no_kernel_image"``, ``"driver"`` or ``"other"``, from a failed probe's error and warnings."""
    if any(re.search(pattern, text) for pattern in NO_KERNEL_IMAGE):
        return "no_kernel_image"
    if any(words in text for words in DRIVER_TOO_OLD):
        return "driver"
    return "other"


def _card(device: dict | None) -> tuple[str, str]:
    """``("Tesla P100-PCIE-16GB (compute capability 6.0, sm_60)", "sm_60")``."""
    if not device:
        return "this machine's GPU (the driver did not name it inside the sandbox)", "this card's architecture"
    major, minor = device["cc"]
    return f"{device['name']} (compute capability {major}.{minor}, sm_{major}{minor})", f"sm_{major}{minor}"


def _below_floor(device: dict | None) -> str:
    """Why the course does not support this card ("" when it does, or is not listed)."""
    from course import gpu_compile

    if not device:
        return ""
    for arch in gpu_compile.ARCHITECTURES:
        if arch.cc == tuple(device["cc"]) and arch.left_out:
            return f" The course does not support {arch.sm} ({arch.cards}): {arch.left_out}."
    return ""


def failure_message(labs: list[Lab], stack: str, record: dict, device: dict | None) -> str:
    """What a failed probe means, for the instructor: the card, the build, what failed
    and what to do. The kind decides the words; every kind stops grading."""
    card, sm = _card(device)
    who = ", ".join(lab.slug for lab in labs)
    name = NAMES[stack]
    error = (record.get("error") or "").strip()
    first = error.splitlines()[0] if error else "no message"  # "AcceleratorError: CUDA error: no kernel image …"
    build = record.get("build") or "(not described)"
    evidence = " ".join(" ".join(record.get("warnings") or []).split())  # torch's warning, on one line
    kind = kind_of_failure(error + "\n" + evidence)
    head = f"the GPU tier cannot grade {who} here: "
    tail = (" No check ran: the machine's software is at fault, not the submission. Or grade on the CPU tier "
            "(--tier cpu); docs/gpus.md lists the cards and builds the course supports.")
    if record.get("error_type") == "import":
        return (f"{head}{who} run{'s' if len(labs) == 1 else ''} {name} on the GPU, and it does not import here: "
                f"{first}. Install it (CuPy: pip install 'k2c[gpu]', or cupy-cuda13x for a CUDA 13 driver)." + tail)
    if kind == "no_kernel_image":
        return (f"{head}the installed {name} has no kernels for {card}. Its build: {build}. One tiny {name} kernel "
                f"failed with: {first}" + (f" (it warned: {evidence[:400]})" if evidence else "") + "."
                + _below_floor(device) + f" Remedy: install {REMEDY[stack].format(sm=sm)}, or grade on another card."
                + tail)
    if kind == "driver":
        driver = f"driver {device['driver']}" if device else "the driver"
        return (f"{head}{driver} is older than the installed {name} needs on {card}. Its build: {build}. One tiny "
                f"{name} kernel failed with: {first}. Remedy: update the NVIDIA driver, or install a {name} build "
                "for an older CUDA." + tail)
    return (f"{head}one tiny {name} kernel failed on {card}. Its build: {build}. The error: {first}"
            + (f" (it warned: {evidence[:400]})" if evidence else "") + "." + _below_floor(device) + tail)


def probe_in_sandbox(stacks: list[str], layer=None) -> dict:
    """``autograder.sandbox.stack_probes.device_kernels`` run as a GPU-tier call into
    student code is run: in the sandbox, with the host's devices."""
    from autograder.grading.runner import IncompleteEnvironment, child_environment
    from autograder.sandbox import Limits, run_call

    with tempfile.TemporaryDirectory(prefix="k2c-preflight-") as folder:
        outcome = run_call({"submission": folder, "target": {"kind": "module", "func": "device_kernels",
                                                             "module": "autograder.sandbox.stack_probes"},
                            "args": [list(stacks)], "kwargs": {}},
                           Limits(timeout_s=PREFLIGHT_TIMEOUT_S, memory_mb=MEMORY_MB, address_space=False,
                                  devices=True),
                           child_environment("gpu"), layer)
    if outcome.status != "ok":
        raise IncompleteEnvironment(
            f"the GPU tier's preflight (one tiny kernel through {', '.join(NAMES[s] for s in stacks)}) did not "
            f"finish: {outcome.status}: {outcome.message} {outcome.output[-300:]}".strip()
            + ". No check ran; grade on the CPU tier (--tier cpu) until the GPU works here")
    return outcome.value


def preflight(labs: list[Lab], layer=None, probe=None) -> None:
    """Before the GPU tier grades ``labs``: one tiny kernel through each stack they run on
    the device, once per process; raises ``IncompleteEnvironment`` (exit 2) naming the
    card, the build and the remedy where one fails. ``probe(stacks, layer)`` runs them
    (tests pass a stand-in that answers as a machine without a GPU cannot)."""
    from autograder.grading.runner import IncompleteEnvironment

    wanted = [s for s in dict.fromkeys(s for lab in labs for s in lab.device_stacks) if s not in _proven]
    if not wanted:
        return
    found = (probe or probe_in_sandbox)(wanted, layer)
    failures = []
    for stack in wanted:
        record = found["stacks"].get(stack, {"ok": False, "error": "the preflight did not run it"})
        if record.get("ok"):
            _proven.add(stack)
        else:
            failures.append(failure_message([lab for lab in labs if stack in lab.device_stacks], stack, record,
                                            found.get("device")))
    if failures:
        raise IncompleteEnvironment(" / ".join(failures))
