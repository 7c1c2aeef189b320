"""Lab 13's hidden planner checks: not in the student repository (lab.toml's
``hidden``), graded wherever the instructor grades (``k2c grade``, ``grade-class``,
Gradescope).

They need the grader's cost model and exhaustive search (``oracles_hidden.py``),
which compute what ``cost_model`` and ``search`` return, and every case is drawn
from the grading's secret seed:

- ``cost_model`` on 30 random plans (1-6 layers, 1-16 devices, one or two
  speeds, odd sizes) against the oracle's step time and every stage's memory;
  ten of them each exercise one term of the model (``TERMS``) whatever the seed;
- ``search`` on four more models, one on each cluster (8 devices, 16 on two
  nodes, two speeds, 2 devices), each with a budget that binds: a valid plan
  that fits by the oracle's memory, in the oracle's best time.

Each kind in one sandboxed call of its own (harness.planner_answers), beside the
public checks' two.
"""
import math

import pytest

from autograder.grading import seeds
from autograder.grading.checking import load_beside
from autograder.grading.submission import not_implemented_yet

cases = load_beside(__file__, "planner_cases")
oracles = load_beside(__file__, "oracles_hidden")
gpt, plan, REL = cases.gpt, cases.plan, 1e-9
DRAWN = "drawn from this grading's seed"
CLUSTERS = {"8 devices": cases.NODE, "16 devices": cases.TWO_NODES, "two speeds": cases.TWO_SPEEDS,
            "2 devices": cases.PAIR}


# Ten of the random plans each exercise one term of the model, whatever the seed: (what, clusters,
# which (dp, tp, pp, m) may be drawn, what else the plan or model must have).
TERMS = [
    ("one stage, replicated", (cases.NODE,), lambda dp, tp, pp, m: pp == 1 and dp > 1, {}),
    ("1F1B with fewer microbatches than stages", (cases.NODE,), lambda dp, tp, pp, m: m < pp, {"schedule": "1f1b"}),
    ("a selective layer with dropout", (cases.NODE, cases.PAIR), lambda *shape: True,
     {"selective": True, "dropout": 0.1}),
    ("tensor parallel over several layers", (cases.NODE,), lambda dp, tp, pp, m: tp > 1 and pp == 1, {}),
    ("data parallel across nodes", (cases.TWO_NODES,), lambda dp, tp, pp, m: pp == 1 and dp > 1, {}),
    ("ZeRO-3 with accumulation", (cases.NODE, cases.TWO_NODES), lambda dp, tp, pp, m: dp > 1 and m > 1, {"zero": 3}),
    ("ZeRO over replicas", (cases.NODE,), lambda dp, tp, pp, m: dp > 1, {"zero": (1, 2, 3)}),
    ("a pipeline of microbatches", (cases.NODE,), lambda dp, tp, pp, m: pp > 1 and m > 1, {}),
    ("a stage on both speeds", (cases.TWO_SPEEDS,), lambda dp, tp, pp, m: pp == 1, {}),
    ("stages that each all-reduce", (cases.NODE,), lambda dp, tp, pp, m: pp > 1 and dp > 1, {}),
]


def _random_plan(rng, clusters=None, keep=None, need=None):
    """(plan, model, cluster): a random valid plan (at least 2 layers where its shape is kept by
    ``keep``), with ``need``'s extras."""
    pick, need = cases.pick, need or {}
    while True:
        model = gpt(layers=int(rng.integers(1 if keep is None else 2, 7)), hidden=pick(rng, [256, 1024, 2048]),
                    heads=pick(rng, [4, 8, 16]), seq=pick(rng, [128, 1000, 2048]), batch=pick(rng, [3, 8, 12]),
                    vocab=pick(rng, [1000, 50257]), dropout=need.get("dropout", pick(rng, [0.0, 0.1])),
                    precision=pick(rng, ["fp32", "mixed"]), optimizer=pick(rng, ["adam", "sgd", "sgd_momentum"]))
        where = pick(rng, clusters or [cases.ONE, cases.PAIR, cases.NODE, cases.TWO_SPEEDS, cases.TWO_NODES])
        shapes = [s for s in oracles.shapes(model, sum(n["devices"] for n in where["nodes"]))
                  if keep is None or keep(*s)]
        if shapes:
            break
    dp, tp, pp, m = pick(rng, shapes)
    kinds = cases.any_strategies(rng, model["layers"])
    if need.get("selective"):
        kinds[int(rng.integers(len(kinds)))] = "selective"
    zero = need.get("zero", (0, 1, 2, 3))
    p = plan(dp, tp, pp, m, cases.any_cut(rng, model["layers"], pp), kinds,
             zero=zero if isinstance(zero, int) else pick(rng, list(zero)),
             schedule=need.get("schedule", pick(rng, ["1f1b", "gpipe"])))
    return p, model, where


