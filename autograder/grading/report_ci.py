"""Reports for grading in CI: a Markdown summary (GitHub's job summary, Classroom
50's release body), Classroom 50's ``result.json`` and GitHub Classroom's reporter.

Every check is worth whole points and scores all or nothing, so a lab's score is
a whole number and each format shows the same one: the text table's
``Score: 17/25`` is Classroom 50's ``"score": 17``, the summary's "17/25" and the
old reporter's "Points 17/25" and "17.00/25". A skipped check did not run: it
counts for nothing and is shown as skipped with its reason, never as passed.
"""
from __future__ import annotations

import base64
import datetime
import json
import os
import subprocess

from autograder.grading.runner import LabResult, LabStatus


def _pts(x: float) -> str:
    return f"{x:g}"


def _missing(r: LabResult) -> bool:
    return r.status is LabStatus.MISSING


def _whole(x: float) -> int:
    """A score as the integer platforms take it; checks are whole points, so it is exact."""
    if x != int(x):
        raise ValueError(f"{x} is not a whole number of points: every check scores 0 or its whole points")
    return int(x)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# --- a Markdown summary ------------------------------------------------------------------------

MARK = {"passed": "✅", "failed": "❌", "error": "❌", "timeout": "⏱️", "skipped": "⏭️"}


def markdown(results: list[LabResult]) -> str:
    """One section per lab: its score, then a table of its checks with the first
    line of each one's feedback, and how to see it in full."""
    lines = []
    for r in results:
        lines.append(f"### Lab {r.lab}: {_pts(r.score)}/{_pts(r.max_score)} points ({r.tier.upper()} tier)")
        lines.append("")
        if _missing(r):
            lines += [f"**Missing:** {r.message}", ""]
            continue
        lines += ["| | check | points | feedback |", "| --- | --- | --- | --- |"]
        for c in r.checks:
            points = "skipped" if c.status == "skipped" else f"{_pts(c.points)}/{_pts(c.max_points)}"
            lines.append(f"| {MARK[c.status]} | {_cell(c.title)} | {points} | {_cell(_first_line(c.feedback))} |")
        lines += ["", f"See a check in full: `k2c grade {r.lab[:2]} -k NAME`. "
                      f"Graded under {r.isolation.get('layer', '?')}; checks sha256 `{r.checks_digest[:12]}`.", ""]
    if len(results) > 1:
        total, top = sum(r.score for r in results), sum(r.max_score for r in results)
        lines += [f"**Total: {_pts(total)}/{_pts(top)}** over labs {', '.join(r.lab[:2] for r in results)}.", ""]
    return "\n".join(lines) + "\n"


# --- Classroom 50 ------------------------------------------------------------------------------

# Classroom 50's autograder contract (foundation50/classroom50, wiki "Advanced
# Autograding"): ./result.json with schema "classroom50/result/v1", the
# submission's identity from the runner's environment, integer score and
# max-score, and tests of test-name, passed, score, max-score; extra fields of
# a test are kept as they are. "datetime" is the graded commit's committer date.
CLASSROOM50_SCHEMA = "classroom50/result/v1"
CLASSROOM50_ENV = {"classroom": "CLASSROOM", "assignment": "ASSIGNMENT", "submission": "SUBMISSION_TAG",
                   "commit": "COMMIT_URL", "release": "RELEASE_URL", "review": "REVIEW_URL"}


