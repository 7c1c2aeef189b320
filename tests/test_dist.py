"""course.dist runs functions on N torch.distributed processes and never outlives
its timeout; one rank's error ends the job and is the one reported."""
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from autograder.sandbox import Limits, run_call
from course import dist

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _importable_fixtures(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))


def test_every_rank_joins_one_group_on_its_own_port():
    first = dist.run("dist_algos:rank_sum", 4, 1.0).check()
    second = dist.run("dist_algos:rank_sum", 2, 0.0).check()
    assert [r[:3] for r in first.results] == [(10.0, 4, "gloo")] * 4
    assert [r[:3] for r in second.results] == [(1.0, 2, "gloo")] * 2
    assert len({r[3] for r in first.results}) == 1  # one rendezvous per job


def test_jobs_at_the_same_time_do_not_collide():
    jobs = [None] * 3
    threads = [threading.Thread(target=lambda i=i: jobs.__setitem__(i, dist.run("dist_algos:rank_sum", 2, i)))
               for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [job.check().results[0][0] for job in jobs] == [1.0, 3.0, 5.0]


def test_a_notebook_imports_torch_once_for_all_its_jobs_and_nothing_outlives_it(tmp_path, our_processes):
    # A stand-in kernel: course.dist sees the shell of a Jupyter kernel, where it cannot fork itself.
    (tmp_path / "kernel.py").write_text(
        "import os, sys, types\n"
        "class ZMQInteractiveShell: pass\n"
        "sys.modules['IPython'] = types.SimpleNamespace(get_ipython=ZMQInteractiveShell)\n"
        "from course import dist\n"
        "results, launchpads = [], set()\n"
        "for n in (2, 3):\n"
        "    results.append(dist.run('dist_algos:rank_sum', n, 1.0).check().results[0][:3])\n"
        "    launchpads.add(dist._Launchpad._current.proc.pid)\n"
        "print(results)\n"
        "print(*launchpads, os.getpid())\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(FIXTURES), str(REPO)]))
    done = subprocess.run([sys.executable, str(tmp_path / "kernel.py")], capture_output=True, text=True, env=env,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    results, pids = done.stdout.splitlines()
    assert results == "[(3.0, 2, 'gloo'), (6.0, 3, 'gloo')]"
    assert len(pids.split()) == 2  # one launchpad for both jobs, and not the kernel itself
    deadline = time.monotonic() + 5  # the launchpad reads the kernel's end on its stdin, and exits
    while our_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert our_processes() == []


def test_point_to_point_around_a_ring():
    assert dist.run(f"{FIXTURES / 'dist_algos.py'}:ring_pass", 3).check().results == [2, 0, 1]


def test_a_hung_collective_is_stopped_once_it_idles_with_nothing_left(our_processes):
    running = []  # the most of ours seen mid-job: the check below is not vacuous
    done = threading.Event()

    def spy():
        while not done.wait(0.2):
            seen = our_processes()
            if len(seen) > len(running):
                running[:] = seen
    watcher = threading.Thread(target=spy)
    watcher.start()
    start = time.monotonic()
    # Stopped once it idles, long before its timeout (the launcher stops one at its timeout in the sandbox test).
    job = dist.run("dist_algos:unmatched_collective", 3, timeout=60, idle_timeout=dist.IDLE_TIMEOUT_S)
    done.set()
    watcher.join()
    assert len(running) >= 3, running
    assert job.status == "timeout" and dist.IDLE_TIMEOUT_S <= time.monotonic() - start < 30
    assert "no rank having used the CPU for 5 s: likely deadlock" in job.explain(), job.explain()
    assert "[0, 1, 2]" in job.explain()
    with pytest.raises(dist.DistJobError, match="collective that not every rank calls"):
        job.check()
    time.sleep(0.5)
    assert our_processes() == []


def test_the_rank_that_raised_first_is_reported_and_the_job_ends_at_once():
    job = dist.run("dist_algos:rank_one_raises", 3, timeout=60)
    assert job.status == "raised" and job.duration_s < 30
    assert job.explain().startswith("rank 1 of 3 raised ValueError: bad rank (at dist_algos.py")


def test_a_stub_reads_as_not_implemented():
    with pytest.raises(NotImplementedError, match="not implemented yet: stub"):
        dist.run("dist_algos:stub", 2).check()


def test_functions_from_main_are_refused_with_advice():
    def local():
        return 0
    with pytest.raises(ValueError, match="Put it in a .py module"):
        dist.run(local, 2)


@pytest.mark.parametrize("launcher_timeout, sandbox_timeout", [(4, 40), (60, 6)],
                         ids=["launcher stops it", "sandbox stops it"])
def test_a_hang_inside_the_sandbox_leaves_no_process(tmp_path, launcher_timeout, sandbox_timeout, our_processes):
    (tmp_path / "job.py").write_text(
        "from course import dist\n\n"
        "def go():\n    assert dist._can_fork_here()\n"
        f"    return dist.run('dist_algos:unmatched_collective', 3, timeout={launcher_timeout}).check()\n")
    (tmp_path / "dist_algos.py").write_text((FIXTURES / "dist_algos.py").read_text())
    request = {"submission": str(tmp_path), "target": {"kind": "module", "module": "job", "func": "go"},
               "args": [], "kwargs": {}}
    # As the grader runs a torch lab's calls: torch preloaded, and the ranks forked from the call.
    env = {"K2C_PRELOAD": "torch,torch.distributed", "OMP_NUM_THREADS": "1"}
    outcome = run_call(request, Limits(timeout_s=sandbox_timeout, memory_mb=4096), env)
    assert outcome.status == "timeout", outcome
    if launcher_timeout < sandbox_timeout:
        assert "likely deadlock" in outcome.message
    time.sleep(0.5)
    assert our_processes() == []


def test_the_same_function_runs_under_torchrun(tmp_path):
    """What a multi-GPU node runs: torchrun starts the processes, course.dist.init() joins them."""
    script = tmp_path / "train.py"
    script.write_text("import os\nimport torch\nfrom course import dist\nimport dist_algos\n\n"
                      "dist.init()\nresult = dist_algos.rank_sum(1.0)[:3]\n"
                      f"open(os.path.join({str(tmp_path)!r}, 'rank' + os.environ['RANK']), 'w').write(repr(result))\n"
                      "torch.distributed.destroy_process_group()\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(FIXTURES), str(REPO)]), OMP_NUM_THREADS="1")
    proc = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["(3.0, 2, 'gloo')"] * 2


def test_the_launcher_counts_what_crossed_between_the_ranks():
    # The kernel's byte counters, read by the launcher (course.wire), match gloo's closed forms
    # (course.wire.gloo_bytes) to within message headers, phase by phase, on 2 and 4 ranks.
    from autograder.grading.traffic import HEADER_BYTES, crossed_in_phases
    from course import wire

    if wire.available():
        pytest.skip(wire.available())
    numel = 50_000
    for n in (2, 4):
        job = dist.run("dist_algos:counted_collectives", n, numel, count_wire=True).check()
        assert job.wire["complete"] and job.wire["bytes"] > 0
        for kind in ("all_reduce", "all_gather"):
            crossed = crossed_in_phases([job], kind, ("done",))["done"]
            want = wire.gloo_bytes(kind, numel * 4, n)
            assert want <= crossed <= want + 2 * n * n * HEADER_BYTES, (kind, n, crossed, want)
    assert dist.run("dist_algos:counted_collectives", 2, 10).check().wire is None  # only when asked for
