"""What lecture 13 runs: hybrid plans, their predicted and their measured cost.

Two halves. The first runs on the ranks of ``course.dist.run`` (each rank is a
new Python process, so it lives in a module, not in the notebook):
``experiments()`` calibrates this machine as a cluster description — a
matmul's flop/s per process while every rank multiplies at once, and gloo
all-reduce times over groups of 2 and 4 ranks — then trains small GPTs under
DP × TP meshes with the lab's ``run_plan``, and counts, for a few plans, the
bytes of every tensor a rank holds (``held_bytes``). The second half is plain
Python on one process: the α-β fit, the rank correlation, the exact count of
what lab 10's layers save, the plans enumerated for the cost model, the Pareto
front, a plan's time split, and the pictures.

The lab's code (``planner``, ``hybrid``, ``cluster``) is imported from the lab's
folder; importing this module puts that folder on ``sys.path`` (for the notebook
and for every rank). In the student repository that is your own
``labs/13-hybrid-parallel``, so the cells that run it start with the cell magic
``%%needs_lab 13`` (registered when this module is imported in IPython): until
the lab is done they say which of its functions is not implemented yet and
skip themselves.
"""
import ast
import contextlib
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import course
from course.fits import ring_allreduce_fit, spearman  # noqa: F401  (spearman: for the lecture)
from course.torch_audit import OpLog, SavedActivations

_ROOT = Path(course.__file__).resolve().parents[1]
LAB_CODE = next((f for f in (_ROOT / "solutions" / "13-hybrid-parallel", _ROOT / "labs" / "13-hybrid-parallel")
                 if f.is_dir()), _ROOT / "labs" / "13-hybrid-parallel")
if str(LAB_CODE) not in sys.path:
    sys.path.insert(0, str(LAB_CODE))

import hybrid  # noqa: E402  (the lab's run_plan, found on the path set just above)
import planner  # noqa: E402

# --- 0. cells that run the lab: %%needs_lab -------------------------------------------------------------
#
# The lecture must not show the lab's answer, so in the student repository its cells run the student's
# own lab 13, a starter until the lab is done. A cell that starts with ``%%needs_lab 13`` runs as usual
# once lab 13 is done, and otherwise prints one line and is skipped: all such cells alike, so no later
# cell misses a name that a skipped one would have defined.

STUB = "not implemented yet"   # how every starter's NotImplementedError begins (``k2c sync`` writes them)


def _stub_in(exc):
    """``("13", "planner.check_plan")``: the lab and the function of the starter that raised ``exc``
    (the lab from its folder, ``NN-slug``; None outside one); None when ``exc`` is no starter's (a
    NotImplementedError of torch's, say)."""
    if not str(exc).startswith(STUB):
        return None
    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    where = Path(code.co_filename)
    lab = where.parent.name.split("-")[0]
    return (lab if lab.isdigit() else None), f"{where.stem}.{code.co_qualname}"


def _run_plan_or_stub(plan, model):
    """On a rank: ``run_plan``, or the starter it stopped at (``_stub_in``): a job's error carries only
    the exception's message, not where it was raised."""
    try:
        hybrid.run_plan(plan, model)
    except NotImplementedError as exc:
        stub = _stub_in(exc)
        if stub is None:
            raise
        return stub
    return None


def _lab13_stub():
    """The first of lab 13's functions (or of the earlier labs' they call) still a starter, called in the
    lecture's order on a tiny case (one device, one layer, one step; ``run_plan`` on one rank), as
    ``_stub_in`` names it; None when none is. An error other than a starter's does not skip the cells:
    it is the lab's to show in the cell that meets it."""
    import cluster as jobs   # the lab's cluster.py

    from course import dist as ranks

    model = {"layers": 1, "hidden": 8, "heads": 2, "seq": 4, "batch": 2, "vocab": 16, "dropout": 0.0,
             "precision": "fp32", "optimizer": "sgd", "steps": 1, "seed": 0}
    device, plan = one_node(1, 1e12, 1e-5, 1e-10, 1e9), simple_plan(1, 1, 1)
    job = {"name": "probe", "nodes": 1, "kind": "torch", "procs_per_node": 1, "command": ["train.py"]}
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1"}
    for call in (lambda: planner.check_plan(plan, model, device), lambda: planner.cost_model(plan, model, device),
                 lambda: planner.search(model, device, 1e9), lambda: hybrid.check_plan(plan, model, 1),
                 lambda: jobs.validate_job(dict(job)), lambda: jobs.make_sbatch(dict(job)),
                 lambda: jobs.rank_from_env(env)):
        try:
            call()
        except NotImplementedError as exc:
            if _stub_in(exc) is not None:
                return _stub_in(exc)
        except Exception:  # noqa: BLE001 - see the docstring
            pass
    run = ranks.run(_run_plan_or_stub, 1, plan, model, timeout=120)
    return run.results[0] if run.ok else None


