"""Grader code that runs next to the student's ``zero`` module in the sandbox.

It knows no answer: the checks draw every input (``check_zero_sharding.py``),
train the unsharded model themselves and compare (``oracles.py``), in the
grader's process. This file feeds the inputs to the student's code and sends
back what it gave.

``formulas(queries)`` answers every ``zero_bytes`` and ``flatten_padded``
query of the checks in one call (importing torch once).

``training_rank`` is the rank function of a rank job (``autograder.sandbox.ranks``).
Each rank receives, per case, what it needs to build the model (the seed of its
initial weights, ``initial_weights``: the same on every rank) and its own rows of
each step's batch, nothing else; it trains with the student's ``ShardedOptimizer``
(ZeRO-1) or ``Zero3Sequential`` (ZeRO-3), and emits its parameters: ZeRO-1 the
full flat parameters (every rank has them after the all-gather), ZeRO-3 its
shards, from which the grader rebuilds the full parameters by the documented
layout. Around the steps it marks ``{case}:start`` and ``{case}:steps``: the
launcher counts the bytes that crossed between them (the kernel's TCP counters).

The memory cases are large (tens of MiB of float64 parameters) so that what
their checks are about dominates each rank's memory, which the launcher reads
from outside at the marks (VmRSS, and VmHWM started afresh at each
``fresh_peak`` mark: ``autograder.grading.rank_jobs.peak_in_phase``):

- ``zero1_memory``: the model is built, then ``{case}:start``; the optimizer is
  made and steps; ``{case}:steps`` after ``zero_grad``: what the rank holds then
  beyond the model's parameters is what it keeps between steps (its optimizer
  state). The rank emits one slice of its parameters (another rank's shard, which
  reached it by the all-gather), and, for a message only, the bytes of tensors
  reachable from ``self.optimizer`` (an in-process count).
- ``zero3_memory``: ``{case}:start``; the layers are built and wrapped;
  ``{case}:built``: what the wrapper holds; the forward pass; ``{case}:forward``;
  the backward pass and the optimizer's step; ``{case}:steps``. The peak of each
  pass above what the rank held when it began is the gathered parameters (and in
  backward the shards' gradients). The rank emits its shards after the step, and
  for a message only the bytes of tensors reachable from the wrapper.

Before a memory case the harness warms torch up (``warm_up``: its own first
backward, Adam step and collectives keep some 20 MiB they allocate once), and
before each of its marks it waits until the rank's other threads sleep
(``settled``: c10d's worker threads let go of a collective's tensors a while
after the collective has returned).

A stub (``NotImplementedError`` on every rank before any collective) is
recorded for its case, and the job goes on.
"""
import gc

from autograder.sandbox import ranks

OPTIMIZERS = {"adam": ("Adam", {"lr": 0.05, "weight_decay": 0.1}),
              "sgd": ("SGD", {"lr": 0.1, "momentum": 0.9}),
              "plain_sgd": ("SGD", {"lr": 0.1})}


def formulas(queries):
    """{"zero_bytes": [...], "flatten_padded": [...]} for the queries the checks send;
    a function still a stub answers {"not_implemented": its message} instead."""
    import numpy as np
    import torch

    import zero

    def zero_bytes():
        return [float(zero.zero_bytes(*q)) for q in queries["zero_bytes"]]

    def flatten_padded():
        flat = []
        for arrays, n in queries["flatten_padded"]:
            tensors = [torch.tensor(np.asarray(a), dtype=torch.float64) for a in arrays]
            out = zero.flatten_padded(tensors, n)
            flat.append(np.asarray(out.detach().cpu().numpy()) if isinstance(out, torch.Tensor) else None)
        return flat

    answers = {}
    for name, answer in (("zero_bytes", zero_bytes), ("flatten_padded", flatten_padded)):
        try:
            answers[name] = answer()
        except NotImplementedError as exc:
            answers[name] = {"not_implemented": str(exc)}
    return answers


# --- the model: the same on every rank and in the grader --------------------------------

def initial_weights(seed, dims):
    """[(weight, bias)] of each Linear of an MLP with layer widths ``dims``, float64 NumPy:
    weights normal with standard deviation 1/sqrt(fan-in), biases 0.1 of that. The grader
    draws ``seed``; ranks and grader make the same arrays from it."""
    import numpy as np

    rng = np.random.default_rng(seed)
    found = []
    for a, b in zip(dims[:-1], dims[1:]):
        scale = 1 / np.sqrt(a)
        found.append((rng.standard_normal((b, a)) * scale, rng.standard_normal(b) * 0.1 * scale))
    return found


def make_layers(seed, dims):
    """Linear, Tanh, ..., Linear: the MLP of ``initial_weights(seed, dims)`` as torch layers."""
    import torch

    layers = []
    for i, (weight, bias) in enumerate(initial_weights(seed, dims)):
        layer = torch.nn.Linear(weight.shape[1], weight.shape[0], dtype=torch.float64, device="meta")
        layer.weight = torch.nn.Parameter(torch.from_numpy(weight))
        layer.bias = torch.nn.Parameter(torch.from_numpy(bias))
        layers.append(layer)
        if i < len(dims) - 2:
            layers.append(torch.nn.Tanh())
    return layers


def _own(array):
    """A tensor on this rank's own (writable) copy of an input array."""
    import numpy as np
    import torch

    return torch.from_numpy(np.require(array, np.float64, ["C", "W"]))


def _flat(tensors):
    import torch

    return torch.cat([t.detach().reshape(-1) for t in tensors]).numpy().copy()


