"""Lab 08's grader: the bucket rule it counts with, gloo's messages it reads the kernel's
byte count with, that each rank receives only its own part, that a step's bytes tell one
all-reduce per bucket from one flat all-reduce, what its recording of collectives sees
(feedback), and that a submission that deadlocks or errors on some ranks costs only its
own cases, within the timeout, with no process left behind."""
import importlib.util
import time
from pathlib import Path

import numpy as np
import pytest

from autograder.grading.rank_jobs import RankJob
from autograder.sandbox import Limits
from conftest import load_check_file
from course.wire import gloo_bytes

REPO = Path(__file__).resolve().parents[1]
LAB = "08-data-parallel"
CHECKS = REPO / "autograder" / "checks" / LAB
checks = load_check_file(LAB, "check_data_parallel")
oracles = checks.oracles
FRAMING = 144  # gloo's bytes per message, as the calibration measures it on this machine (torch 2.13)


@pytest.mark.parametrize("sizes, cap_bytes, want", [
    ([400, 100, 300, 100], 350, 2),          # the docstring's example: [[3, 2], [1, 0]]
    ([400, 100, 300, 100], 1000, 1),         # one partial bucket: [[3, 2, 1, 0]]
    ([400, 100, 300, 100], 100, 4),          # reaching the cap exactly closes a bucket
    ([100, 100, 100], 300, 1),               # full at the end: no partial bucket after it
    ([100, 100, 100], 150, 2),               # [[2, 1], [0]]: the last one partial
    ([10, 1000], 100, 2),                    # [[1], [0]]: a parameter over the cap closes its bucket
    ([10, 10, 10], 1, 3),
])
def test_expected_buckets_follows_the_lab_rule(sizes, cap_bytes, want):
    assert oracles.expected_buckets(sizes, cap_bytes / 2**20) == want


def test_buckets_agree_with_the_reference_on_the_graded_models():
    spec = importlib.util.spec_from_file_location("ddp_reference_08", REPO / "solutions" / LAB / "ddp.py")
    ddp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ddp)
    sizes = [size for _, size in oracles.trained_parameters(oracles.MLP)]
    assert sizes == [1024, 128, 2048, 128, 512, 32]  # the MLP in float64
    assert [size for _, size in oracles.trained_parameters(oracles.FROZEN_TIED)] == [2048, 128, 128, 512, 32]
    for cap in (*checks.BUCKET_CAPS, 0.001, 1e-6):
        want = [sum(sizes[i] for i in bucket) for bucket in ddp.bucket_indices(sizes, cap)]
        assert oracles.buckets(sizes, cap) == want, cap
    assert [oracles.expected_buckets(sizes, cap) for cap in checks.BUCKET_CAPS] == [6, 2, 1]


@pytest.mark.parametrize("elements, p, messages", [
    # measured on loopback with torch 2.13's gloo: (bytes crossed - payload) / 144
    (1, 2, 2), (4, 2, 8), (16, 2, 8), (484, 2, 8), (1, 4, 6), (4, 4, 24), (16, 4, 48), (64, 4, 48), (4096, 4, 48),
])
def test_all_reduce_messages_follow_gloos_segments(elements, p, messages):
    assert oracles.all_reduce_messages(8 * elements, p) == messages
    calibration = 8 * oracles.CALIBRATION_ELEMENTS
    crossed = gloo_bytes("all_reduce", calibration, p) + FRAMING * oracles.all_reduce_messages(calibration, p)
    assert oracles.framing_of(crossed, p) == FRAMING


def test_each_rank_receives_only_its_own_initial_parameters_and_micro_batches():
    case = oracles.draw_case(7, "accumulation", 4, oracles.MLP, steps=2, micro_batches=3)
    parts = [oracles.part(case, rank) for rank in range(4)]
    for rank, part in enumerate(parts):
        assert set(part) == {"spec", "initial", "batches"}
        assert part["initial"] is case["initial"][rank]  # its own, rank 0's to none but rank 0
        assert all(len(step) == 3 for step in part["batches"])
        assert all(len(x) == len(y) == oracles.MICRO_BATCH for step in part["batches"] for x, y in step)
    assert not np.array_equal(case["initial"][1]["0.weight"], case["initial"][0]["0.weight"])
    for t, (x, y) in enumerate(case["batches"]):  # the ranks' micro-batches, rank by rank, make the global batch
        np.testing.assert_array_equal(np.concatenate([m[0] for p in parts for m in p["batches"][t]]), x)
        np.testing.assert_array_equal(np.concatenate([m[1] for p in parts for m in p["batches"][t]]), y)
    again = oracles.draw_case(7, "accumulation", 4, oracles.MLP, steps=2, micro_batches=3)
    other = oracles.draw_case(8, "accumulation", 4, oracles.MLP, steps=2, micro_batches=3)
    assert np.array_equal(again["batches"][0][0], case["batches"][0][0])
    assert not np.array_equal(other["batches"][0][0], case["batches"][0][0])


