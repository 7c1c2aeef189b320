"""Grade several submissions in one grader process, for the tests' fixtures:

    python tests/grade_batch.py JOBS.json REPORTS.json

``JOBS.json`` is a list of ``{"lab", "submission", "select"}`` (``select`` is a
``-k`` expression or null); ``REPORTS.json`` gets one report per job, in order:
what ``k2c grade --format json`` prints, or ``{"error": "..."}``.

A grading's fixed cost (starting Python, importing the checks and what they
import: torch, numba, the CUDA compilers) is then paid once per batch instead of
once per fixture. Nothing else changes: every call into a submission still runs
in a sandbox of its own, exactly as under ``k2c grade``.
"""
import json
import sys
from pathlib import Path

from autograder import report
from autograder.labs import find_lab
from autograder.runner import grade, resolve_tier


def main(jobs_path: str, reports_path: str) -> None:
    jobs = json.loads(Path(jobs_path).read_text())
    tier = resolve_tier("auto")
    reports = []
    for job in jobs:
        try:
            result = grade(find_lab(job["lab"]), Path(job["submission"]), tier, select=job.get("select"))
            reports.append(json.loads(report.render([result], "json")))
        except Exception as exc:  # noqa: BLE001 - one fixture's failure is reported with it, the rest go on
            reports.append({"error": f"{type(exc).__name__}: {exc}"})
        print(f"graded {len(reports)}/{len(jobs)}: {job['submission']}", file=sys.stderr, flush=True)
    Path(reports_path).write_text(json.dumps(reports))


if __name__ == "__main__":
    main(*sys.argv[1:3])
