"""Lab 13's hidden oracles: the cost model from its closed forms, and brute-force search.

They compute what the lab's ``cost_model`` and ``search`` return, so only the
hidden checks (``check_planner_hidden.py``) and the tests use them and ``k2c
release`` leaves them out (lab.toml's ``hidden``). The public checks hold the
student's planner to a table of these oracles' answers for their fixed cases
(``expected.json``, which tests/test_13_hybrid_parallel.py holds to them).

Written from the formulas in the lab's docstring and the papers, not from the
student's modules 07 and 09: the parameter count per GPT block (12h² + 13h),
Korthikanti et al.'s activations per layer, the ZeRO paper's table, the ring
all-reduce's 2(n - 1)(α + β n / t) (at ZeRO-3, two parameter all-gathers per
microbatch and one gradient reduce-scatter a step), Alpa's Σ t + (m - 1) max t.
Everything is computed rank by rank: a rank's stage, its TP and DP groups and
the node of every member.

``best_plan`` tries every plan of the search space. Inside a stage the layers
are alike, so a plan's cost depends only on how many layers of each stage use
each strategy (tests/test_13_hybrid_parallel.py checks this against the
per-layer brute force ``best_plan_per_layer`` on small cases), and the step
time grows with each stage's time while the stage's all-reduce does not
depend on its strategies: for each stage and number of layers only its
fastest fitting choice of strategies can be in a best plan. ``best_plan``
therefore enumerates every cut of the layers into stages, with each stage's
fastest fitting choice found by trying every count of strategies.

The searches take up to seconds and their answers depend only on their
arguments, so each is computed once per grader process (``remembered``): the
module is loaded once per process (``load_beside``), and a batch of gradings
asks the same questions.
"""
import copy
import functools
import itertools
import json
import math

from autograder.grading.checking import load_beside

public = load_beside(__file__, "oracles")
STRATEGIES, compositions, shapes, problem_with = (public.STRATEGIES, public.compositions, public.shapes,
                                                  public.problem_with)

def remembered(search):
    """``search(model, cluster, budget)``, computed once per distinct arguments (plain data)."""
    answers = {}

    @functools.wraps(search)
    def remembering(*args):
        key = json.dumps(args, sort_keys=True)
        if key not in answers:
            answers[key] = search(*args)
        return copy.deepcopy(answers[key])
    return remembering


def node_of_ranks(cluster):
    return [n for n, node in enumerate(cluster["nodes"]) for _ in range(node["devices"])]


def bytes_per_parameter(precision, optimizer):
    """(weights, gradients, optimizer state) bytes per parameter (module 07, the ZeRO paper)."""
    moments = {"adam": 2, "sgd": 0, "sgd_momentum": 1}[optimizer]
    if precision == "fp32":
        return 4, 4, 4 * moments
    return 2, 2, 4 + 4 * moments  # + the fp32 master copy


def zero_table(psi, n, stage, precision="mixed", optimizer="adam"):
    """Bytes per rank of Ψ parameters at a ZeRO stage: the paper's Figure 1 for mixed Adam."""
    weights, grads, state = (x * psi for x in bytes_per_parameter(precision, optimizer))
    return (weights / (n if stage >= 3 else 1) + grads / (n if stage >= 2 else 1)
            + state / (n if stage >= 1 else 1))


def module07_peak(config):
    """Module 07's ``estimate_train_memory(config)["peak"]``, from its closed forms."""
    V, s, h, L, a, b = (config[k] for k in ("vocab", "seq", "hidden", "layers", "heads", "batch"))
    w = 4 if config["precision"] == "fp32" else 2
    params = V * h + s * h + L * (12 * h * h + 13 * h) + 2 * h
    static = params * sum(bytes_per_parameter(config["precision"], config["optimizer"]))
    layer = layer_bytes(config, b)
    kept = s * b * h * w if config.get("checkpointing") else layer
    return static + L * kept + 2 * s * b * h * w + 4 * s * b * V + (layer if config.get("checkpointing") else 0)


def layer_bytes(model, b, strategy="none"):
    """What one layer keeps for backward for a microbatch of b sequences (Korthikanti et al. 2022)."""
    s, h, a = model["seq"], model["hidden"], model["heads"]
    w = 4 if model["precision"] == "fp32" else 2
    if strategy == "full":
        return s * b * h * w
    masks = model["dropout"] > 0
    linear = w * 16 * s * b * h + (2 * s * b * h if masks else 0)
    quadratic = (w * 2 * a * s * s * b + a * s * s * b) if masks else w * a * s * s * b
    return linear if strategy == "selective" else linear + quadratic


def ring(nbytes, n, link):
    return 0.0 if n == 1 else 2 * (n - 1) * (link["alpha"] + link["beta"] * nbytes / n)


