"""Grader code that runs next to the student's ``context_parallel`` module in the sandbox.

The checks draw every input with NumPy and compute every expected value
themselves (``oracles.py``, in the grader's process); this file only feeds the
inputs to the student's functions and sends back what they returned, as
float64 NumPy arrays.

``one_process(queries)`` answers every single-process query (local_attention,
merge_partial_softmax, blockwise_attention, zigzag_indices, balance) in one
call. ``blockwise_attention`` runs under ``course.torch_audit.OpLog``, which
reports the largest tensor it made.

``cases_job(P, cases)`` runs every ring and Ulysses case on P ranks in one
``course.dist`` job, whose launcher counts the bytes that crossed between the
ranks in each case's forward and backward (``count_wire``, ``course.dist.mark``).
Each rank takes its shard of the whole q, k, v and upstream gradient (the positions the case gives it: contiguous, or for causal ring
attention the documented zigzag layout), runs the student's function forward and backward under
``OpLog`` (the messages, all-to-alls, waits and compute of each phase, and the
largest tensor whose last dimension is the head dimension), and records its
output and gradients. A rank writes a file per case as soon as it is done
(``save_record``); after a hang the other cases of the same function are not
run (``run_cases``' ``after_hang``): they use the same code and would hang as long.
"""
from autograder.grading.checking import rank_records, run_cases, save_record
from course import dist as launcher

JOB_TIMEOUT_S = 30  # a correct job of 4 processes takes a few seconds; a deadlock ends sooner, when the job idles


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


def _run_case(student, case, rank, P, mark):
    """A rank's record of one case; ``mark(phase)`` after the forward and after the
    backward, on every rank alike, counts what crossed in each (``course.dist.mark``)."""
    import torch

    from course.torch_audit import OpLog

    function = {"ring": student.ring_attention, "ulysses": student.ulysses_attention}[case["function"]]
    causal = case["causal"]
    if "local_len" in case:  # a shard the function must refuse
        record = _refusal(function, case, causal)
        mark("forward")
        mark("backward")
        return record
    mine = list(case["positions"][rank])
    q, k, v = (_torch(case[name][..., mine, :]).requires_grad_() for name in ("q", "k", "v"))
    upstream = _torch(case["upstream"][..., mine, :])
    with OpLog(last_dim=q.shape[-1]) as log:
        with log.phase("forward"):
            out = function(q, k, v, causal=causal)
        mark("forward")
        record = {"out": _np(out)}
        if isinstance(out, torch.Tensor) and out.shape == upstream.shape and out.requires_grad:
            with log.phase("backward"):
                out.backward(upstream)
        mark("backward")
    record.update({"dq": _np(q.grad), "dk": _np(k.grad), "dv": _np(v.grad), "positions": mine,
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


def rank_side(names, cases, P_expected, folder):
    """Every rank: run each named case; write one file per case and rank."""
    import torch
    import torch.distributed as tdist

    import context_parallel as student

    torch.set_default_dtype(torch.float64)
    rank, P = tdist.get_rank(), tdist.get_world_size()
    assert P == P_expected
    for name in names:
        launcher.mark(f"{name}:start")
        try:
            record = _run_case(student, cases[name], rank, P, lambda phase: launcher.mark(f"{name}:{phase}"))
            record["status"] = "ok"
        except NotImplementedError as exc:  # a stub raises on every rank alike
            record = {"status": "not_implemented", "message": str(exc)}
        tdist.barrier()  # the next case starts together
        save_record(folder, name, rank, record)
    return None


def cases_job(P, cases, job_timeout=JOB_TIMEOUT_S):
    """{case name: outcome} on ``P`` ranks for ``cases`` ({name: case}); see the module docstring."""
    def start(pending, folder):  # gloo on both tiers: the tensors are tiny and live on the CPU
        return launcher.run(f"{__file__}:rank_side", P, list(pending), {n: cases[n] for n in pending}, P, folder,
                            timeout=job_timeout, backend="gloo", idle_timeout=launcher.IDLE_TIMEOUT_S,
                            count_wire=True)

    def after_hang(name, pending):  # the same function would hang again, a timeout each
        return [n for n in pending if cases[n]["function"] == cases[name]["function"]]

    return run_cases(start, list(cases), P, rank_records, after_hang=after_hang, counted=("forward", "backward"))


# --- the GPU tier ------------------------------------------------------------------------------

def blockwise_vs_sdpa(seq_len, block, batch=1, heads=16, head_dim=64, repeats=10):
    """{"ours_ms", "sdpa_ms", "max_error", "device"}: the student's blockwise_attention
    and torch's scaled_dot_product_attention on one GPU, float32, causal."""
    import torch

    import context_parallel as student
    from course.timing import measure

    torch.backends.cuda.matmul.allow_tf32 = False
    generator = torch.Generator(device="cuda").manual_seed(12)
    q, k, v = (torch.randn(batch, heads, seq_len, head_dim, device="cuda", generator=generator) for _ in range(3))
    ours = student.blockwise_attention(q, k, v, block, causal=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    def ms(fn):
        return measure(fn, repeat=repeats, sync=torch.cuda.synchronize).median * 1e3

    return {"ours_ms": ms(lambda: student.blockwise_attention(q, k, v, block, causal=True)),
            "sdpa_ms": ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)),
            "max_error": float((ours - sdpa).abs().max()), "device": torch.cuda.get_device_name()}
