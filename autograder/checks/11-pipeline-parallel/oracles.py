"""Lab 11's public oracles: they check an answer, they do not compute one.

- ``validate``: is a schedule every (kind, microbatch, stage) op exactly once,
  on device ``stage % p``, in an order that cannot deadlock (each device runs
  its next op as soon as the op's dependencies have run); if not, what is
  wrong ("deadlock: device 0 waits for ... while device 1 waits for ...").
- ``timeline_problem``: is a timeline the one ``simulate`` must give for a
  schedule: each op of it checked against its own neighbours in that timeline
  (it starts when its device's previous op has ended and its dependencies
  have arrived, and lasts ``t_f`` or ``t_b``). No timing is computed here: the
  check reads every start and end from the student's timeline, and by
  induction over the dependencies the only timeline that passes is the right one.
- ``peak_in_flight``: the most microbatches a device's list holds (F run, B
  not yet), counted along the list.
- ``closed_form``: GPipe and 1F1B take (m + p - 1)(t_f + t_b), bubble
  (p - 1)/(m + p - 1); interleaved 1F1B with v chunks per device and per-chunk
  times (v m + p - 1)(t_f + t_b), bubble (p - 1)/(v m + p - 1).
- ``brute_force_partition``: the smallest bottleneck, by trying every cut (the
  lab's partition is a dynamic program; this is the exhaustive search it must
  agree with, and it gives the best time, not the cut).
- ``random_schedule``: a valid schedule in a random order (a random topological
  order of the ops, cut into the devices' lists): inputs, not answers; so are
  ``shuffled_schedule`` (valid, microbatches out of order) and
  ``deadlocked_schedule`` (every op once, in an order that deadlocks).
- ``executor_schedule``: the GPipe and 1F1B op lists the executor runs (p = 2
  and 4, m = 4), written out as a table.
- ``draw_model`` and ``train_whole_model``: the executor's float64 MLP, drawn
  from a generator, and one training step of the whole model in one process
  (backpropagation by hand in NumPy, no pipeline): the loss, every layer's
  gradient, and every stage's boundary tensors per microbatch (its output, the
  gradient of its input), which name what each send of an executor carried
  (``carried``). tests/test_11_pipeline_parallel.py holds it to torch's autograd.
- ``message_problem``: do an executor's point-to-point messages, as each rank
  posted them, follow the op lists it was given (one microbatch each, in the
  ops' order)? Each receive gets the oldest unmatched send from its source
  with its tag, as gloo matches them, so what a receive carried is what that
  send's data was.

The oracles that compute the lab's answers (the grader's own schedules and
simulator) are in ``oracles_hidden.py``, which only the hidden checks use.
"""
import itertools
import math

import numpy as np


def op_text(op):
    kind, mb, stage = op
    return f"{kind}(microbatch {mb}, stage {stage})"


def dependencies(op, stages):
    """The ops ``op`` needs: F(mb, s) needs F(mb, s-1); B(mb, s) needs F(mb, s) and B(mb, s+1)."""
    kind, mb, stage = op
    if kind == "F":
        return [("F", mb, stage - 1)] if stage > 0 else []
    return [("F", mb, stage)] + ([("B", mb, stage + 1)] if stage + 1 < stages else [])


