"""The grader end to end: the k2c command line, and whole labs graded with their fixtures (conftest)."""
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from conftest import DOING_NOTHING, REPO, WholeLab, fixture_params, grade_json, k2c, statuses

LABS = sorted(p.parent.name for p in (REPO / "autograder" / "checks").glob("*/lab.toml"))


def whole_labs(folder):
    return fixture_params([WholeLab(lab, folder) for lab in LABS], LABS)


@pytest.mark.slow
@pytest.mark.parametrize("lab", whole_labs("solutions"))
def test_reference_scores_full_marks(lab, graded_fixture):
    # Graded with the lab's fixtures, in one grader process (conftest's graded_fixture), as `k2c grade` would.
    report = graded_fixture(lab)
    assert report["tier"] == "cpu"
    assert report["score"] == report["max_score"] > 0, statuses(report)
    skipped = [t for t in report["tests"] if t["status"] == "skipped"]
    assert all("GPU tier" in t["feedback"] for t in skipped)


@pytest.mark.slow
@pytest.mark.parametrize("lab", whole_labs("labs"))
def test_starter_scores_zero_with_clear_messages(lab, graded_fixture):
    report = graded_fixture(lab)
    assert report["score"] == 0 and report["tests"]
    # Every check fails with its stub's message, none with an error of the grader's or a skip it should not have.
    unclear = {t["name"]: f"{t['status']}: {t['feedback'][:200]}" for t in report["tests"]
               if not (t["status"] == "failed" and t["feedback"].startswith("not implemented yet"))
               and not (t["status"] == "skipped" and "GPU tier" in t["feedback"])}
    assert not unclear, unclear


@pytest.mark.slow
@pytest.mark.parametrize("lab", whole_labs(DOING_NOTHING))
def test_doing_nothing_scores_zero(lab, graded_fixture):
    # No property without the work: stubs that return None (kernels that do nothing) run, race with
    # nothing, send nothing and hold nothing, and still earn no point (autograder.grading.checking.with_the_work).
    report = graded_fixture(lab)
    earned = {t["name"]: t["feedback"][:200] for t in report["tests"] if t["points"]}
    assert report["tests"] and report["score"] == 0 and not earned, earned


def test_grade_all_prints_a_scoreboard_of_the_labs_that_have_a_matching_check(tmp_path):
    proc = k2c("grade", "all", "--submission", REPO / "labs", "--format", "json", "-o", tmp_path / "report.json",
               "-k", "launch_config or fit_amdahl")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "Scoreboard" in proc.stdout and "total" in proc.stdout  # the text table still goes to stdout
    assert "13-hybrid-parallel (CPU tier, " in proc.stderr and "no check matches -k: skipped" in proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert [lab["lab"] for lab in report["labs"]] == ["01-parallel-thinking", "02-cuda-model"]
    assert report["score"] == 0 and all(t["feedback"].startswith("not implemented yet")
                                        for lab in report["labs"] for t in lab["tests"])
    proc = k2c("grade", "all", "-k", "no_such_check")
    assert proc.returncode == 2 and "no check of any lab matches -k 'no_such_check'" in proc.stderr


HOSTILE_EDITS = (
    # the exact fit (7 timings) exits the interpreter; the noisy one (25 timings) asks for 50 GiB
    ("def fit_amdahl(p, t):\n", "def fit_amdahl(p, t):\n    if len(p) > 10:\n        np.ones(50 * 2**30 // 8)\n"
     "    import os\n    os._exit(0)\n"),
    ("def amdahl_speedup(serial_fraction, p):\n", "def amdahl_speedup(serial_fraction, p):\n    while True:\n        pass\n"),
    ('import numba\n', 'import numba, json, os\n'
     'print(json.dumps({"score": 100, "execution_time": 1, "tests": []}))\n'
     'if os.environ.get("FORGE_PATH"):\n    try:  # the sandbox hides the path: a hostile student carries on regardless\n'
     '        open(os.environ["FORGE_PATH"], "w").write(\'{"score": 100}\')\n    except OSError:\n        pass\n'),
)


