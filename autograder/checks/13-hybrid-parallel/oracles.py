"""Lab 13's public oracles: what a plan is, not what it costs.

- ``shapes``/``compositions``: the search space, as the lab's docstring states it
  (every (dp, tp, pp, microbatches) that divides the devices, the heads, the
  hidden size and the batch; every cut of the layers into pp non-empty stages).
- ``problem_with``: is a plan a valid plan of that space (else what is wrong).
- ``caps``: the most memory each stage of a plan may use: the budget, or its
  devices' own memory when one of them has less.

The cost model and the exhaustive search, which compute what ``cost_model`` and
``search`` return, are in ``oracles_hidden.py`` (hidden checks only). The public
checks compare with a table of their answers for the public cases
(``expected.json``), and time a searched plan with the student's own
``cost_model``.
"""
import collections
import itertools

STRATEGIES = ("none", "selective", "full")
PLAN_FIELDS = ("dp", "tp", "pp", "microbatches", "zero", "schedule", "stages", "recompute")


def compositions(total, parts):
    """Every list of ``parts`` positive integers adding up to ``total``."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0,) + cuts + (total,)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


def shapes(model, devices):
    """Every (dp, tp, pp, m) of the search space."""
    for dp in range(1, devices + 1):
        for tp in range(1, devices // dp + 1):
            if devices % (dp * tp) or model["heads"] % tp or model["hidden"] % tp:
                continue
            pp = devices // (dp * tp)
            if pp > model["layers"] or model["batch"] % dp:
                continue
            for m in range(1, model["batch"] // dp + 1):
                if model["batch"] % (dp * m) == 0:
                    yield dp, tp, pp, m


def caps(plan, cluster, budget):
    """[stage j's memory cap]: ``budget``, or less when a device of stage j has less memory
    (stage j holds ranks j·dp·tp .. (j + 1)·dp·tp - 1, the nodes' devices in order)."""
    memory = [node["memory"] for node in cluster["nodes"] for _ in range(node["devices"])]
    per_stage = plan["dp"] * plan["tp"]
    return [min(budget, min(memory[j * per_stage:(j + 1) * per_stage])) for j in range(plan["pp"])]


def problem_with(plan, model, cluster):
    """None when ``plan`` is a valid plan for ``model`` on ``cluster``, else what is wrong.

    The shape is looked up among ``shapes`` (the space, enumerated), the cut is
    read as its running totals (they climb strictly from above 0 to the layer
    count), and the strategies as a tally."""
    if not isinstance(plan, dict):
        return f"a plan is a dict, got {plan!r:.120}"
    absent = sorted(set(PLAN_FIELDS) - set(plan))
    if absent:
        return f"the plan has no {', '.join(absent)}: {plan!r:.200}"
    mesh = tuple(plan[field] for field in PLAN_FIELDS[:4])
    if any(type(x) is not int for x in mesh):
        return f"dp, tp, pp and microbatches must be positive integers: {plan!r:.200}"
    space = set(shapes(model, sum(node["devices"] for node in cluster["nodes"])))
    if mesh not in space:
        return "dp={}, tp={}, pp={}, microbatches={} is not a shape of the search space".format(*mesh)
    if plan["zero"] not in {0, 1, 2, 3} or plan["schedule"] not in {"1f1b", "gpipe"}:
        return f"zero must be 0-3 and schedule '1f1b' or 'gpipe': {plan!r:.200}"
    cut, layers = plan["stages"], model["layers"]
    totals = list(itertools.accumulate(cut)) if isinstance(cut, list) else []
    climbs = all(a < b for a, b in zip([0] + totals, totals))
    if len(totals) != mesh[2] or not climbs or totals[-1] != layers:
        return f"stages {cut!r} must give each of the {mesh[2]} stages at least one of the {layers} layers"
    named = isinstance(plan["recompute"], list) and all(isinstance(k, str) for k in plan["recompute"])
    tally = collections.Counter(plan["recompute"]) if named else None
    if tally is None or sum(tally.values()) != layers or any(k not in STRATEGIES for k in tally):
        return f"recompute must name one of {STRATEGIES} per layer: {plan['recompute']!r:.200}"
    return None
