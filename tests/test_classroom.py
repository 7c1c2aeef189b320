"""``k2c grade --format classroom``: what GitHub Classroom's grading reporter (the product is
being sunset) reads, with partial credit that reads the same in its log and in Classroom.
The workflow that runs it: tests/test_ci.py."""
import base64
import json

import pytest

from autograder.grading import report
from autograder.grading.plugin import CheckResult
from autograder.grading.runner import LabResult
from conftest import REPO, k2c

# What the reporter and the command grader's result carry for each test.
TEST_FIELDS = {"name", "status", "score", "message", "test_code", "filename", "line_no", "duration"}


def decode(text: str) -> dict:
    return json.loads(base64.b64decode(text.strip(), validate=True))


def reporter_points(results: dict) -> tuple[float, float]:
    """The total the reporter sends to Classroom ("Points X/Y", notify-classroom.js): every
    test's score, out of max_score."""
    return sum(t["score"] for t in results["tests"]), results["max_score"]


def reporter_log_points(results: dict) -> float:
    """The total the reporter prints in its log ("X.XX/Y", getTestScore in test-helpers.js):
    the share of tests whose status is "pass", times max_score."""
    passed = sum(t["status"] == "pass" for t in results["tests"])
    return passed / len(results["tests"]) * results["max_score"]


def _check(name, status, points, max_points, feedback=""):
    return CheckResult(name, f"{name} works", points, max_points, status, feedback, 0.25)


def test_partial_credit_per_check():
    lab = LabResult("06-collectives", "Collectives", "cpu", "/s", [
        _check("chunk_bounds", "passed", 1, 1),
        _check("allreduce_ring_results[p = 2]", "failed", 0, 2, "rank 1 holds the wrong sum"),
        _check("alltoall_pairwise_results", "timeout", 0, 2, "likely deadlock"),
        _check("bcast_binomial_results", "error", 0, 2, "ValueError: bad root"),
        _check("gpu_only", "skipped", 0, 3, "needs a CUDA GPU (GPU tier); this run is CPU tier"),
        _check("alltoall_pairwise_cost", "passed", 2, 2),
    ], 3.0, {"layer": "bubblewrap"}, "0" * 64)
    out = report.render([lab], "classroom")
    assert out.count("\n") == 1  # one line: what $GITHUB_OUTPUT's result= takes
    results = decode(out)
    assert results["version"] == 1 and results["status"] == "fail"
    # Classroom's points, the log's and k2c's agree (the old reporter said 17.19 in its log beside Points 17):
    # each point is a test of its own, and skipped checks count for nothing.
    assert reporter_points(results) == (3, 9) == (lab.score, lab.max_score)
    assert reporter_log_points(results) == 3
    for test in results["tests"]:
        assert TEST_FIELDS <= test.keys() and test["line_no"] == 0 and test["status"] in ("pass", "fail", "error")
        assert test["score"] in (0, 1)
    names = [t["name"] for t in results["tests"]]
    assert len(names) == 9 and "allreduce_ring_results[p = 2] works (point 2 of 2)" in names
    assert not any("gpu_only" in n for n in names)  # skipped: not a pass, not a fail; the job summary shows it
    ring = next(t for t in results["tests"] if t["name"].startswith("allreduce_ring"))
    assert ring["message"] == "rank 1 holds the wrong sum" and ring["test_code"] == "k2c grade 06 -k allreduce_ring_results"
    bcast = next(t for t in results["tests"] if t["name"].startswith("bcast"))
    assert bcast["status"] == "error" and bcast["message"] == "ValueError: bad root"  # the reporter prints it
    assert all(isinstance(t["duration"], int) for t in results["tests"])

    lab.checks = [c for c in lab.checks if c.status in ("passed", "skipped")]
    assert decode(report.render([lab], "classroom"))["status"] == "pass"


def test_weighted_partial_credit_reads_the_same_in_every_format():
    """17 of 25 with checks worth 1, 2 and 3: the text table, the summary, Classroom 50,
    JUnit and both of the reporter's totals say 17."""
    import xml.etree.ElementTree as ET

    weights = [3, 3, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1]  # 25 points
    earned = {0, 2, 3, 4, 5, 6, 8, 9, 10, 11}  # 3 + 5 x 2 + 4 x 1 = 17
    checks = [_check(f"c{i}", "passed" if i in earned else "failed", w if i in earned else 0, w)
              for i, w in enumerate(weights)]
    lab = LabResult("13-hybrid-parallel", "Hybrid", "cpu", "/s", checks, 3.0, {"layer": "bubblewrap"}, "0" * 64)
    assert (lab.score, lab.max_score) == (17, 25)
    results = decode(report.render([lab], "classroom"))
    assert reporter_points(results) == (17, 25) and reporter_log_points(results) == 17
    assert "Score: 17/25" in report.text([lab]) and "17/25 points" in report.render([lab], "markdown")
    c50 = json.loads(report.render([lab], "classroom50"))
    assert (c50["score"], c50["max-score"]) == (17, 25)
    cases = ET.fromstring(report.junit([lab]).split("\n", 1)[1]).iter("testcase")
    assert sum(int(c.find("system-out").text.split()[1].split("/")[0]) for c in cases) == 17


def test_k2c_grade_prints_it(tmp_path):
    out = tmp_path / "classroom.b64"
    proc = k2c("grade", "02", "--submission", REPO / "solutions", "--format", "classroom", "-o", out,
               "-k", "launch_config or saxpy_bandwidth")
    assert proc.returncode == 0, proc.stderr
    assert "Score: 2/2" in proc.stdout  # the table for the step's log
    results = decode(out.read_text())
    assert results["status"] == "pass" and reporter_points(results) == (2, 2) and reporter_log_points(results) == 2
    # launch_config's 2 points; the skipped GPU check is in the step's table, not among the reporter's tests
    assert [t["name"].split()[0] for t in results["tests"]] == ["launch_config", "launch_config"]
    assert "skipped  saxpy_kernel" in proc.stdout and "GPU tier" in proc.stdout


def test_when_grading_cannot_run_the_reporter_shows_why(tmp_path):
    out = tmp_path / "classroom.b64"
    proc = k2c("grade", "02", "--tier", "gpu", "--format", "classroom", "-o", out)
    assert proc.returncode == 2
    results = decode(out.read_text())
    assert results["status"] == "error" and results["max_score"] == 0
    assert results["tests"][0]["status"] == "error" and "no usable CUDA GPU" in results["tests"][0]["message"]
