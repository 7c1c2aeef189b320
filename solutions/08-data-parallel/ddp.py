"""Lab 08 — data parallelism from scratch.

Every rank holds a full copy (a *replica*) of the model and trains it on its
own slice of the global batch. After backward each rank's gradients are
averaged over the ranks with an all-reduce, so every replica takes the same
optimizer step — the step single-process training takes on the whole global
batch. You write, in order:

1. ``broadcast_parameters(module, group)`` — copy rank 0's parameters (and
   buffers) to every rank, so the replicas start equal. Both wrappers call it
   in their constructor.
2. ``NaiveDDP(module, group=None)`` — ``sync_gradients()``, called by the
   training loop after ``backward()`` and before ``optimizer.step()``,
   all-reduces each parameter's ``.grad`` (one ``dist.all_reduce`` per
   parameter that has a gradient) and divides it by the world size.
3. ``bucket_indices(sizes_bytes, bucket_cap_mb)`` — group parameters into
   buckets. The rule (torch's DDP uses it too, and the grader counts buckets
   with it): walk the parameters in REVERSE registration order (backward
   produces gradients roughly in that order), adding each to the current
   bucket; as soon as the bucket holds at least ``bucket_cap_mb * 2**20``
   bytes it is closed and the next parameter starts a new one. The last
   bucket may hold less than the cap (a partial bucket): it counts like any
   other. No bucket is empty.
4. ``BucketedDDP(module, bucket_cap_mb=25, group=None)`` — registers a hook
   on every parameter (``Tensor.register_post_accumulate_grad_hook``). When
   the last gradient of a bucket arrives *during backward*, the hook
   copies the bucket's gradients into the bucket's flat buffer
   (``self.buffers[b]``, made once in the constructor) and starts
   ``dist.all_reduce(flat, async_op=True)`` — and does not wait for it:
   backward goes on computing the earlier layers' gradients while the
   bucket travels. ``finish_gradient_synchronization()``, called by the
   training loop after ``backward()`` and before ``optimizer.step()``, waits
   on every bucket's handle, divides by the world size and copies the
   averaged values back into each ``param.grad``. Exactly one all-reduce per
   bucket per step.
5. ``no_sync()`` — a context manager for gradient accumulation: backward
   passes inside it only accumulate into ``.grad`` and communicate nothing;
   the first backward outside it all-reduces the accumulated gradients once.
   The training loop then calls ``finish_gradient_synchronization()`` once::

       for i, (x, y) in enumerate(micro_batches):          # n micro-batches
           context = model.no_sync() if i < n - 1 else contextlib.nullcontext()
           with context:
               (loss_fn(model(x), y) / n).backward()
       model.finish_gradient_synchronization()
       optimizer.step(); optimizer.zero_grad()

6. ``topk_compress(tensor, k)`` and ``ErrorFeedback`` — send only the ``k``
   largest-magnitude entries of a gradient, and keep what was not sent as a
   residual that is added to the next gradient before compressing it, so no
   gradient is lost, only delayed.

Rules the grader relies on: a parameter that requires a gradient receives
one in every backward. A frozen parameter (``requires_grad=False``) is
broadcast like the others but gets no gradient: no hook, no all-reduce, no
place in a bucket. A tied weight (one ``Parameter`` reachable under two
names, as when an embedding and the output layer share their weight) is one
parameter: ``module.parameters()`` yields it once, so synchronise it once.
The process group is
``group`` (``None`` means the default group, ``dist.group.WORLD``); use
``torch.distributed.all_reduce`` (sum) for gradients. The grader counts, from
outside your processes, the bytes that cross between the ranks after each
backward and after your finish call: gloo's messages make one all-reduce per
bucket and one flat all-reduce of everything differ in bytes, so the count
says how many all-reduces crossed, and whether before backward returned. It
also records each collective you call and each ``wait()``, relative to the
end of backward, to show you when a check fails. Grade with ``k2c grade 08``
from the repository root.
"""
import contextlib

import torch
import torch.distributed as dist

# --- 1. Equal replicas -----------------------------------------------------------------


