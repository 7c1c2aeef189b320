"""Grader code that runs next to the student's ``ddp`` in the sandbox.

``ddp_job(world)`` trains a small float64 MLP with every wrapper of the lab on
``world`` torch processes (``course.dist``, gloo), as few jobs as it can:
starting processes is the slow part on a small machine. Per case, every rank:

1. builds the model from a seed of its own (rank r: ``SEED + r``), so a
   wrapper that forgets to broadcast rank 0's parameters starts from
   different replicas;
2. wraps it, compares the parameters with rank 0's initial ones;
3. trains ``STEPS`` SGD steps (momentum) on its slice of each global batch,
   recording every collective call of the step in order, relative to the
   moment backward ends;
4. trains the oracle — the same model from rank 0's seed, torch's own SGD,
   one process, the whole global batch — and reports the largest difference
   per parameter.

Two more cases train a model with a frozen first layer and a weight tied
between two layers (``make_model(seed, FROZEN_TIED)``), with ``NaiveDDP`` and
with ``BucketedDDP`` (one parameter per bucket); ``param_bytes`` and
``param_names`` list the parameters that are trained, each once.

Recording: before the student's module is imported, the collectives of
``torch.distributed`` (``all_reduce`` and the others in ``RECORDED``) are
replaced by wrappers that log each call (``"all_reduce:async"`` or
``"all_reduce:sync"``; a call made inside another, as a deprecated name
calls its new one, is not logged again) and wrap the returned handle so its ``wait()`` logs
``"wait"``; ``from torch.distributed import all_reduce`` in the student's
module therefore gets the wrapper too. The end of backward is marked by a
callback queued on the autograd engine from a hook on the loss
(``Variable._execution_engine.queue_callback``): the engine runs such
callbacks after every node of the backward pass, parameter hooks included —
torch's own DDP waits for its buckets there. Collectives other than
all-reduce are logged under their own name; the checks expect one
all-reduce per bucket and nothing else during a step.

Each rank writes its record of a case to a file as soon as the case is done,
so when a job hangs or a rank raises, the files say which case it was; the
cases after it run again in a new job — except, after a hang, the cases on
the same wrapper class, which would most likely hang as long (each hang costs
an idle stop, ``JOB_TIMEOUT_S`` if it spins). A case whose code raises
``NotImplementedError`` (a stub) is recorded as such and the job goes on. The
job runs on gloo with CPU tensors on every tier. Only ``Work.wait()`` is recorded as a wait: a student
who waits through ``handle.get_future().wait()`` is not seen waiting.

``compression_case()`` runs the compression part in the sandbox process
itself (no other processes needed). What comes back is plain data.
"""
import contextlib
import functools
import inspect

import numpy as np

from autograder.grading.checking import run_cases, save_record
from course import dist

SEED = 808
STEPS = 3
MICRO_BATCH = 4  # samples per rank per backward
ACCUMULATION = 3  # micro-batches per step in the accumulation case
LR, MOMENTUM = 0.05, 0.9
# A correct job of 4 processes takes ~5 s on 2 idle cores, 3x that on busy ones; a deadlock ends
# sooner, once the job idles (course.dist.IDLE_TIMEOUT_S).
JOB_TIMEOUT_S = 40
# bucket caps in MiB: 32 bytes, exactly the smallest parameter (a bucket that reaches the cap closes, so one
# parameter per bucket); two buckets, the last one partial; one partial bucket for all
BUCKET_CAPS = (2**-15, 0.002, 25.0)
FROZEN_TIED = "frozen + tied"  # the model with a frozen layer and a weight shared by two layers
FROZEN_TIED_CAP = 1e-5  # 10.5 bytes: one parameter per bucket
CASES = (("naive", None), *(("bucketed", cap) for cap in BUCKET_CAPS), ("accumulation", 0.002),
         ("naive", None, FROZEN_TIED), ("bucketed", FROZEN_TIED_CAP, FROZEN_TIED))
