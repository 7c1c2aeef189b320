"""Grader code that runs next to the student's ``pipeline`` module in the sandbox.

``formulas(queries)`` answers every ``make_schedule``, ``simulate`` and
``partition`` query of the checks in one call (importing torch once). An
answer is the function's value made plain data, or ``{"error": ...}`` when the
call raised; a function still a stub answers ``{"not_implemented": message}``
for all its queries. ``simulate`` on schedules that deadlock runs under a
timer (``DEADLOCK_GUARD_S``): a simulator that loops forever there costs only
that check.

``executor_job(n, cases)`` runs the student's ``run_pipeline`` on ``n`` ranks
for every case (the check's own op lists, one list per rank) in one
``course.dist`` job. Every rank builds the same float64 MLP — 8 Linear
layers, Tanh between them, widths 5 -> 8 -> ... -> 8 -> 3 — and keeps the
``8 / n`` consecutive Linear layers (with their Tanh) of its stage. The
oracle, computed on every rank before the student's code runs: the whole
model in one process on the concatenated batch, mean squared error, one
backward; its gradients of this rank's layers and its loss. Each rank records
the largest difference of every gradient and, on the last rank, the loss
``run_pipeline`` returned. It also records, in the order they were posted,
the point-to-point messages ``run_pipeline`` sent and received
(``course.torch_audit.MessageLog``: peer, tag, shape), each send named by what
its data is: the oracle's output of this stage for microbatch mb ("F", mb) or
its gradient of this stage's input ("B", mb), or None when it is neither. A
rank writes a file per case as soon as it is done, so after a hang the files
say which case it was; the cases after it are not run (they use the same code
and would hang as long), see ``autograder.grading.checking.run_cases``.
"""
from autograder.grading.checking import TooLong, plain, rank_records, run_cases, save_record, within
from course import dist as launcher

DIMS = (5, 8, 8, 8, 8, 8, 8, 8, 3)  # 8 Linear layers; every stage boundary carries width 8
MICROBATCH_ROWS = 3
ACTIVATION_SHAPE = (MICROBATCH_ROWS, DIMS[1])  # one microbatch at any stage boundary
SEED = 1101
# A correct job of 4 processes takes 3-6 s on 2 busy cores; a deadlock is stopped sooner, once the job idles.
JOB_TIMEOUT_S = 30
DEADLOCK_GUARD_S = 2  # seconds; simulating these 2-device schedules takes microseconds


def _answer_all(function, calls):
    """[plain value or {"error", "call"}] for each (args, call text); {"not_implemented"} for a stub."""
    answers = []
    for args, call in calls:
        try:
            answers.append(plain(function(*args)))
        except NotImplementedError as exc:
            return {"not_implemented": str(exc)}
        except Exception as exc:  # the check says what the call raised
            answers.append({"error": f"{type(exc).__name__}: {exc}"[:400], "call": call})
    return answers


def formulas(queries):
    """{"make_schedule": [...], "make_schedule_errors": [...], "simulate": [...], "partition": [...],
    "partition_errors": [...]}: the answers to the queries, in order."""
    import pipeline

    def schedule_call(q):
        return f"make_schedule({q[0]}, {q[1]}, {q[2]!r}, v={q[3]})"

    answers = {
        "make_schedule": _answer_all(pipeline.make_schedule, [(q, schedule_call(q)) for q in queries["make_schedule"]]),
        "make_schedule_errors": _answer_all(pipeline.make_schedule,
                                            [(q, schedule_call(q)) for q in queries["make_schedule_errors"]]),
        "simulate": _answer_all(pipeline.simulate,
                                [(q, f"simulate(<{len(q[0])} devices>, t_f={q[1]}, t_b={q[2]}, t_comm={q[3]})")
                                 for q in queries["simulate"]]),
        "partition": _answer_all(pipeline.partition,
                                 [(q, f"partition({q[0]}, {q[1]}, speeds={q[2]})") for q in queries["partition"]]),
        "partition_errors": _answer_all(pipeline.partition,
                                        [(q, f"partition({q[0]}, {q[1]})") for q in queries["partition_errors"]]),
    }
    answers["simulate_deadlocks"] = simulate_deadlocks(queries["simulate_deadlocks"])
    return answers


def simulate_deadlocks(schedules, seconds=DEADLOCK_GUARD_S):
    """Per schedule: {"error": what simulate raised}, {"value": what it returned} or
    {"hung": seconds} when it ran longer than ``seconds``."""
    import pipeline

    outcomes = []
    for schedule in schedules:
        try:
            outcomes.append({"value": plain(within(seconds, pipeline.simulate, schedule, 1, 2))})
        except TooLong:
            outcomes.append({"hung": seconds})
        except NotImplementedError as exc:
            return {"not_implemented": str(exc)}
        except Exception as exc:
            outcomes.append({"error": f"{type(exc).__name__}: {exc}"[:400]})
    return outcomes


# --- on every rank ------------------------------------------------------------------------------

