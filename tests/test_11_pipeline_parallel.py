"""Lab 11's grader: its own dependency checker, timeline checker, simulator, schedules
and brute-force partition are right (checked by hand and against the closed forms),
the executor's table of op lists is the documented GPipe and 1F1B, the queries and
schedules drawn from the seed keep their edge cases, the single-process oracle equals
per-microbatch training and names the boundary tensors, each rank receives only its
stage, and an executor that deadlocks costs its case only, within the timeout, with no
process left behind. The simulator and schedules are the hidden oracles (``oracles_hidden.py``)."""
import math
import random
import time
from pathlib import Path

import numpy as np
import pytest

from autograder.sandbox import Limits
from conftest import load_check_file

REPO = Path(__file__).resolve().parents[1]
LAB = "11-pipeline-parallel"
CHECKS = REPO / "autograder" / "checks" / LAB
checks = load_check_file(LAB, "check_pipeline")
executor = load_check_file(LAB, "check_pipeline_executor")
oracles, hidden = checks.oracles, load_check_file(LAB, "oracles_hidden")
# A valid order that is neither GPipe's nor 1F1B's, microbatches out of order (m = 4).
SHUFFLED_2 = [[("F", 2, 0), ("F", 0, 0), ("F", 3, 0), ("B", 2, 0), ("B", 0, 0), ("F", 1, 0), ("B", 3, 0),
               ("B", 1, 0)],
              [("F", 2, 1), ("B", 2, 1), ("F", 0, 1), ("B", 0, 1), ("F", 3, 1), ("B", 3, 1), ("F", 1, 1),
               ("B", 1, 1)]]

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
    for kind, p, m in oracles.EXECUTOR_SCHEDULES:
        assert oracles.executor_schedule(kind, p, m) == hidden.make_schedule(p, m, kind)


def test_shuffled_and_deadlocked_schedules_are_drawn_as_documented():
    rng = random.Random(3)
    for p in (1, 2, 3, 4):
        for m in (2, 4):
            shuffled = oracles.shuffled_schedule(rng, p, m)
            assert oracles.validate(shuffled, p, m) is None
            assert all(shuffled != hidden.make_schedule(p, m, kind) for kind in ("gpipe", "1f1b"))
        for m in (1, 3):
            stuck = oracles.deadlocked_schedule(rng, p, m)
            assert oracles.validate(stuck, p, m).startswith("deadlock"), stuck
            with pytest.raises(RuntimeError, match="deadlock"):
                hidden.simulate(stuck, 1, 2)


def test_the_graded_queries_are_drawn_from_the_seed_and_keep_their_edge_cases():
    first, second = checks.blocking(1), checks.blocking(2)
    assert first != second and first == checks.blocking(1)
    for cases in (first, second):
        assert any(m < p for p, m in cases) and any(m > p and m % p == 0 for p, m in cases)
        assert any(m > p and m % p for p, m in cases) and any(m == 1 < p for p, m in cases)
        assert (1, 1) in cases and any(p == 1 < m for p, m in cases)
    assert all(m % p == 0 for p, m, _ in checks.interleaved(5)) and any(p == 1 for p, _, _ in checks.interleaved(5))
    assert checks._random_cases(1) != checks._random_cases(2)
    assert checks._partition_cases(1) != checks._partition_cases(2)
    assert checks._deadlocked(1)[-1] != checks._deadlocked(2)[-1]


# --- the executor's model and what each rank receives -------------------------------------------

def _whole(case):
    """The case's model as torch modules, trained by torch's autograd on the whole batch at
    once (mean loss): the same step as the oracle's, computed another way."""
    import torch

    modules = []
    for i, (w, b) in enumerate(case["layers"]):
        linear = torch.nn.Linear(w.shape[1], w.shape[0], dtype=torch.float64)
        linear.weight.data, linear.bias.data = torch.tensor(w), torch.tensor(b)
        modules += [linear] + ([torch.nn.Tanh()] if i < len(case["layers"]) - 1 else [])
    model = torch.nn.Sequential(*modules)
    loss = torch.nn.functional.mse_loss(model(torch.tensor(np.concatenate(case["xs"]))),
                                        torch.tensor(np.concatenate(case["ys"])))
    loss.backward()
    return model, float(loss.detach())


