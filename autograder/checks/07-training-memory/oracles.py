"""The answers lab 07's checks compare with, computed in the grader's process only.

None of them is the lab's estimate. Each is torch doing the thing the estimate
is about, or follows from the model's structure measured that way:

- ``parameter_count``: ``sum(p.numel())`` of a ``course.models.TinyGPT`` built
  on the meta device (which allocates nothing, so GPT-2 XL and 7B models too);
- ``state_bytes``: the bytes of the parameters, gradients and optimizer state
  after one real training step with torch's own Adam or SGD (``Trainer``; in
  mixed precision the float32 master copy counts as optimizer state), and
  ``bytes_per_parameter``, those bytes over the parameter count;
- ``traced_activations``: the bytes autograd saves for backward in one forward
  pass (``saved_tensors_bytes``: distinct storages through
  ``torch.autograd.graph.saved_tensors_hooks``);
- ``ActivationFit``: the same bytes for models too large to run. What autograd
  saves is a sum of known monomials in (L, s, b, h, a, V) (``MONOMIALS``: per
  block sbh, as²b and sb terms; outside the blocks sbh, sbV, sb and a constant),
  with whole coefficients that depend on the precision, on whether there is
  dropout and on checkpointing. They are solved for exactly from a few small
  traced runs (``FIT_SHAPES``), checked to reproduce every one of them, and then
  evaluated at any shape: GPT-3's or a 7B model's bytes without running it;
- ``replay_step``: one training step of a given model and batch with plain
  torch, the loss and the parameters after it (``profile_step``'s oracle);
- ``cuda_peaks`` (GPU tier): ``torch.cuda.max_memory_allocated`` of a real step;
  in the CPU tier's dry run, ``CudaMemoryStandIn`` answers for ``torch.cuda``.

Mixed precision is the ZeRO paper's: the model in bfloat16 (parameters,
gradients, activations), the optimizer working on a float32 master copy.
"""
from __future__ import annotations

import contextlib
import functools
import weakref

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autograder.grading.checking import torch_on_one_thread
from course.models import GPTConfig, TinyGPT

# Saved bytes and static terms do not depend on the weights; the profiled model's come from the grading's seed.
WEIGHTS_SEED = 2026


