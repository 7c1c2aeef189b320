"""Lab 05 under the grader: a deadlocking submission is stopped at the launcher's
timeout, reported as a likely deadlock, and leaves no MPI process behind."""
import os
import time
from pathlib import Path

import pytest

from conftest import REPO, grade_json
from fixtures.buggy_05 import BUGS

LAB05 = "05-message-passing"
CHECKS = REPO / "autograder" / "checks" / LAB05 / "check_message_passing.py"


def _launch_timeout_s() -> float:
    for line in CHECKS.read_text().splitlines():
        if line.startswith("LAUNCH_TIMEOUT_S"):
            return float(line.split("=")[1].split("#")[0])
    raise AssertionError("check_message_passing.py no longer sets LAUNCH_TIMEOUT_S")


def _left_behind(marker: str) -> list[str]:
    """Live MPI processes (mpiexec, proxies, ranks) whose environment names ``marker``:
    only the ones this test started, whatever else runs on the machine. Zombies are already dead."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            env = Path(f"/proc/{entry}/environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if state != "Z" and marker in env and any(name in cmd for name in ("course.mpi", "hydra_pmi_proxy",
                                                                           "mpiexec", "mpi_rank_main")):
            found.append(f"{entry} {cmd}")
    return found


@pytest.mark.slow
def test_05_deadlock_is_reported_in_time_and_leaves_no_process(make_submission):
    bug = next(b for b in BUGS if "deadlock" in b.name)
    folder = make_submission(bug.lab, bug.file, bug.edits)
    start = time.monotonic()
    report, _ = grade_json(folder, LAB05, "-k", "exchange_halos and not nonblocking")
    elapsed = time.monotonic() - start
    (check,) = [t for t in report["tests"] if t["name"] == "exchange_halos"]
    assert check["status"] == "timeout" and check["points"] == 0, check
    assert "likely deadlock" in check["feedback"] and "on 2 rank(s)" in check["feedback"], check["feedback"]
    # 1 rank finishes, 2 ranks hang until the launcher stops them: one timeout, plus start-up.
    assert elapsed < _launch_timeout_s() + 20, f"grading took {elapsed:.1f} s"
    time.sleep(0.5)
    assert _left_behind(str(folder)) == []


def test_05_labs_are_stubs_that_say_so():
    report, _ = grade_json(REPO / "labs", LAB05, "-k", "split_rows or exchange_halos or fit_alpha_beta")
    assert report["score"] == 0 and report["tests"]
    for check in report["tests"]:
        assert check["feedback"].startswith("not implemented yet"), check
        assert "Traceback" not in check["feedback"]