def _random_plans(seed, count=30):
    found = []
    for what, clusters, keep, need in TERMS:
        p, model, where = _random_plan(seeds.rng(seed, "13", "random plans", what), clusters, keep, need)
        found.append((f"random plan {len(found)}, {what} ({DRAWN})", p, model, where))
    rng = seeds.rng(seed, "13", "random plans")
    while len(found) < count:
        p, model, where = _random_plan(rng)
        found.append((f"random plan {len(found)} ({DRAWN})", p, model, where))
    return found


def _searches(seed):
    """(name, model, cluster, budget, limit): one model on each cluster, its budget binding."""
    def model(rng):
        return gpt(layers=int(rng.integers(3, 7)), hidden=cases.pick(rng, [1024, 2048, 4096]), heads=16,
                   seq=cases.pick(rng, [1024, 2048, 4096]), batch=cases.pick(rng, [4, 8, 16]), vocab=32000)

    return [case for label, where in CLUSTERS.items()
            for case in cases.drawn_search(oracles, seeds.rng(seed, "13", "hidden search", label), f"{label}, {DRAWN}",
                                           model, where, 1)]


def _answers(submission, seed, kind):
    def ask():
        listed = _random_plans(seed) if kind == "cost_model" else _searches(seed)
        queries = {"cost_model": [], "search": [], kind: [case[1:] for case in listed]}
        got = submission.harness("planner_answers", queries)[kind]
        if isinstance(got, dict) and "not_implemented" in got:
            raise not_implemented_yet(got["not_implemented"])
        return list(zip(listed, got))
    return submission.once(("planner_hidden", kind, seed), ask)


@pytest.mark.points(2)
def check_cost_model_on_random_plans(submission, seed):
    """30 random plans (1-6 layers, 1-16 devices, one or two speeds, odd sizes): step time, every stage's memory"""
    for (name, p, model, where), answer in _answers(submission, seed, "cost_model"):
        assert "error" not in answer, f"cost_model on the case '{name}' ({p}, {model}) raised {answer['error']}"
        value = answer["value"]
        want = oracles.cost(p, model, where)
        assert isinstance(value, dict) and math.isclose(value.get("time", math.nan), want["time"], rel_tol=REL), (
            f"{name} ({p}, {model}): time {value.get('time') if isinstance(value, dict) else value}, expected "
            f"{want['time']:.10g}")
        stages = value.get("stages")
        assert isinstance(stages, list) and len(stages) == len(want["stages"]), (
            f"{name} ({p}): {len(want['stages'])} stages expected, got {str(stages)[:200]}")
        for j, (st, w) in enumerate(zip(stages, want["stages"])):
            assert math.isclose(st.get("memory", math.nan), w["memory"], rel_tol=REL), (
                f"{name} ({p}, {model}): stage {j}'s memory {st.get('memory')}, expected {w['memory']:.10g}")


@pytest.mark.points(2)
def check_search_matches_brute_force_on_more_cases(submission, seed):
    """search on four more models and budgets drawn from the seed: a plan that fits, in the exhaustive best time"""
    for (name, model, where, budget, _), answers in _answers(submission, seed, "search"):
        if isinstance(answers, dict):  # a stub
            raise not_implemented_yet(answers["not_implemented"])
        answer = answers[0]
        if "hung" in answer:
            raise AssertionError(f"search on '{name}' ran past its limit of {answer['hung']} s")
        assert "error" not in answer, f"search on '{name}' ({model}) raised {answer['error']}"
        got = answer["value"]
        problem = oracles.problem_with(got, model, where)
        assert problem is None, f"search on '{name}' returned an invalid plan: {problem}"
        assert oracles.fits(got, model, where, budget), (
            f"search on '{name}' ({model}) returned a plan that does not fit in {budget:.4g} bytes per device, and "
            f"in no more than each device's own memory: {got}")
        best_time, best = oracles.best_plan(model, where, budget)
        time = oracles.cost(got, model, where)["time"]
        assert time <= best_time * (1 + REL), (
            f"search on '{name}' ({model}) returned a plan taking {time:.6g} s per step, but {best} takes "
            f"{best_time:.6g} s")
