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
    raise NotImplementedError('not implemented yet: check_plan: test each rule the docstring lists, and say in the error what broke it')


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
    raise NotImplementedError("not implemented yet: stage_cost: work through the module docstring's formulas for this one stage")


def cost_model(plan, model, cluster):
    """The predicted cost of one training step under ``plan``::

        {"time": seconds per step, "pipeline": ..., "bubble": ...,
         "memory": the largest peak of any device (bytes),
         "stages": [stage_cost(plan, model, cluster, j) for each stage j]}

    Raises ``ValueError`` for a plan that cannot run (``check_plan``).
    """
    check_plan(plan, model, cluster)
    raise NotImplementedError("not implemented yet: cost_model: combine the stages as the module docstring's PP and DP items say")


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
    raise NotImplementedError("not implemented yet: search: use that a stage's cost depends only on its own layers to search stage by stage")
