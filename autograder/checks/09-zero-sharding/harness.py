"""Grader code that runs next to the student's ``zero`` module in the sandbox.

``formulas(queries)`` answers every ``zero_bytes`` and ``flatten_padded``
query of the checks in one call (importing torch once).

``training_job(n)`` runs every training case on ``n`` ranks in one
``course.dist`` job (starting torch processes is the slow part). On every rank
``rank_side`` builds the same small float64 MLP (layer sizes chosen so no
layer's parameter count, nor the total, divides by 4, and the total not by 2
or 3: padding matters), trains it for ``STEPS`` steps on its slice of a
global batch with the student's ``ShardedOptimizer`` (Adam with L2 weight
decay; SGD with momentum) or ``Zero3Sequential`` (Adam), and records:

- every rank's full parameters after training. The oracle, computed on the
  same rank before the student's code runs, is the same model trained in one
  process by the unsharded torch optimizer on the whole batch;
- ZeRO-1: bytes of the unique storages reachable from the inner optimizer's
  ``state`` and ``param_groups`` (a view of a big buffer counts the whole
  buffer), next to the same count for the unsharded torch optimizer;
- ZeRO-3: bytes of the unique storages reachable from the wrapper (its
  tensors, modules, containers and objects of the student's module), and the
  peak bytes of gathered parameters alive at once: every output tensor of
  ``torch.distributed.all_gather_single`` (or of its older name
  ``all_gather_into_tensor``, deprecated in torch 2.13) is tracked with
  ``weakref.finalize`` from the call until it (and every view of it) is freed.

The launcher counts the bytes that cross between the ranks in the training
steps (``count_wire``, ``course.dist.mark``), which the traffic checks compare
with the closed forms.

Each rank writes a file per case as soon as it is done, so when a rank raises
or the job hangs the files say which case it was; the cases after it run again
in a new job without it, as in lab 06. A stub (``NotImplementedError`` on every
rank before any collective) is recorded and skipped within the job.
"""
import gc
import math
import weakref

from autograder.grading.checking import first_failure, run_cases, save_record
from course import dist as launcher

DIMS = (6, 22, 10, 22, 13, 3)  # Linear sizes 154, 230, 242, 299, 42 parameters: 967 in all
GLOBAL_BATCH = 24
STEPS = 3
SEED = 2026
CASES = ("zero1_adam", "zero1_sgd", "zero3_adam")
OPTIMIZERS = {"adam": ("Adam", {"lr": 0.05, "weight_decay": 0.1}),
              "sgd": ("SGD", {"lr": 0.1, "momentum": 0.9})}
# A correct job of 4 processes takes 3-6 s on 2 busy cores; a deadlock ends sooner, when the job idles.
JOB_TIMEOUT_S = 40


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
        for sizes, n in queries["flatten_padded"]:
            tensors = [torch.arange(1, s + 1, dtype=torch.float64) + 1000 * i for i, s in enumerate(sizes)]
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


# --- on every rank ---------------------------------------------------------------------

def _layers():
    import torch

    torch.manual_seed(SEED)
    layers = []
    for i, (a, b) in enumerate(zip(DIMS[:-1], DIMS[1:])):
        layers.append(torch.nn.Linear(a, b, dtype=torch.float64))
        if i < len(DIMS) - 2:
            layers.append(torch.nn.Tanh())
    return layers


def _batch(step):
    import torch

    g = torch.Generator().manual_seed(SEED + step)
    x = torch.randn(GLOBAL_BATCH, DIMS[0], generator=g, dtype=torch.float64)
    y = torch.randn(GLOBAL_BATCH, DIMS[-1], generator=g, dtype=torch.float64)
    return x, y


def _local(tensor, rank, n):
    rows = GLOBAL_BATCH // n
    return tensor[rank * rows:(rank + 1) * rows]


def _flat_params(module_or_tensors):
    import torch

    tensors = module_or_tensors.parameters() if hasattr(module_or_tensors, "parameters") else module_or_tensors
    return torch.cat([t.detach().reshape(-1) for t in tensors]).numpy().copy()


