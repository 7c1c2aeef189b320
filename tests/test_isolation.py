"""A hostile submission against the isolation layer: each test asserts what it
could not do (the grader alive, its files intact, no process left, no network),
not only that grading finished."""
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autograder.sandbox import isolation
from autograder.sandbox.isolation import Isolation, Layer
from autograder.sandbox import Limits, Sandbox, run_call
from conftest import REPO

HOSTILE = r'''
import ctypes, json, os, signal, socket, sys, time

def _detach(work):
    """Run ``work`` in a daemon that double-forks, leaves the session, ignores
    SIGTERM and renames itself; return once it is running."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(ready_w)
        os.waitpid(pid, 0)
        os.read(ready_r, 1)
        os.close(ready_r)
        return
    os.setsid()
    if os.fork():
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # as a daemon does: or mpiexec would wait for its output and PMI socket to close
        os.dup2(devnull, fd)
    os.closerange(3, ready_w)
    os.closerange(ready_w + 1, 4096)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctypes.CDLL(None).prctl(15, b"kworker/0:1", 0, 0, 0)  # PR_SET_NAME
    os.write(ready_w, b"x")
    try:
        work()
    finally:
        os._exit(0)

def _rewrite_forever(paths):
    for _ in range(300):  # 30 s: long after the call and the grader are gone
        for path in paths:
            try:
                with open(path, "w") as f:
                    f.write('{"score": 100}')
            except OSError:
                pass
        time.sleep(0.1)

def attack(grader_pids, paths, port):
    """Everything at once; returns what each attempt did."""
    seen = {"uid": os.getuid()}
    _detach(lambda: _rewrite_forever(paths))
    libc = ctypes.CDLL(None, use_errno=True)
    for pid in grader_pids:
        attached = libc.ptrace(16, pid, None, None) == 0  # PTRACE_ATTACH
        seen[f"ptrace {pid}"] = "attached" if attached else os.strerror(ctypes.get_errno())
        try:
            os.kill(pid, signal.SIGKILL)
            seen[f"kill {pid}"] = "sent"
        except OSError as exc:
            seen[f"kill {pid}"] = type(exc).__name__
    for path in paths:
        try:
            with open(path, "a") as f:
                f.write("# forged\n")
            seen[f"write {path}"] = "written"
        except OSError as exc:
            seen[f"write {path}"] = type(exc).__name__
    try:  # the host's loopback, where the test listens
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        seen["host loopback"] = "connected"
    except OSError as exc:
        seen["host loopback"] = type(exc).__name__
    try:  # a route off this machine (a UDP connect sends nothing, it only looks the route up)
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        probe.connect(("192.0.2.1", 9))
        seen["route out"] = "found"
    except OSError as exc:
        seen["route out"] = type(exc).__name__
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    socket.create_connection(server.getsockname(), timeout=2).close()
    seen["own loopback"] = "connected"
    return seen

def attack_rank(comm, *args):
    return attack(*args)

def attack_through(launcher, *args):
    if launcher == "call":
        return [attack(*args)]
    if launcher == "mpi":
        from course import mpi
        return mpi.run("hostile:attack_rank", 2, *args, timeout=60).check().results
    from course import dist
    assert dist._can_fork_here(), "the ranks should be forked from the call, as the grader's sandbox has them"
    return dist.run("hostile:attack", 2, *args, timeout=60).check().results

def leave_traces(attack):
    """A daemon and a file for the next call of the sandbox; then (``attack``) go for the
    server, which made this process."""
    _detach(lambda: time.sleep(60))
    with open(os.path.join(os.environ["TMPDIR"], "left.txt"), "w") as f:
        f.write("x")
    if not attack:
        return {}
    libc = ctypes.CDLL(None, use_errno=True)
    server = os.getppid()
    seen = {"ptrace": "attached" if libc.ptrace(16, server, None, None) == 0 else os.strerror(ctypes.get_errno())}
    try:
        os.kill(server, signal.SIGKILL)
        seen["kill"] = "sent"
    except OSError as exc:
        seen["kill"] = type(exc).__name__
    return seen

def find_traces():
    """What a call finds of the one before: its file, and the other processes of its user."""
    others = [p for p in filter(str.isdigit, os.listdir("/proc"))
              if int(p) != os.getpid() and os.stat(f"/proc/{p}").st_uid == os.getuid()]
    return {"file": os.path.exists(os.path.join(os.environ["TMPDIR"], "left.txt")), "processes": others}

def read_beside_me(name):
    try:
        return open(os.path.join(os.path.dirname(__file__), name)).read()
    except OSError as exc:
        return type(exc).__name__

def strays_then(how):
    """Leave daemons behind, then end the call in one of the ways a call ends."""
    for _ in range(5):
        _detach(lambda: time.sleep(60))
    if how == "return":
        return "done"
    if how == "raise":
        raise RuntimeError("boom")
    if how == "os._exit":
        os._exit(3)
    if how == "crash":
        ctypes.string_at(0)
    if how == "memory":
        block = bytearray(600 * 2**20)
        for i in range(0, len(block), 4096):
            block[i] = 1
    time.sleep(60)  # "timeout", and "memory" until the watchdog sees it
'''

