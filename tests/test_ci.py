"""Grading after GitHub Classroom (``k2c ci``): the grader wheel holds no answer, the
GitHub Actions workflow grades the lab and the labs it uses from a student
repository's layout as written, and Classroom 50's autograder writes the
``result.json`` its contract asks for."""
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest

from autograder.grading.labs import find_lab
from autograder.instructor import ci
from autograder.instructor.release import leaks, searchable
from conftest import REPO

USED = ("07-training-memory", "08-data-parallel", "09-zero-sharding", "10-tensor-parallel")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return ci.build(find_lab("13"), tmp_path_factory.mktemp("ci"))


def _wheel(built) -> bytes:
    return (built.folder / built.wheel).read_bytes()


def test_the_grader_wheel_holds_the_public_checks_and_no_answer(built):
    data = _wheel(built)
    assert hashlib.sha256(data).hexdigest() == built.sha256
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert built.labs == ("13-hybrid-parallel", *USED)
    assert {n.split("/")[2] for n in names if n.startswith("autograder/checks/")} == set(built.labs)
    assert not [n for n in names if n.startswith(("solutions/", "labs/", "tests/")) or "_hidden" in n]
    lab = find_lab("13")
    assert lab.hidden and not [n for n in names if Path(n).name in lab.hidden]
    # The leak search of `k2c release` reads inside the wheel, and finds no solution region there.
    texts = searchable("grader.whl", data)
    assert len(texts) > 100
    assert leaks(REPO / "solutions", {"grader.whl": (data, False)})[0] == []
    # ... and would find one that was put in.
    planted = io.BytesIO()
    with zipfile.ZipFile(planted, "w") as z:
        z.writestr("course/helper.py", (REPO / "solutions/13-hybrid-parallel/planner.py").read_text())
    found, _ = leaks(REPO / "solutions", {"grader.whl": (planted.getvalue(), False)})
    assert found and all(f.endswith("in grader.whl") for f in found)


def _step(workflow: dict, needle: str) -> dict:
    (job,) = workflow["jobs"].values()
    return next(s for s in job["steps"] if needle in s.get("run", ""))