def _layers():
    import torch

    torch.manual_seed(SEED)
    layers = []
    for i, (a, b) in enumerate(zip(DIMS[:-1], DIMS[1:])):
        block = [torch.nn.Linear(a, b, dtype=torch.float64)]
        if i < len(DIMS) - 2:
            block.append(torch.nn.Tanh())
        layers.append(block)
    return layers  # one [Linear, Tanh] block per layer, the last without Tanh


def _stage(rank, n):
    import torch

    per = len(_layers()) // n
    return torch.nn.Sequential(*[m for block in _layers()[rank * per:(rank + 1) * per] for m in block]), per


def _batch(microbatches):
    import torch

    g = torch.Generator().manual_seed(SEED + 1)
    xs = [torch.randn(MICROBATCH_ROWS, DIMS[0], generator=g, dtype=torch.float64) for _ in range(microbatches)]
    ys = [torch.randn(MICROBATCH_ROWS, DIMS[-1], generator=g, dtype=torch.float64) for _ in range(microbatches)]
    return xs, ys


def _oracle(rank, n, microbatches):
    """Training the whole model in one process: this rank's layers' gradients (in
    parameter order), the loss, and per microbatch the stage's output and the
    gradient of its input (what the rank sends forward and back)."""
    import torch

    blocks = _layers()
    xs, ys = _batch(microbatches)
    per = len(blocks) // n
    h, boundaries = torch.cat(xs), []  # boundaries[s]: the input of stage s (s >= 1)
    for s in range(n):
        if s:
            h.retain_grad()
            boundaries.append(h)
        h = torch.nn.Sequential(*[m for block in blocks[s * per:(s + 1) * per] for m in block])(h)
    loss = torch.nn.functional.mse_loss(h, torch.cat(ys))
    loss.backward()
    grads = [p.grad for block in blocks[rank * per:(rank + 1) * per] for m in block for p in m.parameters()]
    rows = MICROBATCH_ROWS
    sent_forward = boundaries[rank].detach().split(rows) if rank < n - 1 else ()
    sent_backward = boundaries[rank - 1].grad.split(rows) if rank > 0 else ()
    return grads, float(loss), sent_forward, sent_backward


def _carries(message, rank, sent_forward, sent_backward):
    """What a send's data is: ["F", mb] (this stage's output of microbatch mb, sent to
    rank + 1), ["B", mb] (the gradient of its input, to rank - 1), or None."""
    import torch

    candidates = {rank + 1: ("F", sent_forward), rank - 1: ("B", sent_backward)}.get(message["peer"])
    if candidates is None:
        return None
    kind, tensors = candidates
    for mb, want in enumerate(tensors):
        data = message["data"]
        if data.shape == want.shape and torch.allclose(data.to(want.dtype), want, rtol=1e-9, atol=1e-12):
            return [kind, mb]
    return None


def rank_side(cases, folder):
    """Every rank: run each case; write one file per case and rank when it is done."""
    import torch
    import torch.distributed as tdist

    import pipeline as student
    from course.torch_audit import MessageLog

    rank, n = tdist.get_rank(), tdist.get_world_size()
    for name, schedule in cases:
        microbatches = 1 + max(op[1] for op in schedule[0])
        want, oracle_loss, sent_forward, sent_backward = _oracle(rank, n, microbatches)
        stage, _ = _stage(rank, n)
        xs, ys = _batch(microbatches)
        record = {"status": "ok"}
        try:
            launcher.mark(f"{name}:start")  # what the executor sends, counted by the launcher
            with MessageLog() as log:
                loss = student.run_pipeline(stage, [tuple(op) for op in schedule[rank]], xs, ys,
                                            torch.nn.functional.mse_loss, ACTIVATION_SHAPE, dtype=torch.float64)
            launcher.mark(f"{name}:steps")
            errors = []
            for (param_name, param), grad in zip(stage.named_parameters(), want):
                label = f"stage_module.{param_name}"
                errors.append((label, None if param.grad is None else float((param.grad - grad).abs().max())))
            messages = [{"kind": m["kind"], "peer": m["peer"], "tag": plain(m["tag"]), "shape": list(m["shape"]),
                         "carries": _carries(m, rank, sent_forward, sent_backward) if m["kind"] == "send" else None}
                        for m in log.messages]
            record.update(errors=errors, loss=plain(loss), oracle_loss=oracle_loss, messages=messages,
                          activation_shape=list(ACTIVATION_SHAPE))
        except NotImplementedError as exc:  # a stub raises on every rank before any message
            record = {"status": "not_implemented", "message": str(exc)}
        tdist.barrier()  # no case's stray message can reach the next one
        save_record(folder, name, rank, record)
    return None


def executor_job(n, cases, timeout=JOB_TIMEOUT_S):
    """{case name: {"status": ..., "ranks": per-rank records, or "message"}} on ``n`` ranks."""
    # gloo on both tiers: the model is tiny and its tensors live on the CPU.
    start = lambda pending, folder: launcher.run(f"{__file__}:rank_side", n, pending, folder, timeout=timeout,
                                                 backend="gloo", idle_timeout=launcher.IDLE_TIMEOUT_S,
                                                 count_wire=True)
    return run_cases(start, cases, n, rank_records, stem=lambda case: case[0], name=lambda case: case[0],
                     after_hang=lambda hung, pending: list(pending), counted=("steps",))