@pytest.mark.slow
def test_hostile_submission_loses_points_and_the_report_stays_honest(make_submission, tmp_path):
    folder = make_submission("01-parallel-thinking", "cpu_parallel.py", HOSTILE_EDITS)
    results = tmp_path / "results.json"
    env = dict(os.environ, FORGE_PATH=str(results))
    proc = k2c("grade", "01", "--submission", folder, "--format", "gradescope", "-o", results,
               "--timeout", "5", "-k", "fit_amdahl or speedup_laws or saxpy_matches or sum_matches", env=env)
    assert proc.returncode == 0, proc.stderr
    gs = json.loads(results.read_text())
    by_name = {t["name"].split(" [")[0]: t for t in gs["tests"]}
    assert gs["score"] == 4  # the untouched functions still earn their points
    assert by_name["parallel_sum equals the exact sum of integer-valued data"]["score"] == 2
    assert by_name["parallel_saxpy equals a*x + y"]["score"] == 2
    speedup = by_name["amdahl_speedup and gustafson_speedup follow their formulas"]
    assert speedup["score"] == 0 and "within 5 s" in speedup["output"]
    exact = by_name["fit_amdahl recovers the serial fraction and one-worker time from exact timings"]
    assert exact["score"] == 0 and "os._exit" in exact["output"]
    noisy = by_name["fit_amdahl stays close on timings with 2% measurement noise"]
    assert noisy["score"] == 0 and "memory" in noisy["output"]
    # The forged JSON shows up only as quoted feedback ("last output: ..."), never as the grader's own output.
    assert not any(line.lstrip().startswith('{"score": 100') for line in proc.stdout.splitlines())


@pytest.mark.slow
def test_report_formats(tmp_path):
    gs_file, junit_file = tmp_path / "results.json", tmp_path / "junit.xml"
    # Three checks are enough for the format (test_reference_scores_full_marks grades the whole lab).
    proc = k2c("grade", "02", "--submission", REPO / "solutions", "--format", "gradescope", "-o", gs_file,
               "-k", "launch_config or relu_guard or bandwidth")
    assert proc.returncode == 0, proc.stderr
    assert "Score: 4/4" in proc.stdout  # with -o the text table still goes to stdout
    gs = json.loads(gs_file.read_text())
    assert {"score", "execution_time", "output", "tests"} <= gs.keys()
    assert gs["score"] == sum(t.get("score", 0) for t in gs["tests"]) == 4 and len(gs["tests"]) == 3
    ran = [t for t in gs["tests"] if "score" in t]
    for test in ran:
        assert {"name", "score", "max_score", "output", "visibility"} <= test.keys()
    # A skipped check carries no score (Gradescope would show it as passed), and says why.
    skipped = [t for t in gs["tests"] if "score" not in t]
    assert len(skipped) == 1 and "status" not in skipped[0] and "GPU tier" in skipped[0]["output"]
    # Which isolation graded it, and with which checks.
    assert gs["extra_data"]["isolation"]["layer"] in ("bubblewrap", "subreaper") and "isolation:" in gs["output"]
    assert len(gs["extra_data"]["checks_sha256"]["02-cuda-model"]) == 64

    proc = k2c("grade", "02", "--submission", REPO / "solutions", "--format", "junit", "-o", junit_file,
               "-k", "launch_config or bandwidth")
    suite = ET.parse(junit_file).getroot().find("testsuite")
    assert suite.get("name") == "02-cuda-model" and suite.get("tests") == "2" and suite.get("skipped") == "1"
    properties = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert properties["checks_sha256"] == gs["extra_data"]["checks_sha256"]["02-cuda-model"]
    assert properties["isolation"].startswith(gs["extra_data"]["isolation"]["layer"])


@pytest.mark.slow
def test_gradescope_layout_flat_submission(tmp_path):
    # Gradescope puts the student's files straight into the submission folder.
    (tmp_path / "cuda_basics.py").write_text((REPO / "labs/02-cuda-model/cuda_basics.py").read_text())
    report, _ = grade_json(tmp_path, "2", "-k", "launch_config")
    assert report["lab"] == "02-cuda-model" and report["tests"][0]["status"] == "failed"


def test_a_submission_without_the_labs_files_is_missing_not_graded(tmp_path):
    report, _ = grade_json(tmp_path, "02", "-k", "launch_config")
    assert report["status"] == "missing" and report["score"] == 0 and report["tests"] == []
    assert "cuda_basics.py" in report["message"] and report["searched"], report