def stage_layout(plan, cluster, j):
    """What stage j's cost takes from where its ranks are: (its slowest device's flop/s,
    the link of its TP groups, of its DP groups, of its sends to stage j + 1 and to j - 1)."""
    dp, tp, pp = plan["dp"], plan["tp"], plan["pp"]
    nodes = node_of_ranks(cluster)
    flops = [node["flops"] for node in cluster["nodes"] for _ in range(node["devices"])]
    rank_ids = [r for r in range(len(nodes)) if r // (dp * tp) == j]

    def link_of(groups):
        crossing = any(len({nodes[r] for r in group}) > 1 for group in groups)
        return cluster["inter" if crossing else "intra"]

    tp_groups = [[r for r in rank_ids if r // tp == q] for q in {r // tp for r in rank_ids}]
    dp_groups = [[r for r in rank_ids if r % tp == i] for i in range(tp)]
    following = link_of([[r, r + dp * tp] for r in rank_ids]) if j + 1 < pp else None
    preceding = link_of([[r, r - dp * tp] for r in rank_ids]) if j > 0 else None
    return min(flops[r] for r in rank_ids), link_of(tp_groups), link_of(dp_groups), following, preceding


def stage_of(plan, model, cluster, j, counts, layout=None):
    """Stage j's cost: {"time", "compute", "tp_comm", "p2p", "dp_comm", "parameters", "memory"},
    for ``counts[k]`` of its layers using ``STRATEGIES[k]`` (``layout``: ``stage_layout``'s
    answer for this plan's mesh, when the caller has it)."""
    dp, tp, pp, m = plan["dp"], plan["tp"], plan["pp"], plan["microbatches"]
    L, h, s, V, a = model["layers"], model["hidden"], model["seq"], model["vocab"], model["heads"]
    n_none, n_selective, n_full = counts
    n = sum(counts)
    b = model["batch"] / (dp * m)
    w = 4 if model["precision"] == "fp32" else 2
    act = s * b * h * w
    speed, tp_link, dp_link, following, preceding = layout or stage_layout(plan, cluster, j)
    layer_forward = 2 * b * s * 12 * h * h + 4 * b * s * s * h  # 4 linears (12h² weights) + 2 attention products
    forward = n * layer_forward + (2 * b * s * h * V if j == pp - 1 else 0)
    again = n_full * layer_forward + n_selective * 4 * b * s * s * h
    compute = (forward + 2 * forward + again) / tp / speed
    tp_comm = (4 * n + 2 * n_full) * ring(act, tp, tp_link)
    p2p = sum(_send(act / tp, link) for link in (following, preceding) if link is not None)
    block = 12 * h * h + 13 * h
    params = n * block
    if j == 0:
        params += V * h + s * h
    if j == pp - 1:
        params += 2 * h + (V * h if pp > 1 else 0)
    psi = params / tp
    weights_b, grads_b, _ = bytes_per_parameter(model["precision"], model["optimizer"])
    # ZeRO-3 gathers the weights for each microbatch's forward and backward (two all-gathers, each half a
    # ring all-reduce) and reduce-scatters the gradients once a step (the other half)
    allreduce = ring(psi * grads_b, dp, dp_link)
    dp_comm = allreduce * ((2 * m + 1) / 2) if plan["zero"] == 3 else allreduce
    in_flight = m if plan["schedule"] == "gpipe" else min(m, pp - j)
    kept = (n_none * layer_bytes(model, b) + n_selective * layer_bytes(model, b, "selective")
            + n_full * layer_bytes(model, b, "full"))
    if j == pp - 1:
        kept += 2 * act + 4 * s * b * V
    if n_full:
        redo = layer_bytes(model, b)
    elif n_selective:
        redo = layer_bytes(model, b) - layer_bytes(model, b, "selective")
    else:
        redo = 0
    memory = zero_table(psi, dp, plan["zero"], model["precision"], model["optimizer"]) + (in_flight * kept + redo) / tp
    return {"time": compute + tp_comm + p2p, "compute": compute, "tp_comm": tp_comm, "p2p": p2p,
            "dp_comm": dp_comm, "parameters": psi, "memory": memory}


def _send(nbytes, link):
    return link["alpha"] + link["beta"] * nbytes


def stage_counts(plan):
    """[(none, selective, full) per stage] of a plan."""
    counts, first = [], 0
    for n in plan["stages"]:
        kinds = plan["recompute"][first:first + n]
        counts.append(tuple(kinds.count(k) for k in STRATEGIES))
        first += n
    return counts


def cost(plan, model, cluster):
    """{"time", "pipeline", "bubble", "memory", "stages"} of a valid plan."""
    stages = [stage_of(plan, model, cluster, j, c) for j, c in enumerate(stage_counts(plan))]
    m = plan["microbatches"]
    slowest = max(st["time"] for st in stages)
    pipeline = sum(st["time"] for st in stages) + (m - 1) * slowest
    return {"time": pipeline + max(st["dp_comm"] for st in stages), "pipeline": pipeline,
            "bubble": pipeline - m * slowest, "memory": max(st["memory"] for st in stages), "stages": stages}


def fits(plan, model, cluster, budget):
    """Every device's peak at most ``budget`` and its own memory."""
    memory = [node["memory"] for node in cluster["nodes"] for _ in range(node["devices"])]
    per_stage = plan["dp"] * plan["tp"]
    stages = cost(plan, model, cluster)["stages"]
    return all(st["memory"] <= min(budget, min(memory[j * per_stage:(j + 1) * per_stage]))
               for j, st in enumerate(stages))


def _count_vectors(n):
    for full in range(n + 1):
        for selective in range(n - full + 1):
            yield (n - full - selective, selective, full)


@remembered
def best_plan(model, cluster, budget):
    """(time, plan) of a fastest plan that fits, or (inf, None): every shape, ZeRO
    stage, schedule and cut, each stage with its fastest fitting strategy counts."""
    devices = sum(node["devices"] for node in cluster["nodes"])
    memory = [node["memory"] for node in cluster["nodes"] for _ in range(node["devices"])]
    best = (math.inf, None)
    for dp, tp, pp, m in shapes(model, devices):
        mesh = {"dp": dp, "tp": tp, "pp": pp}
        layouts = [stage_layout(mesh, cluster, j) for j in range(pp)]
        caps = [min(budget, min(memory[j * dp * tp:(j + 1) * dp * tp])) for j in range(pp)]
        for zero, schedule in itertools.product(range(4), ("1f1b", "gpipe")):
            plan = {"dp": dp, "tp": tp, "pp": pp, "microbatches": m, "zero": zero, "schedule": schedule}
            fastest = {}  # (j, n) -> (stage cost, counts) or None

            def choice(j, n):
                if (j, n) not in fastest:
                    found = None
                    for counts in _count_vectors(n):
                        st = stage_of(plan, model, cluster, j, counts, layouts[j])
                        if st["memory"] <= caps[j] and (found is None or st["time"] < found[0]["time"]):
                            found = (st, counts)
                    fastest[j, n] = found
                return fastest[j, n]

            for cut in compositions(model["layers"], pp):
                chosen = [choice(j, n) for j, n in enumerate(cut)]
                if None in chosen:
                    continue
                times = [st["time"] for st, _ in chosen]
                time = sum(times) + (m - 1) * max(times) + max(st["dp_comm"] for st, _ in chosen)
                if time < best[0]:
                    recompute = [k for _, counts in chosen for k, c in zip(STRATEGIES, counts) for _ in range(c)]
                    best = (time, dict(plan, stages=cut, recompute=recompute))
    return best


@remembered
def least_memory(model, cluster):
    """The smallest peak memory any plan of the space needs on its fullest device (bytes), and
    that device's own memory not counted: with a budget below it, no plan fits, and at it, one
    does (where each device's own memory allows it)."""
    devices = sum(node["devices"] for node in cluster["nodes"])
    least = math.inf
    for dp, tp, pp, m in shapes(model, devices):
        layouts = [stage_layout({"dp": dp, "tp": tp, "pp": pp}, cluster, j) for j in range(pp)]
        for zero, schedule in itertools.product(range(4), ("1f1b", "gpipe")):
            plan = {"dp": dp, "tp": tp, "pp": pp, "microbatches": m, "zero": zero, "schedule": schedule}
            smallest = {(j, n): min(stage_of(plan, model, cluster, j, counts, layouts[j])["memory"]
                                    for counts in _count_vectors(n))
                        for j in range(pp) for n in range(1, model["layers"] - pp + 2)}
            for cut in compositions(model["layers"], pp):
                least = min(least, max(smallest[j, n] for j, n in enumerate(cut)))
    return least


@remembered
def best_uniform_plan(model, cluster, budget):
    """(time, plan): the fastest fitting plan with the layers cut as evenly as they go
    (the first stages one more) and one strategy for every layer: a floor for a
    search on clusters too large for ``best_plan``."""
    devices = sum(node["devices"] for node in cluster["nodes"])
    best = (math.inf, None)
    L = model["layers"]
    for dp, tp, pp, m in shapes(model, devices):
        cut = [L // pp + (1 if j < L % pp else 0) for j in range(pp)]
        for zero, schedule, kind in itertools.product(range(4), ("1f1b", "gpipe"), STRATEGIES):
            plan = {"dp": dp, "tp": tp, "pp": pp, "microbatches": m, "zero": zero, "schedule": schedule,
                    "stages": cut, "recompute": [kind] * L}
            if fits(plan, model, cluster, budget):
                time = cost(plan, model, cluster)["time"]
                if time < best[0]:
                    best = (time, plan)
    return best


def best_plan_per_layer(model, cluster, budget):
    """(time, plan): every plan of the space, every strategy of every layer (tiny cases only)."""
    devices = sum(node["devices"] for node in cluster["nodes"])
    best = (math.inf, None)
    for dp, tp, pp, m in shapes(model, devices):
        for zero, schedule in itertools.product(range(4), ("1f1b", "gpipe")):
            for cut in compositions(model["layers"], pp):
                for recompute in itertools.product(STRATEGIES, repeat=model["layers"]):
                    plan = {"dp": dp, "tp": tp, "pp": pp, "microbatches": m, "zero": zero, "schedule": schedule,
                            "stages": cut, "recompute": list(recompute)}
                    if fits(plan, model, cluster, budget):
                        time = cost(plan, model, cluster)["time"]
                        if time < best[0]:
                            best = (time, plan)
    return best
