"""Checks for lab 11: pipeline parallelism, its single-process functions (the executor's
checks are in ``check_pipeline_executor.py``).

Every graded input is drawn from the grading's secret seed (a few edge cases
are fixed), and every expected value is computed here, in the grader's process,
by the oracles (``oracles.py``, none from solutions/), which check answers rather
than compute them, so that no released file holds the lab's schedules or simulator:

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

The hidden checks (``check_pipeline_hidden.py``, not in the student repository)
time the student's schedules with the grader's own simulator against the closed
forms, and the student's simulator on the grader's own schedules.

The functions are graded in one sandboxed call for every query (``formulas``;
``simulate`` on deadlocked schedules under a timer there, so a simulator that
loops forever costs only that check).
"""
import math
import random

import pytest

from autograder.grading import seeds
from autograder.grading.checking import load_beside
from autograder.grading.submission import not_implemented_yet

oracles = load_beside(__file__, "oracles")
validate, op_text = oracles.validate, oracles.op_text


# --- the queries, drawn from the grading's seed, one sandboxed call for all ------------------

RANDOM_SCHEDULES = 10
DEADLOCKED = [  # and one drawn per grading
    [[("F", 0, 0), ("B", 0, 0)], [("B", 0, 1), ("F", 0, 1)]],  # device 1 runs B before the F it needs
    [[("F", 0, 0), ("B", 1, 0), ("F", 1, 0), ("B", 0, 0)], [("F", 0, 1), ("B", 0, 1), ("F", 1, 1), ("B", 1, 1)]],
]
# The smallest schedules next to the random ones: nothing to run (makespan 0, bubble 0), and one
# microbatch on one device with fractional times.
SMALLEST_SCHEDULES = [([[], []], 1, 2, 0.5), ([[("F", 0, 0), ("B", 0, 0)]], 0.4, 1.3, 0.25)]
# A layer per stage, one stage, and fractions whose floors tie two cuts: 0.6 | 0.6 + 0.9 takes 1.5,
# 0.6 + 0.6 | 0.9 takes 1.2 (the best), and both floor to 1; with speeds too, and the docstring's example.
EDGE_PARTITIONS = [([1, 1, 1, 1], 2, None), ([5, 1, 1, 1, 1, 1], 3, None), ([2, 3], 2, None), ([4.5], 1, None),
                   ([0.6, 0.6, 0.9], 2, None)]
EDGE_SPEEDS = [([1, 1, 1, 1], 2, [3, 1]), ([1, 1, 1, 1, 1, 1], 3, [1, 4, 1]), ([1.2, 1.2, 1.8], 2, [2, 2]),
               ([2, 3, 1], 3, [1, 2, 0.5])]


def _random(seed, *names):
    return random.Random(int(seeds.rng(seed, "11", *names).integers(2**62)))


def blocking(seed):
    """(p, m) of the GPipe and 1F1B queries, drawn anew each grading: m < p (and m > 1, so that
    p > 2 and a cool-down of several backwards), m % p == 0, m % p != 0, m == p, one microbatch,
    one stage, both, and two more."""
    r = _random(seed, "blocking")
    p = [r.randint(3, 5), r.randint(2, 4), r.randint(2, 5), r.randint(2, 5), r.randint(2, 5)]
    cases = [(p[0], r.randint(2, p[0] - 1)), (p[1], p[1] * r.randint(2, 3)),
             (p[2], r.choice([m for m in range(p[2] + 1, 3 * p[2]) if m % p[2]])), (p[3], p[3]), (p[4], 1),
             (1, r.randint(2, 6)), (1, 1)]
    return cases + [(r.randint(2, 5), r.randint(1, 9)) for _ in range(2)]


def interleaved(seed):
    """(p, m, v) of the interleaved queries, m % p == 0: m = p with v = 2, m = 2p with v = 2
    and 3, and one stage (v = 3 needs m = 2p here: with m = p Megatron's warm-up takes every
    forward, and a warm-up cut short would deadlock instead of only waiting)."""
    r = _random(seed, "interleaved")
    cases = [(p, p, 2) for p in (2, r.randint(3, 4))] + [(p, 2 * p, 2) for p in (r.randint(2, 4), 4)]
    cases += [(p, 2 * p, 3) for p in (2, r.randint(3, 4))]
    return cases + [(1, r.randint(2, 3), r.randint(2, 3))]


def _schedule_errors(seed):
    """Queries that must raise ValueError: interleaved with m % p != 0, v > 1 for GPipe and 1F1B."""
    r = _random(seed, "errors")
    p = r.randint(2, 4)
    return [(p, r.choice([m for m in range(p + 1, 3 * p) if m % p]), "interleaved", 2),
            (r.randint(1, 4), r.randint(1, 6), "gpipe", r.randint(2, 3)),
            (r.randint(1, 4), r.randint(1, 6), "1f1b", r.randint(2, 3))]


