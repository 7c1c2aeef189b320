"""Checks for lab 13's planner: the cost model and the search.

Every check grades two sets of cases of its kind (``planner_cases.py``):

- the public cases, fixed, against a table of their answers (``expected.json``:
  the grader's cost model from its closed forms, module 07's activations and
  parameter count, the ZeRO table, the ring all-reduce, Alpa's pipeline time,
  and its exhaustive search). A student's own grading grades these, and only
  these: the oracles that compute the answers would hand them to the student's
  code, so they are hidden (``oracles_hidden.py``, not in the student repository
  ``k2c release`` writes, nor in ``k2c ci``'s wheel);
- where those hidden oracles are (the instructor's ``k2c grade``, ``grade-class``,
  Gradescope), as many again drawn from the grading's secret seed, each compared
  with the hidden oracles' own answer, computed here. A table of the public cases
  answers none of them. The invalid plans are drawn everywhere: what makes a plan
  invalid is public.

Each check's report says how many of each it graded (``public cases``,
``drawn cases``). All cost_model queries go to the student's code in one
sandboxed call (harness.planner_answers), all search queries in another; each
search runs under its own time limit. Costs are compared to 1e-9 relative. A
search is right when its plan is valid (``oracles.problem_with``), fits, and
takes the best time (to 1e-9; on 32 devices within 2 %): on a public case timed
and sized by the student's own ``cost_model`` (its checks say whether that is
right) against the table; on a drawn case by the hidden cost model, against the
exhaustive search.

The hidden checks (``check_planner_hidden.py``) run the cost model on 30 random
plans and the search on four more drawn cases.
"""
import json
import math
from pathlib import Path

import pytest

from autograder.grading.checking import load_beside, load_hidden_beside
from autograder.grading.submission import not_implemented_yet

cases = load_beside(__file__, "planner_cases")
oracles = cases.oracles
hidden = load_hidden_beside(__file__, "oracles_hidden")  # None in the student repository
# What the hidden oracles answer for the public cases: {"cost": {case: cost}, "search": {case: best}}.
EXPECTED = json.loads(Path(__file__).with_name("expected.json").read_text())
REL = 1e-9
NOT_HERE = "not graded here (the instructor's grader draws them, and holds their answers)"


def _cost_answer(got):
    """The fields the table holds of a cost (the hidden cost model's, for a drawn case)."""
    return {**{k: got[k] for k in ("time", "pipeline", "bubble", "memory")},
            "stages": [{k: st[k] for k in cases.STAGE_FIELDS} for st in got["stages"]]}


SEARCH_KINDS = ("8 devices", "16 devices", "6 layers", "two speeds", "1 device", "nothing fits", "32 devices",
                "64 devices")  # the start of each public search case's name


def graded_costs(submission, seed):
    """This grading's cost_model cases, once: {"cases": {kind: [case]}, "want": {name: expected
    cost}, "drawn": {names}}."""
    def draw():
        found, want, drawn = {kind: list(group) for kind, group in cases.COST.items()}, dict(EXPECTED["cost"]), set()
        for kind, group in cases.drawn_costs(seed).items():
            if hidden or kind == "invalid":  # what makes a plan invalid is public
                found[kind] += group
                drawn.update(name for name, *_ in group)
                want.update({name: _cost_answer(hidden.cost(*rest)) for name, *rest in group if kind != "invalid"})
        return {"cases": found, "want": want, "drawn": drawn}
    return submission.once(("planner cost cases", seed), draw)


def graded_searches(submission, seed):
    """This grading's search cases, once: {"cases": {kind: [case]}, "best": {name: {"time",
    "plan"}}, "drawn": {names}}."""
    def draw():
        found = {kind: [case for case in cases.SEARCHES if case[0].startswith(kind)] for kind in SEARCH_KINDS}
        best, drawn = dict(EXPECTED["search"]), set()
        for kind, group in (cases.drawn_searches(seed, hidden) if hidden else {}).items():
            found[kind] += group
            drawn.update(name for name, *_ in group)
            for name, model, where, budget, _ in group:
                time, plan = hidden.best_plan(model, where, budget)
                best[name] = {"time": time, "plan": plan}
        return {"cases": found, "best": best, "drawn": drawn}
    return submission.once(("planner search cases", seed), draw)


def _answers(submission, seed, kind):
    """{case name: answer} of every ``kind`` query ("cost_model" or "search"), in one sandboxed call
    per kind: grading the cost model alone runs no search."""
    def ask():
        found = (graded_costs if kind == "cost_model" else graded_searches)(submission, seed)["cases"]
        listed = [case for group in found.values() for case in group]
        queries = {"cost_model": [], "search": [], kind: [case[1:] for case in listed]}
        got = submission.harness("planner_answers", queries)[kind]
        if isinstance(got, dict) and "not_implemented" in got:
            raise not_implemented_yet(got["not_implemented"])
        return dict(zip((case[0] for case in listed), got))
    return submission.once(("planner answers", kind, seed), ask)


