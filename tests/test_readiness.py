"""No score from a machine that cannot grade: where the sandbox's user cannot read this
Python or the checkout, every command that grades stops with exit 2, naming the folder
that user cannot enter and the remedy, and gives no score (autograder.sandbox.readiness)."""
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="student code runs as nobody only when the grader is root")


def _first_closed_folder(*paths: str) -> str:
    """The first folder on the way to ``paths`` that nobody (an "other" user) cannot enter."""
    for path in paths:
        steps = Path(path).parts
        for depth in range(2, len(steps) + 1):
            folder = Path(*steps[:depth])
            mode = folder.stat().st_mode
            if folder.is_dir() and (mode & 0o005) != 0o005:
                return str(folder)
    return ""


@pytest.fixture(scope="module")
def private_checkout(tmp_path_factory):
    """The grader and the toolkit, copied into a folder only root may enter (a checkout
    under /root, or a ``mktemp -d``), with the reference of lab 01 as a class of one."""
    private = tmp_path_factory.mktemp("private")
    os.chmod(private, 0o700)
    ignore = shutil.ignore_patterns("__pycache__")
    for part in ("autograder", "course"):
        shutil.copytree(REPO / part, private / part, ignore=ignore)
    shutil.copytree(REPO / "solutions" / "01-parallel-thinking", private / "class" / "ada", ignore=ignore)
    return private


@pytest.mark.slow
def test_a_machine_that_cannot_grade_says_why_and_gives_no_score(private_checkout, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(private_checkout), K2C_ISOLATION="subreaper")
    blocked = _first_closed_folder(os.path.realpath(sys.executable), str(private_checkout / "course"))
    assert blocked, "the copy's folder is 0700"
    gradebook = tmp_path / "book.csv"
    commands = {"grade": ["grade", "01", "--submission", private_checkout / "class" / "ada"],
                "selftest": ["selftest", "01"],
                "grade-class": ["grade-class", "01", private_checkout / "class", "-o", gradebook,
                                "--allow-weak-isolation"]}
    for name, args in commands.items():
        done = subprocess.run([sys.executable, "-m", "autograder.cli", *map(str, args)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        said = done.stdout + done.stderr
        assert done.returncode == 2, f"{name}: {said}"
        assert f"cannot enter {blocked} (drwx------" in said, f"{name}: {said}"
        assert "Remedy: install bubblewrap" in said and "where nobody can read them" in said, f"{name}: {said}"
        assert "Score" not in said and "/21" not in said, f"{name}: {said}"
    assert not gradebook.exists()
