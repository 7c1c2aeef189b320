"""Checks for lab 11: pipeline parallelism.

The oracles (``oracles.py``, none from solutions/) check answers rather than
compute them, so that no released file holds the lab's schedules or simulator:

- ``make_schedule``: ``validate`` (every (kind, microbatch, stage) op exactly
  once, on device ``stage % p``, no deadlock: "deadlock: device 0 waits for ...
  while device 1 waits for ..."), and the microbatches each device holds in
  flight, counted along its list (1F1B: at most min(m, p - i) on device i).
- ``simulate``: on random valid schedules (t_comm > 0) and the smallest ones,
  ``timeline_problem`` checks every op of the student's timeline against its
  neighbours in that same timeline: it lasts t_f or t_b and starts exactly when
  its device is free and its dependencies have arrived (+ t_comm across
  devices). Only the right timeline passes; the makespan, bubble and peaks
  follow from it and from the lists.
- ``partition``: brute force over every way to cut the layers (the best time,
  not the cut).
- The executor: single-process training of the whole float64 MLP on the
  concatenated batch with the mean loss (computed in the job, see harness.py);
  every gradient and the loss must agree to 1e-10. Its GPipe, 1F1B and
  shuffled op lists are a table (``oracles.EXECUTOR_SCHEDULES``). Its
  point-to-point messages, recorded as each rank posts them, must follow the
  op lists (``oracles.message_problem``): one microbatch each, each send the
  output or input gradient (by its data) of the op whose turn it is.

The hidden checks (``check_pipeline_hidden.py``, not in the student repository)
time the student's schedules with the grader's own simulator against the closed
forms, and the student's simulator on the grader's own schedules.

The pure functions are graded in one sandboxed call for every query
(``formulas``; ``simulate`` on deadlocked schedules under a timer there, so a
simulator that loops forever costs only that check); the executor in one
``course.dist`` job per world size (2 and 4) for every case.
"""
import functools
import math
import random

import pytest

from autograder.grading.checking import load_beside, with_the_work
from autograder.grading.submission import failure_from, not_implemented_yet
from autograder.grading.traffic import expect_crossed

oracles = load_beside(__file__, "oracles")
validate, op_text = oracles.validate, oracles.op_text


# --- the queries, one sandboxed call for all ------------------------------------------------