# Files of the grader that a submission must not change: a lab's harness and checks, the course, the sandbox.
GRADER_FILES = [REPO / "autograder/checks/02-cuda-model/harness.py",
                REPO / "autograder/checks/02-cuda-model/check_cuda_basics.py",
                REPO / "course/__init__.py", REPO / "autograder/sandbox/__init__.py"]
SUBREAPER = Isolation(Layer.SUBREAPER, None, None)


def _digests(paths):
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


@pytest.fixture
def hostile(tmp_path):
    folder = tmp_path / "submission"
    folder.mkdir()
    (folder / "hostile.py").write_text(HOSTILE)

    def call(func, *args, limits=Limits(timeout_s=60), layer=None, env=None):
        request = {"submission": str(folder), "target": {"kind": "module", "module": "hostile", "func": func},
                   "args": list(args), "kwargs": {}}
        return run_call(request, limits, env, layer=layer)
    return call


def test_this_machine_gives_the_strongest_layer(bubblewrap):
    if os.geteuid() == 0:
        assert bubblewrap.uid == 65534, bubblewrap.describe()


def test_a_machine_without_bubblewrap_falls_back_or_refuses_and_says_why(monkeypatch):
    """Without bubblewrap, root's grader runs student code as nobody with no namespaces,
    where nobody can read this Python; else it refuses, naming the folder and the remedy."""
    isolation.detect.cache_clear()
    monkeypatch.setattr(isolation.shutil, "which", lambda name: None)
    closed = next((str(p) for p in Path(os.path.realpath(sys.executable)).parents
                   if p.is_dir() and p.stat().st_mode & 0o005 != 0o005), "") if os.geteuid() == 0 else ""
    try:
        if closed:
            with pytest.raises(RuntimeError) as refused:
                isolation.detect()
            assert f"nobody (uid 65534), who cannot enter {closed}" in str(refused.value)
            assert "Remedy: install bubblewrap" in str(refused.value)
            return
        found = isolation.detect()
    finally:
        isolation.detect.cache_clear()
    assert found.layer is Layer.SUBREAPER
    assert "bubblewrap is not installed" in found.fallback_reason and "apt-get install bubblewrap" in found.describe()


@pytest.mark.parametrize("euid, layer, uid, warned", [
    (1000, Layer.SUBREAPER, None, True),  # a student's laptop without bubblewrap
    (1000, Layer.BUBBLEWRAP, None, False),
    (0, Layer.SUBREAPER, 65534, False),  # root's grader: the code runs as nobody
])
def test_every_report_says_when_student_code_could_signal_the_grader_or_write_its_users_files(
        monkeypatch, euid, layer, uid, warned):
    from autograder.grading import report
    from autograder.grading.runner import LabResult

    monkeypatch.setattr(isolation.os, "geteuid", lambda: euid)
    found = Isolation(layer, uid, uid)
    result = LabResult("02-cuda-model", "The CUDA programming model", "cpu", "/submission", [], 1.0,
                       found.as_dict(), "ab" * 32)
    text, as_json = report.text([result]), json.loads(report.as_json([result]))
    said = "student code could signal the grader or write your files"
    assert (said in text) is (said in as_json["isolation"]["detail"]) is (said in found.describe()) is warned, text
    if warned:
        assert f"WARNING: {said}: grade untrusted code elsewhere" in text


@pytest.mark.parametrize("launcher", ["call", "mpi", "torch"])
def test_hostile_code_cannot_touch_the_grader(bubblewrap, hostile, launcher, tmp_path, our_processes):
    results = tmp_path / "results.json"
    results.write_text('{"score": 0}')
    paths = [*GRADER_FILES, results]
    before = _digests(paths)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    grader = [os.getpid(), os.getppid()]

    # torch as a lab that requires it has it (autograder.grading.runner.child_environment): preloaded, the ranks forked
    env = {"K2C_PRELOAD": "torch,torch.distributed", "OMP_NUM_THREADS": "1"} if launcher == "torch" else None
    out = hostile("attack_through", launcher, grader, [str(p) for p in paths], listener.getsockname()[1], env=env)

    assert out.status == "ok", out.message + out.output
    assert len(out.value) == (1 if launcher == "call" else 2)
    for seen in out.value:
        if os.geteuid() == 0:
            assert seen["uid"] == 65534
        assert all(seen[f"kill {pid}"] != "sent" and seen[f"ptrace {pid}"] != "attached" for pid in grader), seen
        assert all(seen[f"write {p}"] != "written" for p in paths), seen
        assert seen["host loopback"] == "ConnectionRefusedError", seen
        assert seen["route out"] == "OSError", seen  # ENETUNREACH: no interface but loopback
        assert seen["own loopback"] == "connected"  # ranks and workers still reach each other
    with pytest.raises(BlockingIOError):
        listener.accept()  # nobody came through to the host's loopback
    assert all(os.kill(pid, 0) is None for pid in grader)
    assert our_processes() == []  # the rewriting daemons went with the call
    time.sleep(0.3)
    assert _digests(paths) == before


