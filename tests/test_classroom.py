"""``k2c grade --format classroom`` and the GitHub Classroom workflow template."""
import base64
import json

import pytest

from autograder.grading import report
from autograder.grading.plugin import CheckResult
from autograder.grading.runner import LabResult
from conftest import REPO, k2c

TEMPLATE = REPO / "templates" / "classroom" / "grade.yml"
REPORTER = "classroom-resources/autograding-grading-reporter"
# What the reporter and the command grader's result carry for each test.
TEST_FIELDS = {"name", "status", "score", "message", "test_code", "filename", "line_no", "duration"}


def decode(text: str) -> dict:
    return json.loads(base64.b64decode(text.strip(), validate=True))


def reporter_points(results: dict) -> tuple[float, float]:
    """The total the reporter sends to Classroom: every test's score, out of max_score."""
    return sum(t["score"] for t in results["tests"]), results["max_score"]


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
    assert reporter_points(results) == (3, 9) == (lab.score, lab.max_score)  # skipped checks count for nothing
    for test in results["tests"]:
        assert TEST_FIELDS <= test.keys() and test["line_no"] == 0 and test["status"] in ("pass", "fail", "error")
    assert [t["status"] for t in results["tests"]] == ["pass", "fail", "fail", "error", "pass", "pass"]
    _, ring, _, bcast, gpu, _ = results["tests"]
    assert ring["message"] == "rank 1 holds the wrong sum" and ring["test_code"] == "k2c grade 06 -k allreduce_ring_results"
    assert bcast["message"] == "ValueError: bad root"  # the reporter prints an error's message
    assert gpu["name"].endswith("(skipped)") and gpu["score"] == 0 and "GPU tier" in gpu["message"]
    assert all(isinstance(t["duration"], int) for t in results["tests"])

    lab.checks = [c for c in lab.checks if c.status in ("passed", "skipped")]
    assert decode(report.classroom([lab]))["status"] == "pass"


def test_k2c_grade_prints_it(tmp_path):
    out = tmp_path / "classroom.b64"
    proc = k2c("grade", "02", "--submission", REPO / "solutions", "--format", "classroom", "-o", out,
               "-k", "launch_config or saxpy_bandwidth")
    assert proc.returncode == 0, proc.stderr
    assert "Score: 2/2" in proc.stdout  # the table for the step's log
    results = decode(out.read_text())
    assert results["status"] == "pass" and reporter_points(results) == (2, 2)
    assert [t["status"] for t in results["tests"]] == ["pass", "pass"]
    assert "GPU tier" in results["tests"][1]["message"]


def test_when_grading_cannot_run_the_reporter_shows_why(tmp_path):
    out = tmp_path / "classroom.b64"
    proc = k2c("grade", "02", "--tier", "gpu", "--format", "classroom", "-o", out)
    assert proc.returncode == 2
    results = decode(out.read_text())
    assert results["status"] == "error" and results["max_score"] == 0
    assert results["tests"][0]["status"] == "error" and "no usable CUDA GPU" in results["tests"][0]["message"]


def test_the_workflow_template_hands_the_result_to_the_reporter():
    yaml = pytest.importorskip("yaml")
    workflow = yaml.safe_load(TEMPLATE.read_text())
    assert {"on", "jobs"} <= workflow.keys()  # "on" quoted: YAML 1.1 would read on: as true
    (job,) = workflow["jobs"].values()
    steps = job["steps"]
    grade = next(s for s in steps if "k2c grade" in s.get("run", ""))
    assert "--format classroom" in grade["run"] and 'result=' in grade["run"] and "$GITHUB_OUTPUT" in grade["run"]
    reporter = next(s for s in steps if s.get("uses", "").startswith(REPORTER + "@"))
    step_id = grade["id"]
    runners = [r.strip() for r in reporter["with"]["runners"].split(",")]
    assert runners == [step_id] and step_id.isalnum()  # the reporter accepts [a-zA-Z0-9]+ names
    assert reporter["env"][f"{step_id.upper()}_RESULTS"].replace(" ", "") == f"${{{{steps.{step_id}.outputs.result}}}}"
    assert steps.index(grade) < steps.index(reporter)
