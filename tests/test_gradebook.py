"""``k2c grade-class``: a folder of submissions becomes a gradebook with a row
for every student, whatever their submission does, and ``--resume`` grades
only what changed. The SLURM form is in tests/test_slurm.py."""
import csv
import json
import os
import shutil
import signal
import socket
import zipfile

import pytest

from conftest import REPO, k2c

from autograder.sandbox import isolation
from autograder.instructor.gradebook import RowStatus, Settings, Unreadable, grade_one, unpack

LAB06 = "06-collectives"
# The checks graded: one pure function and one 2- and 3-rank MPI job, to keep
# the file's time down; the reference's full lab is graded in test_grading.py.
SELECT = "chunk_bounds or allreduce_ring_results"
FULL = 1 + 2


def _reference(into):
    into.mkdir(parents=True)
    shutil.copy(REPO / "solutions" / LAB06 / "collectives.py", into)
    return into


def _class(root, gradebook):
    """Seven students: the reference as a folder and as a zip of a folder, the
    starter, an empty folder, two zips that must not be unpacked, and a hostile
    submission that prints and writes a forged row and kills its process group."""
    root.mkdir()
    _reference(root / "alice")
    shutil.copytree(REPO / "labs" / LAB06, root / "bob", ignore=shutil.ignore_patterns("*.ipynb"))
    (root / "carol").mkdir()
    _reference(root / "zipped" / "dave")
    with zipfile.ZipFile(root / "dave.zip", "w") as z:
        z.write(root / "zipped" / "dave" / "collectives.py", "dave/collectives.py")
    shutil.rmtree(root / "zipped")
    (root / "erin.zip").write_text("not a zip")
    with zipfile.ZipFile(root / "frank.zip", "w") as z:
        z.writestr("../../outside.py", "print('escaped')\n")
    hostile = (REPO / "solutions" / LAB06 / "collectives.py").read_text().replace(
        "import numpy as np\n",
        "import numpy as np\nimport os, signal\n"
        "print('mallory,100,100,cpu,graded')\n"
        "try:\n"
        f"    open({str(gradebook)!r}, 'a').write('mallory,100,100,cpu,graded\\n')\n"
        "except OSError:\n"
        "    pass\n"
        "os.killpg(0, signal.SIGKILL)\n", 1)
    (root / "mallory").mkdir()
    (root / "mallory" / "collectives.py").write_text(hostile)


def _rows(csv_path):
    with open(csv_path, newline="") as f:
        return {row["student"]: row for row in csv.DictReader(f)}


