"""What lecture 09 runs on every rank: torch's own sharded training, measured.

Each rank is a new process (``course.dist.run``), so these functions live in a
module the ranks can import. ``measure(mode, width, depth, steps)`` trains a
small fp32 MLP with Adam for a few steps in one of four ways and returns, for
this rank, the bytes it holds and the bytes that went into collectives:

- ``"dp"``     plain data parallelism: gradients all-reduced by hand, torch Adam;
- ``"zero1"``  torch's ``ZeroRedundancyOptimizer`` (optimizer state sharded);
- ``"fsdp2"``  ``fully_shard(reshard_after_forward=False)``: parameters stay
               gathered from forward to backward, as ZeRO-2 keeps them whole;
- ``"fsdp3"``  ``fully_shard()``: every layer gathered just before use, freed after
               (ZeRO-3).

``measure_all(modes, ...)`` runs several in one job (starting processes is the
slow part). Bytes held are counted from the tensors themselves (distinct storages; a
``DTensor`` counts its local shard). Gathered parameters (FSDP's unsharded
copies) are sampled at every layer's forward and backward hooks; their peak
is added to what the rank holds. Collectives are counted by wrapping the
``torch.distributed`` functions the libraries call.
"""
import torch
import torch.distributed as dist

from course.timing import allreduce_seconds, matmul_flops  # noqa: F401 (the lecture calls ex.matmul_flops)

COLLECTIVES = ("all_reduce", "broadcast", "reduce_scatter_tensor", "reduce_scatter_single",
               "all_gather_into_tensor", "all_gather_single")


def _nbytes(t):
    return t.numel() * t.element_size()