LAB_STUBS = {"13": _lab13_stub}   # the labs a cell can name, and how to find a starter left in each
_stubs = {}                       # lab -> its starter left, or None: decided once per kernel


def stub_left(lab):
    """``_stub_in``'s ``(lab, function)`` of a starter left in ``lab`` (``"13"``) or the labs it uses,
    or None when it is done. Asked once, then kept: a kernel keeps the lab's modules it imported, so a
    lab finished since shows after a restart."""
    if lab not in _stubs:
        _stubs[lab] = LAB_STUBS[lab]()
    return _stubs[lab]


def needs_lab(line, cell):
    """The cell magic ``%%needs_lab 13``: run the cell when every lab named on the line is done, else
    print which function is not implemented yet and skip it. In the course repository, where the labs
    are the reference solutions, a starter left is an error, not a reason to skip."""
    from IPython import get_ipython
    from IPython.core.displayhook import DisplayHook
    from IPython.core.error import UsageError

    labs = line.split()
    if not labs or not all(n.isdigit() and f"{int(n):02d}" in LAB_STUBS for n in labs):
        raise UsageError(f"%%needs_lab takes the numbers of labs it knows ({', '.join(LAB_STUBS)}), got {line!r}")
    for lab in labs:
        stub = stub_left(f"{int(lab):02d}")
        if stub is None:
            continue
        owner, function = stub[0] or lab, stub[1]
        if LAB_CODE.parent.name == "solutions":
            raise RuntimeError(f"{function} of lab {owner} is {STUB}: the reference solutions must be complete")
        print(f"Skipped: lab {owner}'s {function} is {STUB}. Finish lab {owner} (`k2c grade {owner}`), restart "
              "the kernel and run the lecture again; the course's docs site shows what this cell prints.")
        return None
    shell = get_ipython()
    code = shell.transform_cell(cell)
    tree = shell.transform_ast(shell.compile.ast_parse(code))
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    filename = shell.compile.cache(code, shell.execution_count, raw_code=cell)   # tracebacks show the lines
    exec(shell.compile(tree, filename, "exec"), shell.user_global_ns, shell.user_ns)
    if last is not None:
        value = eval(shell.compile(ast.Expression(last.value), filename, "eval"), shell.user_global_ns, shell.user_ns)
        if not DisplayHook.semicolon_at_end_of_expression(cell):
            return value   # the cell's result, shown as without the magic
    return None


def load_ipython_extension(ipython):
    """``%load_ext hybrid_examples`` registers ``%%needs_lab``; importing this module in IPython does too."""
    ipython.register_magic_function(needs_lab, "cell", "needs_lab")


if "IPython" in sys.modules and sys.modules["IPython"].get_ipython() is not None:   # a notebook's kernel, say
    load_ipython_extension(sys.modules["IPython"].get_ipython())

# --- 1. on the ranks: calibration, training runs, the bytes a rank holds --------------------------------