RECORDED = ("all_reduce", "all_reduce_coalesced", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor",
            "all_gather", "all_gather_single", "all_gather_into_tensor", "broadcast", "reduce", "all_to_all",
            "all_to_all_single", "gather", "scatter", "barrier")

EVENTS = []  # this process's record of the current step


def case_name(kind, cap, model=None):
    details = ([model] if model else []) + ([f"bucket_cap_mb={cap:g}"] if cap is not None else [])
    return f"{kind} ({', '.join(details)})" if details else kind


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

    if getattr(tdist, "_k2c_recording", False):
        return
    for name in RECORDED:
        real = getattr(distributed_c10d, name, None)
        if real is None:
            continue
        wrapper = _recording(name, real)
        setattr(tdist, name, wrapper)
        setattr(distributed_c10d, name, wrapper)
    tdist._k2c_recording = True


def _mark_backward_end(loss):
    """Log "backward_end" once the engine has run every node of this backward."""
    import torch

    def on_loss_grad(grad):
        torch.autograd.Variable._execution_engine.queue_callback(lambda: EVENTS.append("backward_end"))
        return grad
    loss.register_hook(on_loss_grad)


# --- one case on every rank ----------------------------------------------------------------

def make_model(seed, model=None):
    """The graded MLP; ``model=FROZEN_TIED``: one more layer, whose weight is layer 2's (one
    Parameter under two names, as tied embeddings are), and a frozen first layer."""
    import torch

    torch.manual_seed(seed)
    if model is None:
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                   torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
    layers = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                 torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
    layers[4].weight = layers[2].weight
    layers[0].requires_grad_(False)
    return layers


def global_batch(step, samples):
    import torch

    gen = torch.Generator().manual_seed(SEED * 1000 + step)
    return (torch.randn(samples, 8, generator=gen, dtype=torch.float64),
            torch.randn(samples, 4, generator=gen, dtype=torch.float64))


def _optimizer(params):
    import torch

    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def oracle_parameters(world, micro_batches, model=None):
    """Single-process training from rank 0's seed on each whole global batch."""
    import torch

    model = make_model(SEED, model)
    opt = _optimizer(model.parameters())
    for step in range(STEPS):
        x, y = global_batch(step, world * micro_batches * MICRO_BATCH)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return dict(model.named_parameters())


def _differences(module, reference):
    return {name: float((p.detach() - reference[name].detach()).abs().max()) for name, p in module.named_parameters()}


def run_case(student, record, kind, cap, model=None):
    """Fill ``record`` as the case goes (a stub further on leaves what came before)."""
    import torch
    import torch.distributed as tdist

    rank, world = tdist.get_rank(), tdist.get_world_size()
    micro_batches = ACCUMULATION if kind == "accumulation" else 1
    module = make_model(SEED + rank, model)
    # What is synchronised: each parameter once (parameters() yields a tied one once), frozen ones not at all.
    trained = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    record.update(param_bytes=[p.numel() * p.element_size() for _, p in trained],
                  param_names=[name for name, _ in trained])
    wrapped = student.NaiveDDP(module) if kind == "naive" else student.BucketedDDP(module, bucket_cap_mb=cap)
    record["initial_errors"] = _differences(module, dict(make_model(SEED, model).named_parameters()))
    dist.mark(f"{case_name(kind, cap, model)}:start")  # what the steps send, counted by the launcher
    opt = _optimizer(module.parameters())
    steps = []
    for step in range(STEPS):
        x, y = global_batch(step, world * micro_batches * MICRO_BATCH)
        micro_records = []
        for m in range(micro_batches):
            start = (rank * micro_batches + m) * MICRO_BATCH
            EVENTS.clear()
            inner = m < micro_batches - 1
            with wrapped.no_sync() if inner else contextlib.nullcontext():
                loss = torch.nn.functional.mse_loss(wrapped(x[start:start + MICRO_BATCH]),
                                                    y[start:start + MICRO_BATCH]) / micro_batches
                _mark_backward_end(loss)
                loss.backward()
            if not inner:
                EVENTS.append("sync_call")  # the training loop asks for the gradients now
                if kind == "naive":
                    wrapped.sync_gradients()
                else:
                    wrapped.finish_gradient_synchronization()
            micro_records.append(list(EVENTS))
        opt.step()
        opt.zero_grad()
        steps.append(micro_records)
    EVENTS.clear()
    dist.mark(f"{case_name(kind, cap, model)}:steps")
    record["steps"] = steps
    record["final_errors"] = _differences(module, oracle_parameters(world, micro_batches, model))


