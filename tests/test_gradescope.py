"""The Gradescope autograder (``k2c gradescope``) and its results.json (``--format gradescope``)."""
import ast
import functools
import importlib.metadata
import io
import json
import os
import shutil
import subprocess
import tempfile
import sys
import time
import zipfile
from pathlib import Path

import pytest

from autograder.instructor import gradescope

from autograder.grading import report
from autograder.grading.labs import all_labs, find_lab
from autograder.grading.plugin import CheckResult
from autograder.grading.runner import LabResult
from conftest import REPO, k2c

TEST_FIELDS = {"name", "number", "score", "max_score", "status", "output", "tags", "visibility"}


def _lab(tier, checks):
    return LabResult("02-cuda-model", "The CUDA programming model", tier, "/submission", checks, 12.3,
                     {"layer": "bubblewrap", "user": "nobody (uid 65534)"}, "ab" * 32)


def _check(name, status, points, max_points, feedback="", metrics=None):
    return CheckResult(name, f"{name} does its job", points, max_points, status, feedback, 0.5, metrics or {})


SYNTHETIC = [
    _check("launch_config", "passed", 2, 2),
    _check("relu_guard", "failed", 0, 3, "relu(-1) = -1, expected 0"),
    _check("saxpy_bandwidth", "passed", 3, 3, metrics={"device": "H200", "ratio": 0.91, "threshold": 0.6}),
    _check("fused_faster_than_unfused", "failed", 0, 2, "1.1x, needs 1.5x", {"speedup": 1.1}),
    _check("roofline_measured", "passed", 1, 1, metrics={"copy_gbs": 4000.0}),  # measured, but no ratio
    _check("zero_copy_on_device", "skipped", 0, 2, "needs a CUDA GPU (GPU tier); this run is CPU tier"),
]


def test_results_json_follows_gradescopes_specification():
    gs = json.loads(report.gradescope([_lab("cpu", SYNTHETIC)]))
    assert {"score", "execution_time", "output", "visibility", "stdout_visibility", "extra_data", "tests"} <= gs.keys()
    assert gs["score"] == 6 == sum(t.get("score", 0) for t in gs["tests"])
    assert gs["execution_time"] == 12.3 and "CPU tier" in gs["output"]
    assert gs["extra_data"]["checks_sha256"] == {"02-cuda-model": "ab" * 32}
    ran, (skipped,) = gs["tests"][:-1], gs["tests"][-1:]
    for test in gs["tests"]:
        assert test["visibility"] == "visible" and "02-cuda-model" in test["tags"]
    for test in ran:
        assert TEST_FIELDS <= test.keys() and test["status"] in ("passed", "failed")
    assert [t["number"] for t in gs["tests"]] == [f"2.{i}" for i in range(1, 7)]
    by_name = {t["name"].split()[0]: t for t in ran}
    assert by_name["relu_guard"]["status"] == "failed" and "expected 0" in by_name["relu_guard"]["output"]
    # A skipped check did not run: neither passed nor failed. Without a status and a score
    # Gradescope shows it as neither, and its name and output say it was skipped and why.
    assert not {"status", "score", "max_score"} & skipped.keys()
    assert skipped["name"] == "skipped: zero_copy_on_device does its job"
    assert skipped["output"] == "skipped: needs a CUDA GPU (GPU tier); this run is CPU tier"
    assert "skipped" in skipped["tags"]
    assert "measured: device H200, ratio 0.91" in by_name["saxpy_bandwidth"]["output"]
    assert "leaderboard" not in gs  # the CPU tier measures no speed


def test_gpu_tier_ratios_go_on_the_leaderboard():
    gs = json.loads(report.gradescope([_lab("gpu", SYNTHETIC)]))
    assert gs["leaderboard"] == [
        {"name": "saxpy_bandwidth ratio", "value": 0.91, "order": "desc"},
        {"name": "fused_faster_than_unfused speedup", "value": 1.1, "order": "desc"},  # a failed check still measured
    ]
    two = json.loads(report.gradescope([_lab("gpu", SYNTHETIC[:3]), _lab("cpu", SYNTHETIC[:3])]))
    assert [e["name"] for e in two["leaderboard"]] == ["02 saxpy_bandwidth ratio"]


