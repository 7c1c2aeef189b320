"""Grade several submissions in one grader process, for the tests' fixtures:

    python tests/grade_batch.py JOBS.json REPORTS.json

``JOBS.json`` is a list of ``{"lab", "submission", "select"}`` (``select`` is a
``-k`` expression or null); ``REPORTS.json`` gets one report per job, in order:
what ``k2c grade --format json`` prints, or ``{"error": "..."}``.

A grading's fixed cost (starting Python, importing the checks and what they
import: torch, numba, the CUDA compilers) is then paid once per batch instead of
once per fixture, and so is the sandbox server's (starting it and importing what
the lab preloads: torch and torch._dynamo take seconds): the fixtures are the
tests' own, trusted code, so one server serves all that share an environment.
Nothing else changes: every call into a submission still runs in a fresh child
of that server, as the student's user, on a read-only copy of that submission
alone, in scratch folders emptied after each call, exactly as under ``k2c grade``.
"""
import json
import sys
from pathlib import Path

from autograder.grading import report
from autograder.grading.labs import find_lab
from autograder.grading.runner import grade, resolve_tier
from autograder.sandbox import Sandbox


class SharedSandboxes:
    """``sandbox_for`` of ``autograder.grading.runner.grade``: one sandbox per environment and limits."""

    def __init__(self):
        self._sandboxes: dict = {}

    def __call__(self, submission: str, limits, env: dict) -> Sandbox:
        key = (limits, tuple(sorted(env.items())))
        if key not in self._sandboxes:
            self._sandboxes[key] = Sandbox(submission, limits, env)
        return self._sandboxes[key]

    def close(self) -> None:
        for sandbox in self._sandboxes.values():
            sandbox.close()


def main(jobs_path: str, reports_path: str) -> None:
    jobs = json.loads(Path(jobs_path).read_text())
    tier = resolve_tier("auto")
    reports, shared = [], SharedSandboxes()
    try:
        for job in jobs:
            try:
                result = grade(find_lab(job["lab"]), Path(job["submission"]), tier, select=job.get("select"),
                               sandbox_for=shared)
                reports.append(json.loads(report.render([result], "json")))
            except Exception as exc:  # noqa: BLE001 - one fixture's failure is reported with it, the rest go on
                reports.append({"error": f"{type(exc).__name__}: {exc}"})
            print(f"graded {len(reports)}/{len(jobs)}: {job['submission']}", file=sys.stderr, flush=True)
    finally:
        shared.close()
    Path(reports_path).write_text(json.dumps(reports))


if __name__ == "__main__":
    main(*sys.argv[1:3])
