"""``k2c grade-class --slurm``: the class as a SLURM job array.

The submitting process writes a manifest of the submissions to grade and a
batch script into the run's scratch folder (beside the gradebook, so it must be
on a file system the nodes share), submits it with ``sbatch --wait``, and while
it waits turns each row a task has written into a gradebook row. Task ``i``
grades chunk ``i`` of the manifest, one ``k2c grade`` process per submission,
exactly as a local run does (``python -m autograder.instructor.gradebook_slurm MANIFEST i``).
A submission whose task left no row (the task was killed, the node died) gets a
``crashed`` row naming the task's log.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from autograder.instructor.gradebook import Row, RowStatus, Settings, grade_one, safely
from autograder.grading.labs import UsageError

POLL_S = 1.0


def batch_script(manifest: Path, tasks: int, throttle: int | None, minutes: int) -> str:
    work = manifest.parent
    array = f"0-{tasks - 1}" + (f"%{throttle}" if throttle else "")
    command = " ".join(map(shlex.quote, [sys.executable, "-m", "autograder.instructor.gradebook_slurm", str(manifest)]))
    return "\n".join([
        "#!/bin/bash",
        "#SBATCH --job-name=k2c-grade",
        f"#SBATCH --array={array}",
        "#SBATCH --ntasks=1",
        f"#SBATCH --time={minutes}",
        f"#SBATCH --output={work}/task-%a.log",
        # The grader's own Python and the course: the nodes see the same paths.
        f"cd {shlex.quote(os.getcwd())}",
        f'exec {command} "$SLURM_ARRAY_TASK_ID"',
        "",
    ])


def array_runner(chunk: int):
    """``grade_class``'s way to grade its rows as a job array of ``chunk`` submissions a task."""
    return lambda todo, settings, scratch, jobs, record: run_array(todo, settings, scratch, jobs, chunk, record)


def run_array(todo, settings: Settings, scratch: Path, jobs: int | None, chunk: int, record) -> None:
    if not todo:
        return
    sbatch = shutil.which("sbatch")
    if not sbatch:
        raise UsageError("--slurm needs SLURM's sbatch on PATH (on one machine: scripts/slurm-localhost.sh start)")
    chunk = max(1, chunk)
    chunks = [todo[i:i + chunk] for i in range(0, len(todo), chunk)]
    (scratch / "rows").mkdir(exist_ok=True)
    manifest = scratch / "manifest.json"
    manifest.write_text(json.dumps({"settings": asdict(settings), "chunks": [
        [{"student": s, "folder": str(p), "digest": d} for s, p, d in part] for part in chunks]}))
    minutes = math.ceil(settings.limit_s * chunk / 60) + 5
    script = scratch / "grade-class.sbatch"
    script.write_text(batch_script(manifest, len(chunks), jobs, minutes))
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


def run_task(manifest: Path, index: int) -> None:
    data = json.loads(Path(manifest).read_text())
    settings = Settings(**data["settings"])
    rows = Path(manifest).parent / "rows"
    for item in data["chunks"][index]:
        student, folder, sha = item["student"], Path(item["folder"]), item["digest"]
        row = safely(student, sha, settings, lambda: grade_one(student, folder, sha, settings, rows.parent))
        tmp = rows / f".{_row_name(student)}.tmp"
        tmp.write_text(json.dumps(row.as_dict()))
        os.replace(tmp, rows / f"{_row_name(student)}.json")  # whole or absent: the submitter polls this folder
        print(f"{student}: {row.status.value} {row.score:g}/{row.max_score if row.max_score is not None else '-'}",
              flush=True)


if __name__ == "__main__":
    run_task(Path(sys.argv[1]), int(sys.argv[2]))
