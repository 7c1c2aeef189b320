"""What lecture 11 runs: pipeline schedules on paper and for real.

Two halves. The first is plain Python: derive a schedule (the order of forward
and backward ops on every device, the backward split in two for zero-bubble
schedules) from a policy by letting a greedy list scheduler run it, run it on paper by a longest-path computation over its ops, and
cut a model's layers into balanced stages by trying every cut. The second runs on the ranks of
``course.dist.run`` (each rank is a new Python process, so it lives in a module,
not in the notebook): a small executor that sends activations forward and
gradients backward with ``torch.distributed`` point-to-point messages, and an
audit of the all-gathers torch's ``fully_shard`` (ZeRO-3) makes when a stage's
data-parallel group runs the microbatches of a pipeline.

Formats (the same as lab 11's):

- an op is ``(kind, microbatch, stage)``, kind ``"F"`` or ``"B"`` (or ``"W"``,
  the weight-gradient half of a split backward, which the lab has not); model stage
  ``s`` of ``p * v`` lives on device ``s % p``;
- a schedule is a list of ``p`` lists, the ops of each device in order;
- ``F(mb, s)`` needs ``F(mb, s-1)``; ``B(mb, s)`` needs ``F(mb, s)`` and
  ``B(mb, s+1)``;
- a timeline is a list of ``(device, kind, microbatch, stage, start, end)``.
"""
import itertools
import time

import torch
import torch.distributed as dist

# --- 1. schedules ---------------------------------------------------------------------------------


def policy(p, kind, v=1):
    """A schedule as a rule: the order in which each device takes its forwards
    and its backwards, and its cap, the most microbatch chunks it may hold
    (forward run, backward not) before it must run a backward rather than a new
    forward. The three schedules differ only in these.

    ``gpipe``: microbatches in order, no cap. ``1f1b``: the same, capped at
    ``p - d`` on device ``d``, one microbatch for each device from ``d`` to the
    last. ``interleaved`` (``v`` chunks, device ``d`` holds stages ``d, d + p,
    ...``): microbatches in groups of ``p``, a group's forwards through the
    chunks in order and its backwards in reverse; capped at Megatron-LM's
    warm-up plus one, ``2 (p - d - 1) + (v - 1) p + 1``.
    Returns ``(rank, caps)``: sorting a device's ops by ``rank`` gives its order."""
    def by_group(op):
        chunk = op[2] // p
        return op[1] // p, chunk if op[0] == "F" else -chunk, op[1]

    rules = {"gpipe": (None, lambda d: float("inf")),
             "1f1b": (None, lambda d: p - d),
             "interleaved": (by_group, lambda d: 2 * (p - d - 1) + (v - 1) * p + 1)}
    if kind not in rules:
        raise ValueError(f"no policy named {kind!r}")
    rank, cap = rules[kind]
    return rank or (lambda op: op[1]), [cap(d) for d in range(p)]


def greedy_schedule(p, m, kind, v=1, cap=None):
    """The schedule a policy produces when it runs: list scheduling on the
    simulator's clock (a forward takes 1, a backward 2). Whenever a device is
    free it runs its next forward, if that forward's input has arrived and the
    device holds fewer chunks than its cap; else its next backward, if its
    gradient has arrived; else it waits for whichever comes first. ``cap`` (one
    number or one per device) replaces the policy's. Returns the op lists the
    devices ran: a schedule that ``simulate`` can replay under other op times."""
    rank, caps = policy(p, kind, v)
    if cap is not None:
        caps = list(cap) if isinstance(cap, (list, tuple)) else [cap] * p
    stages = p * v
    queues = [{kind: sorted(((kind, mb, s) for s in range(d, stages, p) for mb in range(m)), key=rank)
               for kind in "FB"} for d in range(p)]
    order, end, free, held, clock = [[] for _ in range(p)], {}, [0] * p, [0] * p, 0

    def arrived(op):
        return all(end.get(n, clock + 1) <= clock for n in needs(op, stages))

    while any(q["F"] or q["B"] for q in queues):
        for d, q in enumerate(queues):
            if free[d] > clock:
                continue
            if q["F"] and held[d] < caps[d] and arrived(q["F"][0]):
                op = q["F"].pop(0)
            elif q["B"] and arrived(q["B"][0]):
                op = q["B"].pop(0)
            else:
                continue
            held[d] += 1 if op[0] == "F" else -1
            end[op] = free[d] = clock + (1 if op[0] == "F" else 2)
            order[d].append(op)
        later = [t for t in free if t > clock]
        if not later and any(q["F"] or q["B"] for q in queues):
            raise RuntimeError(f"deadlock: every device waits, at its cap {caps} or for an input")
        clock = min(later, default=clock)
    return order


