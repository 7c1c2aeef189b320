"""Grade a whole class: one lab, a folder of submissions, one gradebook.

``k2c grade-class LAB DIR`` grades every submission in DIR (a folder or a zip
per student, named by the student's id). Each is graded by a ``k2c grade``
process of its own, whose calls into student code run in the sandbox, N at a
time. The gradebook is a CSV (one row per student) with a JSON of the full
reports beside it, rewritten after every row, so an interrupted run loses
nothing and ``--resume`` picks it up: a submission whose digest is already
graded is not graded again. Every submission gets its row, whatever happened:

``graded``      the grader ran to the end; the score is the submission's
``missing``     none of the lab's files is in the submission, in any shape the
                grader knows (the lab's files, ``NN-slug/``, ``labs/NN-slug/``,
                each perhaps in one wrapping folder): no check ran, scored 0,
                the message lists the folders looked in. Never ``graded`` 0
``empty``       no files at all
``unreadable``  a zip that cannot be unpacked safely (the message says why)
``crashed``     the grading process failed (never the student's code: that runs
                in the sandbox); scored 0, the message says how
``timeout``     the grading process ran past its limit; scored 0

With ``--slurm`` the gradings run as a SLURM job array, one task per chunk of
submissions, and the same gradebook is merged from what the tasks wrote.
"""
from __future__ import annotations

import csv
import enum
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path

from autograder.grading.labs import (CLUTTER as _SKIPPED_PARTS, MAX_MEMBERS, MAX_UNPACKED_BYTES,  # noqa: F401
                                     Lab, Unreadable, UsageError, unpack)
from autograder.grading.runner import LabStatus


class RowStatus(str, enum.Enum):
    """What happened to one submission (the module docstring says what each means).
    ``graded`` and ``missing`` are ``k2c grade``'s own words (``runner.LabStatus``)."""
    GRADED = LabStatus.GRADED.value
    MISSING = LabStatus.MISSING.value
    EMPTY = "empty"
    UNREADABLE = "unreadable"
    CRASHED = "crashed"
    TIMEOUT = "timeout"


@dataclass
class Row:
    student: str
    digest: str
    status: RowStatus
    score: float = 0.0
    max_score: float | None = None
    tier: str = ""
    duration_s: float = 0.0  # the whole grading process, start to end
    student_s: float = 0.0  # of which inside calls into the student's code
    message: str = ""
    report: dict | None = field(default=None, repr=False)  # k2c grade's JSON report
    node: str = ""  # the machine that graded it (report["graded_on"]), and its GPU or "no GPU"
    gpu: str = ""
    slurm_job: str = ""  # with --slurm: the array task, JOB_TASK

    def __post_init__(self):
        where = (self.report or {}).get("graded_on") or {}
        self.node = self.node or where.get("node", "")
        self.gpu = self.gpu or where.get("gpu", "")
        self.slurm_job = self.slurm_job or where.get("slurm_job", "")

    def as_dict(self) -> dict:
        return dict(asdict(self), status=self.status.value)

    @classmethod
    def from_dict(cls, data: dict) -> "Row":
        return cls(**dict(data, status=RowStatus(data["status"])))


# ---------------------------------------------------------------------------
# Finding the submissions

@dataclass(frozen=True)
class Entry:
    student: str
    source: Path  # the folder or zip as found in DIR


