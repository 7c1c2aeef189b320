"""The GPU support matrix and the compile matrix, as the Markdown docs/gpus.md includes.

``support_matrix()`` is written from ``course.gpu_compile.ARCHITECTURES`` and the
labs' lab.toml: which card, which architecture, what each tier does with it and
which labs. ``compile_matrix(report)`` is written from a JSON report of the compile
checks (``k2c grade 02,03,04 -k compiles --format json``): registers, shared memory
and spills per kernel and architecture. ``scripts/compile_matrix.py`` writes both
into docs/gpu-results/; the tests check that the committed files still say what the
code does.
"""
from __future__ import annotations

COMPILERS = ("nvidia-cuda-nvcc", "nvidia-cuda-nvrtc")  # a lab that requires one has compile checks


def _labs(numbers) -> str:
    numbers = list(numbers)
    return "labs " + ", ".join(numbers) if len(numbers) > 1 else f"lab {numbers[0]}" if numbers else "no lab"


def compiling_labs(labs) -> list[str]:
    """The numbers of the labs whose CPU tier compiles kernels for every target."""
    return [lab.number for lab in labs if set(lab.requires or ()) & set(COMPILERS)]


def device_labs(labs) -> list[str]:
    """The numbers of the labs whose GPU tier runs something on the device."""
    return [lab.number for lab in labs if lab.device_stacks]


def support_matrix(labs=None) -> str:
    """The support matrix as a Markdown table: one row per architecture of ``ARCHITECTURES``."""
    from autograder.grading.labs import all_labs
    from course import gpu_compile

    labs = labs if labs is not None else all_labs()
    compiled, on_device = _labs(compiling_labs(labs)), _labs(device_labs(labs))
    lines = [f"| card | architecture (compute capability) | where students meet it "
             f"| CPU tier: compile checks ({compiled}) | GPU tier ({on_device}) |",
             "| --- | --- | --- | --- | --- |"]
    for arch in gpu_compile.ARCHITECTURES:
        major, minor = arch.cc
        if arch.left_out:
            cpu, gpu = f"left out: {arch.left_out}", "not supported"
        else:
            cpu, gpu = "compiled for by the pinned compilers (tested here)", "supported; not yet run"
        lines.append(f"| {arch.cards} | {arch.sm} ({major}.{minor}) | {arch.where} | {cpu} | {gpu} |")
    return "\n".join(lines) + "\n"


def compile_rows(report: dict) -> dict:
    """``{(lab, kernel): {"sm_75": {registers, shared_bytes, spill_bytes}, ...}}`` from a
    JSON report (one lab's, or ``labs`` of several): its ``compiled`` tables."""
    labs = report["labs"] if "labs" in report else [report]
    return {(lab["lab"][:2], kernel): by_arch for lab in labs for kernel, by_arch in lab.get("compiled", {}).items()}


def compile_matrix(report: dict) -> str:
    """The compile matrix as a Markdown table: a row per kernel, a column per architecture,
    each cell registers per thread / shared memory per block (bytes) / spills (bytes)."""
    rows = compile_rows(report)
    if not rows:
        return "No compile check ran in this report.\n"
    archs = sorted({a for by_arch in rows.values() for a in by_arch}, key=lambda a: int(a.removeprefix("sm_")))
    lines = ["| lab | kernel | " + " | ".join(archs) + " |", "| --- | --- | " + " | ".join("---" for _ in archs) + " |"]
    for (lab, kernel), by_arch in rows.items():
        cells = [("/".join(str(by_arch[a][k]) for k in ("registers", "shared_bytes", "spill_bytes"))
                  if a in by_arch else "-") for a in archs]
        lines.append(f"| {lab} | `{kernel}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def internals_table() -> str:
    """``course.numba_internals.INTERNALS`` as a Markdown table: what the course replaces
    or relies on in numba-cuda and CuPy, where, and the version it was written for."""
    from course import numba_internals

    cupy = " and ".join(map(str, numba_internals.CUPY_WRITTEN_FOR))
    lines = ["| course code | internal | how | what for | written for |", "| --- | --- | --- | --- | --- |"]
    for item in numba_internals.INTERNALS:
        written_for = (f"numba-cuda {numba_internals.WRITTEN_FOR}" if item.package == "numba-cuda"
                       else f"CuPy {cupy}")
        lines.append(f"| `{item.owner}` | `{item.internal}` | {item.kind} | {item.why} | {written_for} |")
    return "\n".join(lines) + "\n"
