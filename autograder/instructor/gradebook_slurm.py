"""``k2c grade-class --slurm``: the class as a SLURM job array.

The submitting process writes a manifest of the submissions to grade and a
batch script into the run's scratch folder (beside the gradebook, so it must be
on a file system the nodes share), submits it with ``sbatch --wait``, and while
it waits turns each row a task has written into a gradebook row. Task ``i``
grades chunk ``i`` of the manifest, one ``k2c grade`` process per submission,
exactly as a local run does (``python -m autograder.instructor.gradebook_slurm MANIFEST i``).
A submission whose task left no row (the task was killed, the node died) gets a
``crashed`` row naming the task's log.

The site's settings (partition, account, time, CPUs and memory per task, any
other ``sbatch`` option) come from ``k2c-slurm.toml`` (``--slurm-config``) and
the command line, which wins; the batch script shows each as an ``#SBATCH``
line. The GPU tier's tasks take the file's ``[gpu]`` table over its top level
(a GPU partition, ``gres = "gpu:1"`` or ``gpus = 1``; ``--gres gpu:1`` when
nothing asks for a GPU); the CPU tier's ask for no GPU. Each task checks its node
before grading: on the GPU tier, that CUDA sees the GPU it was granted; and the
isolation layer: a node without bubblewrap grades nothing unless
``--allow-weak-isolation``.
"""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from autograder.instructor.gradebook import Row, RowStatus, Settings, grade_one, node_and_job, safely
from autograder.grading.labs import UsageError

POLL_S = 1.0
CONFIG = "k2c-slurm.toml"  # read from the current folder when --slurm-config is not given
NO_SBATCH = ("SLURM's sbatch is not on PATH: on a cluster, run k2c on a node that submits jobs (a login node); "
             "on one machine, `sudo scripts/slurm-localhost.sh start` installs SLURM and starts a one-node cluster")
# SLURM's own forms (sbatch(1)): minutes, MM:SS, H:MM:SS, D-H, D-H:MM, D-H:MM:SS; memory a count with K/M/G/T.
TIME_FORM = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}")
MEMORY_FORM = re.compile(r"\d+[KMGT]?", re.IGNORECASE)
# sbatch --gpus=[type:]count and --gres=gpu[:type][:count], as SLURM users write them.
GPUS_FORM = re.compile(r"([A-Za-z][\w.-]*:)?\d+")
GRES_FORM = re.compile(r"gpu(:[A-Za-z][\w.-]*)?(:\d+)?")
DEFAULT_GRES = "gpu:1"  # what a GPU-tier job asks when the site's settings ask for no GPU
GPU_KEYS = ("gpus", "gres")  # the [gpu] table's own; top-level keys may be there too, for the GPU tier