def _where(graded, name):
    return " (a case drawn from this grading's seed)" if name in graded["drawn"] else " (a public case)"


def _count(metrics, graded, found):
    """Note in the check's report how many public and drawn cases it graded."""
    drawn = sum(case[0] in graded["drawn"] for case in found)
    metrics.update({"public cases": len(found) - drawn, "drawn cases": drawn if hidden or drawn else NOT_HERE})


def _costs(submission, seed, kind, metrics):
    """[(name, plan, model, cluster, the student's cost, the expected cost)] of a kind's cases."""
    graded = graded_costs(submission, seed)
    found = graded["cases"][kind]
    _count(metrics, graded, found)
    answers = _answers(submission, seed, "cost_model")
    out = []
    for name, plan, model, where in found:
        answer, origin = answers[name], _where(graded, name)
        assert "error" not in answer, f"cost_model on the case '{name}'{origin} raised {answer['error']}"
        value = answer["value"]
        assert isinstance(value, dict), f"cost_model on '{name}'{origin} returned {str(value)[:200]}, not a dict"
        out.append((name, plan, model, where, value, graded["want"].get(name)))
    return out


def _expect_stage_field(submission, seed, kind, field, why, metrics):
    for name, plan, _, _, value, want in _costs(submission, seed, kind, metrics):
        stages, where = value.get("stages"), _where(graded_costs(submission, seed), name)
        assert isinstance(stages, list) and len(stages) == len(want["stages"]), (
            f"{name}{where}: cost_model(...)['stages'] should list {len(want['stages'])} stages, got "
            f"{str(stages)[:200]}")
        for j, (st, w) in enumerate(zip(stages, want["stages"])):
            got = st.get(field, math.nan) if isinstance(st, dict) else math.nan
            assert isinstance(got, (int, float)) and math.isclose(got, w[field], rel_tol=REL, abs_tol=1e-15), (
                f"{name}{where}, plan {plan}: stage {j}'s {field} is {got}, expected {w[field]:.10g} ({why})")


# --- the cost model --------------------------------------------------------------------------

@pytest.mark.points(2)
def check_memory_matches_module_07_estimator(submission, seed, metrics):
    """On one device with one microbatch, the peak memory is module 07's estimate (none and full recomputation)"""
    for name, _, model, _, value, want in _costs(submission, seed, "module 07", metrics):
        where = _where(graded_costs(submission, seed), name)
        assert math.isclose(value.get("memory", math.nan), want["memory"], rel_tol=REL), (
            f"{name}{where}: memory {value.get('memory')}, expected {want['memory']} (model {model})")


@pytest.mark.points(2)
def check_memory_follows_the_zero_table(submission, seed, metrics):
    """ZeRO stages 0-3 on dp = 2 to 8: the static memory per device is the ZeRO paper's table"""
    found = _costs(submission, seed, "zero", metrics)
    by_model = {}
    for case in found:  # each model's four stages, in order
        by_model.setdefault(json.dumps(case[2:4], sort_keys=True) + str(case[1]["dp"]), []).append(case)
    for group in by_model.values():
        base_got, base_want = group[0][4].get("memory", math.nan), group[0][5]["memory"]
        for name, plan, _, _, value, want in group:
            saved, saving = base_got - value.get("memory", math.nan), base_want - want["memory"]
            assert math.isclose(saved, saving, rel_tol=1e-6, abs_tol=1.0), (
                f"{name}{_where(graded_costs(submission, seed), name)}: ZeRO-{plan['zero']} saves {saved:.6g} bytes "
                f"per device against ZeRO-0, expected {saving:.6g} (weights 2Ψ, gradients 2Ψ and state 12Ψ, divided "
                "by dp from stage 3, 2 and 1 on)")
    _expect_stage_field(submission, seed, "zero", "memory", "the ZeRO table plus the activations", metrics)


@pytest.mark.points(2)
def check_memory_holds_the_schedules_microbatches(submission, seed, metrics):
    """Per stage, activations divided by tp, times m (GPipe) or min(m, pp - j) (1F1B) microbatches in flight"""
    _expect_stage_field(submission, seed, "in flight", "memory", "GPipe holds m microbatches, 1F1B min(m, pp - j)",
                        metrics)


@pytest.mark.points(1)
def check_memory_of_recompute_strategies(submission, seed, metrics):
    """Per stage, 'selective' keeps all but the s² scores, 'full' only the input, plus one layer while recomputing"""
    _expect_stage_field(submission, seed, "recompute", "memory", "what each strategy keeps, plus one recomputed "
                        "layer", metrics)


