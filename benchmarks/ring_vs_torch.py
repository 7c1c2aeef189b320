"""The lab's reference ring attention against torch's own templated ring attention.

    .venv/bin/python benchmarks/ring_vs_torch.py [--ranks 2 4] [--seq 512 1024] [--steps 15]

Launches the processes itself (``course.dist``, gloo on the CPU). Every rank
draws the same whole q, k, v (``[batch, heads, seq, head_dim]``, float32) and
keeps its shard of the sequence, in the layout each implementation expects:
contiguous without a mask; under the causal mask, the lab's ``zigzag_indices``
for the reference and torch's own ``_HeadTailLoadBalancer`` for torch (both
give rank r chunk r and chunk 2P-1-r of 2P chunks). The reference
``ring_attention`` (lab 12) runs against torch's private
``torch.distributed.tensor.experimental._context_parallel._attention.
_templated_ring_attention``, called directly with the process group of a
one-dimensional ``DeviceMesh`` and ``aten._scaled_dot_product_flash_attention_for_cpu``
as the op on each block (the public ``context_parallel()`` dispatches only the
CUDA flash, efficient and cuDNN ops, so it never reaches the ring on the CPU),
and its backward ``_templated_ring_attention_backward`` with
``aten._scaled_dot_product_flash_attention_for_cpu_backward``. torch's load
balancing (``_cp_options.enable_load_balance``) is on under the causal mask
and off without it, which is what the function requires. torch runs twice:
rotating K/V around the ring with all-to-alls (``set_rotate_method("alltoall")``),
as the reference does with point-to-point messages, and with its default,
one all-gather of every rank's K/V (``"allgather"``). The last is
single-process ``torch.nn.functional.scaled_dot_product_attention`` over the
whole sequence, on rank 0 while the others wait.

Before timing, every output and every gradient (q, k, v) must match a dense
float64 attention of the whole sequence. A forward step is one call; a
forward and backward step is the call and the gradients of q, k and v for a
fixed upstream gradient. Each stands between two barriers and its time is the
slowest rank's; the implementations alternate step by step in one job.
Prints a table and writes it to ``docs/benchmarks/ring_attention.md``. The
ratios are reference / other step time, so below 1 the reference is faster;
"fastest steps" is the same ratio from each one's fastest step.
"""
import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "solutions" / "12-context-parallel"
SEQ_DIM = 2  # [batch, heads, seq, head_dim]


