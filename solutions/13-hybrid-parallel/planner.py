"""Lab 13 — a cost model for hybrid parallel training, and a search for the best plan.

Modules 05-12 each taught one way to spread training over devices and what it
costs. Here they add up. A *plan* says how ``D`` devices train a GPT: ``dp``
data-parallel replicas × ``tp``-way tensor parallelism × ``pp`` pipeline stages
(``dp · tp · pp = D``), with ``microbatches`` per step, a ZeRO stage, a
pipeline schedule, the layers of each stage, and per layer whether its
activations are kept or recomputed. You write:

1. ``cost_model(plan, model, cluster)`` — the predicted step time and the peak
   memory of every device, from the formulas below (each one is a module's);
2. ``search(model, cluster, budget)`` — the fastest plan whose every device fits
   in ``budget`` bytes (and in its own memory).

Plain data (the grader sends these)::

    model   = {"layers": L, "hidden": h, "heads": a, "seq": s, "batch": B,  # B: sequences per step
               "vocab": V, "dropout": 0.0, "precision": "mixed", "optimizer": "adam"}  # module 07's config
    cluster = {"nodes": [{"devices": 8, "flops": 3e14, "memory": 8e10}, ...],  # flop/s and bytes per device
               "intra": {"alpha": 5e-6, "beta": 1 / 2e11},   # seconds; seconds per byte, inside a node
               "inter": {"alpha": 1e-5, "beta": 1 / 2.5e10}} # between nodes
    plan    = {"dp": 2, "tp": 4, "pp": 2, "microbatches": 8, "zero": 1, "schedule": "1f1b",  # or "gpipe"
               "stages": [12, 12],                    # layers per stage, in order, each >= 1
               "recompute": ["none"] * 24}            # per layer: "none", "selective" or "full"

Where the devices are: ranks are numbered node after node, and rank
``r = (j · dp + k) · tp + i`` is TP rank ``i`` of replica ``k`` of stage ``j``
(Megatron's order: TP groups are consecutive ranks, so they stay inside a node
when they can; pipeline stages are the farthest apart). A group of ranks talks
over ``intra`` when all of them are on one node, else over ``inter``. Every
device of a stage runs at the speed of the stage's slowest one.

The formulas (per device of stage ``j``; ``b = B / (dp · m)`` sequences per
microbatch, ``X = b·s·h·w`` bytes of one activation, ``w`` = 4 bytes in fp32, 2 mixed):

- **Compute** (Narayanan et al. 2021): a layer's forward is ``24bsh² + 4bs²h``
  flops, the LM head's (last stage) ``2bshV``, split over ``tp``; backward is
  twice the forward, plus the recomputed forward of every "full" layer, or its
  attention core (``4bs²h``) for "selective"; seconds = flops / speed.
- **TP** (module 10): per layer and microbatch, 2 all-reduces of ``X`` in the
  forward, 2 in the backward, and 2 more for a "full" layer's recomputed
  forward; a ring all-reduce of ``n`` bytes over ``t`` devices takes
  ``2(t - 1)(α + β n / t)`` (module 06), 0 for ``t = 1``.
- **PP** (module 11): a stage sends each microbatch's activation forward and its
  gradient back, ``α + β X / tp`` each way. With ``t_j`` the time of one
  microbatch's forward + backward on stage ``j`` (compute, TP and these
  sends: stage ``j`` pays the forward send to ``j + 1`` and the backward send
  to ``j - 1``), the pipeline takes ``Σ t_j + (m - 1) max t_j`` (Alpa's form;
  for equal stages ``(m + p - 1) t``), either schedule; its ``bubble`` is
  that minus ``m · max t_j``.
- **DP** (modules 08-09): after the pipeline, every stage all-reduces its
  gradients (``Ψ_j · w`` bytes, ``Ψ_j`` its parameters per device) over its
  ``dp`` replicas: a ring all-reduce, once per step, at ZeRO 0-2. ZeRO-3 keeps
  no whole weights, so it all-gathers them for every microbatch's forward and
  again for its backward (each gather half of that all-reduce's time), and
  reduce-scatters the gradients once a step (the other half): m + 1/2 times the
  all-reduce. The step takes the pipeline plus the slowest stage's DP time.
- **Memory** (modules 07 and 09): the parameters, gradients and optimizer state
  of ``Ψ_j`` parameters at the ZeRO stage (``zero_bytes``), plus activations:
  each layer saves ``activation_bytes_per_layer`` of a microbatch ("none"),
  that minus its attention scores' ``s²`` terms ("selective", Korthikanti et
  al. 2022), or only its input, ``X`` ("full"); the last stage also the final
  LayerNorm's and the head's inputs (``2X``) and the float32 log-probabilities
  (``4bsV``). Sequence parallelism is assumed, so every activation is divided
  by ``tp``. A stage holds the activations of ``m`` microbatches under GPipe
  and ``min(m, pp - j)`` under 1F1B, plus, while it recomputes, the full
  activations of one "full" layer (or the scores of one "selective" layer).
- **Parameters of a stage**: its layers' (module 07's count per block); the
  first stage also the token and position embeddings, the last the final
  LayerNorm and, when ``pp > 1``, its own copy of the tied LM head (V·h);
  divided by ``tp`` (the few replicated vectors are ignored).

The memory and parameter counts come from your own labs 07 and 09
(``memory_budget.py`` and ``zero.py``); the grader puts them next to this file.
Grade with ``k2c grade 13``.
"""
import itertools
import math