@pytest.mark.points(2)
def check_tp_communication_is_per_layer(submission, seed, metrics):
    """TP: 4 ring all-reduces of a microbatch's activation per layer, 2 more per 'full' layer, over intra or inter"""
    _expect_stage_field(submission, seed, "tp", "tp_comm", "(4n + 2·full) · 2(t - 1)(α + β X / t)", metrics)


@pytest.mark.points(1)
def check_dp_allreduce_is_the_ring_closed_form(submission, seed, metrics):
    """DP: a ring all-reduce of the gradients over dp (m + 1/2 of them at ZeRO-3), 0 for dp = 1, inter across nodes"""
    _expect_stage_field(submission, seed, "dp", "dp_comm", "2(dp - 1)(α + β G / dp); at ZeRO-3 m + 1/2 times that: "
                        "the weights gathered for every microbatch's forward and backward", metrics)


@pytest.mark.points(2)
def check_pipeline_time_and_bubble(submission, seed, metrics):
    """The pipeline takes Σ t_j + (m - 1) max t_j and its bubble is that minus m max t_j (m = 1 and p = 1 too)"""
    for name, plan, _, _, value, want in _costs(submission, seed, "pipeline", metrics):
        where = _where(graded_costs(submission, seed), name)
        for key in ("pipeline", "bubble", "time"):
            assert math.isclose(value.get(key, math.nan), want[key], rel_tol=REL, abs_tol=1e-15), (
                f"{name}{where}: {key} is {value.get(key)}, expected {want[key]:.10g} (Σ t_j + (m - 1) max t_j; "
                "bubble: minus m max t_j)")
    _expect_stage_field(submission, seed, "pipeline", "p2p", "α + β X / tp for each send to a neighbouring stage",
                        metrics)


@pytest.mark.points(2)
def check_compute_on_heterogeneous_devices(submission, seed, metrics):
    """Compute per stage: 3× the forward flops plus recomputation, over tp × the stage's slowest device"""
    _expect_stage_field(submission, seed, "two speeds", "compute", "flops / (tp · the slowest device's speed)",
                        metrics)
    _expect_stage_field(submission, seed, "two speeds", "time", "compute + TP all-reduces + sends", metrics)


@pytest.mark.points(1)
def check_invalid_plans_raise_value_error(submission, seed, metrics):
    """cost_model raises ValueError for a plan that cannot run (device count, tp, microbatches, stages, strategy)"""
    graded = graded_costs(submission, seed)
    found = graded["cases"]["invalid"]
    _count(metrics, graded, found)
    answers = _answers(submission, seed, "cost_model")
    for name, plan, model, _ in found:
        answer = answers[name]
        got = f"raised {answer['error']}" if "error" in answer else f"returned {str(answer.get('value'))[:120]}"
        assert answer.get("error", "").startswith("ValueError"), (
            f"cost_model should raise ValueError when {name}{_where(graded, name)} ({plan}, heads "
            f"{model['heads']}, batch {model['batch']}); it {got}")


# --- the search ------------------------------------------------------------------------------

def _searches(submission, seed, kind, metrics):
    graded = graded_searches(submission, seed)
    found = graded["cases"][kind]
    _count(metrics, graded, found)
    return found


def _searched(submission, seed, name):
    """The student's plan for a search case, or the reason the check fails."""
    answer = _answers(submission, seed, "search")[name]
    if isinstance(answer, dict):  # a stub
        raise not_implemented_yet(answer["not_implemented"])
    answer = answer[0]
    if "hung" in answer:
        raise AssertionError(f"search on '{name}' ran past its limit of {answer['hung']} s")
    return answer


def _timed(answer, name):
    """The student's cost_model of the plan its search returned, in the same call (plain data)."""
    cost = answer.get("cost")
    if isinstance(cost, dict) and "not_implemented" in cost:
        raise AssertionError(f"search on '{name}' returned a plan, but cost_model is not implemented yet, and the "
                             "check times and sizes the plan with your cost_model: " + cost["not_implemented"])
    if isinstance(cost, dict) and "hung" in cost:
        raise AssertionError(f"search on '{name}' returned a plan, and your cost_model of it ran past "
                             f"{cost['hung']} s: {answer['value']}")
    if not isinstance(cost, dict) or "value" not in cost:
        raise AssertionError(f"search on '{name}' returned a plan on which your cost_model raised "
                             f"{(cost or {}).get('error')}: {answer['value']}")
    value = cost["value"]
    if not (isinstance(value, dict) and isinstance(value.get("time"), (int, float))
            and isinstance(value.get("stages"), list)):
        raise AssertionError(f"search on '{name}': your cost_model of its plan returned {str(value)[:200]}")
    return value


