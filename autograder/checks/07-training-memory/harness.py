"""Grader code that runs next to the student's ``memory_budget`` in the sandbox.

Three kinds of functions live here; the measuring ones never call the student:

- ``student_answers`` calls the student's functions on every configuration in
  one process (importing torch once), recording per call a value or why there
  is none;
- ``measured_states``, ``traced_activations`` and ``cuda_peaks`` measure what
  torch itself does: the bytes of the parameters, gradients and optimizer
  state after a real optimizer step, the bytes autograd saves for backward
  (``saved_tensors_bytes``), and on a GPU ``torch.cuda.max_memory_allocated``;
- ``profile_runs`` calls the student's ``profile_step`` on a TinyGPT, without
  and with checkpointing, and replays the same step on a copy with plain
  torch, to compare the loss and the parameters.

Mixed precision is measured as the ZeRO paper describes it: the model in
bfloat16 (parameters, gradients, activations) and the optimizer working on a
float32 master copy of the parameters.
"""
import copy
import time

import torch

from course.models import GPTConfig, TinyGPT

SEED = 2026
torch.set_num_threads(1)  # tiny models: one thread is as fast, and steadier on a shared machine
TRAINABLE = 10**7  # parameters
STUDENT_FUNCTIONS = ("count_parameters", "activation_bytes_per_layer", "estimate_train_memory")


