"""What the handout runs on every rank: your ZeRO-1 optimizer and ZeRO-3 model
next to unsharded training of the same model, with the bytes each rank holds.

You do not need to edit this file. ``course.dist.run(try_sharding, n, steps)``
returns, per rank, ``{"zero1": {...}, "zero3": {...}}``: the largest difference
between your parameters and unsharded Adam's after ``steps`` steps, the bytes
the optimizer holds, and (ZeRO-3) the most bytes of gathered parameters alive
at once. A part you have not written yet comes back as ``{"not_written": message}``.
"""
import weakref

import torch
import torch.distributed as dist

DIMS = (6, 22, 10, 22, 13, 3)  # 967 parameters: not a multiple of 2, 3 or 4
BATCH = 24
ADAM = {"lr": 0.05, "weight_decay": 0.1}


def make_layers(seed=0):
    """The same small float64 MLP on every rank (Linear, Tanh, ..., Linear)."""
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(DIMS[:-1], DIMS[1:])):
        layers.append(torch.nn.Linear(a, b, dtype=torch.float64))
        if i < len(DIMS) - 2:
            layers.append(torch.nn.Tanh())
    return layers


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(BATCH, DIMS[0], generator=g, dtype=torch.float64),
            torch.randn(BATCH, DIMS[-1], generator=g, dtype=torch.float64))


def my_rows(t):
    """This rank's slice of the global batch."""
    rows = BATCH // dist.get_world_size()
    return t[dist.get_rank() * rows:(dist.get_rank() + 1) * rows]


def tensor_bytes(tensors):
    """Bytes of the distinct storages behind ``tensors`` (a view counts its whole buffer)."""
    storages = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors}
    return sum(size for _, size in storages)


def optimizer_bytes(opt):
    """What a torch optimizer holds: its parameters and every tensor in its state."""
    tensors = [p for group in opt.param_groups for p in group["params"]]
    tensors += [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]
    return tensor_bytes(tensors)


def unsharded(steps):
    """Flat parameters after ``steps`` steps of plain Adam on the whole batch, and Adam's bytes."""
    model = torch.nn.Sequential(*make_layers())
    opt = torch.optim.Adam(model.parameters(), **ADAM)
    for step in range(steps):
        x, y = batch(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), optimizer_bytes(opt)


class WatchGathers:
    """Counts the bytes of all-gather outputs alive at once (``dist.all_gather_single``,
    or its older name ``dist.all_gather_into_tensor``)."""

    NAMES = ("all_gather_single", "all_gather_into_tensor")

    def __enter__(self):
        self.originals, self.live, self.peak = {name: getattr(dist, name) for name in self.NAMES}, 0, 0
        for name, original in self.originals.items():
            setattr(dist, name, self._watch(original))
        return self

    def _watch(self, original):
        def watched(out, inp, *args, **kwargs):
            result = original(out, inp, *args, **kwargs)
            self.live += out.nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(out, self._freed, out.nbytes)
            return result
        return watched

    def _freed(self, nbytes):
        self.live -= nbytes

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(dist, name, original)


def _zero1(zero, steps, want):
    model = torch.nn.Sequential(*make_layers())
    opt = zero.ShardedOptimizer(model.parameters(), torch.optim.Adam, **ADAM)
    for step in range(steps):
        x, y = batch(step)
        torch.nn.functional.mse_loss(model(my_rows(x)), my_rows(y)).backward()
        opt.step()
        opt.zero_grad()
    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"max_diff": float((got - want).abs().max()), "optimizer_bytes": optimizer_bytes(opt.optimizer)}


def _zero3(zero, steps, want):
    layers = make_layers()
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    sizes = [s for s in sizes if s]
    model = zero.Zero3Sequential(layers)
    opt = torch.optim.Adam(model.parameters(), **ADAM)
    with WatchGathers() as watch:
        for step in range(steps):
            x, y = batch(step)
            torch.nn.functional.mse_loss(model(my_rows(x)), my_rows(y)).backward()
            opt.step()
            opt.zero_grad()
    # The documented layout, gathered back with your own gather_flat and its padding cut off.
    got = torch.cat([zero.gather_flat(shard)[:size] for shard, size in zip(model.shards, sizes)])
    return {"max_diff": float((got - want).abs().max()), "stored_bytes": tensor_bytes(list(model.parameters())),
            "peak_gathered_bytes": watch.peak, "largest_layer_bytes": 8 * max(shard.numel() for shard in model.shards)
            * dist.get_world_size()}


def try_sharding(steps=3):
    """Both parts on this rank; see the module docstring."""
    import zero

    want, adam_bytes = unsharded(steps)
    out = {"unsharded_adam_bytes": adam_bytes, "model_bytes": 8 * want.numel()}
    for name, part in (("zero1", _zero1), ("zero3", _zero3)):
        try:
            out[name] = part(zero, steps, want)
        except NotImplementedError as err:  # a stub: every rank raises before any collective
            out[name] = {"not_written": str(err)}
    return out
