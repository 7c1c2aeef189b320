"""Grader code that runs next to the student's ``pipeline`` module in the sandbox.

It knows no answer: the checks draw every input from the grading's secret seed
and compute every expected value (``oracles.py``) in the grader's process; this
file calls the student's functions with the inputs it is given and sends back
what they gave.

``formulas(queries)`` answers every ``make_schedule``, ``simulate`` and
``partition`` query of the checks in one call (importing torch once). An
answer is the function's value made plain data, or ``{"error": ...}`` when the
call raised; a function still a stub answers ``{"not_implemented": message}``
for all its queries. ``simulate`` on schedules that deadlock runs under a
timer (``DEADLOCK_GUARD_S``): a simulator that loops forever there costs only
that check.

``executor_rank`` is a rank function of a rank job (``autograder.sandbox.ranks``):
rank r receives, for each case, only what its stage needs: its op list, its
layers' weights (a float64 MLP: Linear layers with Tanh between them), the
microbatch inputs on the first rank and the targets on the last (the other
ranks get None in their place: only the count ``m`` is theirs), and the shape of
a boundary activation. It builds its stage from the weights, runs the student's
``run_pipeline`` under ``course.torch_audit.MessageLog`` (the point-to-point
messages it posted, in order, with a copy of what each send carried: the grader
names each send by comparing its data with its own boundary tensors), marks the
case for the launcher's count of the bytes that crossed, and emits its
gradients, its loss and its messages. ``memory_rank`` runs one case without
the log, in a job of its own, for the launcher's reading of each rank's peak
memory.
"""
from autograder.grading.checking import TooLong, plain, within
from autograder.sandbox import ranks

DEADLOCK_GUARD_S = 2  # seconds; simulating these small schedules takes microseconds
SENT_DATA_LIMIT = 4096  # elements: a send's data comes back when it is at most this large (one microbatch's is 24)


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
    "partition_errors": [...], "simulate_deadlocks": [...]}: the answers to the queries, in order."""
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


# --- on every rank of the executor's jobs ------------------------------------------------------

def _tensor(array):
    """A float64 tensor on this rank's own copy of an input, without another copy."""
    import numpy as np
    import torch

    return torch.from_numpy(np.require(array, np.float64, ["C", "W"]))


def _stage(weights):
    """This rank's stage: a Linear layer per (weight, bias) given, each followed by Tanh
    unless it is the model's last layer (``weights[-1]`` has ``"last"``)."""
    import torch

    modules = []
    for layer in weights:
        linear = torch.nn.Linear(layer["weight"].shape[1], layer["weight"].shape[0], dtype=torch.float64)
        linear.weight = torch.nn.Parameter(_tensor(layer["weight"]))
        linear.bias = torch.nn.Parameter(_tensor(layer["bias"]))
        modules.append(linear)
        if not layer["last"]:
            modules.append(torch.nn.Tanh())
    return torch.nn.Sequential(*modules)


def _run(student, part, stage):
    """The student's run_pipeline on this rank's part of a case: its return value."""
    import torch

    m = part["m"]
    microbatches = [_tensor(x) for x in part["microbatches"]] if "microbatches" in part else [None] * m
    targets = [_tensor(y) for y in part["targets"]] if "targets" in part else [None] * m
    return student.run_pipeline(stage, [tuple(op) for op in part["ops"]], microbatches, targets,
                                torch.nn.functional.mse_loss, tuple(part["activation_shape"]), dtype=torch.float64)


def _numpy(tensor):
    import torch

    if not isinstance(tensor, torch.Tensor):
        return None
    return tensor.detach().to("cpu", torch.float64).numpy().copy()


def _results(stage, loss):
    """What the grader compares: every parameter's gradient (None where it has none) and
    the loss returned (a number, None, or what it was in words)."""
    grads = [{"name": f"stage_module.{name}", "grad": _numpy(param.grad)} for name, param in stage.named_parameters()]
    value = plain(loss)
    return {"grads": grads, "loss": value if value is None or isinstance(value, (float, str)) else repr(value)[:200]}


def _message(posted):
    """A message as plain data: a send's data comes back for the grader to name."""
    data = posted["data"]
    small = data is not None and data.numel() <= SENT_DATA_LIMIT
    return {"kind": posted["kind"], "peer": plain(posted["peer"]), "tag": plain(posted["tag"]),
            "shape": [int(n) for n in posted["shape"]], "data": _numpy(data) if small else None}


def executor_rank(parts):
    """A rank of the executor's job: every case it is given (its own part of each), in
    order; one record per case, emitted as soon as it is done."""
    import torch.distributed as tdist

    import pipeline as student
    from course.torch_audit import MessageLog

    for part in parts:
        name = part["case"]
        stage = _stage(part["weights"])
        ranks.mark(f"{name}:start")  # what the executor sends, counted by the launcher
        try:
            with MessageLog() as log:
                loss = _run(student, part, stage)
            ranks.mark(f"{name}:steps")
            record = {"status": "ok", **_results(stage, loss), "messages": [_message(m) for m in log.messages]}
        except NotImplementedError as exc:  # a stub raises on every rank before any message
            record = {"status": "not_implemented", "message": str(exc)}
        tdist.barrier()  # no case's stray message can reach the next one
        ranks.emit({"case": name, **record})


def memory_rank(parts):
    """A rank of a job of cases run one after the other, each followed by a mark at which the
    launcher reads the rank's peak memory from outside."""
    import pipeline as student

    for part in parts:
        stage = _stage(part["weights"])
        try:
            record = {"status": "ok", **_results(stage, _run(student, part, stage))}
        except NotImplementedError as exc:
            record = {"status": "not_implemented", "message": str(exc)}
        del stage
        ranks.mark(f"{part['case']}:done")
        ranks.emit({"case": part["case"], **record})
