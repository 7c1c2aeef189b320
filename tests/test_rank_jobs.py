"""Rank jobs (autograder.sandbox.ranks): each rank receives only its own inputs, shares
nothing with its peers but the network, and what the grader reads is measured from outside."""
import os
from pathlib import Path

import numpy as np
import pytest

from autograder.grading.labs import find_lab
from autograder.grading.rank_jobs import cpu_in_phase, crossed_in_phases, held_at, peak_in_phase, per_rank_in_phase, run_cases
from autograder.grading.runner import child_environment
from autograder.grading.submission import Submission
from autograder.sandbox import Limits, isolation

FIXTURE = Path(__file__).parent / "fixtures" / "rank_jobs"


def _submission(lab):
    return Submission(FIXTURE, FIXTURE / "harness.py", "cpu", Limits(timeout_s=120, memory_mb=6144),
                      child_environment("cpu", find_lab(lab)))


@pytest.fixture(scope="module")
def pried():
    """One MPI job of 3 ranks, each of which tries to read the others' inputs (their paths are
    no secret), to leave them files, and to reach them other than over the network."""
    submission = _submission("06")
    try:
        rng = np.random.default_rng(7)
        parts = [rng.integers(-100, 100, 20_000) for _ in range(3)]
        job = submission.rank_job("mpi", "mpi_rank", [[{"case": "sum", "x": part}] for part in parts], timeout=60,
                                  count_wire=True)
        return job, parts
    finally:
        submission.close()


def test_each_rank_has_a_user_a_tmp_and_a_dev_shm_of_its_own(pried):
    job, parts = pried
    assert job.status == "ok", job.explain()
    seen = [outputs[0] for outputs in job.outputs]
    for rank, rank_saw in enumerate(seen):
        np.testing.assert_array_equal(rank_saw["sum"], sum(parts))  # the work, done over the network
        assert rank_saw["write_tmp"] == "done" and rank_saw["write_shm"] == "done"
        if isolation.detect().ranks_apart:
            assert rank_saw["uid"] == 64000 + rank
            assert all(read.startswith("refused") for read in rank_saw["read_peer_inputs"]), rank_saw
            assert rank_saw["peers_files"] == sorted([*rank_saw["tmp_before"], "shared-by-rank"])  # its own alone
            assert rank_saw["signal_parent"].startswith("refused") and rank_saw["parent_environ"].startswith("refused")
        assert rank_saw["unix_socket"].startswith("refused") and rank_saw["udp"].startswith("refused")
        assert rank_saw["fork"].startswith("refused")
    if isolation.detect().ranks_apart:
        assert job.kept_apart == ""
        assert len({s["uid"] for s in seen}) == 3
    # Each rank's audit hook recorded what it tried, for the instructor, its channel intact.
    kinds = {kind for kind, _ in job.flags}
    assert "introspection" in kinds and "channel" not in kinds, job.flags
    assert any("sys._getframe (peer.py:" in detail for _, detail in job.flags), job.flags


def test_the_launcher_measures_bytes_per_rank_and_peak_memory(pried):
    job, parts = pried
    crossed = crossed_in_phases(job, "sum", ["done"])
    if "unavailable" in crossed:
        pytest.skip(crossed["unavailable"])
    nbytes = parts[0].nbytes
    assert 2 * (3 - 1) / 3 * nbytes * 3 <= crossed["done"] <= 3 * 2 * nbytes  # a ring or better, all ranks
    if isolation.detect().ranks_apart:
        per_rank = per_rank_in_phase(job, "sum", "done")
        assert all(sent >= (3 - 1) / 3 * nbytes for sent in per_rank), per_rank
    held = [peak - base for peak, base in zip(job.peak_bytes, job.baseline_bytes)]
    assert all(h >= 90 * 2**20 for h in held), held  # the 96 MiB each held, clear_refs notwithstanding
    # and its clock at each mark: the 0.2 s each rank slept between them, timed from outside
    assert 0 < job.mark_times["sum:start"] < job.mark_times["sum:start"] + 0.2 <= job.mark_times["sum:done"]
    assert job.mark_times["sum:done"] <= job.duration_s
    assert job.memory_tampered == []


def test_a_mark_can_start_the_peak_afresh_so_a_phase_is_measured_alone():
    submission = _submission("09")
    try:
        job = submission.rank_job("torch", "memory_phases_rank", [[{}]], timeout=60)
    finally:
        submission.close()
    assert job.status == "ok", job.explain()
    mib = 2**20
    held = held_at(job, "phase:end")[0] - held_at(job, "phase:start")[0]
    (peak,), own = peak_in_phase(job, "phase:start", "phase:end")
    assert own and "phase:start" in job.fresh_peaks
    assert 15.5 * mib <= held <= 17 * mib, held / mib  # the 16 MiB kept
    assert 23.5 * mib <= peak <= 26 * mib, peak / mib  # and 8 MiB more for a moment; not the 64 MiB before
    assert job.peak_bytes[0] - job.baseline_bytes[0] >= 63 * mib  # the whole job's peak keeps the 64 MiB
    assert job.memory_tampered == [] and not job.flags  # the launcher's own restart is no tampering
    assert peak_in_phase(job, "phase:start", "never") is None


def test_run_cases_reports_the_case_that_failed_and_runs_the_rest():
    submission = _submission("08")
    try:
        cases = [("ok-1", "ok"), ("stub", "stub"), ("ok-2", "ok"), ("hang", "hang"), ("ok-3", "ok")]
        out = run_cases(submission, "torch", "torch_rank", cases, lambda c: 2,
                        lambda c, r: {"what": c[1], "rank": r}, key=lambda c: c[0], timeout=60, idle_timeout=3)
    finally:
        submission.close()
    assert out["ok-1"]["status"] == out["ok-2"]["status"] == out["ok-3"]["status"] == "ok"
    assert [r["rank"] for r in out["ok-3"]["records"]] == [0, 1]
    assert out["stub"]["status"] == "not_implemented" and "torch_step" in out["stub"]["message"]
    assert out["hang"]["status"] == "timeout" and "likely deadlock" in out["hang"]["message"]


def test_the_launcher_counts_each_ranks_cpu_seconds_between_marks():
    submission = _submission("07")
    try:
        job = submission.rank_job("torch", "cpu_rank", [{"busy_s": 0.4, "sleep_s": 0.4}], timeout=60)
    finally:
        submission.close()
    assert job.status == "ok", job.explain()
    [busy], [slept] = cpu_in_phase(job, "start", "busy"), cpu_in_phase(job, "busy", "slept")
    assert 0.35 <= busy <= 1.0, busy  # its own CPU time, read from outside; a busy machine does not add to it
    assert slept < 0.1, slept  # asleep: wall time passes, CPU time does not
    assert cpu_in_phase(job, "start", "never made") == [None]


def test_a_job_that_times_its_ranks_keeps_the_allocators_reuse():
    """exact_peaks (the default) sends every allocation of 1 MiB or more to the kernel and back,
    so that VmHWM is what a rank held at once, at the price of its page faults each time; a job
    that times its ranks (lab 13's run_plan) asks for the allocator's usual reuse instead."""
    submission = _submission("13")
    try:
        faults = {exact: submission.rank_job("torch", "faults_rank", [[]], timeout=60, exact_peaks=exact)
                  .outputs[0][0]["faults"] for exact in (True, False)}
    finally:
        submission.close()
    pages = 40 * 2**22 // 4096
    assert faults[True] > pages / 4 > 2 * faults[False], faults  # measured: 20594 and 1573 of 40960 pages
