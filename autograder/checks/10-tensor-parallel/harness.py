"""Grader code that runs next to the student's ``tensor_parallel`` module in the sandbox.

It knows no answer. The checks draw every input and build every dense model in the
grader (``oracles.py``), and give rank r of a rank job (``autograder.sandbox.ranks``)
only its own part of each case: the class to build, its slices of the dense weights
as NumPy arrays, its input and its upstream gradient (for the conjugate operators,
its own input and upstream gradient only). ``cases_rank`` builds the student's module,
loads the given slices into its parameters (``load``: a parameter of another shape
than the slice is reported with the shape the layout gives it, never guessed at),
marks the start (``ranks.mark``), runs the forward pass, marks, runs the backward pass
with the given upstream gradient, marks (the launcher counts what crossed between
the ranks in each pass, in all and per rank), sums the sequence-parallel gradients
where the case says so, and emits its output and every gradient; the grader compares
them with the dense model's.

With them go in-process records, for the checks' messages: ``CollectiveLog`` wraps
the collectives of ``torch.distributed`` before the student's module is imported
(all_reduce, all_gather_single, reduce_scatter_single, their older names
all_gather_into_tensor and reduce_scatter_tensor, all_gather, reduce_scatter,
broadcast) and records ``(kind, elements, phase)`` for every call made in a pass;
``largest_held`` is the largest tensor reachable from the student's module,
``SavedWatch`` the largest autograd saved for backward (``saved_tensors_hooks``), and
``course.torch_audit.OpLog`` sees every operator the passes run: the largest tensor
any of them makes, and the collectives as torch's process group sees them.

``memory_rank`` builds a small and then a large ``ParallelMLP``, loads its slices and runs a
forward pass with nothing recorded, for the peak memory the launcher reads from outside.

A stub (``NotImplementedError``) and a parameter of the wrong shape are emitted per
case on every rank alike; any other error ends the job, and the grader runs the cases
after it again in a new one (``autograder.grading.rank_jobs.run_cases``).
"""
import contextlib
import functools
import inspect

from autograder.sandbox import ranks

# The old names (deprecated in torch 2.13) call the new ones inside distributed_c10d, not through
# torch.distributed, where these are wrapped: each call is recorded once, under either name.
COLLECTIVES = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
               "reduce_scatter_tensor", "all_gather", "reduce_scatter", "broadcast")
KIND = {"all_reduce": "all-reduce", "broadcast": "broadcast", "all_gather_single": "all-gather",
        "all_gather_into_tensor": "all-gather", "all_gather": "all-gather", "reduce_scatter_single": "reduce-scatter",
        "reduce_scatter_tensor": "reduce-scatter", "reduce_scatter": "reduce-scatter"}


# --- the collective recorder ----------------------------------------------------------------

def _elements(op, bound):
    """Elements of the whole (unsharded) tensor a collective call moves."""
    a = bound.arguments
    if op in ("all_reduce", "broadcast"):
        return a["tensor"].numel()
    if op in ("all_gather_single", "all_gather_into_tensor"):
        return a["output_tensor"].numel()
    if op in ("reduce_scatter_single", "reduce_scatter_tensor"):
        return a["input"].numel()
    if op == "all_gather":
        return sum(t.numel() for t in a["tensor_list"])
    return sum(t.numel() for t in a["input_list"])  # reduce_scatter