from course.roofline import ring_allreduce_s  # module 06's ring, the one every lecture's roofline uses
from course.siblings import import_lab_module

memory_budget = import_lab_module(__file__, "07-training-memory", "memory_budget")
zero = import_lab_module(__file__, "09-zero-sharding", "zero")

STRATEGIES = ("none", "selective", "full")
SCHEDULES = ("1f1b", "gpipe")
PLAN_KEYS = ("dp", "tp", "pp", "microbatches", "zero", "schedule", "stages", "recompute")

# --- the cluster ------------------------------------------------------------------------


def device_list(cluster):
    """One ``{"node", "flops", "memory"}`` per rank, node after node."""
    return [{"node": n, "flops": node["flops"], "memory": node["memory"]}
            for n, node in enumerate(cluster["nodes"]) for _ in range(node["devices"])]


def check_plan(plan, model, cluster):
    """Raise ``ValueError`` saying what is wrong when ``plan`` cannot run ``model`` on
    ``cluster``: a missing key, dp·tp·pp not the number of devices, tp not dividing
    the heads and the hidden size, microbatches that do not split the batch, stages
    or strategies that do not match the layers, an unknown ZeRO stage or schedule."""
    # BEGIN SOLUTION: test each rule the docstring lists, and say in the error what broke it
    missing = [key for key in PLAN_KEYS if key not in plan]
    if missing:
        raise ValueError(f"the plan has no {', '.join(missing)}")
    dp, tp, pp, m = plan["dp"], plan["tp"], plan["pp"], plan["microbatches"]
    if not all(isinstance(x, int) and x >= 1 for x in (dp, tp, pp, m)):
        raise ValueError(f"dp, tp, pp and microbatches must be positive integers: {dp}, {tp}, {pp}, {m}")
    total = sum(node["devices"] for node in cluster["nodes"])
    if dp * tp * pp != total:
        raise ValueError(f"dp·tp·pp = {dp * tp * pp}, but the cluster has {total} devices")
    if model["heads"] % tp or model["hidden"] % tp:
        raise ValueError(f"tp = {tp} must divide the heads ({model['heads']}) and the hidden size")
    if model["batch"] % (dp * m):
        raise ValueError(f"a batch of {model['batch']} cannot be split into dp·microbatches = {dp * m}")
    stages, recompute = list(plan["stages"]), list(plan["recompute"])
    if len(stages) != pp or sum(stages) != model["layers"] or min(stages) < 1:
        raise ValueError(f"stages {stages} must give each of the {pp} stages >= 1 of the {model['layers']} layers")
    if len(recompute) != model["layers"] or not set(recompute) <= set(STRATEGIES):
        raise ValueError(f"recompute needs one of {STRATEGIES} per layer, got {recompute}")
    if plan["zero"] not in (0, 1, 2, 3) or plan["schedule"] not in SCHEDULES:
        raise ValueError(f"zero must be 0-3 and schedule one of {SCHEDULES}")
    # END SOLUTION


# --- 1. The cost model ------------------------------------------------------------------