def _layout():
    """(name, number of elements) of every parameter, in the flat order."""
    import torch

    return [(name, p.numel()) for name, p in torch.nn.Sequential(*_layers()).named_parameters()]


def oracle(kind):
    """The unsharded model trained in this one process on the whole batch: flat parameters
    and the bytes its torch optimizer holds."""
    import torch

    model = torch.nn.Sequential(*_layers())
    name, kwargs = OPTIMIZERS[kind]
    opt = getattr(torch.optim, name)(model.parameters(), **kwargs)
    for step in range(STEPS):
        x, y = _batch(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return _flat_params(model), storage_bytes([opt.state, opt.param_groups])


def storage_bytes(root, student_module="zero"):
    """Bytes of the unique tensor storages reachable from ``root``: through tensors,
    modules, dicts, lists, tuples, sets, and objects whose class is defined in
    ``student_module``. A view counts the whole storage it lives in; a tensor's
    ``.grad`` is not followed (gradients are not optimizer state)."""
    import torch

    seen_objects, storages, todo = set(), {}, [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen_objects:
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr(), storage.nbytes()] = storage.nbytes()  # gradients are not followed
        elif isinstance(obj, torch.nn.Module):  # its parameters, buffers, submodules and attributes
            todo.append(vars(obj))
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif type(obj).__module__ == student_module and hasattr(obj, "__dict__"):
            todo.append(vars(obj))
    return int(sum(storages.values()))


class GatherWatch:
    """Wraps ``torch.distributed.all_gather_single`` and its older name
    ``all_gather_into_tensor``: how many bytes of gathered outputs are alive now,
    and the most that were alive at once. (The old name calls the new one inside
    ``distributed_c10d``, not through ``torch.distributed``: a call counts once.)"""

    NAMES = ("all_gather_single", "all_gather_into_tensor")

    def __init__(self):
        import torch.distributed as tdist

        self.tdist, self.originals = tdist, {name: getattr(tdist, name) for name in self.NAMES}
        self.live = self.peak = self.calls = self.total = 0
        self.alive = {}  # id of a gathered output still alive -> its bytes

    def __enter__(self):
        for name, original in self.originals.items():
            setattr(self.tdist, name, self._watch(original))
        return self

    def _watch(self, original):
        import torch

        def watched(output_tensor, input_tensor, *args, **kwargs):
            asynchronous = kwargs.get("async_op", args[1] if len(args) > 1 else False)  # (group, async_op)
            if asynchronous:  # a prefetch: the output is the student's to wait on
                result = original(output_tensor, input_tensor, *args, **kwargs)
            else:
                # Gather into a buffer of our own, then copy: c10d may keep a reference to the tensor
                # it gathered into until its worker thread lets go, and that timing is not the student's.
                scratch = torch.empty_like(output_tensor)
                result = original(scratch, input_tensor, *args, **kwargs)
                output_tensor.copy_(scratch)
                del scratch
            nbytes = output_tensor.numel() * output_tensor.element_size()
            self.calls += 1
            self.total += nbytes
            if id(output_tensor) not in self.alive:  # a buffer gathered into again is counted once
                self.alive[id(output_tensor)] = nbytes
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(output_tensor, self._freed, id(output_tensor))
            return result
        return watched

    def _freed(self, key):
        self.live -= self.alive.pop(key)

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(self.tdist, name, original)


def _zero1(student, kind, rank, n):
    import torch

    model = torch.nn.Sequential(*_layers())
    name, kwargs = OPTIMIZERS[kind]
    optimizer_class = getattr(torch.optim, name)
    opt = student.ShardedOptimizer(model.parameters(), optimizer_class, **kwargs)
    launcher.mark(f"zero1_{kind}:start")  # what the steps send, counted by the launcher
    for step in range(STEPS):
        x, y = _batch(step)
        torch.nn.functional.mse_loss(model(_local(x, rank, n)), _local(y, rank, n)).backward()
        opt.step()
        opt.zero_grad()
    launcher.mark(f"zero1_{kind}:steps")
    inner = getattr(opt, "optimizer", None)
    record = {"params": _flat_params(model), "inner_class": type(inner).__name__,
              "inner_ok": isinstance(inner, optimizer_class)}
    if record["inner_ok"]:
        record["state_bytes"] = storage_bytes([inner.state, inner.param_groups])
        record["state_entries"] = len(inner.state)
    return record


def _zero3(student, rank, n):
    import torch
    import torch.distributed as tdist

    layers = _layers()
    shapes = [[tuple(p.shape) for p in layer.parameters()] for layer in layers]
    shapes = [s for s in shapes if s]
    model = student.Zero3Sequential(layers)
    name, kwargs = OPTIMIZERS["adam"]
    opt = getattr(torch.optim, name)(model.parameters(), **kwargs)
    with GatherWatch() as watch:
        launcher.mark("zero3_adam:start")
        for step in range(STEPS):
            x, y = _batch(step)
            torch.nn.functional.mse_loss(model(_local(x, rank, n)), _local(y, rank, n)).backward()
            opt.step()
            opt.zero_grad()
        launcher.mark("zero3_adam:steps")
        tdist.barrier()  # c10d may hold a collective's output until the next one is issued
        gc.collect()
        live_after = watch.live
    stored = storage_bytes(model)
    shards = list(getattr(model, "shards", []))
    record = {"peak_gathered": watch.peak, "gathers": watch.calls, "gathered_total": watch.total,
              "live_after": live_after, "stored_bytes": stored, "shard_sizes": [s.numel() for s in shards],
              "layer_sizes": [sum(math.prod(t) for t in s) for s in shapes]}
    # The full parameters, rebuilt by the grader from the shards with the documented layout.
    if len(shards) != len(shapes) or any(s.numel() * n < size for s, size in zip(shards, record["layer_sizes"])):
        record["params"] = None
        return record
    full = []
    for shard, size in zip(shards, record["layer_sizes"]):
        pieces = [torch.zeros_like(shard.detach()) for _ in range(n)]  # the list form, one piece per rank
        tdist.all_gather(pieces, shard.detach().contiguous())
        full.append(torch.cat(pieces)[:size])
    record["params"] = torch.cat(full).numpy().copy()
    return record


def rank_side(names, n_expected, folder):
    """Every rank: run each named case; write one file per case and rank."""
    import torch.distributed as tdist

    import zero as student

    rank, n = tdist.get_rank(), tdist.get_world_size()
    assert n == n_expected
    for name in names:
        kind = name.split("_")[1]
        want, unsharded_bytes = oracle(kind)
        try:
            if name.startswith("zero1"):
                record = _zero1(student, kind, rank, n)
                record["unsharded_state_bytes"] = unsharded_bytes
            else:
                record = _zero3(student, rank, n)
            record.update(status="ok", oracle=want if rank == 0 else None, layout=_layout())
        except NotImplementedError as exc:  # a stub raises on every rank before any collective
            record = {"status": "not_implemented", "message": str(exc)}
        tdist.barrier()  # the next case starts together
        save_record(folder, name, rank, record)
    return None


def _merge(records):
    """One record per rank -> one per case: per-rank lists of what differs between ranks."""
    failure = first_failure(records)
    if failure:
        return failure
    first = records[0]
    merged = {"status": "ok", "oracle": first["oracle"], "layout": first["layout"]}
    for key in first:
        if key not in ("status", "oracle", "layout"):
            merged[key] = [r.get(key) for r in records]
    return merged


def training_job(n, names=CASES):
    """{case: outcome} for ``n`` ranks; see the module docstring."""
    # gloo on both tiers: the model is tiny and its tensors live on the CPU.
    start = lambda pending, folder: launcher.run(f"{__file__}:rank_side", n, pending, n, folder,
                                                 timeout=JOB_TIMEOUT_S, backend="gloo",
                                                 idle_timeout=launcher.IDLE_TIMEOUT_S, count_wire=True)
    return run_cases(start, names, n, _merge, counted=("steps",))