def validate(schedule, p, m, v=1):
    """None when ``schedule`` runs every op of ``m`` microbatches through ``p * v``
    stages exactly once, each on its device, without a deadlock; else what is wrong."""
    stages = p * v
    if not isinstance(schedule, (list, tuple)) or len(schedule) != p:
        return f"expected a list of {p} lists (one per device), got {str(schedule)[:120]}"
    where = {}
    for d, ops in enumerate(schedule):
        if not isinstance(ops, (list, tuple)):
            return f"schedule[{d}] should be a list of ops, got {ops!r}"
        for op in ops:
            if not (isinstance(op, (list, tuple)) and len(op) == 3 and op[0] in ("F", "B")
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in op[1:])
                    and 0 <= op[1] < m and 0 <= op[2] < stages):
                return (f"device {d} has {op!r}, which is not an op (kind, microbatch, stage) with kind 'F' or "
                        f"'B', microbatch in 0..{m - 1} and stage in 0..{stages - 1}")
            op = tuple(op)
            if op in where:
                return f"{op_text(op)} is run twice (on devices {where[op]} and {d})"
            if op[2] % p != d:
                return f"{op_text(op)} is on device {d}, but stage {op[2]} lives on device {op[2] % p}"
            where[op] = d
    missing = [(k, mb, s) for k in "FB" for mb in range(m) for s in range(stages) if (k, mb, s) not in where]
    if missing:
        return f"{len(missing)} ops are never run, e.g. {op_text(missing[0])}"
    return _deadlock(schedule, stages)


def _deadlock(schedule, stages):
    """None when the ops can all run, else the deadlock in words. The ops and two kinds of
    edges (each op after its device's previous op, each op after what it needs) form a
    graph; the schedule runs exactly when that graph has no cycle. Kahn's algorithm peels
    off ops with nothing left to wait for; whatever is never peeled off is stuck."""
    ops = [tuple(op) for ops_of_device in schedule for op in ops_of_device]
    waits_for = {op: set(dependencies(op, stages)) for op in ops}
    for ops_of_device in schedule:
        for earlier, later in zip(ops_of_device, ops_of_device[1:]):
            waits_for[tuple(later)].add(tuple(earlier))
    unblocks = {op: [] for op in ops}
    for op, needed in waits_for.items():
        for need in needed:
            unblocks[need].append(op)
    remaining = {op: len(needed) for op, needed in waits_for.items()}
    ready = [op for op, count in remaining.items() if count == 0]
    peeled = set()
    while ready:
        op = ready.pop()
        peeled.add(op)
        for after in unblocks[op]:
            remaining[after] -= 1
            if remaining[after] == 0:
                ready.append(after)
    if len(peeled) == len(ops):
        return None
    waits = []
    for d, ops_of_device in enumerate(schedule):
        stuck = next((tuple(op) for op in ops_of_device if tuple(op) not in peeled), None)
        if stuck is not None:
            needs = [op_text(n) for n in dependencies(stuck, stages) if n not in peeled]
            waits.append(f"device {d} waits for {' and '.join(needs)} before its {op_text(stuck)}")
    return "deadlock: " + " while ".join(waits)


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def timeline_problem(schedule, t_f, t_b, t_comm, timeline, tolerance=1e-9):
    """None when ``timeline`` (simulate's list of (device, kind, microbatch, stage,
    start, end)) is the timeline of the valid ``schedule``: one entry per op, on its
    device, lasting ``t_f`` (F) or ``t_b`` (B), starting exactly when both its
    device's previous op has ended (0 for the first) and each dependency has ended
    (+ ``t_comm`` for one that ran on another device). Else what is wrong, for the
    earliest wrong op whose own predecessors are right: a wrong end makes the ops
    that wait for it look wrong too, and the one named is the cause."""
    if not isinstance(timeline, (list, tuple)) or not all(
            isinstance(e, (list, tuple)) and len(e) == 6 for e in timeline):
        return (f"the timeline should be a list of (device, kind, microbatch, stage, start, end), got "
                f"{str(timeline)[:200]}")
    stages = max((op[2] for ops in schedule for op in ops), default=-1) + 1
    device_of = {tuple(op): d for d, ops in enumerate(schedule) for op in ops}
    entries = {}
    for entry in timeline:
        device, kind, mb, stage, start, end = entry
        if not (_number(start) and _number(end)):
            return f"the timeline's entry {tuple(entry)} should end with two finite numbers, start and end"
        try:
            entries[(kind, mb, stage)] = (device, start, end)
        except TypeError:  # a list where a kind or number should be
            return f"the timeline's entry {tuple(entry)} should be (device, kind, microbatch, stage, start, end)"
    if len(entries) != len(timeline) or len(timeline) != len(device_of):
        return (f"the timeline has {len(timeline)} entries ({len(entries)} different ops), expected one per op: "
                f"{len(device_of)}")
    missing = [op for op in device_of if op not in entries]
    if missing:
        return f"{op_text(missing[0])} is missing from the timeline"
    wrong = []
    for d, ops in enumerate(schedule):
        for i, op in enumerate(map(tuple, ops)):
            device, start, end = entries[op]
            duration = t_f if op[0] == "F" else t_b
            if device != d:
                wrong.append((start, op, f"{op_text(op)} is on device {device} in the timeline, but device {d} runs it"))
                continue
            if not math.isclose(end - start, duration, abs_tol=tolerance):
                wrong.append((start, op, f"{op_text(op)} runs from {start:g} to {end:g}, which is {end - start:g}; an "
                                     f"{op[0]} takes {'t_f' if op[0] == 'F' else 't_b'} = {duration:g}"))
                continue
            free = entries[tuple(ops[i - 1])][2] if i else 0
            arrivals = [(need, entries[need][2] + (t_comm if device_of[need] != d else 0))
                        for need in dependencies(op, stages)]
            should = max([free] + [at for _, at in arrivals])
            if not math.isclose(start, should, abs_tol=tolerance):
                why = [f"device {d} is free at {free:g}" + ("" if i else " (its first op)")]
                why += [f"{op_text(need)} " + (f"arrives at {at:g} (ends at {entries[need][2]:g}, + t_comm from "
                                               f"device {device_of[need]})" if device_of[need] != d else
                                               f"ends at {at:g} on the same device")
                        for need, at in arrivals]
                wrong.append((start, op, f"{op_text(op)} starts at {start:g} on device {d}, expected {should:g}: "
                                     f"{'; '.join(why)} (an op starts as soon as its device is free and its "
                                     "dependencies have arrived)"))
    if not wrong:
        return None
    before = {tuple(op): ([tuple(ops[i - 1])] if i else []) + dependencies(tuple(op), stages)
              for ops in schedule for i, op in enumerate(ops)}
    bad = {op for _, op, _ in wrong}
    causes = [w for w in wrong if not bad.intersection(before[w[1]])] or wrong
    return min(causes)[2]


