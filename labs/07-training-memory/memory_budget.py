"""Lab 07 — where training time and memory go.

Before a training job runs you can say, to within a few percent, how much
memory it will need: the parameters, their gradients and the optimizer's state
are fixed by the parameter count and the precision; the activations saved for
backward follow from the model's shape. Here you write that estimate for the
GPT of ``course.models.TinyGPT`` (read its docstring: it lists what every op
saves), then measure where one training step's time goes with ``torch.profiler``:

1. ``count_parameters`` — exactly ``sum(p.numel() for p in TinyGPT(...).parameters())``;
2. ``state_bytes_per_parameter`` — bytes per parameter of the parameters,
   gradients and optimizer state, for float32 or mixed precision and Adam or SGD;
3. ``activation_bytes_per_layer`` — what one GPT block saves for backward;
4. ``estimate_train_memory`` — the whole breakdown and the peak;
5. ``profile_step`` — one training step under ``torch.profiler``, as plain data.

A configuration is a plain dict (so the grader can send it to your code)::

    {"layers": L, "hidden": h, "heads": a, "seq": s, "batch": b, "vocab": V,
     "dropout": 0.1,           # probability; 0 means no dropout layers at all
     "precision": "fp32",      # or "mixed"
     "optimizer": "adam",      # or "sgd", "sgd_momentum"
     "checkpointing": False}   # activation checkpointing of every block

"mixed" is mixed precision as in the ZeRO paper: 2-byte (fp16/bf16) parameters,
gradients and activations, plus a float32 master copy of the parameters that
the optimizer updates, with its state in float32. Dropout masks take 1 byte
per element in both precisions; the loss keeps float32 log-probabilities.
Every size is in bytes, as a Python int. Run the checks with ``k2c grade 07``.
"""
import time

import torch

PRECISIONS = ("fp32", "mixed")
OPTIMIZERS = ("adam", "sgd", "sgd_momentum")


def count_parameters(config):
    """Parameters of ``course.models.TinyGPT`` built with this config's shape.

    The LM head shares the token embedding's weight (count it once); the
    position table has ``seq`` rows; every ``nn.Linear`` has a bias and every
    LayerNorm a weight and a bias.
    """
    raise NotImplementedError("not implemented yet: count_parameters: add up the token embedding, the position table, each block's four linears (weight + bias) and two LayerNorms, and the final LayerNorm")


def state_bytes_per_parameter(precision, optimizer):
    """``{"parameters": ..., "gradients": ..., "optimizer_state": ...}``, bytes per parameter.

    fp32: 4-byte parameters and gradients; Adam keeps two moments (m and v) per
    parameter, SGD with momentum one buffer, plain SGD nothing. mixed: 2-byte
    parameters and gradients; the optimizer's state also holds the float32
    master copy of the parameters (ZeRO: 2 + 2 + 12 = 16 bytes for Adam).
    """
    assert precision in PRECISIONS and optimizer in OPTIMIZERS, (precision, optimizer)
    raise NotImplementedError('not implemented yet: state_bytes_per_parameter: Count the float32 buffers the optimizer keeps per parameter; in mixed precision the master copy is one of them.')


def activation_bytes_per_layer(config):
    """Bytes one GPT block saves for backward, without checkpointing.

    With dropout, Korthikanti et al. count per block 16sbh + 2as²b activations
    and 2sbh + as²b one-byte mask elements: sbh(34 + 5as/h) bytes with 2-byte
    activations. Activations take 4 bytes in fp32 and 2 in mixed precision.
    With ``dropout == 0`` there are no masks, and the softmax output is the
    tensor the attention over V saves: 16sbh + as²b activations.
    (``config["checkpointing"]`` does not change this number.)
    """
    raise NotImplementedError("not implemented yet: activation_bytes_per_layer: activations in elements times their size (4 or 2 bytes), plus the masks at 1 byte each; course.models' docstring lists what every op saves")


def estimate_train_memory(config):
    """The memory of one training step, in bytes, as a dict.

    - ``parameters``, ``gradients``, ``optimizer_state``: parameter count times
      ``state_bytes_per_parameter``;
    - ``activations``: what autograd holds at the end of the forward pass: every
      block's saved tensors (with checkpointing only each block's input, sbh
      elements), plus outside the blocks the final LayerNorm's input and the LM
      head's input (sbh elements each) and the float32 log-probabilities of the
      loss (4·sbV bytes). The token ids and LayerNorm statistics are left out;
    - ``peak``: parameters + gradients + optimizer state + activations: the
      memory in use at the end of a forward pass while the gradients of an
      earlier micro-batch are kept (gradient accumulation). With checkpointing,
      backward recomputes one block at a time, which holds that block's full
      activations once more: add ``activation_bytes_per_layer`` to the peak.

    Work it out from the shape: the grader also asks about models of 1-7B
    parameters, too large to run, and counts the CPU time your estimates take
    there. Building the model on the meta device (to count its parameters) is
    fine; running it, even there, is a measurement, not an estimate.
    """
    raise NotImplementedError("not implemented yet: estimate_train_memory: Model states come from the two functions above; activations are the blocks' saved tensors plus the terms outside them.")


def profile_step(model, tokens, targets, optimizer):
    """Run one training step under ``torch.profiler`` and say where its time went.

    The step: ``optimizer.zero_grad()``, ``loss = model(tokens, targets)``,
    ``loss.backward()``, ``optimizer.step()``. Returns plain data::

        {"wall_s": seconds the step took (time.perf_counter around it),
         "loss": float(loss),
         "ops": [{"name": "aten::addmm", "calls": 12, "self_cpu_s": 0.0004}, ...]}

    with one entry per operator name the profiler saw
    (``prof.key_averages()``: ``key``, ``count``, ``self_cpu_time_total`` in
    microseconds), sorted by self CPU time, largest first. Self time excludes
    the time spent in the ops an op calls, so the self times add up to at
    most the wall time.
    """
    raise NotImplementedError('not implemented yet: profile_step: Time the step inside a CPU profiler, then turn each of its averaged events into a plain dict in seconds.')