def _in_one_thread(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch_on_one_thread():
            return fn(*args, **kwargs)
    return wrapper


def shape_of(config) -> GPTConfig:
    return GPTConfig(vocab=config.get("vocab"), seq=config.get("seq"), hidden=config.get("hidden"), heads=config.get("heads"),
                     layers=config.get("layers"), dropout=config.get("dropout"))


def build(config, seed=WEIGHTS_SEED, device="cpu"):
    """TinyGPT with ``config``'s shape, precision and checkpointing, in training mode."""
    torch.manual_seed(seed)
    model = TinyGPT(shape_of(config), checkpointing=config.get("checkpointing", False)).to(device)
    if config.get("precision") == "mixed":
        model = model.to(torch.bfloat16)
    return model.train()


def batch(config, seed=WEIGHTS_SEED, device="cpu"):
    g = torch.Generator().manual_seed(seed + 1)
    size = (config.get("batch"), config.get("seq"))
    return (torch.randint(0, config.get("vocab"), size, generator=g).to(device),
            torch.randint(0, config.get("vocab"), size, generator=g).to(device))


@functools.lru_cache(maxsize=None)
def _count(shape: GPTConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in TinyGPT(shape).parameters())


def parameter_count(config) -> int:
    """Parameters of a TinyGPT built with ``config``'s shape, on the meta device (no memory)."""
    return _count(shape_of(config))


# --- the model states, after a real step ---------------------------------------------

class Trainer:
    """One model and its optimizer; ``forward_backward`` then ``update`` is a whole step.

    Gradients are kept (zeroed, not freed) between steps, as with gradient
    accumulation. In mixed precision the optimizer updates float32 master
    parameters; the bfloat16 gradients are converted one tensor at a time.
    """

    def __init__(self, config, device="cpu"):
        self.model = build(config, device=device)
        self.params = list(self.model.parameters())
        self.mixed = config.get("precision") == "mixed"
        self.master = [p.detach().float().clone() for p in self.params] if self.mixed else self.params
        name = config.get("optimizer")
        if name == "adam":
            self.optimizer = torch.optim.Adam(self.master, lr=1e-3, foreach=False)
        else:
            momentum = 0.9 if name == "sgd_momentum" else 0.0
            self.optimizer = torch.optim.SGD(self.master, lr=1e-2, momentum=momentum, foreach=False)
        self.tokens, self.targets = batch(config, device=device)

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


@_in_one_thread
def state_bytes(config) -> dict:
    """The parameter count and the bytes torch holds after one real training step with ``config``."""
    trainer = Trainer(config)
    trainer.forward_backward()
    trainer.update()
    return {"numel": sum(p.numel() for p in trainer.params), **trainer.state_bytes()}


SMALL = dict(layers=1, hidden=8, heads=2, seq=4, batch=1, vocab=16, dropout=0.0, checkpointing=False)


@functools.lru_cache(maxsize=None)
def bytes_per_parameter(precision: str, optimizer: str) -> dict:
    """Bytes per parameter of each model state, measured on a small model's real step."""
    found = state_bytes(dict(SMALL, precision=precision, optimizer=optimizer))
    return {key: found[key] // found["numel"] for key in ("parameters", "gradients", "optimizer_state")}


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


@_in_one_thread
def traced_activations(config) -> int:
    """The bytes one forward pass of TinyGPT with ``config`` saves for backward (a real, small run)."""
    model = build(config)
    tokens, targets = batch(config)
    loss, nbytes = saved_tensors_bytes(model, lambda: model(tokens, targets))
    loss.backward()  # frees what was saved; also shows the traced run was a real one
    return nbytes


# The monomials of (L, s, b, h, a, V) that saved bytes are made of; the first three are per block.
MONOMIALS = {
    "L·sbh": lambda L, S, B, H, A, V: L * S * B * H,  # a block's activations of width h or 4h, and its dropout masks
    "L·as²b": lambda L, S, B, H, A, V: L * A * B * S**2,  # a block's attention scores, softmax output, its mask
    "L·sb": lambda L, S, B, H, A, V: L * S * B,  # a block's LayerNorm statistics (a mean and 1/std per token)
    "sbh": lambda L, S, B, H, A, V: S * B * H,  # the final LayerNorm's and the LM head's inputs
    "sbV": lambda L, S, B, H, A, V: S * B * V,  # the loss's float32 log-probabilities
    "sb": lambda L, S, B, H, A, V: S * B,  # token ids, targets, the final LayerNorm's statistics
    "1": lambda L, S, B, H, A, V: 1,  # the loss's scalars
}
PER_BLOCK = ("L·sbh", "L·as²b", "L·sb")
# Small (L, s, b, h, a, V) on which the coefficients are solved for: each monomial varied alone once.
FIT_SHAPES = [(1, 8, 2, 8, 2, 16), (2, 8, 2, 8, 2, 16), (1, 16, 2, 8, 2, 16), (1, 8, 3, 8, 2, 16),
              (1, 8, 2, 16, 2, 16), (1, 8, 2, 16, 4, 16), (1, 8, 2, 8, 2, 24), (2, 12, 3, 12, 3, 20)]


class FitError(RuntimeError):
    """The saved bytes are not the polynomial ``MONOMIALS`` say (``course.models`` changed): a grader's fault."""


SHAPE_KEYS = ("layers", "seq", "batch", "hidden", "heads", "vocab")  # the monomials' arguments, in order


def _values(config):
    return [f(*(config.get(key) for key in SHAPE_KEYS)) for f in MONOMIALS.values()]


class ActivationFit:
    """Saved bytes as ``MONOMIALS`` with whole coefficients, solved for from traced runs."""

    @_in_one_thread
    def __init__(self, precision: str, dropout: bool, checkpointing: bool):
        self.kind = dict(precision=precision, dropout=0.1 if dropout else 0.0, checkpointing=checkpointing)
        configs = [dict(self.kind, layers=L, seq=s, batch=b, hidden=h, heads=a, vocab=V)
                   for L, s, b, h, a, V in FIT_SHAPES]
        rows = np.array([_values(c) for c in configs], dtype=float)
        traced = [traced_activations(c) for c in configs]
        solved, *_ = np.linalg.lstsq(rows, np.array(traced, dtype=float), rcond=None)
        self.coefficients = dict(zip(MONOMIALS, (int(c) for c in np.rint(solved))))
        off = [(shape, nbytes, self.bytes(c)) for shape, c, nbytes in zip(FIT_SHAPES, configs, traced)
               if self.bytes(c) != nbytes]
        if off or np.abs(solved - np.rint(solved)).max() > 1e-6:
            raise FitError(f"the bytes a TinyGPT ({self.kind}) saves for backward are not a sum of {list(MONOMIALS)} "
                           f"with whole coefficients (solved {solved.round(3).tolist()}; traced, fitted: {off}): "
                           "update MONOMIALS in autograder/checks/07-training-memory/oracles.py to course.models")

    def bytes(self, config) -> int:
        """What a forward pass with ``config`` saves, whole model."""
        return sum(c * v for c, v in zip(self.coefficients.values(), _values(config)))

    def per_block(self, config) -> int:
        """What one block saves (the per-block monomials over L)."""
        one = dict(config, layers=1)
        return sum(self.coefficients[m] * MONOMIALS[m](*(one.get(key) for key in SHAPE_KEYS)) for m in PER_BLOCK)


@functools.lru_cache(maxsize=None)
def activation_fit(precision: str, dropout: bool, checkpointing: bool) -> ActivationFit:
    return ActivationFit(precision, dropout, checkpointing)


def fit_for(config) -> ActivationFit:
    return activation_fit(config.get("precision"), config.get("dropout") > 0, bool(config.get("checkpointing")))


# --- profile_step: the same step, replayed with torch -------------------------------

def profile_model(config, seed):
    """The profiled model's weights (float32 arrays by name) and batch, from ``seed``."""
    model = build(dict(config, precision="fp32"), seed=seed)
    tokens, targets = batch(config, seed=seed)
    return {name: t.detach().numpy().copy() for name, t in model.state_dict().items()}, tokens.numpy(), targets.numpy()


@_in_one_thread
def replay_step(config, weights, tokens, targets) -> tuple[float, dict]:
    """zero_grad, forward, backward and one Adam step (lr 1e-2) of TinyGPT with ``weights`` on the batch,
    in one thread as the sandbox runs it: (the loss, the parameters after the step)."""
    model = TinyGPT(shape_of(config), checkpointing=config.get("checkpointing")).train()
    model.load_state_dict({name: torch.from_numpy(np.array(value)) for name, value in weights.items()})
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    optimizer.zero_grad()
    loss = model(torch.from_numpy(np.array(tokens)), torch.from_numpy(np.array(targets)))
    loss.backward()
    optimizer.step()
    return float(loss), {name: p.detach().numpy() for name, p in model.named_parameters()}


# --- GPU tier: the peak, as the CUDA caching allocator saw it ----------------------

def cuda_peaks(configs, dry_run=False):
    """Per configuration: the peak bytes of a training step on the GPU, less what was there before.

    A warm-up step creates the gradients and the optimizer state; then the peak
    of one more step, minus what was allocated beyond the model states before
    it (the batch, cuBLAS workspaces), is the step's own peak.

    ``dry_run`` (the CPU tier's dry run of the GPU tier): the same lines on the
    CPU, in one thread, with :class:`CudaMemoryStandIn` answering for
    ``torch.cuda``. Its bytes are a CPU step's live tensors, not the caching
    allocator's: nothing measured so says anything about a GPU.
    """
    stand_in = CudaMemoryStandIn() if dry_run else None
    cuda, device = (stand_in, "cpu") if dry_run else (torch.cuda, "cuda")
    found = []
    with (torch_on_one_thread() if dry_run else contextlib.nullcontext()), (stand_in or contextlib.nullcontext()):
        for config in configs:
            trainer = Trainer(config, device=device)
            trainer.forward_backward()
            trainer.update()
            cuda.synchronize()
            states = trainer.state_bytes()
            other = cuda.memory_allocated() - sum(states.values())
            cuda.reset_peak_memory_stats()
            trainer.forward_backward()
            cuda.synchronize()
            found.append({"peak": cuda.max_memory_allocated() - other, "device": cuda.get_device_name(), **states})
            del trainer
            cuda.empty_cache()
    return found


class CudaMemoryStandIn(TorchDispatchMode):
    """``torch.cuda``'s memory calls that ``cuda_peaks`` makes, answered on the CPU.

    While it is entered (a ``TorchDispatchMode``: every aten op, forward and
    backward, passes through it), it counts the bytes of the CPU storages that the
    ops return and that are still alive: a storage is counted the first time an
    op returns it (grown if an op resized it) and uncounted when Python frees it
    (``weakref.finalize``; torch keeps one Python object per storage). The peak is
    the most counted after any op. Tensors made before it was entered are not
    counted. The CUDA caching allocator rounds blocks up and keeps workspaces, so
    its numbers differ; these only let the GPU tier's lines run on the CPU tier.
    """

    NAME = "stand-in device (CPU tier dry run: live CPU tensor bytes, not a GPU's allocator)"

    def __init__(self):
        super().__init__()
        self._bytes = {}  # id of a live storage -> the bytes counted for it
        self._allocated = 0
        self._peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                self._count(value.untyped_storage())
        return out

    def _count(self, storage):
        key, nbytes = id(storage), storage.nbytes()
        if key not in self._bytes:
            self._bytes[key] = 0
            weakref.finalize(storage, self._free, key)
        self._allocated += max(0, nbytes - self._bytes[key])
        self._bytes[key] = max(nbytes, self._bytes[key])
        self._peak = max(self._peak, self._allocated)

    def _free(self, key):
        self._allocated -= self._bytes.pop(key)

    # torch.cuda's names, as cuda_peaks calls them
    def synchronize(self):
        """The CPU's ops are done when they return."""

    def memory_allocated(self) -> int:
        return self._allocated

    def max_memory_allocated(self) -> int:
        return self._peak

    def reset_peak_memory_stats(self):
        self._peak = self._allocated

    def empty_cache(self):
        """No cache: a freed storage is uncounted at once."""

    def get_device_name(self) -> str:
        return self.NAME
