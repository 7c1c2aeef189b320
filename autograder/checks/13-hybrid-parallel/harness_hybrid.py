"""Grader code that runs the student's ``hybrid.run_plan`` in the sandbox, as rank jobs.

The lab's ``harness.py`` re-exports these functions. Nothing here knows what
run_plan should return: the check draws each case and compares what came back
with single-process training it runs itself (``run_plan_oracles.py``, in the
grader's process).

``hybrid_cases_rank(parts)`` is a rank function of a rank job
(``autograder.sandbox.ranks``) of ``WORLD`` gloo processes. Each rank receives
only what run_plan is documented to take: for each case the plan and the model
(sizes, optimizer, steps, learning rate and seed: run_plan makes its own data
and starting weights from the seed), or plans it must refuse. For a training
case it marks ``f"{case}:start"``, calls ``run_plan(plan, model)``, marks
``f"{case}:run"`` (the launcher counts what crossed between the two marks) and
emits what run_plan returned, made plain (``returned``): its losses, its shards
as float64 arrays, its own step time. For a refusal case it emits whether each
plan raised ValueError.

``hybrid_measure_rank(parts)`` measures, in one job of ``WORLD`` processes,
what a cost model of this machine needs and what it must predict. First, before
any of the student's modules is imported into the rank (nothing of the
student's has run in these processes yet), this process's float32 matmul rate
while all ``WORLD`` multiply at once, and gloo ``all_reduce`` times over groups
of 2 and of 4 at ``ALLREDUCE_SIZES`` (the check fits α and β to them); then, for
each entry, run_plan under a global ``torch.optim`` step hook that makes a mark
after every optimizer step: the step times are the gaps between those marks by
the launcher's clock, outside the ranks. The hook itself runs in the student's
process (a run_plan that makes another number of steps shows in the count);
the student's own ``step_time_s`` is sent back beside it.

``cost_model_times(entries, cluster)`` calls the student's
``planner.cost_model(plan, model, cluster)`` for every entry in one sandboxed
call: ``[{"time": float} or {"error": "..."}]`` (a stub: ``{"not_implemented"}``).
"""
from autograder.sandbox import ranks

MATMUL_N = 256
MATMUL_SECONDS = 0.4
ALLREDUCE_SIZES = (2**6, 2**8, 2**10, 2**18, 2**20, 2**21)  # float32 elements: 256 B .. 8 MiB
ALLREDUCE_REPEATS = 7
MOST_PARAMETERS = 400  # TinyGPT of 2 layers has 28 parameters; a result with far more is cut short


def _array(value):
    """A parameter shard as a float64 NumPy array, or its repr when it is none."""
    import numpy as np
    import torch

    try:
        if isinstance(value, torch.Tensor):
            return value.detach().to("cpu", torch.float64).numpy().copy()
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError, RuntimeError):
        return repr(value)[:200]


def returned(result):
    """What run_plan returned, as plain data: {"keys", "losses" (floats, or a repr),
    "parameters" ({name: array}, or a repr), "step_time_s"}, or {"not_a_dict": type}."""
    if not isinstance(result, dict):
        return {"not_a_dict": type(result).__name__}
    out = {"keys": sorted(str(k) for k in result)[:20]}
    try:
        out["losses"] = [float(x) for x in result.get("losses")]
    except (TypeError, ValueError):
        out["losses"] = repr(result.get("losses"))[:200]
    params = result.get("parameters")
    if isinstance(params, dict):
        out["parameters"] = {str(k): _array(v) for k, v in list(params.items())[:MOST_PARAMETERS]}
    else:
        out["parameters"] = repr(params)[:200]
    seconds = result.get("step_time_s")
    out["step_time_s"] = float(seconds) if isinstance(seconds, (int, float)) else None
    return out


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
    return found


def hybrid_cases_rank(parts):
    """A rank of the cases job: every case it is given, in order; one record per case."""
    import torch.distributed as tdist

    import hybrid as student

    for case in parts:
        name = case["case"]
        try:
            if "refuse" in case:
                record = {"status": "ok", "refusals": _refusals(student, case)}
            else:
                ranks.mark(f"{name}:start")
                result = student.run_plan(case["plan"], case["model"])
                ranks.mark(f"{name}:run")
                record = {"status": "ok", **returned(result)}
        except NotImplementedError as exc:  # a stub raises on every rank alike
            record = {"status": "not_implemented", "message": str(exc)}
        tdist.barrier()  # the next case starts together
        ranks.emit({"case": name, **record})


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


def hybrid_measure_rank(parts):
    """A rank of the measuring job: the machine first, then each entry's run_plan, its
    optimizer steps marked for the launcher's clock."""
    ranks.emit({"case": "machine", "flops": _matmul_flops(), "allreduce": _allreduce_times()})

    from torch.optim.optimizer import register_optimizer_step_post_hook

    import hybrid as student  # only now: the machine was measured before anything of the student's ran

    for part in parts:
        name, steps = part["case"], [0]

        def stepped(optimizer, args, kwargs, name=name, steps=steps):
            steps[0] += 1
            ranks.mark(f"{name}:step {steps[0]}")

        ranks.mark(f"{name}:start")
        handle = register_optimizer_step_post_hook(stepped)
        try:
            result = student.run_plan(part["plan"], part["model"])
        finally:
            handle.remove()
        reported = result.get("step_time_s") if isinstance(result, dict) else None
        ranks.emit({"case": name, "steps": steps[0],
                    "reported_s": float(reported) if isinstance(reported, (int, float)) else None})


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