def _attempt(fn, *args):
    """{"status": "ok", "value": ...} or why there is no value, as plain data."""
    try:
        return {"status": "ok", "value": fn(*args)}
    except NotImplementedError as exc:
        return {"status": "not_implemented", "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 - the student's error is reported, not raised
        return {"status": "raised", "message": f"{type(exc).__name__}: {exc}"}


def student_answers(configs):
    """Per configuration, each of the student's functions' answer (see ``_attempt``)."""
    import memory_budget as student

    answers = []
    for config in configs:
        answers.append({name: _attempt(getattr(student, name), dict(config)) for name in STUDENT_FUNCTIONS})
    per_parameter = {f"{p}/{o}": _attempt(student.state_bytes_per_parameter, p, o)
                     for p in ("fp32", "mixed") for o in ("adam", "sgd", "sgd_momentum")}
    return {"per_config": answers, "per_parameter": per_parameter}


# --- the model, the optimizers and mixed precision, as torch does them -------------

def build(config, device="cpu"):
    torch.manual_seed(SEED)
    shape = GPTConfig(vocab=config["vocab"], seq=config["seq"], hidden=config["hidden"],
                      heads=config["heads"], layers=config["layers"], dropout=config["dropout"])
    model = TinyGPT(shape, checkpointing=config["checkpointing"]).to(device)
    if config["precision"] == "mixed":
        model = model.to(torch.bfloat16)
    return model.train()


def batch(config, device="cpu"):
    g = torch.Generator().manual_seed(SEED + 1)
    size = (config["batch"], config["seq"])
    tokens = torch.randint(0, config["vocab"], size, generator=g)
    targets = torch.randint(0, config["vocab"], size, generator=g)
    return tokens.to(device), targets.to(device)


class Trainer:
    """One model and its optimizer; ``step()`` is a whole training step.

    Gradients are kept (zeroed, not freed) between steps, as with gradient
    accumulation. In mixed precision the optimizer updates float32 master
    parameters; the bfloat16 gradients are converted one tensor at a time.
    """

    def __init__(self, config, device="cpu"):
        self.model = build(config, device)
        self.params = list(self.model.parameters())
        self.mixed = config["precision"] == "mixed"
        self.master = [p.detach().float().clone() for p in self.params] if self.mixed else self.params
        name = config["optimizer"]
        if name == "adam":
            self.optimizer = torch.optim.Adam(self.master, lr=1e-3, foreach=False)
        else:
            momentum = 0.9 if name == "sgd_momentum" else 0.0
            self.optimizer = torch.optim.SGD(self.master, lr=1e-2, momentum=momentum, foreach=False)
        self.tokens, self.targets = batch(config, device)

    def forward_backward(self):
        loss = self.model(self.tokens, self.targets)
        loss.backward()
        return loss

    def update(self):
        if self.mixed:
            for p, m in zip(self.params, self.master):
                m.grad = p.grad.float()
        self.optimizer.step()
        if self.mixed:
            with torch.no_grad():
                for p, m in zip(self.params, self.master):
                    p.copy_(m)
                    m.grad = None
        for p in self.params:
            p.grad.zero_()

    def state_bytes(self):
        """Bytes of parameters, gradients and optimizer state (the master copy included)."""
        tensors = [t for state in self.optimizer.state.values() for k, t in state.items()
                   if torch.is_tensor(t) and k != "step"]  # Adam's step counter is one scalar per tensor
        optimizer_state = sum(t.nbytes for t in tensors) + (sum(m.nbytes for m in self.master) if self.mixed else 0)
        return {"parameters": sum(p.nbytes for p in self.params),
                "gradients": sum(p.grad.nbytes for p in self.params if p.grad is not None),
                "optimizer_state": optimizer_state}


def measured_states(configs):
    """Per configuration: the parameter count of a built TinyGPT and the bytes after one real step.

    A model too large to train here (more than ``TRAINABLE`` parameters) is
    built on the meta device, which allocates nothing: only its count comes back.
    """
    found = []
    for config in configs:
        with torch.device("meta"):
            numel = sum(p.numel() for p in build(config, device="meta").parameters())
        if numel > TRAINABLE:
            found.append({"numel": numel})
            continue
        trainer = Trainer(config)
        trainer.forward_backward()
        trainer.update()
        found.append({"numel": sum(p.numel() for p in trainer.params), **trainer.state_bytes()})
    return found


# --- activations: what autograd saves for backward -----------------------------------

def saved_tensors_bytes(model, run):
    """Bytes of the distinct storages autograd saves for backward while ``run()`` runs.

    Every tensor an op saves passes through the pack hook of
    ``torch.autograd.graph.saved_tensors_hooks``; views share their base's
    storage, so storages are counted once each (by address: a saved storage
    stays alive until backward, so no address is reused while we count).
    Parameters and buffers are the model's, not activations: left out. Under
    non-reentrant checkpointing a block's inside is packed by the checkpoint's
    own hooks; what it keeps (the block's input) still comes through here.
    Returns ``(run()'s value, bytes)``.
    """
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in own:
            saved[storage.data_ptr()] = (storage.nbytes(), tensor)  # the tensor keeps the address taken
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        value = run()
    return value, sum(nbytes for nbytes, _ in saved.values())


def traced_activations(configs):
    """Per configuration: the bytes saved for backward by one forward pass of TinyGPT."""
    found = []
    for config in configs:
        model = build(config)
        tokens, targets = batch(config)
        loss, nbytes = saved_tensors_bytes(model, lambda: model(tokens, targets))
        loss.backward()  # frees what was saved; also shows the traced run was a real one
        found.append(nbytes)
    return found


# --- GPU tier: the peak, as the CUDA caching allocator saw it ----------------------

def cuda_peaks(configs):
    """Per configuration: the peak bytes of a training step on the GPU, less what was there before.

    A warm-up step creates the gradients and the optimizer state; then the peak
    of one more step, minus what was allocated beyond the model states before
    it (the batch, cuBLAS workspaces), is the step's own peak.
    """
    found = []
    for config in configs:
        trainer = Trainer(config, device="cuda")
        trainer.forward_backward()
        trainer.update()
        torch.cuda.synchronize()
        states = trainer.state_bytes()
        other = torch.cuda.memory_allocated() - sum(states.values())
        torch.cuda.reset_peak_memory_stats()
        trainer.forward_backward()
        torch.cuda.synchronize()
        found.append({"peak": torch.cuda.max_memory_allocated() - other, **states})
        del trainer
        torch.cuda.empty_cache()
    return found


# --- profile_step ------------------------------------------------------------------------

def profile_runs(config):
    """``profile_run`` without and with checkpointing, in one process: {"plain": ..., "checkpointed": ...}."""
    return {name: profile_run(dict(config, checkpointing=checkpointing))
            for name, checkpointing in (("plain", False), ("checkpointed", True))}


def profile_run(config):
    """The student's ``profile_step`` on a TinyGPT, next to the same step replayed with torch."""
    import memory_budget as student

    model = build(config)
    twin = copy.deepcopy(model)
    tokens, targets = batch(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    start = time.perf_counter()
    result = student.profile_step(model, tokens, targets, optimizer)
    outer_s = time.perf_counter() - start

    twin_optimizer = torch.optim.Adam(twin.parameters(), lr=1e-2)
    twin_optimizer.zero_grad()
    loss = twin(tokens, targets)
    loss.backward()
    twin_optimizer.step()
    moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), twin.parameters()))
    return {"result": result, "outer_s": outer_s, "loss": float(loss), "max_param_difference": moved}
