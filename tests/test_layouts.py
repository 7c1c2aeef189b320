"""Submission layouts: the grader finds a lab's files in every shape a submission
comes in, as a folder or a zip (``autograder.grading.labs.locate``):

- ``top``: the lab's files themselves (Gradescope's flat upload);
- ``slug``: ``06-collectives/`` at the top (like ``labs/`` or ``solutions/``);
- ``repo``: a student repository, the lab in ``labs/06-collectives/`` (a clone
  of ``k2c release``, as GitHub Classroom and Gradescope's GitHub upload hand over);
- ``wrapped-*``: one wrapping folder around any of those, with clutter beside it.

A lab that uses earlier labs' files (13) takes them from the same repository;
a submission without any of the lab's files is ``missing``, never graded 0.
"""
import base64
import csv
import json
import shutil
import zipfile
from pathlib import Path

import pytest

from conftest import REPO, grade_batch, k2c

from autograder.grading.labs import find_lab, locate, unpack, with_used_files

pytestmark = pytest.mark.xdist_group("layouts")  # the shapes are graded in one batch, a module fixture

LAB06 = "06-collectives"
LAB13 = "13-hybrid-parallel"
# One pure-function check, enough to show the reference was found and graded; the
# wrapped repository zip, the deepest shape, is graded on every check.
SELECT = "chunk_bounds"