def find_submissions(folder: Path) -> list[Entry]:
    """One entry per folder or ``.zip`` in ``folder``, named by the student's id."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"no folder {str(folder)!r}: grade-class takes a folder holding one folder or zip per student")
    entries, seen = [], {}
    for path in sorted(folder.iterdir()):
        if path.name.startswith("."):
            continue
        if path.is_dir() or (path.is_file() and path.suffix.lower() == ".zip"):
            student = path.name if path.is_dir() else path.stem
            if student in seen:
                raise UsageError(f"two submissions for {student!r}: {seen[student].name} and {path.name}; keep one")
            seen[student] = path
            entries.append(Entry(student, path))
    if not entries:
        raise UsageError(f"{folder} holds no submissions: expected one folder or .zip per student, named by the student's id")
    return entries


def digest(folder: Path) -> tuple[str, int]:
    """sha256 over the names and bytes of the submission's files, and how many
    there are: the same files give the same digest, zipped or not."""
    h, count = hashlib.sha256(), 0
    folder = Path(folder)
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if _SKIPPED_PARTS & set(rel.parts) or path.suffix == ".pyc" or path.is_symlink() or not path.is_file():
            continue
        h.update(rel.as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
        count += 1
    return h.hexdigest(), count


# ---------------------------------------------------------------------------
# Grading one submission

@dataclass(frozen=True)
class Settings:
    lab: str  # slug
    tier: str
    timeout_s: float | None = None  # per call into the student's code (k2c grade --timeout)
    select: str | None = None  # k2c grade -k
    limit_s: float = 3600.0  # the whole grading process
    budget_s: float | None = None  # all its calls into the student's code (k2c grade --budget)

    def grade_args(self) -> list[str]:
        args = ["--tier", self.tier]
        if self.timeout_s:
            args += ["--timeout", str(self.timeout_s)]
        if self.budget_s:
            args += ["--budget", str(self.budget_s)]
        if self.select:
            args += ["-k", self.select]
        return args


_running: set[subprocess.Popen] = set()
_running_lock = threading.Lock()


def grade_one(student: str, folder: Path, sha: str, settings: Settings, scratch: Path) -> Row:
    """Grade one submission in a ``k2c grade`` process of its own."""
    out = scratch / f"{sha[:16]}.json"
    command = [sys.executable, "-m", "autograder.cli", "grade", settings.lab, "--submission", str(folder),
               "--format", "json", "-o", str(out), *settings.grade_args()]
    started = time.monotonic()
    # A session of its own: on a timeout or Ctrl-C its whole process group goes.
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    with _running_lock:
        _running.add(proc)
    try:
        _, err = proc.communicate(timeout=settings.limit_s)
    except subprocess.TimeoutExpired:
        _kill(proc)
        proc.communicate()
        return Row(student, sha, RowStatus.TIMEOUT, tier=settings.tier, duration_s=time.monotonic() - started,
                   message=f"grading ran past {settings.limit_s:g} s and was stopped", **node_and_job())
    finally:
        with _running_lock:
            _running.discard(proc)
    duration = time.monotonic() - started
    report = None
    try:
        report = json.loads(out.read_text())
    except (OSError, ValueError):
        pass
    if proc.returncode != 0 or not report or "error" in report:
        why = (report or {}).get("error") or _last_lines(err.decode(errors="replace")) or f"exit status {proc.returncode}"
        return Row(student, sha, RowStatus.CRASHED, tier=settings.tier, duration_s=duration,
                   message=f"grading failed: {why}", **node_and_job())
    if report.get("status") == LabStatus.MISSING.value:
        return Row(student, sha, RowStatus.MISSING, 0.0, report["max_score"], report["tier"], duration, 0.0,
                   report["message"], report)
    return Row(student, sha, RowStatus.GRADED, report["score"], report["max_score"], report["tier"], duration,
               report.get("student_s", 0.0), _summary(report), report)


def node_and_job() -> dict:
    """A row's node and SLURM job where the grading left no report to say them."""
    from autograder.grading.where import node, slurm_job

    return {"node": node(), "slurm_job": slurm_job()}


def _kill(proc: subprocess.Popen) -> None:
    """Kill the grading and everything below it: its sandboxed calls run in
    sessions of their own, so its process group alone is not enough."""
    from autograder.sandbox import group_members, kill_group

    doomed = group_members(proc.pid)
    kill_group(proc.pid)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_alive(pid) for pid in doomed):
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _last_lines(text: str, n: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-n:])


def _summary(report: dict) -> str:
    """A row's message: the one reason every check gave, when they all gave the same
    (a missing file, a syntax error); otherwise nothing, the checks say it."""
    reasons = {t["feedback"].splitlines()[0] for t in report["tests"] if t["status"] != "skipped" and t["feedback"]}
    failed = [t for t in report["tests"] if t["status"] not in ("passed", "skipped")]
    if len(reasons) == 1 and failed and len(failed) == sum(t["status"] != "skipped" for t in report["tests"]):
        return reasons.pop()[:300]
    return ""


def prepare(entry: Entry, scratch: Path) -> tuple[Path | None, Row | None, str]:
    """The folder to grade and its digest, or the row that says why there is none."""
    folder = entry.source
    if entry.source.is_file():
        try:
            folder = unpack(entry.source, scratch / "unpacked" / entry.student)
        except Unreadable as exc:
            sha = hashlib.sha256(entry.source.read_bytes()).hexdigest()
            return None, Row(entry.student, sha, RowStatus.UNREADABLE, message=str(exc)), sha
    sha, count = digest(folder)
    if count == 0:
        return None, Row(entry.student, sha, RowStatus.EMPTY, message="the submission holds no files"), sha
    return folder, None, sha


