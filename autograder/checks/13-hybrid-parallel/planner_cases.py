"""Lab 13's planner cases: the public checks' fixed ones, and the same kinds drawn from a grading's seed.

The fixed cases (``COST_CASES``, ``SEARCHES``) are public and stay: a student's
own grading grades them against the table of their answers (``expected.json``),
and they reproduce a failure by hand. Each kind also has a generator of cases
drawn from the grading's secret seed (``autograder.grading.seeds``): the cost
model's by the public rules of a plan (``oracles.shapes``, ``compositions``),
the search's with budgets chosen by the hidden oracles passed in (between the
least memory any plan needs and what the fastest plan needs, so that every
budget binds). What the drawn cases must answer is computed by those oracles in
the grader; the invalid plans' only by construction (each breaks one rule).

The fixed cases are GPT-sized (h = 2048-4096, s = 1-4k) on clusters of 8
A100-like devices a node, with budgets where memory binds; the drawn ones vary
the layers, widths, batches, meshes, cuts, strategies and budgets around them,
at sizes whose exhaustive search takes a fraction of a second (32 devices: about
a second).
"""
import json
import math

from autograder.grading import seeds
from autograder.grading.checking import load_beside

oracles = load_beside(__file__, "oracles")

INTRA, INTER = {"alpha": 5e-6, "beta": 1 / 2e11}, {"alpha": 1e-5, "beta": 1 / 2.5e10}
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
FOUR_NODES = cluster(A100, A100, A100, A100)

# --- the cost model's fixed cases: {kind: [(name, plan, model, cluster)]} --------------------------