def _reference(lab, into: Path) -> Path:
    """The lab's reference modules (no notebooks) in ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    for path in (REPO / "solutions" / lab).glob("*.py"):
        shutil.copy(path, into)
    return into


def _repository(into: Path, *labs) -> Path:
    """A student repository: ``labs/NN-slug/`` holding the references of ``labs``, a
    starter of another lab beside them, a README and a ``.git`` folder."""
    for lab in labs:
        _reference(lab, into / "labs" / lab)
    shutil.copytree(REPO / "labs" / "05-message-passing", into / "labs" / "05-message-passing")
    (into / "README.md").write_text("# my k2c labs\n")
    (into / ".git").mkdir()
    (into / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return into


def _wrapped(make):
    """``make``'s shape inside one folder, ``k2c-main/``, with an archiver's clutter beside it."""
    def build(folder: Path) -> None:
        make(folder / "k2c-main")
        (folder / "__MACOSX").mkdir()
        (folder / "__MACOSX" / "._k2c-main").write_text("resource fork")
        (folder / ".DS_Store").write_text("finder")
    return build


BARE = {  # shape -> (make it in a folder, the lab's folder inside it)
    "top": (lambda d: _reference(LAB06, d), "."),
    "slug": (lambda d: _reference(LAB06, d / LAB06), LAB06),
    "repo": (lambda d: _repository(d, LAB06), f"labs/{LAB06}"),
}
SHAPES = {**BARE, **{f"wrapped-{name}": (_wrapped(make), "k2c-main" if inside == "." else f"k2c-main/{inside}")
                     for name, (make, inside) in BARE.items()}}


def _zip(folder: Path, archive: Path) -> Path:
    with zipfile.ZipFile(archive, "w") as z:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                z.write(path, path.relative_to(folder).as_posix())
    return archive


def _build(shape: str, kind: str, work: Path) -> Path:
    folder = work / f"{shape}-{kind}"
    folder.mkdir(parents=True)
    SHAPES[shape][0](folder)
    return _zip(folder, work / f"{shape}.zip") if kind == "zip" else folder


@pytest.mark.parametrize("shape", SHAPES)
def test_locate_finds_the_lab_in_every_shape(shape, tmp_path):
    folder = _build(shape, "folder", tmp_path)
    found = locate(find_lab(LAB06), folder)
    inside = SHAPES[shape][1]
    assert found.folder == (folder / inside).resolve() and found.missing == () and found.searched == ()
    reference = REPO / "solutions" / LAB06 / "collectives.py"
    assert (found.folder / "collectives.py").read_bytes() == reference.read_bytes()


# ---------------------------------------------------------------------------
# Graded: every shape, as a folder and as a zip, in one grader process

KINDS = ("folder", "zip")
CASES = [(shape, kind) for shape in SHAPES for kind in KINDS]
FULL = ("wrapped-repo", "zip")


@pytest.fixture(scope="module")
def shape_reports(tmp_path_factory):
    """(the submission, its JSON report) for each case."""
    work = tmp_path_factory.mktemp("shapes")
    built = {case: _build(*case, work) for case in CASES}
    jobs = [{"lab": LAB06, "submission": str(built[case]), "select": None if case == FULL else SELECT}
            for case in CASES]
    (work / "batch").mkdir()
    return {case: (built[case], report) for case, report in zip(CASES, grade_batch(jobs, work / "batch"))}


@pytest.mark.slow
@pytest.mark.parametrize("shape,kind", CASES, ids=[f"{s}-{k}" for s, k in CASES])
def test_every_shape_of_the_reference_scores_full(shape, kind, shape_reports):
    submission, report = shape_reports[(shape, kind)]
    assert "error" not in report, report.get("error")
    assert report["status"] == "graded" and report["tests"], report
    assert report["score"] == report["max_score"] > 0, [(t["name"], t["feedback"]) for t in report["tests"]]
    inside = SHAPES[shape][1]
    if kind == "folder":
        assert report["submission"] == str((submission / inside).resolve())
    else:  # the zip, and the folder in it that was graded
        zipped = str(submission.resolve())
        assert report["submission"] == (zipped if inside == "." else f"{zipped}!/{inside}")
    if (shape, kind) == FULL:
        assert len(report["tests"]) > 1 and report["max_score"] == sum(t["max_points"] for t in report["tests"])


# ---------------------------------------------------------------------------
# Lab 13 takes labs 07-10 from the same repository

USED = ["07-training-memory", "08-data-parallel", "09-zero-sharding", "10-tensor-parallel"]


def test_used_files_come_from_the_repository_beside_the_lab(tmp_path):
    lab = find_lab(LAB13)
    archive = _zip(_repository(tmp_path / "made" / "my-repo", LAB13, *USED), tmp_path / "repo.zip")
    root = unpack(archive, tmp_path / "unpacked")
    found = locate(lab, root)
    assert found.folder == (root / "labs" / LAB13).resolve() and found.root == (root / "labs").resolve()
    staged = with_used_files(lab, found.folder, found.root, tmp_path / "staged")
    for used in lab.uses:
        assert (staged / Path(used).name).read_bytes() == (root / "labs" / used).read_bytes(), used
    # Only lab 13's files, flat: nothing is taken from anywhere else (solutions/ least of all).
    alone = _reference(LAB13, tmp_path / "flat")
    found = locate(lab, alone)
    staged = with_used_files(lab, found.folder, found.root, tmp_path / "staged-flat")
    assert found.folder == alone.resolve() and not any((staged / Path(u).name).exists() for u in lab.uses)


@pytest.mark.slow
def test_lab_13_in_a_repository_grades_with_labs_07_to_10_beside_it(tmp_path):
    repo = _repository(tmp_path / "repo", LAB13, *USED)
    # planner.py imports 07's memory_budget and 09's zero; hybrid.py 08's ddp and 10's tensor_parallel.
    proc = k2c("grade", "13", "--submission", repo, "--format", "json",
               "-k", "memory_matches_module_07_estimator or run_plan_rejects_unsupported_plans")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["status"] == "graded" and len(report["tests"]) == 2
    assert report["score"] == report["max_score"] == 3, [(t["name"], t["feedback"]) for t in report["tests"]]
    assert report["submission"] == str((repo / "labs" / LAB13).resolve())


# ---------------------------------------------------------------------------
# No lab files: status missing, with where it looked

def _no_lab_files(folder: Path) -> Path:
    """A repository whose lab folder holds only the handout: none of the lab's files."""
    (folder / "labs" / LAB06).mkdir(parents=True)
    shutil.copy(REPO / "labs" / LAB06 / "handout.ipynb", folder / "labs" / LAB06)
    (folder / "notes.txt").write_text("I forgot to commit collectives.py\n")
    return folder


