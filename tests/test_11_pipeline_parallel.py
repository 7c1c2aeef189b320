"""Lab 11's grader: its own dependency checker, timeline checker, simulator, schedules
and brute-force partition are right (checked by hand and against the closed forms),
the executor's table of op lists is the documented GPipe and 1F1B, and an executor
that deadlocks costs its case only, within the timeout, with no process left behind.
The simulator and schedules are the hidden oracles (``oracles_hidden.py``)."""
import math
import random
import time
from pathlib import Path

import pytest

from autograder.sandbox import Limits, run_call
from conftest import load_check_file

REPO = Path(__file__).resolve().parents[1]
LAB = "11-pipeline-parallel"
CHECKS = REPO / "autograder" / "checks" / LAB
checks = load_check_file(LAB, "check_pipeline")
oracles, hidden = checks.oracles, load_check_file(LAB, "oracles_hidden")

# 1F1B on 2 devices, 2 microbatches, written out by hand.
HAND_1F1B = [[("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)],
             [("F", 0, 1), ("B", 0, 1), ("F", 1, 1), ("B", 1, 1)]]


def test_validate_accepts_a_hand_written_1f1b():
    assert oracles.validate(HAND_1F1B, 2, 2) is None
    assert hidden.make_schedule(2, 2, "1f1b") == HAND_1F1B


def test_validate_reports_a_deadlock_with_what_each_device_waits_for():
    # Device 0 puts B(1) before F(1) and B(0); device 1 then waits for F(1), which device 0 never runs.
    stuck = [[("F", 0, 0), ("B", 1, 0), ("F", 1, 0), ("B", 0, 0)],
             [("F", 0, 1), ("B", 0, 1), ("F", 1, 1), ("B", 1, 1)]]
    assert oracles.validate(stuck, 2, 2) == (
        "deadlock: device 0 waits for F(microbatch 1, stage 0) and B(microbatch 1, stage 1) before its "
        "B(microbatch 1, stage 0) "
        "while device 1 waits for F(microbatch 1, stage 0) before its F(microbatch 1, stage 1)")
    with pytest.raises(RuntimeError, match="deadlock"):
        hidden.simulate(stuck, 1, 2)


@pytest.mark.parametrize("schedule, message", [
    ([HAND_1F1B[0], HAND_1F1B[1][:-1]], "1 ops are never run, e.g. B(microbatch 1, stage 1)"),
    ([HAND_1F1B[0] + [("F", 0, 0)], HAND_1F1B[1]], "F(microbatch 0, stage 0) is run twice (on devices 0 and 0)"),
    ([HAND_1F1B[1], HAND_1F1B[0]], "F(microbatch 0, stage 1) is on device 0, but stage 1 lives on device 1"),
    ([[("X", 0, 0)], []], "device 0 has ('X', 0, 0), which is not an op"),
])
def test_validate_reports_missing_repeated_misplaced_and_malformed_ops(schedule, message):
    assert oracles.validate(schedule, 2, 2).startswith(message)


def test_simulator_gpipe_by_hand():
    # p = 2, m = 2, t_f = 1, t_b = 2: device 1 runs F0 F1 then B0 B1; device 0's B0 waits for device 1's.
    gpipe = hidden.make_schedule(2, 2, "gpipe")
    got = hidden.simulate(gpipe, 1, 2)
    assert got["timing"] == {("F", 0, 0): (0, 0, 1), ("F", 1, 0): (0, 1, 2), ("F", 0, 1): (1, 1, 2),
                             ("F", 1, 1): (1, 2, 3), ("B", 0, 1): (1, 3, 5), ("B", 1, 1): (1, 5, 7),
                             ("B", 0, 0): (0, 5, 7), ("B", 1, 0): (0, 7, 9)}
    assert got["makespan"] == 9 == (2 + 2 - 1) * (1 + 2)
    assert got["bubble"] == pytest.approx(1 - 12 / 18) == pytest.approx(1 / 3)
    assert got["peak_in_flight"] == [2, 2]
    # t_comm = 0.5 on every hop between devices
    late = hidden.simulate(gpipe, 1, 2, 0.5)["timing"]
    assert late[("F", 0, 1)] == (1, 1.5, 2.5) and late[("F", 1, 1)] == (1, 2.5, 3.5)
    assert late[("B", 0, 0)] == (0, 6.0, 8.0) and late[("B", 1, 0)] == (0, 8.0, 10.0)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_closed_forms_hold_for_the_checks_schedules(kind):
    for p in range(1, 6):
        for m in range(1, 10):
            schedule = hidden.make_schedule(p, m, kind)
            assert oracles.validate(schedule, p, m) is None
            for t_f, t_b in ((1, 2), (1, 1), (3, 1), (2, 5)):
                got = hidden.simulate(schedule, t_f, t_b)
                makespan, bubble = oracles.closed_form(p, m, t_f, t_b)
                assert got["makespan"] == makespan and math.isclose(got["bubble"], bubble, abs_tol=1e-12)
            peak = [min(m, p - i) for i in range(p)] if kind == "1f1b" else [m] * p
            assert got["peak_in_flight"] == peak


def test_interleaved_closed_form_cuts_the_bubble_time_v_fold():
    for p in range(2, 6):
        for v in (2, 3, 4):
            for m in (p, 2 * p, 3 * p):
                schedule = hidden.make_schedule(p, m, "interleaved", v)
                assert oracles.validate(schedule, p, m, v) is None
                for t_f, t_b in ((1, 2), (1, 1), (3, 1), (1, 3)):
                    got = hidden.simulate(schedule, t_f, t_b)
                    assert (got["makespan"], got["bubble"]) == pytest.approx(oracles.closed_form(p, m, t_f, t_b, v))
                    # idle time per device: (p - 1)(t_f + t_b) per chunk, i.e. 1/v of 1F1B's with v-times-longer ops
                    assert got["makespan"] - v * m * (t_f + t_b) == (p - 1) * (t_f + t_b)


def test_random_schedules_are_valid():
    rng = random.Random(0)
    for _ in range(30):
        p, v, m = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 5)
        assert oracles.validate(oracles.random_schedule(rng, p, m, v), p, m, v) is None


def _timeline(simulated):
    return [(device, *op, start, end) for op, (device, start, end) in simulated["timing"].items()]


def test_the_timeline_check_passes_the_simulators_timeline_and_names_the_first_wrong_op():
    rng = random.Random(1)
    for _ in range(100):
        p, v, m = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 5)
        schedule = oracles.random_schedule(rng, p, m, v)
        t_f, t_b, t_comm = rng.choice([1, 0.5, 0.4]), rng.choice([1, 1.3, 2]), rng.choice([0, 0.25, 1])
        timeline = _timeline(hidden.simulate(schedule, t_f, t_b, t_comm))
        assert oracles.timeline_problem(schedule, t_f, t_b, t_comm, timeline) is None
        late = rng.randrange(len(timeline))  # one op half a unit late: it is the one named, not those after it
        device, kind, mb, stage, start, end = timeline[late]
        timeline[late] = (device, kind, mb, stage, start + 0.5, end + 0.5)
        problem = oracles.timeline_problem(schedule, t_f, t_b, t_comm, timeline)
        assert problem.startswith(f"{oracles.op_text((kind, mb, stage))} starts at {start + 0.5:g}"), problem
    gpipe = hidden.make_schedule(2, 2, "gpipe")
    timeline = _timeline(hidden.simulate(gpipe, 1, 2))
    assert oracles.timeline_problem(gpipe, 1, 2, 0, timeline[:-1]).startswith("the timeline has 7 entries")
    short = [e if e[1:4] != ("F", 1, 1) else (*e[:5], e[5] - 0.5) for e in timeline]
    assert "which is 0.5; an F takes t_f = 1" in oracles.timeline_problem(gpipe, 1, 2, 0, short)


