"""What torch code on this process communicates and computes, recorded as it runs.

``OpLog`` is a ``TorchDispatchMode``: while it is active it sees every operator
torch runs on this process below autograd — the compute (matrix products,
attention kernels) and the process-group operators ``torch.distributed`` turns
its calls into (``c10d.send``, ``c10d.alltoall_base_``, ...), whichever API
called them (``isend``, ``batch_isend_irecv``, ``all_to_all_single``,
``torch.distributed.nn``). It also sees the backward pass autograd runs for the
code, and ``Work.wait()`` calls, so the order of posts, compute and waits
says whether a transfer overlapped compute. Lectures and the grader use the
same log (lab 12's checks count ring and Ulysses messages with it).
``SavedActivations`` counts the bytes autograd saves for backward while it is
open (lectures 10, 12 and 13 measure activation memory with it).

    with OpLog() as log, log.phase("forward"):
        out = ring_attention(q, k, v)
    log.count("send", "forward"), log.elements("send", "forward")
"""
from __future__ import annotations

import contextlib

# c10d operator name (without the overload) -> what it is
COMMUNICATION = {
    "send": "send", "recv_": "recv", "recv_any_source_": "recv",
    "alltoall_base_": "all_to_all", "alltoall_": "all_to_all",
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast", "scatter_": "scatter", "gather_": "gather", "reduce_": "reduce",
}
# aten operators that do the arithmetic of attention and linear layers
COMPUTE = {"mm", "bmm", "baddbmm", "addmm", "addbmm", "matmul", "dot", "einsum",
           "_scaled_dot_product_attention_math", "_scaled_dot_product_flash_attention",
           "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
           "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward"}
# which argument holds the data each kind sends (its element count is the message's size)
_SENT = {"send": 0, "recv": 0, "all_to_all": 1, "all_gather": 1, "all_reduce": 0, "reduce_scatter": 1,
         "broadcast": 0, "scatter": 1, "gather": 1, "reduce": 0}


def _elements(value) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (list, tuple)):
        return sum(_elements(v) for v in value)
    return 0


def _tensors(value):
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


class OpLog:
    """Records ``(kind, elements, phase)`` events: a communication kind (``send``,
    ``recv``, ``all_to_all``, ``all_gather``, ...), ``compute`` for a matrix product
    or attention kernel (elements: the output's), and ``wait`` when a request is
    waited for. Events outside ``phase(...)`` have phase None. ``largest`` is the
    largest tensor (elements, shape) an operator produced whose last dimension is
    ``last_dim`` (any tensor when it is None), messages included."""

    def __init__(self, last_dim: int | None = None):
        self.events: list[tuple[str, int, str | None]] = []
        self.largest: tuple[int, tuple] = (0, ())
        self.last_dim = last_dim
        self.current = None
        self._mode = None
        self._wait = None

    # -- recording ---------------------------------------------------------------------------
    def __enter__(self) -> "OpLog":
        import torch._C._distributed_c10d as c10d
        from torch.utils._python_dispatch import TorchDispatchMode

        log = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                log._saw(func, args, out)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        self._wait = c10d.Work.wait

        def wait(work, *args, **kwargs):
            log.events.append(("wait", 0, log.current))
            return log._wait(work, *args, **kwargs)

        c10d.Work.wait = wait
        return self

    def __exit__(self, *exc) -> None:
        import torch._C._distributed_c10d as c10d

        c10d.Work.wait = self._wait
        self._mode.__exit__(*exc)

    @contextlib.contextmanager
    def phase(self, name: str):
        before, self.current = self.current, name
        try:
            yield
        finally:
            self.current = before

    def _saw(self, func, args, out) -> None:
        namespace, name = func.namespace, func._opname
        kind = None
        if namespace == "c10d" and name in COMMUNICATION:
            kind = COMMUNICATION[name]
            self.events.append((kind, _elements(args[_SENT[kind]]) if len(args) > _SENT[kind] else 0,
                                self.current))
            produced = list(_tensors(args[0]))  # the buffers it fills (or sends)
        else:
            if namespace == "aten" and name in COMPUTE:
                self.events.append(("compute", _elements(out), self.current))
            produced = list(_tensors(out))
        for tensor in produced:
            if tensor.dim() and (self.last_dim is None or tensor.shape[-1] == self.last_dim):
                self.largest = max(self.largest, (tensor.numel(), tuple(tensor.shape)))

    # -- reading -----------------------------------------------------------------------------
    def count(self, kind: str, phase: str | None = None) -> int:
        return sum(1 for k, _, p in self.events if k == kind and (phase is None or p == phase))

    def elements(self, kind: str, phase: str | None = None) -> list[int]:
        """The element count of each ``kind`` event, in order."""
        return [n for k, n, p in self.events if k == kind and (phase is None or p == phase)]

    def overlapped_transfers(self, phase: str | None = None) -> tuple[int, int]:
        """(transfers, overlapped): a transfer is a run of sends and receives posted
        before the next wait; it overlapped when compute ran between its first
        post and that wait."""
        transfers = overlapped = 0
        posted = computed = False
        for kind, _, p in self.events:
            if phase is not None and p != phase:
                continue
            if kind in ("send", "recv"):
                posted = True
            elif kind == "compute" and posted:
                computed = True
            elif kind == "wait" and posted:
                transfers += 1
                overlapped += computed
                posted = computed = False
        return transfers, overlapped


class SavedActivations:
    """Bytes of the distinct storages autograd saves for backward while the context is
    open (``torch.autograd.graph.saved_tensors_hooks``), leaving out ``exclude``
    (the parameters: they are memory anyway, not activations)."""

    def __init__(self, exclude=()):
        self.skip = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages = {}

    def _pack(self, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.skip:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self):
        import torch

        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def nbytes(self):
        return sum(self.storages.values())


class MessageLog:
    """The point-to-point messages torch code on this process posts, in order,
    whichever API posted them (``send``, ``isend``, ``batch_isend_irecv``):
    ``messages`` gets ``{"kind": "send" or "recv", "peer", "tag", "shape",
    "data"}`` per tensor of each ``c10d.send`` / ``c10d.recv_``. ``peer`` is the
    rank in the message's group (None: a receive from any source); ``data`` is a
    copy of what a send sends, taken as it is posted (None for a receive, whose
    buffer is filled later). Lab 11 compares an executor's messages with the
    schedule it was given."""

    def __init__(self):
        self.messages: list[dict] = []
        self._mode = None

    def __enter__(self) -> "MessageLog":
        from torch.utils._python_dispatch import TorchDispatchMode

        log = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace == "c10d" and func._opname in ("send", "recv_", "recv_any_source_"):
                    log._saw(func._opname, args)
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)

    def _saw(self, name, args) -> None:
        # (tensors, process group, peer, tag); recv_any_source_ has (tensors, process group, tag)
        peer, tag = (None, args[2]) if name == "recv_any_source_" else (args[2], args[3])
        for tensor in _tensors(args[0]):
            self.messages.append({"kind": "send" if name == "send" else "recv", "peer": peer, "tag": tag,
                                  "shape": tuple(tensor.shape),
                                  "data": tensor.detach().clone() if name == "send" else None})
