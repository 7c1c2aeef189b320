import json
import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
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


def load_check_file(lab, name):
    """``autograder/checks/<lab>/<name>.py`` as a module, to test the grader's own
    pieces. Its checks' ``points(n)`` mark is registered by the grader's plugin,
    so plain pytest's unknown-mark warning is silenced while it loads."""
    import importlib.util
    import warnings

    path = REPO / "autograder" / "checks" / lab / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"lab{lab[:2]}_{name}", path)
    module = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
        spec.loader.exec_module(module)
    return module


def fixtures(pattern, name):
    """Every ``name`` list of the modules ``tests/fixtures/<pattern>.py``, joined, with pytest ids
    ``"NN: what it is"``."""
    import importlib

    found = [item for path in sorted((REPO / "tests" / "fixtures").glob(f"{pattern}.py"))
             for item in getattr(importlib.import_module(f"fixtures.{path.stem}"), name)]
    return found, [f"{item.lab[:2]}: {item.name}" for item in found]


def statuses(report):
    return {t["name"]: t["status"] for t in report["tests"]}


def build_submission(folder: Path, lab_slug, filename, edits=()) -> Path:
    """Copy a lab's reference into ``folder``, applying (before, after) edits to
    ``filename``. The earlier labs' files it ``uses`` are copied beside its own (a
    flat submission holding them): the grader takes them from the submission only."""
    from autograder.grading.labs import find_lab

    shutil.copytree(REPO / "solutions" / lab_slug, folder, ignore=shutil.ignore_patterns("*.ipynb", "__pycache__"))
    for used in find_lab(lab_slug).uses:
        shutil.copyfile(REPO / "solutions" / used, folder / Path(used).name)
    path = folder / filename
    source = path.read_text()
    for before, after in edits:
        assert source.count(before) == 1, f"fixture edit no longer applies to {filename}: {before!r}"
        source = source.replace(before, after)
    path.write_text(source)
    return folder


@pytest.fixture
def make_submission(tmp_path):
    """``make(lab_slug, filename, edits)``: the reference with edits, in a fresh folder (see build_submission)."""
    return lambda lab_slug, filename, edits=(): build_submission(tmp_path / lab_slug, lab_slug, filename, edits)


@dataclass(frozen=True)
class WholeLab:
    """A whole lab of ``folder`` (``solutions``: the reference; ``labs``: the starter), graded on every check."""
    lab: str
    folder: str

    @property
    def name(self) -> str:
        return self.folder


DOING_NOTHING = "doing nothing"  # a WholeLab folder: the starter with every stub returning None


def doing_nothing(lab: str, folder: Path) -> Path:
    """A copy of ``labs/<lab>`` in which every ``raise NotImplementedError(...)`` is
    ``return None``: functions and kernels that run, and do nothing."""
    import ast
    import shutil

    shutil.copytree(REPO / "labs" / lab, folder / lab)
    for path in (folder / lab).rglob("*.py"):
        lines = path.read_text().splitlines(keepends=True)
        stubs = [node for node in ast.walk(ast.parse("".join(lines))) if isinstance(node, ast.Raise)
                 and isinstance(node.exc, ast.Call) and getattr(node.exc.func, "id", "") == "NotImplementedError"]
        for node in sorted(stubs, key=lambda n: n.lineno, reverse=True):
            indent = lines[node.lineno - 1][:node.col_offset]
            lines[node.lineno - 1:node.end_lineno] = [indent + "return None\n"]
        path.write_text("".join(lines))
    return folder


def fixture_params(items, ids):
    """pytest parameters for fixtures (buggy, alternative, WholeLab), one xdist
    group per lab: under ``--dist loadgroup`` a lab's fixtures run in one worker,
    which grades them all in one batch (``graded_fixture``)."""
    return [pytest.param(item, id=name, marks=pytest.mark.xdist_group(f"lab-{item.lab}"))
            for item, name in zip(items, ids)]


def grade_batch(jobs, work: Path) -> list[dict]:
    """``tests/grade_batch.py``: grade ``jobs`` ({lab, submission, select}) in one grader process."""
    spec, out = work / "jobs.json", work / "reports.json"
    spec.write_text(json.dumps(jobs))
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "grade_batch.py"), spec, out], cwd=REPO,
                          capture_output=True, text=True, timeout=600 + 120 * len(jobs))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _job(item, folder: Path) -> dict:
    """What grade_batch.py grades for a fixture: the edited reference on its grade_args, or a whole lab."""
    if isinstance(item, WholeLab) and item.folder == DOING_NOTHING:
        return {"lab": item.lab, "select": None, "submission": str(doing_nothing(item.lab, folder))}
    if isinstance(item, WholeLab):
        return {"lab": item.lab, "select": None, "submission": str(REPO / item.folder)}
    return {"lab": item.lab, "select": dict(zip(item.grade_args[::2], item.grade_args[1::2])).get("-k"),
            "submission": str(build_submission(folder / item.lab, item.lab, item.file, item.edits))}


@pytest.fixture(scope="session")
def graded_fixture(request, tmp_path_factory):
    """``report(fixture)``: the JSON report of a buggy or alternative fixture
    (``tests/fixtures``, graded on its ``grade_args``) or of a ``WholeLab``. The
    first fixture of a lab asked for grades, in one grader process, every fixture
    of that lab that this session's selected tests hold (under xdist, its group's):
    a grader process and its sandbox server per lab, not per fixture."""
    from fixtures.alternative import Alternative
    from fixtures.buggy import Bug

    reports = {}

    def key(item):
        return type(item).__name__, item.lab, item.name

    def report(wanted):
        if key(wanted) not in reports:
            batch = []
            for test in request.session.items:
                item = getattr(test, "callspec", None) and next(
                    (v for v in test.callspec.params.values() if isinstance(v, (Bug, Alternative, WholeLab))), None)
                if item is not None and item.lab == wanted.lab and key(item) not in reports \
                        and item not in batch:
                    batch.append(item)
            work = tmp_path_factory.mktemp(f"batch-{wanted.lab[:2]}")
            jobs = [_job(item, work / f"{n}") for n, item in enumerate(batch)]
            for item, got in zip(batch, grade_batch(jobs, work)):
                reports[key(item)] = got
        got = reports[key(wanted)]
        assert "error" not in got, got.get("error")
        return got
    return report


@pytest.fixture
def our_processes(monkeypatch):
    """A function listing the live processes this test started (zombies are already
    dead). Other tests may run jobs at the same time (pytest-xdist): ours carry this
    test's marker in their environment, which mpiexec, the launchers and the
    sandbox pass on."""
    token = uuid.uuid4().hex
    monkeypatch.setenv("K2C_TEST_JOB", token)
    marker = f"K2C_TEST_JOB={token}".encode()

    def ours() -> list[str]:
        found = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if state != "Z" and marker in environ:
                found.append(f"{entry} {cmd}")
        return found
    return ours


@pytest.fixture
def bubblewrap():
    """The strong isolation layer. CI installs bubblewrap, so there it must be in use; elsewhere
    (a laptop without it) the tests that need it are skipped, and say so."""
    from autograder.sandbox import isolation

    found = isolation.detect()
    if found.layer is not isolation.Layer.BUBBLEWRAP:
        if os.environ.get("CI"):
            pytest.fail(f"CI must grade under bubblewrap; this machine gives {found.describe()}")
        pytest.skip(f"needs bubblewrap (apt-get install bubblewrap); here: {found.describe()}")
    return found
