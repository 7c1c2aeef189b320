"""Checks for lab 11: pipeline parallelism.

Oracles (all in this file, none from solutions/):
- ``validate``: an event-driven run of a schedule that lets each device run its
  next op as soon as the op's dependencies have run; it checks that every
  (kind, microbatch, stage) op appears exactly once, on device ``stage % p``,
  and reports a deadlock as "deadlock: device 0 waits for ... while device 1
  waits for ...".
- ``simulate``: timing as a longest path through the graph whose edges are the
  dependencies (plus ``t_comm`` across devices) and each device's list order:
  an op starts when its device's previous op and its dependencies have ended.
- ``make_schedule``: the check's own GPipe, 1F1B and interleaved 1F1B, used to
  grade the student's ``simulate`` and executor apart from their ``make_schedule``.
- The closed forms, verified by tests/test_11_pipeline_parallel.py with this
  file's simulator for p = 1..5, m = 1..9 and several (t_f, t_b):
  GPipe and 1F1B take (m + p - 1)(t_f + t_b), bubble (p - 1)/(m + p - 1);
  interleaved 1F1B with v chunks per device and per-chunk times takes
  (v m + p - 1)(t_f + t_b), bubble (p - 1)/(v m + p - 1) — the bubble's time,
  (p - 1)(t_f + t_b) with per-chunk times, is 1/v of the non-interleaved one
  (relative to the ideal time v m (t_f + t_b): (p - 1)/(v m), Megatron's form).
  1F1B holds at most min(m, p - i) microbatches on device i, GPipe m.
- ``partition``: brute force over every way to cut the layers.
- The executor: single-process training of the whole float64 MLP on the
  concatenated batch with the mean loss (computed in the job, see harness.py);
  every gradient and the loss must agree to 1e-10.

The pure functions are graded in one sandboxed call for every query
(``formulas``; ``simulate`` on deadlocked schedules under a timer there, so a
simulator that loops forever costs only that check); the executor in one
``course.dist`` job per world size (2 and 4) for every case.
"""
import functools
import itertools
import math
import random

import pytest

from autograder.grading.submission import failure_from, not_implemented_yet

# --- the check's own oracles -------------------------------------------------------------


def op_text(op):
    kind, mb, stage = op
    return f"{kind}(microbatch {mb}, stage {stage})"


def dependencies(op, stages):
    """The ops ``op`` needs: F(mb, s) needs F(mb, s-1); B(mb, s) needs F(mb, s) and B(mb, s+1)."""
    kind, mb, stage = op
    if kind == "F":
        return [("F", mb, stage - 1)] if stage > 0 else []
    return [("F", mb, stage)] + ([("B", mb, stage + 1)] if stage + 1 < stages else [])


def validate(schedule, p, m, v=1):
    """None when ``schedule`` runs every op of ``m`` microbatches through ``p * v``
    stages exactly once, each on its device, without a deadlock; else what is wrong."""
    stages = p * v
    if not isinstance(schedule, (list, tuple)) or len(schedule) != p:
        return f"expected a list of {p} lists (one per device), got {str(schedule)[:120]}"
    where = {}
    for d, ops in enumerate(schedule):
        if not isinstance(ops, (list, tuple)):
            return f"schedule[{d}] should be a list of ops, got {ops!r}"
        for op in ops:
            if not (isinstance(op, (list, tuple)) and len(op) == 3 and op[0] in ("F", "B")
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in op[1:])
                    and 0 <= op[1] < m and 0 <= op[2] < stages):
                return (f"device {d} has {op!r}, which is not an op (kind, microbatch, stage) with kind 'F' or "
                        f"'B', microbatch in 0..{m - 1} and stage in 0..{stages - 1}")
            op = tuple(op)
            if op in where:
                return f"{op_text(op)} is run twice (on devices {where[op]} and {d})"
            if op[2] % p != d:
                return f"{op_text(op)} is on device {d}, but stage {op[2]} lives on device {op[2] % p}"
            where[op] = d
    missing = [(k, mb, s) for k in "FB" for mb in range(m) for s in range(stages) if (k, mb, s) not in where]
    if missing:
        return f"{len(missing)} ops are never run, e.g. {op_text(missing[0])}"
    done, position = set(), [0] * p
    while any(position[d] < len(schedule[d]) for d in range(p)):
        progressed = False
        for d in range(p):
            while position[d] < len(schedule[d]) and all(
                    need in done for need in dependencies(tuple(schedule[d][position[d]]), stages)):
                done.add(tuple(schedule[d][position[d]]))
                position[d] += 1
                progressed = True
        if not progressed:
            waits = []
            for d in range(p):
                if position[d] < len(schedule[d]):
                    op = tuple(schedule[d][position[d]])
                    needs = [op_text(n) for n in dependencies(op, stages) if n not in done]
                    waits.append(f"device {d} waits for {' and '.join(needs)} before its {op_text(op)}")
            return "deadlock: " + " while ".join(waits)
    return None


