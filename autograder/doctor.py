"""``k2c doctor``: what this machine offers the course, and what to install."""
from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import platform
import re
import shutil
import sys
from pathlib import Path

from course.tier import describe_gpu

PACKAGES = [  # (distribution, import name, what it is for, install hint)
    ("numpy", "numpy", "arrays everywhere", "pip install numpy"),
    ("numba", "numba", "modules 01-03: CPU parallel loops and CUDA kernels", "pip install numba numba-cuda"),
    ("numba-cuda", "numba.cuda", "modules 02-03: numba.cuda and its simulator", "pip install numba-cuda"),
    ("cupy-cuda13x", "cupy", "module 04 on a GPU (NumPy stands in on the CPU tier)", "pip install 'k2c[gpu]' (GPU machines only)"),
    ("mpi4py", "mpi4py", "modules 05-06: MPI", "pip install mpich mpi4py"),
    ("torch", "torch", "modules 07-13: training", "pip install torch==2.13.0"),
    ("matplotlib", "matplotlib", "plots in lectures", "pip install matplotlib"),
    ("jupyter", "jupyter_core", "lectures and handouts", "pip install jupyter"),
    ("pytest", "pytest", "the autograder", "pip install pytest"),
]


def _version(dist: str) -> str | None:
    for name in (dist, dist.replace("-cuda13x", "-cuda12x"), dist.replace("-cuda13x", "")):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def _extra(module: str) -> str:
    """A line of detail for the packages where the version alone says little."""
    try:
        if module == "mpi4py":
            from mpi4py import MPI

            mpiexec = os.path.join(sys.prefix, "bin", "mpiexec")
            where = mpiexec if os.path.exists(mpiexec) else (shutil.which("mpiexec") or "no mpiexec found")
            return f"{MPI.Get_library_version().splitlines()[0].strip()}; mpiexec: {where}"
        if module == "torch":
            import torch
            import torch.distributed as dist

            backends = [b for b, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                                        ("mpi", dist.is_mpi_available())) if ok]
            cuda = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)" if torch.cuda.is_available() else "CPU build or no GPU"
            return f"{cuda}; distributed backends: {', '.join(backends) or 'none'}"
        if module == "cupy":
            import cupy

            return "usable" if cupy.is_available() else "installed, but no GPU: NumPy stands in"
    except Exception as exc:  # report, don't crash the doctor
        return f"import failed: {exc}"
    return ""


def _isolation() -> tuple[str, bool]:
    """Which isolation layer grading gets here, proven able to grade every lab (the
    readiness proof: a fresh Python in it, as the student's user, imports what the labs'
    calls need), and how to get a stronger one; and whether this machine can grade."""
    from autograder.grading.labs import UsageError, all_labs
    from autograder.grading.runner import ready_to_grade
    from autograder.sandbox import isolation

    try:
        found = ready_to_grade(all_labs())
    except UsageError as exc:
        return f"Isolation: ✗ {exc}", False
    line = f"Isolation: {found.layer.value}: {found.describe()}\n  student code could read: {found.readable}"
    if found.layer is not isolation.Layer.BUBBLEWRAP:
        line += ("\n  for namespaces (no network, read-only files, nothing outlives a call): install bubblewrap "
                 "(Debian/Ubuntu: apt-get install bubblewrap), or grade in a container that allows it; "
                 "k2c grade-class refuses this layer unless --allow-weak-isolation")
    return line, True


# Run on a node by `k2c doctor`'s srun: the layer grading gets there, proven (autograder.sandbox.readiness).
NODE_PROBE = ("import socket\nfrom autograder.grading.labs import UsageError, all_labs\n"
              "from autograder.grading.runner import ready_to_grade\ntry:\n    i = ready_to_grade(all_labs())\n"
              "    print(f'{socket.gethostname()}: {i.layer.value}' + ('' if i.hides_files else ' (hides no file)'))\n"
              "except UsageError as exc:\n    print(f'{socket.gethostname()}: cannot grade ({exc})')\n")


def _run(command: list[str], timeout_s: float) -> tuple[int | None, str]:
    import subprocess

    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None, f"no answer within {timeout_s:g} s"
    except OSError as exc:
        return None, str(exc)
    return done.returncode, (done.stdout + done.stderr).strip()


