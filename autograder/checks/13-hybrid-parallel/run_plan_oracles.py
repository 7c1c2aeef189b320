"""Lab 13's run_plan oracles, in the grader's process: TinyGPT trained in one process, and
the bytes a dp x tp mesh sends.

What ``hybrid.run_plan`` must equal, rank by rank, as its docstring says: the
single-process ``course.models.TinyGPT`` built after ``torch.manual_seed(seed)`` in
float32 and cast to float64, trained with the same ``torch.optim`` optimizer for
the same steps on the whole global batch (tokens and next-token targets from
``torch.Generator().manual_seed(seed + 1)``), the mean cross-entropy over every
token (``F.cross_entropy`` in float64). ``shard`` cuts a dense parameter as the
lab's ``tp_shards`` documents it. None of the student's code runs here, and none
of this runs in the sandbox: the ranks return their losses and shards, and the
check compares them with these. ``mesh_traffic`` is the closed form of what the
mesh's collectives send, which the check holds the kernel's count to.
"""
import functools
import json

from course.wire import gloo_bytes, gloo_messages


def dense(model):
    """TinyGPT as ``run_plan`` starts from it: built in float32 after ``torch.manual_seed(seed)``, float64."""
    import torch

    from course.models import GPTConfig, TinyGPT

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        torch.manual_seed(model["seed"])
        gpt = TinyGPT(GPTConfig(vocab=model["vocab"], seq=model["seq"], hidden=model["hidden"],
                                heads=model["heads"], layers=model["layers"], dropout=0.0))
    finally:
        torch.set_default_dtype(previous)
    return gpt.to(torch.float64)


def data(model):
    """(tokens, targets), each ``[steps, batch, seq]``: the documented global batches."""
    import torch

    generator = torch.Generator().manual_seed(model["seed"] + 1)
    drawn = torch.randint(0, model["vocab"], (model["steps"], model["batch"], model["seq"] + 1), generator=generator)
    return drawn[..., :-1], drawn[..., 1:]


def optimizer_of(model, params):
    import torch

    if model["optimizer"] == "adam":
        return torch.optim.Adam(params, lr=model["lr"])
    return torch.optim.SGD(params, lr=model["lr"], momentum=0.9 if model["optimizer"] == "sgd_momentum" else 0.0)


def single_process(model):
    """(losses per step, {name: final dense parameter}) of TinyGPT trained on the whole batch;
    computed once per model (a grading asks for each case's as many times as it has ranks)."""
    return _single_process(json.dumps(model, sort_keys=True))