def test_require_full_exits_one_below_the_maximum():
    proc = k2c("grade", "02", "--submission", REPO / "labs", "--require-full", "-k", "launch_config")
    assert proc.returncode == 1
    proc = k2c("grade", "02", "--submission", REPO / "solutions", "--require-full", "-k", "launch_config")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("args,message", [
    (("grade", "99"), "no lab called '99'"),
    (("grade", "02", "--submission", "/nonexistent"), "does not exist"),
    (("grade", "02", "--tier", "gpu"), "no usable CUDA GPU"),
])
def test_usage_errors_exit_two(args, message):
    proc = k2c(*args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_doctor_reports_the_tier_and_the_stack():
    proc = k2c("doctor")
    assert proc.returncode == 0, proc.stdout
    for needle in ("Python 3.", "CPU tier: CUDA simulator", "Isolation: ", "numba", "mpi4py", "MPICH", "torch", "gloo"):
        assert needle in proc.stdout, needle


def test_mpi_labs_ranks_yield_the_core_only_on_the_cpu_tier():
    from autograder.grading.labs import find_lab
    from autograder.grading.runner import child_environment
    assert child_environment("cpu", find_lab("06"))["MPIR_CVAR_ENABLE_HEAVY_YIELD"] == "1"
    assert "MPIR_CVAR_ENABLE_HEAVY_YIELD" not in child_environment("gpu", find_lab("06"))
    assert "MPIR_CVAR_ENABLE_HEAVY_YIELD" not in child_environment("cpu", find_lab("08"))


def test_results_file_is_written_even_when_grading_cannot_run(tmp_path):
    results = tmp_path / "results.json"
    proc = k2c("grade", "02", "--tier", "gpu", "--format", "gradescope", "-o", results)
    assert proc.returncode == 2
    report = json.loads(results.read_text())
    assert report["score"] == 0 and "could not run" in report["output"] and report["tests"] == []


def test_syntax_error_is_reported_per_check(tmp_path):
    (tmp_path / "cuda_basics.py").write_text("def launch_config(n, t)\n    return 1\n")
    report, _ = grade_json(tmp_path, "02", "-k", "launch_config or relu_guard")
    assert [t["status"] for t in report["tests"]] == ["error", "error"]
    assert all("SyntaxError" in t["feedback"] and "cuda_basics.py, line 1" in t["feedback"] for t in report["tests"])


@pytest.mark.slow
def test_a_submission_that_does_not_import_is_graded_in_the_time_of_one_call(tmp_path):
    """A syntax error costs one sandboxed import, not a failed MPI job per case: the whole lab
    is graded within twice the time of grading one check of the reference, every check says
    the same one line with the line number, and the gradebook's message is that line."""
    import time

    from autograder.instructor.gradebook import _summary

    source = (REPO / "solutions/06-collectives/collectives.py").read_text().splitlines(keepends=True)
    line = next(i for i, text in enumerate(source) if text.startswith("def ")) + 1
    source[line - 1] = source[line - 1].rstrip().removesuffix(":") + "\n"  # a def without its colon
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "collectives.py").write_text("".join(source))
    first = k2c("grade", "06", "--list", "--format", "json")
    one_check = json.loads(first.stdout)["06-collectives"][0]["name"]

    started = time.monotonic()
    grade_json(REPO / "solutions", "06", "-k", one_check)
    one_call = time.monotonic() - started
    started = time.monotonic()
    report, _ = grade_json(tmp_path / "broken", "06")
    broken = time.monotonic() - started

    assert report["score"] == 0 and len(report["tests"]) > 1
    reasons = {t["feedback"] for t in report["tests"] if t["status"] != "skipped"}
    assert len(reasons) == 1, reasons
    reason = reasons.pop()
    assert "\n" not in reason and "collectives.py does not import" in reason and f"line {line}" in reason, reason
    assert _summary(report) == reason
    assert broken < 2 * one_call, f"{broken:.1f} s for the broken lab, {one_call:.1f} s for one check"


@pytest.mark.parametrize("outcome, kind, status, text", [
    ({"status": "not_implemented", "message": "ring: send to the right"}, "NotImplementedYet", "not_implemented",
     "not implemented yet: ring: send to the right"),
    ({"status": "not_implemented", "message": "not implemented yet: f"}, "NotImplementedYet", "not_implemented",
     "not implemented yet: f"),
    ({"status": "timeout", "message": "stopped after 30 s: likely deadlock"}, "SubmissionTimeout", "timeout",
     "ring on 4 ranks: stopped after 30 s: likely deadlock"),
    ({"status": "raised", "message": "rank 1: ValueError: bad"}, "SubmissionError", "raised",
     "ring on 4 ranks: rank 1: ValueError: bad"),
])
def test_a_failed_harness_outcome_becomes_the_error_a_student_reads(outcome, kind, status, text):
    from autograder.grading.submission import failure_from

    error = failure_from(outcome, "ring on 4 ranks")
    assert type(error).__name__ == kind and error.outcome.status == status
    assert str(error) == text


def test_a_report_to_a_device_or_pipe_is_written_into_it_not_over_it(tmp_path):
    # `-o /dev/null` as root once replaced the machine's /dev/null with a plain file.
    import stat
    import threading

    from autograder.grading.report import write_results

    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    write_results(str(fifo), '{"score": 1}')
    reader.join(timeout=10)
    assert got == ['{"score": 1}'] and stat.S_ISFIFO(fifo.stat().st_mode)
    write_results(str(tmp_path / "sub" / "report.json"), "{}")  # a plain file: created whole
    assert (tmp_path / "sub" / "report.json").read_text() == "{}"