def broadcast_parameters(module, group=None):
    """Overwrite every parameter and buffer of ``module`` with rank 0's, in place.

    Rank 0 here is rank 0 *of the group*; ``dist.broadcast`` wants its global
    rank as ``src``: ``dist.get_global_rank(group, 0)`` (0 for the default group).
    """
    # BEGIN SOLUTION: Broadcast every parameter, then every buffer, from the group's first rank, in the same order on all ranks.
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, src=src, group=group)
    # END SOLUTION


# --- 2. Naive: one all-reduce per parameter, after backward ---------------------------------


class NaiveDDP(torch.nn.Module):
    """Data parallel the simple way: all-reduce each gradient after backward."""

    def __init__(self, module, group=None):
        super().__init__()
        self.module = module
        self.group = group
        broadcast_parameters(module, group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def sync_gradients(self):
        """Replace each ``param.grad`` by its average over the ranks: one
        ``dist.all_reduce`` (sum) per parameter with a gradient, then divide."""
        # BEGIN SOLUTION: Sum each existing gradient over the group in place, then scale it down to the average.
        world = dist.get_world_size(self.group)
        for param in self.module.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad, group=self.group)
                param.grad.div_(world)
        # END SOLUTION


# --- 3. Buckets ---------------------------------------------------------------------------


def bucket_indices(sizes_bytes, bucket_cap_mb):
    """Buckets of parameter indices, following the rule in the module docstring.

    ``sizes_bytes[i]`` is the size of parameter ``i`` (registration order) in
    bytes. Returns a list of buckets, each a list of indices, in the order the
    gradients are expected: the first bucket starts with the last parameter.
    Example: sizes ``[400, 100, 300, 100]`` with a cap of 350 bytes give
    ``[[3, 2], [1, 0]]``; with a cap of 1000 bytes, ``[[3, 2, 1, 0]]``.
    """
    # BEGIN SOLUTION: Walk from the last parameter to the first, closing a bucket as soon as its bytes reach the cap.
    cap = bucket_cap_mb * 2**20
    buckets, current, filled = [], [], 0
    for i in reversed(range(len(sizes_bytes))):
        current.append(i)
        filled += sizes_bytes[i]
        if filled >= cap:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets
    # END SOLUTION


# --- 4. Bucketed, overlapped with backward; 5. no_sync ---------------------------------------


