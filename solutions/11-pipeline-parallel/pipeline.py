"""Lab 11 — pipeline parallelism.

A model too big for one device is cut into consecutive *stages*, one per
device; a batch is cut into ``m`` *microbatches* that flow through the stages
one after the other, forward (F) then backward (B). While device 1 runs
microbatch 0, device 0 already runs microbatch 1: the devices work at once on
different microbatches. The time a device waits is the *bubble*. You write:

1. ``partition(costs, p, speeds=None)`` — cut a list of layer costs into ``p``
   contiguous stages so that the slowest stage is as fast as possible, on
   devices of different speeds too (HetPipe's situation).
2. ``make_schedule(p, m, kind, v=1)`` — the order of F and B ops on every
   device: GPipe (all forwards, then all backwards), 1F1B (PipeDream-Flush:
   a short warm-up, then one forward, one backward, ...) and Megatron's
   interleaved 1F1B (``v`` model chunks per device).
3. ``simulate(schedule, t_f, t_b, t_comm=0)`` — run a schedule on paper: when
   each op starts and ends, the makespan, the bubble fraction and how many
   microbatches' activations each device holds at most.
4. ``run_pipeline(...)`` — the executor: run this rank's ops for real with
   ``torch.distributed`` point-to-point messages.

Data formats (plain data; the grader relies on them):

- an op is a tuple ``(kind, microbatch, stage)`` with kind ``"F"`` or ``"B"``;
  ``stage`` is the model stage ``0 .. p*v-1``; model stage ``s`` lives on
  device ``s % p`` (interleaved: device ``d`` holds chunks ``d, d+p, d+2p, ...``);
  for ``v = 1`` the stage is the device.
- a schedule is a list of ``p`` lists: ``schedule[d]`` = the ops device ``d``
  runs, in order, one at a time.
- dependencies: ``F(mb, s)`` needs ``F(mb, s-1)``; ``B(mb, s)`` needs ``F(mb, s)``
  and ``B(mb, s+1)`` (the last stage's B needs only its F).

Grade with ``k2c grade 11`` from the repository root.
"""
import torch
import torch.distributed as dist

# --- 1. Partition layers into stages --------------------------------------------------