@pytest.mark.slow
def test_a_class_gets_a_row_per_student_and_resume_grades_only_what_changed(tmp_path):
    gradebook = tmp_path / "out" / "gradebook.csv"
    _class(tmp_path / "class", gradebook)
    proc = k2c("grade-class", "06", tmp_path / "class", "-o", gradebook, "--jobs", "2", "-k", SELECT)
    assert proc.returncode == 0, proc.stderr
    assert "7 submissions (4 graded, 1 empty, 2 unreadable)" in proc.stdout, proc.stdout
    rows = _rows(gradebook)
    assert sorted(rows) == ["alice", "bob", "carol", "dave", "erin", "frank", "mallory"]
    header = next(csv.reader(open(gradebook)))
    assert header[:5] == ["student", "score", "max", "tier", "status"]
    assert header[-3:] == ["duration_s", "digest", "message"]
    assert header[5:-3] == ["chunk_bounds", "allreduce_ring_results", "isolation", "flags", "node", "gpu", "slurm_job"]
    assert {rows[name]["isolation"] for name in ("alice", "bob", "dave")} == {isolation.detect().layer.value}
    # Where each was graded: this machine, on the CPU tier, outside SLURM (an empty row: nowhere).
    assert {(rows[n]["node"], rows[n]["gpu"], rows[n]["slurm_job"]) for n in ("alice", "bob", "dave")} == {
        (os.environ.get("SLURMD_NODENAME") or socket.gethostname(), "no GPU", "")}
    assert rows["carol"]["node"] == ""

    def score(name):
        return float(rows[name]["score"])

    assert {name: rows[name]["status"] for name in rows} == {
        "alice": "graded", "bob": "graded", "carol": "empty", "dave": "graded", "erin": "unreadable",
        "frank": "unreadable", "mallory": "graded"}
    assert score("alice") == score("dave") == float(rows["alice"]["max"]) > 0
    assert score("bob") == score("mallory") == 0
    assert all(rows[n]["max"] == rows["alice"]["max"] for n in rows)  # one maximum for the class
    assert "no files" in rows["carol"]["message"] and "not a readable zip" in rows["erin"]["message"]
    assert "outside the submission" in rows["frank"]["message"]
    assert not (tmp_path / "outside.py").exists() and not (tmp_path / "class" / "outside.py").exists()
    assert len(rows["alice"]["digest"]) == 64 and rows["alice"]["digest"] == rows["dave"]["digest"]
    # The points per check add up to the score; the forged row is nowhere.
    checks = header[5:-8]
    assert sum(float(rows["alice"][c]) for c in checks) == score("alice")
    assert "mallory,100" not in gradebook.read_text() and "mallory,100" not in proc.stdout
    report = json.loads(gradebook.with_suffix(".json").read_text())
    by_student = {r["student"]: r for r in report["rows"]}
    assert by_student["mallory"]["report"]["tests"][0]["status"] in ("error", "failed")
    assert by_student["alice"]["student_s"] > 0 and by_student["alice"]["duration_s"] > by_student["alice"]["student_s"]
    # Nothing left behind beside the gradebook: the scratch folder is gone.
    assert sorted(p.name for p in gradebook.parent.iterdir()) == ["gradebook.csv", "gradebook.json"]

    # --resume: bob now submits the reference; only bob is graded again.
    (tmp_path / "class" / "bob" / "collectives.py").write_text((REPO / "solutions" / LAB06 / "collectives.py").read_text())
    again = k2c("grade-class", "06", tmp_path / "class", "-o", gradebook, "--jobs", "2", "-k", SELECT, "--resume")
    assert again.returncode == 0, again.stderr
    assert "1 to grade, 3 kept from" in again.stderr and "3 empty or unreadable" in again.stderr, again.stderr
    resumed = _rows(gradebook)
    assert float(resumed["bob"]["score"]) == score("alice")
    assert {n: resumed[n] for n in resumed if n != "bob"} == {n: rows[n] for n in rows if n != "bob"}

    # --resume grades again a row graded under a weaker layer than this machine gives now
    # (bubblewrap installed since): dave's, as if graded without it.
    if isolation.detect().layer is isolation.Layer.BUBBLEWRAP:
        data = json.loads(gradebook.with_suffix(".json").read_text())
        for row in data["rows"]:
            if row["student"] == "dave":
                row["report"]["isolation"]["layer"] = "subreaper"
        gradebook.with_suffix(".json").write_text(json.dumps(data))
        third = k2c("grade-class", "06", tmp_path / "class", "-o", gradebook, "--jobs", "2", "-k", SELECT, "--resume")
        assert third.returncode == 0, third.stderr
        assert "1 graded under a weaker isolation layer than this machine gives now, so graded again: dave" in third.stderr, third.stderr
        assert "1 to grade, 3 kept from" in third.stderr, third.stderr
        assert _rows(gradebook)["dave"]["isolation"] == "bubblewrap"


def test_a_grading_that_cannot_run_gets_a_crashed_row(tmp_path):
    row = grade_one("zoe", tmp_path, "0" * 64, Settings("no-such-lab", "cpu"), tmp_path)
    assert row.status is RowStatus.CRASHED and row.score == 0
    assert "no lab called 'no-such-lab'" in row.message


def test_a_grading_past_its_limit_gets_a_timeout_row_and_leaves_no_process(tmp_path, our_processes):
    _reference(tmp_path / "sub")
    row = grade_one("zoe", tmp_path / "sub", "0" * 64, Settings(LAB06, "cpu", limit_s=1.0), tmp_path)
    assert row.status is RowStatus.TIMEOUT and "past 1 s" in row.message
    assert our_processes() == []


def test_unpacking_refuses_what_would_leave_the_folder(tmp_path):
    archive = tmp_path / "a.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("/etc/evil", "x")
    with pytest.raises(Unreadable, match="outside the submission"):
        unpack(archive, tmp_path / "out")
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("sub/dir/collectives.py", "x = 1\n")
        z.writestr("__MACOSX/sub/._collectives.py", "junk")
    assert unpack(archive, tmp_path / "ok") == tmp_path / "ok" / "sub" / "dir"