def _slurm() -> str:
    """SLURM, for ``--slurm`` gradings and lab 13's jobs: sbatch, whether this user can
    submit with the site's settings (``sbatch --test-only``), on the CPU tier and on the
    GPU tier (with its GPU request), and the isolation layer a node grades with (one
    short ``srun --immediate``: a busy cluster answers "no node"). A client without a
    cluster is one line saying so, never SLURM's own errors in place of its version."""
    from autograder.grading.labs import UsageError
    from autograder.instructor.gradebook_slurm import CONFIG, NO_SBATCH, SlurmSite

    sbatch, srun = shutil.which("sbatch"), shutil.which("srun")
    if not sbatch or not srun:
        return f"SLURM: - not here: {NO_SBATCH} (only --slurm gradings and lab 13's cluster jobs need it)"
    version, unconfigured = _slurm_version(sbatch)
    if unconfigured:
        return (f"SLURM: - client installed ({sbatch}), no cluster configured ({unconfigured}): only --slurm "
                "gradings and lab 13's cluster jobs need one (the site's slurm.conf; on one machine, "
                "sudo scripts/slurm-localhost.sh start)")
    try:
        site, origin = SlurmSite.resolve(None)
        gpu_site, _ = SlurmSite.resolve(None, "gpu")
        gpu_table = SlurmSite.read(Path(CONFIG))[1] if Path(CONFIG).exists() else {}
    except UsageError as exc:
        return f"SLURM: ✗ {exc}"
    code, said = _run(["sinfo", "-h", "-o", "%P %a"], 15)
    if code != 0:
        why = _slurm_says(said) or f"sinfo exit {code}"
        return f"SLURM: ✗ {version} client installed ({sbatch}), no cluster reachable ({why}): is slurmctld up?"
    lines = [f"SLURM: {version} ({sbatch}); settings: {origin}"]
    partitions = sorted({line.strip() for line in said.splitlines() if line.strip()})
    lines.append("  partitions (* the default): " + ", ".join(partitions))
    settings = site.srun_args()
    code, said = _run([sbatch, "--test-only", *settings, "--wrap", "true"], 20)
    where = site.partition or "the default partition"
    submits = code == 0
    if submits:
        lines.append(f"  ✓ can submit to {where}: {said.splitlines()[-1].removeprefix('sbatch: ')}")
    else:
        lines.append(f"  ✗ cannot submit to {where} ({' '.join(settings)}): {said[-300:]}")
    lines.append(_gpu_tier(sbatch, gpu_site, bool(gpu_table)))
    if not submits:
        return "\n".join(lines)
    code, said = _run([srun, "--immediate=30", "--nodes=1", "--ntasks=1", "--quiet", f"--chdir={os.getcwd()}",
                       *settings, sys.executable, "-c", NODE_PROBE], 60)
    if code != 0:
        lines.append(f"  ? could not run on a node to see its isolation layer: {said[-300:] or f'exit {code}'}")
    else:
        node, _, layer = said.splitlines()[-1].rpartition(": ")
        mark = "✓" if layer == "bubblewrap" else "✗"
        lines.append(f"  {mark} node {node} grades with {layer}" + ("" if mark == "✓" else
                     ": install bubblewrap on the nodes, or grade-class --slurm grades nothing there"))
    return "\n".join(lines)


def _slurm_version(sbatch: str) -> tuple[str, str]:
    """sbatch's version, or "" and why this client has no cluster to talk to: SLURM_CONF
    naming no file (sbatch would retry reading it for a minute), or sbatch failing to
    read its configuration (no slurm.conf and no DNS record of a configless cluster)."""
    conf = os.environ.get("SLURM_CONF")
    if conf and not os.path.isfile(conf):
        return "", f"SLURM_CONF={conf} is not a file"
    code, said = _run([sbatch, "--version"], 10)
    if code == 0 and re.fullmatch(r"slurm\S* \S+", said):
        return said, ""
    if "Could not establish a configuration source" in said:
        return "", "no slurm.conf, and no DNS SRV record of a configless cluster"
    return "", _slurm_says(said) or (f"sbatch --version: exit {code}" if code is not None else said)


def _slurm_says(output: str) -> str:
    """The last of SLURM's messages in ``output``, without its ``sbatch: fatal:`` prefix."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if not lines:
        return ""
    return re.sub(r"^\S+: (error|fatal): ", "", lines[-1])


def _gpu_tier(sbatch: str, site, configured: bool) -> str:
    """Whether a GPU-tier job can be submitted with its GPU request (``sbatch --test-only``):
    ✗ when k2c-slurm.toml has a [gpu] table that does not work; "-" when there is none and
    the default (``--gres=gpu:1`` on the default partition) does not."""
    settings = site.srun_args()
    ask = " ".join(a for a in settings if a.startswith(("--gres", "--gpus", "--partition")))
    code, said = _run([sbatch, "--test-only", *settings, "--wrap", "true"], 20)
    if code == 0:
        return f"  ✓ GPU tier ({ask}): {said.splitlines()[-1].removeprefix('sbatch: ')}"
    why = _slurm_says(said) or f"exit {code}"
    if configured:
        return f"  ✗ GPU tier: cannot submit {ask}: {why}"
    return (f"  - GPU tier: cannot submit {ask}: {why} (only --tier gpu under SLURM needs it: give the GPU "
            "partition and gres in k2c-slurm.toml's [gpu] table)")


def report() -> tuple[str, bool]:
    """The doctor's text, and whether everything the CPU tier needs is present."""
    isolation, healthy = _isolation()
    lines = [f"Python {platform.python_version()} ({sys.executable})",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores",
             describe_gpu(),
             isolation,
             _slurm(),
             ""]
    for dist, module, purpose, hint in PACKAGES:
        version = _version(dist)
        if version is None:
            from autograder.grading.runner import for_this_platform

            # cupy: GPU machines only; numba-cuda: Linux only (pyproject's markers), and off
            # Linux numba's own numba.cuda simulates kernels while the compile checks skip.
            optional = dist.startswith("cupy") or not for_this_platform(dist)
            healthy &= optional
            lines.append(f"  {'-' if optional else '✗'} {dist:<13} missing — {purpose}; install: {hint}")
            continue
        if module in ("mpi4py", "torch", "cupy"):
            detail = _extra(module)
        else:
            try:
                importlib.import_module(module if module != "numba.cuda" else "numba")
                detail = ""
            except Exception as exc:
                detail, healthy = f"import failed: {exc}", False
        lines.append(f"  ✓ {dist:<13} {version:<12} {purpose}" + (f"\n{'':18}{detail}" if detail else ""))
    lines.append("")
    lines.append("Everything the CPU tier needs is here." if healthy
                 else "Something the course needs is missing or cannot run: run 'make grade' (it installs everything), "
                      "or the hints above.")
    return "\n".join(lines) + "\n", healthy