COST = {
    "module 07": [(f"module 07 {prec} {opt} dropout={p} {kind}", plan(1, 1, 1, 1, [3], [kind] * 3),
                   gpt(layers=3, hidden=256, heads=4, seq=128, batch=2, vocab=1000, dropout=p, precision=prec,
                       optimizer=opt), ONE)
                  for prec, opt, p, kind in [("fp32", "adam", 0.0, "none"), ("mixed", "adam", 0.1, "none"),
                                             ("mixed", "sgd_momentum", 0.1, "full"), ("fp32", "sgd", 0.0, "full")]],
    "zero": [(f"ZeRO-{z} on dp={dp}", plan(dp, 1, 1, 1, [4], ["none"] * 4, zero=z), gpt(batch=8, seq=512),
              cluster(dict(A100, devices=dp))) for dp in (2, 8) for z in range(4)],
    "in flight": [(f"{sched} m={m} on pp=4 tp=2", plan(1, 2, 4, m, [2, 1, 2, 3], ["none"] * 8, schedule=sched),
                   gpt(layers=8, batch=8), NODE) for sched in ("gpipe", "1f1b") for m in (1, 2, 8)],
    "recompute": [(f"recompute {kinds}", plan(2, 2, 2, 2, [3, 3], kinds), gpt(layers=6, batch=8), NODE)
                  for kinds in (["none", "selective", "full"] * 2, ["selective"] * 6, ["full", "none"] * 3,
                                ["selective", "none", "none", "none", "none", "none"])],
    "tp": [(f"tp={tp} over {layers} layers{' across nodes' if tp > 8 else ''}",
            plan(16 // tp, tp, 1, 1, [layers], ["full"] + ["none"] * (layers - 1)),
            gpt(layers=layers, batch=16, heads=32), TWO_NODES) for tp in (2, 8, 16) for layers in (1, 3)],
    "dp": [(f"dp={dp} zero={z}{' across nodes' if dp * tp > 8 else ''}", plan(dp, tp, 16 // (dp * tp), 1,
            [1] * (16 // (dp * tp)) if 16 // (dp * tp) > 1 else [1], ["none"] * max(1, 16 // (dp * tp)), zero=z),
            gpt(layers=max(1, 16 // (dp * tp)), batch=16), TWO_NODES)
           for dp, tp in ((1, 16), (2, 8), (4, 2), (16, 1)) for z in (0, 3)]
    # ZeRO-3 with gradient accumulation: the weights are gathered again for every microbatch
    + [(f"dp={dp} zero={z} m={m}{' across nodes' if dp * tp > 8 else ''}",
        plan(dp, tp, 16 // (dp * tp), m, [1] * (16 // (dp * tp)), ["none"] * (16 // (dp * tp)), zero=z),
        gpt(layers=16 // (dp * tp), batch=32), TWO_NODES)
       for dp, tp, m in ((4, 2, 4), (16, 1, 2)) for z in (2, 3)],
    "pipeline": [(f"pipeline pp={pp} m={m} stages={stages}", plan(1, 8 // pp, pp, m, stages, ["none"] * sum(stages)),
                  gpt(layers=sum(stages), batch=12), NODE)
                 for pp, m, stages in ((1, 1, [5]), (1, 6, [5]), (2, 1, [3, 2]), (2, 3, [1, 4]),
                                       (4, 12, [2, 1, 1, 3]), (8, 4, [1] * 8))],
    "two speeds": [(f"two speeds {name}", p, gpt(layers=sum(p["stages"]), batch=8, hidden=2048, heads=16), TWO_SPEEDS)
                   for name, p in [("pp=2", plan(1, 4, 2, 4, [4, 2], ["none", "full"] * 3)),
                                   ("pp=8", plan(1, 1, 8, 2, [1] * 8, ["selective"] * 8)),
                                   ("tp=8 across speeds", plan(1, 8, 1, 1, [6], ["none"] * 6))]],
    "invalid": [("dp·tp·pp is not the device count", plan(2, 2, 1, 1, [4], ["none"] * 4), gpt(), NODE),
                ("tp does not divide the heads", plan(1, 8, 1, 1, [4], ["none"] * 4), gpt(heads=12, hidden=768),
                 NODE),
                ("microbatches do not split the batch", plan(8, 1, 1, 3, [4], ["none"] * 4), gpt(batch=16), NODE),
                ("a stage without layers", plan(1, 4, 2, 1, [4, 0], ["none"] * 4), gpt(), NODE),
                ("an unknown strategy", plan(8, 1, 1, 1, [4], ["none"] * 3 + ["offload"]), gpt(), NODE)],
}
COST_CASES = [case for kind in COST.values() for case in kind]
# The stage fields the table holds for every case (``parameters`` is checked by none).
STAGE_FIELDS = ("time", "compute", "tp_comm", "p2p", "dp_comm", "memory")

# --- the search's fixed cases: (name, model, cluster, budget, limit in seconds) --------------------

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
    + [("32 devices, 8 layers", gpt(layers=8, seq=2048, batch=32), FOUR_NODES, 6e9, LARGE),
       ("64 devices, 32 layers", gpt(layers=32, hidden=8192, heads=64, batch=64), cluster(*[A100] * 8), 4e10, LARGE)])
SEARCH_BY_NAME = {case[0]: case for case in SEARCHES}

# --- drawn cases --------------------------------------------------------------------------------------


def pick(rng, options):
    return options[int(rng.integers(len(options)))]


def any_cut(rng, layers, pp):
    return pick(rng, list(oracles.compositions(layers, pp)))


def any_strategies(rng, layers, options=oracles.STRATEGIES):
    return [pick(rng, options) for _ in range(layers)]


def _divisor(rng, n):
    return pick(rng, [d for d in range(1, n + 1) if n % d == 0])


def _module07(rng, i):
    heads = pick(rng, [2, 4, 8])
    prec, opt, p = pick(rng, ["fp32", "mixed"]), pick(rng, ["adam", "sgd", "sgd_momentum"]), pick(rng, [0.0, 0.1])
    kind, layers = ("none", "full")[i % 2], int(rng.integers(1, 5))
    model = gpt(layers=layers, hidden=heads * pick(rng, [16, 32, 64]), heads=heads, seq=pick(rng, [64, 128, 256]),
                batch=int(rng.integers(1, 5)), vocab=int(rng.integers(500, 5000)), dropout=p, precision=prec,
                optimizer=opt)
    return [(f"module 07, drawn {i}: {prec} {opt} dropout={p} {kind}", plan(1, 1, 1, 1, [layers], [kind] * layers),
             model, ONE)]


def _zero(rng, i):
    dp, layers = pick(rng, [2, 4, 8]), int(rng.integers(1, 5))
    model = gpt(layers=layers, hidden=pick(rng, [1024, 2048, 4096]), batch=dp * int(rng.integers(1, 3)),
                seq=pick(rng, [256, 512, 1024]), vocab=int(rng.integers(1000, 50000)))
    return [(f"ZeRO-{z} on dp={dp}, drawn {i}", plan(dp, 1, 1, 1, [layers], ["none"] * layers, zero=z), model,
             cluster(dict(A100, devices=dp))) for z in range(4)]


def _in_flight(rng, i):
    """Every layer kept, ZeRO-0, as the public cases: only the microbatches in flight vary (1F1B
    with fewer than the stages, so that min(m, pp - j) is not pp - j)."""
    tp, pp = pick(rng, [(2, 4), (1, 4), (2, 2), (1, 8)])
    dp, sched = 8 // (tp * pp), ("gpipe", "1f1b")[i % 2]
    m = pick(rng, [1, 2, 3, 4, 8] if sched == "gpipe" else [m for m in (1, 2, 3, 4) if m < pp])
    model = gpt(layers=pp + int(rng.integers(0, 5)), batch=dp * m * int(rng.integers(1, 3)))
    p = plan(dp, tp, pp, m, any_cut(rng, model["layers"], pp), ["none"] * model["layers"], schedule=sched)
    return [(f"{sched} m={m} on pp={pp} tp={tp}, drawn {i}", p, model, NODE)]


def _recompute(rng, i):
    """Mixed strategies on 2 x 2 x 2, as the public cases, at least as many microbatches as stages."""
    layers, m = int(rng.integers(4, 9)), pick(rng, [2, 4])
    kinds = ["selective", "full"] + any_strategies(rng, layers - 2)
    rng.shuffle(kinds)
    return [(f"recompute {kinds}, drawn {i}", plan(2, 2, 2, m, any_cut(rng, layers, 2), kinds),
             gpt(layers=layers, batch=2 * m * int(rng.integers(1, 3))), NODE)]


def _tp(rng, i):
    tp, layers = pick(rng, [2, 4, 8, 16]), int(rng.integers(1, 5))
    kinds = ["full"] + any_strategies(rng, layers - 1, ("none", "full"))
    return [(f"tp={tp} over {layers} layers, drawn {i}", plan(16 // tp, tp, 1, 1, [layers], kinds),
             gpt(layers=layers, batch=16, heads=32, hidden=pick(rng, [2048, 4096])), TWO_NODES)]


def _dp(rng, i):
    dp, tp = pick(rng, [(1, 16), (2, 8), (2, 4), (4, 2), (4, 4), (8, 2), (16, 1)])
    pp, m = 16 // (dp * tp), pick(rng, [1, 2, 4])
    layers = pp + int(rng.integers(0, 3))
    return [(f"dp={dp} tp={tp} zero={z} m={m}, drawn {i}",
             plan(dp, tp, pp, m, any_cut(rng, layers, pp), ["none"] * layers, zero=z),
             gpt(layers=layers, batch=dp * m * int(rng.integers(1, 3))), TWO_NODES) for z in (int(rng.integers(3)), 3)]


def _pipeline(rng, i):
    pp = pick(rng, [1, 2, 4, 8])
    m, layers = int(rng.integers(1, 13)), pp + int(rng.integers(0, 4))
    stages = any_cut(rng, layers, pp)
    return [(f"pipeline pp={pp} m={m} stages={stages}, drawn {i}", plan(1, 8 // pp, pp, m, stages, ["none"] * layers),
             gpt(layers=layers, batch=m * int(rng.integers(1, 3))), NODE)]


def _two_speeds(rng, i):
    model = gpt(layers=int(rng.integers(2, 9)), batch=8, hidden=2048, heads=16)
    dp, tp, pp, m = pick(rng, list(oracles.shapes(model, 8)))
    p = plan(dp, tp, pp, m, any_cut(rng, model["layers"], pp), any_strategies(rng, model["layers"]),
             zero=int(rng.integers(4)))
    return [(f"two speeds dp={dp} tp={tp} pp={pp}, drawn {i}", p, model, TWO_SPEEDS)]


def _invalid(rng, i):
    """One plan per rule it breaks, the rest of it valid (oracles.problem_with names the rule)."""
    layers = int(rng.integers(2, 7))
    model = gpt(layers=layers, batch=16)
    dp, tp, pp, m = pick(rng, list(oracles.shapes(model, 8)))
    good = plan(dp, tp, pp, m, any_cut(rng, layers, pp), any_strategies(rng, layers))
    odd_heads = pick(rng, [12, 20, 28, 36])
    cases = {
        "dp·tp·pp is not the device count": (dict(good, dp=dp * 2), model),
        "tp does not divide the heads": (plan(1, 8, 1, 1, [layers], ["none"] * layers),
                                         dict(model, heads=odd_heads, hidden=64 * odd_heads)),
        "microbatches do not split the batch": (dict(good, microbatches=pick(rng, [3, 5, 6, 7])),
                                                dict(model, batch=dp * 16)),
        "a stage without layers": (plan(1, 4, 2, 1, [layers, 0], ["none"] * layers), model),
        "an unknown strategy": (dict(good, recompute=good["recompute"][:-1] + [pick(rng, ["offload", "half"])]),
                                model),
    }
    return [(f"{what}, drawn {i}", p, mod, NODE) for what, (p, mod) in cases.items()]


DRAW_COST = {"module 07": (_module07, 4), "zero": (_zero, 2), "in flight": (_in_flight, 2),
             "recompute": (_recompute, 2), "tp": (_tp, 2), "dp": (_dp, 2), "pipeline": (_pipeline, 3),
             "two speeds": (_two_speeds, 2), "invalid": (_invalid, 1)}


def _inputs(case):
    return json.dumps(case[1:], sort_keys=True)


def drawn_costs(seed):
    """{kind: [(name, plan, model, cluster)]}: the cost model's cases drawn from ``seed``, as many
    of each kind as ``DRAW_COST`` says, each unlike every public case and every other draw (a
    drawn case equal to a public one is answered by a table of the public answers)."""
    seen = {_inputs(case) for case in COST_CASES}
    found = {}
    for kind, (draw, count) in DRAW_COST.items():
        found[kind] = []
        for i in range(count):
            rng = seeds.rng(seed, "13", "cost", kind, i)
            for _ in range(50):
                group = draw(rng, i)
                if not seen & {_inputs(case) for case in group}:
                    break
            else:
                raise RuntimeError(f"50 draws of '{kind}' {i} all repeat a case: the drawn sizes need looking at")
            seen.update(_inputs(case) for case in group)
            found[kind] += group
    return found


# --- drawn searches: budgets that bind, chosen by the hidden oracles ---------------------------------

def _unbounded(where):
    return dict(where, nodes=[dict(node, memory=math.inf) for node in where["nodes"]])


def _binding_budgets(hidden, rng, model, where, count, unbounded=None):
    """``count`` budgets that bind (the best plan within each is slower than the best plan
    without it), between the least memory any plan needs and what the fastest plan needs; None
    when a few tries find none. ``unbounded``: the cluster without the budget, if not ``where``."""
    least = hidden.least_memory(model, where)
    fastest_time, fastest = hidden.best_plan(model, unbounded or where, math.inf)
    # at most the smallest device's memory: there the budget binds, not a device's own memory
    free = min(hidden.cost(fastest, model, where)["memory"], *(node["memory"] for node in where["nodes"]))
    budgets = []
    for u in rng.uniform(0.02, 0.7, size=3 * count):
        budget = float(least + u * (free - least))
        if fastest_time * (1 + 1e-9) < hidden.best_plan(model, where, budget)[0] < math.inf:
            budgets.append(budget)
            if len(budgets) == count:
                return budgets
    return None


def drawn_search(hidden, rng, label, make_model, where, count, limit=SMALL):
    for _ in range(20):  # a model whose budgets bind, in a few draws
        model = make_model(rng)
        budgets = _binding_budgets(hidden, rng, model, where, count)
        if budgets:
            return [(f"{label}, {b:.4g} B", model, where, b, limit) for b in sorted(budgets)]
    raise RuntimeError(f"no binding budget drawn for {label}: the drawn sizes need looking at")


def _one_device(hidden, rng):
    """One device whose own memory binds (the budget, 1e12 B, is above it)."""
    for _ in range(20):
        model = gpt(layers=int(rng.integers(4, 9)), seq=pick(rng, [4096, 8192]), batch=1)
        found = _binding_budgets(hidden, rng, model, ONE, 1, unbounded=_unbounded(ONE))
        if found:
            where = cluster(dict(A100, devices=1, memory=found[0]))
            return [(f"1 device of {found[0]:.4g} B, a batch of 1, drawn, 1e12 B", model, where, 1e12, SMALL)]
    raise RuntimeError("no device memory that binds drawn for 1 device: the drawn sizes need looking at")


def _nothing_fits(hidden, rng):
    """Just below the least memory any plan needs (raise ValueError), and just at it (a plan)."""
    model = gpt(layers=int(rng.integers(2, 6)), hidden=pick(rng, [2048, 4096]), seq=pick(rng, [1024, 2048]))
    least = hidden.least_memory(model, NODE)
    below = float(least * rng.uniform(0.5, 0.95))
    return [(f"nothing fits, drawn, {below:.4g} B", model, NODE, below, SMALL),
            (f"just fits, drawn, {least * (1 + 1e-6):.4g} B", model, NODE, least * (1 + 1e-6), SMALL)]


def drawn_searches(seed, hidden):
    """{kind: [(name, model, cluster, budget, limit)]}: search cases drawn from ``seed``, their
    budgets chosen with the hidden oracles (``oracles_hidden``, passed in)."""
    def rng(kind):
        return seeds.rng(seed, "13", "search", kind)

    return {
        "8 devices": drawn_search(hidden, rng("8 devices"), "8 devices, drawn", lambda r: gpt(
            layers=int(r.integers(3, 6)), hidden=pick(r, [2048, 4096]), seq=pick(r, [1024, 2048]),
            batch=pick(r, [8, 16])), NODE, 2),
        "16 devices": drawn_search(hidden, rng("16 devices"), "16 devices, drawn", lambda r: gpt(
            layers=int(r.integers(3, 6)), seq=1024, batch=32), TWO_NODES, 1),
        "6 layers": drawn_search(hidden, rng("6 layers"), "per-layer strategies on 2 devices, drawn", lambda r: gpt(
            layers=int(r.integers(4, 7)), hidden=2048, heads=16, seq=pick(r, [2048, 4096]), batch=2,
            vocab=32000), PAIR, 2),
        "two speeds": drawn_search(hidden, rng("two speeds"), "two speeds, drawn", lambda r: gpt(
            layers=int(r.integers(4, 7)), hidden=2048, heads=16), TWO_SPEEDS, 2),
        "1 device": _one_device(hidden, rng("1 device")),
        "nothing fits": _nothing_fits(hidden, rng("nothing fits")),
        "32 devices": drawn_search(hidden, rng("32 devices"), "32 devices, drawn", lambda r: gpt(
            layers=int(r.integers(4, 7)), seq=2048, batch=32), FOUR_NODES, 1, LARGE),
    }
