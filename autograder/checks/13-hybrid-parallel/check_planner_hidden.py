"""Lab 13's hidden planner checks: not in the student repository (lab.toml's
``hidden``), graded wherever the instructor grades (``k2c grade``, ``grade-class``,
Gradescope, CI).

They need the grader's cost model and exhaustive search (``oracles_hidden.py``),
which compute what ``cost_model`` and ``search`` return:

- ``cost_model`` on 30 random plans (1-6 layers, 1-16 devices, one or two
  speeds, odd sizes) against the oracle's step time and every stage's memory;
- ``search`` on cases the public checks do not hold (other models and budgets,
  every budget binding): a valid plan that fits by the oracle's memory, in the
  oracle's best time.

Each kind in one sandboxed call of its own (harness.planner_answers), beside the
public checks' two.
"""
import functools
import math
import random

import pytest

from autograder.grading.checking import load_beside
from autograder.grading.submission import not_implemented_yet

public = load_beside(__file__, "check_planner")
oracles = load_beside(__file__, "oracles_hidden")
gpt, plan, cluster, REL = public.gpt, public.plan, public.cluster, public.REL
ONE, PAIR, NODE, TWO_SPEEDS, TWO_NODES = public.ONE, public.PAIR, public.NODE, public.TWO_SPEEDS, public.TWO_NODES


def _random_cases(count=30, seed=1313):
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        model = gpt(layers=rng.randint(1, 6), hidden=rng.choice([256, 1024, 2048]), heads=rng.choice([4, 8, 16]),
                    seq=rng.choice([128, 1000, 2048]), batch=rng.choice([3, 8, 12]), vocab=rng.choice([1000, 50257]),
                    dropout=rng.choice([0.0, 0.1]), precision=rng.choice(["fp32", "mixed"]),
                    optimizer=rng.choice(["adam", "sgd", "sgd_momentum"]))
        where = rng.choice([ONE, PAIR, NODE, TWO_SPEEDS, TWO_NODES])
        shapes = list(oracles.shapes(model, sum(n["devices"] for n in where["nodes"])))
        if not shapes:
            continue
        dp, tp, pp, m = rng.choice(shapes)
        cut = rng.choice(list(oracles.compositions(model["layers"], pp)))
        kinds = [rng.choice(oracles.STRATEGIES) for _ in range(model["layers"])]
        cases.append((f"random plan {len(cases)}", plan(dp, tp, pp, m, cut, kinds, zero=rng.randint(0, 3),
                                                         schedule=rng.choice(["1f1b", "gpipe"])), model, where))
    return cases


RANDOM = _random_cases()
# (name, model, cluster, budget, limit in seconds): every budget binds (the best plan without it is faster).
SEARCHES = [
    ("8 devices, 6 layers of h = 2048, 1.5e9 B", gpt(layers=6, hidden=2048, heads=16, batch=8), NODE, 1.5e9,
     public.SMALL),
    ("16 devices, 5 layers, 2.2e9 B", gpt(layers=5, batch=16), TWO_NODES, 2.2e9, public.SMALL),
    ("two speeds, 5 layers, 1.2e9 B", gpt(layers=5, hidden=2048, heads=16), TWO_SPEEDS, 1.2e9, public.SMALL),
    ("3 layers on 2 devices, 6e9 B", gpt(layers=3, hidden=2048, heads=16, seq=4096, batch=4, vocab=32000), PAIR, 6e9,
     public.SMALL),
]


@functools.lru_cache(maxsize=None)
def _queries():
    return {"cost_model": [case[1:] for case in RANDOM], "search": [case[1:] for case in SEARCHES]}


def _answers(submission, kind):
    queries = {"cost_model": [], "search": [], kind: _queries()[kind]}
    got = submission.harness_once(("planner_hidden", kind), "planner_answers", queries)[kind]
    if isinstance(got, dict) and "not_implemented" in got:
        raise not_implemented_yet(got["not_implemented"])
    return got


@pytest.mark.points(2)
def check_cost_model_on_random_plans(submission):
    """30 random plans (1-6 layers, 1-16 devices, one or two speeds, odd sizes): step time, every stage's memory"""
    for (name, p, model, where), answer in zip(RANDOM, _answers(submission, "cost_model")):
        assert "error" not in answer, f"cost_model on the case '{name}' raised {answer['error']}"
        value = answer["value"]
        want = oracles.cost(p, model, where)
        assert math.isclose(value["time"], want["time"], rel_tol=REL), (
            f"{name} ({p}): time {value['time']}, expected {want['time']:.10g}")
        for j, (st, w) in enumerate(zip(value["stages"], want["stages"])):
            assert math.isclose(st["memory"], w["memory"], rel_tol=REL), (
                f"{name} ({p}): stage {j}'s memory {st['memory']}, expected {w['memory']:.10g}")


@pytest.mark.points(2)
def check_search_matches_brute_force_on_more_cases(submission):
    """search on models and budgets the public checks do not try: a plan that fits, in the exhaustive search's best time"""
    for (name, model, where, budget, _), answers in zip(SEARCHES, _answers(submission, "search")):
        if isinstance(answers, dict):  # a stub
            raise not_implemented_yet(answers["not_implemented"])
        answer = answers[0]
        if "hung" in answer:
            raise AssertionError(f"search on '{name}' ran past its limit of {answer['hung']} s")
        assert "error" not in answer, f"search on '{name}' raised {answer['error']}"
        got = answer["value"]
        problem = oracles.problem_with(got, model, where)
        assert problem is None, f"search on '{name}' returned an invalid plan: {problem}"
        assert oracles.fits(got, model, where, budget), (
            f"search on '{name}' returned a plan that does not fit in {budget:.4g} bytes per device, and in "
            f"no more than each device's own memory: {got}")
        best_time, best = oracles.best_plan(model, where, budget)
        time = oracles.cost(got, model, where)["time"]
        assert time <= best_time * (1 + REL), (
            f"search on '{name}' returned a plan taking {time:.6g} s per step, but {best} takes {best_time:.6g} s")
