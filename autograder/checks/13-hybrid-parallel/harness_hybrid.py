"""Grader code that runs the student's ``hybrid.run_plan`` in the sandbox.

The lab's ``harness.py`` re-exports these functions:

``hybrid_cases_job(cases)`` runs every correctness case in ONE ``course.dist``
job of ``WORLD`` gloo processes. ``cases`` is ``{name: {"plan", "model"}}``,
plus cases ``{"refuse": [plan, ...], "model"}`` that run_plan must reject with
``ValueError``. For a training case each rank calls ``run_plan(plan, model)``
and then computes the single-process oracle itself, without the student's code:
``course.models.TinyGPT`` built after ``torch.manual_seed(seed)`` in float32
and cast to float64, trained with the same ``torch.optim`` optimizer for the
same steps on the whole global batch (tokens and next-token targets from
``torch.Generator().manual_seed(seed + 1)``), the mean cross-entropy over
every token (``F.cross_entropy`` in float64). The rank's shard of every dense
parameter is cut by the lab's documented layout, from this rank's place in
the mesh (rank = d * tp + t, row-major as ``init_device_mesh`` lays it out),
and compared with what run_plan returned: the record holds the losses (got,
want) and, per parameter, the largest absolute difference and the largest
absolute value of the wanted shard. A rank writes its record of a case as
soon as it is done (``save_record``); a rank that raises ends the job and the
case is reported with its error, the cases after it run again
(``run_cases``); after a hang the remaining training cases are not run (each
would most likely hang too), only the refusals.

``hybrid_measure_job(entries)`` measures, in one job of ``WORLD`` processes,
what a cost model of this machine needs and what it must predict:
- ``flops``: matmul throughput of one process (float32, ``MATMUL_N`` squared,
  one thread) while all ``WORLD`` processes multiply at once (they share the
  machine's cores as training does);
- ``alpha``, ``beta``: an α–β fit of gloo ``all_reduce`` (float32) over groups
  of 2 and of 4 ranks at ``ALLREDUCE_SIZES``, to the ring formula
  T = 2(p−1)·α + 2(p−1)/p·n·β (n bytes), by least squares on relative error;
- ``step_time_s`` per entry ``{"plan", "model"}``: run_plan's time per step
  after the first, measured here rather than trusted: run_plan runs
  ``model["steps"]`` (at least 2) steps under a global ``torch.optim`` step hook, and
  the time is the shortest gap between consecutive optimizer steps (the least
  disturbed by whatever else runs on the machine; None when run_plan made
  another number of ``torch.optim`` steps); the student's own
  ``step_time_s`` is recorded next to it.
Any error of run_plan ends the job (``status`` "raised", with the rank's
error): its ranks may be inside different collectives by then.

``cost_model_times(entries, cluster)`` calls the student's
``planner.cost_model(plan, model, cluster)`` for every entry in one sandboxed
call: ``[{"time": float} or {"error": "..."}]`` (a stub: ``{"not_implemented"}``).
"""
from autograder.grading.checking import run_cases, save_record
from course import dist as launcher
from course.fits import ring_allreduce_fit

WORLD = 4
CASES_TIMEOUT_S = 40  # a correct job of every case takes ~10 s on 2 cores; a deadlock ends sooner, when the job idles
MEASURE_TIMEOUT_S = 60  # a correct measurement takes ~15-20 s on 2 shared cores
MATMUL_N = 256
MATMUL_SECONDS = 0.4
ALLREDUCE_SIZES = (2**6, 2**8, 2**10, 2**18, 2**20, 2**21)  # float32 elements: 256 B .. 8 MiB
ALLREDUCE_REPEATS = 7


# --- the oracle: TinyGPT in one process ---------------------------------------------------------

def _dense(model):
    import torch

    from course.models import GPTConfig, TinyGPT

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        torch.manual_seed(model["seed"])
        gpt = TinyGPT(GPTConfig(vocab=model["vocab"], seq=model["seq"], hidden=model["hidden"],
                                heads=model["heads"], layers=model["layers"], dropout=0.0))
    finally:
        torch.set_default_dtype(previous)
    return gpt.to(torch.float64)


def _data(model):
    import torch

    generator = torch.Generator().manual_seed(model["seed"] + 1)
    data = torch.randint(0, model["vocab"], (model["steps"], model["batch"], model["seq"] + 1), generator=generator)
    return data[..., :-1], data[..., 1:]


def _optimizer(model, params):
    import torch

    if model["optimizer"] == "adam":
        return torch.optim.Adam(params, lr=model["lr"])
    return torch.optim.SGD(params, lr=model["lr"], momentum=0.9 if model["optimizer"] == "sgd_momentum" else 0.0)