def simulate(schedule, t_f, t_b, t_comm=0, stages=None):
    """The check's timing: {op: (device, start, end)}, makespan, bubble, peak in flight.
    An op starts when the previous op of its device and its dependencies have ended
    (plus ``t_comm`` for a dependency on another device): a longest path, memoised."""
    p = len(schedule)
    stages = stages or max((op[2] for ops in schedule for op in ops), default=-1) + 1
    device_of, previous = {}, {}
    for d, ops in enumerate(schedule):
        for i, op in enumerate(ops):
            device_of[tuple(op)] = d
            previous[tuple(op)] = tuple(ops[i - 1]) if i else None
    end = {}

    def finish(op, visiting=()):
        if op not in end:
            if op in visiting:
                raise RuntimeError(f"deadlock around {op_text(op)}")
            before = [previous[op]] if previous[op] else []
            ready = [finish(before[0], visiting + (op,))] if before else [0.0]
            for need in dependencies(op, stages):
                hop = t_comm if device_of[need] != device_of[op] else 0
                ready.append(finish(need, visiting + (op,)) + hop)
            end[op] = max(ready) + (t_f if op[0] == "F" else t_b)
        return end[op]

    timing = {op: (device_of[op], finish(op) - (t_f if op[0] == "F" else t_b), finish(op)) for op in device_of}
    makespan = max((e for _, _, e in timing.values()), default=0)
    busy = sum(e - s for _, s, e in timing.values())
    peaks = []
    for ops in schedule:  # one op at a time per device: the count changes only between ops
        held = peak = 0
        for op in ops:
            held += 1 if op[0] == "F" else -1
            peak = max(peak, held)
        peaks.append(peak)
    bubble = 1 - busy / (p * makespan) if makespan else 0  # an empty schedule: nothing runs, nobody waits
    return {"timing": timing, "makespan": makespan, "bubble": bubble, "peak_in_flight": peaks}