def test_the_single_process_oracle_equals_torch_autograd_and_names_the_boundaries():
    import torch

    case = executor._case(7, "shuffled", 4)
    trained = oracles.train_whole_model(case["layers"], case["xs"], case["ys"], 4)
    model, loss = _whole(case)
    assert math.isclose(trained["loss"], loss, rel_tol=1e-12)
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    for (dw, db), linear in zip(trained["grads"], linears):
        assert np.allclose(dw, linear.weight.grad.numpy(), rtol=0, atol=1e-14)
        assert np.allclose(db, linear.bias.grad.numpy(), rtol=0, atol=1e-14)
    h = torch.tensor(case["xs"][2])
    for s in range(3):  # stage s's output of microbatch 2 is what it sends forward
        h = model[4 * s:4 * s + 4](h)
        assert np.allclose(trained["outputs"][s][2], h.detach().numpy(), atol=1e-15)
        assert oracles.carried(h.detach().numpy(), s + 1, s, trained) == ["F", 2]
        assert oracles.carried(h.detach().numpy(), s - 1, s, trained) is None  # to the wrong neighbour
    # the last stage's input gradient of microbatch 1: its share (1/m) of the whole batch's mean loss
    x3 = torch.tensor(trained["outputs"][2][1], requires_grad=True)
    (torch.nn.functional.mse_loss(model[12:](x3), torch.tensor(case["ys"][1])) / 4).backward()
    assert np.allclose(trained["input_grads"][3][1], x3.grad.numpy(), rtol=0, atol=1e-15)
    assert oracles.carried(trained["input_grads"][3][1], 2, 3, trained) == ["B", 1]
    assert oracles.carried(np.zeros((3, 8)), 2, 3, trained) is None and oracles.carried(None, 2, 3, trained) is None


def test_each_rank_receives_only_its_stage():
    case = executor._case(7, "gpipe", 4)
    parts = [executor._part(case, rank) for rank in range(4)]
    assert [("microbatches" in part, "targets" in part) for part in parts] == [
        (True, False), (False, False), (False, False), (False, True)]
    for rank, part in enumerate(parts):
        assert [layer["weight"].tolist() for layer in part["weights"]] == [
            w.tolist() for w, _ in case["layers"][2 * rank:2 * rank + 2]]
        assert part["ops"] == case["schedule"][rank] and part["m"] == executor.MICROBATCHES
    assert [layer["last"] for part in parts for layer in part["weights"]] == [False] * 7 + [True]
    assert executor._case(7, "gpipe", 4)["xs"][0].tolist() == case["xs"][0].tolist()
    assert executor._case(8, "gpipe", 4)["xs"][0].tolist() != case["xs"][0].tolist()


def test_the_memory_case_keeps_8_mib_per_microbatch_and_sends_16_kib():
    dims, rows = executor.MEMORY["dims"], executor.MEMORY["rows"]
    assert executor.held_per_microbatch(dims, rows, 2) == 8 * 2**20
    case = executor._case(0, "1f1b memory", 2, dims, rows, executor.MEMORY["microbatches"])
    assert math.prod(case["activation_shape"]) * 8 == 16 * 2**10
    assert oracles.peak_in_flight(case["schedule"]) == [2, 1]


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
        schedule = (oracles.shuffled_schedule(random.Random(p), p, 4) if kind == "shuffled"
                    else oracles.executor_schedule(kind, p))
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
    shuffled = SHUFFLED_2
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


def test_the_partition_queries_are_well_formed():
    for seed in range(20):
        plain, speeds = checks._partition_cases(seed)
        for costs, p, speeds_of in plain + speeds:
            assert 1 <= p <= len(costs) and (speeds_of is None or len(speeds_of) == p)


@pytest.mark.slow
def test_an_executor_deadlock_costs_its_case_only_and_leaves_no_process(make_submission, our_processes):
    """Blocking sends: GPipe works, 1F1B hangs (both neighbours send at once) and the shuffled
    case after it is not run. The job is stopped once its ranks idle, well before its timeout."""
    from autograder.grading.labs import find_lab
    from autograder.grading.runner import child_environment
    from autograder.grading.submission import Submission
    from fixtures.buggy_11 import BUGS

    bug = next(b for b in BUGS if b.name.startswith("executor with blocking sends"))
    folder = make_submission(LAB, bug.file, bug.edits)
    submission = Submission(folder, CHECKS / "harness.py", "cpu", Limits(timeout_s=120, memory_mb=6144),
                            child_environment("cpu", find_lab(LAB)))
    start = time.monotonic()
    try:
        cases = {name: outcome for name, (_, outcome) in executor._job(submission, 0, 2).items()}
    finally:
        submission.close()
    elapsed = time.monotonic() - start
    assert cases["gpipe"]["status"] == "ok", cases
    assert cases["1f1b"]["status"] == "timeout", cases
    assert "likely deadlock" in cases["1f1b"]["message"], cases
    assert "no rank having used the CPU for 5 s" in cases["1f1b"]["message"], cases
    assert cases["shuffled"]["status"] == "timeout" and "not run" in cases["shuffled"]["message"], cases
    assert elapsed < 40
    time.sleep(0.5)
    assert our_processes() == []