# ---------------------------------------------------------------------------
# The gradebook

def paths(output: Path) -> tuple[Path, Path]:
    output = Path(output)
    return output, output.with_suffix(".json")


def load_previous(json_path: Path, settings: Settings, checks_sha256: str) -> dict[str, Row]:
    """Rows of an earlier run that still hold: same lab, tier, checks and selection."""
    try:
        data = json.loads(json_path.read_text())
    except (OSError, ValueError):
        return {}
    same = (data.get("lab"), data.get("tier"), data.get("checks_sha256"), data.get("select")) == \
           (settings.lab, settings.tier, checks_sha256, settings.select)
    if not same:
        sys.stderr.write(f"{json_path}: graded with other checks, tier or -k; grading everything again\n")
        return {}
    return {r["student"]: Row.from_dict(r) for r in data.get("rows", [])}


def _weaker_isolation(previous: dict[str, Row]) -> set[str]:
    """The students whose kept row was graded under a weaker isolation layer than this
    machine gives now (bubblewrap installed since): their code ran where it could read
    more, so ``--resume`` grades them again."""
    from autograder.sandbox import isolation

    try:
        now = isolation.detect().layer
    except RuntimeError:
        return set()
    stale = set()
    for student, row in previous.items():
        layer = (row.report or {}).get("isolation", {}).get("layer")
        if layer in {l.value for l in isolation.Layer} and isolation.Layer(layer).weaker_than(now):
            stale.add(student)
    return stale


def write(output: Path, rows: list[Row], settings: Settings, checks_sha256: str) -> None:
    from autograder.grading.report import write_results

    csv_path, json_path = paths(output)
    checks = []  # check names in the order the lab runs them
    for row in rows:
        for test in (row.report or {}).get("tests", []):
            if test["name"] not in checks:
                checks.append(test["name"])
    top = next((r.max_score for r in rows if r.max_score is not None), None)
    buffer = io.StringIO()
    out = csv.writer(buffer)
    out.writerow(["student", "score", "max", "tier", "status", *checks, "isolation", "flags", "node", "gpu",
                  "slurm_job", "duration_s", "digest", "message"])
    for row in sorted(rows, key=lambda r: r.student):
        points = {t["name"]: t["points"] for t in (row.report or {}).get("tests", [])}
        out.writerow([row.student, f"{row.score:g}", "" if top is None else f"{top:g}", row.tier or settings.tier,
                      row.status.value, *(_pts(points.get(name)) for name in checks),
                      (row.report or {}).get("isolation", {}).get("layer", ""), _flags(row),
                      row.node, row.gpu, row.slurm_job, f"{row.duration_s:.1f}", row.digest, row.message])
    write_results(str(csv_path), buffer.getvalue())
    write_results(str(json_path), json.dumps({
        "lab": settings.lab, "tier": settings.tier, "checks_sha256": checks_sha256, "select": settings.select,
        "rows": [r.as_dict() for r in sorted(rows, key=lambda r: r.student)]}, indent=1) + "\n")


def _flags(row: Row) -> str:
    """The row's flags for the instructor, by kind (``autograder.grading.flags.summary``)."""
    from autograder.grading.flags import Found, summary

    found = [Found(f.get("kind", "?"), f.get("detail", ""), f.get("seen", "")) for f in (row.report or {}).get("flags", [])]
    return summary(found)


def _pts(value) -> str:
    return "" if value is None else f"{value:g}"


# ---------------------------------------------------------------------------
# Progress

class Progress:
    """A bar with an ETA on a terminal; one line per submission in a log (CI)."""

    def __init__(self, total: int, stream=None):
        self.total, self.done, self.started = total, 0, time.monotonic()
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._lock = threading.Lock()

    def eta(self) -> str:
        if not self.done:
            return "?"
        left = (time.monotonic() - self.started) / self.done * (self.total - self.done)
        return f"{int(left // 60)}m{int(left % 60):02d}s"

    def update(self, row: Row) -> None:
        with self._lock:
            self.done += 1
            result = f"{row.score:g}/{row.max_score:g}" if row.max_score is not None else row.status.value
            if self.tty:
                width = 30
                filled = width * self.done // self.total
                self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                                  f"ETA {self.eta()} · {row.student}: {result}\033[K")
                if self.done == self.total:
                    self.stream.write("\n")
            else:
                self.stream.write(f"[{self.done}/{self.total}] {row.student}: {result} ({row.status.value}, "
                                  f"{row.duration_s:.1f} s) ETA {self.eta()}\n")
            self.stream.flush()