class BucketedDDP(torch.nn.Module):
    """Gradients all-reduced bucket by bucket while backward still runs.

    ``self.buckets[b]`` lists the parameter indices (into ``self.params``, the
    parameters that require a gradient) of bucket ``b``; ``self.buffers[b]`` is its flat buffer, made once with as many
    elements as the bucket's parameters together (one dtype per bucket).
    """

    def __init__(self, module, bucket_cap_mb=25, group=None):
        super().__init__()
        self.module = module
        self.group = group
        self.params = [p for p in module.parameters() if p.requires_grad]  # frozen ones get no gradient
        self.buckets = bucket_indices([p.numel() * p.element_size() for p in self.params], bucket_cap_mb)
        # One flat buffer per bucket, made once and reused every step (as torch's DDP does): a fresh
        # multi-MiB tensor per bucket and step costs page faults that show in the step time.
        self.buffers = [torch.empty(sum(self.params[i].numel() for i in bucket), dtype=self.params[bucket[0]].dtype,
                                    device=self.params[bucket[0]].device) for bucket in self.buckets]
        self.sync = True  # False inside no_sync(): accumulate locally, send nothing
        self.pending = []  # per bucket: how many of its gradients have not arrived this backward
        self.in_flight = []  # (handle, flat gradients, bucket) of each all-reduce started
        broadcast_parameters(module, group)
        self._reset()
        self._register_hooks()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _reset(self):
        self.pending = [len(bucket) for bucket in self.buckets]
        self.in_flight = []

    def _register_hooks(self):
        """A hook on each parameter: ``self._grad_ready(bucket, param)`` once
        its gradient has been accumulated into ``param.grad``.

        The hook is ``Tensor.register_post_accumulate_grad_hook``; torch calls
        it with the parameter alone, so each hook must carry its own bucket
        number. A function made inside a loop looks its free variables up when
        it runs, not when it is made: without care every hook would see the
        last bucket's number.
        """
        # BEGIN SOLUTION: Give every parameter of every bucket a hook that reports that bucket's number, fixed when the hook is made.
        for b, bucket in enumerate(self.buckets):
            for i in bucket:
                self.params[i].register_post_accumulate_grad_hook(lambda p, b=b: self._grad_ready(b, p))
        # END SOLUTION

    def _grad_ready(self, bucket, param):
        """Called during backward. When the bucket's last gradient is in, start
        its all-reduce (``async_op=True``) and keep the handle; do not wait.
        Inside ``no_sync()`` do nothing.

        ``self.pending[bucket]`` counts the bucket's gradients still to come.
        The bucket's gradients go into ``self.buffers[bucket]`` flattened, one
        after the other in the bucket's own order, and each all-reduce started
        is recorded in ``self.in_flight`` as the triple (its handle, the
        buffer, the bucket number).
        """
        # BEGIN SOLUTION: Count down the bucket's missing gradients; when none is left, pack them into its buffer and launch its reduction.
        if not self.sync:
            return
        self.pending[bucket] -= 1
        if self.pending[bucket] == 0:
            flat = self.buffers[bucket]
            torch.cat([self.params[i].grad.reshape(-1) for i in self.buckets[bucket]], out=flat)
            handle = dist.all_reduce(flat, group=self.group, async_op=True)
            self.in_flight.append((handle, flat, bucket))
        # END SOLUTION

    def finish_gradient_synchronization(self):
        """Wait for every bucket's all-reduce, average, and copy the result back
        into each ``param.grad``; ready the counters for the next backward.

        Each parameter's part of a buffer is the run of ``numel`` elements that
        ``_grad_ready`` packed for it; write the average into the existing
        ``param.grad`` tensor, in place, then call ``self._reset()``.
        """
        # BEGIN SOLUTION: Wait for each launched reduction, then hand every gradient its averaged slice of the buffer; reset the counters.
        world = dist.get_world_size(self.group)
        for handle, flat, bucket in self.in_flight:
            handle.wait()
            offset = 0
            for i in self.buckets[bucket]:
                grad = self.params[i].grad
                torch.div(flat[offset:offset + grad.numel()].view_as(grad), world, out=grad)  # average, copy back
                offset += grad.numel()
        self._reset()
        # END SOLUTION

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside this block accumulate gradients locally only."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous


# --- 6. Top-k compression with error feedback --------------------------------------------


def topk_compress(tensor, k):
    """``(values, indices)``: the ``k`` entries of ``tensor`` largest in absolute
    value, as 1-D tensors; ``indices`` index ``tensor.reshape(-1)`` and
    ``values`` keep their sign (``values == tensor.reshape(-1)[indices]``)."""
    # BEGIN SOLUTION: Rank the flattened entries by magnitude and keep the k largest, signs intact, with their positions.
    flat = tensor.reshape(-1)
    indices = flat.abs().topk(k).indices
    return flat[indices], indices
    # END SOLUTION


def topk_decompress(values, indices, shape, dtype=None):
    """The dense tensor of ``shape`` that is ``values`` at ``indices`` and 0 elsewhere."""
    dense = torch.zeros(torch.Size(shape).numel(), dtype=dtype or values.dtype)
    dense[indices] = values
    return dense.reshape(shape)


class ErrorFeedback:
    """Top-k compression that remembers what it did not send.

    ``compress(key, grad, k)`` adds the residual kept for ``key`` (zero the
    first time) to ``grad``, sends the top-k of that sum, and keeps the rest
    as the new residual. Over any number of steps,
    Σ sent (decompressed) + residual = Σ grad: nothing is lost.
    """

    def __init__(self):
        self.residuals = {}  # key -> tensor shaped like the gradient

    def residual(self, key):
        return self.residuals.get(key)

    def compress(self, key, grad, k):
        """``(values, indices)`` to send for ``grad``; ``grad`` is not modified."""
        # BEGIN SOLUTION: Fold the stored residual into a copy of the gradient, compress that, and remember what was left behind.
        corrected = grad.detach().clone()
        if key in self.residuals:
            corrected += self.residuals[key]
        values, indices = topk_compress(corrected, k)
        residual = corrected.reshape(-1).clone()
        residual[indices] = 0
        self.residuals[key] = residual.reshape(grad.shape)
        return values, indices
        # END SOLUTION
