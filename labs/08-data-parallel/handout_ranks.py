"""What the handout runs on every rank: your wrappers on a small model, next to
single-process training on the global batch.

You do not need to edit this file. ``course.dist.run(try_wrappers, p)`` returns,
per rank, ``{case: {...}}``: how far this rank's parameters are from rank 0's
right after the wrapper was built, how far they are after ``STEPS`` steps from
single-process training on the whole global batch, and the order in which
all-reduces were started, waited on, and backward ended (first step).
A case whose code is still a stub is ``{"not_written": message}``.
"""
import contextlib

import torch
import torch.distributed as dist

STEPS, MICRO_BATCH = 3, 4
EVENTS = []  # this rank's record of one step


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()


def batch(step, samples):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(samples, 8, generator=gen, dtype=torch.float64), torch.randn(samples, 4, generator=gen,
                                                                                     dtype=torch.float64)


class _Handle:
    """An all-reduce's handle whose wait() is recorded."""

    def __init__(self, work):
        self.work = work

    def wait(self, *args, **kwargs):
        out = self.work.wait(*args, **kwargs)
        EVENTS.append("wait")
        return out


def _record_all_reduce():
    """Replace dist.all_reduce (as ``ddp`` sees it) by a version that records each call."""
    real = dist.all_reduce

    def all_reduce(tensor, *args, async_op=False, **kwargs):
        EVENTS.append(f"all_reduce ({tensor.numel()} elements{', async' if async_op else ''})")
        work = real(tensor, *args, async_op=async_op, **kwargs)
        return _Handle(work) if async_op else work
    dist.all_reduce = all_reduce


def _end_of_backward(loss):
    def hook(grad):  # runs first in backward; the callback runs once backward is over
        torch.autograd.Variable._execution_engine.queue_callback(lambda: EVENTS.append("backward ends"))
        return grad
    loss.register_hook(hook)


def _single_process(world, micro_batches):
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = batch(step, world * micro_batches * MICRO_BATCH)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model


def _train(wrap, kind, micro_batches=1):
    import ddp

    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(rank)  # every rank starts from different weights
    wrapped = wrap(ddp, model)
    reference = make_model(0)
    out = {"start_gap": max(float((a - b).abs().max()) for a, b in zip(model.parameters(), reference.parameters()))}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = batch(step, world * micro_batches * MICRO_BATCH)
        EVENTS.clear()
        for m in range(micro_batches):
            first = (rank * micro_batches + m) * MICRO_BATCH
            inner = m < micro_batches - 1
            with wrapped.no_sync() if inner else contextlib.nullcontext():
                loss = torch.nn.functional.mse_loss(wrapped(x[first:first + MICRO_BATCH]),
                                                    y[first:first + MICRO_BATCH]) / micro_batches
                _end_of_backward(loss)
                loss.backward()
        if kind == "naive":
            wrapped.sync_gradients()
        else:
            wrapped.finish_gradient_synchronization()
        if step == 0:
            out["first_step"] = list(EVENTS)
        opt.step()
        opt.zero_grad()
    single = _single_process(world, micro_batches)
    out["end_gap"] = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), single.parameters()))
    return out


CASES = {
    "NaiveDDP": (lambda ddp, m: ddp.NaiveDDP(m), "naive", 1),
    "BucketedDDP, 0.0001 MiB buckets": (lambda ddp, m: ddp.BucketedDDP(m, bucket_cap_mb=0.0001), "bucketed", 1),
    "BucketedDDP, 3 micro-batches with no_sync": (lambda ddp, m: ddp.BucketedDDP(m, bucket_cap_mb=0.0001),
                                                  "bucketed", 3),
}


def try_wrappers():
    """Every case of CASES on this rank; a stub is reported, not raised."""
    _record_all_reduce()
    results = {}
    for name, (wrap, kind, micro_batches) in CASES.items():
        try:
            results[name] = _train(wrap, kind, micro_batches)
        except NotImplementedError as exc:  # every rank raises at the same place
            results[name] = {"not_written": str(exc)}
        dist.barrier()
    return results
