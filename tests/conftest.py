import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Tests that launch kernels in this process (course.cuda_audit) need numba's CUDA
# simulator, which must be chosen before numba.cuda is first imported.
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


def k2c(*args, cwd=REPO, env=None, timeout=900):
    """Run the k2c command line as a user would, in a process of its own."""
    return subprocess.run([sys.executable, "-m", "autograder.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def grade_json(submission, lab, *extra, env=None):
    """Grade and return (the JSON report as a dict, the completed process)."""
    proc = k2c("grade", lab, "--submission", submission, "--format", "json", *extra, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc


def statuses(report):
    return {t["name"]: t["status"] for t in report["tests"]}


@pytest.fixture
def make_submission(tmp_path):
    """Copy a lab's reference into a fresh folder, applying (before, after) edits."""
    def make(lab_slug, filename, edits=()):
        folder = tmp_path / lab_slug
        shutil.copytree(REPO / "solutions" / lab_slug, folder,
                        ignore=shutil.ignore_patterns("*.ipynb", "__pycache__"))
        path = folder / filename
        source = path.read_text()
        for before, after in edits:
            assert source.count(before) == 1, f"fixture edit no longer applies to {filename}: {before!r}"
            source = source.replace(before, after)
        path.write_text(source)
        return folder
    return make
