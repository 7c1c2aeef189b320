"""The lab's reference ``BucketedDDP`` against torch's own ``DistributedDataParallel``.

    .venv/bin/python benchmarks/ddp_vs_torch.py [--ranks 4] [--bucket-mib 1] [--steps 30]

Launches the processes itself (``course.dist``, gloo on the CPU). Both wrappers
train the same MLP (float32, same initial weights, same bucket cap) in the same
job, alternating step by step; each step (forward, backward, gradient
synchronization, SGD step) stands between two barriers, and the time of a step
is the slowest rank's. Prints a table and writes it to ``docs/benchmarks/ddp.md``
(a fragment a docs page can pull in with MyST's ``{include}``). The ratio is
reference / torch step time, so below 1 the reference is faster; the last
column is the same ratio from each wrapper's fastest step: with more processes
than cores (and other work on the machine) the medians are noisy, and
interference only ever adds time.
"""
import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "solutions" / "08-data-parallel"


def make_model(width, depth):
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def measure(width, depth, batch, bucket_mib, steps, warmup=3):
    """Every rank: seconds per step (slowest rank) of the reference and of torch's DDP."""
    import torch
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, str(REFERENCE))
    from ddp import BucketedDDP

    rank = tdist.get_rank()
    ours = BucketedDDP(make_model(width, depth), bucket_cap_mb=bucket_mib)
    theirs = DistributedDataParallel(make_model(width, depth), bucket_cap_mb=bucket_mib)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, width, generator=gen), torch.randint(0, 10, (batch,), generator=gen)

    def step(model, opt, finish):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        finish()
        opt.step()
        opt.zero_grad()

    runs = {"reference": (ours, torch.optim.SGD(ours.parameters(), lr=1e-3), ours.finish_gradient_synchronization),
            "torch": (theirs, torch.optim.SGD(theirs.parameters(), lr=1e-3), lambda: None)}
    times = {name: [] for name in runs}
    for i in range(warmup + steps):
        order = list(runs.items()) if i % 2 == 0 else list(runs.items())[::-1]  # neither always goes first
        for name, (model, opt, finish) in order:
            tdist.barrier()
            start = time.perf_counter()
            step(model, opt, finish)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            tdist.all_reduce(elapsed, op=tdist.ReduceOp.MAX)  # the slowest rank's time
            if i >= warmup:
                times[name].append(float(elapsed))
    # Same data, same weights, same averaged gradients: the two models must still agree.
    gap = max(float((a - b).abs().max()) for a, b in zip(ours.parameters(), theirs.parameters()))
    n_params = sum(p.numel() for p in ours.parameters())
    return {"times": times, "gap": gap, "params": n_params, "buckets": len(ours.buckets)}


def table(rows):
    import numpy as np

    lines = ["| model | parameters | buckets (reference) | reference step (ms) | torch DDP step (ms) "
             "| reference / torch | reference / torch, fastest steps |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for label, result in rows:
        ours, theirs = np.array(result["times"]["reference"]), np.array(result["times"]["torch"])
        lines.append(f"| {label} | {result['params']:,} | {result['buckets']} | {np.median(ours) * 1e3:.2f} "
                     f"| {np.median(theirs) * 1e3:.2f} | {np.median(ours) / np.median(theirs):.3f} "
                     f"| {ours.min() / theirs.min():.3f} |")
    return "\n".join(lines)


def main():
    import report  # benchmarks/report.py, beside this script
    import torch

    from course import dist

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--bucket-mib", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = parser.parse_args()
    models = [(512, 4), (1024, 4)]  # (width, hidden layers): ~1.1 M and ~4.2 M parameters
    rows = []
    for width, depth in models:
        job = dist.run(f"{__file__}:measure", args.ranks, width, depth, args.batch, args.bucket_mib, args.steps,
                       timeout=900, backend="gloo")
        result = job.check().results[0]
        assert result["gap"] < 1e-4, f"the reference and torch's DDP disagree by {result['gap']}"
        rows.append((f"MLP {depth} x {width}", result))
    where = (f"{report.machine(args.ranks)}, torch {torch.__version__}, gloo on loopback; "
             f"float32 MLP, {args.batch} samples per rank, bucket cap {args.bucket_mib:g} MiB for both; "
             f"median of {args.steps} steps after 3 warm-up steps, slowest rank per step; "
             "the two wrappers alternate step by step in one job")
    text = table(rows)
    report.publish(__file__, "ddp.md", "Reference `BucketedDDP` (lab 08) against torch's `DistributedDataParallel`",
                   where, text, write=not args.no_write)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