def test_the_executor_table_is_the_documented_gpipe_and_1f1b():
    for kind in ("gpipe", "1f1b"):
        for p in (2, 4):
            assert oracles.executor_schedule(kind, p) == hidden.make_schedule(p, checks.MICROBATCHES, kind)
    for p in (2, 4):  # the shuffled one: valid, and neither of them
        shuffled = oracles.executor_schedule("shuffled", p)
        assert oracles.validate(shuffled, p, checks.MICROBATCHES) is None
        assert all(shuffled != hidden.make_schedule(p, checks.MICROBATCHES, kind) for kind in ("gpipe", "1f1b"))


# --- the executor's messages -------------------------------------------------------------------

SHAPE = (3, 8)


def _posted(schedule, order=None):
    """The messages a rank posts for ``schedule``, as the harness records them: in the order
    of ``expected_messages``, or ``order(rank, events)`` of it; every tag the microbatch."""
    p, found = len(schedule), []
    for r, ops in enumerate(schedule):
        events = oracles.expected_messages(ops, r, p)
        events = order(r, events) if order else events
        found.append([{"kind": d, "peer": peer, "tag": what[1], "shape": list(SHAPE),
                       "carries": list(what) if d == "send" else None} for _, d, peer, what in events])
    return found


def _batched(rank, events):
    """Each receive moved before the previous op's send (one batch_isend_irecv, receive first)."""
    events = list(events)
    for k in range(1, len(events)):
        if events[k][1] == "recv" and events[k - 1][1] == "send" and events[k - 1][0] == events[k][0] - 1:
            events[k - 1], events[k] = events[k], events[k - 1]
    return events


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "shuffled"])
def test_messages_in_the_schedules_order_pass_and_so_do_batched_receives(kind):
    for p in (2, 4):
        schedule = oracles.executor_schedule(kind, p)
        assert oracles.message_problem(schedule, _posted(schedule), SHAPE) is None
        batched = _posted(schedule, _batched)
        assert batched != _posted(schedule) or kind == "gpipe" and p == 2
        assert oracles.message_problem(schedule, batched, SHAPE) is None