def needs(op, stages):
    """The ops ``op`` must wait for. With the backward split (zero-bubble schedules),
    ``B`` is the input gradient only and ``W(mb, s)``, the weight gradient, needs
    just the ``B`` of its own microbatch and stage."""
    kind, mb, s = op
    if kind == "F":
        return [("F", mb, s - 1)] if s > 0 else []
    if kind == "W":
        return [("B", mb, s)]
    return [("F", mb, s)] + ([("B", mb, s + 1)] if s < stages - 1 else [])


def simulate(plan, t_f, t_b, t_comm=0.0, t_w=0.0):
    """Run ``plan`` on paper: each device runs its ops in order, each as soon as
    the device is free and what it needs has ended (``t_comm`` later if that
    ran on another device). ``t_f``/``t_b``/``t_w`` are one op's time, or a list
    with one per stage (``t_w`` only for plans with ``W`` ops). Returns the
    timeline, the makespan, the bubble (idle time / (p * makespan)) and each
    device's peak of microbatches in flight.

    An op's start is the latest of what it waits for: its device's previous op
    and the ops it needs. That is a longest-path computation over the graph of
    ops, done in a topological order (Kahn's algorithm): an op is timed once
    everything it waits for has been; ops never timed lie on a cycle, a deadlock."""
    p = len(plan)
    stages = 1 + max(s for ops in plan for _, _, s in ops)
    per_stage = {kind: (t if isinstance(t, (list, tuple)) else [t] * stages)
                 for kind, t in (("F", t_f), ("B", t_b), ("W", t_w))}
    device = {op: d for d, ops in enumerate(plan) for op in ops}
    waits = {op: [(n, t_comm if device[n] != device[op] else 0.0) for n in needs(op, stages)] for op in device}
    for ops in plan:
        for before, op in zip(ops, ops[1:]):
            waits[op].append((before, 0.0))
    unblocks = {op: [] for op in device}
    for op, pairs in waits.items():
        for n, _ in pairs:
            unblocks[n].append(op)
    left = {op: len(pairs) for op, pairs in waits.items()}
    ready = [op for op, count in left.items() if count == 0]
    start, end = {}, {}
    while ready:
        op = ready.pop()
        start[op] = max([end[n] + delay for n, delay in waits[op]], default=0.0)
        end[op] = start[op] + per_stage[op[0]][op[2]]
        for later in unblocks[op]:
            left[later] -= 1
            if left[later] == 0:
                ready.append(later)
    if len(end) < len(device):
        stuck = [next(op for op in ops if op not in end) for ops in plan if any(op not in end for op in ops)]
        raise RuntimeError(f"deadlock: next ops {stuck}")
    timeline = sorted(((device[op], *op, start[op], end[op]) for op in device), key=lambda e: (e[4], e[0]))
    makespan = max(end.values())
    busy = sum(end[op] - start[op] for op in device)
    return {"timeline": timeline, "makespan": makespan, "bubble": 1 - busy / (p * makespan),
            "peak_in_flight": [in_flight_peak(ops) for ops in plan]}


def in_flight_peak(ops):
    """The most (microbatch, stage) activations a device holds: +1 per F, -1 per
    the op that ends its backward (W when the backward is split, else B)."""
    last = "W" if any(kind == "W" for kind, _, _ in ops) else "B"
    held = peak = 0
    for kind, _, _ in ops:
        held += 1 if kind == "F" else -1 if kind == last else 0
        peak = max(peak, held)
    return peak


