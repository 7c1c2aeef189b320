"""Student code sees only its own files, and the instructor sees what it tried.

Each kind of borrowing, tried as a student who has read the grader would: the
reference by path and by a glob, an oracle loaded by path, a classmate's folder
during grade-class; then the flags that record it, and the channel that carries
them. Under bubblewrap the files are not there (the score is the starter's);
under the subreaper layer, which hides no file, the flag is what the instructor
has, and grade-class refuses that layer unless told.
"""
import csv
import json
import os
import shutil
import uuid
from pathlib import Path

import pytest

from autograder.grading.flags import static_flags
from autograder.sandbox import Limits, run_call
from autograder.sandbox.isolation import Isolation, Layer
from conftest import REPO, grade_json, k2c

SUBREAPER = Isolation(Layer.SUBREAPER, None, None)  # as the grader's user: it can read the checkout

# The lab 06 module a student submits: the reference, found and run.
BY_PATH = '''
import os, course
_root = os.path.dirname(os.path.dirname(course.__file__))
exec(open(os.path.join(_root, "solutions", "06-collectives", "collectives.py")).read())
'''
BY_GLOB = '''
import glob, os
_found = [p for top in os.listdir("/") if top not in ("proc", "sys", "dev", "usr") for depth in range(6)
          for p in glob.glob(f"/{top}" + "/*" * depth + "/solutions/06-collectives/collectives.py")]
if _found:
    exec(open(_found[0]).read())
'''
# Lab 13's planner, taken from the grader's hidden oracle (its search) by path.
ORACLE = '''
import importlib.util, os, course
_path = os.path.join(os.path.dirname(os.path.dirname(course.__file__)), "autograder", "checks",
                     "13-hybrid-parallel", "oracles_hidden.py")
_spec = importlib.util.spec_from_file_location("stolen", _path)
stolen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stolen)


def names():
    return sorted(n for n in dir(stolen) if not n.startswith("_"))
'''


def _call(folder, module, func, layer=None, args=()):
    request = {"submission": str(folder), "target": {"kind": "module", "module": module, "func": func},
               "args": list(args), "kwargs": {}}
    return run_call(request, Limits(timeout_s=60), layer=layer)


def _kinds(outcome):
    return {kind for kind, _ in outcome.flags}


@pytest.mark.parametrize("source", [BY_PATH, BY_GLOB], ids=["by path", "by glob"])
def test_the_reference_cannot_be_borrowed_and_the_try_is_flagged(tmp_path, source, bubblewrap):
    (tmp_path / "collectives.py").write_text(source)
    strong = _call(tmp_path, "collectives", "chunk_bounds", args=(10, 3))
    assert strong.status == "raised" and strong.value is None, strong  # nothing to exec: no chunk_bounds
    assert "files" in _kinds(strong) or source is BY_GLOB, strong.flags  # by path: it opened the solution
    weak = _call(tmp_path, "collectives", "chunk_bounds", layer=SUBREAPER, args=(10, 3))
    # The layer that hides no file lets it through; the instructor sees how.
    assert weak.status == "ok", weak
    assert {"files", "code"} <= _kinds(weak), weak.flags
    assert any("solutions/06-collectives/collectives.py" in detail for _, detail in weak.flags), weak.flags


def test_an_oracle_cannot_be_loaded_and_the_try_is_flagged(tmp_path, bubblewrap):
    (tmp_path / "planner.py").write_text(ORACLE)
    strong = _call(tmp_path, "planner", "names")
    assert strong.status == "raised" and "No such file" in strong.message, strong
    assert any("oracles_hidden.py" in detail for kind, detail in strong.flags if kind == "files"), strong.flags
    weak = _call(tmp_path, "planner", "names", layer=SUBREAPER)
    assert weak.status == "ok" and weak.value, weak
    assert any("oracles_hidden.py" in detail for kind, detail in weak.flags if kind in ("files", "code")), weak.flags


@pytest.mark.slow
def test_a_borrowing_submission_scores_the_starters_zero(tmp_path, bubblewrap):
    (tmp_path / "collectives.py").write_text(BY_PATH)
    report, _ = grade_json(tmp_path, "06", "-k", "chunk_bounds or bcast_binomial")
    assert report["status"] == "graded" and report["score"] == 0 and len(report["tests"]) >= 2, report
    kinds = {f["kind"] for f in report["flags"]}
    assert {"files", "code"} <= kinds and {f["seen"] for f in report["flags"]} == {"running", "source"}, report["flags"]
    assert report["isolation"]["readable"].startswith("its own files"), report["isolation"]


PRIVATE = '''
import ctypes
import sys


LONG = "x" * 400 + "/srv/course/autograder/checks/10-tensor-parallel/harness.py" + "y" * 400


def never_called():
    import torch
    torch.utils._python_dispatch._disable_current_modes()
    sys.modules["course.torch_audit"] = None
    return open("/srv/course/solutions/12-context-parallel/attention.py").read()
'''


def test_the_static_read_flags_what_never_ran(tmp_path):
    (tmp_path / "attention.py").write_text(PRIVATE)
    (tmp_path / "broken.py").write_text("def (:\n")  # a file that does not parse is no flag
    found = {(f.kind, f.detail.split(" (")[0]) for f in static_flags(tmp_path)}
    assert ("ctypes", "imports ctypes") in found
    assert ("private", "uses torch.utils._python_dispatch._disable_current_modes") in found
    assert ("toolkit", "changes sys.modules") in found
    assert any(kind == "files" and "solutions/" in detail for kind, detail in found), found
    assert any(kind == "files" and "autograder/checks/10" in detail for kind, detail in found), found  # 860 chars
    assert static_flags(REPO / "solutions" / "12-context-parallel") == []  # the reference: none


