"""The public oracles of lab 09's checks, in the grader's process. None of them
computes what a lab function returns the way the lab asks for it: training is
torch's own unsharded optimizer on the whole batch in one process; the byte
counts are the closed forms and the ZeRO paper's printed numbers.

- ``closed_form``: bytes per rank at ZeRO stage 0-3, 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N,
  16Ψ/N for K = 12 (any K); ``FIGURE_1``, ``TABLE_1``, ``TABLE_2``: the numbers
  printed in Rajbhandari et al. 2020 (Figure 1: Ψ = 7.5B, N = 64, K = 12; Table 1:
  GB per device by DP degree; Table 2: the largest model on 32 GB devices).
- ``padded``: what ``flatten_padded`` must give, by NumPy.
- ``unsharded``: the MLP trained by the unsharded torch optimizer (Adam with L2
  weight decay, SGD with or without momentum) on the whole batch, in one process:
  its flat parameters after every step of the case.
- ``formula_queries``: the ``zero_bytes`` and ``flatten_padded`` queries, values
  drawn from the grading's generator (the paper's cases are the paper's).
- ``where``: the name of a flat parameter index (layer, weight or bias, index).
- ``rebuild``: a ZeRO-3 model's full flat parameters from every rank's shards,
  by the documented layout (each layer's parameters flattened in order, padded
  to ``n * ceil(numel / n)``, rank r holding the r-th of n equal pieces).
"""
import math

import numpy as np

SHARDED = ("nothing sharded", "optimizer state / N", "optimizer state and gradients / N", "everything / N")
FIGURE_1 = [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)]  # GB, Ψ = 7.5B, N = 64, K = 12
# Table 1: GB per device for stages 1, 2, 3 (P_os, P_os+g, P_os+g+p), by DP degree and model size.
TABLE_1 = {
    7.5e9: {1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5), 64: (31.4, 16.6, 1.88),
            256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12)},
    128e9: {1: (2048, 2048, 2048), 4: (896, 704, 512), 16: (608, 368, 128), 64: (536, 284, 32),
            256: (518, 263, 8), 1024: (513, 257, 2)},
    1e12: {1: (16000, 16000, 16000), 4: (7000, 5500, 4000), 16: (4750, 2875, 1000), 64: (4187, 2218, 250),
           256: (4046, 2054, 62.5), 1024: (4011, 2013, 15.6)},
}
# Table 2: largest model (parameters) on 32 GB devices; MP-way model parallelism, DP degree 64 throughout.
TABLE_2 = {1: (2e9, 7.6e9, 14.4e9, 128e9), 2: (4e9, 15.2e9, 28.8e9, 256e9), 4: (8e9, 30.4e9, 57.6e9, 0.5e12),
           8: (16e9, 60.8e9, 115.2e9, 1e12), 16: (32e9, 121.6e9, 230.4e9, 2e12)}


def closed_form(psi, n, stage, k):
    return [(4 + k) * psi, 4 * psi + k * psi / n, 2 * psi + (2 + k) * psi / n, (4 + k) * psi / n][stage]


FLATTEN_SIZES = [([3, 4], 4), ([5, 2, 6], 3), ([8], 4), ([2, 1], 5), ([7], 1)]


def formula_queries(rng):
    """{"zero_bytes": [(psi, n, stage, k)], "flatten_padded": [(arrays, n)], "closed": the closed-form
    cases}: the paper's cases, then an odd and a large Ψ, N = 1, 2, 3 and one drawn, K = 12, 8 and
    a drawn fraction; flatten_padded's arrays drawn, of sizes that do and do not divide by n."""
    odd = int(rng.integers(3, 100)) | 1
    closed = [(psi, n, stage, k) for psi in (odd, float(rng.integers(10**6, 10**10)))
              for n in (1, 2, 3, int(rng.integers(5, 65))) for stage in range(4)
              for k in (12, 8, float(rng.integers(3, 32)) / 2)]
    zero_bytes = [(7.5e9, 64, stage, 12) for stage, _ in FIGURE_1]
    zero_bytes += [(psi, n, stage, 12) for psi, rows in TABLE_1.items() for n in rows for stage in (1, 2, 3)]
    zero_bytes += [(1, 64, stage, 12) for stage in range(4)] + closed
    flatten = [([rng.standard_normal(s).round(6) for s in sizes], n) for sizes, n in FLATTEN_SIZES]
    return {"zero_bytes": zero_bytes, "flatten_padded": flatten, "closed": closed}


def where(dims, index):
    """Which parameter element ``index`` of the flat parameters of an MLP of widths ``dims`` is."""
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        for part, size in (("weight", a * b), ("bias", b)):
            if index < size:
                return f"layer {i}'s {part}[{index}]"
            index -= size
    return f"element {index} past the end"


def padded(arrays, n):
    """Every element of ``arrays`` in order, then zeros up to a multiple of ``n``."""
    flat = np.concatenate([np.asarray(a, dtype=float).reshape(-1) for a in arrays])
    return np.concatenate([flat, np.zeros(n * math.ceil(flat.size / n) - flat.size)])


def layer_sizes(dims):
    """The parameter count of each Linear of an MLP with layer widths ``dims``."""
    return [b * (a + 1) for a, b in zip(dims[:-1], dims[1:])]


def unsharded(weights, xs, ys, optimizer):
    """Flat parameters (weights then bias of each Linear, in order) of the Linear-Tanh MLP
    of ``weights`` after one step of ``optimizer`` ((torch.optim class name, keyword
    arguments)) per batch in ``xs``/``ys``, on the whole batch (MSE loss), in this process."""
    import torch

    layers = []
    for i, (weight, bias) in enumerate(weights):
        layer = torch.nn.Linear(weight.shape[1], weight.shape[0], dtype=torch.float64)
        with torch.no_grad():
            layer.weight.copy_(torch.from_numpy(weight))
            layer.bias.copy_(torch.from_numpy(bias))
        layers += [layer, torch.nn.Tanh()] if i < len(weights) - 1 else [layer]
    model = torch.nn.Sequential(*layers)
    name, kwargs = optimizer
    opt = getattr(torch.optim, name)(model.parameters(), **kwargs)
    for x, y in zip(xs, ys):
        torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def rebuild(shards_by_rank, sizes):
    """The full flat parameters of layers of ``sizes`` parameters from each rank's list of
    shards (rank order), or a string saying why they cannot be rebuilt."""
    n = len(shards_by_rank)
    full = []
    for layer, size in enumerate(sizes):
        want = math.ceil(size / n)
        pieces = []
        for rank, shards in enumerate(shards_by_rank):
            found = [np.asarray(s).size for s in shards]
            if len(shards) != len(sizes) or found[layer] != want:
                return (f"rank {rank} holds shards of {found} elements; expected {len(sizes)} shards (one per "
                        f"layer with parameters) of {[math.ceil(s / n) for s in sizes]}: ceil(numel / {n}) each")
            pieces.append(np.asarray(shards[layer], dtype=float).reshape(-1))
        full.append(np.concatenate(pieces)[:size])
    return np.concatenate(full)