def storage_bytes(root, student_module="zero"):
    """Bytes of the unique tensor storages reachable from ``root``: through tensors,
    modules, dicts, lists, tuples, sets, and objects whose class is defined in
    ``student_module``. A view counts the whole storage it lives in; a tensor's
    ``.grad`` is not followed. An in-process count, for messages only."""
    import torch

    seen_objects, storages, todo = set(), {}, [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen_objects:
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr(), storage.nbytes()] = storage.nbytes()
        elif isinstance(obj, torch.nn.Module):  # its parameters, buffers, submodules and attributes
            todo.append(vars(obj))
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif type(obj).__module__ == student_module and hasattr(obj, "__dict__"):
            todo.append(vars(obj))
    return int(sum(storages.values()))


# --- on every rank ------------------------------------------------------------------------

def _steps(model, optimizer, case):
    """Every step of ``case`` on this rank's rows: forward, loss, backward, step, zero_grad."""
    import torch

    for x, y in zip(case["x"], case["y"]):
        x, y = _own(x), _own(y)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def warm_up():
    """Torch's own first uses, before a measured phase: the first backward, Adam step and
    collectives of a process allocate about 20 MiB that they keep (autograd's, Adam's and
    gloo's), which are not the student's."""
    import torch
    import torch.distributed as tdist

    layer = torch.nn.Linear(362, 362, dtype=torch.float64)  # 1 MiB of weights
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.1, weight_decay=0.1)
    torch.tanh(layer(torch.ones(2, 362, dtype=torch.float64))).sum().backward()
    optimizer.step()
    shard = torch.ones(2**17, dtype=torch.float64)
    full = torch.empty(2**17 * tdist.get_world_size(), dtype=torch.float64)
    tdist.all_gather_single(full, shard)
    tdist.all_gather_single(full, shard, async_op=True).wait()
    tdist.reduce_scatter_single(shard, full)
    tdist.all_reduce(shard)


def settled():
    """Wait (2 s at most) until every other thread of this rank sleeps. A collective's worker
    thread lets go of its tensors only after the caller's wait() has returned, when it next
    runs: on busy cores a gathered buffer can outlive the step by a while, and what the
    launcher reads at a mark would count it."""
    import os
    import threading
    import time

    me, quiet, deadline = threading.get_native_id(), 0, time.monotonic() + 2
    while quiet < 2 and time.monotonic() < deadline:
        running = False
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/stat") as f:
                    running |= int(task) != me and f.read().rsplit(")", 1)[1].split()[0] == "R"
            except (OSError, IndexError):
                pass
        quiet = 0 if running else quiet + 1
        time.sleep(0.005)


def _mark(name, memory, fresh_peak=False):
    """The mark ``name``; in a memory case, once the collectives' threads have let go."""
    if memory:
        settled()
    ranks.mark(name, fresh_peak=fresh_peak)


def _zero1(student, case):
    import torch

    name = case["case"]
    if case.get("memory"):
        warm_up()
    model = torch.nn.Sequential(*make_layers(case["model_seed"], case["dims"]))
    class_name, kwargs = OPTIMIZERS[case["optimizer"]]
    memory = case.get("memory", False)
    _mark(f"{name}:start", memory, fresh_peak=True)  # from here: the optimizer's bytes and the steps' traffic
    optimizer = student.ShardedOptimizer(model.parameters(), getattr(torch.optim, class_name), **kwargs)
    _steps(model, optimizer, case)
    _mark(f"{name}:steps", memory)
    flat = _flat(model.parameters())
    if "slice" in case:  # a large case: one slice is enough to see the work was done
        start, stop = case["slice"]
        record = {"params": flat[start:stop], "inner_bytes": _inner_bytes(optimizer)}
    else:
        record = {"params": flat}
    del model, optimizer
    return record


def _inner_bytes(optimizer):
    inner = getattr(optimizer, "optimizer", None)
    try:
        return storage_bytes([inner.state, inner.param_groups])
    except AttributeError:
        return None


def _zero3(student, case):
    import torch

    name, memory = case["case"], case.get("memory", False)
    if memory:
        warm_up()
    _mark(f"{name}:start", memory, fresh_peak=True)  # from here: what the wrapper stores, and the steps' traffic
    layers = make_layers(case["model_seed"], case["dims"])
    model = student.Zero3Sequential(layers)
    del layers  # the wrapper keeps what it needs of them
    class_name, kwargs = OPTIMIZERS[case["optimizer"]]
    optimizer = getattr(torch.optim, class_name)(model.parameters(), **kwargs)
    gc.collect()
    _mark(f"{name}:built", memory, fresh_peak=True)  # from here: the peaks of the step above what is stored
    if memory:  # one step, its forward and backward measured apart
        x, y = _own(case["x"][0]), _own(case["y"][0])
        loss = torch.nn.functional.mse_loss(model(x), y)
        _mark(f"{name}:forward", memory, fresh_peak=True)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        del loss
    else:
        _steps(model, optimizer, case)
    _mark(f"{name}:steps", memory)
    record = {"shards": [shard.detach().numpy().copy() for shard in getattr(model, "shards", [])]}
    if case.get("memory"):
        record["wrapper_bytes"] = storage_bytes(model)
    del model, optimizer
    return record


def training_rank(parts):
    """A rank of a rank job: every case it is given (its rows of each), in order; one
    record per case, emitted as soon as it is done."""
    import torch.distributed as tdist

    import zero as student

    gc.freeze()  # what is loaded by now stays: a collection then looks at what the cases make only (fast)
    for case in parts:
        try:
            record = (_zero1 if case["case"].startswith("zero1") else _zero3)(student, case)
            record["status"] = "ok"
        except NotImplementedError as exc:  # a stub raises on every rank alike
            record = {"status": "not_implemented", "message": str(exc)}
        gc.collect()  # what the case made goes before the next case starts
        tdist.barrier()  # the next case starts together
        ranks.emit({"case": case["case"], **record})