def dense_attention(q, k, v, causal):
    """The oracle: attention of the whole sequence, one score matrix."""
    import torch

    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def measure(batch, heads, seq, dim, steps, warmup=3):
    """Every rank: seconds per step (slowest rank) of the reference, of torch's
    templated ring (all-to-all and all-gather rotation) and of one-process SDPA,
    with and without the causal mask, forward and forward + backward."""
    import torch
    import torch.distributed as tdist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    sys.path.insert(0, str(REFERENCE))
    from context_parallel import ring_attention, zigzag_indices

    rank, world = tdist.get_rank(), tdist.get_world_size()
    group = init_device_mesh("cpu", (world,)).get_group()  # what torch's own SDPA handler passes
    forward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    backward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    gen = torch.Generator().manual_seed(0)
    whole = [torch.randn(batch, heads, seq, dim, generator=gen, dtype=torch.float64) for _ in range(4)]  # q k v dout
    oracle_inputs = [t.clone().requires_grad_() for t in whole[:3]]
    results = {}
    for causal in (False, True):
        # The oracle, in float64 on the whole sequence: the output and the gradients of q, k, v.
        out64 = dense_attention(*oracle_inputs, causal)
        out64.backward(whole[3])
        expected64 = [out64.detach()] + [t.grad for t in oracle_inputs]
        for t in oracle_inputs:
            t.grad = None
        # Each implementation's shard of the sequence, in the layout it expects.
        if causal:
            ours_at = torch.tensor(zigzag_indices(seq, world)[rank])
            theirs_at = _HeadTailLoadBalancer(seq, world, "cpu")._generate_indices()[0].view(world, -1)[rank].long()
        else:
            ours_at = theirs_at = torch.arange(rank * seq // world, (rank + 1) * seq // world)
        same_layout = bool(torch.equal(ours_at, theirs_at))
        ours = [t[:, :, ours_at].float().contiguous() for t in whole]
        theirs = [t[:, :, theirs_at].float().contiguous() for t in whole]
        ours_expected = [t[:, :, ours_at] for t in expected64]
        theirs_expected = [t[:, :, theirs_at] for t in expected64]
        full = [t.float() for t in whole]
        cp._cp_options.enable_load_balance = causal  # torch's load balancing: required under causal, refused without

        def reference(backward):
            q, k, v = (t.clone().requires_grad_(backward) for t in ours[:3])
            out = ring_attention(q, k, v, causal=causal)
            if not backward:
                return [out]
            out.backward(ours[3])
            return [out, q.grad, k.grad, v.grad]

        def templated(rotate, backward):
            cp.set_rotate_method(rotate)
            q, k, v, dout = theirs
            out, lse = cp._templated_ring_attention(group, SEQ_DIM, forward_op, q, k, v, is_causal=causal)
            if not backward:
                return [out]
            grads = cp._templated_ring_attention_backward(
                group, SEQ_DIM, backward_op, grad_out=dout, grad_out_name="grad_out", query=q, key=k, value=v,
                out=out, logsumexp=lse, is_causal=causal, dropout_p=0.0)
            return [out, *grads[:3]]

        def sdpa(backward):
            if rank != 0:  # one process over the whole sequence; the others only wait
                return None
            q, k, v = (t.clone().requires_grad_(backward) for t in full[:3])
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            if backward:
                out.backward(full[3])
            return [out]

        def gap(got, expected):
            """The largest error over the tensors, relative to each tensor's largest entry."""
            return max(float((a.double() - b).abs().max() / b.abs().max()) for a, b in zip(got, expected))

        runs = {"reference": (reference, ours_expected),
                "torch all-to-all": (lambda backward: templated("alltoall", backward), theirs_expected),
                "torch all-gather": (lambda backward: templated("allgather", backward), theirs_expected),
                "sdpa": (sdpa, None)}
        for backward in (False, True):
            # Correctness first: each ring against the float64 oracle, the slowest rank's error.
            errors = torch.tensor([gap(run(backward), expected) if expected is not None else 0.0
                                   for run, expected in runs.values()], dtype=torch.float64)
            tdist.all_reduce(errors, op=tdist.ReduceOp.MAX)
            times = {name: [] for name in runs}
            for i in range(warmup + steps):
                order = list(runs.items()) if i % 2 == 0 else list(runs.items())[::-1]  # neither always goes first
                for name, (run, _) in order:
                    tdist.barrier()
                    start = time.perf_counter()
                    run(backward)
                    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                    tdist.all_reduce(elapsed, op=tdist.ReduceOp.MAX)  # the slowest rank's time
                    if i >= warmup:
                        times[name].append(float(elapsed))
            results[(causal, backward)] = {"times": times, "same_layout": same_layout,
                                           "errors": dict(zip(runs, errors.tolist()))}
    return results


def table(rows):
    import numpy as np

    lines = ["| ranks p | sequence | mask | pass | reference (ms) | torch ring, all-to-all (ms) "
             "| torch, all-gather (ms) | SDPA, one process (ms) | reference / torch all-to-all "
             "| reference / torch all-to-all, fastest steps | reference / torch all-gather | reference / SDPA "
             "| torch all-to-all / SDPA | largest relative error: reference, torch |",
             "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for ranks, seq, result in rows:
        for (causal, backward), run in result.items():
            t = {name: np.array(times) for name, times in run["times"].items()}
            ours, a2a, ag, sdpa = (t[name] for name in ("reference", "torch all-to-all", "torch all-gather", "sdpa"))
            median = {name: np.median(times) for name, times in t.items()}
            errors = run["errors"]
            lines.append(
                f"| {ranks} | {seq:,} | {'causal' if causal else 'none'} "
                f"| {'forward + backward' if backward else 'forward'} "
                f"| {median['reference'] * 1e3:.2f} | {median['torch all-to-all'] * 1e3:.2f} "
                f"| {median['torch all-gather'] * 1e3:.2f} | {median['sdpa'] * 1e3:.2f} "
                f"| {np.median(ours) / np.median(a2a):.3f} | {ours.min() / a2a.min():.3f} "
                f"| {np.median(ours) / np.median(ag):.3f} | {np.median(ours) / np.median(sdpa):.3f} "
                f"| {np.median(a2a) / np.median(sdpa):.3f} "
                f"| {errors['reference']:.1e}, {max(errors['torch all-to-all'], errors['torch all-gather']):.1e} |")
    return "\n".join(lines)


def main():
    import report  # benchmarks/report.py, beside this script
    import torch

    from course import dist

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4],
                        help="sequence shards, one process each (one job per value)")
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 1024], help="whole sequence lengths")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = parser.parse_args()
    rows = []
    for ranks in args.ranks:
        for seq in args.seq:
            job = dist.run(f"{__file__}:measure", ranks, args.batch, args.heads, seq, args.head_dim, args.steps,
                           timeout=900, backend="gloo")
            result = job.check().results[0]
            for (causal, backward), run in result.items():
                for name, error in run["errors"].items():
                    assert error < 1e-4, (f"p = {ranks}, seq {seq}, causal={causal}, backward={backward}: {name} "
                                          f"is {error} (relative) from the float64 oracle")
            rows.append((ranks, seq, result))
    layouts = "the same" if all(r["same_layout"] for _, _, result in rows for r in result.values()) else "different"
    machines = "; ".join(f"p = {ranks}: {report.machine(ranks)}" for ranks in args.ranks)
    where = (f"{machines}; torch {torch.__version__}, gloo on loopback, one thread per process; "
             f"float32, batch {args.batch}, {args.heads} heads of {args.head_dim}; "
             f"causal shards: lab zigzag and torch head-tail, {layouts} positions; "
             f"torch's ring is `_templated_ring_attention` (and its backward) on "
             f"`_scaled_dot_product_flash_attention_for_cpu`; "
             f"median of {args.steps} steps after 3 warm-up steps, slowest rank per step; "
             "the four alternate step by step in one job")
    text = table(rows)
    report.publish(__file__, "ring_attention.md",
                   "Reference `ring_attention` (lab 12) against torch's templated ring attention",
                   where, text, write=not args.no_write)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