def _counted(case, world, step_sizes, barrier=288):
    """An outcome whose job's marks count ``step_sizes`` (the all-reduces of each step, all
    after backward), as the launcher would."""
    marks, total = {}, 0

    def mark(name):
        marks[name] = (total, None)
    mark("calibration:start")
    total += oracles.all_reduce_wire_bytes(8 * oracles.CALIBRATION_ELEMENTS, world, FRAMING)
    mark("calibration:all_reduce")
    total += barrier
    mark("calibration:barrier")
    mark("c:start")
    for t, sizes in enumerate(step_sizes):
        total += barrier
        mark(f"c:s{t}.m0.backward")
        total += sum(oracles.all_reduce_wire_bytes(n, world, FRAMING) for n in sizes)
        mark(f"c:s{t}.m0.finish")
    job = RankJob(kind="torch", n=world, status="ok", marks=marks, wire={"bytes": total})
    return {"status": "ok", "job": job, "records": [{"case": "c", "steps": [[["all_reduce:sync"]]] * len(step_sizes)}]}


def test_a_steps_bytes_tell_one_all_reduce_per_bucket_from_one_flat_all_reduce():
    case = oracles.draw_case(3, "c", 2, oracles.MLP, steps=2, micro_batches=1)
    sizes = oracles.buckets([size for _, size in oracles.trained_parameters(oracles.MLP)], checks.BUCKET_CAPS[0])
    checks._expect_step_traffic(2, "c", case, _counted(case, 2, [sizes] * 2), sizes, "one per bucket")
    flat = _counted(case, 2, [[sum(sizes)]] * 2)
    with pytest.raises(AssertionError, match="8 messages of gloo's framing.*6 of 32, 512, 128, 2048, 128, 1024 bytes"):
        checks._expect_step_traffic(2, "c", case, flat, sizes, "one per bucket")
    merged = _counted(case, 2, [[sizes[0] + sizes[1], *sizes[2:]]] * 2)  # one bucket too few: 1152 bytes fewer
    with pytest.raises(AssertionError, match="40 messages"):
        checks._expect_step_traffic(2, "c", case, merged, sizes, "one per bucket")


def _job(folder, world=2):
    """Every case of the lab on ``world`` ranks, as a grading runs them, and how long it took."""
    from autograder.grading.labs import find_lab
    from autograder.grading.runner import child_environment
    from autograder.grading.submission import Submission

    submission = Submission(folder, CHECKS / "harness.py", "cpu", Limits(timeout_s=120, memory_mb=6144),
                            child_environment("cpu", find_lab(LAB)))
    start = time.monotonic()
    try:
        return checks._job(submission, 0, world), time.monotonic() - start
    finally:
        submission.close()


@pytest.mark.slow
def test_an_all_reduce_imported_by_name_with_async_op_by_position_is_still_recorded(make_submission):
    folder = make_submission(LAB, "ddp.py", [
        ("import torch.distributed as dist\n",
         "import torch.distributed as dist\nfrom torch.distributed import all_reduce\n"),
        ("            handle = dist.all_reduce(flat, group=self.group, async_op=True)\n",
         "            handle = all_reduce(flat, dist.ReduceOp.SUM, self.group, True)\n")])
    cases, _ = _job(folder)
    _, outcome = cases["bucketed (bucket_cap_mb=0.002)"]
    assert outcome["status"] == "ok", outcome
    steps = outcome["records"][0]["steps"]
    assert steps[0][0] == ["all_reduce:async"] * 2 + ["backward_end", "sync_call"] + ["wait"] * 2


@pytest.mark.slow
def test_a_deadlock_costs_its_case_only_and_leaves_no_process(make_submission, our_processes):
    folder = make_submission(LAB, "ddp.py", [(
        "        world = dist.get_world_size(self.group)\n        for param in self.module.parameters():\n",
        "        world = dist.get_world_size(self.group)\n        if dist.get_rank() == 1:\n"
        "            dist.recv(torch.zeros(1), src=0)  # a message rank 0 never sends\n"
        "        for param in self.module.parameters():\n")])
    cases, elapsed = _job(folder)
    naive = cases["naive"][1]
    assert naive["status"] == "timeout" and "no rank having used the CPU" in naive["message"], naive
    assert "not run" in cases["naive (frozen + tied)"][1]["message"]  # the same wrapper would hang as long
    others = {name: outcome for name, (_, outcome) in cases.items() if not name.startswith("naive")}
    assert {o["status"] for o in others.values()} == {"ok"}, others
    assert elapsed < 60, elapsed  # one idle stop, not a whole job timeout
    time.sleep(0.5)
    assert our_processes() == []


@pytest.mark.slow
def test_a_rank_dependent_number_of_all_reduces_is_reported_not_waited_out(make_submission, our_processes):
    """gloo notices the mismatched sizes and aborts the receiving rank: the case fails with gloo's
    message, at once, whichever rank the launcher happens to see fail first."""
    folder = make_submission(LAB, "ddp.py", [(
        "                dist.all_reduce(param.grad, group=self.group)\n",
        "                if dist.get_rank() == 0 or param.dim() > 1:  # rank 1 skips the biases\n"
        "                    dist.all_reduce(param.grad, group=self.group)\n")])
    cases, elapsed = _job(folder)
    naive = cases["naive"][1]
    assert naive["status"] in ("crashed", "raised") and naive["status"] != "timeout", naive
    assert elapsed < checks.JOB_TIMEOUT_S, elapsed  # nothing waited for the job's timeout
    assert all(o["status"] == "ok" for name, (_, o) in cases.items() if not name.startswith("naive")), cases
    time.sleep(0.5)
    assert our_processes() == []