def default_jobs(lab: Lab) -> int:
    """As many gradings at once as there are cores, and as the lab's memory limit
    per call leaves room for in the memory available now."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        meminfo = Path("/proc/meminfo").read_text()
        available_mb = int(next(l for l in meminfo.splitlines() if l.startswith("MemAvailable")).split()[1]) // 1024
    except (OSError, StopIteration, ValueError):
        return cores
    return max(1, min(cores, available_mb // max(lab.memory_mb, 1)))


# ---------------------------------------------------------------------------
# The whole class

def grade_class(lab: Lab, folder: Path, output: Path, settings: Settings, jobs: int, resume: bool,
                run_array=None) -> list[Row]:
    """Grade the class in ``folder`` into ``output``. ``run_array``: grade the rows to do
    some other way than ``jobs`` local processes (``gradebook_slurm.array_runner``)."""
    slurm = run_array is not None
    entries = find_submissions(folder)
    checks_sha256 = lab.checks_digest()
    previous = load_previous(paths(output)[1], settings, checks_sha256) if resume else {}
    stale = _weaker_isolation(previous)
    # Scratch beside the gradebook: with --slurm the tasks, perhaps on other nodes, read and write it.
    output.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{output.stem}-work-", dir=output.parent))
    rows: dict[str, Row] = {}
    todo = []
    try:
        for entry in entries:
            graded_folder, row, sha = prepare(entry, scratch)
            if row is None and entry.student in previous and previous[entry.student].digest == sha \
                    and previous[entry.student].status is RowStatus.GRADED \
                    and entry.student not in stale:  # crashes, timeouts and weaker isolation: again
                row = previous[entry.student]
            if row is not None:
                rows[entry.student] = row
            else:
                todo.append((entry.student, graded_folder, sha))
        resumed = sum(row is previous.get(student) for student, row in rows.items())
        if stale:
            names = ", ".join(sorted(stale)[:5]) + (", …" if len(stale) > 5 else "")
            sys.stderr.write(f"{len(stale)} graded under a weaker isolation layer than this machine gives now, "
                             f"so graded again: {names}\n")
        unfit = len(rows) - resumed
        sys.stderr.write(f"grading {lab.slug}: {len(entries)} submissions, {len(todo)} to grade"
                         + (f", {resumed} kept from {paths(output)[1]}" if resumed else "")
                         + (f", {unfit} empty or unreadable" if unfit else "")
                         + (f", as a SLURM job array" if slurm else f", {jobs} at a time") + "\n")
        write(output, list(rows.values()), settings, checks_sha256)
        progress = Progress(len(todo))

        def record(row: Row) -> None:
            rows[row.student] = row
            write(output, list(rows.values()), settings, checks_sha256)
            progress.update(row)

        if slurm:
            run_array(todo, settings, scratch, jobs, record)
        else:
            _run_local(todo, settings, scratch, jobs, record)
    except KeyboardInterrupt:
        sys.stderr.write(f"\ninterrupted: {len(rows)} rows kept in {output}; --resume carries on\n")
        raise
    finally:
        if slurm and any(r.status is RowStatus.CRASHED for r in rows.values()):
            sys.stderr.write(f"kept {scratch} for the SLURM tasks' logs\n")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    return [rows[e.student] for e in entries]


def safely(student: str, sha: str, settings: Settings, work) -> Row:
    """``work()``'s row, or a ``crashed`` row if the grader itself failed here."""
    try:
        return work()
    except Exception as exc:  # noqa: BLE001 - one submission's trouble must not end the class
        return Row(student, sha, RowStatus.CRASHED, tier=settings.tier, message=f"grading failed: {exc!r}")


def _run_local(todo, settings: Settings, scratch: Path, jobs: int, record) -> None:
    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        futures = [pool.submit(safely, student, sha, settings,
                               lambda s=student, p=path, d=sha: grade_one(s, p, d, settings, scratch))
                   for student, path, sha in todo]
        for future in as_completed(futures):
            record(future.result())
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        with _running_lock:  # stop the gradings under way before waiting for their threads
            for proc in _running:
                _kill(proc)
        raise
    pool.shutdown()
