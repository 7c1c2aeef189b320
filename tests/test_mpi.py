"""course.mpi runs functions on N ranks and never outlives its timeout;
course.mpi_audit counts messages and rounds as the algorithms' costs say."""
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from autograder.sandbox import Limits, run_call
from course import mpi
from course.mpi_audit import CollectiveNotAllowed, Event, rounds, totals

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(autouse=True)
def _importable_fixtures(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))


def test_every_rank_returns():
    job = mpi.run("mpi_algos:weighted_total", 4, np.ones(3)).check()
    assert job.results == [30.0] * 4 and job.finished == [0, 1, 2, 3]


def test_a_file_path_target():
    job = mpi.run(f"{FIXTURES / 'mpi_algos.py'}:weighted_total", 2, np.ones(2)).check()
    assert job.results == [6.0, 6.0]


def test_deadlock_is_stopped_at_the_timeout_with_nothing_left(our_processes):
    start = time.monotonic()
    running = []  # what our_processes() sees mid-job: the check below is not vacuous
    spy = threading.Timer(2.5, lambda: running.extend(our_processes()))
    spy.start()
    job = mpi.run("mpi_algos:deadlock", 3, timeout=4)
    spy.join()
    assert len(running) >= 4, running  # mpiexec, its proxy, three ranks
    assert job.status == "timeout" and 4 <= time.monotonic() - start < 15
    assert "likely deadlock" in job.explain() and "[0, 1, 2]" in job.explain()
    with pytest.raises(mpi.MPIJobError, match="likely deadlock"):
        job.check()
    time.sleep(0.5)
    assert our_processes() == []


def test_a_rank_that_raises_ends_the_job_at_once():
    job = mpi.run("mpi_algos:rank_one_raises", 3, timeout=60)
    assert job.status == "raised" and job.duration_s < 30
    assert job.errors[1].startswith("ValueError: bad rank") and "mpi_algos.py" in job.errors[1]


def test_a_stub_reads_as_not_implemented():
    job = mpi.run("mpi_algos:stub", 2)
    with pytest.raises(NotImplementedError, match="not implemented yet: stub"):
        job.check()


def test_functions_from_main_are_refused_with_advice():
    def local(comm):
        return comm.rank
    with pytest.raises(ValueError, match="Put it in a .py module"):
        mpi.run(local, 2)


@pytest.mark.parametrize("launcher_timeout, sandbox_timeout", [(3, 30), (60, 4)],
                         ids=["launcher stops it", "sandbox stops it"])
def test_deadlock_inside_the_sandbox_leaves_no_process(tmp_path, launcher_timeout, sandbox_timeout, our_processes):
    (tmp_path / "job.py").write_text(
        "from course import mpi\n\n"
        f"def go():\n    return mpi.run('mpi_algos:deadlock', 4, timeout={launcher_timeout}).check().results\n")
    (tmp_path / "mpi_algos.py").write_text((FIXTURES / "mpi_algos.py").read_text())
    request = {"submission": str(tmp_path), "target": {"kind": "module", "module": "job", "func": "go"},
               "args": [], "kwargs": {}}
    outcome = run_call(request, Limits(timeout_s=sandbox_timeout, memory_mb=4096, address_space=False))
    assert outcome.status == "timeout", outcome
    if launcher_timeout < sandbox_timeout:
        assert "likely deadlock" in outcome.message
    time.sleep(0.5)
    assert our_processes() == []


@pytest.mark.parametrize("p, want", [(2, 1), (5, 3), (8, 3)])
def test_binomial_broadcast_takes_log2_rounds(p, want):
    job = mpi.run("mpi_algos:binomial_bcast", p, 10).check()
    logs = [log for log, _ in job.results]
    assert rounds(logs) == want
    assert all(total == 45 for _, total in job.results)
    assert sum(totals(log)["messages_sent"] for log in logs) == p - 1


def test_linear_broadcast_takes_p_minus_1_rounds():
    logs = [log for log, _ in mpi.run("mpi_algos:linear_bcast", 6, 10).check().results]
    assert rounds(logs) == 5 and totals(logs[0])["messages_sent"] == 5


@pytest.mark.parametrize("p", [3, 4])
def test_ring_allreduce_costs(p):
    n = 10
    job = mpi.run("mpi_algos:ring_allreduce", p, n).check()
    want = [sum(range(1, p + 1))] * n
    assert all(result == want for _, result in job.results)
    logs = [log for log, _ in job.results]
    assert rounds(logs) == 2 * (p - 1)
    for log in logs:
        t = totals(log)
        assert t["messages_sent"] == 2 * (p - 1)
        assert abs(t["elements_sent"] - 2 * (p - 1) / p * n) <= 2 * (p - 1)  # chunks differ by one element


