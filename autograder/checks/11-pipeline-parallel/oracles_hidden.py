"""Lab 11's hidden oracles: the grader's own schedules and simulator, which compute
what the lab's ``make_schedule`` and ``simulate`` return. Only the hidden checks
(``check_pipeline_hidden.py``) use them; ``k2c release`` leaves both files out
(lab.toml's ``hidden``), so no student's code can load them and return their answers.

- ``make_schedule``: GPipe, 1F1B (warm-up p-d-1) and Megatron's interleaved 1F1B.
- ``simulate``: timing as a longest path through the graph whose edges are the
  dependencies (plus ``t_comm`` across devices) and each device's list order:
  an op starts when its device's previous op and its dependencies have ended.

tests/test_11_pipeline_parallel.py holds them to the closed forms (``oracles.closed_form``)
for p = 1..5, m = 1..9 and several (t_f, t_b), to ``oracles.timeline_problem`` on
random schedules, and to the executor's table (``oracles.EXECUTOR_SCHEDULES``).
"""
from autograder.grading.checking import load_beside

oracles = load_beside(__file__, "oracles")


def simulate(schedule, t_f, t_b, t_comm=0, stages=None):
    """The check's timing: {op: (device, start, end)}, makespan, bubble, peak in flight.
    An op starts when the previous op of its device and its dependencies have ended
    (plus ``t_comm`` for a dependency on another device): a longest path, memoised."""
    p = len(schedule)
    stages = stages or max((op[2] for ops in schedule for op in ops), default=-1) + 1
    device_of, previous = {}, {}
    for d, ops in enumerate(schedule):
        for i, op in enumerate(ops):
            device_of[tuple(op)] = d
            previous[tuple(op)] = tuple(ops[i - 1]) if i else None
    end = {}

    def finish(op, visiting=()):
        if op not in end:
            if op in visiting:
                raise RuntimeError(f"deadlock around {oracles.op_text(op)}")
            before = [previous[op]] if previous[op] else []
            ready = [finish(before[0], visiting + (op,))] if before else [0.0]
            for need in oracles.dependencies(op, stages):
                hop = t_comm if device_of[need] != device_of[op] else 0
                ready.append(finish(need, visiting + (op,)) + hop)
            end[op] = max(ready) + (t_f if op[0] == "F" else t_b)
        return end[op]

    timing = {op: (device_of[op], finish(op) - (t_f if op[0] == "F" else t_b), finish(op)) for op in device_of}
    makespan = max((e for _, _, e in timing.values()), default=0)
    busy = sum(e - s for _, s, e in timing.values())
    bubble = 1 - busy / (p * makespan) if makespan else 0  # an empty schedule: nothing runs, nobody waits
    return {"timing": timing, "makespan": makespan, "bubble": bubble, "peak_in_flight": oracles.peak_in_flight(schedule)}


def make_schedule(p, m, kind, v=1):
    """The check's GPipe, 1F1B (warm-up p-d-1) and Megatron interleaved 1F1B."""
    if kind == "gpipe":
        return [[("F", mb, d) for mb in range(m)] + [("B", mb, d) for mb in range(m)] for d in range(p)]
    schedule = []
    for d in range(p):
        if kind == "1f1b":
            fwd = [("F", mb, d) for mb in range(m)]
            bwd = [("B", mb, d) for mb in range(m)]
            warm = min(p - d - 1, m)
        else:  # Megatron: groups of p microbatches through chunk 0, 1, ..., v-1; backward the other way
            fwd, bwd = [], []
            for k in range(m * v):
                chunk, mb = (k // p) % v, (k // (p * v)) * p + k % p
                fwd.append(("F", mb, chunk * p + d))
                bwd.append(("B", mb, (v - 1 - chunk) * p + d))
            warm = min(2 * (p - d - 1) + (v - 1) * p, m * v)
        steady = len(fwd) - warm
        ops = list(fwd[:warm])
        for i in range(steady):
            ops += [fwd[warm + i], bwd[i]]
        schedule.append(ops + bwd[steady:])
    return schedule
