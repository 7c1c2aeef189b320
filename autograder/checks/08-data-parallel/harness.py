"""Grader code that runs next to the student's ``ddp`` in the sandbox.

The checks draw every input in the grader, from the grading's secret seed, and
compute every expected value there (``oracles.py``: single-process training, the
buckets, what gloo sends for them). This file feeds the inputs to the student's
wrappers and sends back what they did.

``ddp_rank`` is the rank function of a rank job (``autograder.sandbox.ranks``):
rank r receives, per case, the model's architecture, its *own* initial
parameters (only rank 0's are the model's) and its own micro-batches of each
step. Per case it builds the model, wraps it (``NaiveDDP`` or ``BucketedDDP``),
emits its parameters as the wrapper left them, trains, and emits its parameters
after the last step. Marks, which the launcher answers after counting the bytes
that have crossed between the ranks (the kernel's count):

- ``{case}:start`` once the wrapper is built;
- per step and micro-batch, ``{case}:s{t}.m{m}.backward`` once ``loss.backward()``
  has returned and the harness's own barrier has finished: gloo runs a barrier
  only after every collective issued before it on the group, so what the hooks
  started during backward has crossed by then, and nothing after backward has
  been started yet (the barrier's own bytes are measured in the calibration);
- after the last micro-batch of a step, ``{case}:s{t}.m{m}.finish`` once
  ``sync_gradients()`` or ``finish_gradient_synchronization()`` has returned.

A case with ``ahead`` set runs rank 0 ahead of the others: they sleep
``AHEAD_S`` before their backward, and rank 0 marks ``{case}:s{t}.m{m}.rank0``
alone as soon as its own backward returns. Hooks that wait for an all-reduce
cannot return before the other ranks have started theirs; hooks that only start
one can, and the bytes the other ranks had sent by that mark say which.

``calibrate`` runs first, before the student's module is imported: one
all-reduce of ``CALIBRATION_ELEMENTS`` float64 and one barrier, each marked, so
the grader knows gloo's bytes per message and the barrier's bytes in this very
job.

Recording, for feedback only (no point rests on it): before the student's module
is imported, the collectives of ``torch.distributed`` (``RECORDED``) are replaced
by wrappers that log each call (``"all_reduce:async"`` or ``"all_reduce:sync"``;
a call made inside another is not logged again) and wrap the returned handle so
its ``wait()`` logs ``"wait"``; the end of backward is logged by a callback the
autograd engine runs after its last node (``"backward_end"``). The events of each
micro-batch come back with the case.

``compression_case`` runs the compression part in the sandbox process itself on
the inputs the grader drew. What comes back is plain data.
"""
import contextlib
import functools
import inspect
import time

import numpy as np

from autograder.sandbox import ranks

CALIBRATION_ELEMENTS = 64  # float64: every one of gloo's 2P segments holds some, for P up to 32
AHEAD_S = 0.3  # how long the other ranks wait before their backward in an "ahead" case
RECORDED = ("all_reduce", "all_reduce_coalesced", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor",
            "all_gather", "all_gather_single", "all_gather_into_tensor", "broadcast", "reduce", "all_to_all",
            "all_to_all_single", "gather", "scatter", "barrier")

EVENTS = []  # this process's record of the current micro-batch
_REAL = {}  # the collectives as torch.distributed had them before the recorder: the harness's own


# --- the model: an architecture from the grader, parameters from the grader -----------------

def parameter_shapes(spec):
    """(name, shape, fan in) of each distinct parameter of a model of ``spec``, in
    registration order (a tied weight under its first name only)."""
    tied = {to for to, _ in spec["tied"]}
    found = []
    for i, (fan_in, fan_out) in enumerate(spec["layers"]):
        index = 2 * i  # a Tanh between two Linear layers
        if index not in tied:
            found.append((f"{index}.weight", (fan_out, fan_in), fan_in))
        found.append((f"{index}.bias", (fan_out,), fan_in))
    return found


def build_model(spec, parameters):
    """A float64 ``Sequential`` of Linear layers with Tanh between them, its ``tied`` weights one
    Parameter, its ``frozen`` layers without gradients, holding ``parameters`` ({name: array})."""
    import torch

    layers = []
    for i, (fan_in, fan_out) in enumerate(spec["layers"]):
        layers += ([torch.nn.Tanh()] if i else []) + [torch.nn.Linear(fan_in, fan_out, dtype=torch.float64)]
    model = torch.nn.Sequential(*layers)
    for to, source in spec["tied"]:
        model[to].weight = model[source].weight
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.from_numpy(np.asarray(parameters[name], dtype=np.float64)))
    for index in spec["frozen"]:
        model[index].requires_grad_(False)
    return model


def _parameters(module):
    return {name: p.detach().numpy().copy() for name, p in module.named_parameters()}


# --- recording, installed before the student's module is imported --------------------------

class RecordedWork:
    """A collective's handle whose ``wait()`` is logged."""

    def __init__(self, work):
        self._work = work

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        EVENTS.append("wait")
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


_INSIDE = []  # the recorded call running now: a deprecated name calls its new one, recorded too


def _recording(name, real):
    signature = inspect.signature(real)

    @functools.wraps(real)
    def call(*args, **kwargs):
        if _INSIDE:  # a collective the student called, calling another: one call, recorded once
            return real(*args, **kwargs)
        try:  # async_op may come by keyword or by position
            asynchronous = bool(signature.bind(*args, **kwargs).arguments.get("async_op", False))
        except TypeError:  # arguments the real function will refuse itself
            asynchronous = bool(kwargs.get("async_op", False))
        EVENTS.append(f"{name}:{'async' if asynchronous else 'sync'}")
        _INSIDE.append(name)
        try:
            work = real(*args, **kwargs)
        finally:
            _INSIDE.pop()
        return RecordedWork(work) if work is not None and asynchronous else work
    return call


