"""``k2c grade LAB --slurm``: one submission graded in one SLURM job.

The submission is copied into a scratch folder in the current folder, which the
nodes must see at the same path, as they see the course's Python (a shared file
system): what is graded is what was there when it was submitted, however long
the job waits. A batch script there runs, on a node, exactly the ``k2c grade``
this command would have run here, with its report, its text and its exit status
written into the scratch folder. ``sbatch --wait`` waits for the job while its
log (the progress marks) is copied to standard error; then the report goes where
``k2c grade`` would have put it, and its exit status is this command's. A job that
ends without that status (cancelled, past its time, its node lost) is an
infrastructure error: exit 2, naming the job's log, which is kept.

On the GPU tier the job asks for a GPU (``SlurmSite.resolve``); ``k2c grade
--tier gpu`` on a node where CUDA cannot use one stops with exit 2 and says what
SLURM granted, so a missing GPU is never graded as the student's zero.
"""
from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from autograder.grading.labs import CLUTTER, UsageError
from autograder.instructor.gradebook_slurm import NO_SBATCH, POLL_S, SlurmSite

MINUTES_PER_LAB = 60  # the job's --time when the site gives none: per lab graded, plus 5 minutes


def grade_in_job(args, labs, tier: str, site: SlurmSite, origin: str) -> int:
    """Grade ``args.submission`` as ``k2c grade args.lab`` would, in one SLURM job; its exit status."""
    from autograder.cli import _append, _default_submission
    from autograder.grading.report import write_results

    sbatch = shutil.which("sbatch")
    if not sbatch:
        raise UsageError(f"--slurm: {NO_SBATCH}")
    source = Path(args.submission) if args.submission else _default_submission()
    if not source.exists():
        raise UsageError(f"submission folder {str(source)!r} does not exist")
    try:
        scratch = Path(tempfile.mkdtemp(prefix=".k2c-grade-", dir=Path.cwd()))
    except OSError as exc:
        raise UsageError(f"--slurm: cannot make the job's scratch folder in {Path.cwd()} ({exc.strerror}): run k2c "
                         "from a folder you can write on the file system the nodes share") from None
    keep = False  # the scratch folder, when it holds the log of a job that ended too soon
    try:
        copy = _copy(source, scratch / "submission", scratch)
        minutes = MINUTES_PER_LAB * len(labs) + 5
        script = scratch / "grade.sbatch"
        script.write_text(job_script(args, labs, tier, copy, source, scratch, minutes, site, origin))
        sys.stderr.write(f"submitting {script} ({tier.upper()} tier; " + ", ".join(
            line.removeprefix("#SBATCH --") for line in site.sbatch_lines(minutes)) + f"; from {origin})\n")
        job, ended = _run(sbatch, script, scratch / "job.log")
        status = scratch / "status"
        if not status.exists():
            keep = True
            raise UsageError(f"SLURM job {job or '(none)'} ended before k2c grade did ({ended}); its log: "
                             f"{scratch / 'job.log'} (kept)")
        code = int(status.read_text().strip() or 2)
        sys.stdout.write((scratch / "stdout").read_text())
        if args.output and (scratch / "report").exists():
            write_results(args.output, (scratch / "report").read_text())
        if args.summary and (scratch / "summary.md").exists():
            _append(args.summary, (scratch / "summary.md").read_text())
        return code
    finally:
        if not keep:
            shutil.rmtree(scratch, ignore_errors=True)


def _copy(source: Path, into: Path, scratch: Path) -> Path:
    """A copy of the submission (a folder, without version control, caches or the scratch
    folder itself; or a zip, which the node unpacks as k2c grade does) under ``into``."""
    into.mkdir()
    target = into / (source.resolve().name or "submission")
    if source.is_file():
        shutil.copy2(source, target)
        return target
    skip = scratch.resolve()
    shutil.copytree(source, target, symlinks=True, ignore=lambda folder, names: [
        n for n in names if n in CLUTTER or (Path(folder) / n).resolve() == skip])
    return target


def job_script(args, labs, tier: str, copy: Path, source: Path, scratch: Path, minutes: int,
               site: SlurmSite, origin: str) -> str:
    """The batch script: the ``k2c grade`` of ``args`` on the copy, its report and its text
    into ``scratch``, and then its exit status, the last thing the job writes."""
    command = [sys.executable, "-m", "autograder.cli", "grade", args.lab, "--submission", str(copy),
               "--shown-as", str(source.resolve()), "--tier", tier, "--format", args.format]
    if args.output:
        command += ["-o", str(scratch / "report")]
    if args.summary:
        command += ["--summary", str(scratch / "summary.md")]
    if args.timeout:
        command += ["--timeout", str(args.timeout)]
    if getattr(args, "budget", None):
        command += ["--budget", str(args.budget)]
    if args.k:
        command += ["-k", args.k]
    if args.require_full:
        command.append("--require-full")
    if getattr(args, "dry_run_gpu", False):
        command.append("--dry-run-gpu")
    quoted = " ".join(map(shlex.quote, command))
    return "\n".join([
        "#!/bin/bash",
        f"# Written by k2c grade --slurm: lab {', '.join(lab.slug for lab in labs)} of {source.resolve()},",
        f"# graded on the {tier.upper()} tier from its copy beside this script.",
        f"# The site's settings come from {origin}.",
        f"#SBATCH --job-name=k2c-grade-{labs[0].number if len(labs) == 1 else 'labs'}",
        "#SBATCH --ntasks=1",
        *site.sbatch_lines(minutes),
        f"#SBATCH --output={scratch}/job.log",
        # The grader's own Python and the course: the nodes see the same paths.
        f"cd {shlex.quote(str(Path.cwd()))}",
        f"{quoted} > {shlex.quote(str(scratch / 'stdout'))}",
        f"echo $? > {shlex.quote(str(scratch / 'status.tmp'))} && "
        f"mv {shlex.quote(str(scratch / 'status.tmp'))} {shlex.quote(str(scratch / 'status'))}",
        "",
    ])


def _run(sbatch: str, script: Path, log: Path) -> tuple[str, str]:
    """Submit the script with ``sbatch --wait`` and wait, copying the job's log to standard
    error as it grows; the job's id and how sbatch ended, in words. Ctrl-C cancels the job."""
    proc = subprocess.Popen([sbatch, "--wait", "--parsable", str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    job = (proc.stdout.readline().strip().split(";")[0]) if proc.stdout else ""
    if job:
        sys.stderr.write(f"SLURM job {job}: waiting for it (squeue -j {job}; scancel {job} stops it)\n")
    shown = 0
    try:
        while True:
            finished = proc.poll() is not None
            shown = _show_new(log, shown)
            if finished:
                break
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        if job:
            subprocess.run(["scancel", job], capture_output=True)
            sys.stderr.write(f"\ncancelled SLURM job {job}\n")
        proc.kill()
        raise
    err = proc.stderr.read().strip() if proc.stderr else ""
    if not job:
        raise UsageError(f"sbatch refused the job (exit {proc.returncode}): {err[-500:] or 'no reason given'}")
    return job, f"sbatch --wait exit {proc.returncode}" + (f": {err[-300:]}" if err else "")


def _show_new(log: Path, shown: int) -> int:
    """Copy what the log gained since byte ``shown`` to standard error; the new offset."""
    try:
        with open(log, "rb") as f:
            f.seek(shown)
            new = f.read()
    except OSError:
        return shown
    if new:
        sys.stderr.write(new.decode(errors="replace"))
        sys.stderr.flush()
    return shown + len(new)