class CountCollectives:
    """Wraps ``torch.distributed``'s collectives; ``calls`` lists (name, bytes) where
    bytes is the size of the whole vector involved: the all-reduced or broadcast
    tensor, the reduce-scatter's input, the all-gather's output."""

    def __enter__(self):
        self.calls, self.originals = [], {}
        for name in COLLECTIVES:
            if hasattr(dist, name):
                self.originals[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self.originals[name]))
        return self

    def _wrap(self, name, original):
        def counted(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [v for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k != "src"]
            if name.startswith("reduce_scatter"):
                nbytes = _nbytes(tensors[1])  # (output shard, input vector)
            elif name.startswith("all_gather"):
                nbytes = _nbytes(tensors[0])  # (output vector, input shard)
            else:
                nbytes = _nbytes(tensors[0])
            self.calls.append((name, nbytes))
            return original(*args, **kwargs)
        return counted

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(dist, name, original)


def ring_bytes_sent(calls, n):
    """Bytes one rank sends for these collectives with ring algorithms (module 06):
    all-reduce 2(n-1)/n of the vector, the others (n-1)/n."""
    return sum((2 if name == "all_reduce" else 1) * (n - 1) / n * nbytes for name, nbytes in calls)


def make_model(width, depth, seed=0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def held_bytes(tensors):
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shard)."""
    storages = {}
    for t in tensors:
        if t is not None:
            s = _local(t).untyped_storage()
            storages[s.data_ptr(), s.nbytes()] = s.nbytes()
    return sum(storages.values())


class GatheredWatch:
    """Samples the bytes of gathered (plain, non-DTensor) parameters of FSDP-sharded
    layers at each layer's forward and backward hooks."""

    def __init__(self, layers):
        self.layers, self.peak, self.handles = layers, 0, []
        for layer in layers:
            self.handles.append(layer.register_forward_pre_hook(lambda *a: self.sample()))
            self.handles.append(layer.register_forward_hook(lambda *a: self.sample()))
            self.handles.append(layer.register_full_backward_pre_hook(lambda *a: self.sample()))

    def sample(self):
        gathered = [p for layer in self.layers for p in layer.parameters(recurse=False) if not hasattr(p, "to_local")]
        self.peak = max(self.peak, held_bytes(gathered))


def measure(mode, width=64, depth=6, steps=2, batch=8):
    """This rank's bytes held (parameters, gradients, optimizer state, peak gathered) and
    collective calls of one training step, for ``mode`` in dp, zero1, fsdp2, fsdp3."""
    n, rank = dist.get_world_size(), dist.get_rank()
    model = make_model(width, depth)
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    watch = None
    if mode in ("fsdp2", "fsdp3"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (n,))
        for layer in linears:
            fully_shard(layer, mesh=mesh, reshard_after_forward=(mode == "fsdp3"))
        fully_shard(model, mesh=mesh, reshard_after_forward=(mode == "fsdp3"))
        watch = GatheredWatch(linears)
    if mode == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
        inner = opt.optim
    else:
        opt = inner = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    for step in range(steps):
        x = torch.randn(batch, width, generator=g)
        with CountCollectives() as counted:
            model(x).square().mean().backward()
            if mode in ("dp", "zero1"):  # data parallelism by hand: average the gradients
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= n
            # the moment everything is alive at once: parameters, gradients, optimizer state
            params, grads = list(model.parameters()), [p.grad for p in model.parameters()]
            state = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
            opt.step()
            opt.zero_grad()
    state = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return {"psi": sum(p.numel() for p in make_model(width, depth).parameters()),
            "layer_bytes": 4 * linears[0].weight.numel() + 4 * width if watch else 0,
            "params": held_bytes(params), "grads": held_bytes(grads), "state": held_bytes(state),
            "gathered_peak": watch.peak if watch else 0, "calls": counted.calls}


def measure_all(modes=("dp", "zero1", "fsdp2", "fsdp3"), **kwargs):
    """``{mode: measure(mode, **kwargs)}`` for this rank, every mode in one job, and under
    ``"allreduce_s"`` the best time of a 4 MiB all-reduce (None on one rank)."""
    out = {mode: measure(mode, **kwargs) for mode in modes}
    out["allreduce_s"] = allreduce_seconds() if dist.get_world_size() > 1 else None
    return out


# --- on the notebook's side: predictions and pictures -----------------------------------

def predicted_bytes(psi, n, stage, weight=2, grad=2, state=12):
    """Bytes per rank at ZeRO ``stage``: ``weight``, ``grad`` and ``state`` bytes per
    parameter (mixed-precision Adam: 2, 2, 12; fp32 Adam: 4, 4, 8), the
    optimizer state divided by n from stage 1, the gradients from stage 2, the
    weights at stage 3."""
    shard = [(1, 1, 1), (1, 1, n), (1, n, n), (n, n, n)][stage]
    return psi * (weight / shard[0] + grad / shard[1] + state / shard[2])


STAGE_NAMES = ("0: data parallel", "1: optimizer state", "2: + gradients", "3: + parameters")


def draw_stages(ax, n=4):
    """What each of ``n`` ranks holds at each ZeRO stage: a bar per rank for the weights
    (2Ψ), gradients (2Ψ) and optimizer state (12Ψ), filled where the rank keeps
    them and hatched-empty where another rank does."""
    from matplotlib.patches import Patch, Rectangle

    parts = (("weights 2Ψ", 2, "C0"), ("gradients 2Ψ", 2, "C1"), ("optimizer state 12Ψ", 12, "C2"))
    sharded_from = (3, 2, 1)  # the stage from which each part is sharded
    for stage in range(4):
        y0 = (3 - stage) * 1.4
        ax.text(-0.3, y0 + 0.45, f"stage {STAGE_NAMES[stage]}", ha="right", va="center", fontsize=8)
        for rank in range(n):
            x0 = rank * 17.5
            left = x0
            for (label, width, colour), first in zip(parts, sharded_from):
                if stage >= first:  # sharded: this rank keeps 1/n of it
                    piece = width / n
                    ax.add_patch(Rectangle((left, y0), width, 0.9, facecolor="none", edgecolor=colour, hatch="///",
                                           lw=0.5, alpha=0.5))
                    ax.add_patch(Rectangle((left + rank * piece, y0), piece, 0.9, color=colour))
                else:
                    ax.add_patch(Rectangle((left, y0), width, 0.9, color=colour))
                left += width
            held = predicted_bytes(1, n, stage)
            ax.text(x0 + 8, y0 - 0.15, f"rank {rank}: {held:.3g}Ψ", ha="center", va="top", fontsize=6.5)
    ax.set_xlim(-0.5, n * 17.5)
    ax.set_ylim(-0.5, 4 * 1.4)
    ax.axis("off")
    ax.legend(handles=[Patch(color=c, label=label) for label, _, c in parts], fontsize=7, ncol=3,
              loc="upper center", bbox_to_anchor=(0.5, 1.08), frameon=False)


# --- the network roofline: this machine's numbers, and ZeRO-3's prefetching -------------------

def zero3_schedule(n_layers, t_compute, t_gather, prefetch):
    """One ZeRO-3 step on two streams, compute and communication, as ``(row, start, duration, label)``
    tasks (row 0: communication, 1: compute) and the step's end.

    Forward: each layer's parameters are all-gathered (``t_gather``), then it computes
    (``t_compute``). Backward, last layer first: gather again, compute twice as long,
    reduce-scatter the gradient (``t_gather``). Communication runs in issue order on
    its stream. Without prefetching a layer's gather is issued when the previous
    layer's compute ends; with it, when that compute starts (one layer ahead).
    """
    tasks, comm_free, compute_end, issue = [], 0.0, 0.0, 0.0
    order = [("F", k, t_compute) for k in range(n_layers)] + \
            [("B", k, 2 * t_compute) for k in reversed(range(n_layers))]
    gather_end = None
    for j, (phase, layer, work) in enumerate(order):
        if gather_end is None:  # not prefetched: issued now
            start = max(comm_free, issue)
            tasks.append((0, start, t_gather, f"AG{layer}"))
            gather_end = comm_free = start + t_gather
        start = max(compute_end, gather_end)
        tasks.append((1, start, work, f"{phase}{layer}"))
        compute_end = start + work
        gather_end = None
        if prefetch and j + 1 < len(order):  # the next layer's gather, issued as this one starts
            nxt = order[j + 1][1]
            g_start = max(comm_free, start)
            tasks.append((0, g_start, t_gather, f"AG{nxt}"))
            gather_end = comm_free = g_start + t_gather
        if phase == "B":  # the gradient leaves as soon as it exists
            rs_start = max(comm_free, compute_end)
            tasks.append((0, rs_start, t_gather, f"RS{layer}"))
            comm_free = rs_start + t_gather
        issue = compute_end
    return tasks, max(start + duration for _, start, duration, _ in tasks)