def rank_side(cases, folder):
    """Every rank: run each case; write one file per case and rank when it is done."""
    install_recorder()
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    import ddp as student  # after install_recorder: its imports of torch.distributed get the wrappers

    rank = tdist.get_rank()
    for index, case in cases:
        record = {"status": "ok"}
        try:
            run_case(student, record, *case)
        except NotImplementedError as exc:  # a stub: every rank raises at the same place
            record.update(status="not_implemented", message=str(exc))
        tdist.barrier()  # no case's stray message can reach the next one
        EVENTS.clear()
        save_record(folder, index, rank, record)
    return None


def ddp_job(world, timeout=JOB_TIMEOUT_S):
    """{case name: {"status": ..., per-rank records or a message}} for ``world`` processes."""
    start = lambda pending, folder: dist.run(f"{__file__}:rank_side", world, pending, folder, timeout=timeout,
                                             backend="gloo", idle_timeout=dist.IDLE_TIMEOUT_S, count_wire=True)
    return run_cases(start, list(enumerate(CASES)), world, _merge, stem=lambda case: case[0],
                     name=lambda case: case_name(*case[1]), after_hang=_same_wrapper, counted=("steps",))


def _same_wrapper(hung, pending):
    """The cases on the wrapper class that hung: they would most likely hang as long."""
    naive = hung[1][0] == "naive"
    return [case for case in pending if (case[1][0] == "naive") == naive]


def _merge(records):
    """Per-rank records -> one per case; what a stub left unmeasured is missing."""
    first = records[0]
    merged = {k: first[k] for k in ("status", "message", "param_bytes", "param_names") if k in first}
    merged["ranks"] = [{k: r[k] for k in ("initial_errors", "final_errors", "steps") if k in r} for r in records]
    return merged


# --- compression: no other processes needed ---------------------------------------------------

def compression_case():
    """What ``topk_compress`` and ``ErrorFeedback`` return on random float64 data;
    a part still a stub is ``{"not_implemented": message}``."""
    import ddp as student

    rng = np.random.default_rng(SEED)
    out = {}
    for part, run in (("topk", _topk_cases), ("feedback", _feedback_steps)):
        try:
            out[part] = run(student, rng)
        except NotImplementedError as exc:
            out[part] = {"not_implemented": str(exc)}
    return out


def _topk_cases(student, rng):
    import torch

    cases = []
    for shape, k in (((6, 7), 5), ((50,), 1), ((3, 4), 12)):
        x = rng.permutation(np.prod(shape)).astype(np.float64) + 1  # distinct magnitudes, mixed signs
        x *= rng.choice([-1.0, 1.0], x.size)
        x = x.reshape(shape)
        values, indices = student.topk_compress(torch.from_numpy(x.copy()), k)
        cases.append({"x": x, "k": k, "values": _numpy(values), "indices": _numpy(indices)})
    return cases


def _feedback_steps(student, rng):
    import torch

    feedback, steps = student.ErrorFeedback(), {}
    for _ in range(4):
        for key, shape in (("w", (5, 8)), ("b", (8,))):  # two tensors in turn: residuals are kept per key
            grad = rng.standard_normal(shape)
            values, indices = feedback.compress(key, torch.from_numpy(grad.copy()), 3)
            residual = feedback.residual(key)
            steps.setdefault(key, []).append({"grad": grad, "values": _numpy(values), "indices": _numpy(indices),
                                              "residual": None if residual is None else _numpy(residual)})
    return steps


def _numpy(t):
    import torch

    return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
