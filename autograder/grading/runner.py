"""Grade one lab: run its checks, with pytest, in this process, against a submission."""
from __future__ import annotations

import contextlib
import enum
import io
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from autograder.sandbox import isolation
from autograder.grading.labs import Found, Lab, Unreadable, UsageError, locate, unpack, with_used_files
from autograder.grading import flags, seeds
from autograder.grading.plugin import CheckResult, GradingPlugin, check_title, register_marks
from autograder.sandbox import Limits
from autograder.grading.submission import BUDGET_CALL_LIMITS, BUDGET_FLOOR_S, Submission
from course import refuse
from course.tier import current_tier


class NoCheckSelected(UsageError):
    """``-k`` picks none of the lab's checks."""


class IncompleteEnvironment(UsageError):
    """What grading a lab needs is missing from this machine (a package, ``mpiexec``):
    the run reports that it could not grade, never a score the student did not earn."""


def _name(text: str) -> str:
    import re

    return re.sub(r"[-_.]+", "-", text).lower()


def for_this_platform(dist: str) -> bool:
    """Whether this install of k2c asks for ``dist`` here: False for a requirement whose
    environment marker excludes this machine (the GPU compiler wheels off Linux)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        declared = {_name(r.name): r for r in map(Requirement, metadata.requires("k2c") or ())}
    except metadata.PackageNotFoundError:
        return True
    wanted = declared.get(_name(dist))
    return wanted is None or wanted.marker is None or wanted.marker.evaluate({"extra": ""})


# The CUDA compilers' wheels. A CUDA toolkit installed on the machine (a GPU node's
# /usr/local/cuda, a conda cudatoolkit) serves as well: course.gpu_compile finds NVVM and
# ptxas either way, and where neither is there the compile checks say so and skip
# (``gpu_compile.unavailable``), while the lab's other checks still grade.
COMPILER_WHEELS = ("nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime")


def _installed(dist: str) -> bool:
    from importlib import metadata

    try:
        metadata.version(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


def missing_stack(lab: Lab) -> str:
    """Why this environment cannot grade ``lab`` ("" when it can): a distribution of its
    ``requires`` that k2c asks for on this platform but is not installed (the compilers'
    wheels aside: ``COMPILER_WHEELS``), or MPI's launcher. Cheap: versions and paths, nothing
    run (``k2c selftest`` runs the stack)."""
    lacking = [dist for dist in lab.requires or ()
               if for_this_platform(dist) and dist not in COMPILER_WHEELS and not _installed(dist)]
    if lacking:
        return (f"lab {lab.slug} needs {', '.join(lacking)}, which this environment lacks: "
                f"pip install {' '.join(lacking)} (see `k2c doctor`)")
    if "mpich" in (lab.requires or ()):
        from course import mpi

        try:
            mpi.mpiexec()
        except FileNotFoundError as exc:
            return str(exc)
    return ""


class LabStatus(str, enum.Enum):
    """What grading one lab of a submission came to: ``LabResult.status``, the
    ``status`` of every report, and the same words in ``k2c grade-class``'s rows
    (``autograder.instructor.gradebook.RowStatus``).

    ``graded``   the checks ran; the score is the submission's (some of the
                 lab's files may be missing: their checks say so)
    ``missing``  none of the lab's files is in the submission: no check ran,
                 the score is 0 and ``searched`` lists the folders looked in.
                 Never reported as ``graded`` with 0.
    """
    GRADED = "graded"
    MISSING = "missing"


@dataclass
class LabResult:
    lab: str
    title: str
    tier: str
    submission: str
    checks: list[CheckResult] = field(default_factory=list)
    duration_s: float = 0.0
    isolation: dict = field(default_factory=dict)  # autograder.sandbox.isolation.Isolation.as_dict()
    checks_digest: str = ""  # sha256 of the lab's check files that graded it
    student_s: float = 0.0  # of duration_s, the wall time inside calls into the student's code
    status: LabStatus = LabStatus.GRADED
    files: tuple[str, ...] = ()  # the lab's files (what was looked for)
    searched: tuple[str, ...] = ()  # missing: the folders looked in, relative to the submission
    missing_max: float = 0.0  # missing: what the checks that would have run are worth
    flags: list = field(default_factory=list)  # flags.Found: for the instructor, never in the score
    seed: int | None = None  # the secret the graded inputs were drawn from (autograder.grading.seeds)
    gpu_dry_run: bool = False  # the GPU checks ran on stand-ins, awarding nothing (GradingPlugin)
    graded_on: dict = field(default_factory=dict)  # where.graded_on: the node, the card, the SLURM job

    @property
    def score(self) -> float:
        return sum(c.points for c in self.checks)

    @property
    def max_score(self) -> float:
        if self.status is LabStatus.MISSING:
            return self.missing_max
        return sum(c.max_points for c in self.checks if c.status != "skipped")

    @property
    def message(self) -> str:
        """One line on what happened, for a lab that was not graded (else empty)."""
        if self.status is not LabStatus.MISSING:
            return ""
        return (f"no lab files found: none of {', '.join(self.files)} is in the submission "
                f"(looked in {', '.join(self.searched)}); no check ran")


def resolve_tier(requested: str) -> str:
    found = current_tier()
    if requested == "auto":
        return found
    if requested == "gpu" and found != "gpu":
        from autograder.grading.where import no_usable_gpu

        raise UsageError(f"--tier gpu asked for, but "
                         f"{no_usable_gpu() or 'this machine has no usable CUDA GPU: use --tier cpu or auto'}")
    return requested


# What the sandbox's server imports once for all the calls of a lab that requires
# (lab.toml) each distribution: seconds of CPU that each call would otherwise pay.
# torch._dynamo comes with the first optimizer; mpi4py is not here, since its ranks
# are new processes started by mpiexec.
PRELOAD = {"torch": ("torch", "torch.distributed", "torch._dynamo"), "numba": ("numba", "numba.cuda")}


# What a call imports for each distribution a lab requires: the readiness proof
# (autograder.sandbox.readiness) imports these in a fresh Python, as the student's user,
# before any check runs. The compilers' wheels are folders of programs and libraries
# that share one package folder (nvidia/cu13): importing it proves that folder readable.
_CUDA_13 = ("nvidia.cu13",)
IMPORTS = {"numba": ("numba",), "numba-cuda": ("numba.cuda",), "cuda-bindings": ("cuda.bindings",),
           "nvidia-cuda-nvcc": _CUDA_13, "nvidia-nvvm": _CUDA_13, "nvidia-cuda-nvrtc": _CUDA_13,
           "nvidia-cuda-runtime": _CUDA_13, "torch": ("torch", "torch.distributed"), "mpi4py": ("mpi4py.MPI",)}


def ready_to_grade(labs: list[Lab], tier: str = "cpu") -> isolation.Isolation:
    """The isolation layer that grades ``labs`` here, once proven able to: raises
    ``IncompleteEnvironment`` (exit 2) with the cause and the remedy when this machine
    lacks a package the labs need, or when student code could not import what they need
    (``proven_layer``), or on the GPU tier when a stack the labs run on the device cannot
    run one tiny kernel on this card (``preflight``): no score from a machine that cannot grade."""
    for lab in labs:
        lacking = missing_stack(lab)
        if lacking:
            raise IncompleteEnvironment(f"this machine cannot grade lab {lab.slug}: {lacking}")
    layer = proven_layer(labs)
    if tier == "gpu":
        from autograder.grading import preflight

        preflight.preflight(labs, layer)
    return layer


def proven_layer(labs: list[Lab]) -> isolation.Isolation:
    """The strongest isolation layer here, in which a fresh Python, as the student's user,
    imports what the calls of ``labs`` need (``autograder.sandbox.readiness``)."""
    from autograder.sandbox import readiness

    try:
        layer = isolation.detect()
    except RuntimeError as exc:
        raise IncompleteEnvironment(str(exc)) from None
    modules = tuple(dict.fromkeys(m for lab in labs for dist in (lab.requires if lab.requires is not None else IMPORTS)
                                  if for_this_platform(dist) and (dist not in COMPILER_WHEELS or _installed(dist))
                                  for m in IMPORTS.get(dist, ())))
    try:
        readiness.prove(layer, modules)
    except readiness.Unready as exc:
        raise IncompleteEnvironment(f"this machine cannot grade {', '.join(lab.number for lab in labs)}: {exc}") \
            from None
    return layer


def child_environment(tier: str, lab: Lab | None = None) -> dict[str, str]:
    env = {"K2C_TIER": tier}
    if lab and lab.refuse:
        env[refuse.ENV] = json.dumps({"names": list(lab.refuse), "why": lab.refuse_why})
    if tier == "cpu":
        env["NUMBA_ENABLE_CUDASIM"] = "1"
        # Races must have threads to race with, even on a small machine.
        if (os.cpu_count() or 1) < 4:
            env["NUMBA_NUM_THREADS"] = "4"
        if lab and "mpich" in (lab.requires or ()):
            # MPICH's ranks wait for a message by spinning. Here they outnumber the cores (lab 06
            # runs 8 on 2), so a waiting rank burns the slice its sender needs, and a deadlocked
            # job holds every core until its timeout. Sleeping instead costs about 0.1 ms a
            # message, which no CPU-tier check times (lectures and benchmarks keep the spin).
            env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1"
    else:
        env["NUMBA_ENABLE_CUDASIM"] = "0"
    if lab:
        env["K2C_PRELOAD"] = ",".join(m for r in lab.requires or () for m in PRELOAD.get(r, ()))
        if "torch" in (lab.requires or ()):
            # One OpenMP thread, as course.dist gives its ranks: several processes share few
            # cores, and then a job's ranks can be forked from the call (course.dist._can_fork_here).
            env["OMP_NUM_THREADS"] = "1"
    return env


def grade(lab: Lab, submission_root: Path, tier: str, timeout_s: float | None = None,
          select: str | None = None, on_result=None, sandbox_for=None, dry_run_gpu: bool = False,
          budget_s: float | None = None) -> LabResult:
    """Grade ``submission_root`` (a folder or a ``.zip``, in any shape ``locate`` knows) on
    ``lab``'s checks (those ``select``, a ``-k`` expression, picks). With none of the lab's
    files in it, no check runs and the result's status is ``missing``.
    ``timeout_s``: each call's limit (default: the lab's); ``budget_s``: the most this grading
    spends in the student's code (default: ``grade_budget_s``).
    ``sandbox_for``: see ``Submission``; None gives this grading a sandbox of its own.
    ``dry_run_gpu`` (CPU tier): the GPU tier's checks run at tiny sizes on stand-in devices
    and are reported as skipped, awarding nothing (``GradingPlugin``)."""
    from autograder.grading.where import graded_on

    if dry_run_gpu and tier != "cpu":
        raise UsageError(f"a dry run of the GPU tier runs on the CPU tier, not the {tier.upper()} tier")
    result = _grade_submission(lab, Path(submission_root), tier, timeout_s, select, on_result, sandbox_for,
                               dry_run_gpu, budget_s)
    result.graded_on = graded_on(tier)
    return result


def _grade_submission(lab, submission_root, tier, timeout_s, select, on_result, sandbox_for,
                      dry_run_gpu, budget_s) -> LabResult:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="k2c-grade-") as tmp:
        scratch = Path(tmp).resolve()
        root, shown_from = submission_root, None  # shown_from: a zip's unpacked top
        if submission_root.is_file() and submission_root.suffix.lower() == ".zip":
            top = scratch / "unpacked"
            try:
                root = unpack(submission_root, top)
            except Unreadable as exc:
                raise UsageError(str(exc)) from None
            shown_from = top
        elif submission_root.exists() and not submission_root.is_dir():
            raise UsageError(f"submission {str(submission_root)!r} is neither a folder nor a .zip")
        found = locate(lab, root, shown_from)
        if found.folder is None:
            return _missing(lab, tier, select, found, submission_root, start)
        graded = with_used_files(lab, found.folder, found.root, scratch / "uses")
        # A zip's files are graded from a folder that is gone once this returns: the report names the zip.
        where = found.folder
        if shown_from is not None:
            inside = found.folder.relative_to(shown_from).as_posix()
            where = submission_root.resolve() if inside == "." else Path(f"{submission_root.resolve()}!/{inside}")
        return _grade_folder(lab, where, graded, found.missing_message(where), tier, timeout_s, select, on_result,
                             start, sandbox_for, dry_run_gpu, budget_s)


def _missing(lab: Lab, tier: str, select: str | None, found: Found, shown: Path, start: float) -> LabResult:
    """The result for a submission without any of the lab's files: no check runs (nothing
    of the student's to call), but they are collected, so the maximum is the lab's and a
    broken install still fails here as it would grading."""
    checks = list_checks(lab, select)
    if select and not checks:
        raise NoCheckSelected(f"no check of lab {lab.slug} matches -k {select!r} (k2c grade {lab.number} --list "
                              "shows their names)")
    top = sum(c.max_points for c in checks if tier == "gpu" or not c.gpu)
    return LabResult(lab.slug, lab.title, tier, str(shown.resolve()), [], time.monotonic() - start, {},
                     lab.checks_digest(), 0.0, LabStatus.MISSING, tuple(lab.files), found.searched, top)


@dataclass(frozen=True)
class CheckInfo:
    name: str
    title: str
    max_points: float
    gpu: bool  # graded on the GPU tier only
    hidden: bool = False  # in a file of lab.toml's ``hidden``: not in the student repository


def _pytest_args(lab: Lab, select: str | None = None) -> list[str]:
    args = [str(lab.checks_dir), "-c", os.devnull, "--rootdir", str(lab.checks_dir),
            "-o", "python_files=check_*.py", "-o", "python_functions=check_*",
            # Only the grading plugin: entry-point plugins of whatever is installed
            # (nbval takes ~6 s to import; pytest-randomly would reorder checks)
            # have no say in a grade.
            "--disable-plugin-autoload",
            "-p", "no:cacheprovider", "-p", "no:stepwise", "--import-mode=importlib",
            "-q", "--no-header", "-W", "ignore::pytest.PytestAssertRewriteWarning"]
    return args + (["-k", select] if select else [])


def list_checks(lab: Lab, select: str | None = None) -> list[CheckInfo]:
    """The lab's checks, in grading order, without running one (``k2c grade --list``)."""
    class Collector:
        def __init__(self):
            self.found: list[CheckInfo] = []

        def pytest_configure(self, config):
            register_marks(config)

        def pytest_collection_finish(self, session):
            for item in session.items:
                marker = item.get_closest_marker("points")
                self.found.append(CheckInfo(item.name.removeprefix("check_"), check_title(item),
                                            float(marker.args[0]) if marker else 1.0,
                                            item.get_closest_marker("gpu") is not None,
                                            item.path.name in lab.hidden))

    collector = Collector()
    log = io.StringIO()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        code = pytest.main([*_pytest_args(lab, select), "--collect-only"], plugins=[collector])
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        raise UsageError(f"the checks of lab {lab.slug} could not be collected (pytest exit {int(code)}):\n"
                         + log.getvalue()[-2000:])
    return collector.found