@pytest.mark.parametrize("layer", [None, SUBREAPER], ids=["strongest", "subreaper"])
@pytest.mark.parametrize("how, status", [("return", "ok"), ("raise", "raised"), ("os._exit", "no_result"),
                                         ("crash", "crashed"), ("timeout", "timeout"), ("memory", "memory")])
def test_nothing_outlives_a_call_however_it_ends(hostile, our_processes, how, status, layer):
    out = hostile("strays_then", how, layer=layer,
                  limits=Limits(timeout_s=3, memory_mb=400, address_space=False))
    assert out.status == status, (out.status, out.message)
    assert our_processes() == []


@pytest.mark.parametrize("layer", [None, SUBREAPER], ids=["strongest", "subreaper"])
def test_the_calls_of_a_sandbox_cannot_reach_its_server_or_each_other(hostile, tmp_path, our_processes, layer):
    """One server (autograder.sandbox.child) serves every call of a grading: a call cannot stop it,
    and the next call finds nothing of the last, even after one that was stopped."""
    def request(func, *args):
        return {"submission": str(tmp_path / "submission"), "args": list(args), "kwargs": {},
                "target": {"kind": "module", "module": "hostile", "func": func}}

    with Sandbox(str(tmp_path / "submission"), Limits(timeout_s=5), layer=layer) as box:
        assert box.call(request("find_traces")).status == "ok"
        server = our_processes()  # the server and what started it, which stay between calls
        # Only where the calls run as nobody (the grader is root) is the server out of their reach.
        first = box.call(request("leave_traces", box.layer.uid is not None))
        assert first.status == "ok", first.message + first.output
        if box.layer.uid is not None:
            assert first.value == {"ptrace": "Operation not permitted", "kill": "PermissionError"}
        assert our_processes() == server  # the daemon went with the call
        second = box.call(request("find_traces"))
        assert second.status == "ok" and second.value["file"] is False, second
        if box.layer.layer is Layer.BUBBLEWRAP:
            assert second.value["processes"] == []  # in its PID namespace: only itself, the server and bwrap
        stopped = box.call(request("strays_then", "timeout"))
        assert stopped.status == "timeout"
        assert our_processes() == []  # a stopped call ends the sandbox's server too
        after = box.call(request("find_traces"))
        assert after.status == "ok" and after.value["file"] is False, after
    assert our_processes() == []


def test_links_and_fifos_in_a_submission_leak_nothing_and_hang_nothing(bubblewrap, hostile, tmp_path):
    secret = tmp_path / "secret.txt"  # the grader's, readable by root only
    secret.write_text("s3cret")
    secret.chmod(0o600)
    folder = tmp_path / "submission"
    (folder / "leak").symlink_to(secret)
    os.mkfifo(folder / "pipe")  # copying it as a file would wait forever for a writer
    out = hostile("read_beside_me", "leak", limits=Limits(timeout_s=20))
    assert out.status == "ok" and out.value != "s3cret", out
    assert out.value in ("FileNotFoundError", "PermissionError")


def test_a_daemon_cannot_forge_the_results_after_the_grader_exits(bubblewrap, tmp_path, our_processes):
    """The exploit that was found: a grandchild outlives grading and rewrites results.json,
    and another kills the grader. Neither works: the score stays 0, the file stays whole."""
    folder = tmp_path / "02-cuda-model"
    folder.mkdir()
    results = tmp_path / "results.json"
    (folder / "cuda_basics.py").write_text(HOSTILE + f'''
def _kill_the_grader():
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = open(f"/proc/{{entry}}/environ", "rb").read()
            cmdline = open(f"/proc/{{entry}}/cmdline", "rb").read()
        except OSError:
            continue
        if b"K2C_TEST_JOB" in environ and b"autograder.cli" in cmdline:
            os.kill(int(entry), signal.SIGKILL)

_detach(lambda: _rewrite_forever([{str(results)!r}]))
_kill_the_grader()

def launch_config(n, threads_per_block=256):
    raise NotImplementedError("a hostile starter")
''')
    proc = subprocess.run([sys.executable, "-m", "autograder.cli", "grade", "02", "--submission", str(tmp_path),
                           "--format", "json", "-o", str(results), "-k", "launch_config"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    written = results.read_bytes()
    report = json.loads(written)
    assert report["score"] == 0 and report["max_score"] == 2
    assert report["isolation"]["layer"] == isolation.detect().layer.value
    assert len(report["checks_sha256"]) == 64
    time.sleep(1.0)  # the daemon would rewrite within 0.1 s
    assert results.read_bytes() == written
    assert our_processes() == []