def zero_bubble(p, m, cap=None):
    """A zero-bubble schedule in the spirit of ZB-H1 (Qi et al., 2024), found by a
    rule rather than written down: the forwards and input gradients (B) in
    1F1B's order, each B leaving a weight gradient (W) that can run any time
    later. Time advances in unit steps (t_f = t_b = t_w = 1); at each, a free
    device runs its next F or B if its inputs have arrived, and otherwise its
    oldest waiting W. A device holding ``cap`` microbatches (F done, W not;
    default p, what 1F1B's first device holds; a list gives one per device) runs
    a waiting W before a new F. Returns the op lists each device ended up running."""
    caps = [p] * p if cap is None else list(cap) if isinstance(cap, (list, tuple)) else [cap] * p
    base, order = greedy_schedule(p, m, "1f1b"), [[] for _ in range(p)]
    nxt, waiting, held, free, end = [0] * p, [[] for _ in range(p)], [0] * p, [0] * p, {}
    clock = 0
    while any(nxt[d] < len(base[d]) or waiting[d] for d in range(p)):
        for d in range(p):
            if free[d] > clock:
                continue
            op = base[d][nxt[d]] if nxt[d] < len(base[d]) else None
            full = op is not None and op[0] == "F" and held[d] >= caps[d] and waiting[d]
            if op is not None and not full and all(end.get(n, clock + 1) <= clock for n in needs(op, p)):
                nxt[d] += 1
                if op[0] == "B":
                    waiting[d].append(("W", op[1], op[2]))
            elif waiting[d]:
                op = waiting[d].pop(0)
            else:
                continue
            held[d] += {"F": 1, "B": 0, "W": -1}[op[0]]
            end[op], free[d] = clock + 1, clock + 1
            order[d].append(op)
        clock += 1
    return order


# --- 2. balanced partitioning ---------------------------------------------------------------------


def stage_times(costs, bounds, speeds=None):
    """Seconds of each stage: the layers ``costs[bounds[i]:bounds[i+1]]`` on a device of ``speeds[i]``."""
    speeds = speeds or [1.0] * (len(bounds) - 1)
    return [sum(costs[a:b]) / speed for a, b, speed in zip(bounds, bounds[1:], speeds)]


def brute_force_partition(costs, p, speeds=None):
    """The cut whose slowest stage is fastest, found by trying every way to cut:
    the ``C(n-1, p-1)`` choices of ``p-1`` cut points (the first best one)."""
    n = len(costs)
    cuts = ([0, *c, n] for c in itertools.combinations(range(1, n), p - 1))
    return min(cuts, key=lambda b: max(stage_times(costs, b, speeds)))


def equal_count(n, p):
    """The naive cut: the same number of layers per stage."""
    return [round(i * n / p) for i in range(p + 1)]


# --- 3. a real pipeline over send/recv (runs on every rank) ---------------------------------------


def mlp(stages, width, seed=0):
    """A model of ``stages`` blocks (Linear + Tanh), float64; block ``s`` is pipeline stage ``s``."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                 for _ in range(stages)]).double()


def batch(samples, width, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(samples, width, generator=gen, dtype=torch.float64),
            torch.randn(samples, width, generator=gen, dtype=torch.float64))


def _tag(kind, mb, stage, stages):
    """A message's tag: which op receives it (unique per op)."""
    return 2 * (mb * stages + stage) + (kind == "B")


def execute(blocks, ops, x_mbs, y_mbs, p, stages, clock=None):
    """Run this rank's ``ops`` for real. ``blocks[s]`` is model stage ``s`` (only
    this rank's stages are used). F: receive the input from the device of stage
    ``s-1`` (stage 0 reads the microbatch), run the block, send the output to
    the device of stage ``s+1``; the last stage computes the loss instead,
    divided by ``m`` so that the accumulated gradient is the whole batch's.
    B: receive the output's gradient (the last stage starts from the loss),
    backpropagate, send the input's gradient back. Sends are ``isend`` (never
    block: two neighbours may send to each other at once); receives block.
    Returns the peak count of stored activations and, with ``clock``, the
    timeline of this rank's ops (each from the end of its receive to the end
    of its sends: waiting for a message shows as a gap)."""
    rank, m = dist.get_rank(), len(x_mbs)
    saved, pending, timeline, peak = {}, [], [], 0
    for kind, mb, s in ops:
        if kind == "F":
            if s == 0:
                x = x_mbs[mb]
            else:
                x = torch.empty_like(x_mbs[mb])
                dist.recv(x, src=(s - 1) % p, tag=_tag("F", mb, s, stages))
                x.requires_grad_()
            start = clock() if clock else 0.0  # the wait for the message is idle time, not work
            out = blocks[s](x)
            if s == stages - 1:
                out = torch.nn.functional.mse_loss(out, y_mbs[mb]) / m
            else:
                sent = out.detach()
                pending.append((dist.isend(sent, dst=(s + 1) % p, tag=_tag("F", mb, s + 1, stages)), sent))
            saved[mb, s] = (x, out)  # what backward needs: this microbatch's activations
            peak = max(peak, len(saved))
        else:
            x, out = saved.pop((mb, s))
            if s == stages - 1:
                start = clock() if clock else 0.0
                out.backward()
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, src=(s + 1) % p, tag=_tag("B", mb, s, stages))
                start = clock() if clock else 0.0
                out.backward(grad)
            if s > 0:
                pending.append((dist.isend(x.grad, dst=(s - 1) % p, tag=_tag("B", mb, s - 1, stages)), x.grad))
        if clock:
            timeline.append((rank, kind, mb, s, start, clock()))
    for work, _ in pending:
        work.wait()
    return peak, timeline


