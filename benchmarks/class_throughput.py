"""Grading a class, measured the way it runs: ``k2c grade-class`` on a synthetic
class of lab 06 submissions.

    .venv/bin/python benchmarks/class_throughput.py [--students 60] [-k EXPR] [--no-slurm]

The class mixes the reference, the starter, every buggy fixture of
``tests/fixtures/buggy_06.py`` and every alternative of
``tests/fixtures/alternative_06.py``, in turn; each copy carries its student's
id in a comment, so no two digests are equal. The class is graded at
``--jobs 1``, at ``--jobs 2`` and (when ``sbatch`` is on PATH) through
``--slurm --chunk 4 --jobs 2`` on the cluster of ``scripts/slurm-localhost.sh``. For each
run the table gives submissions per minute (from the run's wall time), the
grader's own time per submission (a grading's wall time minus the time spent
inside calls into the student's code; the median over the class), and the
speed-up over ``--jobs 1``. Every run must give every student the score of its
kind (all references equal, and so on), or the script fails.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from benchmarks.report import publish  # noqa: E402

LAB = "06-collectives"
FILE = "collectives.py"


def kinds():
    """(name, source) for the reference, the starter, each bug and each alternative."""
    from fixtures.alternative_06 import ALTERNATIVES
    from fixtures.buggy_06 import BUGS

    reference = (ROOT / "solutions" / LAB / FILE).read_text()

    def edited(edits):
        source = reference
        for before, after in edits:
            source = source.replace(before, after)
        return source

    found = [("reference", reference), ("starter", (ROOT / "labs" / LAB / FILE).read_text())]
    found += [(f"bug: {b.name}", edited(b.edits)) for b in BUGS if b.file == FILE]
    found += [(f"alternative: {a.name}", edited(a.edits)) for a in ALTERNATIVES if a.file == FILE]
    return found


def make_class(root: Path, students: int) -> dict[str, str]:
    """``root/sNNN/collectives.py`` for each student; returns student -> kind."""
    variety = kinds()
    kind_of = {}
    for i in range(students):
        name, source = variety[i % len(variety)]
        student = f"s{i:03d}"
        (root / student).mkdir(parents=True)
        (root / student / FILE).write_text(f"# {student}\n{source}")
        kind_of[student] = name
    return kind_of


def grade(class_dir: Path, out: Path, extra: list[str]) -> tuple[float, list[dict]]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "autograder.cli", "grade-class", LAB, str(class_dir),
                           "-o", str(out), *extra], cwd=ROOT, text=True, stderr=subprocess.PIPE)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        sys.exit(f"grade-class {' '.join(extra)} failed:\n{proc.stderr[-2000:]}")
    return wall, json.loads(out.with_suffix(".json").read_text())["rows"]


def consistent(rows: list[dict], kind_of: dict[str, str]) -> dict[str, float]:
    """Each kind's score, after checking that all its students got it."""
    scores: dict[str, set] = {}
    for row in rows:
        assert row["status"] == "graded", row
        scores.setdefault(kind_of[row["student"]], set()).add(row["score"])
    spread = {k: v for k, v in scores.items() if len(v) > 1}
    assert not spread, f"students of one kind got different scores: {spread}"
    return {k: v.pop() for k, v in scores.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--students", type=int, default=60)
    parser.add_argument("-k", dest="select", help="grade only these checks (k2c grade -k); default: the whole lab")
    parser.add_argument("--no-slurm", action="store_true")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args()

    extra = ["-k", args.select] if args.select else []
    runs = [("--jobs 1", ["--jobs", "1"]), ("--jobs 2", ["--jobs", "2"])]
    if not args.no_slurm and shutil.which("sbatch"):
        # In chunks of 4, as the instructor guide advises: each array task pays SLURM's start.
        runs.append(("--slurm --chunk 4 --jobs 2", ["--slurm", "--chunk", "4", "--jobs", "2"]))
    lines = ["| run | submissions | wall (s) | per minute | grader's time per submission (s, median) | speed-up |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    with tempfile.TemporaryDirectory() as scratch:
        class_dir = Path(scratch) / "class"
        kind_of = make_class(class_dir, args.students)
        first = None
        scores = None
        for label, flags in runs:
            wall, rows = grade(class_dir, Path(scratch) / f"gradebook-{len(lines)}.csv", flags + extra)
            got = consistent(rows, kind_of)
            assert scores is None or got == scores, f"{label} scored differently: {got} != {scores}"
            scores = got
            first = first or wall
            overhead = statistics.median(r["duration_s"] - r["student_s"] for r in rows)
            lines.append(f"| `{label}` | {len(rows)} | {wall:.0f} | {len(rows) / wall * 60:.1f} | "
                         f"{overhead:.2f} | {first / wall:.2f}× |")
            print(lines[-1], flush=True)
    kinds_line = "; ".join(f"{k}: {v:g}" for k, v in scores.items())
    where = (f"{args.students} lab 06 submissions ({len(set(kind_of.values()))} kinds in turn), "
             f"{'checks ' + repr(args.select) if args.select else 'the whole lab'}, on {os.cpu_count()} cores; "
             f"scores per kind: {kinds_line}")
    publish(__file__, "class_grading.md", "`k2c grade-class` throughput", where, "\n".join(lines),
            write=not args.no_write)


if __name__ == "__main__":
    main()
