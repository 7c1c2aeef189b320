"""Untrusted code in the sandbox: hangs, exits, crashes, memory hogs and stray
processes cost the call, never the grader."""
import os
import sys
import time

import numpy as np
import pytest

from autograder.sandbox import Limits, run_call

HOSTILE = '''
import ctypes, os, subprocess, sys, time
import numpy as np

def ok(x):
    return {"doubled": np.asarray(x) * 2, "pair": (1, "a")}

def loops_forever():
    os.listdir("/")  # outside its own folder: a flag for the instructor
    while True:
        pass

def hard_exit():
    os._exit(0)

def soft_exit():
    sys.exit(3)

def segfault():
    ctypes.string_at(0)

def allocate(gib):
    return np.ones(int(gib * 2**30) // 8).sum()

def touch(mib):
    block = bytearray(mib * 2**20)
    for i in range(0, len(block), 4096):
        block[i] = 1
    time.sleep(30)

def spawn_and_hang(marker):
    # a grandchild in the same group, and one that escapes into its own session
    subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({marker})"])
    subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({marker})"], start_new_session=True)
    time.sleep(60)

def trains():
    import torch
    model = torch.nn.Linear(2, 1)
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # the first optimizer imports torch._dynamo
    return "trained"

def returns_object():
    return object()

def raises():
    def inner():
        return {}["missing"]
    return inner()
'''


@pytest.fixture
def hostile(tmp_path):
    (tmp_path / "hostile.py").write_text(HOSTILE)

    def call(func, *args, limits=Limits(timeout_s=20), env=None):
        request = {"submission": str(tmp_path), "target": {"kind": "module", "module": "hostile", "func": func},
                   "args": list(args), "kwargs": {}}
        return run_call(request, limits, env)
    return call


def _alive_with(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_plain_data_round_trip(hostile):
    out = hostile("ok", np.arange(3))
    assert out.status == "ok"
    assert np.array_equal(out.value["doubled"], [0, 2, 4]) and out.value["pair"] == (1, "a")


def test_infinite_loop_is_stopped_at_the_timeout(hostile):
    start = time.monotonic()
    out = hostile("loops_forever", limits=Limits(timeout_s=2))
    assert out.status == "timeout" and "within 2 s" in out.message
    assert time.monotonic() - start < 10
    # What it did before it was stopped still reaches the instructor (the flags come as it runs).
    assert ("files", "listed /") in out.flags, out.flags


def test_os_exit_is_reported_not_trusted(hostile):
    out = hostile("hard_exit")
    assert out.status == "no_result" and "os._exit" in out.message


def test_sys_exit_is_reported(hostile):
    out = hostile("soft_exit")
    assert out.status == "exit" and "sys.exit(3)" in out.message


def test_segfault_is_reported(hostile):
    out = hostile("segfault")
    assert out.status == "crashed" and "SIGSEGV" in out.message


def test_50_gib_allocation_fails_inside_the_limit(hostile):
    out = hostile("allocate", 50, limits=Limits(timeout_s=20, memory_mb=2048))
    assert out.status == "memory" and "memory" in out.message


def test_memory_watchdog_without_address_space_limit(hostile):
    # On a GPU the address-space limit is off (CUDA reserves huge ranges); the watchdog still stops a hog.
    out = hostile("touch", 600, limits=Limits(timeout_s=20, memory_mb=300, address_space=False))
    assert out.status == "memory" and "300 MiB" in out.message


def test_no_process_outlives_its_call(hostile):
    marker = "4321.5"
    out = hostile("spawn_and_hang", marker, limits=Limits(timeout_s=3))
    assert out.status == "timeout"
    time.sleep(0.5)
    assert _alive_with(marker) == []


def test_unsendable_return_value_is_explained(hostile):
    out = hostile("returns_object")
    assert out.status == "raised" and "cannot be sent back" in out.message


def test_exception_points_at_the_students_line(hostile):
    out = hostile("raises")
    assert out.status == "raised" and out.error_type == "KeyError"
    assert out.where and out.where[-1].startswith("hostile.py:") and "missing" in out.where[-1]


def test_grader_process_is_untouched(hostile):
    before = os.getpid(), sys.getrecursionlimit()
    for func in ("hard_exit", "soft_exit", "segfault"):
        hostile(func)
    assert (os.getpid(), sys.getrecursionlimit()) == before


def test_preloaded_torch_trains_whatever_cache_folder_the_grader_had(hostile, monkeypatch):
    """torch sets TORCHINDUCTOR_CACHE_DIR in the grader once it has loaded torch._dynamo (as the
    grader's checks or an earlier test may): a folder the sandbox's server cannot make. Its
    preload must not half-fail, or every later import of torch._dynamo raises."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_the_grader")
    out = hostile("trains", env={"K2C_PRELOAD": "torch,torch._dynamo"}, limits=Limits(timeout_s=60))
    assert out.status == "ok" and out.value == "trained", out.message + out.output


def test_one_server_serves_several_submissions_each_on_its_own_copy(tmp_path):
    """tests/grade_batch.py sends many fixtures through one server: each call sees its own
    submission's files only, and a forgotten submission's copy is gone."""
    from autograder.sandbox import Sandbox

    folders = []
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "which.py").write_text(
            f"import os\ndef which():\n    return {name!r}, sorted(os.listdir(os.path.dirname(__file__)))\n")
        folders.append(str(tmp_path / name))

    def request(folder):
        return {"submission": folder, "target": {"kind": "module", "module": "which", "func": "which"},
                "args": [], "kwargs": {}}

    with Sandbox(folders[0], Limits(timeout_s=20)) as box:
        assert box.call(request(folders[0])).value == ("first", ["which.py"])
        server = box._proc.pid
        assert box.call(request(folders[1])).value == ("second", ["which.py"])
        assert box._proc.pid == server  # the same server, no restart
        copy = box._copy_of(folders[1])
        box.forget(folders[1])
        assert not os.path.exists(copy)
        (tmp_path / "second" / "which.py").write_text("def which():\n    return 'changed'\n")
        assert box.call(request(folders[1])).value == "changed"  # a fresh copy