def peak_in_flight(schedule):
    """Per device: the most microbatches in flight along its list (F run, B not yet):
    the largest running total of +1 per F and -1 per B, 0 for an empty list."""
    return [max(itertools.accumulate(1 if op[0] == "F" else -1 for op in ops), default=0) for ops in schedule]


def closed_form(p, m, t_f, t_b, v=1):
    """(makespan, bubble) of GPipe/1F1B (v = 1) and interleaved 1F1B (per-chunk times)."""
    return (v * m + p - 1) * (t_f + t_b), (p - 1) / (v * m + p - 1)


def random_schedule(rng, p, m, v):
    """A valid schedule: a random order in which every op runs after its dependencies,
    cut into the devices' lists."""
    stages, schedule, done = p * v, [[] for _ in range(p)], set()
    todo = {(k, mb, s) for k in "FB" for mb in range(m) for s in range(stages)}
    while todo:
        op = rng.choice(sorted(o for o in todo if all(n in done for n in dependencies(o, stages))))
        todo.remove(op)
        done.add(op)
        schedule[op[2] % p].append(op)
    return schedule


def stage_time(costs, lo, hi, speed):
    return sum(costs[lo:hi]) / speed


def bottleneck(costs, bounds, speeds):
    return max(stage_time(costs, a, b, s) for a, b, s in zip(bounds[:-1], bounds[1:], speeds))


def brute_force_partition(costs, p, speeds=None):
    """The smallest bottleneck over every cut of ``costs`` into ``p`` non-empty stages."""
    speeds = speeds or [1.0] * p
    n = len(costs)
    return min(bottleneck(costs, [0, *cuts, n], speeds) for cuts in itertools.combinations(range(1, n), p - 1))


