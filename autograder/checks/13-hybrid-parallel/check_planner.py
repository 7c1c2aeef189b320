"""Checks for lab 13's planner: the cost model and the search.

Every expected value is a table (``expected.json``): the answers, for these
fixed cases, of the grader's cost model from its closed forms (module 07's
activations and parameter count, the ZeRO table, the ring all-reduce, Alpa's
pipeline time) and of its exhaustive search. Those oracles compute what
``cost_model`` and ``search`` return, so they are hidden (``oracles_hidden.py``,
not in the student repository); tests/test_13_hybrid_parallel.py holds the table
to them. All cost_model queries go to the student's code in one sandboxed call
(harness.planner_answers), all search queries in another; each search runs
under its own time limit. Costs are compared to 1e-9 relative; a search is right
when its plan is valid (``oracles.problem_with``), fits, and takes the exhaustive
search's best time (to 1e-9; on the medium cluster within 2 %), both timed and
sized by the student's own ``cost_model`` (its checks say whether that is right).

The hidden checks (``check_planner_hidden.py``) run the cost model on random
plans and the search on other cases, against the oracles themselves.

The cases are GPT-sized (h = 2048-4096, s = 1-4k) on clusters of 8 A100-like
devices a node, with budgets where memory binds: there the best plan changes
its mesh, ZeRO stage, microbatches and per-layer recomputation.
"""
import functools
import json
import math
from pathlib import Path

import pytest

from autograder.grading.checking import load_beside
from autograder.grading.submission import not_implemented_yet

oracles = load_beside(__file__, "oracles")
# What the hidden oracles answer for these cases: {"cost": {case: cost}, "search": {case: best}}.
EXPECTED = json.loads(Path(__file__).with_name("expected.json").read_text())

INTRA, INTER = {"alpha": 5e-6, "beta": 1 / 2e11}, {"alpha": 1e-5, "beta": 1 / 2.5e10}
REL = 1e-9
A100 = {"devices": 8, "flops": 3e14, "memory": 8e10}


def cluster(*nodes):
    return {"nodes": list(nodes), "intra": INTRA, "inter": INTER}


def gpt(**changes):
    base = {"layers": 4, "hidden": 4096, "heads": 32, "seq": 2048, "batch": 16, "vocab": 50000,
            "dropout": 0.1, "precision": "mixed", "optimizer": "adam"}
    return dict(base, **changes)


def plan(dp, tp, pp, m, stages, recompute, zero=0, schedule="1f1b"):
    return {"dp": dp, "tp": tp, "pp": pp, "microbatches": m, "zero": zero, "schedule": schedule,
            "stages": stages, "recompute": recompute}


ONE = cluster(dict(A100, devices=1))
NODE, TWO_NODES = cluster(A100), cluster(A100, A100)
TWO_SPEEDS = cluster(dict(A100, devices=4), {"devices": 4, "flops": 1e14, "memory": 4e10})
PAIR = cluster(dict(A100, devices=2))

# --- the cost model's cases: (name, plan, model, cluster) -----------------------------------

MODULE07 = [(f"module 07 {prec} {opt} dropout={p} {kind}", plan(1, 1, 1, 1, [3], [kind] * 3),
             gpt(layers=3, hidden=256, heads=4, seq=128, batch=2, vocab=1000, dropout=p, precision=prec,
                 optimizer=opt), ONE)
            for prec, opt, p, kind in [("fp32", "adam", 0.0, "none"), ("mixed", "adam", 0.1, "none"),
                                       ("mixed", "sgd_momentum", 0.1, "full"), ("fp32", "sgd", 0.0, "full")]]
ZERO = [(f"ZeRO-{z} on dp={dp}", plan(dp, 1, 1, 1, [4], ["none"] * 4, zero=z), gpt(batch=8, seq=512),
         cluster(dict(A100, devices=dp))) for dp in (2, 8) for z in range(4)]
IN_FLIGHT = [(f"{sched} m={m} on pp=4 tp=2", plan(1, 2, 4, m, [2, 1, 2, 3], ["none"] * 8, schedule=sched),
              gpt(layers=8, batch=8), NODE) for sched in ("gpipe", "1f1b") for m in (1, 2, 8)]
