"""Lab 11's hidden checks: not in the student repository (lab.toml's ``hidden``),
graded wherever the instructor grades (``k2c grade``, ``grade-class``, Gradescope, CI).

They need the grader's own schedules and simulator (``oracles_hidden.py``), which
compute what the lab's ``make_schedule`` and ``simulate`` return:

- the student's GPipe, 1F1B and interleaved schedules, timed by the grader's
  simulator, take the closed-form time (a valid schedule can still wait longer
  than it must: a warm-up cut short, a cool-down in the wrong order);
- the student's ``simulate`` on the grader's own GPipe, 1F1B and interleaved
  schedules gives the closed-form makespan and bubble, for integer and
  fractional times.

The cases are the public checks' (p, m) and (p, m, v), drawn from the grading's
secret seed. The student's schedules come from the public checks' sandboxed call;
the simulations of the grader's schedules from a second one (the same harness).
"""
import math

import pytest

from autograder.grading.checking import load_beside
from autograder.grading.submission import not_implemented_yet

public = load_beside(__file__, "check_pipeline")
hidden = load_beside(__file__, "oracles_hidden")
oracles = public.oracles

TIMES = [(1, 2), (1, 1), (3, 1), (2, 5), (0.4, 1.3)]  # integers and fractions (a clock in whole steps is wrong)


def _cases(seed):
    cases = [(p, m, kind, 1) for p, m in public.blocking(seed) for kind in ("gpipe", "1f1b")]
    return cases + [(p, m, "interleaved", v) for p, m, v in public.interleaved(seed)]


def _queries(seed):
    sims = [(hidden.make_schedule(p, m, kind, v), t_f, t_b, 0) for p, m, kind, v in _cases(seed) for t_f, t_b in TIMES]
    return {"make_schedule": [], "make_schedule_errors": [], "simulate": sims, "partition": [],
            "partition_errors": [], "simulate_deadlocks": []}


def _simulated(submission, seed, index):
    got = submission.harness_once("formulas_hidden", "formulas", _queries(seed))["simulate"]
    if isinstance(got, dict) and "not_implemented" in got:
        raise not_implemented_yet(got["not_implemented"])
    got = got[index]
    if isinstance(got, dict) and "error" in got:
        raise AssertionError(f"{got['call']} raised {got['error']}")
    if not isinstance(got, dict) or not {"timeline", "makespan", "bubble", "peak_in_flight"} <= set(got):
        raise AssertionError(f"simulate returned {str(got)[:200]}; expected a dict with keys 'timeline', "
                             "'makespan', 'bubble' and 'peak_in_flight'")
    return got


@pytest.mark.points(1)
def check_schedules_take_the_closed_form_time(submission, seed):
    """Your GPipe and 1F1B take (m+p-1)(t_f+t_b), interleaved (vm+p-1)(t_f+t_b) (timed by the check's simulator)"""
    for p, m, kind, v in _cases(seed):
        schedule = public.schedule_of(submission, seed, p, m, kind, v)
        if oracles.validate(schedule, p, m, v) is not None:
            raise AssertionError(f"make_schedule({p}, {m}, {kind!r}, v={v}) is not a valid schedule "
                                 "(see the validity checks)")
        for t_f, t_b in TIMES:
            got = hidden.simulate(schedule, t_f, t_b, stages=p * v)["makespan"]
            want, _ = oracles.closed_form(p, m, t_f, t_b, v)
            assert math.isclose(got, want), (
                f"make_schedule({p}, {m}, {kind!r}, v={v}) with t_f={t_f}, t_b={t_b} takes {got:g}, expected "
                f"{want:g} = ({v}*{m} + {p} - 1)(t_f + t_b): a device waits longer than it must")


@pytest.mark.points(2)
def check_simulate_reproduces_closed_forms(submission, seed):
    """simulate on GPipe/1F1B: makespan (m+p-1)(t_f+t_b), bubble (p-1)/(m+p-1); interleaved: vm in place of m"""
    index = 0
    for p, m, kind, v in _cases(seed):
        for t_f, t_b in TIMES:
            got = _simulated(submission, seed, index)
            index += 1
            makespan, bubble = oracles.closed_form(p, m, t_f, t_b, v)
            what = f"simulate({kind} schedule, p={p}, m={m}{f', v={v}' if v > 1 else ''}, t_f={t_f}, t_b={t_b})"
            assert math.isclose(public.number(got["makespan"], what + "['makespan']"), makespan), (
                f"{what}['makespan'] = {got['makespan']}, expected ({v}*{m} + {p} - 1)({t_f} + {t_b}) = {makespan}")
            assert math.isclose(public.number(got["bubble"], what + "['bubble']"), bubble, abs_tol=1e-12), (
                f"{what}['bubble'] = {got['bubble']}, expected ({p} - 1)/({v}*{m} + {p} - 1) = {bubble:.6g} "
                "(idle time / (p * makespan))")