def _random_cases(seed):
    r = _random(seed, "simulate")
    cases = []
    for i in range(RANDOM_SCHEDULES):
        p, v, m = r.randint(1, 4), r.choice([1, 1, 2, 3]), r.randint(1, 5)
        cases.append((oracles.random_schedule(r, p, m, v), r.choice([1, 0.5, 2]), r.choice([1, 1.5, 2, 3]),
                      [0, 0.25, 1, 0.5][i % 4]))
    return cases + SMALLEST_SCHEDULES


def _deadlocked(seed):
    r = _random(seed, "deadlocked")
    return DEADLOCKED + [oracles.deadlocked_schedule(r, r.randint(2, 3), r.randint(1, 3))]


def _partition_cases(seed):
    r = _random(seed, "partition")
    plain, speeds = list(EDGE_PARTITIONS), []
    for _ in range(14):
        n = r.randint(2, 8)
        p = r.randint(1, min(n, 4))
        costs = [r.choice([round(r.uniform(0.1, 5), 3), r.randint(1, 4)]) for _ in range(n)]
        plain.append((costs, p, None))
        speeds.append((costs, p, [r.choice([0.5, 1, 2, 3, round(r.uniform(0.3, 4), 2)]) for _ in range(p)]))
    return plain, speeds + EDGE_SPEEDS


def queries(submission, seed):
    """Every single-process query of this grading (the hidden checks' schedules read it too)."""
    def draw():
        schedules = [(p, m, kind, 1) for p, m in blocking(seed) for kind in ("gpipe", "1f1b")]
        plain, speeds = _partition_cases(seed)
        return {"make_schedule": schedules + [(p, m, "interleaved", v) for p, m, v in interleaved(seed)],
                "make_schedule_errors": _schedule_errors(seed), "simulate": _random_cases(seed),
                "partition": plain + speeds, "plain_partitions": plain, "speed_partitions": speeds,
                "partition_errors": [([1, 2, 3], 4)], "simulate_deadlocks": _deadlocked(seed)}
    return submission.once("queries", draw)


def _answers(submission, seed, name):
    got = submission.harness_once("formulas", "formulas", queries(submission, seed))[name]
    if isinstance(got, dict) and "not_implemented" in got:
        raise not_implemented_yet(got["not_implemented"])
    return got


def _raw(submission, seed, name, query):
    """What the submission's function gave for one query, an error it raised included."""
    asked = [repr(q) for q in queries(submission, seed)[name]]
    return _answers(submission, seed, name)[asked.index(repr(query))]


def _answer(submission, seed, name, query):
    """What the submission's function gave for one query; an exception it raised fails the check."""
    got = _raw(submission, seed, name, query)
    if isinstance(got, dict) and "error" in got:
        raise AssertionError(f"{got['call']} raised {got['error']}")
    return got


def schedule_of(submission, seed, p, m, kind, v=1):
    return _answer(submission, seed, "make_schedule", (p, m, kind, v))


# --- make_schedule ----------------------------------------------------------------------------

def _expect_valid(submission, seed, kind, cases):
    for p, m, v in cases:
        problem = validate(schedule_of(submission, seed, p, m, kind, v), p, m, v)
        assert problem is None, f"make_schedule({p}, {m}, {kind!r}{f', v={v}' if v > 1 else ''}): {problem}"


@pytest.mark.points(1)
def check_gpipe_schedule_is_valid(submission, seed):
    """make_schedule(p, m, "gpipe"): every F and B exactly once on its device, dependencies respected, no deadlock"""
    _expect_valid(submission, seed, "gpipe", [(p, m, 1) for p, m in blocking(seed)])


@pytest.mark.points(2)
def check_1f1b_schedule_is_valid(submission, seed):
    """make_schedule(p, m, "1f1b"): every op exactly once on its device, no deadlock (m < p and m % p != 0 too)"""
    _expect_valid(submission, seed, "1f1b", [(p, m, 1) for p, m in blocking(seed)])


@pytest.mark.points(2)
def check_interleaved_schedule_is_valid(submission, seed):
    """make_schedule(p, m, "interleaved", v): v chunks per device, every op once, no deadlock; ValueError cases"""
    _expect_valid(submission, seed, "interleaved", interleaved(seed))
    asked = queries(submission, seed)["make_schedule_errors"]
    for query, got in zip(asked, _answers(submission, seed, "make_schedule_errors")):
        p, m, kind, v = query
        assert isinstance(got, dict) and got.get("error", "").startswith("ValueError"), (
            f"make_schedule({p}, {m}, {kind!r}, v={v}) should raise ValueError "
            f"({'m is not a multiple of p' if kind == 'interleaved' else 'v > 1 is only for interleaved'}), "
            f"got {got.get('error') if isinstance(got, dict) else 'a schedule'}")