def stage_cost(plan, model, cluster, j):
    """Stage ``j``'s part of the cost model::

        {"time": t_j, "compute": ..., "tp_comm": ..., "p2p": ..., "dp_comm": ...,
         "parameters": Ψ_j, "memory": peak bytes of each device of the stage}

    ``compute``, ``tp_comm`` and ``p2p`` are one microbatch's forward and
    backward (they add up to ``t_j``); ``dp_comm`` is the stage's data-parallel
    time per step (the gradient all-reduce; at ZeRO-3 also the gathers of every
    microbatch). It reads only stage ``j``'s entries of
    ``plan["stages"]`` and of ``plan["recompute"]``: a search may try a stage
    alone with the others' layers made up.
    """
    # BEGIN SOLUTION: work through the module docstring's formulas for this one stage
    dp, tp, pp, m = plan["dp"], plan["tp"], plan["pp"], plan["microbatches"]
    h, s, V = model["hidden"], model["seq"], model["vocab"]
    b = model["batch"] // (dp * m)
    w = 4 if model["precision"] == "fp32" else 2
    X = b * s * h * w
    devices = device_list(cluster)
    first = sum(plan["stages"][:j])
    n = plan["stages"][j]
    kinds = plan["recompute"][first:first + n]
    last = j == pp - 1
    mine = [(j * dp + k) * tp + i for k in range(dp) for i in range(tp)]

    def worst_link(groups):  # the groups talk at once: the slowest link sets the pace
        spans_nodes = any(devices[g[0]]["node"] != devices[g[-1]]["node"] for g in groups)
        chosen = cluster["inter"] if spans_nodes else cluster["intra"]
        return chosen["alpha"], chosen["beta"]

    # compute: forward, twice that backward, and what is recomputed
    f_layer, f_head, f_attention = 24 * b * s * h * h + 4 * b * s * s * h, 2 * b * s * h * V, 4 * b * s * s * h
    speed = min(devices[r]["flops"] for r in mine)
    flops = n * f_layer + (f_head if last else 0)
    recomputed = kinds.count("full") * f_layer + kinds.count("selective") * f_attention
    compute = (3 * flops + recomputed) / (tp * speed)
    # TP: 2 all-reduces per layer forward, 2 backward, 2 more for a recomputed forward
    tp_link = worst_link([mine[k * tp:(k + 1) * tp] for k in range(dp)])
    tp_comm = (4 * n + 2 * kinds.count("full")) * ring_allreduce_s(X, tp, *tp_link)
    # PP: the activation forward, the gradient back
    p2p = 0.0
    for other in (j + 1, j - 1):
        if 0 <= other < pp:
            alpha, beta = worst_link([[r, r + (other - j) * dp * tp] for r in mine])
            p2p += alpha + beta * X / tp
    # parameters: module 07's count, cut into stages
    empty = memory_budget.count_parameters(dict(model, layers=0))  # embeddings + final LayerNorm
    block = memory_budget.count_parameters(dict(model, layers=1)) - empty
    if pp == 1:
        params = n * block + empty
    else:
        params = n * block + (empty - 2 * h if j == 0 else 0) + (2 * h + V * h if last else 0)
    psi = params / tp
    per_param = memory_budget.state_bytes_per_parameter(model["precision"], model["optimizer"])
    dp_link = worst_link([mine[i::tp] for i in range(tp)])
    # ZeRO-3: two parameter all-gathers per microbatch (forward, backward), one gradient reduce-scatter per step
    dp_comm = (m + 0.5 if plan["zero"] == 3 else 1.0) * ring_allreduce_s(psi * per_param["gradients"], dp, *dp_link)
    # memory: zero_bytes counts 2-byte weights and gradients; scale Ψ for 4-byte ones
    scale = per_param["parameters"] / 2
    static = zero.zero_bytes(psi * scale, dp, plan["zero"], k=per_param["optimizer_state"] / scale)
    per_layer = memory_budget.activation_bytes_per_layer(dict(model, batch=b))
    heads = model["heads"]
    scores = ((2 * w + 1) if model["dropout"] > 0 else w) * heads * s * s * b  # the s² terms
    saved = {"none": per_layer, "selective": per_layer - scores, "full": X}
    while_recomputing = {"none": 0, "selective": scores, "full": per_layer}
    held = m if plan["schedule"] == "gpipe" else min(m, pp - j)
    activations = held * (sum(saved[k] for k in kinds) + (2 * X + 4 * b * s * V if last else 0))
    peak = static + (activations + max(while_recomputing[k] for k in kinds)) / tp
    return {"time": compute + tp_comm + p2p, "compute": compute, "tp_comm": tp_comm, "p2p": p2p,
            "dp_comm": dp_comm, "parameters": psi, "memory": peak}
    # END SOLUTION