def make_schedule(p, m, kind, v=1):
    """The check's GPipe, 1F1B (warm-up p-d-1) and Megatron interleaved 1F1B."""
    if kind == "gpipe":
        return [[("F", mb, d) for mb in range(m)] + [("B", mb, d) for mb in range(m)] for d in range(p)]
    schedule = []
    for d in range(p):
        if kind == "1f1b":
            fwd = [("F", mb, d) for mb in range(m)]
            bwd = [("B", mb, d) for mb in range(m)]
            warm = min(p - d - 1, m)
        else:  # Megatron: groups of p microbatches through chunk 0, 1, ..., v-1; backward the other way
            fwd, bwd = [], []
            for k in range(m * v):
                chunk, mb = (k // p) % v, (k // (p * v)) * p + k % p
                fwd.append(("F", mb, chunk * p + d))
                bwd.append(("B", mb, (v - 1 - chunk) * p + d))
            warm = min(2 * (p - d - 1) + (v - 1) * p, m * v)
        steady = len(fwd) - warm
        ops = list(fwd[:warm])
        for i in range(steady):
            ops += [fwd[warm + i], bwd[i]]
        schedule.append(ops + bwd[steady:])
    return schedule


def closed_form(p, m, t_f, t_b, v=1):
    """(makespan, bubble) of GPipe/1F1B (v = 1) and interleaved 1F1B (per-chunk times)."""
    return (v * m + p - 1) * (t_f + t_b), (p - 1) / (v * m + p - 1)


def random_schedule(rng, p, m, v):
    """A valid schedule: a random order in which every op runs after its dependencies,
    cut into the devices' lists."""
    stages, schedule, done = p * v, [[] for _ in range(p)], set()
    todo = {(k, mb, s) for k in "FB" for mb in range(m) for s in range(stages)}
    while todo:
        op = rng.choice(sorted(o for o in todo if all(n in done for n in dependencies(o, stages))))
        todo.remove(op)
        done.add(op)
        schedule[op[2] % p].append(op)
    return schedule


def stage_time(costs, lo, hi, speed):
    return sum(costs[lo:hi]) / speed


def bottleneck(costs, bounds, speeds):
    return max(stage_time(costs, a, b, s) for a, b, s in zip(bounds[:-1], bounds[1:], speeds))


def brute_force_partition(costs, p, speeds=None):
    """The smallest bottleneck over every cut of ``costs`` into ``p`` non-empty stages."""
    speeds = speeds or [1.0] * p
    n = len(costs)
    return min(bottleneck(costs, [0, *cuts, n], speeds) for cuts in itertools.combinations(range(1, n), p - 1))


# --- the queries, one sandboxed call for all ------------------------------------------------

# (p, m): m < p, m % p != 0, one stage (p = 1), one microbatch (m = 1) and both
BLOCKING = [(4, 4), (2, 1), (2, 5), (3, 2), (4, 7), (3, 9), (5, 3), (1, 3), (1, 1)]
INTERLEAVED = [(2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (3, 6, 3), (3, 3, 2), (1, 2, 2)]  # (p, m, v), m % p == 0
TIMES = [(1, 2), (1, 1), (3, 1), (2, 5), (0.4, 1.3)]  # integers and fractions (a clock in whole steps is wrong)
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
        cases.append((random_schedule(rng, p, m, v), rng.choice([1, 0.5, 2]), rng.choice([1, 1.5, 2, 3]),
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
    sims = [(make_schedule(p, m, kind), tf, tb, 0) for p, m in BLOCKING for kind in ("gpipe", "1f1b")
            for tf, tb in TIMES]
    sims += [(make_schedule(p, m, "interleaved", v), tf, tb, 0) for p, m, v in INTERLEAVED for tf, tb in TIMES]
    sims += _random_cases()
    return {"make_schedule": schedules, "make_schedule_errors": SCHEDULE_ERRORS, "simulate": sims,
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
def check_schedules_take_the_closed_form_time(submission):
    """Your GPipe and 1F1B take (m+p-1)(t_f+t_b), interleaved (vm+p-1)(t_f+t_b) (timed by the check's simulator)"""
    cases = [(p, m, kind, 1) for p, m in BLOCKING for kind in ("gpipe", "1f1b")]
    cases += [(p, m, "interleaved", v) for p, m, v in INTERLEAVED]
    for p, m, kind, v in cases:
        schedule = _schedule(submission, p, m, kind, v)
        if validate(schedule, p, m, v) is not None:
            raise AssertionError(f"make_schedule({p}, {m}, {kind!r}, v={v}) is not a valid schedule "
                                 "(see the validity checks)")
        for t_f, t_b in TIMES:
            got = simulate(schedule, t_f, t_b, stages=p * v)["makespan"]
            want, _ = closed_form(p, m, t_f, t_b, v)
            assert math.isclose(got, want), (
                f"make_schedule({p}, {m}, {kind!r}, v={v}) with t_f={t_f}, t_b={t_b} takes {got:g}, expected "
                f"{want:g} = ({v}*{m} + {p} - 1)(t_f + t_b): a device waits longer than it must")


@pytest.mark.points(1)
def check_1f1b_holds_fewer_microbatches_in_flight(submission):
    """1F1B holds at most min(m, p-i) microbatches in flight on device i; GPipe holds all m"""
    for p, m in BLOCKING:
        for kind, want in (("1f1b", [min(m, p - i) for i in range(p)]), ("gpipe", [m] * p)):
            schedule = _schedule(submission, p, m, kind)
            if validate(schedule, p, m) is not None:
                raise AssertionError(f"make_schedule({p}, {m}, {kind!r}) is not a valid schedule "
                                     "(see the validity checks)")
            got = simulate(schedule, 1, 2, stages=p)["peak_in_flight"]
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
def check_simulate_reproduces_closed_forms(submission):
    """simulate on GPipe/1F1B: makespan (m+p-1)(t_f+t_b), bubble (p-1)/(m+p-1); interleaved: vm in place of m"""
    cases = [(p, m, kind, 1) for p, m in BLOCKING for kind in ("gpipe", "1f1b")]
    cases += [(p, m, "interleaved", v) for p, m, v in INTERLEAVED]
    for p, m, kind, v in cases:
        for t_f, t_b in TIMES:
            got = _simulated(submission, make_schedule(p, m, kind, v), t_f, t_b, 0)
            makespan, bubble = closed_form(p, m, t_f, t_b, v)
            what = f"simulate({kind} schedule, p={p}, m={m}{f', v={v}' if v > 1 else ''}, t_f={t_f}, t_b={t_b})"
            assert math.isclose(_number(got["makespan"], what + "['makespan']"), makespan), (
                f"{what}['makespan'] = {got['makespan']}, expected ({v}*{m} + {p} - 1)({t_f} + {t_b}) = {makespan}")
            assert math.isclose(_number(got["bubble"], what + "['bubble']"), bubble, abs_tol=1e-12), (
                f"{what}['bubble'] = {got['bubble']}, expected ({p} - 1)/({v}*{m} + {p} - 1) = {bubble:.6g} "
                "(idle time / (p * makespan))")


@pytest.mark.points(2)
def check_simulate_matches_the_check_on_random_schedules(submission):
    """simulate's timeline, makespan, bubble, peak in flight equal the check's on random (t_comm > 0) and empty schedules"""
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
        want = simulate(schedule, t_f, t_b, t_comm)
        timeline = got["timeline"]
        if not isinstance(timeline, list) or not all(isinstance(e, (list, tuple)) and len(e) == 6 for e in timeline):
            raise AssertionError(f"{what}['timeline'] should be a list of (device, kind, microbatch, stage, start, "
                                 f"end), got {str(timeline)[:200]}")
        entries = {(e[1], e[2], e[3]): (e[0], e[4], e[5]) for e in timeline}
        assert len(entries) == len(timeline) == len(want["timing"]), (
            f"{what}: the timeline has {len(timeline)} entries ({len(entries)} different ops), expected one per "
            f"op: {len(want['timing'])}")
        for op, (device, start, end) in sorted(want["timing"].items(), key=lambda item: item[1][1]):
            found = entries.get(op)
            assert found is not None, f"{what}: {op_text(op)} is missing from the timeline"
            assert found[0] == device and math.isclose(found[1], start, abs_tol=1e-9) and math.isclose(
                found[2], end, abs_tol=1e-9), (
                f"{what}: {op_text(op)} runs on device {found[0]} from {found[1]:g} to {found[2]:g}, expected "
                f"device {device} from {start:g} to {end:g} (as soon as its device is free and its dependencies "
                f"have ended, + t_comm for one on another device)")
        assert math.isclose(_number(got["makespan"], what), want["makespan"]), (
            f"{what}['makespan'] = {got['makespan']}, expected {want['makespan']:g}")
        assert math.isclose(_number(got["bubble"], what), want["bubble"], abs_tol=1e-9), (
            f"{what}['bubble'] = {got['bubble']}, expected {want['bubble']:.6g}")
        assert list(got["peak_in_flight"]) == want["peak_in_flight"], (
            f"{what}['peak_in_flight'] = {got['peak_in_flight']}, expected {want['peak_in_flight']}")




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
        want = brute_force_partition(costs, p, speeds)
        slowest = bottleneck(costs, list(got), speeds or [1.0] * p)
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
EXECUTOR_CASES = ("gpipe", "1f1b")
TOLERANCE = 1e-10


def executor_cases(n, names=EXECUTOR_CASES):
    """(name, the check's op lists) for each case on ``n`` ranks: plain data for the job."""
    return [(kind, make_schedule(n, MICROBATCHES, kind)) for kind in names]


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


def _expect_single_process(submission, name):
    for n, outcome in _executor_outcomes(submission, name).items():
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


@pytest.mark.points(2)
def check_executor_gpipe_matches_single_process(submission):
    """run_pipeline with GPipe ops: every gradient and the loss equal single-process training (2 and 4 ranks)"""
    _expect_single_process(submission, "gpipe")


@pytest.mark.points(2)
def check_executor_1f1b_matches_single_process(submission):
    """run_pipeline with 1F1B ops: every gradient and the loss equal single-process training (2 and 4 ranks)"""
    _expect_single_process(submission, "1f1b")