def _utc(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _commit_date() -> datetime.datetime | None:
    try:
        done = subprocess.run(["git", "log", "-1", "--format=%cI"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    try:
        return datetime.datetime.fromisoformat(done.stdout.strip()) if done.returncode == 0 else None
    except ValueError:
        return None


def classroom50(results: list[LabResult], env=os.environ, message: str = "") -> str:
    """Classroom 50's result.json. Skipped checks are left out of ``tests`` (its table
    has PASS and FAIL only); the release body (``markdown``) lists them with their reasons."""
    tests = []
    for r in results:
        prefix = f"{r.lab}: " if len(results) > 1 else ""
        if _missing(r):
            tests.append({"test-name": f"{prefix}the lab's files", "passed": False, "score": 0,
                          "max-score": _whole(r.max_score), "status": "missing", "message": r.message})
        for c in r.checks:
            if c.status == "skipped":
                continue
            tests.append({"test-name": prefix + c.title, "passed": c.status == "passed",
                          "score": _whole(c.points), "max-score": _whole(c.max_points),
                          "status": c.status, "message": _first_line(c.feedback),
                          "command": f"k2c grade {r.lab[:2]} -k {c.name.split('[')[0]}"})
    now = datetime.datetime.now(datetime.timezone.utc)
    result = {"schema": CLASSROOM50_SCHEMA, **{key: env.get(var, "") for key, var in CLASSROOM50_ENV.items()}}
    result["review"] = result["review"] or result["commit"]
    result.update({"datetime": _utc(_commit_date() or now), "graded_at": _utc(now),
                   "score": sum(t["score"] for t in tests), "max-score": sum(t["max-score"] for t in tests),
                   "tests": tests, **({"message": message} if message else {})})
    return json.dumps(result, indent=2) + "\n"


# --- GitHub Classroom's reporter (the product is being sunset) ---------------------------------

# classroom-resources/autograding-grading-reporter reads base64 of this JSON from
# the environment variable ``<RUNNER>_RESULTS``. It computes the total twice: the
# points it sends to Classroom ("Points X/Y") sum each test's ``score``, and the
# total in its log ("X.XX/Y") is the share of tests whose ``status`` is "pass"
# times ``max_score``. The two agree only if every test is worth the same, so each
# point of a check is a test of its own ("ring works (point 2 of 2)"). It prints
# ``message`` only for "error" and ``test_code`` for every test. Skipped checks
# are left out (it knows only pass and fail); the step's log and job summary show them.
CLASSROOM_STATUS = {"passed": "pass", "failed": "fail", "timeout": "fail", "error": "error"}


def reporter_test(name, status, score, message, test_code, duration_ms):
    return {"name": name, "status": status, "score": score, "message": message, "test_code": test_code,
            "filename": "", "line_no": 0, "duration": duration_ms}


def classroom_json(results: list[LabResult]) -> dict:
    tests = []
    for r in results:
        if _missing(r):  # the reporter prints an "error" test's message: the student sees where it looked
            # One test, or (beside other labs) one per point, so that the log's share of passed tests stays right.
            units = _whole(r.max_score) if len(results) > 1 and r.max_score > 1 else 1
            tests += [reporter_test(f"{r.lab}: the lab's files" + (f" (point {i + 1} of {units})" if units > 1 else ""),
                                    "error", 0, r.message, f"k2c grade {r.lab[:2]}", round(r.duration_s * 1000))
                      for i in range(units)]
        for c in r.checks:
            if c.status == "skipped":
                continue
            name = f"{r.lab}: {c.title}" if len(results) > 1 else c.title
            points = _whole(c.max_points)
            for i in range(points):
                tests.append(reporter_test(name + (f" (point {i + 1} of {points})" if points > 1 else ""),
                                            CLASSROOM_STATUS[c.status], 1 if c.status == "passed" else 0,
                                            c.feedback, f"k2c grade {r.lab[:2]} -k {c.name.split('[')[0]}",
                                            round(c.duration_s * 1000)))
    full = all(r.score >= r.max_score and not _missing(r) for r in results)
    return {"version": 1, "status": "pass" if results and full else "fail",
            "max_score": _whole(sum(r.max_score for r in results)), "tests": tests}


def base64_json(data: dict) -> str:
    return base64.b64encode(json.dumps(data).encode()).decode() + "\n"


def classroom(results: list[LabResult]) -> str:
    """What GitHub Classroom's grading reporter reads: one line of base64 JSON."""
    return base64_json(classroom_json(results))