def test_failure_report_has_every_top_level_field():
    gs = json.loads(report.failure("gradescope", "no usable GPU"))
    assert gs["score"] == 0 and gs["tests"] == [] and "no usable GPU" in gs["output"]
    assert {"execution_time", "visibility", "stdout_visibility"} <= gs.keys()


def _wheel(zip_path):
    with zipfile.ZipFile(zip_path) as outer:
        names = outer.namelist()
        wheel_name = next(n for n in names if n.endswith(".whl"))
        inner = zipfile.ZipFile(io.BytesIO(outer.read(wheel_name)))
        modes = {n: outer.getinfo(n).external_attr >> 16 for n in names}
    return names, wheel_name, inner, modes


def test_the_zip_holds_the_scripts_and_a_wheel_of_only_what_lab_06_needs(tmp_path):
    proc = k2c("gradescope", "06", "-o", tmp_path / "autograder.zip")
    assert proc.returncode == 0, proc.stderr
    names, wheel_name, inner, modes = _wheel(tmp_path / "autograder.zip")
    assert sorted(names) == sorted(["setup.sh", "run_autograder", wheel_name])
    assert modes["setup.sh"] & 0o111 and modes["run_autograder"] & 0o111
    assert wheel_name == f"k2c-{gradescope.project()['version']}+lab06-py3-none-any.whl"
    files = inner.namelist()
    assert not any(n.startswith(("solutions/", "labs/")) or "/solutions/" in n for n in files)
    assert {n.split("/")[2] for n in files if n.startswith("autograder/checks/")} == {"06-collectives"}
    assert not any(n.startswith("course/lectures") or n.endswith(".ipynb") for n in files)
    course = {n for n in files if n.startswith("course/")}
    assert {"course/__init__.py", "course/mpi.py", "course/mpi_audit.py", "course/jobs.py"} <= course
    assert not course & {"course/dist.py", "course/models.py", "course/plots.py", "course/races.py"}
    metadata = inner.read(next(n for n in files if n.endswith(".dist-info/METADATA"))).decode()
    requires = {gradescope.distribution(line.split(":", 1)[1]) for line in metadata.splitlines()
                if line.startswith("Requires-Dist:")}
    assert requires == {"numpy", "pytest", "mpi4py", "mpich"}
    assert b"k2c = autograder.cli:main" in inner.read(next(n for n in files if n.endswith("entry_points.txt")))
    # The same checkout gives the same zip, byte for byte.
    k2c("gradescope", "06", "-o", tmp_path / "again.zip")
    assert (tmp_path / "again.zip").read_bytes() == (tmp_path / "autograder.zip").read_bytes()
    # The instructor guide shows this run: what it says is in the wheel is what is.
    guide = (REPO / "docs" / "instructor-guide.md").read_text()
    for line in proc.stdout.splitlines()[1:]:
        assert f"\n{line}\n" in guide, f"docs/instructor-guide.md's 'k2c gradescope 06' differs from {line!r}"


@pytest.mark.parametrize("lab", [lab for lab in all_labs() if lab.hidden], ids=lambda lab: lab.slug)
def test_the_wheel_holds_the_labs_hidden_checks_and_oracles(lab):
    """Gradescope grades for the instructor: the hidden checks and their oracles ship in its
    wheel (the student repository leaves them out), at the same place in the checks folder."""
    files = gradescope.wheel_files(lab)
    assert {f"autograder/checks/{lab.slug}/{name}" for name in lab.hidden} <= set(files)
    assert all(files[f"autograder/checks/{lab.slug}/{name}"] == lab.checks_dir / name for name in lab.hidden)