def test_locate_lists_where_it_looked(tmp_path):
    found = locate(find_lab(LAB06), _no_lab_files(tmp_path / "sub"))
    assert found.folder is None and found.searched == ("./", f"{LAB06}/", f"labs/{LAB06}/")
    wrapped = tmp_path / "outer"
    _no_lab_files(wrapped / "inner")
    assert locate(find_lab(LAB06), wrapped).searched == (
        "./", f"{LAB06}/", f"labs/{LAB06}/", "inner/", f"inner/{LAB06}/", f"inner/labs/{LAB06}/")


def test_no_lab_files_is_missing_in_every_report_format(tmp_path):
    sub = _no_lab_files(tmp_path / "sub")
    searched = ["./", f"{LAB06}/", f"labs/{LAB06}/"]
    proc = k2c("grade", "06", "--submission", sub, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["status"] == "missing" and report["score"] == 0 and report["tests"] == []
    assert report["max_score"] == 25 and report["searched"] == searched  # the lab's maximum, nothing run
    assert all(where in report["message"] for where in searched) and "collectives.py" in report["message"]

    text = k2c("grade", "06", "--submission", sub).stdout
    assert "MISSING: no lab files found" in text and all(f"    {where}\n" in text for where in searched)
    gradescope = json.loads(k2c("grade", "06", "--submission", sub, "--format", "gradescope").stdout)
    assert gradescope["score"] == 0 and gradescope["tests"] == []
    assert "no lab files found" in gradescope["output"] and all(w in gradescope["output"] for w in searched)
    junit = k2c("grade", "06", "--submission", sub, "--format", "junit").stdout
    assert 'failures="1"' in junit and 'type="missing"' in junit and f"labs/{LAB06}/" in junit
    classroom = json.loads(base64.b64decode(k2c("grade", "06", "--submission", sub, "--format", "classroom").stdout))
    assert classroom["status"] == "fail" and classroom["max_score"] == 25
    assert [t["status"] for t in classroom["tests"]] == ["error"]
    assert f"labs/{LAB06}/" in classroom["tests"][0]["message"]
    # --require-full: missing is below full marks
    assert k2c("grade", "06", "--submission", sub, "--require-full").returncode == 1


def test_some_of_the_lab_files_is_graded_with_the_missing_ones_named(tmp_path):
    sub = tmp_path / "sub"
    sub.mkdir()
    shutil.copy(REPO / "solutions" / LAB13 / "planner.py", sub)
    proc = k2c("grade", "13", "--submission", sub, "--format", "json", "-k", "invalid_plans_raise_value_error")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["status"] == "graded" and report["score"] == 0
    assert "has no hybrid.py, cluster.py" in report["tests"][0]["feedback"]


# ---------------------------------------------------------------------------
# k2c grade-class

@pytest.mark.slow
def test_a_repository_shaped_submission_of_the_references_gets_full_marks_in_grade_class(tmp_path):
    """Must-show: alice's submission is her repository (labs/06-collectives/ holding the
    reference's modules); carol's repository lacks the lab's file."""
    root = tmp_path / "class"
    _repository(root / "alice", LAB06)
    _no_lab_files(root / "carol")
    gradebook = tmp_path / "gradebook.csv"
    proc = k2c("grade-class", "06", root, "-o", gradebook, "--jobs", "1")
    assert proc.returncode == 0, proc.stderr
    assert "2 submissions (1 graded, 1 missing)" in proc.stdout, proc.stdout
    with open(gradebook, newline="") as f:
        rows = {row["student"]: row for row in csv.DictReader(f)}
    alice, carol = rows["alice"], rows["carol"]
    assert alice["status"] == "graded" and float(alice["score"]) == float(alice["max"]) == 25, alice
    assert carol["status"] == "missing" and float(carol["score"]) == 0 and carol["max"] == alice["max"]
    assert "no lab files found" in carol["message"] and f"labs/{LAB06}/" in carol["message"], carol