# The executor's GPipe and 1F1B op lists, device d = stage d: one string per device.
EXECUTOR_SCHEDULES = {
    ("gpipe", 2, 4): ["F0 F1 F2 F3 B0 B1 B2 B3"] * 2,
    ("gpipe", 4, 4): ["F0 F1 F2 F3 B0 B1 B2 B3"] * 4,
    ("1f1b", 2, 4): ["F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"],
    ("1f1b", 4, 4): ["F0 F1 F2 F3 B0 B1 B2 B3", "F0 F1 F2 B0 F3 B1 B2 B3", "F0 F1 B0 F2 B1 F3 B2 B3",
                     "F0 B0 F1 B1 F2 B2 F3 B3"],
    ("1f1b", 2, 2): ["F0 F1 B0 B1", "F0 B0 F1 B1"],
    ("1f1b", 2, 8): ["F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
                     "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"],
}


def executor_schedule(kind, p, m=4):
    """The ``kind`` schedule of ``EXECUTOR_SCHEDULES`` on ``p`` devices, as op lists."""
    return [[(word[0], int(word[1:]), d) for word in ops.split()]
            for d, ops in enumerate(EXECUTOR_SCHEDULES[kind, p, m])]


def shuffled_schedule(rng, p, m):
    """A valid schedule (stage d on device d) whose device 0 runs its forwards out of
    microbatch order, so neither GPipe's nor 1F1B's: an executor that runs a schedule of
    its own, or numbers the microbatches itself, sends them in another order."""
    while True:
        schedule = random_schedule(rng, p, m, 1)
        forwards = [op[1] for op in schedule[0] if op[0] == "F"]
        if forwards != sorted(forwards):
            return schedule


def deadlocked_schedule(rng, p, m):
    """Every op of ``m`` microbatches on ``p`` devices once, on its device, in an order that
    deadlocks: a valid schedule with one op of a device moved before earlier ones."""
    schedule = random_schedule(rng, p, m, 1)
    while True:
        device = rng.randrange(p)
        i, j = sorted(rng.sample(range(len(schedule[device])), 2))
        moved = [list(ops) for ops in schedule]
        moved[device].insert(i, moved[device].pop(j))
        if (validate(moved, p, m) or "").startswith("deadlock"):
            return moved


# --- the executor's model, trained in one process -------------------------------------------

def draw_model(rng, dims):
    """[(weight [out, in], bias [out])] of each Linear layer of an MLP of widths ``dims``:
    torch's default initialisation (uniform in +-1/sqrt(in)), drawn from ``rng`` (NumPy)."""
    layers = []
    for a, b in zip(dims[:-1], dims[1:]):
        bound = 1 / math.sqrt(a)
        layers.append((rng.uniform(-bound, bound, (b, a)), rng.uniform(-bound, bound, b)))
    return layers


def _product(a, b):
    """``a @ b`` as a sum over its smallest dimension (every product here has one of at most
    8): whole-array NumPy on one core. A BLAS's threads, on a busy machine, made the wide
    memory case's oracle take seconds instead of a fraction of one."""
    (m, k), n = a.shape, b.shape[1]
    if k <= min(m, n):
        return sum(a[:, j, None] * b[None, j, :] for j in range(k))
    if n <= m:
        return np.stack([(a * b[:, j]).sum(1) for j in range(n)], axis=1)
    return np.stack([(a[i, :, None] * b).sum(0) for i in range(m)])