# (p, m): m < p, m % p != 0, one stage (p = 1), one microbatch (m = 1) and both
BLOCKING = [(4, 4), (2, 1), (2, 5), (3, 2), (4, 7), (3, 9), (5, 3), (1, 3), (1, 1)]
INTERLEAVED = [(2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (3, 6, 3), (3, 3, 2), (1, 2, 2)]  # (p, m, v), m % p == 0
RANDOM_SCHEDULES = 10
DEADLOCKED = [
    [[("F", 0, 0), ("B", 0, 0)], [("B", 0, 1), ("F", 0, 1)]],  # device 1 runs B before the F it needs
    [[("F", 0, 0), ("B", 1, 0), ("F", 1, 0), ("B", 0, 0)], [("F", 0, 1), ("B", 0, 1), ("F", 1, 1), ("B", 1, 1)]],
]
SCHEDULE_ERRORS = [(4, 6, "interleaved", 2), (2, 4, "gpipe", 2), (2, 4, "1f1b", 3)]  # must raise ValueError
# The smallest schedules next to the random ones: nothing to run (makespan 0, bubble 0), and one
# microbatch on one device with fractional times.
SMALLEST_SCHEDULES = [([[], []], 1, 2, 0.5), ([[("F", 0, 0), ("B", 0, 0)]], 0.4, 1.3, 0.25)]


def _random_cases():
    rng = random.Random(1111)
    cases = []
    for i in range(RANDOM_SCHEDULES):
        p, v, m = rng.randint(1, 4), rng.choice([1, 1, 2, 3]), rng.randint(1, 5)
        cases.append((oracles.random_schedule(rng, p, m, v), rng.choice([1, 0.5, 2]), rng.choice([1, 1.5, 2, 3]),
                      [0, 0.25, 1, 0.5][i % 4]))
    return cases + SMALLEST_SCHEDULES


def _partition_cases():
    rng = random.Random(1112)
    # a layer per stage, one stage, and fractions whose floors tie two cuts: 0.6 | 0.6 + 0.9 takes 1.5,
    # 0.6 + 0.6 | 0.9 takes 1.2 (the best), and both floor to 1
    plain = [([1, 1, 1, 1], 2, None), ([5, 1, 1, 1, 1, 1], 3, None), ([2, 3], 2, None), ([4.5], 1, None),
             ([0.6, 0.6, 0.9], 2, None)]
    speeds = []
    for _ in range(14):
        n = rng.randint(2, 8)
        p = rng.randint(1, min(n, 4))
        costs = [rng.choice([round(rng.uniform(0.1, 5), 3), rng.randint(1, 4)]) for _ in range(n)]
        plain.append((costs, p, None))
        speeds.append((costs, p, [rng.choice([0.5, 1, 2, 3, round(rng.uniform(0.3, 4), 2)]) for _ in range(p)]))
    speeds.append(([1, 1, 1, 1], 2, [3, 1]))  # the docstring's example: [0, 3, 4]
    speeds.append(([1, 1, 1, 1, 1, 1], 3, [1, 4, 1]))
    return plain, speeds


PLAIN_PARTITIONS, SPEED_PARTITIONS = _partition_cases()


@functools.lru_cache(maxsize=None)
def _queries():
    schedules = [(p, m, kind, 1) for p, m in BLOCKING for kind in ("gpipe", "1f1b")]
    schedules += [(p, m, "interleaved", v) for p, m, v in INTERLEAVED]
    return {"make_schedule": schedules, "make_schedule_errors": SCHEDULE_ERRORS, "simulate": _random_cases(),
            "partition": PLAIN_PARTITIONS + SPEED_PARTITIONS, "partition_errors": [([1, 2, 3], 4)],
            "simulate_deadlocks": DEADLOCKED}


def _answers(submission, name):
    got = submission.harness_once("formulas", "formulas", _queries())[name]
    if isinstance(got, dict) and "not_implemented" in got:
        raise not_implemented_yet(got["not_implemented"])
    return got


def _answer(submission, name, query):
    """What the submission's function gave for one query; an exception it raised fails the check."""
    got = _answers(submission, name)[_position(name)[repr(query)]]
    if isinstance(got, dict) and "error" in got:
        raise AssertionError(f"{got['call']} raised {got['error']}")
    return got


@functools.lru_cache(maxsize=None)
def _position(name):
    """{repr(query): its position among the ``name`` queries}."""
    return {repr(query): i for i, query in enumerate(_queries()[name])}


def _schedule(submission, p, m, kind, v=1):
    return _answer(submission, "make_schedule", (p, m, kind, v))


# --- make_schedule ----------------------------------------------------------------------------

def _expect_valid(submission, kind, cases):
    for p, m, v in cases:
        problem = validate(_schedule(submission, p, m, kind, v), p, m, v)
        assert problem is None, f"make_schedule({p}, {m}, {kind!r}{f', v={v}' if v > 1 else ''}): {problem}"


@pytest.mark.points(1)
def check_gpipe_schedule_is_valid(submission):
    """make_schedule(p, m, "gpipe"): every F and B exactly once on its device, dependencies respected, no deadlock"""
    _expect_valid(submission, "gpipe", [(p, m, 1) for p, m in BLOCKING])


@pytest.mark.points(2)
def check_1f1b_schedule_is_valid(submission):
    """make_schedule(p, m, "1f1b"): every op exactly once on its device, no deadlock (m < p and m % p != 0 too)"""
    _expect_valid(submission, "1f1b", [(p, m, 1) for p, m in BLOCKING])


@pytest.mark.points(2)
def check_interleaved_schedule_is_valid(submission):
    """make_schedule(p, m, "interleaved", v): v chunks per device, every op once, no deadlock; ValueError cases"""
    _expect_valid(submission, "interleaved", INTERLEAVED)
    for query, got in zip(SCHEDULE_ERRORS, _answers(submission, "make_schedule_errors")):
        p, m, kind, v = query
        assert isinstance(got, dict) and got.get("error", "").startswith("ValueError"), (
            f"make_schedule({p}, {m}, {kind!r}, v={v}) should raise ValueError "
            f"({'m is not a multiple of p' if kind == 'interleaved' else 'v > 1 is only for interleaved'}), "
            f"got {got.get('error') if isinstance(got, dict) else 'a schedule'}")


@pytest.mark.points(1)
def check_1f1b_holds_fewer_microbatches_in_flight(submission):
    """1F1B holds at most min(m, p-i) microbatches in flight on device i; GPipe holds all m"""
    for p, m in BLOCKING:
        for kind, want in (("1f1b", [min(m, p - i) for i in range(p)]), ("gpipe", [m] * p)):
            schedule = _schedule(submission, p, m, kind)
            if validate(schedule, p, m) is not None:
                raise AssertionError(f"make_schedule({p}, {m}, {kind!r}) is not a valid schedule "
                                     "(see the validity checks)")
            got = oracles.peak_in_flight(schedule)
            assert got == want, (
                f"make_schedule({p}, {m}, {kind!r}): at most {got} microbatches in flight per device (F run, B "
                f"not yet), expected {want}" + (": the warm-up of device d is p - d - 1 forwards"
                                                if kind == "1f1b" else ""))


# --- simulate ---------------------------------------------------------------------------------

def _simulated(submission, schedule, t_f, t_b, t_comm):
    got = _answer(submission, "simulate", (schedule, t_f, t_b, t_comm))
    if not isinstance(got, dict) or not {"timeline", "makespan", "bubble", "peak_in_flight"} <= set(got):
        raise AssertionError(f"simulate returned {str(got)[:200]}; expected a dict with keys 'timeline', "
                             "'makespan', 'bubble' and 'peak_in_flight'")
    return got


def _number(value, what):
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise AssertionError(f"{what} should be a number, got {value!r}")
    return value


@pytest.mark.points(2)
def check_simulate_matches_the_check_on_random_schedules(submission):
    """simulate's timeline, makespan, bubble, peak in flight are right on random (t_comm > 0) and empty schedules"""
    for schedule, t_f, t_b, t_comm in _random_cases():
        p = len(schedule)
        if (schedule, t_f, t_b, t_comm) in SMALLEST_SCHEDULES:
            what = f"simulate({schedule}, t_f={t_f}, t_b={t_b}, t_comm={t_comm})"
            answer = _answers(submission, "simulate")[_position("simulate")[repr((schedule, t_f, t_b, t_comm))]]
            if isinstance(answer, dict) and "error" in answer:
                raise AssertionError(f"{what} raised {answer['error']}; a schedule with no op takes 0, and its "
                                     "bubble is 0 (nothing runs, so no device waits)" if not any(schedule) else
                                     f"{what} raised {answer['error']}")
        else:
            what = f"simulate(a random valid schedule on {p} devices, t_f={t_f}, t_b={t_b}, t_comm={t_comm})"
        got = _simulated(submission, schedule, t_f, t_b, t_comm)
        problem = oracles.timeline_problem(schedule, t_f, t_b, t_comm, got["timeline"])
        assert problem is None, f"{what}['timeline']: {problem}"
        makespan = max((e[5] for e in got["timeline"]), default=0)
        busy = sum(e[5] - e[4] for e in got["timeline"])
        bubble = 1 - busy / (p * makespan) if makespan else 0
        assert math.isclose(_number(got["makespan"], what), makespan), (
            f"{what}['makespan'] = {got['makespan']}, expected {makespan:g} (when the timeline's last op ends)")
        assert math.isclose(_number(got["bubble"], what), bubble, abs_tol=1e-9), (
            f"{what}['bubble'] = {got['bubble']}, expected {bubble:.6g} (idle time / (p * makespan), 0 without ops)")
        assert list(got["peak_in_flight"]) == oracles.peak_in_flight(schedule), (
            f"{what}['peak_in_flight'] = {got['peak_in_flight']}, expected {oracles.peak_in_flight(schedule)}")


@pytest.mark.points(1)
def check_simulate_reports_a_deadlock(submission):
    """simulate raises an error (it does not hang or return) on a schedule that deadlocks"""
    for schedule, outcome in zip(DEADLOCKED, _answers(submission, "simulate_deadlocks")):
        assert "hung" not in outcome, (
            f"simulate({schedule}, 1, 2) was still running after {outcome.get('hung')} s; this schedule deadlocks "
            f"({validate(schedule, 2, 2 if len(schedule[0]) > 2 else 1)}): when a sweep over the devices runs no "
            "op, raise an error saying what each blocked device waits for")
        assert "error" in outcome, (
            f"simulate({schedule}, 1, 2) returned {str(outcome.get('value'))[:200]}; this schedule deadlocks "
            f"({validate(schedule, 2, 2 if len(schedule[0]) > 2 else 1)}), so simulate should raise an error "
            "saying what each blocked device waits for")


# --- partition ---------------------------------------------------------------------------------

def _expect_partitions(submission, cases):
    for costs, p, speeds in cases:
        call = f"partition({costs}, {p}{f', speeds={speeds}' if speeds else ''})"
        got = _answer(submission, "partition", (costs, p, speeds))
        n = len(costs)
        assert (isinstance(got, (list, tuple)) and len(got) == p + 1 and all(isinstance(b, int) for b in got)
                and got[0] == 0 and got[-1] == n and all(a < b for a, b in zip(got[:-1], got[1:]))), (
            f"{call} = {got!r}; expected {p + 1} increasing boundaries from 0 to {n} (every stage non-empty)")
        want = oracles.brute_force_partition(costs, p, speeds)
        slowest = oracles.bottleneck(costs, list(got), speeds or [1.0] * p)
        assert math.isclose(slowest, want, rel_tol=1e-12), (
            f"{call} = {list(got)}: its slowest stage takes {slowest:.6g}, but the best cut's slowest takes "
            f"{want:.6g}" + (" (stage i's time is sum(costs[b_i:b_(i+1)]) / speeds[i])" if speeds else ""))


@pytest.mark.points(2)
def check_partition_matches_brute_force(submission):
    """partition(costs, p) minimises the slowest stage (equal to trying every cut); ValueError when p > len(costs)"""
    _expect_partitions(submission, PLAIN_PARTITIONS)
    (got,) = _answers(submission, "partition_errors")
    assert isinstance(got, dict) and got.get("error", "").startswith("ValueError"), (
        f"partition([1, 2, 3], 4) should raise ValueError (4 non-empty stages from 3 layers), got "
        f"{got.get('error') if isinstance(got, dict) else got}")


@pytest.mark.points(1)
def check_partition_with_device_speeds(submission):
    """partition(costs, p, speeds): stage i takes sum of its costs / speeds[i]; equal to trying every cut"""
    _expect_partitions(submission, SPEED_PARTITIONS)


# --- the executor, on 2 and 4 ranks -----------------------------------------------------------

WORLD_SIZES = (2, 4)
MICROBATCHES = 4
EXECUTOR_CASES = ("gpipe", "1f1b", "shuffled")
TOLERANCE = 1e-10


def executor_cases(n, names=EXECUTOR_CASES):
    """(name, the op lists of the table) for each case on ``n`` ranks: plain data for the job."""
    return [(kind, oracles.executor_schedule(kind, n)) for kind in names]


def _executor_job(submission, n):
    """Every case's outcome on ``n`` ranks, once per grading run. On 4 ranks only the cases
    that ran on 2 run (the checks stop at the first failure; a hang costs seconds at least)."""
    names = EXECUTOR_CASES
    if n != WORLD_SIZES[0]:
        first = _executor_job(submission, WORLD_SIZES[0])
        names = tuple(name for name in names if first[name]["status"] == "ok")
    outcomes = {}
    if names:
        outcomes = submission.harness_once(("executor_job", n), "executor_job", n, executor_cases(n, names))
    return {name: outcomes.get(name, {"status": "crashed", "message": f"not run: it failed on {WORLD_SIZES[0]} ranks"})
            for name in EXECUTOR_CASES}


def _executor_outcomes(submission, name):
    found = {}
    for n in WORLD_SIZES:
        outcome = _executor_job(submission, n)[name]
        if outcome["status"] != "ok":
            raise failure_from(outcome, f"run_pipeline with the {name} schedule on {n} ranks")
        found[n] = outcome
    return found


def _expect_outcome_matches(name, n, outcome):
    """Every gradient of the run and the last rank's loss equal single-process training."""
    what = f"run_pipeline with the check's {name} ops, {MICROBATCHES} microbatches, on {n} ranks"
    for rank, record in enumerate(outcome["ranks"]):
        for param, error in record["errors"]:
            assert error is not None, (f"{what}: rank {rank}'s {param} has no gradient after run_pipeline "
                                       "(backward never reached it?)")
            assert error <= TOLERANCE, (
                f"{what}: rank {rank}'s {param}.grad differs from single-process training on the whole batch "
                f"(mean loss) by {error:.3g}; expected at most {TOLERANCE:g}. Did the last rank divide each "
                "microbatch's loss by m, and did every B backpropagate the gradient received from rank+1?")
    last = outcome["ranks"][-1]
    loss = last["loss"]
    assert isinstance(loss, float) and math.isclose(loss, last["oracle_loss"], rel_tol=TOLERANCE), (
        f"{what}: the last rank returned the loss {loss!r}, expected the mean loss {last['oracle_loss']:.12g} "
        "(single process, whole batch)")


def _expect_single_process(submission, name):
    for n, outcome in _executor_outcomes(submission, name).items():
        _expect_outcome_matches(name, n, outcome)


@pytest.mark.points(2)
def check_executor_gpipe_matches_single_process(submission):
    """run_pipeline with GPipe ops: every gradient and the loss equal single-process training (2 and 4 ranks)"""
    _expect_single_process(submission, "gpipe")


@pytest.mark.points(2)
def check_executor_1f1b_matches_single_process(submission):
    """run_pipeline with 1F1B ops: every gradient and the loss equal single-process training (2 and 4 ranks)"""
    _expect_single_process(submission, "1f1b")


@pytest.mark.points(2)
def check_executor_follows_the_schedule(submission):
    """run_pipeline's sends and receives follow its ops (GPipe, 1F1B, shuffled): one microbatch each, in that order"""
    for name in EXECUTOR_CASES:
        for n, outcome in _executor_outcomes(submission, name).items():
            with_the_work("the audit of its messages", lambda: _expect_outcome_matches(name, n, outcome))
            problem = oracles.message_problem(oracles.executor_schedule(name, n),
                                              [record["messages"] for record in outcome["ranks"]],
                                              outcome["ranks"][0]["activation_shape"])
            assert problem is None, (
                f"run_pipeline with the check's {name} ops on {n} ranks: {problem}. Each op is one microbatch: "
                "F receives from rank - 1 and sends to rank + 1, B receives from rank + 1 and sends to rank - 1, "
                "in the order of ops")
            # What crossed, as the kernel counted it: each microbatch's activation forward and gradient back
            # over every stage boundary, and nothing else.
            schedule = oracles.executor_schedule(name, n)
            messages = 2 * (n - 1) * (1 + max(op[1] for op in schedule[0]))
            expect_crossed(submission, outcome["wire"], "steps", messages * 8 * math.prod(
                outcome["ranks"][0]["activation_shape"]), messages, f"run_pipeline with the {name} ops on {n} ranks",
                "one activation forward and one gradient back per microbatch and stage boundary")
