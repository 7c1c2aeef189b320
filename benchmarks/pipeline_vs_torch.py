"""The lab's reference pipeline executor against torch's ``torch.distributed.pipelining``.

    .venv/bin/python benchmarks/pipeline_vs_torch.py [--ranks 2 4] [--microbatches 8] [--steps 60]

Launches the processes itself (``course.dist``, gloo on the CPU). An MLP of
equal blocks (Linear + ReLU, float32) is cut into one stage of consecutive
blocks per rank. The reference ``run_pipeline`` (lab 11) runs this rank's ops
of ``make_schedule(p, m, kind)``; torch runs the same stage, with the same
initial weights, as a ``PipelineStage`` under ``ScheduleGPipe`` or
``Schedule1F1B``, on the same microbatches with the same loss (mean squared
error per microbatch, averaged over the ``m`` microbatches: the reference
divides each loss by ``m``, torch divides the gradients by ``m``,
``scale_grads=True``). A step is one forward and backward of the whole batch
(no optimizer: both keep their weights, so every step does the same work);
it stands between two barriers and its time is the slowest rank's. The two
executors alternate step by step in one job. Before timing, both must give
the same gradients. Prints a table and writes it to
``docs/benchmarks/pipeline.md``. The ratio is reference / torch step time,
so below 1 the reference is faster; the last column is the same ratio from
each executor's fastest step.

torch's 1F1B runs one more warm-up forward than the lab's (``p - d`` against
``p - d - 1``) before alternating; both hold at most ``p - d`` microbatches in
flight on stage ``d``, and both are dependency-valid orders of the same ops.
"""
import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "solutions" / "11-pipeline-parallel"


def make_stage(width, depth, rank, world):
    """Blocks ``rank * depth // world`` .. of an MLP of ``depth`` blocks; every rank
    builds the whole model from the same seed and keeps its own slice."""
    import torch

    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(depth)]
    return torch.nn.Sequential(*blocks[rank * depth // world:(rank + 1) * depth // world])


def measure(width, depth, batch, m, kinds, steps, warmup=3):
    """Every rank: seconds per step (slowest rank) of the reference and of torch, per schedule kind."""
    import torch
    import torch.distributed as tdist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    sys.path.insert(0, str(REFERENCE))
    from pipeline import make_schedule, run_pipeline

    rank, world = tdist.get_rank(), tdist.get_world_size()
    first, last = rank == 0, rank == world - 1
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)
    x_mbs, y_mbs = list(x.chunk(m)), list(y.chunk(m))
    loss_fn = torch.nn.functional.mse_loss
    torch_schedules = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    results = {}
    for kind in kinds:
        ours, theirs = make_stage(width, depth, rank, world), make_stage(width, depth, rank, world)
        ops = make_schedule(world, m, kind)[rank]
        stage = PipelineStage(theirs, rank, world, torch.device("cpu"))
        schedule = torch_schedules[kind](stage, m, loss_fn=loss_fn, scale_grads=True)

        def reference_step():
            run_pipeline(ours, ops, x_mbs, y_mbs, loss_fn, (batch // m, width))

        def torch_step():
            if first:
                schedule.step(x, return_outputs=False)
            elif last:
                schedule.step(target=y, return_outputs=False)
            else:
                schedule.step(return_outputs=False)

        runs = {"reference": (ours, reference_step), "torch": (theirs, torch_step)}
        times = {name: [] for name in runs}
        for i in range(warmup + steps):
            order = list(runs.items()) if i % 2 == 0 else list(runs.items())[::-1]  # neither always goes first
            for name, (module, step) in order:
                for p in module.parameters():
                    p.grad = None
                tdist.barrier()
                start = time.perf_counter()
                step()
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                tdist.all_reduce(elapsed, op=tdist.ReduceOp.MAX)  # the slowest rank's time
                if i >= warmup:
                    times[name].append(float(elapsed))
        # Same weights, same microbatches, same loss: the gradients of the last step must agree.
        gap = torch.tensor([max(float((a.grad - b.grad).abs().max() / b.grad.abs().max().clamp_min(1e-30))
                                for a, b in zip(ours.parameters(), theirs.parameters()))])
        tdist.all_reduce(gap, op=tdist.ReduceOp.MAX)
        results[kind] = {"times": times, "gap": float(gap)}
    n_params = torch.tensor([sum(p.numel() for p in make_stage(width, depth, rank, world).parameters())])
    tdist.all_reduce(n_params)
    return {"schedules": results, "params": int(n_params)}


def table(rows):
    import numpy as np

    lines = ["| stages p | model | parameters | schedule | reference step (ms) | torch step (ms) | reference / torch "
             "| reference / torch, fastest steps | largest relative gradient difference |",
             "|---:|---|---:|---|---:|---:|---:|---:|---:|"]
    for ranks, label, result in rows:
        for kind, run in result["schedules"].items():
            ours, theirs = np.array(run["times"]["reference"]), np.array(run["times"]["torch"])
            lines.append(f"| {ranks} | {label} | {result['params']:,} | {kind} | {np.median(ours) * 1e3:.2f} "
                         f"| {np.median(theirs) * 1e3:.2f} | {np.median(ours) / np.median(theirs):.3f} "
                         f"| {ours.min() / theirs.min():.3f} | {run['gap']:.1e} |")
    return "\n".join(lines)


def main():
    import report  # benchmarks/report.py, beside this script
    import torch

    from course import dist

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4],
                        help="pipeline stages, one process each (one job per value)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="samples per step, cut into the microbatches")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = parser.parse_args()
    models = [(256, 8), (1024, 8)]  # (width, blocks): ~0.5 M and ~8.4 M parameters
    rows = []
    for ranks in args.ranks:
        for width, depth in models:
            job = dist.run(f"{__file__}:measure", ranks, width, depth, args.batch, args.microbatches,
                           ("gpipe", "1f1b"), args.steps, timeout=900, backend="gloo")
            result = job.check().results[0]
            for kind, run in result["schedules"].items():
                assert run["gap"] < 1e-4, f"{kind}: the reference and torch disagree by {run['gap']} (relative)"
            rows.append((ranks, f"MLP {depth} x {width}", result))
    machines = "; ".join(f"p = {ranks}: {report.machine(ranks)}" for ranks in args.ranks)
    where = (f"{machines}; torch {torch.__version__}, gloo on loopback; "
             f"float32 MLP cut into p stages of consecutive blocks, {args.batch} samples per step "
             f"in {args.microbatches} microbatches, forward and backward only; "
             f"median of {args.steps} steps after 3 warm-up steps, slowest rank per step; "
             "the two executors alternate step by step in one job")
    text = table(rows)
    report.publish(__file__, "pipeline.md",
                   "Reference `run_pipeline` (lab 11) against `torch.distributed.pipelining`",
                   where, text, write=not args.no_write)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