def test_setup_installs_the_programs_a_labs_checks_run(tmp_path):
    # lab.toml's system: lab 04 runs its fused kernel's C with g++, which setup.sh installs when missing.
    for lab, wanted in (("04", True), ("06", False)):
        proc = k2c("gradescope", lab, "-o", tmp_path / f"{lab}.zip")
        assert proc.returncode == 0, proc.stderr
        setup = zipfile.ZipFile(tmp_path / f"{lab}.zip").read("setup.sh").decode()
        assert ("command -v g++ >/dev/null || missing+=(g++)" in setup) == wanted
        assert "@SYSTEM@" not in setup


def test_a_lab_without_requires_gets_every_course_dependency():
    lab = find_lab("06")
    pinned = ["numpy>=1.26", "pytest>=8", "torch==2.13.0", "mpi4py>=4.0"]
    everything = type(lab)(**{**lab.__dict__, "requires": None})
    assert gradescope.requirements(everything, pinned) == pinned
    own_pin = type(lab)(**{**lab.__dict__, "requires": ("mpi4py", "cupy-cuda12x>=13")})
    assert gradescope.requirements(own_pin, pinned) == ["numpy>=1.26", "pytest>=8", "mpi4py>=4.0", "cupy-cuda12x>=13"]


@functools.cache
def _providers():
    return importlib.metadata.packages_distributions()  # scans every installed distribution: once


def _module_level_imports(path):
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("lab", all_labs(), ids=lambda lab: lab.slug)
def test_each_labs_requires_cover_what_its_files_import(lab):
    """What the lab's checks, harness, reference and course modules import when
    they load must be installed by its requires (lazy imports of GPU-only paths aside)."""
    providers = _providers()
    allowed = {gradescope.distribution(r) for r in gradescope.requirements(lab, gradescope.project()["dependencies"])}
    lab_files = [*lab.checks_dir.glob("*.py"), *gradescope.lab_sources(lab)]
    sources = lab_files + [REPO / "course" / f"{m}.py" for m in gradescope.course_modules(lab)]
    local = {"course", "autograder", *(p.stem for p in lab_files)}
    for path in sources:
        for top in _module_level_imports(path) - local - set(sys.stdlib_module_names) - {"__future__"}:
            dists = {gradescope.distribution(d) for d in providers.get(top, [])}
            assert dists & allowed, f"{path.relative_to(REPO)} imports {top} ({dists or 'not installed'}), " \
                                    f"which lab {lab.slug}'s requires leave out"


# A submission that forges its results: on stdout, into results.json (its path is in the
# environment), from a daemon that outlives the call, and kills the sandbox's supervisor.
# Inside MPI ranks it raises instead: a rank that dies there hangs its own job until the
# job's timeout (20 s a case), which the MPI tests cover and this test need not wait for.
HOSTILE = '''\
import json, os, signal, time
FORGED = json.dumps({"score": 25, "execution_time": 1, "output": "forged", "tests": []})
print(FORGED)  # a results.json on stdout, for a grader that parses it
RESULTS = os.path.join(os.environ.get("K2C_AUTOGRADER_ROOT", "/autograder"), "results", "results.json")


def forge():
    try:
        with open(RESULTS, "w") as f:
            f.write(FORGED)
    except OSError:
        pass


forge()
if os.fork() == 0:  # a daemon, to write the results once the grader has
    os.setsid()
    os.closerange(3, 1024)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    for _ in range(100):
        time.sleep(0.2)
        forge()
    os._exit(0)
if os.environ.get("PMI_RANK") is not None:
    raise RuntimeError("an MPI rank gives up")  # the ranks' own job: a dead rank would only cost its timeout
try:
    os.kill(os.getppid(), signal.SIGKILL)  # the sandbox's supervisor
except OSError:
    pass
os._exit(0)
'''