@functools.lru_cache(maxsize=16)
def _single_process(key):
    import torch
    import torch.nn.functional as F

    model = json.loads(key)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tensors of a few KiB: a pool of threads on a busy machine costs 10x more
    try:
        gpt = dense(model)
        optimizer = optimizer_of(model, gpt.parameters())
        tokens, targets = data(model)
        losses = []
        for step in range(model["steps"]):
            logits = gpt(tokens[step])
            loss = F.cross_entropy(logits.flatten(0, 1), targets[step].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    return losses, {name: p.detach() for name, p in gpt.named_parameters()}


def shard(name, tensor, t, tp):
    """tp rank ``t``'s part of the dense parameter ``name``, by the lab's documented layout."""
    import torch

    def rows(x):
        part = x.shape[0] // tp
        return x[t * part:(t + 1) * part]

    if name == "tok.weight" or name.endswith(("fc1.weight", "fc1.bias")):
        return rows(tensor)
    if name.endswith(("qkv.weight", "qkv.bias")):  # q, k and v, each split by heads
        return torch.cat([rows(part) for part in tensor.chunk(3)])
    if name.endswith(("proj.weight", "fc2.weight")):  # row-parallel: split by input features
        part = tensor.shape[1] // tp
        return tensor[:, t * part:(t + 1) * part]
    return tensor


def compare(returned, plan, model, rank):
    """What the check needs of one rank's run_plan result (``returned``: what the rank sent
    back, ``harness_hybrid.returned``), against single-process training: {"status": "ok",
    "losses": [got, want], "params": {name: [largest difference, largest wanted value]},
    "missing", "shapes", "tp_rank", "dp_rank"}, or {"status": "bad_result", "message"}."""
    import math

    import torch

    tp = plan["tp"]
    t = rank % tp  # row-major mesh: rank = d * tp + t
    if "not_a_dict" in returned:
        return {"status": "bad_result", "message": f"run_plan returned {returned['not_a_dict']}, expected a dict "
                "with 'losses', 'step_time_s' and 'parameters'"}
    missing_keys = [k for k in ("losses", "parameters") if k not in returned["keys"]]
    if missing_keys:
        return {"status": "bad_result", "message": f"run_plan's result has no {missing_keys} (it has "
                f"{returned['keys'][:10]})"}
    if not isinstance(returned["losses"], list):
        return {"status": "bad_result", "message": f"run_plan's 'losses' is {returned['losses']}, expected a list "
                "of floats, one per step"}
    want_losses, want_params = single_process(model)
    got_params = returned["parameters"] if isinstance(returned["parameters"], dict) else {}
    params, missing, shapes = {}, [], {}
    for name, whole in want_params.items():
        want = shard(name, whole, t, tp)
        got = got_params.get(name)
        if got is None or isinstance(got, str):
            missing.append(name)
            continue
        got = torch.as_tensor(got, dtype=torch.float64)
        if tuple(got.shape) != tuple(want.shape):
            shapes[name] = [list(got.shape), list(want.shape)]
            continue
        diff = (got - want).abs().max().item() if want.numel() else 0.0
        params[name] = [diff if math.isfinite(diff) else float("inf"), want.abs().max().item()]
    return {"status": "ok", "losses": [returned["losses"], want_losses], "params": params, "missing": missing,
            "shapes": shapes, "tp_rank": t, "dp_rank": rank // tp}


def _shard_elements(model, tp):
    """Elements of one tp rank's shard of TinyGPT (``tp_shards``' layout): what DP all-reduces."""
    h, L, V, s = model["hidden"], model["layers"], model["vocab"], model["seq"]
    split = V * h + L * (3 * h * h + 3 * h + h * h + 4 * h * h + 4 * h + 4 * h * h)  # column and row halves
    whole = s * h + L * (2 * h + h + 2 * h + h) + 2 * h  # position table, LayerNorms, row layers' biases
    return split // tp + whole


def mesh_traffic(plan, model):
    """(least, most, messages): the bytes a dp x tp run_plan must send (float64), all ranks
    together. Each step and micro-batch, every tp group all-reduces the [s, b, h]
    activations 2L + 1 times forward (embedding, attention, MLP) and 2L + 1 backward (f
    before q/k/v and fc1, and before the tied head), twice more per recomputed layer, and
    at least 2 per-token values for the loss (at most 3, each way); each dp group
    all-reduces its shard's gradients once a step. ``most`` adds DDP's broadcast of the
    shards, the loss's third value, the step's loss and barriers, and gloo's headers for
    all of those messages (NaiveDDP's one all-reduce per parameter included)."""
    dp, tp, m = plan["dp"], plan["tp"], plan["microbatches"]
    L, steps = model["layers"], model["steps"]
    tokens = model["seq"] * model["batch"] // dp // m
    activation, shard = 8 * tokens * model["hidden"], 8 * _shard_elements(model, tp)
    per_micro = (4 * L + 2 + 2 * plan["recompute"].count("full")) * gloo_bytes("all_reduce", activation, tp)
    loss = gloo_bytes("all_reduce", 8 * tokens, tp)
    least = steps * (dp * m * (per_micro + 2 * loss) + tp * gloo_bytes("all_reduce", shard, dp))
    per_micro_reduces = 4 * L + 2 + 2 * plan["recompute"].count("full") + 6  # + the loss's, both ways
    parameters = 2 + 12 * L + 2  # TinyGPT's tensors: NaiveDDP all-reduces each on its own
    messages = steps * (dp * m * per_micro_reduces * gloo_messages("all_reduce", tp)
                        + tp * (parameters + 3) * gloo_messages("all_reduce", dp))  # + the loss, two barriers
    most = least + steps * dp * m * 4 * loss + tp * gloo_bytes("broadcast", shard, dp)
    return least, most, messages