TAMPERING = '''
import os
import course.refuse


def _pipes():
    found = []
    for fd in sorted(map(int, os.listdir("/proc/self/fd"))):
        try:
            if fd > 2 and os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:"):
                found.append(fd)
        except OSError:  # the listing's own descriptor, closed since
            pass
    return found


def close_it():
    os.close(_pipes()[-1])  # the flag pipe is the call's last
    return 1


def forge():
    os.write(_pipes()[-1], b"0 1 1 [\\"end\\", \\"\\"]\\n")
    return 2


def patch():
    course.refuse.install_from_env = lambda: None
    return 3


def patch_a_class():
    import course.mpi_audit
    course.mpi_audit.AuditComm.totals = lambda self: {}
    return 4


def walk_the_frames():
    import inspect
    return len(inspect.stack())
'''


def test_a_broken_or_forged_channel_and_a_patched_toolkit_are_flags(tmp_path):
    (tmp_path / "tamper.py").write_text(TAMPERING)
    closed = _call(tmp_path, "tamper", "close_it")
    assert closed.status == "ok" and closed.value == 1, closed  # the score is the code's; the flag says what it did
    assert any(kind == "channel" and "never came" in detail for kind, detail in closed.flags), closed.flags
    forged = _call(tmp_path, "tamper", "forge")
    assert forged.value == 2 and any(kind == "channel" and "did not write" in detail
                                     for kind, detail in forged.flags), forged.flags
    patched = _call(tmp_path, "tamper", "patch")
    assert patched.value == 3 and any(kind == "toolkit" and "course.refuse" in detail
                                      for kind, detail in patched.flags), patched.flags
    classy = _call(tmp_path, "tamper", "patch_a_class")
    assert classy.value == 4 and any(kind == "toolkit" and "course.mpi_audit: AuditComm.totals" in detail
                                     for kind, detail in classy.flags), classy.flags
    walked = _call(tmp_path, "tamper", "walk_the_frames")
    assert walked.value > 1 and ("introspection", "called sys._getframe (tamper.py:40)") in walked.flags, walked.flags
    honest = _call(REPO / "solutions" / "06-collectives", "collectives", "chunk_bounds", args=(10, 3))
    assert honest.status == "ok" and honest.flags == [], honest.flags


SPY = '''
import glob
import os
from pathlib import Path

_marker = "CLASSMATE" + "-MARKER"
_tops = [t for t in os.listdir("/") if t not in ("proc", "sys", "dev", "usr")]
_seen = [Path(p).read_text() for top in _tops for depth in range(6)
         for p in glob.glob(f"/{top}" + "/*" * depth + "/collectives.py") if _marker in Path(p).read_text()]
print("SPIED:", _seen)
if _seen:
    raise RuntimeError("SPIED " + _seen[0])
'''


@pytest.mark.slow
def test_grade_class_keeps_classmates_apart_and_refuses_the_weak_layer(tmp_path, bubblewrap, request):
    reference = (REPO / "solutions" / "06-collectives" / "collectives.py").read_text()
    # Where an instructor may keep a class, outside /home and /tmp: the spy's glob reaches it
    # wherever the machine's folders are shown.
    klass = Path("/srv") / f"k2c-test-class-{uuid.uuid4().hex[:8]}"
    request.addfinalizer(lambda: shutil.rmtree(klass, ignore_errors=True))
    for student, source in (("alice", SPY + reference), ("bob", "# CLASSMATE-MARKER\n" + reference)):
        (klass / student).mkdir(parents=True)
        (klass / student / "collectives.py").write_text(source)
    out = tmp_path / "book.csv"
    proc = k2c("grade-class", "06", klass, "-o", out, "--jobs", "1", "-k", "chunk_bounds")
    assert proc.returncode == 0, proc.stderr
    rows = {r["student"]: r for r in csv.DictReader(out.open())}
    assert rows["alice"]["score"] == rows["bob"]["score"] == "1", rows
    assert rows["alice"]["isolation"] == "bubblewrap" and "files" in rows["alice"]["flags"], rows["alice"]
    assert rows["bob"]["flags"] == "", rows["bob"]
    assert "CLASSMATE-MARKER" not in json.dumps(json.loads(out.with_suffix(".json").read_text()))

    weak = dict(os.environ, K2C_ISOLATION="subreaper")
    refused = k2c("grade-class", "06", klass, "-o", tmp_path / "weak.csv", "--jobs", "1", "-k", "chunk_bounds",
                  env=weak)
    assert refused.returncode == 2, refused.stderr
    assert not (tmp_path / "weak.csv").exists()
    if "who cannot enter" in refused.stderr:  # nobody cannot read this Python (pyenv under /root): no weak layer
        return  # to refuse, and the grading stopped saying so (tests/test_readiness.py)
    assert "--allow-weak-isolation" in refused.stderr, refused.stderr
    shutil.rmtree(klass / "alice")
    allowed = k2c("grade-class", "06", klass, "-o", tmp_path / "weak.csv", "--jobs", "1", "-k", "chunk_bounds",
                  "--allow-weak-isolation", env=weak)
    assert allowed.returncode == 0, allowed.stderr
    assert [r["isolation"] for r in csv.DictReader((tmp_path / "weak.csv").open())] == ["subreaper"]