def _shell(command: str, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", command], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def _runner_venv(tmp_path: Path, name: str = "venv") -> Path:
    """A runner's environment with torch and the rest already in it (so that nothing is
    downloaded): a venv whose site-packages links to this one's, but not to k2c itself."""
    import sysconfig

    venv = tmp_path / name
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    inner = next((venv / "lib").glob("python3*/site-packages"))
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not (inner / entry.name).exists() and not entry.name.startswith(
                ("__editable__", "k2c", "autograder", "course", "pip", "_distutils_hack", "distutils-precedence")):
            (inner / entry.name).symlink_to(entry)
    return venv


def _student_repository(tmp_path: Path, built) -> Path:
    """What the student's repository holds: labs/ with their work (here the references) and
    the wheel where `k2c release --ci` commits it."""
    repo = tmp_path / "student"
    for slug in built.labs:
        shutil.copytree(REPO / "solutions" / slug, repo / "labs" / slug, ignore=shutil.ignore_patterns("*.ipynb"))
    (repo / ci.WHEEL_FOLDER).mkdir()
    shutil.copy(built.folder / built.wheel, repo / ci.WHEEL_FOLDER / built.wheel)
    return repo


@pytest.mark.slow
def test_the_workflow_grades_the_lab_and_the_labs_it_uses_as_written(built, tmp_path):
    yaml = pytest.importorskip("yaml")
    workflow = yaml.safe_load((built.folder / "k2c-grade.yml").read_text())
    assert {"on", "jobs", "env"} <= workflow.keys() and workflow["permissions"] == {"contents": "read"}
    assert workflow["env"]["LABS"] == "13,07,08,09,10"
    assert workflow["env"]["K2C_WHEEL"] == f".k2c/{built.wheel}" and workflow["env"]["K2C_WHEEL_SHA256"] == built.sha256
    install, selftest, grade = (_step(workflow, w) for w in ("sha256sum --check", "k2c selftest", "k2c grade"))
    assert "download.pytorch.org/whl/cpu" in install["run"]  # torch's CPU build on a runner without a GPU
    repo = _student_repository(tmp_path, built)
    _runner_venv(tmp_path, "k2c")  # "$RUNNER_TEMP/k2c", with torch in it already: nothing to download
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(workflow["env"], RUNNER_TEMP=str(tmp_path), GITHUB_PATH=str(tmp_path / "path"),
               GITHUB_STEP_SUMMARY=str(tmp_path / "summary.md"))
    # The install step as written, but apt-get (bubblewrap is here already).
    installed = _shell("\n".join(l for l in install["run"].splitlines() if "apt-get" not in l), env, repo)
    assert installed.returncode == 0 and ": OK" in installed.stdout, installed.stdout + installed.stderr
    env["PATH"] = os.pathsep.join([*(tmp_path / "path").read_text().split(), env["PATH"]])
    ran = _shell(selftest["run"], env, repo)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    graded = _shell(grade["run"], env, repo)
    assert graded.returncode == 0, graded.stdout[-3000:] + graded.stderr[-3000:]  # --require-full: full marks
    where = _shell("head -1 \"$(command -v k2c)\" && python -c 'import autograder; print(autograder.__file__)'",
                   env, repo).stdout
    assert f"{tmp_path}/k2c/" in where and str(REPO / "autograder") not in where  # the wheel graded, not this checkout

    suites = ET.parse(repo / "k2c-junit.xml").getroot().findall("testsuite")
    assert [s.get("name") for s in suites] == list(built.labs)
    assert all(s.get("failures") == s.get("errors") == "0" for s in suites)
    summary = (tmp_path / "summary.md").read_text()
    headings = re.findall(r"^### Lab (\S+): (\d+)/(\d+) points", summary, re.M)
    assert [h[0] for h in headings] == list(built.labs) and all(h[1] == h[2] for h in headings)
    assert "**Total:" in summary and len(summary.encode()) < 1024 * 1024  # GitHub's job summary limit

    # A wheel that is not the one k2c ci wrote stops the job before anything runs.
    (repo / ci.WHEEL_FOLDER / built.wheel).write_bytes(_wheel(built) + b"\0")
    assert _shell(install["run"].splitlines()[0], env, repo).returncode != 0


def test_the_github_classroom_workflow_hands_the_result_to_the_reporter(built):
    yaml = pytest.importorskip("yaml")
    workflow = yaml.safe_load((built.folder / "github-classroom.yml").read_text())
    (job,) = workflow["jobs"].values()
    grade = _step(workflow, "k2c grade")
    assert "--format classroom" in grade["run"] and "result=" in grade["run"] and "$GITHUB_OUTPUT" in grade["run"]
    assert "K2C_SOURCE" not in json.dumps(workflow)  # nothing from the private course repository
    reporter = next(s for s in job["steps"] if s.get("uses", "").startswith("classroom-resources/autograding-grading-reporter@"))
    step_id = grade["id"]
    assert [r.strip() for r in reporter["with"]["runners"].split(",")] == [step_id] and step_id.isalnum()
    assert reporter["env"][f"{step_id.upper()}_RESULTS"].replace(" ", "") == f"${{{{steps.{step_id}.outputs.result}}}}"
    assert job["steps"].index(grade) < job["steps"].index(reporter)


# Classroom 50's result.json contract (wiki "Advanced Autograding"): field, type.
CLASSROOM50_FIELDS = {"schema": str, "classroom": str, "assignment": str, "submission": str, "commit": str,
                      "release": str, "review": str, "datetime": str, "score": int, "max-score": int, "tests": list}
CLASSROOM50_TEST = {"test-name": str, "passed": bool, "score": int, "max-score": int}
UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


def assert_classroom50_result(result: dict) -> None:
    for field, kind in CLASSROOM50_FIELDS.items():
        assert type(result[field]) is kind, (field, result.get(field))
    assert result["schema"] == "classroom50/result/v1" and UTC.fullmatch(result["datetime"])
    for test in result["tests"]:
        for field, kind in CLASSROOM50_TEST.items():
            assert type(test[field]) is kind, (field, test)
        assert 0 <= test["score"] <= test["max-score"] and test["passed"] == (test["score"] == test["max-score"] > 0)
    assert result["score"] == sum(t["score"] for t in result["tests"])
    assert result["max-score"] == sum(t["max-score"] for t in result["tests"])


@pytest.mark.slow
def test_classroom50s_autograder_writes_the_result_its_contract_asks_for(built, tmp_path):
    """autograder.py as Classroom 50's runner runs it: in the student's checkout, with
    the runner's variables, the wheel beside it. Lab 13's reference with lab 10's starter:
    the score is the student's, whole points, the same in result.json and release-body.md."""
    bundle = tmp_path / "classroom50" / "autograders" / "lab-13"
    bundle.mkdir(parents=True)
    for name in ("autograder.py", built.wheel):
        shutil.copy(built.folder / name, bundle / name)
    repo = _student_repository(tmp_path, built)
    shutil.rmtree(repo / "labs" / "10-tensor-parallel")
    shutil.copytree(REPO / "labs" / "10-tensor-parallel", repo / "labs" / "10-tensor-parallel")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=s", "-c", "user.email=s@x", "commit", "-q", "--allow-empty", "-m", "work",
                    "--date", "2026-06-01T14:32:05Z"], cwd=repo, check=True,
                   env=dict(os.environ, GIT_COMMITTER_DATE="2026-06-01T14:32:05Z"))
    venv = _runner_venv(tmp_path)
    runner = {"CLASSROOM": "cs-parallel", "ASSIGNMENT": "lab-13", "SUBMISSION_TAG": "submit/2026-06-01T14-32-05Z-a1b2c3d",
              "COMMIT_URL": "https://github.com/org/lab-13-ada/commit/a1b2c3d",
              "RELEASE_URL": "https://github.com/org/lab-13-ada/releases/tag/submit%2F2026",
              "REVIEW_URL": "", "K2C_VENV": str(venv)}
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    done = subprocess.run([sys.executable, str(bundle / "autograder.py")], cwd=repo, env={**env, **runner},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((repo / "result.json").read_text())
    assert_classroom50_result(result)
    assert (result["classroom"], result["assignment"], result["submission"]) == ("cs-parallel", "lab-13",
                                                                                 runner["SUBMISSION_TAG"])
    assert result["review"] == runner["COMMIT_URL"] and result["datetime"] == "2026-06-01T14:32:05Z"
    assert 0 < result["score"] < result["max-score"]  # lab 10's stubs cost lab 13 the checks that use them
    body = (repo / "release-body.md").read_text()
    assert f"### Lab 13-hybrid-parallel: {result['score']}/{result['max-score']} points" in body