def install_recorder():
    import torch.distributed as tdist
    from torch.distributed import distributed_c10d

    for name in RECORDED:
        real = getattr(distributed_c10d, name, None)
        if real is None:
            continue
        _REAL.setdefault(name, real)
        wrapper = _recording(name, real)
        setattr(tdist, name, wrapper)
        setattr(distributed_c10d, name, wrapper)


def _barrier():
    """The harness's own barrier, unrecorded: it ends after every collective issued before it."""
    from torch.distributed import distributed_c10d

    _REAL.get("barrier", distributed_c10d.barrier)()


def _mark_backward_end(loss):
    """Log "backward_end" once the engine has run every node of this backward."""
    import torch

    def on_loss_grad(grad):
        torch.autograd.Variable._execution_engine.queue_callback(lambda: EVENTS.append("backward_end"))
        return grad
    loss.register_hook(on_loss_grad)


# --- the rank job ------------------------------------------------------------------------------

def calibrate():
    """One all-reduce of known size and one barrier, each counted apart, before any of the
    student's code has loaded."""
    import torch
    import torch.distributed as tdist

    ranks.mark("calibration:start")
    tdist.all_reduce(torch.zeros(CALIBRATION_ELEMENTS, dtype=torch.float64))
    ranks.mark("calibration:all_reduce")
    tdist.barrier()
    ranks.mark("calibration:barrier")


def _run_case(student, case, record):
    """Fill ``record`` as the case goes: a stub further on leaves what came before."""
    import torch
    import torch.distributed as tdist

    name, rank = case["case"], tdist.get_rank()
    module = build_model(case["spec"], case["initial"])
    if case["kind"] == "naive":
        wrapped = student.NaiveDDP(module)
    else:
        wrapped = student.BucketedDDP(module, bucket_cap_mb=case["cap"])
    record["initial"] = _parameters(module)
    ranks.mark(f"{name}:start")
    opt = torch.optim.SGD(module.parameters(), lr=case["lr"], momentum=case["momentum"])
    steps = []
    for t, micro_batches in enumerate(case["batches"]):
        events = []
        for m, (x, y) in enumerate(micro_batches):
            phase, last = f"{name}:s{t}.m{m}", m == len(micro_batches) - 1
            EVENTS.clear()
            with contextlib.nullcontext() if last else wrapped.no_sync():
                loss = torch.nn.functional.mse_loss(wrapped(torch.from_numpy(x)), torch.from_numpy(y))
                loss = loss / len(micro_batches)
                _mark_backward_end(loss)
                if case.get("ahead") and rank != 0:
                    time.sleep(AHEAD_S)
                loss.backward()
            if case.get("ahead") and rank == 0:
                ranks.mark(f"{phase}.rank0", ranks=1)
            _barrier()
            ranks.mark(f"{phase}.backward")
            if last:
                EVENTS.append("sync_call")  # the training loop asks for the gradients now
                wrapped.sync_gradients() if case["kind"] == "naive" else wrapped.finish_gradient_synchronization()
                ranks.mark(f"{phase}.finish")
            events.append(list(EVENTS))
        opt.step()
        opt.zero_grad()
        steps.append(events)
        record["steps"] = steps
    EVENTS.clear()
    record["final"] = _parameters(module)


def ddp_rank(parts):
    """Every case this rank is given, in order; one record per case, emitted when it is done."""
    import torch.distributed as tdist

    calibrate()
    install_recorder()
    import ddp as student  # after install_recorder: its imports of torch.distributed get the wrappers

    for case in parts:
        record = {}
        try:
            _run_case(student, case, record)
            record["status"] = "ok"
        except NotImplementedError as exc:  # a stub: every rank raises at the same place
            record.update(status="not_implemented", message=str(exc))
        _barrier()  # no case's stray message can reach the next one
        EVENTS.clear()
        ranks.emit({"case": case["case"], **record})


# --- compression: no other processes needed ---------------------------------------------------

def compression_case(topk_cases, feedback_steps):
    """What ``topk_compress`` and ``ErrorFeedback`` return on the grader's inputs; a part
    still a stub is ``{"not_implemented": message}``."""
    import ddp as student

    out = {}
    for part, run in (("topk", lambda: _topk(student, topk_cases)),
                      ("feedback", lambda: _feedback(student, feedback_steps))):
        try:
            out[part] = run()
        except NotImplementedError as exc:
            out[part] = {"not_implemented": str(exc)}
    return out


def _topk(student, cases):
    import torch

    found = []
    for case in cases:
        values, indices = student.topk_compress(torch.from_numpy(np.array(case["x"])), case["k"])
        found.append({"values": _numpy(values), "indices": _numpy(indices)})
    return found


def _feedback(student, steps):
    """``steps``: [[(key, grad), ...] per step]; each step compresses its tensors in turn."""
    import torch

    feedback, found = student.ErrorFeedback(), []
    for step in steps:
        row = []
        for key, grad, k in step:
            values, indices = feedback.compress(key, torch.from_numpy(np.array(grad)), k)
            residual = feedback.residual(key)
            row.append({"values": _numpy(values), "indices": _numpy(indices),
                        "residual": None if residual is None else _numpy(residual)})
        found.append(row)
    return found


def _numpy(t):
    import torch

    return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