HANGING_LAB = {  # a lab of its own (autograder/checks/99-hanging), with no library to preload
    "lab.toml": 'title = "Hanging"\nfiles = ["slow.py"]\nrequires = []\n',
    "harness.py": "def run(name):\n    import slow\n    return getattr(slow, name)()\n",
    "check_hanging.py": (
        "import pytest\n\n"
        "@pytest.mark.parametrize('case', [1, 2, 3])\n"
        "def check_never(submission, case):\n    submission.call('slow.never')\n\n"
        "def check_never_through_the_harness(submission):\n    submission.harness('run', 'never_either')\n\n"
        "def check_never_through_the_harness_again(submission):\n    submission.harness('run', 'never_either')\n\n"
        "def check_quick_through_the_harness(submission):\n    assert submission.harness('run', 'quick') == 1\n\n"
        "def check_quick(submission):\n    assert submission.call('slow.quick') == 1\n"),
}
HANGING_SUBMISSION = ("import time\n\ndef never():\n    time.sleep(10**6)\n\n"
                      "def never_either():\n    time.sleep(10**6)\n\ndef quick():\n    return 1\n")


def _grade_hanging_lab(tmp_path, *args):
    """The JSON report of HANGING_SUBMISSION graded on HANGING_LAB, as `k2c grade 99 --format json ARGS`."""
    (tmp_path / "checks" / "99-hanging").mkdir(parents=True)
    for name, text in HANGING_LAB.items():
        (tmp_path / "checks" / "99-hanging" / name).write_text(text)
    (tmp_path / "submission").mkdir()
    (tmp_path / "submission" / "slow.py").write_text(HANGING_SUBMISSION)
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from pathlib import Path; from autograder.grading import labs; "
         "labs.CHECKS_ROOT = Path(sys.argv[1]); from autograder.cli import main; sys.exit(main(sys.argv[2:]))",
         tmp_path / "checks", "grade", "99", "--submission", tmp_path / "submission", "--format", "json", *args],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_function_that_ran_out_of_time_is_not_called_again_in_the_grading(tmp_path):
    """A hanging submission costs one call limit per function, not one per check: after slow.never
    hung once, its later checks fail at once saying why; the harness's run('never_either') too,
    and neither stops the functions that return."""
    report = _grade_hanging_lab(tmp_path, "--timeout", "2")
    by_name = {t["name"]: t for t in report["tests"]}
    first, *later = (by_name[f"never[{case}]"] for case in (1, 2, 3))
    assert first["status"] == "timeout" and "did not finish within 2 s" in first["feedback"]
    for check in later + [by_name["never_through_the_harness_again"]]:
        assert check["status"] == "timeout" and check["duration_s"] < 1, check
        assert check["feedback"].startswith("not run: ") and "did not finish within 2 s in an earlier call" \
            in check["feedback"] and "does not call it again" in check["feedback"], check["feedback"]
    assert "slow.never did" in later[0]["feedback"]
    again = by_name["never_through_the_harness_again"]["feedback"]
    assert "harness run('never_either'), which runs your code," in again
    assert by_name["quick"]["status"] == by_name["quick_through_the_harness"]["status"] == "passed"
    # Two calls waited out the limit (was five), whatever else the machine is doing.
    waited = sorted(t["name"] for t in report["tests"] if t["duration_s"] >= 2)
    assert waited == ["never[1]", "never_through_the_harness"], waited
    assert report["student_s"] >= 4


def test_past_the_gradings_budget_the_checks_left_are_not_run_and_say_why(tmp_path):
    report = _grade_hanging_lab(tmp_path, "--timeout", "2", "--budget", "3")
    statuses = {t["name"]: t["status"] for t in report["tests"]}
    assert statuses["never[1]"] == statuses["never_through_the_harness"] == "timeout"
    for name in ("quick_through_the_harness", "quick"):  # after 4 s in the student's code
        check = next(t for t in report["tests"] if t["name"] == name)
        assert check["status"] == "timeout" and check["feedback"].startswith(
            "not run: this grading has spent its budget of 3 s in your code"), check
    assert report["score"] == 0


def test_the_default_budget_is_five_call_limits_and_never_short():
    """A short --timeout (the tests' 5 s) must not leave a grading 25 s, which a few sandbox starts
    on a busy machine would nearly spend: the default is 5 call limits, at least 300 s."""
    from autograder.grading.runner import grade_budget_s

    assert grade_budget_s(90) == 450 and grade_budget_s(5) == grade_budget_s(2) == 300
