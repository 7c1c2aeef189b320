"""Grader code that runs next to the student's ``context_parallel`` module in the sandbox.

The checks draw every input with NumPy and compute every expected value
themselves (``oracles.py``, in the grader's process); this file only feeds the
inputs to the student's functions and sends back what they returned, as
float64 NumPy arrays.

``one_process(queries)`` answers every single-process query (local_attention,
merge_partial_softmax, blockwise_attention, zigzag_indices, balance) in one
call. ``blockwise_attention`` runs under ``course.torch_audit.OpLog``, which
reports the largest tensor it made.

``cases_rank`` is a rank function of a rank job (``autograder.sandbox.ranks``): rank r
receives only its own shard of every case's q, k, v and upstream gradient (the
positions the layout gives it: contiguous, or for causal ring attention the
documented zigzag layout), runs the student's function forward and backward under
``OpLog`` (the messages, all-to-alls, waits and compute of each phase, and the
largest tensor whose last dimension is the head dimension: an in-process record,
for feedback), marks each phase for the launcher's count of what crossed, and emits
its output and gradients. ``blockwise_memory_rank`` runs one large blockwise attention whose
peak memory the launcher reads from outside.

``blockwise_vs_sdpa`` (the GPU tier) times the student's blockwise attention and torch's
through ``course.gpu_timing.bench``: new inputs named by a seed every run, sampled
outputs back (on the CPU tier, a dry run on the stand-ins).
"""
from autograder.sandbox import ranks


def _torch(array):
    """A contiguous float64 tensor (NumPy's fancy indexing can leave strided arrays)."""
    import numpy as np
    import torch

    return torch.tensor(np.ascontiguousarray(array), dtype=torch.float64)


def _np(tensor):
    import numpy as np
    import torch

    if tensor is None:
        return None
    if not isinstance(tensor, torch.Tensor):
        return np.asarray(tensor, dtype=float)
    return tensor.detach().to("cpu", torch.float64).numpy().copy()


def _plain(value):
    """A layout or placement as lists of ints, or its repr when it is something else."""
    import numbers

    try:
        return [[int(i) for i in part] if not isinstance(part, numbers.Number) else int(part) for part in value]
    except (TypeError, ValueError):
        return repr(value)[:200]


def _answer(call, what):
    """{"value": ...}, {"error": ...} or raises NotImplementedError for a stub."""
    try:
        return {"value": call()}
    except NotImplementedError:
        raise
    except Exception as exc:  # the check says what the call raised
        return {"error": f"{type(exc).__name__}: {exc}"[:400], "call": what}


def _pair(value):
    """(out, lse) as arrays, whatever sequence the student returned."""
    out, lse = value
    return [_np(out), _np(lse)]


def one_process(queries):
    """{function: [answer per query] or {"not_implemented": message}}."""
    import torch

    import context_parallel as student
    from course.torch_audit import OpLog

    torch.set_default_dtype(torch.float64)

    def local(q):
        return _pair(student.local_attention(_torch(q["q"]), _torch(q["k"]), _torch(q["v"]), causal=q["causal"]))

    def merge(q):
        return _pair(student.merge_partial_softmax(_torch(q["out_a"]), _torch(q["lse_a"]), _torch(q["out_b"]),
                                                   _torch(q["lse_b"])))

    def blockwise(q):
        with OpLog() as log:
            out = student.blockwise_attention(_torch(q["q"]), _torch(q["k"]), _torch(q["v"]), q["block"],
                                              causal=q["causal"])
        return {"out": _np(out), "largest": list(log.largest[1])}

    def zigzag(q):
        return _plain(student.zigzag_indices(q["seq_len"], q["P"]))

    def balance(q):
        return _plain(student.balance(list(q["seq_lens"]), q["P"]))

    answers = {}
    for name, function in (("local_attention", local), ("merge_partial_softmax", merge),
                           ("blockwise_attention", blockwise), ("zigzag_indices", zigzag), ("balance", balance)):
        try:
            answers[name] = [_answer(lambda: function(q), q.get("call", name)) for q in queries.get(name, [])]
        except NotImplementedError as exc:
            answers[name] = {"not_implemented": str(exc)}
    return answers


# --- the distributed cases -------------------------------------------------------------------

def _events(log, phase):
    return {kind: log.elements(kind, phase) for kind in ("send", "recv", "all_to_all", "all_gather", "all_reduce",
                                                         "broadcast", "reduce_scatter", "scatter", "gather")}


def _own(array):
    """A tensor on this rank's own part of an input, without a copy."""
    import numpy as np
    import torch

    return torch.from_numpy(np.require(array, np.float64, ["C", "W"]))