def _slowest(seconds):
    """The largest of every rank's ``seconds``: a step waits for its slowest rank."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def matmul_flops(shape, rounds=3, per_round=8):
    """Flop/s per process of a float32 ``[n, k] @ [k, m]`` while every rank multiplies at once: each
    round starts at a barrier, every rank computes ``per_round`` products, and the round lasts until
    the slowest rank is done (4 processes on 2 cores take turns: a rank that ran first saw a core of
    its own). The fastest round counts, as the training runs' fastest pass does
    (``experiments``): load from elsewhere on the machine only ever slows a round."""
    n, k, m = shape
    gen = torch.Generator().manual_seed(dist.get_rank())
    a, b = torch.randn(n, k, generator=gen), torch.randn(k, m, generator=gen)
    a @ b   # warm-up
    runs = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(per_round):
            a @ b
        runs.append(_slowest(time.perf_counter() - start) / per_round)
    return 2 * n * k * m / min(runs)


def allreduce_times(groups, sizes, repeats=3, per_repeat=4):
    """``{nbytes: seconds}``: a float32 all-reduce of each size over this rank's group, all ``groups``
    at once (as a plan's groups run), the fastest of ``repeats`` of the slowest rank's mean of
    ``per_repeat`` back-to-back all-reduces."""
    rank = dist.get_rank()
    handles = [dist.new_group(g) for g in groups]   # every rank creates every group, in the same order
    mine = next(h for g, h in zip(groups, handles) if rank in g)
    times = {}
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        dist.all_reduce(x, group=mine)   # warm-up: gloo connects at the first message
        runs = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(per_repeat):
                dist.all_reduce(x, group=mine)
            runs.append(_slowest((time.perf_counter() - start) / per_repeat))
        times[nbytes] = min(runs)
    return times


def held_bytes(plan, model):
    """What one rank of ``plan`` (pp = 1) holds, from its tensors: the rank is built as ``run_plan``
    builds it (the DP × TP mesh, ``ParallelGPT`` loaded with its tp shards, lab 08's ``BucketedDDP``,
    the optimizer), then runs one microbatch forward and backward and one optimizer step::

        {"parameters", "gradients", "optimizer_state", "ddp_buckets", "activations": bytes,
         "parameter_tensors": how many,
         "all_reduces": [elements of each all-reduce of a second microbatch's forward and backward]}

    ``activations`` adds up the distinct storages autograd saved during the forward (a
    ``saved_tensors_hooks`` pack hook), the parameters left out; the others are the sizes of the
    parameters, their ``.grad``, every tensor in ``optimizer.state`` and DDP's flat bucket buffers.
    ``all_reduces`` is what ``course.torch_audit.OpLog`` saw, gradient synchronisation included."""
    rows, columns, m = plan["dp"], plan["tp"], plan["microbatches"]
    row, column = divmod(dist.get_rank(), columns)   # rank = row · tp + column, the mesh's order
    # every rank creates every group, in one order: first the rows (tp groups), then the columns (dp groups)
    row_groups = [dist.new_group([r * columns + c for c in range(columns)]) for r in range(rows)]
    column_groups = [dist.new_group([r * columns + c for r in range(rows)]) for c in range(columns)]
    dense = hybrid.dense_model(model)
    net = hybrid.ParallelGPT(model, row_groups[row], plan["recompute"])
    net.load_shards(hybrid.tp_shards(dense, column, columns))
    replica = hybrid.ddp.BucketedDDP(net, group=column_groups[column])   # gradients averaged down a column
    optimizer = hybrid.make_optimizer(model, net.parameters())
    tokens, targets = hybrid.make_batches(model)
    b = model["batch"] // (rows * m)   # one microbatch of this rank's sequences
    x, y = tokens[0, row * b:(row + 1) * b], targets[0, row * b:(row + 1) * b]

    params = list(net.parameters())
    with SavedActivations(exclude=params) as saved:
        loss = replica(x, y)
    loss.backward()
    replica.finish_gradient_synchronization()
    optimizer.step()

    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    held = {"parameters": nbytes(params), "gradients": nbytes(p.grad for p in params),
            "optimizer_state": nbytes(state), "ddp_buckets": nbytes(replica.buffers),
            "activations": saved.nbytes, "parameter_tensors": len(params)}
    with OpLog() as log:
        replica(x, y).backward()
        replica.finish_gradient_synchronization()
    held["all_reduces"] = log.elements("all_reduce")
    return held


def experiments(runs, memory_runs, matmul_shape, sizes, passes=3):
    """Everything lecture 13 measures, in one job of 4 ranks. Returns, on every rank::

        {"flops": this rank's matmul flop/s (all ranks at once),
         "allreduce": {group size: {nbytes: seconds}},
         "runs": [{"losses", "step_time_s"} of run_plan(plan, model) for each of runs],
         "memory": [held_bytes(plan, model) for each of memory_runs]}

    Each pass measures everything once, the calibration (matmul, all-reduces) and then every
    run, and each number keeps its best pass: other work on the machine only ever adds time,
    and passing through the same moments of load, calibration and runs see it alike. A burst
    of load then slows one pass, not a run's number, nor the order of two runs."""
    world = dist.get_world_size()
    groups = {world: [list(range(world))], 2: [list(range(i, i + 2)) for i in range(0, world, 2)]}
    result = {"flops": 0.0, "allreduce": {t: {} for t in groups},
              "runs": [{"losses": None, "step_time_s": math.inf} for _ in runs]}
    for _ in range(passes):
        result["flops"] = max(result["flops"], matmul_flops(matmul_shape))
        for t, ranks in groups.items():
            for nbytes, seconds in allreduce_times(ranks, sizes).items():
                result["allreduce"][t][nbytes] = min(result["allreduce"][t].get(nbytes, math.inf), seconds)
        for kept, (plan, model) in zip(result["runs"], runs):
            out = hybrid.run_plan(plan, model)
            kept["losses"] = kept["losses"] or out["losses"]
            kept["step_time_s"] = min(kept["step_time_s"], out["step_time_s"])
    result["memory"] = [held_bytes(plan, model) for plan, model in memory_runs]
    return result


# --- 2. from the measurements to a cluster description ------------------------------------------------


def simple_plan(dp, tp, layers, microbatches=1):
    """A plan ``run_plan`` can run: ``dp × tp`` ranks, one stage, no ZeRO, nothing recomputed."""
    return {"dp": dp, "tp": tp, "pp": 1, "microbatches": microbatches, "zero": 0, "schedule": "1f1b",
            "stages": [layers], "recompute": ["none"] * layers}


def fit_alpha_beta(times):
    """``(α, β)`` of the ring all-reduce fitted to ``{t: {nbytes: seconds}}`` (``course.fits``)."""
    return ring_allreduce_fit([(t, n, seconds) for t, by_size in times.items() for n, seconds in by_size.items()])


def one_node(devices, flops, alpha, beta, memory):
    """A cluster description of one node: ``devices`` alike, every link ``(alpha, beta)``."""
    link = {"alpha": alpha, "beta": beta}
    return {"nodes": [{"devices": devices, "flops": flops, "memory": memory}], "intra": link, "inter": dict(link)}


# --- 3. memory: what the cost model counts, what lab 10's layers save ------------------------------------


def replicated_parameters(model):
    """Parameters every tp rank holds whole in ``ParallelGPT`` (the cost model divides them by tp
    too): the position table, each layer's two LayerNorms and the biases of its two row-parallel
    linears, and the final LayerNorm."""
    h = model["hidden"]
    return model["seq"] * h + model["layers"] * (4 * h + 2 * h) + 2 * h


def lab10_activation_bytes(model, b, t):
    """What one rank of ``ParallelGPT`` saves for backward in one forward of ``b`` sequences, counted
    op by op (float32, no dropout, nothing recomputed). Per layer: the two LayerNorms' inputs (the
    residual stream) and outputs, whole on every rank (no sequence parallelism): 4sbh; q, k, v, the attention output,
    the GELU's input and fc2's input of this rank's heads and columns: 12sbh/t; the attention's
    log-sum-exp per head and token, as·b/t (``scaled_dot_product_attention`` keeps no s × s
    probabilities); two LayerNorms' mean and 1/std, 4sb. Outside the layers: the final LayerNorm's
    input, output and statistics, 2sbh + 2sb; the vocabulary-parallel loss's softmax, sbV/t; int64
    token ids and targets and two bool masks, 18sb bytes."""
    s, h, a, V, L = model["seq"], model["hidden"], model["heads"], model["vocab"], model["layers"]
    sb, w = s * b, 4
    per_layer = w * (4 * sb * h + 12 * sb * h // t + a * sb // t + 4 * sb)
    return L * per_layer + w * (2 * sb * h + 2 * sb + sb * V // t) + 18 * sb


def predicted_memory(plan, model, cluster):
    """The cost model's bytes per device of stage 0, split as module 07 splits them::

        {"parameters", "gradients", "optimizer_state", "activations", "peak"}"""
    stage = planner.stage_cost(plan, model, cluster, 0)
    psi = stage["parameters"]
    per = planner.memory_budget.state_bytes_per_parameter(model["precision"], model["optimizer"])
    split = {"parameters": psi * per["parameters"], "gradients": psi * per["gradients"],
             "optimizer_state": psi * per["optimizer_state"]}
    if plan["zero"] == 0:
        split["activations"] = stage["memory"] - sum(split.values())
    split["peak"] = stage["memory"]
    return split


# --- 4. plans for the cost model --------------------------------------------------------------------------


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def uniform_plans(model, cluster, strategies=planner.STRATEGIES):
    """Every plan with an even cut (pp dividing the layers) and one strategy for all layers: every
    dp · tp · pp equal to the devices (tp dividing the heads), every number of microbatches dividing
    B / dp, ZeRO 0-3, both schedules."""
    devices = sum(node["devices"] for node in cluster["nodes"])
    L, B = model["layers"], model["batch"]
    plans = []
    for tp in divisors(devices):
        for pp in divisors(devices // tp):
            dp = devices // (tp * pp)
            if model["heads"] % tp or L % pp or B % dp:
                continue
            for m in divisors(B // dp):
                for zero in range(4):
                    for schedule in planner.SCHEDULES:
                        for how in strategies:
                            plans.append({"dp": dp, "tp": tp, "pp": pp, "microbatches": m, "zero": zero,
                                          "schedule": schedule, "stages": [L // pp] * pp, "recompute": [how] * L})
    return plans


def pareto_front(memory, seconds):
    """Indices of the plans no other plan beats in both memory and time, by increasing memory."""
    order = np.lexsort((seconds, memory))
    front, best = [], math.inf
    for i in order:
        if seconds[i] < best:
            front.append(i)
            best = seconds[i]
    return front


SPLIT = ("compute", "TP all-reduces", "PP sends", "pipeline bubble", "DP all-reduce")


def time_split(cost, plan):
    """The step time of ``cost = cost_model(plan, ...)`` in the parts of ``SPLIT``: the slowest stage's
    m microbatches of compute, TP and PP sends, the bubble (what the pipeline takes beyond that), and
    the slowest all-reduce of gradients. They add up to ``cost["time"]``."""
    m = plan["microbatches"]
    slowest = max(cost["stages"], key=lambda st: st["time"])
    parts = [m * slowest["compute"], m * slowest["tp_comm"], m * slowest["p2p"], cost["bubble"],
             max(st["dp_comm"] for st in cost["stages"])]
    return dict(zip(SPLIT, parts))


def plain_log_ticks(axis):
    """Label a log axis 2, 3, 5, 10, 20 rather than 2×10⁰, 3×10⁰, 10¹ (minor ticks 2, 3 and 5 only)."""
    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "235" else ""))


def describe(plan):
    """A plan in one line: the mesh, microbatches, ZeRO, the cut and the strategies' counts."""
    kinds = {k: plan["recompute"].count(k) for k in planner.STRATEGIES if plan["recompute"].count(k)}
    return (f"dp={plan['dp']} tp={plan['tp']} pp={plan['pp']} m={plan['microbatches']} "
            f"ZeRO-{plan['zero']} {plan['schedule']} stages={plan['stages']} "
            + " ".join(f"{n}×{k}" for k, n in kinds.items()))


# --- 5. the picture of where a plan puts its ranks ----------------------------------------------------------


def draw_placement(plan, cluster, ax, title=None):
    """Each device a square, one row per node: its colour is its pipeline stage, its label its rank
    over ``k·i`` (replica k, tp rank i), and a black frame closes round each TP group (a red frame
    when the group spans two nodes)."""
    from matplotlib.patches import Rectangle

    from course.diagrams import BLOCK_COLOURS

    dp, tp = plan["dp"], plan["tp"]
    devices = planner.device_list(cluster)
    per_node = max(node["devices"] for node in cluster["nodes"])
    where = {}
    for r, device in enumerate(devices):
        first = sum(node["devices"] for node in cluster["nodes"][:device["node"]])
        x, y = r - first, -device["node"] * 1.6
        where[r] = (x, y)
        j, rest = divmod(r, dp * tp)
        k, i = divmod(rest, tp)
        ax.add_patch(Rectangle((x + 0.06, y + 0.06), 0.88, 0.88, facecolor=BLOCK_COLOURS[j % len(BLOCK_COLOURS)],
                               edgecolor="white"))
        ax.text(x + 0.5, y + 0.5, f"{r}\n{k}·{i}", ha="center", va="center", fontsize=6.5)
    for n, node in enumerate(cluster["nodes"]):
        ax.add_patch(Rectangle((-0.08, -n * 1.6 - 0.08), node["devices"] + 0.16, 1.16, fill=False,
                               edgecolor="grey", ls="--", lw=0.8))
        ax.text(-0.25, -n * 1.6 + 0.5, f"node {n}", ha="right", va="center", fontsize=7)
    for start in range(0, len(devices), tp):
        group = list(range(start, start + tp))
        spans = devices[group[0]]["node"] != devices[group[-1]]["node"]
        for node in sorted({devices[r]["node"] for r in group}):
            mine = [where[r] for r in group if devices[r]["node"] == node]
            x0, y0 = min(p[0] for p in mine), mine[0][1]
            ax.add_patch(Rectangle((x0 + 0.02, y0 + 0.02), len(mine) - 0.04, 0.96, fill=False,
                                   edgecolor="#c0392b" if spans else "black", lw=1.6 if spans else 1.0))
    ax.set_xlim(-1.6, per_node + 0.2)
    ax.set_ylim(-1.6 * (len(cluster["nodes"]) - 1) - 0.2, 1.25)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title or describe(plan), fontsize=8)
    return ax


# --- 6. counting what a search evaluates ---------------------------------------------------------------------


@contextlib.contextmanager
def counting(module, name):
    """Count the calls of ``module.name`` while the block runs: ``with counting(planner, "stage_cost")
    as calls: ...`` leaves the number in ``calls[0]``."""
    original, calls = getattr(module, name), [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    setattr(module, name, counted)
    try:
        yield calls
    finally:
        setattr(module, name, original)