@pytest.mark.parametrize("waitall", [False, True], ids=["request.Wait()", "MPI.Request.Waitall"])
def test_nonblocking_calls_are_recorded_in_order(waitall):
    job = mpi.run("mpi_algos:ring_nonblocking", 3, waitall).check()
    log, got = job.results[1]
    assert [e.op for e in log] == ["irecv", "isend", "wait", "wait"] and got == [0.0] * 3
    assert rounds([log for log, _ in job.results]) == 1


def _ring_logs(p, steps, step_events):
    """Every rank's log of ``steps`` ring steps, each made of ``step_events(right, left, request)``."""
    logs = []
    for rank in range(p):
        right, left = (rank + 1) % p, (rank - 1) % p
        logs.append([e for k in range(steps) for e in step_events(right, left, 10 * k)])
    return logs


RING_STEPS = {
    "Sendrecv": lambda right, left, req: [Event("sendrecv", right, 4, 32, 0, left, 4)],
    "Irecv + Isend + Waitall": lambda right, left, req: [
        Event("irecv", left, 4, 32, 0, request=req + 1), Event("isend", right, 4, 32, 0, request=req + 2),
        Event("wait", None, request=req + 1), Event("wait", None, request=req + 2)],
    "Isend + Recv": lambda right, left, req: [
        Event("isend", right, 4, 32, 0, request=req + 1), Event("recv", left, 4, 32, 0),
        Event("wait", None, request=req + 1)],
    "Send + Recv": lambda right, left, req: [Event("send", right, 4, 32, 0), Event("recv", left, 4, 32, 0)],
}


@pytest.mark.parametrize("style", RING_STEPS)
@pytest.mark.parametrize("p", [2, 5])
def test_a_ring_step_is_one_round_however_it_is_written(style, p):
    assert rounds(_ring_logs(p, 2 * (p - 1), RING_STEPS[style])) == 2 * (p - 1)


def test_sends_to_many_ranks_take_a_round_each_even_nonblocking():
    root = [Event("isend", d, request=d) for d in (1, 2, 3)] + [Event("wait", None, request=d) for d in (1, 2, 3)]
    leaves = [[Event("irecv", 0, request=1), Event("wait", None, request=1)] for _ in range(3)]
    assert rounds([root, *leaves]) == 3


def test_a_message_forwarded_after_its_wait_adds_a_round():
    first = [Event("isend", 1, request=1), Event("wait", None, request=1)]
    middle = [Event("irecv", 0, request=1), Event("wait", None, request=1), Event("send", 2)]
    last = [Event("recv", 1)]
    assert rounds([first, middle, last]) == 2


def test_collectives_are_refused():
    job = mpi.run("mpi_algos:uses_allreduce", 2)
    error = next(iter(job.errors.values()))  # the first rank to raise aborts the others
    assert job.status == "raised" and error.startswith(CollectiveNotAllowed.__name__)
    assert "Send/Recv/Sendrecv" in error


def test_synchronous_sends_expose_an_order_that_only_buffering_saves():
    assert mpi.run("mpi_algos:send_first", 2, False).check().results == [[1.0] * 4] * 2
    assert mpi.run("mpi_algos:send_first", 2, True, timeout=3).status == "timeout"


def test_what_crosses_between_mpi_ranks_is_counted_in_the_sandbox(tmp_path):
    # With count_wire, MPICH sends over loopback TCP (no shared memory), in the sandbox's own network
    # namespace too, and the launcher's count of a ring step is its payload plus MPI's few headers.
    (tmp_path / "job.py").write_text(
        "from course import mpi\n\n"
        "def go():\n    job = mpi.run('mpi_algos:counted_ring', 4, 10_000, count_wire=True).check()\n"
        "    marks = dict(job.wire['marks'])\n"
        "    return [marks['ring:done'] - marks['ring:start'], job.results]\n")
    (tmp_path / "mpi_algos.py").write_text((FIXTURES / "mpi_algos.py").read_text())
    request = {"submission": str(tmp_path), "target": {"kind": "module", "module": "job", "func": "go"},
               "args": [], "kwargs": {}}
    outcome = run_call(request, Limits(timeout_s=60, memory_mb=4096), {})
    assert outcome.status == "ok", outcome
    crossed, results = outcome.value
    assert results == [10_000.0] * 4
    assert 4 * 10_000 * 8 <= crossed <= 4 * 10_000 * 8 + 4 * 300, crossed