# The reference, with a first try at the grader's files: a check file and this bundle's
# wheel. Where nobody could read one, every call fails with LEAKED and what it read.
PRYING = '''
import glob, os, sys
_site = os.path.dirname(os.path.dirname(os.__file__)) + "/site-packages"
_tries = [p for p in sys.path if p.endswith("site-packages")]
_leaked = []
for _folder in _tries + [os.environ.get("K2C_AUTOGRADER_ROOT", "/autograder") + "/source"]:
    for _path in (glob.glob(_folder + "/autograder/checks/*/check_*.py") + glob.glob(_folder + "/k2c-*.whl")
                  + [_folder + "/autograder/checks/06-collectives/check_collectives.py"]):
        try:
            with open(_path, "rb") as _f:
                _leaked.append((_path, _f.read(30)))
        except OSError:
            pass
if _leaked:
    raise RuntimeError(f"LEAKED {_leaked!r}")
'''


def _run(script, root, env, timeout):
    return subprocess.run(["bash", str(root / "source" / script)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_the_autograder_grades_on_an_emulated_gradescope(tmp_path, our_processes):
    """setup.sh into a fresh venv, then run_autograder on the reference, the
    starter and a hostile submission: full marks, zero, zero."""
    root = tmp_path / "autograder"
    for folder in ("source", "submission", "results"):
        (root / folder).mkdir(parents=True)
    proc = k2c("gradescope", "06", "-o", tmp_path / "autograder.zip")
    assert proc.returncode == 0, proc.stderr
    with zipfile.ZipFile(tmp_path / "autograder.zip") as z:
        z.extractall(root / "source")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    # Gradescope's folders are open to every user; pytest's tmp_path is not (nobody could not reach it).
    for folder in (tmp_path, *tmp_path.parents):
        if str(folder).startswith(tempfile.gettempdir() + "/"):
            folder.chmod(folder.stat().st_mode | 0o711)
    env.update(K2C_AUTOGRADER_ROOT=str(root), K2C_VENV=str(tmp_path / "venv"), K2C_PYTHON=sys.executable)

    setup = _run("setup.sh", root, env, 600)
    assert setup.returncode == 0, setup.stdout + setup.stderr
    site = next((tmp_path / "venv" / "lib").glob("python3*/site-packages"))
    assert sorted(p.name for p in (site / "autograder" / "checks").iterdir()) == ["06-collectives"]
    assert not (site / "solutions").exists() and not (site / "course" / "dist.py").exists()

    digest = find_lab("06").checks_digest()
    scores = {}
    for name, source in (("reference", (REPO / "solutions/06-collectives/collectives.py").read_text()),
                         ("starter", (REPO / "labs/06-collectives/collectives.py").read_text()),
                         ("hostile", HOSTILE)):
        shutil.rmtree(root / "submission")
        (root / "submission").mkdir()
        (root / "submission" / "collectives.py").write_text(source)  # Gradescope's flat layout
        (root / "results" / "results.json").unlink(missing_ok=True)
        done = _run("run_autograder", root, env, 300)
        assert done.returncode == 0, done.stdout + done.stderr
        results = json.loads((root / "results" / "results.json").read_text())
        assert results["extra_data"]["checks_sha256"] == {"06-collectives": digest}
        assert all(TEST_FIELDS <= t.keys() for t in results["tests"] if not t["name"].startswith("skipped: "))
        scores[name] = (results["score"], sum(t.get("max_score", 0) for t in results["tests"]))
        if name == "hostile":  # the grader's own report, still, after the forger's child had time to write
            time.sleep(1)
            results = json.loads((root / "results" / "results.json").read_text())
            assert results["output"].startswith("Graded on the CPU tier") and results["tests"]
            assert all(t.get("score", 0) == 0 and t.get("status", "failed") == "failed" for t in results["tests"])
    assert scores["reference"][0] == scores["reference"][1] > 0, scores
    assert scores["starter"][0] == 0 and scores["hostile"][0] == 0, scores

    # A submission that tries the grader's files scores what the reference does, and the
    # instructor (only) sees what it tried.
    shutil.rmtree(root / "submission")
    (root / "submission").mkdir()
    (root / "submission" / "collectives.py").write_text(
        PRYING + (REPO / "solutions/06-collectives/collectives.py").read_text())
    done = _run("run_autograder", root, env, 300)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((root / "results" / "results.json").read_text())
    assert "LEAKED" not in json.dumps(results), results
    assert results["score"] == scores["reference"][0], results["score"]
    flags = [t for t in results["tests"] if "Flags for the instructor" in t["name"]]
    assert len(flags) == 1 and flags[0]["visibility"] == "hidden", flags
    assert "check_collectives.py" in flags[0]["output"], flags[0]["output"]

    # The layer that hides no file (a container without namespaces) runs student code as
    # nobody on the machine's own files: setup.sh and run_autograder made the grader's root's alone.
    grader = site / "autograder"
    assert _readable_by_nobody(grader / "sandbox" / "child.py") and _readable_by_nobody(site / "course" / "mpi.py")
    for secret in (grader / "checks" / "06-collectives" / "check_collectives.py", grader / "instructor" / "release.py",
                   next((root / "source").glob("k2c-*.whl"))):
        assert not _readable_by_nobody(secret), secret

    # An image whose MPI launcher went missing fails its build, saying why (setup.sh's self-test).
    (tmp_path / "venv" / "bin" / "mpiexec").unlink()
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not os.path.exists(f"{p}/mpiexec"))
    broken = _run("setup.sh", root, env, 600)
    assert broken.returncode != 0, broken.stdout + broken.stderr
    assert "✗ MPI: no mpiexec in this environment" in broken.stdout, broken.stdout
    assert "cannot grade lab 06-collectives" in broken.stderr, broken.stderr
    assert our_processes() == []


def _readable_by_nobody(path) -> bool:
    """Whether user nobody can open ``path``, tried in a child that becomes nobody."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            with open(path, "rb"):
                os._exit(0)
        except BaseException:  # noqa: BLE001 - any failure to open: not readable
            os._exit(1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def _venv_without_mpiexec(tmp_path):
    """An environment of this one's packages (a .pth onto its site-packages) whose bin/ has
    no mpiexec: what a Gradescope image is when mpich's launcher did not install."""
    import sysconfig

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    inner = next((venv / "lib").glob("python3*/site-packages"))
    (inner / "k2c-parent.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    for library in [*Path(sys.prefix, "lib").glob("libmpi*"), Path(sys.prefix, "lib", "mpich")]:
        (venv / "lib" / library.name).symlink_to(library)  # mpich's library did install (mpi4py loads it)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                           if not (os.path.exists(os.path.join(p, "mpiexec"))))
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PATH=path, PYTHONPATH=str(REPO))
    return venv / "bin" / "python", env


def test_an_image_without_mpi_fails_its_self_test_and_never_grades_a_student(tmp_path):
    """setup.sh's self-test runs the stack (here: the sandbox, then 2 MPI ranks), so an image
    without mpiexec fails to build with the reason; and a run there reports that it could
    not grade (exit 2, no score), not the student's 1/25."""
    python, env = _venv_without_mpiexec(tmp_path)
    selftest = subprocess.run([str(python), "-m", "autograder.cli", "selftest", "06"], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
    assert selftest.returncode == 2, selftest.stdout + selftest.stderr
    assert "✓ sandbox" in selftest.stdout and "✗ MPI: no mpiexec in this environment" in selftest.stdout, selftest.stdout

    results = tmp_path / "results.json"
    graded = subprocess.run([str(python), "-m", "autograder.cli", "grade", "06", "--submission",
                             str(REPO / "solutions"), "--format", "gradescope", "-o", str(results)],
                            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert graded.returncode == 2, graded.stdout + graded.stderr
    report = json.loads(results.read_text())
    assert report["score"] == 0 and report["tests"] == []
    assert report["output"].startswith("The autograder could not run: this machine cannot grade lab 06-collectives")
    assert "no mpiexec" in report["output"]