@dataclass(frozen=True)
class SlurmSite:
    """What a site's cluster asks of every job: ``None`` leaves it to the site's defaults."""
    partition: str | None = None
    account: str | None = None
    time: str | None = None  # per array task; default: the grading's own limit for its chunk, plus 5 minutes
    cpus_per_task: int | None = None
    mem: str | None = None  # per task, e.g. "8G"
    options: tuple[str, ...] = ()  # any other sbatch option, as written on its command line ("--qos=short")
    gpus: str | None = None  # the GPU tier's: sbatch --gpus, "[type:]count"
    gres: str | None = None  # the GPU tier's: sbatch --gres, "gpu[:type][:count]"

    def __post_init__(self):
        if self.time is not None and not TIME_FORM.fullmatch(str(self.time)):
            raise UsageError(f"SLURM time {self.time!r}: write minutes (90), H:MM:SS (1:30:00) or D-HH (1-00)")
        if self.mem is not None and not MEMORY_FORM.fullmatch(str(self.mem)):
            raise UsageError(f"SLURM memory {self.mem!r}: write a size such as 4G or 4096M")
        if self.cpus_per_task is not None and (not isinstance(self.cpus_per_task, int) or self.cpus_per_task < 1):
            raise UsageError(f"SLURM cpus-per-task {self.cpus_per_task!r}: a whole number, 1 or more")
        bad = [o for o in self.options if not str(o).startswith("-") or "\n" in str(o)]
        if bad:
            raise UsageError(f"SLURM options {bad}: each an sbatch option as on its command line (--qos=short)")
        if self.gpus is not None and not GPUS_FORM.fullmatch(str(self.gpus)):
            raise UsageError(f"SLURM gpus {self.gpus!r}: a count (1) or type:count (a100:1), as sbatch --gpus takes")
        if self.gres is not None and not GRES_FORM.fullmatch(str(self.gres)):
            raise UsageError(f"SLURM gres {self.gres!r}: gpu:COUNT or gpu:TYPE:COUNT (gpu:1, gpu:a100:1), "
                             "as sbatch --gres takes")
        if self.gpus is not None and self.gres is not None:
            raise UsageError(f"SLURM gpus {self.gpus!r} and gres {self.gres!r}: ask for the GPUs one way, not both")

    @staticmethod
    def read(path: Path) -> tuple[dict, dict]:
        """A ``k2c-slurm.toml``'s settings, as SlurmSite's fields: its top level (partition,
        account, time, cpus-per-task, mem, options) and its ``[gpu]`` table (the same keys,
        and gpus or gres), each checked for unknown keys."""
        import tomllib

        try:
            data = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise UsageError(f"cannot read the SLURM settings {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise UsageError(f"{path} is not TOML: {exc}") from None
        known = {f.name.replace("_", "-"): f.name for f in fields(SlurmSite)}
        gpu = data.pop("gpu", {})
        if not isinstance(gpu, dict):
            raise UsageError(f"{path}: gpu is a table of the GPU tier's settings ([gpu], then gres = \"gpu:1\")")
        misplaced = sorted(set(data) & set(GPU_KEYS))
        if misplaced:
            raise UsageError(f"{path}: {', '.join(misplaced)} at the top level; GPUs are the GPU tier's, so they go "
                             "in its [gpu] table (the CPU tier asks for no GPU)")
        for where, table in (("", data), ("[gpu] ", gpu)):
            unknown = sorted(set(table) - set(known))
            if unknown:
                allowed = sorted(set(known) - (set() if where else set(GPU_KEYS))) + ([] if where else ["[gpu]"])
                raise UsageError(f"{path}: unknown SLURM settings {where}{unknown}; the settings are {allowed}")

        def values(table):
            return {known[k]: (tuple(v) if k == "options" else (str(v) if k in ("time", "gpus") else v))
                    for k, v in table.items()}
        return values(data), values(gpu)

    @classmethod
    def resolve(cls, config: str | None, tier: str = "cpu", **given) -> tuple["SlurmSite", str]:
        """The settings of ``config`` (else ``./k2c-slurm.toml`` when there is one) for a job of
        ``tier``, with the command line's ``given`` (not None) over them; and where they came
        from, in words. On the GPU tier ``gpu_partition`` is the partition, given GPUs
        replace the file's, and a job that asks for no GPU asks ``--gres=gpu:1``; on the
        CPU tier a GPU setting is a usage error."""
        path = Path(config) if config else Path(CONFIG)
        read = bool(config) or path.exists()
        top, gpu = cls.read(path) if read else ({}, {})
        given = {k: v for k, v in given.items() if v is not None}
        asked = [k for k in ("gpus", "gres", "gpu_partition") if k in given]
        if tier != "gpu" and asked:
            raise UsageError(f"{', '.join('--' + k.replace('_', '-') for k in asked)} asks for a GPU, but the CPU tier "
                             "grades without one: give --tier gpu (or leave --tier out)")
        values = dict(top)
        if tier == "gpu":
            values |= gpu
            if "gpus" in given or "gres" in given:  # the command line's GPUs, not the file's as well
                values.pop("gpus", None)
                values.pop("gres", None)
            if "gpu_partition" in given:
                given["partition"] = given.pop("gpu_partition")
        values |= given
        defaulted = tier == "gpu" and not values.get("gpus") and not values.get("gres")
        if defaulted:
            values["gres"] = DEFAULT_GRES
        origin = " and ".join(([str(path)] if read else []) + (["the command line"] if given else []))
        origin = origin or "the site's defaults (no k2c-slurm.toml, no options)"
        if defaulted:
            origin += f"; --gres={DEFAULT_GRES}, the GPU tier's default"
        return cls(**values), origin

    def sbatch_lines(self, minutes: int) -> list[str]:
        lines = [f"--partition={self.partition}" if self.partition else "",
                 f"--account={self.account}" if self.account else "",
                 f"--time={self.time or minutes}",
                 f"--cpus-per-task={self.cpus_per_task}" if self.cpus_per_task else "",
                 f"--mem={self.mem}" if self.mem else "",
                 f"--gpus={self.gpus}" if self.gpus else "", f"--gres={self.gres}" if self.gres else "", *self.options]
        return [f"#SBATCH {line}" for line in lines if line]

    def srun_args(self) -> list[str]:
        """The same settings for a one-off ``srun`` (``k2c doctor``'s probe of a node)."""
        return [line.removeprefix("#SBATCH ") for line in self.sbatch_lines(2) if "--time=" not in line] + ["--time=2"]


def slurm_tier(requested: str, gpu_asked: bool) -> str:
    """The tier a SLURM job grades on, decided here and not by this (login) node's GPU:
    ``gpu`` for ``--tier gpu``, or for ``auto`` with a GPU setting on the command line
    (``--gpus``, ``--gres``, ``--gpu-partition``); else ``cpu``: a node's GPU is not the
    job's unless the job asked for it."""
    if requested == "auto":
        return "gpu" if gpu_asked else "cpu"
    return requested


def batch_script(manifest: Path, tasks: int, throttle: int | None, minutes: int,
                 site: SlurmSite = SlurmSite(), origin: str = "") -> str:
    work = manifest.parent
    array = f"0-{tasks - 1}" + (f"%{throttle}" if throttle else "")
    command = " ".join(map(shlex.quote, [sys.executable, "-m", "autograder.instructor.gradebook_slurm", str(manifest)]))
    return "\n".join([
        "#!/bin/bash",
        "# Written by k2c grade-class --slurm: one array task per chunk of submissions.",
        f"# The site's settings come from {origin or 'the site defaults'}.",
        "#SBATCH --job-name=k2c-grade",
        f"#SBATCH --array={array}",
        "#SBATCH --ntasks=1",
        *site.sbatch_lines(minutes),
        f"#SBATCH --output={work}/task-%a.log",
        # The grader's own Python and the course: the nodes see the same paths.
        f"cd {shlex.quote(os.getcwd())}",
        f'exec {command} "$SLURM_ARRAY_TASK_ID"',
        "",
    ])


def array_runner(chunk: int, site: SlurmSite = SlurmSite(), origin: str = "", allow_weak_isolation: bool = False):
    """``grade_class``'s way to grade its rows as a job array of ``chunk`` submissions a task."""
    return lambda todo, settings, scratch, jobs, record: run_array(todo, settings, scratch, jobs, chunk, record,
                                                                   site, origin, allow_weak_isolation)


def run_array(todo, settings: Settings, scratch: Path, jobs: int | None, chunk: int, record,
              site: SlurmSite = SlurmSite(), origin: str = "", allow_weak_isolation: bool = False) -> None:
    if not todo:
        return
    sbatch = shutil.which("sbatch")
    if not sbatch:
        raise UsageError(f"--slurm: {NO_SBATCH}")
    chunk = max(1, chunk)
    chunks = [todo[i:i + chunk] for i in range(0, len(todo), chunk)]
    (scratch / "rows").mkdir(exist_ok=True)
    manifest = scratch / "manifest.json"
    manifest.write_text(json.dumps({"settings": asdict(settings), "allow_weak_isolation": allow_weak_isolation,
                                    "chunks": [
        [{"student": s, "folder": str(p), "digest": d} for s, p, d in part] for part in chunks]}))
    minutes = math.ceil(settings.limit_s * chunk / 60) + 5
    script = scratch / "grade-class.sbatch"
    script.write_text(batch_script(manifest, len(chunks), jobs, minutes, site, origin))
    tasks = f"{len(chunks)} task" + ("s" if len(chunks) > 1 else "")
    sys.stderr.write(f"submitting {script} ({tasks}, {settings.tier.upper()} tier; " + ", ".join(
        line.removeprefix("#SBATCH --") for line in site.sbatch_lines(minutes)) + f"; from {origin})\n")
    submitted = {}

    def submit():
        submitted["proc"] = subprocess.run([sbatch, "--wait", "--parsable", str(script)],
                                           capture_output=True, text=True)

    waiter = threading.Thread(target=submit, daemon=True)
    waiter.start()
    seen: set[str] = set()
    while True:
        finished = not waiter.is_alive()
        for path in sorted((scratch / "rows").glob("*.json")):
            if path.name not in seen:
                seen.add(path.name)
                record(Row.from_dict(json.loads(path.read_text())))
        if finished:
            break
        time.sleep(POLL_S)
    proc = submitted["proc"]
    if proc.returncode != 0 and not seen:
        raise UsageError(f"sbatch failed (exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()[-500:]}")
    graded = {name.removesuffix(".json") for name in seen}
    for index, part in enumerate(chunks):
        for student, _, sha in part:
            if _row_name(student) not in graded:
                record(Row(student, sha, RowStatus.CRASHED, tier=settings.tier,
                           message=f"SLURM task {index} left no row (its log: {scratch / f'task-{index}.log'})"))


def _row_name(student: str) -> str:
    return student.replace("/", "_")


def node_refusal(lab_slug: str, allow_weak_isolation: bool, tier: str = "cpu") -> str:
    """Why this node must not grade ("" when it may): on the GPU tier, CUDA cannot use a GPU
    here (none granted, or a granted one without a working driver: grading on would be
    the CPU tier's checks under the GPU tier's name); it cannot grade the lab at all (the
    readiness proof); or it gives no layer that hides the other students' files
    (bubblewrap), unless the instructor allowed the weaker one."""
    from autograder.grading.labs import UsageError, find_lab
    from autograder.grading.runner import ready_to_grade
    from autograder.grading.where import no_usable_gpu, node

    if tier == "gpu":
        missing = no_usable_gpu()
        if missing:
            return f"the GPU tier cannot run here: {missing}"
    try:
        layer = ready_to_grade([find_lab(lab_slug)], tier)
    except UsageError as exc:
        return f"node {node()} cannot grade: {exc}"
    if layer.hides_files or allow_weak_isolation:
        return ""
    return (f"node {node()} grades under the {layer.layer.value} layer, where student code could read "
            f"its classmates' submissions: install bubblewrap on the nodes (or pass --allow-weak-isolation)")


def run_task(manifest: Path, index: int) -> int:
    data = json.loads(Path(manifest).read_text())
    settings = Settings(**data["settings"])
    rows = Path(manifest).parent / "rows"
    refused = node_refusal(settings.lab, data.get("allow_weak_isolation", False), settings.tier)
    for item in data["chunks"][index]:
        student, folder, sha = item["student"], Path(item["folder"]), item["digest"]
        if refused:
            row = Row(student, sha, RowStatus.CRASHED, tier=settings.tier, message=refused, **node_and_job())
        else:
            row = safely(student, sha, settings, lambda: grade_one(student, folder, sha, settings, rows.parent))
        tmp = rows / f".{_row_name(student)}.tmp"
        tmp.write_text(json.dumps(row.as_dict()))
        os.replace(tmp, rows / f"{_row_name(student)}.json")  # whole or absent: the submitter polls this folder
        print(f"{student}: {row.status.value} {row.score:g}/{row.max_score if row.max_score is not None else '-'}",
              flush=True)
    if refused:
        print(refused, file=sys.stderr)
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(run_task(Path(sys.argv[1]), int(sys.argv[2])))