def _run_case(student, case, mark):
    """A rank's record of one case, from its own shard of q, k, v and the upstream gradient;
    ``mark(phase)`` after the forward and after the backward, on every rank alike, counts
    what crossed in each."""
    import torch

    from course.torch_audit import OpLog

    function = {"ring": student.ring_attention, "ulysses": student.ulysses_attention}[case["function"]]
    causal = case["causal"]
    if "local_len" in case:  # a shard the function must refuse
        record = _refusal(function, case, causal)
        mark("forward")
        mark("backward")
        return record
    q, k, v = (_own(case[name]).requires_grad_() for name in ("q", "k", "v"))
    upstream = _own(case["upstream"])
    with OpLog(last_dim=q.shape[-1]) as log:
        with log.phase("forward"):
            out = function(q, k, v, causal=causal)
        mark("forward")
        record = {"out": _np(out)}
        if isinstance(out, torch.Tensor) and out.shape == upstream.shape and out.requires_grad:
            with log.phase("backward"):
                out.backward(upstream)
        mark("backward")
    record.update({"dq": _np(q.grad), "dk": _np(k.grad), "dv": _np(v.grad),
                   "forward": _events(log, "forward"), "backward": _events(log, "backward"),
                   "overlap": list(log.overlapped_transfers("forward")), "largest": list(log.largest[1])})
    return record


def _refusal(function, case, causal):
    """Whether ``function`` raised ValueError for a shard it must refuse."""
    import torch
    b, h, _, d = case["shape"]
    x = torch.zeros(b, h, case["local_len"], d)
    try:
        function(x.clone(), x.clone(), x.clone(), causal=causal)
    except ValueError as exc:
        return {"raised": True, "message": str(exc)[:300]}
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported: the wrong error
        return {"raised": False, "message": f"{type(exc).__name__}: {exc}"[:300]}
    return {"raised": False, "message": ""}


def cases_rank(parts):
    """A rank of a rank job (``autograder.sandbox.ranks``): every case it is given (its own
    shard of each), in order; one record per case, emitted as soon as it is done."""
    import torch
    import torch.distributed as tdist

    import context_parallel as student

    torch.set_default_dtype(torch.float64)
    for case in parts:
        name = case["case"]
        ranks.mark(f"{name}:start")
        try:
            record = _run_case(student, case, lambda phase: ranks.mark(f"{name}:{phase}"))
            record["status"] = "ok"
        except NotImplementedError as exc:  # a stub raises on every rank alike
            record = {"status": "not_implemented", "message": str(exc)}
        tdist.barrier()  # the next case starts together
        ranks.emit({"case": name, **record})


def blockwise_memory_rank(parts):
    """``blockwise_attention`` on each case in turn (a small one, then a large one), a mark
    after each at which the launcher reads the rank's peak memory from outside."""
    import torch

    import context_parallel as student

    torch.set_default_dtype(torch.float64)
    for case in parts:
        q, k, v = (_own(case[name]) for name in ("q", "k", "v"))
        with torch.no_grad():
            out = student.blockwise_attention(q, k, v, case["block"], causal=case["causal"])
        del q, k, v
        ranks.mark(f"{case['case']}:done")
        ranks.emit({"case": case["case"], "status": "ok", "out": _np(out)})
        del out


# --- the GPU tier ------------------------------------------------------------------------------

def blockwise_vs_sdpa(seq_len, block, seeds, batch=1, heads=16, head_dim=64, samples=32):
    """The student's causal ``blockwise_attention`` and torch's ``scaled_dot_product_attention``,
    float32, each timed with ``course.gpu_timing.bench`` on ``torch_device.device()``: for
    every seed of ``seeds`` new q, k, v named by it (``hashed``: q and k in [-2, 2), v in
    [-1, 1)), the L2 flushed, CUDA events around the call; each run sends back its output at
    ``gpu_timing.sample_positions(seed, size, samples)``, which the grader recomputes.
    On the CPU tier the device is a stand-in (CPU tensors): a dry run."""
    import torch

    import context_parallel as student
    from course import gpu_timing, torch_device

    torch.backends.cuda.matmul.allow_tf32 = False  # FP32, as the check's description says
    dev = torch_device.device()
    shape = (batch, heads, seq_len, head_dim)

    def inputs(seed):
        return (dev.hashed(seed, shape, -2.0, 2.0), dev.hashed(seed, shape, -2.0, 2.0, stream=1),
                dev.hashed(seed, shape, -1.0, 1.0, stream=2))

    def sampled(out, args, seed):
        return dev.take(out, gpu_timing.sample_positions(seed, out.numel(), samples))

    def ours(q, k, v):
        return student.blockwise_attention(q, k, v, block, causal=True)

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    return {"ours": gpu_timing.bench(dev, ours, inputs, sampled, seeds),
            "sdpa": gpu_timing.bench(dev, sdpa, inputs, sampled, seeds)}
