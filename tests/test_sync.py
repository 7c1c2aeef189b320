"""labs/ is generated from solutions/ and must not drift."""
import pytest

from autograder.instructor.sync import MarkerError, differences, strip_solutions, sync
from conftest import REPO, k2c


def test_labs_are_in_sync_with_solutions():
    assert differences(REPO / "solutions", REPO / "labs") == []


def test_sync_check_command_agrees():
    proc = k2c("sync", "--check")
    assert proc.returncode == 0 and "in sync" in proc.stdout, proc.stdout + proc.stderr


def test_strip_replaces_region_with_named_hint():
    source = (
        "def f(x):\n"
        "    y = 1\n"
        "    # BEGIN SOLUTION: add one\n"
        "    return x + y\n"
        "    # END SOLUTION\n"
    )
    out = strip_solutions(source)
    assert "return x + y" not in out
    assert "    raise NotImplementedError('not implemented yet: f: add one')\n" in out
    assert out.startswith("def f(x):\n    y = 1\n")


def test_starters_have_no_solution_code():
    for path in (REPO / "labs").rglob("*.py"):
        text = path.read_text()
        assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text, path
    assert "prange(x.size)" not in (REPO / "labs/01-parallel-thinking/cpu_parallel.py").read_text()


@pytest.mark.parametrize("source,problem", [
    ("# BEGIN SOLUTION\nx = 1\n", "without END"),
    ("x = 1\n# END SOLUTION\n", "without BEGIN"),
    ("# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION\n", "inside another"),
])
def test_unbalanced_markers_are_refused(source, problem):
    with pytest.raises(MarkerError, match=problem):
        strip_solutions(source, "x.py")


def test_drift_is_detected_and_repaired(tmp_path):
    solutions, labs = tmp_path / "solutions", tmp_path / "labs"
    (solutions / "01-x").mkdir(parents=True)
    (solutions / "01-x" / "m.py").write_text("def f():\n    # BEGIN SOLUTION\n    return 1\n    # END SOLUTION\n")
    (solutions / "01-x" / "handout.ipynb").write_text("{}")
    sync(solutions, labs)
    assert differences(solutions, labs) == []
    (labs / "01-x" / "m.py").write_text("def f():\n    return 1\n")  # a hand edit
    (labs / "01-x" / "stale.py").write_text("")
    assert sorted(differences(solutions, labs)) == ["differs: labs/01-x/m.py", "not in solutions/: labs/01-x/stale.py"]
    sync(solutions, labs)
    assert differences(solutions, labs) == []


def test_no_committed_notebook_keeps_outputs():
    """Notebooks in the repository hold no outputs or execution counts: nothing of the
    machine that last ran them (its paths, its timings) reaches students or the site."""
    import json
    import subprocess

    tracked = subprocess.run(["git", "ls-files", "*.ipynb"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    assert len(tracked) >= 13 + 13  # the lectures and every lab's handout, twice (labs/, solutions/)
    kept = {}
    for name in tracked:
        cells = [c for c in json.loads((REPO / name).read_text())["cells"] if c["cell_type"] == "code"]
        outputs = sum(bool(c.get("outputs")) for c in cells)
        counts = sum(c.get("execution_count") is not None for c in cells)
        if outputs or counts:
            kept[name] = f"{outputs} cells with outputs, {counts} with execution counts"
    assert not kept, ("clear them (Jupyter: Edit > Clear Outputs of All Cells; or "
                      f"jupyter nbconvert --clear-output --inplace FILE): {kept}")
