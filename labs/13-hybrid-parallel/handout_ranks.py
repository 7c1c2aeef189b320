"""What the handout runs on every rank: your ``run_plan`` on this rank, and the
same training in one process for comparison.

You do not need to edit this file. ``course.dist.run(train, n, plan, model)``
returns, per rank, what ``run_plan`` returned, made plain (the losses and the
step time; the parameter shards are left out), or ``{"not_written": message}``
while ``run_plan`` (or a lab 08 or 10 piece it uses) is still a stub.
"""
import torch.nn.functional as F

import hybrid


def train(plan, model):
    try:
        result = hybrid.run_plan(plan, model)
    except NotImplementedError as err:
        return {"not_written": str(err)}
    return {"losses": [float(x) for x in result["losses"]], "step_time_s": float(result["step_time_s"])}


def single_process_losses(model):
    """TinyGPT in one process on the whole batch: the loss before each step's update."""
    gpt = hybrid.dense_model(model)
    tokens, targets = hybrid.make_batches(model)
    optimizer = hybrid.make_optimizer(model, gpt.parameters())
    losses = []
    for step in range(model["steps"]):
        optimizer.zero_grad()
        logits = gpt(tokens[step])  # in the model's precision (TinyGPT's own loss is float32)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[step].reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