@pytest.mark.points(1)
def check_1f1b_holds_fewer_microbatches_in_flight(submission, seed):
    """1F1B holds at most min(m, p-i) microbatches in flight on device i; GPipe holds all m"""
    for p, m in blocking(seed):
        for kind, want in (("1f1b", [min(m, p - i) for i in range(p)]), ("gpipe", [m] * p)):
            schedule = schedule_of(submission, seed, p, m, kind)
            if validate(schedule, p, m) is not None:
                raise AssertionError(f"make_schedule({p}, {m}, {kind!r}) is not a valid schedule "
                                     "(see the validity checks)")
            got = oracles.peak_in_flight(schedule)
            assert got == want, (
                f"make_schedule({p}, {m}, {kind!r}): at most {got} microbatches in flight per device (F run, B "
                f"not yet), expected {want}" + (": the warm-up of device d is p - d - 1 forwards"
                                                if kind == "1f1b" else ""))


# --- simulate ---------------------------------------------------------------------------------

def number(value, what):
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise AssertionError(f"{what} should be a number, got {value!r}")
    return value


@pytest.mark.points(2)
def check_simulate_matches_the_check_on_random_schedules(submission, seed):
    """simulate's timeline, makespan, bubble, peak in flight are right on random (t_comm > 0) and empty schedules"""
    for query in queries(submission, seed)["simulate"]:
        schedule, t_f, t_b, t_comm = query
        p = len(schedule)
        what = (f"simulate({schedule}, t_f={t_f}, t_b={t_b}, t_comm={t_comm})" if query in SMALLEST_SCHEDULES else
                f"simulate(a random valid schedule on {p} devices, t_f={t_f}, t_b={t_b}, t_comm={t_comm})")
        got = _raw(submission, seed, "simulate", query)
        if isinstance(got, dict) and "error" in got:
            raise AssertionError(f"{what} raised {got['error']}" + ("" if any(schedule) else (
                "; a schedule with no op takes 0, and its bubble is 0 (nothing runs, so no device waits)")))
        if not isinstance(got, dict) or not {"timeline", "makespan", "bubble", "peak_in_flight"} <= set(got):
            raise AssertionError(f"{what} returned {str(got)[:200]}; expected a dict with keys 'timeline', "
                                 "'makespan', 'bubble' and 'peak_in_flight'")
        problem = oracles.timeline_problem(schedule, t_f, t_b, t_comm, got["timeline"])
        assert problem is None, f"{what}['timeline']: {problem}"
        makespan = max((e[5] for e in got["timeline"]), default=0)
        busy = sum(e[5] - e[4] for e in got["timeline"])
        bubble = 1 - busy / (p * makespan) if makespan else 0
        assert math.isclose(number(got["makespan"], what), makespan), (
            f"{what}['makespan'] = {got['makespan']}, expected {makespan:g} (when the timeline's last op ends)")
        assert math.isclose(number(got["bubble"], what), bubble, abs_tol=1e-9), (
            f"{what}['bubble'] = {got['bubble']}, expected {bubble:.6g} (idle time / (p * makespan), 0 without ops)")
        assert list(got["peak_in_flight"]) == oracles.peak_in_flight(schedule), (
            f"{what}['peak_in_flight'] = {got['peak_in_flight']}, expected {oracles.peak_in_flight(schedule)}")


@pytest.mark.points(1)
def check_simulate_reports_a_deadlock(submission, seed):
    """simulate raises an error (it does not hang or return) on a schedule that deadlocks"""
    asked = queries(submission, seed)["simulate_deadlocks"]
    for schedule, outcome in zip(asked, _answers(submission, seed, "simulate_deadlocks")):
        why = validate(schedule, len(schedule), sum(op[0] == "F" for op in schedule[0]))
        assert "hung" not in outcome, (
            f"simulate({schedule}, 1, 2) was still running after {outcome.get('hung')} s; this schedule deadlocks "
            f"({why}): when a sweep over the devices runs no op, raise an error saying what each blocked device "
            "waits for")
        assert "error" in outcome, (
            f"simulate({schedule}, 1, 2) returned {str(outcome.get('value'))[:200]}; this schedule deadlocks "
            f"({why}), so simulate should raise an error saying what each blocked device waits for")


# --- partition ---------------------------------------------------------------------------------

def _expect_partitions(submission, seed, cases):
    for costs, p, speeds in cases:
        call = f"partition({costs}, {p}{f', speeds={speeds}' if speeds else ''})"
        got = _answer(submission, seed, "partition", (costs, p, speeds))
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
def check_partition_matches_brute_force(submission, seed):
    """partition(costs, p) minimises the slowest stage (equal to trying every cut); ValueError when p > len(costs)"""
    _expect_partitions(submission, seed, queries(submission, seed)["plain_partitions"])
    (got,) = _answers(submission, seed, "partition_errors")
    assert isinstance(got, dict) and got.get("error", "").startswith("ValueError"), (
        f"partition([1, 2, 3], 4) should raise ValueError (4 non-empty stages from 3 layers), got "
        f"{got.get('error') if isinstance(got, dict) else got}")


@pytest.mark.points(1)
def check_partition_with_device_speeds(submission, seed):
    """partition(costs, p, speeds): stage i takes sum of its costs / speeds[i]; equal to trying every cut"""
    _expect_partitions(submission, seed, queries(submission, seed)["speed_partitions"])