RECOMPUTE = [(f"recompute {kinds}", plan(2, 2, 2, 2, [3, 3], kinds), gpt(layers=6, batch=8), NODE)
             for kinds in (["none", "selective", "full"] * 2, ["selective"] * 6, ["full", "none"] * 3,
                           ["selective", "none", "none", "none", "none", "none"])]
TP_COMM = [(f"tp={tp} over {layers} layers{' across nodes' if tp > 8 else ''}",
            plan(16 // tp, tp, 1, 1, [layers], ["full"] + ["none"] * (layers - 1)),
            gpt(layers=layers, batch=16, heads=32), TWO_NODES) for tp in (2, 8, 16) for layers in (1, 3)]
DP_COMM = [(f"dp={dp} zero={z}{' across nodes' if dp * tp > 8 else ''}", plan(dp, tp, 16 // (dp * tp), 1,
            [1] * (16 // (dp * tp)) if 16 // (dp * tp) > 1 else [1], ["none"] * max(1, 16 // (dp * tp)), zero=z),
            gpt(layers=max(1, 16 // (dp * tp)), batch=16), TWO_NODES)
           for dp, tp in ((1, 16), (2, 8), (4, 2), (16, 1)) for z in (0, 3)]
# ZeRO-3 with gradient accumulation: the weights are gathered again for every microbatch
DP_COMM += [(f"dp={dp} zero={z} m={m}{' across nodes' if dp * tp > 8 else ''}",
             plan(dp, tp, 16 // (dp * tp), m, [1] * (16 // (dp * tp)), ["none"] * (16 // (dp * tp)), zero=z),
             gpt(layers=16 // (dp * tp), batch=32), TWO_NODES)
            for dp, tp, m in ((4, 2, 4), (16, 1, 2)) for z in (2, 3)]
PIPELINE = [(f"pipeline pp={pp} m={m} stages={stages}", plan(1, 8 // pp, pp, m, stages, ["none"] * sum(stages)),
             gpt(layers=sum(stages), batch=12), NODE)
            for pp, m, stages in ((1, 1, [5]), (1, 6, [5]), (2, 1, [3, 2]), (2, 3, [1, 4]), (4, 12, [2, 1, 1, 3]),
                                  (8, 4, [1] * 8))]
HETEROGENEOUS = [(f"two speeds {name}", p, gpt(layers=sum(p["stages"]), batch=8, hidden=2048, heads=16), TWO_SPEEDS)
                 for name, p in [("pp=2", plan(1, 4, 2, 4, [4, 2], ["none", "full"] * 3)),
                                 ("pp=8", plan(1, 1, 8, 2, [1] * 8, ["selective"] * 8)),
                                 ("tp=8 across speeds", plan(1, 8, 1, 1, [6], ["none"] * 6))]]
INVALID = [("dp·tp·pp is not the device count", plan(2, 2, 1, 1, [4], ["none"] * 4), gpt(), NODE),
           ("tp does not divide the heads", plan(1, 8, 1, 1, [4], ["none"] * 4), gpt(heads=12, hidden=768), NODE),
           ("microbatches do not split the batch", plan(8, 1, 1, 3, [4], ["none"] * 4), gpt(batch=16), NODE),
           ("a stage without layers", plan(1, 4, 2, 1, [4, 0], ["none"] * 4), gpt(), NODE),
           ("an unknown strategy", plan(8, 1, 1, 1, [4], ["none"] * 3 + ["offload"]), gpt(), NODE)]
COST_CASES = MODULE07 + ZERO + IN_FLIGHT + RECOMPUTE + TP_COMM + DP_COMM + PIPELINE + HETEROGENEOUS + INVALID
# The stage fields the table holds for every case (``parameters`` is checked by none).
STAGE_FIELDS = ("time", "compute", "tp_comm", "p2p", "dp_comm", "memory")

# --- the search's cases: (name, model, cluster, budget, limit in seconds) --------------------

SMALL, LARGE = 10, 60
SEARCHES = (
    [(f"8 devices, {b:.3g} B", gpt(), NODE, b, SMALL) for b in (2.66e9, 3.53e9, 4.69e9, 8e10)]
    + [(f"16 devices, {b:.3g} B", gpt(seq=1024, batch=32), TWO_NODES, b, SMALL) for b in (1.63e9, 3e10)]
    + [(f"6 layers on 2 devices, {b:.3g} B", gpt(layers=6, hidden=2048, heads=16, seq=4096, batch=2, vocab=32000),
        PAIR, b, SMALL) for b in (5e9, 7.67e9, 1.18e10, 1.81e10)]
    + [(f"two speeds, {b:.3g} B", gpt(layers=6, hidden=2048, heads=16), TWO_SPEEDS, b, SMALL)
       for b in (1e9, 1.69e9, 2.87e9, 4e10)]
    + [("nothing fits", gpt(), NODE, 2e9, SMALL)]
    # the smallest cluster and one sequence a step (one microbatch); the device's own 80 GB binds, not the budget
    + [("1 device, a batch of 1, 1e12 B", gpt(layers=6, seq=8192, batch=1), ONE, 1e12, SMALL)]
    + [("32 devices, 8 layers", gpt(layers=8, seq=2048, batch=32), cluster(A100, A100, A100, A100), 6e9, LARGE),
       ("64 devices, 32 layers", gpt(layers=32, hidden=8192, heads=64, batch=64), cluster(*[A100] * 8), 4e10, LARGE)])
SEARCH_BY_NAME = {case[0]: case for case in SEARCHES}


@functools.lru_cache(maxsize=None)
def _queries():
    return {"cost_model": [case[1:] for case in COST_CASES], "search": [case[1:] for case in SEARCHES]}


def _answers(submission, kind):
    """The answers to every ``kind`` query ("cost_model" or "search"), in one sandboxed call per kind: grading
    the cost model alone runs no search."""
    queries = {"cost_model": [], "search": [], kind: _queries()[kind]}
    got = submission.harness_once(("planner", kind), "planner_answers", queries)[kind]
    if isinstance(got, dict) and "not_implemented" in got:
        raise not_implemented_yet(got["not_implemented"])
    return got


def _costs(submission, cases):
    """{name: the student's cost_model value} for these cases; a call that raised fails the check."""
    position = {case[0]: i for i, case in enumerate(COST_CASES)}
    got = {}
    for name, *_ in cases:
        answer = _answers(submission, "cost_model")[position[name]]
        assert "error" not in answer, f"cost_model on the case '{name}' raised {answer['error']}"
        got[name] = answer["value"]
    return got


def _expect_stage_field(submission, cases, field, why):
    for (name, p, model, where), value in zip(cases, _costs(submission, cases).values()):
        want = EXPECTED["cost"][name]["stages"]
        stages = value.get("stages") if isinstance(value, dict) else None
        assert isinstance(stages, list) and len(stages) == len(want), (
            f"{name}: cost_model(...)['stages'] should list {len(want)} stages, got {str(stages)[:200]}")
        for j, (st, w) in enumerate(zip(stages, want)):
            assert math.isclose(st.get(field, math.nan), w[field], rel_tol=REL, abs_tol=1e-15), (
                f"{name}: stage {j}'s {field} is {st.get(field)}, expected {w[field]:.10g} ({why})")


# --- the cost model --------------------------------------------------------------------------

@pytest.mark.points(2)
def check_memory_matches_module_07_estimator(submission):
    """On one device with one microbatch, the peak memory is module 07's estimate (none and full recomputation)"""
    for (name, p, model, _), value in zip(MODULE07, _costs(submission, MODULE07).values()):
        want = EXPECTED["cost"][name]["memory"]
        assert math.isclose(value["memory"], want, rel_tol=REL), f"{name}: memory {value['memory']}, expected {want}"


@pytest.mark.points(2)
def check_memory_follows_the_zero_table(submission):
    """ZeRO stages 0-3 on dp = 2 and 8: the static memory per device is the ZeRO paper's table"""
    got = _costs(submission, ZERO)
    for dp in (2, 8):
        names = [f"ZeRO-{z} on dp={dp}" for z in range(4)]
        for z, name in enumerate(names):
            saved = got[names[0]]["memory"] - got[name]["memory"]
            want = EXPECTED["cost"][names[0]]["memory"] - EXPECTED["cost"][name]["memory"]
            assert math.isclose(saved, want, rel_tol=1e-6, abs_tol=1.0), (
                f"{name}: ZeRO-{z} saves {saved:.6g} bytes per device against ZeRO-0, expected {want:.6g} "
                f"(weights 2Ψ, gradients 2Ψ and state 12Ψ, divided by dp from stage 3, 2 and 1 on)")
    _expect_stage_field(submission, ZERO, "memory", "the ZeRO table plus the activations")


@pytest.mark.points(2)
def check_memory_holds_the_schedules_microbatches(submission):
    """Per stage, activations divided by tp, times m (GPipe) or min(m, pp - j) (1F1B) microbatches in flight"""
    _expect_stage_field(submission, IN_FLIGHT, "memory", "GPipe holds m microbatches, 1F1B min(m, pp - j)")


@pytest.mark.points(1)
def check_memory_of_recompute_strategies(submission):
    """Per stage, 'selective' keeps all but the s² scores, 'full' only the input, plus one layer while recomputing"""
    _expect_stage_field(submission, RECOMPUTE, "memory", "what each strategy keeps, plus one recomputed layer")


@pytest.mark.points(2)
def check_tp_communication_is_per_layer(submission):
    """TP: 4 ring all-reduces of a microbatch's activation per layer, 2 more per 'full' layer, over intra or inter"""
    _expect_stage_field(submission, TP_COMM, "tp_comm", "(4n + 2·full) · 2(t - 1)(α + β X / t)")


@pytest.mark.points(1)
def check_dp_allreduce_is_the_ring_closed_form(submission):
    """DP: a ring all-reduce of the gradients over dp (m + 1/2 of them at ZeRO-3), 0 for dp = 1, inter across nodes"""
    _expect_stage_field(submission, DP_COMM, "dp_comm", "2(dp - 1)(α + β G / dp); at ZeRO-3 m + 1/2 times that: "
                        "the weights gathered for every microbatch's forward and backward")


@pytest.mark.points(2)
def check_pipeline_time_and_bubble(submission):
    """The pipeline takes Σ t_j + (m - 1) max t_j and its bubble is that minus m max t_j (m = 1 and p = 1 too)"""
    for (name, p, model, where), value in zip(PIPELINE, _costs(submission, PIPELINE).values()):
        want = EXPECTED["cost"][name]
        for key in ("pipeline", "bubble", "time"):
            assert math.isclose(value.get(key, math.nan), want[key], rel_tol=REL, abs_tol=1e-15), (
                f"{name}: {key} is {value.get(key)}, expected {want[key]:.10g} (Σ t_j + (m - 1) max t_j; bubble: "
                f"minus m max t_j)")
    _expect_stage_field(submission, PIPELINE, "p2p", "α + β X / tp for each send to a neighbouring stage")


@pytest.mark.points(2)
def check_compute_on_heterogeneous_devices(submission):
    """Compute per stage: 3× the forward flops plus recomputation, over tp × the stage's slowest device"""
    _expect_stage_field(submission, HETEROGENEOUS, "compute", "flops / (tp · the slowest device's speed)")
    _expect_stage_field(submission, HETEROGENEOUS, "time", "compute + TP all-reduces + sends")


@pytest.mark.points(1)
def check_invalid_plans_raise_value_error(submission):
    """cost_model raises ValueError for a plan that cannot run (device count, tp, microbatches, stages, strategy)"""
    position = {case[0]: i for i, case in enumerate(COST_CASES)}
    for name, *_ in INVALID:
        answer = _answers(submission, "cost_model")[position[name]]
        assert answer.get("error", "").startswith("ValueError"), (
            f"cost_model should raise ValueError when {name}; it "
            + (f"raised {answer['error']}" if "error" in answer else f"returned {str(answer.get('value'))[:120]}"))


# --- the search ------------------------------------------------------------------------------

def _searched(submission, name):
    """The student's plan for a search case, or the reason the check fails."""
    answer = _answers(submission, "search")[list(SEARCH_BY_NAME).index(name)]
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


def _fitting_plan(submission, name):
    """The student's plan for a search case, valid and fitting by its own cost_model, with that cost."""
    _, model, where, budget, _ = SEARCH_BY_NAME[name]
    answer = _searched(submission, name)
    assert "error" not in answer, f"search on '{name}' raised {answer['error']}"
    got = answer["value"]
    problem = oracles.problem_with(got, model, where)
    assert problem is None, f"search on '{name}' returned an invalid plan: {problem}"
    cost = _timed(answer, name)
    caps = oracles.caps(got, where, budget)
    for j, (stage, cap) in enumerate(zip(cost["stages"], caps)):
        memory = stage.get("memory") if isinstance(stage, dict) else None
        assert isinstance(memory, (int, float)) and memory <= cap, (
            f"search on '{name}' returned a plan whose stage {j} needs {memory} bytes per device (your cost_model), "
            f"more than {cap:.4g}: the budget of {budget:.4g} bytes per device, and no more than each device's "
            f"own memory: {got}")
    return got, cost["time"]


def _expect_best(submission, names, within=REL):
    for name in names:
        got, time = _fitting_plan(submission, name)
        best = EXPECTED["search"][name]
        assert time <= best["time"] * (1 + within), (
            f"search on '{name}' returned a plan taking {time:.6g} s per step (your cost_model), but "
            f"{best['plan']} takes {best['time']:.6g} s")
        assert time >= best["time"] * (1 - REL), (
            f"search on '{name}' returned a plan that your cost_model says takes {time:.6g} s per step, less than "
            f"the best plan's {best['time']:.6g} s ({best['plan']}): does your cost_model pass its checks?")


@pytest.mark.points(2)
def check_search_matches_brute_force_on_8_devices(submission):
    """8 devices, budgets from tight to loose: the exhaustive oracle's best time, in a plan that fits"""
    _expect_best(submission, [n for n in SEARCH_BY_NAME if n.startswith("8 devices")])


@pytest.mark.points(1)
def check_search_matches_brute_force_on_16_devices(submission):
    """16 devices on two nodes: the exhaustive oracle's best time, in a plan that fits"""
    _expect_best(submission, [n for n in SEARCH_BY_NAME if n.startswith("16 devices")])


@pytest.mark.points(2)
def check_search_chooses_a_strategy_per_layer(submission):
    """6 layers, 3 strategies each, budgets where only a mix of kept and recomputed layers is fastest"""
    _expect_best(submission, [n for n in SEARCH_BY_NAME if n.startswith("6 layers")])


@pytest.mark.points(2)
def check_search_with_two_device_speeds(submission):
    """A fast and a slow node (3e14 and 1e14 flop/s, 80 and 40 GB): the oracle's best, fitting each device"""
    _expect_best(submission, [n for n in SEARCH_BY_NAME if n.startswith("two speeds")])


@pytest.mark.points(1)
def check_search_on_one_device(submission):
    """1 device, a batch of 1, a budget above the device's 80 GB: the oracle's best, fitting the device's own memory"""
    _expect_best(submission, ["1 device, a batch of 1, 1e12 B"])


@pytest.mark.points(1)
def check_search_raises_when_nothing_fits(submission):
    """search raises ValueError when no plan fits in the budget"""
    answer = _searched(submission, "nothing fits")
    assert answer.get("error", "").startswith("ValueError"), (
        "search should raise ValueError when no plan fits in 2e9 bytes per device; it "
        + (f"raised {answer['error']}" if "error" in answer else f"returned {str(answer.get('value'))[:160]}"))


@pytest.mark.points(1)
def check_search_scales_to_large_clusters(submission):
    """32 devices: within 2 % of the best; 64 devices, 32 layers: fits, within the limit, beats every uniform plan"""
    _expect_best(submission, ["32 devices, 8 layers"], within=0.02)
    name = "64 devices, 32 layers"
    _, time = _fitting_plan(submission, name)
    floor = EXPECTED["search"][name]
    assert time <= floor["time"] * (1 + REL), (
        f"search on '{name}' returned a plan taking {time:.6g} s per step (your cost_model); even cut into equal "
        f"stages with one strategy for all layers, {floor['plan']} takes {floor['time']:.6g} s")
