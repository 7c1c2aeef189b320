"""What the handout runs on every rank: your ``run_pipeline`` on a small model cut
into one stage per rank, next to single-process training of the whole model.

You do not need to edit this file. ``course.dist.run(try_pipeline, p, schedule)``
returns, per rank, the largest difference between the gradients
``run_pipeline`` left in this rank's stage and those of the whole model trained
in one process on the whole batch (mean loss), and on the last rank the loss
it returned next to the single-process loss. A stub comes back as
``{"not_written": message}``.
"""
import torch
import torch.distributed as dist

DIMS = (5, 8, 8, 8, 8, 8, 8, 8, 3)  # 8 Linear layers, Tanh between; every stage boundary is 8 wide
ROWS = 3  # samples per microbatch


def make_layers(seed=0):
    """The whole model as a list of modules (Linear, Tanh, ..., Linear), float64."""
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(DIMS[:-1], DIMS[1:])):
        layers.append(torch.nn.Linear(a, b, dtype=torch.float64))
        if i < len(DIMS) - 2:
            layers.append(torch.nn.Tanh())
    return layers


def stage_bounds(p):
    """Module indices where each of ``p`` stages starts: 8 / p Linear layers (with their Tanh) each."""
    per = (len(DIMS) - 1) // p
    return [min(2 * per * i, 2 * (len(DIMS) - 1) - 1) for i in range(p + 1)]


def gpipe(p, m):
    """GPipe's op lists, written out here so the executor can run before make_schedule does."""
    return [[("F", mb, d) for mb in range(m)] + [("B", mb, d) for mb in range(m)] for d in range(p)]


def batch(m):
    g = torch.Generator().manual_seed(7)
    return ([torch.randn(ROWS, DIMS[0], generator=g, dtype=torch.float64) for _ in range(m)],
            [torch.randn(ROWS, DIMS[-1], generator=g, dtype=torch.float64) for _ in range(m)])


def try_pipeline(schedule):
    """This rank's stage trained one step by ``run_pipeline`` with ``schedule[rank]``."""
    import pipeline

    rank, p = dist.get_rank(), dist.get_world_size()
    m = 1 + max(op[1] for op in schedule[0])
    lo, hi = stage_bounds(p)[rank:rank + 2]
    stage = torch.nn.Sequential(*make_layers()[lo:hi])
    xs, ys = batch(m)
    try:
        loss = pipeline.run_pipeline(stage, schedule[rank], xs, ys, torch.nn.functional.mse_loss,
                                     (ROWS, DIMS[1]), dtype=torch.float64)
    except NotImplementedError as exc:
        return {"not_written": str(exc)}
    whole = torch.nn.Sequential(*make_layers())
    single_loss = torch.nn.functional.mse_loss(whole(torch.cat(xs)), torch.cat(ys))
    single_loss.backward()
    mine = [q.grad for q in stage.parameters()]
    theirs = [q.grad for q in torch.nn.Sequential(*list(whole)[lo:hi]).parameters()]
    diff = max(float((a - b).abs().max()) if a is not None else float("inf") for a, b in zip(mine, theirs))
    return {"max_grad_diff": diff, "loss": loss, "single_loss": float(single_loss)}
