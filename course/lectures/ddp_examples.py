"""What lecture 08 runs on each rank (``course.dist.run``) and the small models it uses.

Each rank is a new Python process, so these functions live in a module the
ranks can import, not in the notebook. The bucketed, overlapped runs use
torch's own ``DistributedDataParallel`` with a *communication hook*: DDP calls
the hook with each bucket as soon as the bucket's gradients are ready (during
backward), and the hook returns a future for the all-reduce it started. The
hook here also notes the time each bucket was handed over and the time its
all-reduce finished, which is what the timelines draw.
"""
import time

import torch
import torch.distributed as dist


def mlp(width=256, depth=4, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 8)).to(dtype)


def global_batch(step, samples, width, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(samples, width, generator=gen, dtype=dtype), torch.randn(samples, 8, generator=gen, dtype=dtype)


# --- 1. data parallel = single process on the global batch --------------------------------------

def data_parallel_vs_single(steps=3, per_rank=8, width=16, uneven=False, average=True, weighted=False):
    """Train a float64 MLP data-parallel (all-reduce each gradient after backward),
    and the same model in one process on the whole global batch; the largest
    parameter difference after ``steps`` SGD steps. ``uneven``: rank r gets
    ``per_rank + r`` samples (each rank still averages over its own).
    ``average=False``: gradients summed over ranks, not averaged. ``weighted``:
    each rank's mean gradient is scaled by its share of the samples times the
    world size before the all-reduce (lecture 08's Problem 3 asks why)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [per_rank + (r if uneven else 0) for r in range(world)]
    model, single = mlp(width, 2, dtype=torch.float64), mlp(width, 2, dtype=torch.float64)
    opt, opt_single = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(single.parameters(), lr=0.1)
    for step in range(steps):
        x, y = global_batch(step, sum(sizes), width, torch.float64)
        first = sum(sizes[:rank])
        torch.nn.functional.mse_loss(model(x[first:first + sizes[rank]]), y[first:first + sizes[rank]]).backward()
        for p in model.parameters():
            if weighted:
                p.grad *= sizes[rank] * world / sum(sizes)
            dist.all_reduce(p.grad)
            if average:
                p.grad /= world
        torch.nn.functional.mse_loss(single(x), y).backward()
        for o in (opt, opt_single):
            o.step()
            o.zero_grad()
    return max(float((a - b).abs().max()) for a, b in zip(model.parameters(), single.parameters()))


def data_parallel_experiments():
    """The three runs the lecture compares, in one job: even shards averaged,
    uneven shards averaged, even shards summed."""
    return {"even shards, averaged": data_parallel_vs_single(),
            "uneven shards, averaged": data_parallel_vs_single(uneven=True),
            "even shards, summed": data_parallel_vs_single(average=False)}


# --- 2. timelines: when does each all-reduce run? ------------------------------------------------

class _Clock:
    def __init__(self):
        self.t0 = time.perf_counter()
        self.events = []  # (what, start ms, end ms)

    def now(self):
        return (time.perf_counter() - self.t0) * 1e3


def _timed_hook(state, bucket):
    """A DDP communication hook: all-reduce the bucket (average), noting in
    ``state["clock"]`` when it was handed over and when the all-reduce finished."""
    clock, world = state["clock"], dist.get_world_size()
    start = clock.now()
    future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()

    def done(fut):
        clock.events.append((f"bucket {bucket.index()}", start, clock.now()))
        return fut.value()[0].div_(world)
    return future.then(done)


def _mark_backward(loss, clock, marks):
    def at_start(grad):  # the loss's hook runs first in backward; the callback once backward is over
        marks["start"] = clock.now()
        torch.autograd.Variable._execution_engine.queue_callback(lambda: marks.__setitem__("end", clock.now()))
        return grad
    loss.register_hook(at_start)


def timeline(kind, bucket_cap_mb=25.0, width=512, depth=6, batch=64, steps=4):
    """Rank 0's last step: backward's span and each all-reduce's span, in ms from
    the start of the step. ``kind``: "naive" (one all-reduce per parameter after
    backward) or "ddp" (torch's DDP, buckets of ``bucket_cap_mb``, overlapped)."""
    rank = dist.get_rank()
    model = mlp(width, depth)
    state = {}
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        model.register_comm_hook(state, _timed_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = global_batch(rank, batch, width)
    for _ in range(steps):  # the last step is drawn; the first ones warm up (and let DDP settle its buckets)
        clock = state["clock"] = _Clock()
        marks = {}
        dist.barrier()
        clock.t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        _mark_backward(loss, clock, marks)
        loss.backward()  # DDP: returns once every bucket's all-reduce has finished
        if kind == "naive":
            for i, p in enumerate(model.parameters()):
                start = clock.now()
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
                clock.events.append((f"param {i}", start, clock.now()))
        synced = clock.now()
        opt.step()
        opt.zero_grad()
    return {"backward": (marks["start"], marks["end"]), "comm": sorted(clock.events, key=lambda e: e[1]),
            "synced": synced}


def timelines(bucket_cap_mb=1.0):
    """Both timelines in one job."""
    return {kind: timeline(kind, bucket_cap_mb) for kind in ("naive", "ddp")}


# --- 3. bucket size: step time of torch's DDP ---------------------------------------------------------

def step_times(bucket_caps_mb, width=512, depth=6, batch=32, steps=8, warmup=2):
    """Median step time (s, slowest rank) of torch's DDP for each bucket cap,
    and the number of buckets it made."""
    rank = dist.get_rank()
    out = []
    for cap in bucket_caps_mb:
        model = torch.nn.parallel.DistributedDataParallel(mlp(width, depth), bucket_cap_mb=cap)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x, y = global_batch(rank, batch, width)
        times = []
        for i in range(warmup + steps):
            dist.barrier()
            start = time.perf_counter()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= warmup:
                times.append(float(elapsed))
        out.append((cap, sorted(times)[len(times) // 2], _count_buckets(cap, width, depth, x, y)))
    return out


def _count_buckets(cap, width, depth, x, y):
    """How many buckets torch's DDP makes: a fresh copy whose comm hook counts its calls."""
    model = torch.nn.parallel.DistributedDataParallel(mlp(width, depth), bucket_cap_mb=cap)
    state = {"calls": 0}

    def counting(state, bucket):
        state["calls"] += 1
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])
    model.register_comm_hook(state, counting)
    for _ in range(2):  # DDP starts with one bucket and rebuilds its buckets after the first backward
        state["calls"] = 0
        torch.nn.functional.mse_loss(model(x), y).backward()
    return state["calls"]


def bucket_sweep(bucket_caps_mb, width=128, depth=24, batch=32, steps=10):
    """``step_times`` for an MLP of many small weights (``width`` x ``width`` floats:
    64 KiB at 128), so that caps below and above one weight's size both bite, and the
    time of one all-reduce of one weight's gradient on its own (median of 5 rounds of
    20 calls, slowest rank): what each extra bucket costs at least."""
    rows = step_times(bucket_caps_mb, width=width, depth=depth, batch=batch, steps=steps)
    vector, rounds = torch.zeros(width * width), []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(20):
            dist.all_reduce(vector)
        elapsed = torch.tensor([(time.perf_counter() - start) / 20])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        rounds.append(float(elapsed))
    return {"rows": rows, "allreduce_s": sorted(rounds)[2],
            "parameters": sum(p.numel() for p in mlp(width, depth).parameters())}


def bucket_counts(bucket_caps_mb, width=512, depth=6, batch=8):
    """``{cap: buckets}``: how many buckets torch's DDP makes for an MLP of this shape."""
    x, y = global_batch(dist.get_rank(), batch, width)
    return {cap: _count_buckets(cap, width, depth, x, y) for cap in bucket_caps_mb}


# --- 4. compression: what the exchange costs ----------------------------------------------------------

def exchange_times(sizes, fraction=0.01, repeats=7):
    """Per size n (float32 elements): fastest seconds (slowest rank) of a dense
    all-reduce, of a top-k selection (k = fraction * n) and of exchanging the
    top-k pairs with an all-gather."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for n in sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        k = max(1, int(fraction * n))
        timings = {"allreduce": [], "topk": [], "allgather": []}
        for _ in range(repeats):
            for name in timings:
                dist.barrier()
                start = time.perf_counter()
                if name == "allreduce":
                    dist.all_reduce(x.clone())
                elif name == "topk":
                    x.abs().topk(k)
                else:
                    pairs = torch.zeros(2 * k)
                    dist.all_gather_into_tensor(torch.empty(2 * k * world), pairs)
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                timings[name].append(float(elapsed))
        rows.append((n, *(min(t) for t in timings.values())))  # other work on the machine only adds time
    return rows


# --- drawing ---------------------------------------------------------------------------------------------

def draw_timeline(result, ax, title):
    """Backward's span on the top row; below it each all-reduce's span (handed
    over -> finished), on lanes of their own so the ones in flight together show."""
    start, end = result["backward"]
    comm = result["comm"]
    lanes = min(len(comm), 6)
    height = 1.6 / lanes
    ax.barh(0, end - start, left=start, height=0.6, color="C0", label="backward (compute)")
    for i, (_, begin, finish) in enumerate(comm):
        ax.barh(1 + (i % lanes) * height, finish - begin, left=begin, height=height * 0.8, color="C1",
                edgecolor="black", lw=0.5, label="all-reduce" if i == 0 else None)
    ax.axvline(end, color="C0", ls="--", lw=1)
    ax.axvline(result["synced"], color="black", ls=":", lw=1, label="gradients ready for the step")
    ax.set_yticks([0, 1 + 0.8 - height / 2], ["compute", "communication"])
    ax.set_ylim(-0.5, 2.7)
    ax.invert_yaxis()
    ax.set_xlim(0, None)
    ax.set_xlabel("ms since the step began (rank 0)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)


# --- 5. the data-parallel roofline: backward against the gradient all-reduce ----------------------------

def roofline_times(samples_per_rank, width=512, depth=6, repeats=3):
    """This rank's compute rate and, per batch size, backward's time against the
    gradient all-reduce's (fastest of ``repeats``, slowest rank), for the float32
    MLP. Returns ``{"flops_per_s": ..., "parameters": Ψ, "rows": [(samples,
    backward s, all-reduce s), ...]}``; an MLP sample passes every weight once,
    so its backward costs 4Ψ FLOPs."""
    rank = dist.get_rank()
    model = mlp(width, depth)
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])

    def slowest(seconds):
        elapsed = torch.tensor([seconds])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    a, b = torch.randn(width, width), torch.randn(width, width)
    matmul = []
    for _ in range(repeats):  # both ranks at once, as during training
        dist.barrier()
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        matmul.append(slowest((time.perf_counter() - start) / 4))
    rows = []
    for samples in samples_per_rank:
        x, y = global_batch(rank, samples, width)
        backward, allreduce = [], []
        for _ in range(repeats):
            loss = torch.nn.functional.mse_loss(model(x), y)
            dist.barrier()
            start = time.perf_counter()
            loss.backward()
            backward.append(slowest(time.perf_counter() - start))
            model.zero_grad()
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(flat)
            allreduce.append(slowest(time.perf_counter() - start))
        rows.append((samples, min(backward), min(allreduce)))
    return {"flops_per_s": 2 * width**3 / min(matmul), "parameters": flat.numel(), "rows": rows}