def train_whole_model(layers, xs, ys, p):
    """One training step of the whole MLP (Linear layers, Tanh between them) in one
    process, float64, with the mean squared error over the whole batch (the mean of the
    microbatches' means: they are of equal size), by hand in NumPy, one microbatch at a
    time; cut into ``p`` stages of ``len(layers) / p`` layers for what crosses between them:
    {"loss", "grads": per layer (dweight, dbias), "outputs": {stage s < p-1: its output per
    microbatch}, "input_grads": {stage s > 0: the gradient of its input per microbatch}}."""
    per, m, last = len(layers) // p, len(xs), len(layers) - 1
    grads = [(np.zeros_like(w), np.zeros_like(b)) for w, b in layers]
    found = {"loss": 0.0, "grads": grads, "outputs": {s: [] for s in range(p - 1)},
             "input_grads": {s: [] for s in range(1, p)}}
    for x, y in zip(xs, ys):
        inputs = []  # inputs[i]: the input of layer i; the output of a Tanh is the next layer's input
        for i, (w, b) in enumerate(layers):
            inputs.append(x)
            if i and i % per == 0:
                found["outputs"][i // per - 1].append(x)
            x = _product(x, w.T) + b
            if i < last:
                x = np.tanh(x)
        found["loss"] += float(np.mean((x - y) ** 2)) / m
        grad = 2 * (x - y) / (y.size * m)  # of the output, for this microbatch's share of the mean
        for i in range(last, -1, -1):
            if i < last:
                grad = grad * (1 - inputs[i + 1] ** 2)  # through the Tanh: 1 - tanh^2
            grads[i][0][...] += _product(grad.T, inputs[i])
            grads[i][1][...] += grad.sum(0)
            grad = _product(grad, layers[i][0])
            if i and i % per == 0:
                found["input_grads"][i // per].append(grad)
    return found


def carried(data, peer, rank, trained):
    """What a send of ``rank`` to ``peer`` carried: ["F", mb] (its stage's output of
    microbatch mb, to rank + 1), ["B", mb] (the gradient of its stage's input, to rank - 1),
    or None when its data is neither (or did not come back)."""
    if data is None:
        return None
    kind, tensors = {rank + 1: ("F", trained["outputs"].get(rank, [])),
                     rank - 1: ("B", trained["input_grads"].get(rank, []))}.get(peer, (None, []))
    data = np.asarray(data, dtype=float)
    for mb, want in enumerate(tensors):
        if data.shape == want.shape and np.allclose(data, want, rtol=1e-9, atol=1e-12):
            return [kind, mb]
    return None


# --- the executor's messages ------------------------------------------------------------------

def expected_messages(ops, rank, p):
    """(op index, "send" or "recv", peer, (kind, mb)) for what ``rank`` of ``p`` posts for its
    ``ops``, in order: F(mb) receives mb's activation from rank - 1 and sends its output to
    rank + 1; B(mb) receives the gradient of its output from rank + 1 and sends the gradient
    of its input to rank - 1 (the first and last ranks skip the messages they have no peer for)."""
    events = []
    for i, (kind, mb, _) in enumerate(ops):
        source, target = (rank - 1, rank + 1) if kind == "F" else (rank + 1, rank - 1)
        if 0 <= source < p:
            events.append((i, "recv", source, (kind, mb)))
        if 0 <= target < p:
            events.append((i, "send", target, (kind, mb)))
    return events


NOUN = {"send": "send", "recv": "receive"}


def _message_text(direction, peer, carries):
    """A message in words: F2 to rank 1 (microbatch 2's activation), B0 from rank 2 (a gradient)."""
    return f"{carries[0]}{carries[1]} {'to' if direction == 'send' else 'from'} rank {peer}"


def _received(messages):
    """(per rank, (direction, peer, (kind, mb)) for each message in posting order, None), a
    receive's (kind, mb) being that of the send it matches; or (None, the problem that stops it)."""
    sent = {}  # (source, destination, tag) -> what its sends carried, oldest first
    for r, posted in enumerate(messages):
        for m in posted:
            if m["kind"] == "send":
                sent.setdefault((r, m["peer"], m["tag"]), []).append(m["carries"])
    found = []
    for r, posted in enumerate(messages):
        events = []
        for k, m in enumerate(posted):
            if m["kind"] == "send":
                carries = m["carries"]
                if carries is None:
                    return None, (f"rank {r}'s message {k + 1} sends rank {m['peer']} (tag {m['tag']}) a tensor "
                                  "that is neither its stage's output for a microbatch (to rank + 1) nor the gradient "
                                  "of its input (to rank - 1)")
            else:
                if m["peer"] is None:
                    return None, (f"rank {r}'s message {k + 1} receives from any source; receive from the neighbour "
                                  "the op's input comes from (rank - 1 for F, rank + 1 for B)")
                queue = sent.get((m["peer"], r, m["tag"]))
                if not queue:
                    return None, (f"rank {r}'s message {k + 1} receives from rank {m['peer']} with tag {m['tag']}, "
                                  "but that rank sends it no message (or no more) with that tag")
                carries = queue.pop(0)
            events.append((m["kind"], m["peer"], tuple(carries)))
        found.append(events)
    return found, None


def message_problem(schedule, messages, shape):
    """None when the messages each rank posted (``messages[r]``: dicts "kind" ("send" or
    "recv"), "peer", "tag", "shape" and, for a send, "carries": ["F" or "B", mb] its data
    is, or None) follow ``schedule`` (``schedule[r]``: rank r's ops); else what is wrong.

    Every message is one microbatch's (``shape``). Per rank, the sends are those of
    ``expected_messages`` in that order, and so are the receives. A receive may be
    posted early, with the previous op's send (as ``batch_isend_irecv`` posts a send and
    the next receive together), not before an earlier op's send; and never after the
    send of its own op or a later one (its op runs before them)."""
    for r, posted in enumerate(messages):
        for k, m in enumerate(posted):
            if tuple(m["shape"]) != tuple(shape):
                return (f"rank {r}'s message {k + 1} ({m['kind']} {'to' if m['kind'] == 'send' else 'from'} rank "
                        f"{m['peer']}) has shape {tuple(m['shape'])}; every message is one microbatch's activation "
                        f"or gradient, {tuple(shape)}")
    found, problem = _received(messages)
    if problem:
        return problem
    p = len(schedule)
    for r, ops in enumerate(schedule):
        ops = [tuple(op) for op in ops]
        listed = " ".join(f"{kind}{mb}" for kind, mb, _ in ops)
        want, got = expected_messages(ops, r, p), found[r]
        for direction in ("send", "recv"):
            w = [(peer, what) for _, d, peer, what in want if d == direction]
            g = [(peer, what) for d, peer, what in got if d == direction]
            if w != g:
                first = next(i for i in range(max(len(w), len(g))) if i >= len(w) or i >= len(g) or w[i] != g[i])
                came = _message_text(direction, *g[first]) if first < len(g) else "nothing more"
                expected = _message_text(direction, *w[first]) if first < len(w) else "nothing more"
                every = ", ".join(_message_text(direction, *e) for e in g) or "nothing"
                return (f"rank {r} (ops {listed}): its {NOUN[direction]} number {first + 1} is {came}, expected "
                        f"{expected} (in all it {NOUN[direction]}s {every})")
        index = {(kind, mb): i for i, (kind, mb, _) in enumerate(ops)}
        for k, (direction, peer, what) in enumerate(got):
            if direction != "recv":
                continue
            j = index[what]
            later = next((e for e in got[:k] if e[0] == "send" and index[e[2]] >= j), None)
            if later:
                return (f"rank {r} (ops {listed}) sends {_message_text(*later)} before it receives "
                        f"{_message_text(direction, peer, what)}, whose op comes first in its ops: run the ops "
                        "in the order given")
            earlier = next((e for e in got[k + 1:] if e[0] == "send" and index[e[2]] < j - 1), None)
            if earlier:
                return (f"rank {r} (ops {listed}) receives {_message_text(direction, peer, what)} before it sends "
                        f"{_message_text(*earlier)}, more than one op ahead of its ops' order: a receive may go "
                        "out with the previous op's send, not earlier")
    return None