def warm_up_links(p):
    """Gloo opens a connection between two ranks at their first message, which
    takes far longer than a message: open every link the schedules use first."""
    rank, token = dist.get_rank(), torch.zeros(1)
    for step in (1, -1):
        work = dist.isend(token, dst=(rank + step) % p)
        dist.recv(torch.empty(1), src=(rank - step) % p)
        work.wait()


def pipeline_vs_single(kinds=(("gpipe", 1), ("1f1b", 1), ("interleaved", 2)), m=8, samples_per_mb=32, width=256):
    """On every rank: run each schedule of ``kinds`` (pairs of a policy's name and
    its chunks per device) once, one training step's gradients, and compare this
    rank's gradients with one process running the whole model on the whole batch.
    Returns per schedule the largest gradient difference, the peak of stored
    activations and the measured timeline (ms)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    warm_up_links(p)
    results = {}
    for kind, chunks in kinds:
        stages = p * chunks
        model, single = mlp(stages, width), mlp(stages, width)
        x, y = batch(m * samples_per_mb, width)
        torch.nn.functional.mse_loss(single(x), y).backward()  # the oracle: no pipeline at all
        ops = greedy_schedule(p, m, kind, chunks)[rank]
        dist.barrier()
        t0 = time.perf_counter()
        peak, timeline = execute(list(model), ops, x.chunk(m), y.chunk(m), p, stages,
                                 clock=lambda: (time.perf_counter() - t0) * 1e3)
        mine = [s for s in range(stages) if s % p == rank]
        gap = max(float((a.grad - b.grad).abs().max())
                  for s in mine for a, b in zip(model[s].parameters(), single[s].parameters()))
        results[kind] = {"gap": gap, "peak": peak, "timeline": timeline}
    return results


# --- 4. ZeRO-3 under a pipeline's microbatches: torch's own fully_shard, audited -------------------


def zero3_collectives(ms=(1, 2, 4), width=32, layers=3, samples_per_mb=4):
    """On every rank, the ranks being one stage's data-parallel group: shard a stage of
    ``layers`` Linear layers with torch's ``fully_shard``, once per layer and once
    for the whole, and run one step as a pipeline stage runs it, the forward and
    backward of each of ``m`` microbatches in turn. ``OpLog`` records the
    collectives. For each ``reshard_after_forward`` (True: ZeRO-3 proper, the
    gathered parameters freed after each use; False: kept from a microbatch's
    forward to its backward) and each m: the number of all-gathers and
    reduce-scatters, and the elements each all-gather put in (this rank's shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from course.torch_audit import OpLog

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    found = {}
    for reshard in (True, False):
        for m in ms:
            torch.manual_seed(0)
            stage = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).double()
            for layer in stage:
                fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(stage, mesh=mesh, reshard_after_forward=reshard)
            x = torch.randn(m * samples_per_mb, width, dtype=torch.float64)
            with OpLog() as log:
                for microbatch in x.chunk(m):
                    stage(microbatch).square().mean().backward()
            found[reshard, m] = {"all_gather": log.count("all_gather"), "reduce_scatter": log.count("reduce_scatter"),
                                 "gathered_elements": sorted(set(log.elements("all_gather")))}
    return {"per_layer": width * width + width, "layers": layers, "counts": found}


def lecture_job(m=8):
    """Everything lecture 11 runs on the ranks, in one job (starting processes is the slow part):
    ``pipeline_vs_single`` and ``zero3_collectives``."""
    return {"pipeline": pipeline_vs_single(m=m), "zero3": zero3_collectives()}