class CollectiveLog:
    """Wraps the collectives of ``module`` (``torch.distributed``) in place.
    ``calls`` gets ``(kind, elements, phase)`` for each call made inside
    ``with log.phase(name)``; calls outside a phase are not recorded."""

    def __init__(self, module):
        self.module, self.calls, self.current, self.originals = module, [], None, {}

    def install(self):
        for op in COLLECTIVES:
            original = getattr(self.module, op)
            self.originals[op] = original
            setattr(self.module, op, self._wrap(op, original))
        return self

    def uninstall(self):
        for op, original in self.originals.items():
            setattr(self.module, op, original)

    def _wrap(self, op, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            if self.current is not None:
                self.calls.append((KIND[op], _elements(op, signature.bind(*args, **kwargs)), self.current))
            return original(*args, **kwargs)
        return recorded

    @contextlib.contextmanager
    def phase(self, name):
        before, self.current = self.current, name
        try:
            yield
        finally:
            self.current = before


def tally(calls, phase):
    """{"kind of elements": count} of the calls recorded in ``phase``."""
    counts = {}
    for kind, elements, where in calls:
        if where == phase:
            key = f"{kind} of {elements}"
            counts[key] = counts.get(key, 0) + 1
    return counts


# --- loading the given slices into the student's module -----------------------------------

class LoadError(Exception):
    """The student's parameter is missing or not the documented shard."""


def load(module, label, path, array, expected):
    """Copy ``array`` (this rank's slice) into the student's parameter at ``path`` ("fc1.weight")
    of ``module``; the parameter, or LoadError that ends with ``expected`` (the slice's shape, and
    why: the grader's sentence)."""
    import numpy as np
    import torch

    *owners, attr = path.split(".")
    owner, where = module, label.split(".")[0]
    for name in owners:
        child = getattr(owner, name, None)
        if child is None:
            raise LoadError(f"{where} has no .{name}; the grader loads weights into the submodules the module "
                            "docstring names")
        owner, where = child, f"{where}.{name}"
    got = getattr(owner, attr, None)
    if not isinstance(got, torch.Tensor):
        raise LoadError(f"{label} is {got!r}, expected a parameter; {expected}")
    if tuple(got.shape) != tuple(array.shape):
        raise LoadError(f"{label} has shape {tuple(got.shape)}; {expected}")
    if got.dtype != torch.float64:
        raise LoadError(f"{label} is {got.dtype}, expected torch.float64: create parameters in torch's default "
                        "dtype (the grader sets it to float64)")
    with torch.no_grad():
        got.copy_(torch.from_numpy(np.require(array, np.float64, ["C", "W"])))
    return got


# --- what the student's module holds --------------------------------------------------------

def largest_held(root, student_module="tensor_parallel"):
    """(elements, path) of the largest tensor reachable from ``root``: through modules,
    dicts, lists, tuples and objects of the student's module (gradients not followed)."""
    import torch

    seen, best, todo = set(), (0, ""), [(root, type(root).__name__)]
    while todo:
        obj, path = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            best = max(best, (obj.numel(), path))
        elif isinstance(obj, torch.nn.Module):
            todo.append((vars(obj), path))
        elif isinstance(obj, dict):
            todo.extend((v, f"{path}.{k}" if not str(k).startswith("_") else path) for k, v in obj.items())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend((v, f"{path}[{i}]") for i, v in enumerate(obj))
        elif type(obj).__module__ == student_module and hasattr(obj, "__dict__"):
            todo.append((vars(obj), path))
    return best


class SavedWatch:
    """Inside ``with``, the largest tensor autograd saves for backward: (elements, shape)."""

    def __init__(self):
        self.largest = (0, ())

    def __enter__(self):
        import torch

        def pack(tensor):
            self.largest = max(self.largest, (tensor.numel(), tuple(tensor.shape)))
            return tensor

        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


# --- the cases ----------------------------------------------------------------------------------

def _np(value):
    """What the student's code returned, as an array the grader can compare (a repr where it is none)."""
    import numpy as np
    import torch

    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        found = value.detach().cpu().numpy().copy()
        return found.item() if found.ndim == 0 else found  # the codec sends 0-d arrays as 1-d
    try:
        return np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        return repr(value)[:200]


def _tensor(array):
    """A tensor on this rank's own copy of an input."""
    import numpy as np
    import torch

    return torch.from_numpy(np.require(array, requirements=["C", "W"]))


def _made(ops):
    """What the operators ``ops`` (an OpLog) saw: the largest tensor made, as [elements,
    shape], and each phase's collectives [[kind, elements], ...] in order."""
    return {"made": [ops.largest[0], list(ops.largest[1])],
            "dispatched": {phase: [[kind, n] for kind, n, p in ops.events
                                   if p == phase and kind not in ("compute", "wait")]
                           for phase in ("forward", "backward")}}


def _passes(forward, backward, mark, log, ops=None, saved=None):
    """``forward()``, then ``backward(output)`` (which runs the backward pass where the output
    can take the upstream gradient, and says whether it did), in their phases of the
    recorders; a mark after each. (output, whether backward ran)."""
    def phase(name):
        stack = contextlib.ExitStack()
        for manager in ([saved] if saved is not None and name == "forward" else []) + [log.phase(name)] + (
                [ops, ops.phase(name)] if ops is not None else []):
            stack.enter_context(manager)
        return stack

    with phase("forward"):
        y = forward()
    mark("forward")
    with phase("backward"):
        ran = backward(y)
    mark("backward")
    return y, ran


def _with(upstream):
    """``backward`` for ``_passes``: the output's backward pass with ``upstream``, if its shape fits."""
    import torch

    def backward(y):
        if isinstance(y, torch.Tensor) and tuple(y.shape) == tuple(upstream.shape) and y.requires_grad:
            y.backward(upstream)
            return True
        return False
    return backward


def _operator_case(student, part, mark, log):
    """One conjugate operator on this rank's own input and upstream gradient."""
    x = _tensor(part["x"]).requires_grad_()
    function = getattr(student, part["function"])
    mark("start")
    out, backward = _passes(lambda: function(x), _with(_tensor(part["upstream"])), mark, log)
    record = {"output": _np(out)}
    if backward:
        record["gradient of the input"] = _np(x.grad)
    return {**record, "forward": tally(log.calls, "forward"), "backward": tally(log.calls, "backward")}


def _build(student, build):
    cls, args, kwargs = build
    return getattr(student, cls)(*args, **kwargs)


def _module_case(student, part, mark, log):
    """The student's module with this rank's slices loaded, on this rank's input."""
    from course.torch_audit import OpLog

    mod = _build(student, part["build"])
    params = [(label, load(mod, label, path, array, expected)) for label, path, array, expected in part["shards"]]
    x = _tensor(part["x"])
    differentiable = x.is_floating_point()
    x.requires_grad_(differentiable)
    ops, saved = OpLog(), SavedWatch()  # entered around the student's passes only
    mark("start")
    y, backward = _passes(lambda: mod(x), _with(_tensor(part["upstream"])), mark, log, ops, saved)
    record = {"output": _np(y)}
    if backward:
        if part["sync"]:
            with log.phase("sync"):
                student.allreduce_sequence_parallel_grads(mod)
        if differentiable:
            record["gradient of the input"] = _np(x.grad)
        record.update({f"gradient of {label}": _np(param.grad) for label, param in params})
    held, path = largest_held(mod)
    return {**record, "held": held, "held_at": path, "saved": saved.largest[0],
            "saved_shape": list(saved.largest[1]), "forward": tally(log.calls, "forward"),
            "backward": tally(log.calls, "backward"), **_made(ops)}


def _cross_entropy_case(student, part, mark, log):
    import torch

    from course.torch_audit import OpLog

    local, target = _tensor(part["logits"]).requires_grad_(), _tensor(part["target"])
    ops = OpLog()
    mark("start")

    def backward(loss):
        if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad:
            loss.reshape(()).backward()
            return True
        return False
    loss, _ = _passes(lambda: student.vocab_parallel_cross_entropy(local, target), backward, mark, log, ops)
    record = {"loss": _np(loss)}
    if local.grad is not None:
        record["gradient of the local logits"] = _np(local.grad)
    return {**record, **_made(ops)}


def _builds_case(student, part):
    """Each named constructor: whether it raised ValueError, and its message."""
    found = {}
    for key, build in part["builds"].items():
        try:
            _build(student, build)
        except ValueError as exc:
            found[key] = {"raised": True, "message": str(exc)[:300]}
        else:
            found[key] = {"raised": False, "message": ""}
    return found


def _run_case(student, part, mark, log):
    kind = part["kind"]
    if kind == "operator":
        return _operator_case(student, part, mark, log)
    if kind == "module":
        return _module_case(student, part, mark, log)
    if kind == "cross_entropy":
        return _cross_entropy_case(student, part, mark, log)
    return _builds_case(student, part)


def cases_rank(parts):
    """A rank of a rank job: every case it is given (its own part of each), in order; one
    record per case, emitted as soon as it is done."""
    import torch
    import torch.distributed as tdist

    log = CollectiveLog(tdist).install()  # before the student's module can import the collectives
    import tensor_parallel as student

    torch.set_default_dtype(torch.float64)
    for part in parts:
        name = part["case"]
        log.calls = []
        try:
            record = _run_case(student, part, lambda phase: ranks.mark(f"{name}:{phase}"), log)
            record["status"] = "ok"
        except NotImplementedError as exc:  # a stub raises on every rank alike
            record = {"status": "not_implemented", "message": str(exc)}
        except LoadError as exc:
            record = {"status": "wrong_shape", "message": str(exc)}
        tdist.barrier()  # the next case starts together
        ranks.emit({"case": name, **record})


def memory_rank(parts):
    """Module cases in turn (a small one, then a large one), each a forward pass with autograd
    on and nothing recorded, between a mark that starts this rank's peak memory afresh and one
    at which the launcher reads it from outside. Emits each output."""
    import torch

    import tensor_parallel as student

    torch.set_default_dtype(torch.float64)
    for part in parts:
        ranks.mark(f"{part['case']}:start", fresh_peak=True)
        try:
            mod = _build(student, part["build"])
            for label, path, array, expected in part["shards"]:
                load(mod, label, path, array, expected)
            record = {"status": "ok", "output": _np(mod(_tensor(part["x"])))}
        except NotImplementedError as exc:
            record = {"status": "not_implemented", "message": str(exc)}
        except LoadError as exc:
            record = {"status": "wrong_shape", "message": str(exc)}
        mod = None
        ranks.mark(f"{part['case']}:done")
        ranks.emit({"case": part["case"], **record})