def test_gpipe_order_for_1f1b_ops_is_named_by_the_rank_and_messages_that_show_it():
    ones = oracles.executor_schedule("1f1b", 2)
    ran = _posted(oracles.executor_schedule("gpipe", 2))  # what an executor ignoring its ops posts
    assert oracles.message_problem(ones, ran, SHAPE) == (
        "rank 0 (ops F0 F1 B0 F2 B1 F3 B2 B3) sends F2 to rank 1 before it receives B0 from rank 1, whose op "
        "comes first in its ops: run the ops in the order given")


def test_whole_batch_messages_and_shuffled_microbatches_are_named():
    gpipe = oracles.executor_schedule("gpipe", 2)
    whole = [[{"kind": "send", "peer": 1, "tag": 0, "shape": [12, 8], "carries": None},
              {"kind": "recv", "peer": 1, "tag": 0, "shape": [12, 8], "carries": None}],
             [{"kind": "recv", "peer": 0, "tag": 0, "shape": [12, 8], "carries": None},
              {"kind": "send", "peer": 0, "tag": 0, "shape": [12, 8], "carries": None}]]
    assert oracles.message_problem(gpipe, whole, SHAPE).startswith(
        "rank 0's message 1 (send to rank 1) has shape (12, 8); every message is one microbatch's")
    shuffled = oracles.executor_schedule("shuffled", 2)
    assert oracles.message_problem(shuffled, _posted(oracles.executor_schedule("1f1b", 2)), SHAPE).startswith(
        "rank 0 (ops F2 F0 F3 B2 B0 F1 B3 B1): its send number 1 is F0 to rank 1, expected F2 to rank 1")


def test_a_receive_posted_two_ops_early_or_unmatched_is_refused():
    ones = oracles.executor_schedule("1f1b", 2)

    def hoisted(rank, events):  # rank 1 posts every receive first
        return sorted(events, key=lambda e: e[1] != "recv") if rank == 1 else events
    assert "more than one op ahead" in oracles.message_problem(ones, _posted(ones, hoisted), SHAPE)
    untagged = _posted(ones)
    untagged[1][0]["tag"] = 7  # a receive no send matches
    assert oracles.message_problem(ones, untagged, SHAPE) == (
        "rank 1's message 1 receives from rank 0 with tag 7, but that rank sends it no message (or no more) "
        "with that tag")
    unknown = _posted(ones)
    unknown[0][0]["carries"] = None  # data that is no microbatch's output
    assert oracles.message_problem(ones, unknown, SHAPE).startswith("rank 0's message 1 sends rank 1 (tag 0) a tensor")


def test_brute_force_partition_on_tiny_cases():
    assert oracles.brute_force_partition([1, 2, 3], 2) == 3  # [0, 2, 3]: 1+2 | 3
    assert oracles.brute_force_partition([1, 2, 3], 2, [1, 3]) == pytest.approx(5 / 3)  # [0, 1, 3]: 1 | 5/3
    assert oracles.brute_force_partition([1, 1, 1, 1], 2, [3, 1]) == 1  # [0, 3, 4]
    assert oracles.brute_force_partition([4, 1, 1], 3) == 4
    assert oracles.brute_force_partition([7], 1) == 7


def test_the_partition_queries_have_a_unique_best_value_to_compare():
    for costs, p, speeds in checks.PLAIN_PARTITIONS + checks.SPEED_PARTITIONS:
        assert 1 <= p <= len(costs) and (speeds is None or len(speeds) == p)


@pytest.mark.slow
def test_an_executor_deadlock_costs_its_case_only_and_leaves_no_process(make_submission, our_processes):
    """Blocking sends: GPipe works, 1F1B hangs (both neighbours send at once). The job is stopped
    once its ranks idle (course.dist's idle_timeout), well before its 60 s timeout."""
    folder = make_submission(LAB, "pipeline.py", [
        ("                sends.append((dist.isend(sent, dst=peer(rank + 1), group=group, tag=mb), sent))\n",
         "                dist.send(sent, dst=peer(rank + 1), group=group, tag=mb)\n"),
        ("                sends.append((dist.isend(sent, dst=peer(rank - 1), group=group, tag=mb), sent))\n",
         "                dist.send(sent, dst=peer(rank - 1), group=group, tag=mb)\n")])
    request = {"submission": str(folder), "target": {"kind": "harness", "path": str(CHECKS / "harness.py"),
                                                     "func": "executor_job"},
               "args": [2, checks.executor_cases(2), 60], "kwargs": {}}
    start = time.monotonic()
    outcome = run_call(request, Limits(timeout_s=120, memory_mb=6144))
    elapsed = time.monotonic() - start
    assert outcome.status == "ok", outcome
    assert outcome.value["gpipe"]["status"] == "ok", outcome.value
    assert outcome.value["1f1b"]["status"] == "timeout", outcome.value
    assert "likely deadlock" in outcome.value["1f1b"]["message"], outcome.value
    assert "no rank having used the CPU for 5 s" in outcome.value["1f1b"]["message"], outcome.value
    assert elapsed < 40
    time.sleep(0.5)
    assert our_processes() == []