def cost_model(plan, model, cluster):
    """The predicted cost of one training step under ``plan``::

        {"time": seconds per step, "pipeline": ..., "bubble": ...,
         "memory": the largest peak of any device (bytes),
         "stages": [stage_cost(plan, model, cluster, j) for each stage j]}

    Raises ``ValueError`` for a plan that cannot run (``check_plan``).
    """
    check_plan(plan, model, cluster)
    # BEGIN SOLUTION: combine the stages as the module docstring's PP and DP items say
    stages = [stage_cost(plan, model, cluster, j) for j in range(plan["pp"])]
    times = [st["time"] for st in stages]
    m = plan["microbatches"]
    pipeline = sum(times) + (m - 1) * max(times)
    return {"time": pipeline + max(st["dp_comm"] for st in stages), "pipeline": pipeline,
            "bubble": pipeline - m * max(times), "memory": max(st["memory"] for st in stages), "stages": stages}
    # END SOLUTION


# --- 2. The search ----------------------------------------------------------------------


def search(model, cluster, budget):
    """The fastest plan (the smallest ``cost_model(...)["time"]``) whose every
    device's peak memory is at most ``budget`` bytes and at most its own
    ``memory``. Raises ``ValueError`` when no plan fits.

    The space: every ``dp · tp · pp`` equal to the devices (``tp`` dividing the
    heads and the hidden size, ``pp`` at most the layers), every number of
    microbatches that divides ``B / dp``, ZeRO 0-3, both schedules, every cut of
    the layers into stages and every strategy per layer. On a large cluster
    that is far too many plans to try one by one. A stage's cost depends only
    on its own layers (``stage_cost``), so cut the layers with a dynamic
    program over stages and layers (Alpa's ``Σ t + (m - 1) max t``), or choose
    the strategies layer by layer as Galvatron does; say in a comment which you
    do and why it finds the best plan.
    """
    # BEGIN SOLUTION: use that a stage's cost depends only on its own layers to search stage by stage
    # Exact, in three steps:
    # 1. ZeRO 0-2 take the same time and ZeRO-2 the least memory; 1F1B the same
    #    time as GPipe in no more memory: only ZeRO 2 or 3 under 1F1B can be
    #    strictly best, so only they are tried.
    # 2. For a shape (dp, tp, pp, m, zero), stage j with n layers is fastest with
    #    the fewest recomputed layers that fit: for each number of "full"
    #    layers, the fewest "selective" ones (memory falls by the same amount
    #    with each, so that number is found from two evaluations).
    # 3. The cut: the step is Σ t_j + (m - 1) max t_j + max u_j (u_j: the
    #    all-reduce). For each bound U on u_j and T on t_j, in ascending order,
    #    a DP over (stage, layers so far) gives the least Σ t_j; a bound is
    #    abandoned once its best possible time cannot beat the best found.
    devices = device_list(cluster)
    total, L, B = len(devices), model["layers"], model["batch"]
    shapes = []
    for dp, tp in itertools.product(range(1, total + 1), repeat=2):
        if total % (dp * tp) or model["heads"] % tp or model["hidden"] % tp or B % dp:
            continue
        pp = total // (dp * tp)
        if pp > L:
            continue
        for m in (m for m in range(1, B // dp + 1) if (B // dp) % m == 0):
            for zero_stage in (2, 3):
                shape = {"dp": dp, "tp": tp, "pp": pp, "microbatches": m, "zero": zero_stage, "schedule": "1f1b"}
                shapes.append((_lower_bound(shape, model, cluster), shape))
    # Branch and bound: the most promising shapes first; stop at the first whose
    # lower bound cannot beat the best plan found.
    best = None
    for bound, shape in sorted(shapes, key=lambda pair: pair[0]):
        if best and bound >= best[0]:
            break
        found = _best_cut(shape, model, cluster, devices, budget, best[0] if best else math.inf)
        if found and (best is None or found[0] < best[0]):
            best = found
    if best is None:
        raise ValueError(f"no plan fits in {budget:.4g} bytes per device")
    return best[1]


def _lower_bound(shape, model, cluster):
    """No plan of this shape is faster: every layer kept, memory ignored, the
    layers on the stage where a layer costs least, the stages perfectly balanced."""
    pp, m, L = shape["pp"], shape["microbatches"], model["layers"]
    fixed, per_layer, reduce = 0.0, math.inf, math.inf
    for j in range(pp):
        one = _try_stage(shape, model, cluster, j, 1, 0, 0)[0]
        two = _try_stage(shape, model, cluster, j, 2, 0, 0)[0]
        fixed += one["time"] - (two["time"] - one["time"])  # a stage's time is affine in its layers
        per_layer = min(per_layer, two["time"] - one["time"])
        reduce = min(reduce, one["dp_comm"])
    total = fixed + L * per_layer
    return total + (m - 1) * total / pp + reduce


def _try_stage(shape, model, cluster, j, n, full, selective):
    """Stage j's cost with n layers, ``full`` of them "full" and ``selective`` "selective"."""
    pp = shape["pp"]
    stages = [1] * pp
    stages[j] = n
    kinds = ["full"] * full + ["selective"] * selective + ["none"] * (n - full - selective)
    plan = dict(shape, stages=stages, recompute=["none"] * j + kinds + ["none"] * (pp - 1 - j))
    return stage_cost(plan, dict(model, layers=sum(stages)), cluster, j), kinds


def _stage_options(shape, model, cluster, devices, budget, j):
    """{n: (t_j, u_j, recompute)}: stage j's fastest choice with n layers that fits."""
    dp, tp, pp = shape["dp"], shape["tp"], shape["pp"]
    cap = min(budget, min(devices[(j * dp + k) * tp + i]["memory"] for k in range(dp) for i in range(tp)))
    options = {}
    for n in range(1 if pp > 1 else model["layers"], model["layers"] - pp + 2):
        found = None
        for full in range(n + 1):
            cost, kinds = _try_stage(shape, model, cluster, j, n, full, 0)
            if cost["memory"] > cap and n - full >= 1:
                one, _ = _try_stage(shape, model, cluster, j, n, full, 1)
                two = _try_stage(shape, model, cluster, j, n, full, 2)[0] if n - full >= 2 else one
                step = one["memory"] - two["memory"]
                need = 1 if one["memory"] <= cap else (2 + math.ceil((two["memory"] - cap) / step - 1e-9)
                                                         if step > 0 else n + 1)
                for selective in (need - 1, need):  # guard the rounding
                    if 1 <= selective <= n - full:
                        cost, kinds = _try_stage(shape, model, cluster, j, n, full, selective)
                        if cost["memory"] <= cap:
                            break
            if cost["memory"] <= cap and (found is None or cost["time"] < found[0]):
                found = (cost["time"], cost["dp_comm"], kinds)
            if cost["memory"] <= cap and kinds.count("selective") == 0:
                break  # fits with no selective layer: more "full" ones are only slower
        if found:
            options[n] = found
    return options


def _best_cut(shape, model, cluster, devices, budget, to_beat):
    """(time, plan): the best cut and strategies for one shape, or None."""
    pp, m, L = shape["pp"], shape["microbatches"], model["layers"]
    options = [_stage_options(shape, model, cluster, devices, budget, j) for j in range(pp)]

    def least_sum(t_bound, u_bound):
        # table[l] after stage j: (least Σ t_j so far, [(n, kinds), ...]) with l layers used
        table = {0: (0.0, [])}
        for j in range(pp):
            nxt = {}
            for used, (total, cut) in table.items():
                for n, (t, u, kinds) in options[j].items():
                    if t <= t_bound and u <= u_bound and used + n <= L - (pp - 1 - j):
                        if used + n not in nxt or total + t < nxt[used + n][0]:
                            nxt[used + n] = (total + t, cut + [(j, n)])
            table = nxt
        return table.get(L, (math.inf, None))

    floor, _ = least_sum(math.inf, math.inf)
    best = None
    t_values = sorted({t for opts in options for t, _, _ in opts.values()})
    for u_bound in sorted({u for opts in options for _, u, _ in opts.values()}):
        if floor + u_bound >= min(to_beat, best[0] if best else math.inf):
            break
        for t_bound in t_values:
            if floor + (m - 1) * t_bound + u_bound >= min(to_beat, best[0] if best else math.inf):
                break
            total, cut = least_sum(t_bound, u_bound)
            if cut is None:
                continue
            chosen = [options[j][n] for j, n in cut]
            time = total + (m - 1) * max(c[0] for c in chosen) + max(c[1] for c in chosen)
            if best is None or time < best[0]:
                plan = dict(shape, stages=[n for _, n in cut], recompute=[k for c in chosen for k in c[2]])
                best = (time, plan)
    return best
    # END SOLUTION