def _fitting_plan(submission, seed, case):
    """(the student's plan, its time): valid and fitting, on a public case by the student's own
    cost_model, on a drawn one by the grader's."""
    name, model, where, budget, _ = case
    graded = graded_searches(submission, seed)
    answer = _searched(submission, seed, name)
    assert "error" not in answer, f"search on '{name}'{_where(graded, name)} raised {answer['error']}"
    got = answer["value"]
    problem = oracles.problem_with(got, model, where)
    assert problem is None, f"search on '{name}' returned an invalid plan: {problem}"
    drawn = name in graded["drawn"]
    cost = _cost_answer(hidden.cost(got, model, where)) if drawn else _timed(answer, name)
    whose = "the grader's cost model" if drawn else "your cost_model"
    for j, (stage, cap) in enumerate(zip(cost["stages"], oracles.caps(got, where, budget))):
        memory = stage.get("memory") if isinstance(stage, dict) else None
        assert isinstance(memory, (int, float)) and memory <= cap, (
            f"search on '{name}'{_where(graded, name)} returned a plan whose stage {j} needs {memory} bytes "
            f"per device ({whose}), more than {cap:.4g}: the budget of {budget:.4g} bytes per device, and no more "
            f"than each device's own memory: {got}")
    return got, cost["time"]


def _expect_best(submission, seed, kind, metrics, within=REL):
    graded = graded_searches(submission, seed)
    for case in _searches(submission, seed, kind, metrics):
        name = case[0]
        got, time = _fitting_plan(submission, seed, case)
        best = graded["best"][name]
        assert time <= best["time"] * (1 + within), (
            f"search on '{name}'{_where(graded, name)} returned a plan taking {time:.6g} s per step, but "
            f"{best['plan']} takes {best['time']:.6g} s")
        assert time >= best["time"] * (1 - REL), (
            f"search on '{name}' returned a plan that your cost_model says takes {time:.6g} s per step, less than "
            f"the best plan's {best['time']:.6g} s ({best['plan']}): does your cost_model pass its checks?")


@pytest.mark.points(2)
def check_search_matches_brute_force_on_8_devices(submission, seed, metrics):
    """8 devices, budgets from tight to loose: the exhaustive oracle's best time, in a plan that fits"""
    _expect_best(submission, seed, "8 devices", metrics)


@pytest.mark.points(1)
def check_search_matches_brute_force_on_16_devices(submission, seed, metrics):
    """16 devices on two nodes: the exhaustive oracle's best time, in a plan that fits"""
    _expect_best(submission, seed, "16 devices", metrics)


@pytest.mark.points(2)
def check_search_chooses_a_strategy_per_layer(submission, seed, metrics):
    """4-6 layers on 2 devices, 3 strategies each, budgets where only a mix of kept and recomputed layers is fastest"""
    _expect_best(submission, seed, "6 layers", metrics)


@pytest.mark.points(2)
def check_search_with_two_device_speeds(submission, seed, metrics):
    """A fast and a slow node (3e14 and 1e14 flop/s, 80 and 40 GB): the oracle's best, fitting each device"""
    _expect_best(submission, seed, "two speeds", metrics)


@pytest.mark.points(1)
def check_search_on_one_device(submission, seed, metrics):
    """1 device, a batch of 1, a budget above the device's memory: the oracle's best, fitting the device's own memory"""
    _expect_best(submission, seed, "1 device", metrics)


@pytest.mark.points(1)
def check_search_raises_when_nothing_fits(submission, seed, metrics):
    """search raises ValueError when no plan fits in the budget (and returns one when one just fits)"""
    graded = graded_searches(submission, seed)
    for case in _searches(submission, seed, "nothing fits", metrics):
        name, budget = case[0], case[3]
        if name.startswith("just fits"):  # the least memory any plan needs: one plan fits
            _fitting_plan(submission, seed, case)
            continue
        answer = _searched(submission, seed, name)
        assert answer.get("error", "").startswith("ValueError"), (
            f"search should raise ValueError when no plan fits in {budget:.4g} bytes per device "
            f"('{name}'{_where(graded, name)}); it "
            + (f"raised {answer['error']}" if "error" in answer else f"returned {str(answer.get('value'))[:160]}"))


@pytest.mark.points(1)
def check_search_scales_to_large_clusters(submission, seed, metrics):
    """32 devices: within 2 % of the best; 64 devices, 32 layers: fits, within the limit, beats every uniform plan"""
    _expect_best(submission, seed, "32 devices", metrics, within=0.02)
    name = "64 devices, 32 layers"
    _, time = _fitting_plan(submission, seed, cases.SEARCH_BY_NAME[name])
    floor = EXPECTED["search"][name]
    assert time <= floor["time"] * (1 + REL), (
        f"search on '{name}' returned a plan taking {time:.6g} s per step (your cost_model); even cut into equal "
        f"stages with one strategy for all layers, {floor['plan']} takes {floor['time']:.6g} s")
    metrics["public cases"] += 1