def single_process(model):
    """(losses per step, {name: final dense parameter}) of TinyGPT trained on the whole batch."""
    import torch
    import torch.nn.functional as F

    gpt = _dense(model)
    optimizer = _optimizer(model, gpt.parameters())
    tokens, targets = _data(model)
    losses = []
    for step in range(model["steps"]):
        logits = gpt(tokens[step])
        loss = F.cross_entropy(logits.flatten(0, 1), targets[step].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach() for name, p in gpt.named_parameters()}


def shard(name, tensor, t, tp):
    """tp rank ``t``'s part of the dense parameter ``name``, by the lab's documented layout."""
    import torch

    def rows(x):
        part = x.shape[0] // tp
        return x[t * part:(t + 1) * part]

    if name == "tok.weight" or name.endswith(("fc1.weight", "fc1.bias")):
        return rows(tensor)
    if name.endswith(("qkv.weight", "qkv.bias")):  # q, k and v, each split by heads
        return torch.cat([rows(part) for part in tensor.chunk(3)])
    if name.endswith(("proj.weight", "fc2.weight")):  # row-parallel: split by input features
        part = tensor.shape[1] // tp
        return tensor[:, t * part:(t + 1) * part]
    return tensor


def _compare(result, plan, model, rank):
    """What the check needs from one rank's run_plan result."""
    import math

    import torch

    tp = plan["tp"]
    t = rank % tp  # row-major mesh: rank = d * tp + t
    want_losses, want_params = single_process(model)
    if not isinstance(result, dict):
        return {"status": "bad_result", "message": f"run_plan returned {type(result).__name__}, expected a dict "
                "with 'losses', 'step_time_s' and 'parameters'"}
    missing_keys = [k for k in ("losses", "parameters") if k not in result]
    if missing_keys:
        return {"status": "bad_result", "message": f"run_plan's result has no {missing_keys} (it has "
                f"{sorted(result)[:10]})"}
    try:
        got_losses = [float(x) for x in result["losses"]]
    except (TypeError, ValueError):
        return {"status": "bad_result", "message": f"run_plan's 'losses' is {result['losses']!r:.200}, expected "
                "a list of floats, one per step"}
    params, missing, shapes = {}, [], {}
    got_params = result["parameters"]
    for name, dense in want_params.items():
        want = shard(name, dense, t, tp)
        got = got_params.get(name) if isinstance(got_params, dict) else None
        if got is None:
            missing.append(name)
            continue
        got = torch.as_tensor(got).detach().to("cpu", torch.float64)
        if tuple(got.shape) != tuple(want.shape):
            shapes[name] = [list(got.shape), list(want.shape)]
            continue
        diff = (got - want).abs().max().item() if want.numel() else 0.0
        params[name] = [diff if math.isfinite(diff) else float("inf"), want.abs().max().item()]
    time_s = result.get("step_time_s")
    return {"status": "ok", "losses": [got_losses, want_losses], "params": params, "missing": missing,
            "shapes": shapes, "extra": sorted(set(got_params) - set(want_params))[:10] if isinstance(got_params, dict)
            else [], "step_time_s": float(time_s) if isinstance(time_s, (int, float)) else None,
            "tp_rank": t, "dp_rank": rank // tp}


def _refusals(student, case):
    """For each plan run_plan must reject: {"raised": bool, "message": str}."""
    found = []
    for plan in case["refuse"]:
        try:
            student.run_plan(plan, case["model"])
        except ValueError as exc:
            found.append({"raised": True, "message": str(exc)[:300]})
        else:
            found.append({"raised": False, "message": ""})
    return {"status": "ok", "refusals": found}


def cases_rank_side(names, cases, folder):
    """Every rank: run each named case; write one file per case and rank."""
    import torch.distributed as tdist

    import hybrid as student

    rank = tdist.get_rank()
    for name in names:
        case = cases[name]
        try:
            if "refuse" in case:
                record = _refusals(student, case)
            else:
                launcher.mark(f"{name}:start")  # what run_plan sends, counted by the launcher
                result = student.run_plan(case["plan"], case["model"])
                launcher.mark(f"{name}:run")
                record = _compare(result, case["plan"], case["model"], rank)
        except NotImplementedError as exc:  # a stub raises on every rank alike
            record = {"status": "not_implemented", "message": str(exc)}
        tdist.barrier()  # the next case starts together
        save_record(folder, name, rank, record)
    return None


def _merge(records):
    for record in records:
        if record["status"] != "ok":
            return {"status": record["status"], "message": record["message"]}
    return {"status": "ok", "ranks": records}


def hybrid_cases_job(cases):
    """{case name: outcome}; see the module docstring."""
    def start(pending, folder):  # gloo: the models are tiny and live on the CPU
        return launcher.run(f"{__file__}:cases_rank_side", WORLD, list(pending), {n: cases[n] for n in pending},
                            folder, timeout=CASES_TIMEOUT_S, backend="gloo", idle_timeout=launcher.IDLE_TIMEOUT_S,
                            count_wire=True)

    def after_hang(name, pending):  # every training case runs the same code: each would hang as long
        return [n for n in pending if "refuse" not in cases[n]]

    return run_cases(start, list(cases), WORLD, _merge, after_hang=after_hang, counted=("run",))


# --- measuring the machine and run_plan ----------------------------------------------------------------

def _matmul_flops():
    import time

    import torch
    import torch.distributed as tdist

    n = MATMUL_N
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    tdist.barrier()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < MATMUL_SECONDS:
        for _ in range(4):
            a @ b
        count += 4
    elapsed = time.perf_counter() - start
    tdist.barrier()
    return 2 * n**3 * count / elapsed


def _allreduce_times():
    """[(p, bytes, seconds)]: the median all_reduce time over the world and over pairs."""
    import statistics
    import time

    import torch
    import torch.distributed as tdist

    rank, world = tdist.get_rank(), tdist.get_world_size()
    pairs = [tdist.new_group([r, r + 1]) for r in range(0, world, 2)]  # every rank creates every group
    found = []
    for p, group in ((world, None), (2, pairs[rank // 2])):
        for n in ALLREDUCE_SIZES:
            x = torch.ones(n)
            tdist.all_reduce(x, group=group)  # warm-up
            times = []
            for _ in range(ALLREDUCE_REPEATS):
                tdist.barrier()
                start = time.perf_counter()
                tdist.all_reduce(x, group=group)
                times.append(time.perf_counter() - start)
            found.append((p, 4 * n, statistics.median(times)))
    return found


def _step_times(student, plan, model):
    """(seconds per step after the first, run_plan's result): the shortest time between consecutive
    ``torch.optim`` steps, seen by a global optimizer hook (one step, one ``optimizer.step()``)."""
    import time

    from torch.optim.optimizer import register_optimizer_step_post_hook

    stamps = []
    handle = register_optimizer_step_post_hook(
        lambda optimizer, args, kwargs: stamps.append(time.perf_counter()))
    try:
        result = student.run_plan(plan, model)
    finally:
        handle.remove()
    if len(stamps) != model["steps"]:
        return None, result
    return min(b - a for a, b in zip(stamps, stamps[1:])), result


def measure_rank_side(entries):
    """Every rank: the matmul rate, the all-reduce times, and each entry's step time."""
    import torch
    import torch.distributed as tdist

    import hybrid as student

    flops = _matmul_flops()
    allreduce = _allreduce_times()
    found = []
    for entry in entries:
        try:
            seconds, result = _step_times(student, entry["plan"], entry["model"])
        except NotImplementedError as exc:  # a stub raises on every rank alike
            return {"not_implemented": str(exc)}
        reported = result.get("step_time_s") if isinstance(result, dict) else None
        found.append({"step_time_s": seconds,
                      "reported_s": float(reported) if isinstance(reported, (int, float)) else None})
    rates = torch.tensor([flops], dtype=torch.float64)
    everyone = [torch.zeros(1, dtype=torch.float64) for _ in range(tdist.get_world_size())]
    tdist.all_gather(everyone, rates)
    return {"flops_per_rank": [float(x) for x in everyone], "allreduce": allreduce, "entries": found}


def hybrid_measure_job(entries):
    """{"flops", "alpha", "beta", "entries": [per entry], ...} or {"status", "message"}; see the docstring."""
    import statistics

    job = launcher.run(f"{__file__}:measure_rank_side", WORLD, list(entries), timeout=MEASURE_TIMEOUT_S,
                       backend="gloo")
    if job.status == "not_implemented":
        return {"status": "not_implemented", "message": job.explain()}
    if not job.ok:
        return {"status": job.status, "message": job.explain()}
    rank0 = job.results[0]
    if "not_implemented" in rank0:
        return {"status": "not_implemented", "message": rank0["not_implemented"]}
    alpha, beta = ring_allreduce_fit(rank0["allreduce"])
    # Rank 0's step times: every rank's step ends in the same collectives, so the ranks agree closely.
    return {"status": "ok", "flops": statistics.median(rank0["flops_per_rank"]),
            "alpha": alpha, "beta": beta,
            "flops_per_rank": rank0["flops_per_rank"], "allreduce": rank0["allreduce"], "entries": rank0["entries"]}


def cost_model_times(entries, cluster):
    """[{"time": float} or {"error": ...}] per entry from the student's planner.cost_model."""
    import planner

    answers = []
    for entry in entries:
        try:
            predicted = planner.cost_model(entry["plan"], entry["model"], cluster)
            answers.append({"time": float(predicted["time"])})
        except NotImplementedError as exc:
            return {"not_implemented": str(exc)}
        except Exception as exc:  # noqa: BLE001 - the check says what it raised
            answers.append({"error": f"{type(exc).__name__}: {exc}"[:400]})
    return answers