def partition(costs, p, speeds=None):
    """Boundaries ``[0 = b0 < b1 < ... < bp = len(costs)]``: stage ``i`` holds
    layers ``costs[b_i:b_{i+1}]`` (at least one) and runs on device ``i``, in
    ``sum(costs[b_i:b_{i+1}]) / speeds[i]`` seconds. Among all such cuts, return
    one whose slowest stage is fastest. ``speeds=None`` means every device has
    speed 1. Raises ``ValueError`` when ``p > len(costs)``.

    Example: ``partition([1, 1, 1, 1], 2)`` is ``[0, 2, 4]``;
    ``partition([1, 1, 1, 1], 2, speeds=[3, 1])`` is ``[0, 3, 4]``.
    """
    # BEGIN SOLUTION: dynamic programming over how many devices take the first i layers; remember each best cut to rebuild the boundaries
    n = len(costs)
    if not 1 <= p <= n:
        raise ValueError(f"cannot cut {n} layers into {p} non-empty stages")
    speeds = [1.0] * p if speeds is None else list(speeds)
    if len(speeds) != p:
        raise ValueError(f"need one speed per stage: got {len(speeds)} speeds for p={p}")
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(p + 1)]  # best[k][i]: first i layers on k devices
    cut = [[0] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for k in range(1, p + 1):
        for i in range(k, n - (p - k) + 1):  # leave at least one layer for each later stage
            for j in range(k - 1, i):
                time = max(best[k - 1][j], sum(costs[j:i]) / speeds[k - 1])
                if time < best[k][i]:
                    best[k][i], cut[k][i] = time, j
    bounds = [n]
    for k in range(p, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]
    # END SOLUTION


# --- 2. Schedules ---------------------------------------------------------------------


def make_schedule(p, m, kind, v=1):
    """The schedule (``p`` lists of ops) of ``m`` microbatches on ``p`` devices.

    - ``"gpipe"``: every device runs F of microbatches 0..m-1, then B of 0..m-1.
    - ``"1f1b"``: device ``d`` runs ``min(p - d - 1, m)`` forwards (warm-up),
      then alternates one forward and one backward while forwards remain, then
      runs the remaining backwards (cool-down). Microbatches in order.
    - ``"interleaved"``: Megatron's interleaved 1F1B; device ``d`` holds the
      ``v`` chunks (model stages) ``d, d+p, ..., d+(v-1)p``. Microbatches go in
      groups of ``p``: a group runs through chunk 0, then chunk 1, ...; the
      k-th forward of a device is microbatch ``(k // (p*v)) * p + k % p`` on its
      chunk ``(k // p) % v``; the k-th backward the same microbatch on chunk
      ``v - 1 - (k // p) % v``. Warm-up: ``(p - d - 1) * 2 + (v - 1) * p``
      forwards (at most ``m*v``), then 1F1B, then cool-down. Requires
      ``m % p == 0``.

    ``v > 1`` is only for ``"interleaved"``; anything else raises ``ValueError``.
    """
    # BEGIN SOLUTION: build each device's forwards and backwards in order, then lay them out as warm-up forwards, alternating pairs, and cool-down
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"need p, m, v >= 1, got p={p}, m={m}, v={v}")
    if kind not in ("gpipe", "1f1b", "interleaved"):
        raise ValueError(f"unknown schedule kind {kind!r}: use 'gpipe', '1f1b' or 'interleaved'")
    if v > 1 and kind != "interleaved":
        raise ValueError(f"v={v} chunks per device only for the interleaved schedule, not {kind!r}")
    if kind == "interleaved" and m % p:
        raise ValueError(f"the interleaved schedule needs m a multiple of p, got m={m}, p={p}")
    schedule = []
    for d in range(p):
        if kind == "gpipe":
            schedule.append([("F", mb, d) for mb in range(m)] + [("B", mb, d) for mb in range(m)])
            continue
        if kind == "1f1b":
            forwards = [("F", mb, d) for mb in range(m)]
            backwards = [("B", mb, d) for mb in range(m)]
            warmup = min(p - d - 1, m)
        else:
            def microbatch(k):
                return (k // (p * v)) * p + k % p
            forwards = [("F", microbatch(k), ((k // p) % v) * p + d) for k in range(m * v)]
            backwards = [("B", microbatch(k), (v - 1 - (k // p) % v) * p + d) for k in range(m * v)]
            warmup = min((p - d - 1) * 2 + (v - 1) * p, m * v)
        ops = forwards[:warmup]
        for k in range(len(forwards) - warmup):
            ops += [forwards[warmup + k], backwards[k]]
        ops += backwards[len(forwards) - warmup:]
        schedule.append(ops)
    return schedule
    # END SOLUTION


# --- 3. Simulate a schedule -------------------------------------------------------------


def simulate(schedule, t_f, t_b, t_comm=0):
    """Run ``schedule`` on paper.

    One op of one stage takes ``t_f`` (F) or ``t_b`` (B); a dependency on an op
    of another device arrives ``t_comm`` after that op ends. Each device runs
    its ops in list order, one at a time, each as soon as the device is free
    and its dependencies are done. Returns a dict::

        {"timeline": [(device, kind, microbatch, stage, start, end), ...],
         "makespan": the time the last op ends (the first starts at 0; 0 if none),
         "bubble": idle time / (p * makespan) (0 when there is no op),
         "peak_in_flight": [per device: the most (microbatch, stage) pairs
                            whose F has run but whose B has not, at any time]}

    The last stage is the largest stage number in ``schedule`` (``p * v - 1``):
    its B needs only its own F. A device's ``peak_in_flight`` is read off its list
    alone (+1 for each F, -1 for each B, the largest running total).

    Raises ``RuntimeError`` naming what each blocked device waits for when no
    device can go on (a deadlock).
    """
    # BEGIN SOLUTION: sweep the devices again and again, starting each next op whose dependencies have ended; a sweep that starts nothing is a deadlock
    p = len(schedule)
    last_stage = max((op[2] for ops in schedule for op in ops), default=0)
    end, device_of = {}, {}
    for d, ops in enumerate(schedule):
        for op in ops:
            device_of[op] = d

    def dependencies(op):
        kind, mb, stage = op
        if kind == "F":
            return [("F", mb, stage - 1)] if stage > 0 else []
        return [("F", mb, stage)] + ([("B", mb, stage + 1)] if stage < last_stage else [])

    timeline, position, free = [], [0] * p, [0.0] * p
    while any(position[d] < len(schedule[d]) for d in range(p)):
        progressed = False
        for d in range(p):
            while position[d] < len(schedule[d]):
                op = schedule[d][position[d]]
                needs = dependencies(op)
                if any(need not in end for need in needs):
                    break
                start = max([free[d]] + [end[need] + (t_comm if device_of[need] != d else 0) for need in needs])
                end[op] = free[d] = start + (t_f if op[0] == "F" else t_b)
                timeline.append((d, op[0], op[1], op[2], start, end[op]))
                position[d] += 1
                progressed = True
        if not progressed:
            waits = [f"device {d} waits for {[n for n in dependencies(schedule[d][position[d]]) if n not in end]} "
                     f"before {schedule[d][position[d]]}" for d in range(p) if position[d] < len(schedule[d])]
            raise RuntimeError("deadlock: " + "; ".join(waits))
    makespan = max((t[5] for t in timeline), default=0.0)
    busy = sum(t[5] - t[4] for t in timeline)
    peaks = []
    for ops in schedule:
        held = peak = 0
        for kind, _, _ in ops:
            held += 1 if kind == "F" else -1
            peak = max(peak, held)
        peaks.append(peak)
    bubble = 1.0 - busy / (p * makespan) if makespan > 0 else 0.0
    return {"timeline": timeline, "makespan": makespan, "bubble": bubble, "peak_in_flight": peaks}
    # END SOLUTION


# --- 4. The executor -------------------------------------------------------------------


def run_pipeline(stage_module, ops, microbatches, targets, loss_fn, activation_shape, dtype=torch.float32,
                 group=None):
    """Run this rank's ``ops`` (``(kind, microbatch, stage)`` with stage = rank) in order.

    Every rank holds one stage (``stage_module``) of the model; rank ``r`` feeds
    rank ``r + 1``. ``F`` of microbatch ``mb``: receive the activation from rank
    ``r - 1`` (rank 0 takes ``microbatches[mb]``), run ``stage_module``, send
    the output to rank ``r + 1``; the last rank instead computes
    ``loss_fn(out, targets[mb]) / m`` (``m = len(microbatches)``). ``B`` of
    ``mb``: receive the gradient of this stage's output from rank ``r + 1``
    (the last rank starts from its loss), backpropagate it, send the gradient
    of this stage's input to rank ``r - 1`` (rank 0 sends nothing).
    ``activation_shape`` is the shape of every activation (and so of every
    gradient) crossing a stage boundary, for one microbatch, of ``dtype``.

    Each rank has only what its stage needs: ``microbatches`` holds the inputs on
    the first rank only and ``targets`` the targets on the last rank only; on the
    other ranks their entries are ``None`` (their length is still ``m``).

    Gradients accumulate in ``stage_module``'s parameters' ``.grad``; the caller
    steps the optimizer. Returns the mean loss over the microbatches (a float)
    on the last rank, ``None`` on the others.

    Ranks ``r - 1`` and ``r + 1`` are ranks of ``group``; point-to-point calls
    take global ranks, so translate them (``dist.get_global_rank``) when a
    group is given. Keep each microbatch's stage input (received as a tensor
    that requires grad, so that its gradient exists after B) and its output
    until that microbatch's B, and no longer: a stage holds the activations of
    the microbatches in flight (F run, B not yet), at most ``p - r`` on rank
    ``r`` under 1F1B, all ``m`` under GPipe (the grader reads each rank's peak
    memory).

    Every message is one microbatch's activation or gradient, sent and
    received in the order of ``ops`` (the grader records them; a receive may
    be posted together with the previous op's send, as ``batch_isend_irecv``
    does, not earlier).

    Sends must not block: a rank sending an activation forward while its
    neighbour sends it a gradient backward would otherwise wait forever.
    ``dist.isend`` returns at once; keep its handle (and the tensor it sends)
    and wait on every handle before returning. Receives (``dist.recv``) block
    until the message is there, and use ``tag=mb`` so messages cannot mix up.
    (On NCCL, a large send and a receive from the same peer must be started
    together, with ``dist.batch_isend_irecv``, as Megatron's
    ``send_forward_recv_backward`` does; the grader runs on gloo.)
    """
    # BEGIN SOLUTION: keep each microbatch's stage input and output until its backward; post sends without blocking and wait for them all at the end
    rank, world = dist.get_rank(group), dist.get_world_size(group)

    def peer(r):
        return r if group is None else dist.get_global_rank(group, r)

    device = next(stage_module.parameters()).device
    m, first, last = len(microbatches), rank == 0, rank == world - 1
    inputs, outputs, sends, loss_total = {}, {}, [], 0.0
    for kind, mb, _ in ops:
        if kind == "F":
            if first:
                x = microbatches[mb].to(device)
            else:
                x = torch.empty(activation_shape, dtype=dtype, device=device)
                dist.recv(x, src=peer(rank - 1), group=group, tag=mb)
                x.requires_grad_()
            inputs[mb] = x
            out = stage_module(x)
            if last:
                out = loss_fn(out, targets[mb].to(device)) / m
                loss_total += float(out.detach())
            else:
                sent = out.detach().contiguous()
                sends.append((dist.isend(sent, dst=peer(rank + 1), group=group, tag=mb), sent))
            outputs[mb] = out
        elif kind == "B":
            out, x = outputs.pop(mb), inputs.pop(mb)
            if last:
                out.backward()
            else:
                grad = torch.empty(activation_shape, dtype=dtype, device=device)
                dist.recv(grad, src=peer(rank + 1), group=group, tag=mb)
                out.backward(grad)
            if not first:
                sent = x.grad.contiguous()
                sends.append((dist.isend(sent, dst=peer(rank - 1), group=group, tag=mb), sent))
        else:
            raise ValueError(f"unknown op kind {kind!r} in {(kind, mb)}: use 'F' or 'B'")
    for handle, _ in sends:
        handle.wait()
    return loss_total if last else None
    # END SOLUTION
