"""Lab 08's grader: the bucket rule it counts with, what its recording of
collectives sees, and that a submission that deadlocks or errors on some ranks
costs only its own cases, within the timeout, with no process left behind."""
import importlib.util
import time
from pathlib import Path

import pytest

from autograder.sandbox import Limits, run_call
from conftest import load_check_file

REPO = Path(__file__).resolve().parents[1]
LAB = "08-data-parallel"
CHECKS = REPO / "autograder" / "checks" / LAB
checks = load_check_file(LAB, "check_data_parallel")


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
    assert checks.expected_buckets(sizes, cap_bytes / 2**20) == want


def test_expected_buckets_agrees_with_the_reference_on_the_graded_model():
    spec = importlib.util.spec_from_file_location("ddp_reference_08", REPO / "solutions" / LAB / "ddp.py")
    ddp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ddp)
    sizes = [1024, 128, 2048, 128, 512, 32]  # the harness's MLP in float64
    for cap in (*checks.BUCKET_CAPS, 0.001, 1e-6):
        assert checks.expected_buckets(sizes, cap) == len(ddp.bucket_indices(sizes, cap)), cap
    assert [checks.expected_buckets(sizes, cap) for cap in checks.BUCKET_CAPS] == [6, 2, 1]


def _ddp_job(folder, world=2, job_timeout=40, sandbox_timeout=120):
    request = {"submission": str(folder), "target": {"kind": "harness", "path": str(CHECKS / "harness.py"),
                                                     "func": "ddp_job"},
               "args": [world, job_timeout], "kwargs": {}}
    start = time.monotonic()
    outcome = run_call(request, Limits(timeout_s=sandbox_timeout, memory_mb=6144))
    return outcome, time.monotonic() - start


@pytest.mark.slow
def test_an_all_reduce_imported_by_name_with_async_op_by_position_is_still_recorded(make_submission):
    folder = make_submission(LAB, "ddp.py", [
        ("import torch.distributed as dist\n",
         "import torch.distributed as dist\nfrom torch.distributed import all_reduce\n"),
        ("            handle = dist.all_reduce(flat, group=self.group, async_op=True)\n",
         "            handle = all_reduce(flat, dist.ReduceOp.SUM, self.group, True)\n")])
    outcome, _ = _ddp_job(folder)
    assert outcome.status == "ok", outcome
    steps = outcome.value["bucketed (bucket_cap_mb=0.002)"]["ranks"][0]["steps"]
    assert steps[0][0] == ["all_reduce:async"] * 2 + ["backward_end", "sync_call"] + ["wait"] * 2


@pytest.mark.slow
def test_a_deadlock_costs_its_case_only_and_leaves_no_process(make_submission, our_processes):
    folder = make_submission(LAB, "ddp.py", [(
        "        world = dist.get_world_size(self.group)\n        for param in self.module.parameters():\n",
        "        world = dist.get_world_size(self.group)\n        if dist.get_rank() == 1:\n"
        "            dist.recv(torch.zeros(1), src=0)  # a message rank 0 never sends\n"
        "        for param in self.module.parameters():\n")])
    # The rerun of the other cases after the hang gets 30 s too: room for a busy machine (CI once
    # saw one of them time out at 20 s while lab batches ran beside it). The hang itself ends when it idles.
    outcome, elapsed = _ddp_job(folder, job_timeout=30)
    assert outcome.status == "ok", outcome
    naive = outcome.value["naive"]
    assert naive["status"] == "timeout" and "no rank having used the CPU" in naive["message"], naive
    others = {k: v["status"] for k, v in outcome.value.items() if not k.startswith("naive")}
    assert set(others.values()) == {"ok"}, {k: outcome.value[k] for k, s in others.items() if s != "ok"}
    assert elapsed < 60, elapsed  # not a whole job timeout for the hang
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
    outcome, _ = _ddp_job(folder)
    assert outcome.status == "ok", outcome
    naive = outcome.value["naive"]
    # not "timeout": nothing waited for the job's 40 s
    assert naive["status"] == "crashed" and "SIGABRT" in naive["message"], naive
    assert "collective mismatch" in naive["message"], naive
    assert all(v["status"] == "ok" for k, v in outcome.value.items() if not k.startswith("naive")), outcome.value
    time.sleep(0.5)
    assert our_processes() == []