def grade_budget_s(call_limit_s: float) -> float:
    """The most one grading's calls run, all together, by default: ``BUDGET_CALL_LIMITS``
    call limits, and at least ``BUDGET_FLOOR_S``. A reference spends a fraction of one limit
    (its calls take seconds, the limits are generous), so only code that hangs or crawls in
    call after call reaches it."""
    return max(BUDGET_CALL_LIMITS * call_limit_s, BUDGET_FLOOR_S)


def _grade_folder(lab, folder, graded, missing, tier, timeout_s, select, on_result, start,
                  sandbox_for=None, dry_run_gpu=False, budget_s=None) -> LabResult:
    layer = ready_to_grade([lab], tier)
    limits = Limits(timeout_s=timeout_s or lab.timeout_s, memory_mb=lab.memory_mb,
                    address_space=(tier == "cpu"), devices=(tier == "gpu"))
    submission = Submission(graded, lab.checks_dir / "harness.py", tier, limits, child_environment(tier, lab),
                            sandbox_for, budget_s or grade_budget_s(limits.timeout_s))
    args = _pytest_args(lab, select)
    log = io.StringIO()
    try:
        if not missing:  # a file that does not import fails every check with the same one line
            missing = submission.import_failure([Path(f).stem for f in lab.files if f.endswith(".py")]) or None
        plugin = GradingPlugin(submission, tier, missing, on_result, seed=seeds.draw(), dry_run_gpu=dry_run_gpu)
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            code = pytest.main(args, plugins=[plugin])
    finally:
        submission.close()
    if submission.cannot_grade:
        raise IncompleteEnvironment(f"this machine cannot grade lab {lab.slug}: {submission.cannot_grade}")
    if code == pytest.ExitCode.NO_TESTS_COLLECTED and select:
        raise NoCheckSelected(f"no check of lab {lab.slug} matches -k {select!r} (k2c grade {lab.number} --list "
                              "shows their names)")
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED) and not plugin.results:
        raise UsageError(f"the checks of lab {lab.slug} could not run (pytest exit {int(code)}):\n"
                         + log.getvalue()[-2000:])
    result = LabResult(lab.slug, lab.title, tier, str(folder), plugin.results, time.monotonic() - start,
                       layer.as_dict(), lab.checks_digest(), submission.calls_s[0])
    result.gpu_dry_run = dry_run_gpu
    result.flags = flags.running_flags(submission.flags) + flags.static_flags(graded)
    result.seed = plugin.grading_seed
    return result
