"""Checks for lab 12: context parallelism (blockwise, ring and Ulysses attention).

Every expected value comes from ``oracles.py``, in the grader's process, and none
of its functions computes what a lab function returns: outputs and gradients
are torch's own attention and autograd in float64 (``scaled_dot_product_attention``,
which the lab does not ask for); a log-sum-exp is checked by its definition
(``sum_j exp(score_ij - lse_i) == 1``), a merge by the weights its log-sum-exp
gives the two blocks; the layouts are a table, the balance a brute force. The
inputs are drawn here and sent to the student's code; it sends back its outputs.
The hidden check (``check_context_parallel_hidden.py``, not in the student
repository) tries ``zigzag_indices`` on sizes the table does not hold.

- One process: ``local_attention``, ``merge_partial_softmax`` (including
  log-sum-exps near ±1e4, where a merge that takes ``exp`` of them overflows),
  ``blockwise_attention`` (block sizes that do and do not divide the sequence;
  the largest tensor it makes, seen by ``course.torch_audit.OpLog``),
  ``zigzag_indices`` and ``balance``, all in one sandboxed call.
- Ring and Ulysses attention on 2 and 4 gloo processes, every case of a world
  size in one ``course.dist`` job (see harness.py): output and dq, dk, dv of
  every rank against dense attention of the whole sequence, sliced by the
  documented layout; the messages, all-to-alls, waits and compute each rank
  ran, and the largest tensor with the head dimension it made.

- The GPU tier: causal ``blockwise_attention`` against torch's
  ``scaled_dot_product_attention``, both timed through ``course.gpu_timing.bench``
  (new inputs named by a seed every run, the L2 flushed) and judged by
  ``autograder.grading.timed.judge``: every timed run's sampled output rows are
  recomputed here in float64 (``oracles.sampled_causal_attention``). On the CPU
  tier, ``--dry-run-gpu`` runs it at tiny sizes on the stand-ins, awarding nothing.

Sizes: batch 2, sequence 16, head dimension 6 (no sequence length or block is
6, so a tensor whose last dimension is 6 is a q, k, v or output, never a score
matrix). Tolerances: 1e-9 relative, and absolute 1e-11 or 1e-10 of the array's
largest value, whichever is larger (1e-8 where every score is near ±1e4); the
position-encoded Ulysses case is exact.
"""
import math

import numpy as np
import pytest

from autograder.grading import seeds, timed
from autograder.grading.checking import expect_array, load_beside, with_the_work
from autograder.grading.rank_jobs import held_at_peak, run_cases, settle
from autograder.grading.traffic import expect_crossed
from course import gpu_timing
from course.wire import gloo_bytes, gloo_messages
from autograder.grading.submission import failure_from, not_implemented_yet

oracles = load_beside(__file__, "oracles")

WORLD_SIZES = (2, 4)
B, S, D = 2, 16, 6
RING_HEADS, ULYSSES_HEADS = 3, 4  # ring takes any head count; Ulysses 4: one head per rank on 4 ranks
RTOL, ATOL = 1e-9, 1e-11
BLOCKWISE_SHAPE = (B, 2, 10, D)  # 10 positions: blocks 1, 3, 4, 10 and 13
BLOCKS = (1, 3, 4, 10, 13)


# --- the single-process call -----------------------------------------------------------------

def _queries(seed):
    """Every single-process query, its values drawn from the grading's secret seed."""
    def draw(*names):
        return int(seeds.rng(seed, "12", *names).integers(2**62))

    q = {"local_attention": [], "merge_partial_softmax": [], "blockwise_attention": [], "zigzag_indices": [],
         "balance": []}
    for i, causal in enumerate((False, True)):
        inputs = oracles.qkv(draw("local", i), (B, 3, 7, D))
        if not causal:  # queries against a block of another length
            inputs["k"], inputs["v"] = oracles.randn(draw("local k"), B, 3, 5, D), oracles.randn(draw("local v"), B, 3, 5, D)
        q["local_attention"].append({**inputs, "causal": causal, "call": f"local_attention(causal={causal})"})
    for i, (centre, spread) in enumerate(((0.0, 3.0), (0.0, 0.0), (1e4, 4.0), (-1e4, 4.0), (1e4, 40.0))):
        shape, at = (B, 3, 5), draw("merge", i)
        q["merge_partial_softmax"].append({
            "out_a": oracles.randn(at, *shape, D), "out_b": oracles.randn(at + 100, *shape, D),
            "lse_a": centre + oracles.randn(at + 200, *shape, scale=spread),
            "lse_b": centre + oracles.randn(at + 300, *shape, scale=spread), "huge": abs(centre) > 0})
    for causal in (False, True):
        inputs = oracles.qkv(draw("blockwise", causal), BLOCKWISE_SHAPE)
        for block in BLOCKS:
            q["blockwise_attention"].append({**inputs, "block": block, "causal": causal,
                                             "call": f"blockwise_attention(block={block}, causal={causal})"})
    q["zigzag_indices"] = [{"seq_len": s, "P": P, "call": f"zigzag_indices({s}, {P})"}
                           for s, P in ((2, 1), (4, 2), (16, 2), (16, 4), (24, 3), (8, 4), (10, 4), (6, 2), (9, 1))]
    rng = seeds.rng(seed, "12", "balance")
    lens = [[7], [3, 3], [5, 1, 1, 1], [8, 7, 6, 5, 4, 3, 2, 1], [2, 2, 2, 2, 2, 2, 2], [9, 1, 1, 1, 1, 1, 1]]
    lens += [[int(n) for n in rng.integers(1, 40, size=rng.integers(4, 9))] for _ in range(6)]
    q["balance"] = [{"seq_lens": lens_, "P": P, "call": f"balance({lens_}, {P})"}
                    for lens_ in lens for P in (2, 3)] + [{"seq_lens": [4, 2], "P": 4, "call": "balance([4, 2], 4)"}]
    return q


def _answers(submission, seed, name):
    """[(query, answer)] for ``name``; NotImplementedYet for a stub."""
    queries = submission.once("queries", lambda: _queries(seed))
    found = submission.harness_once("one_process", "one_process", queries)[name]
    if isinstance(found, dict) and "not_implemented" in found:
        raise not_implemented_yet(found["not_implemented"])
    return list(zip(queries[name], found))


def _value(answer, call):
    if "error" in answer:
        raise AssertionError(f"{call} raised {answer['error']}")
    return answer["value"]


def _pair(value, call):
    if not (isinstance(value, (list, tuple)) and len(value) == 2):
        raise AssertionError(f"{call} should return (out, lse), got {str(value)[:120]}")
    return value


@pytest.mark.points(1)
def check_local_attention(submission, seed):
    """local_attention: output equals torch's attention, the log-sum-exp each row's, causal and not"""
    for query, answer in _answers(submission, seed, "local_attention"):
        out, lse = _pair(_value(answer, query["call"]), query["call"])
        want_out = oracles.torch_attention(query["q"], query["k"], query["v"], query["causal"])
        expect_array(out, want_out, f"{query['call']}: out", rtol=RTOL, atol=ATOL)
        problem = oracles.lse_problem(query["q"], query["k"], query["causal"], lse, f"{query['call']}: lse")
        assert problem is None, problem


def _expect_merges(submission, seed, huge):
    for query, answer in _answers(submission, seed, "merge_partial_softmax"):
        if query["huge"] != huge:
            continue
        call = "merge_partial_softmax" + (f" with log-sum-exps near {query['lse_a'].mean():.0f}" if huge else "")
        out, lse = _pair(_value(answer, call), call)
        finite = all(np.isfinite(np.asarray(x, dtype=float)).all() for x in (out, lse))
        hint = ("" if not huge or finite else
                " (not finite: exp of a log-sum-exp near 1e4 overflows; weigh the blocks by a sigmoid of the "
                "difference of their log-sum-exps)")
        problem = oracles.merge_problem(query["out_a"], query["lse_a"], query["out_b"], query["lse_b"], out, lse,
                                        call, rtol=RTOL, atol=ATOL)
        assert problem is None, f"{problem}{hint}"


@pytest.mark.points(2)
def check_merge_partial_softmax(submission, seed):
    """merge_partial_softmax: two blocks' (out, lse) combine into attention over both (weights from the merged lse)"""
    _expect_merges(submission, seed, huge=False)


@pytest.mark.points(1)
def check_merge_is_stable_for_huge_logits(submission, seed):
    """merge_partial_softmax stays finite and exact for log-sum-exps near ±1e4"""
    _expect_merges(submission, seed, huge=True)


@pytest.mark.points(2)
def check_blockwise_attention(submission, seed):
    """blockwise_attention equals full attention, causal and not, for blocks that do and do not divide the sequence"""
    for query, answer in _answers(submission, seed, "blockwise_attention"):
        found = _value(answer, query["call"])
        want = oracles.torch_attention(query["q"], query["k"], query["v"], query["causal"])
        expect_array(found["out"], want, query["call"], rtol=RTOL, atol=ATOL)


# Large enough that the score matrix dominates what a rank's peak memory (VmHWM, which the launcher
# reads from outside) grows by during the run. A small run first puts what any first run allocates
# (torch's own buffers, the harness, the process group) into the peak already, whatever that comes
# to on a machine; the check reads how much the large run then adds: 2 MiB for the reference, 256 MiB and more
# for a forward that makes the whole score matrix.
BLOCKWISE_MEMORY = {"shape": (1, 8, 2048, 8), "block": 128}  # the full score matrix: 256 MiB in float64
WARM_UP_SHAPE = (1, 8, 256, 8)  # its full score matrix: 4 MiB
MEMORY_TIMEOUT_S = 60


def _memory_job(submission, seed, function, P):
    """(the large case, the job) of a small and then a large blockwise attention in a job of one
    rank (``harness.blockwise_memory_rank``), marking after each; once per grading."""
    def run():
        rng = seeds.rng(seed, "12", "memory", function)
        cases = []
        for name, shape in (("warm-up", WARM_UP_SHAPE), ("large", BLOCKWISE_MEMORY["shape"])):
            case = {**oracles.qkv(int(rng.integers(2**62)), shape), "name": name, "function": "blockwise",
                    "causal": False, "block": BLOCKWISE_MEMORY["block"], "positions": [list(range(shape[2]))]}
            del case["upstream"]
            cases.append(case)
        parts = [[{"case": case["name"], "function": function, "causal": False, "block": case["block"],
                   **{name: np.ascontiguousarray(case[name][..., case["positions"][rank], :])
                      for name in ("q", "k", "v")}} for case in cases] for rank in range(P)]
        return cases[-1], submission.rank_job("torch", "blockwise_memory_rank", parts, timeout=MEMORY_TIMEOUT_S,
                                              idle_timeout=IDLE_TIMEOUT_S)
    return submission.once(("memory", function, P), run)


def _peak_growth(submission, seed, function, P, what):
    """How much each rank's peak memory (the launcher's reading of VmHWM) grew during the large
    forward pass, after the small one, whose output must also be right; None where this machine
    gives no reading."""
    case, job = _memory_job(submission, seed, function, P)
    if job.status != "ok":
        raise failure_from({"status": job.status, "message": job.explain()}, what)
    want = oracles.torch_attention(case["q"], case["k"], case["v"], False)
    for rank, records in enumerate(job.outputs):
        expect_array(records[-1]["out"], want[..., case["positions"][rank], :], f"{what}, rank {rank}: out",
                     rtol=RTOL, atol=ATOL)
    before, after = held_at_peak(job, "warm-up:done"), held_at_peak(job, "large:done")
    if before is None or after is None or not all(before) or not all(after):
        return None
    return [b - a for a, b in zip(before, after)]


@pytest.mark.points(1)
def check_blockwise_attention_never_makes_the_full_score_matrix(submission, seed, metrics):
    """blockwise_attention never holds the full score matrix: its peak memory, read from outside, stays under half of it"""
    with_the_work("never making the full score matrix", lambda: check_blockwise_attention(submission, seed))
    b, h, s, d = BLOCKWISE_MEMORY["shape"]
    scores = b * h * s * s * 8
    what = f"blockwise_attention(block={BLOCKWISE_MEMORY['block']}) on q, k, v of shape {(b, h, s, d)}"
    grown = _peak_growth(submission, seed, "blockwise", 1, what)
    if grown is None:
        pytest.skip("this machine gives the launcher no reading of a process's memory (/proc/PID/status)")
    held = grown[0]
    metrics.update(peak_growth_mib=round(held / 2**20, 1), scores_mib=scores / 2**20)
    if held >= scores / 2:
        raise AssertionError(
            f"{what} held {held / 2**20:.0f} MiB more at its peak than a run on a sequence of "
            f"{WARM_UP_SHAPE[2]} before it (the kernel's count of its memory); "
            f"the full score matrix is {scores / 2**20:.0f} MiB, a block of scores "
            f"{scores * BLOCKWISE_MEMORY['block'] // s / 2**20:.0f} MiB: compute one block of keys at a time and "
            "merge, with NumPy as with torch")
    # The in-process record at the small sizes, for a message that names the tensor.
    bb, hh, ss, dd = BLOCKWISE_SHAPE
    for query, answer in _answers(submission, seed, "blockwise_attention"):
        if query["block"] >= ss:
            continue
        shape = _value(answer, query["call"])["largest"]
        limit = bb * hh * ss * max(dd, query["block"])  # q, k, v, the output, or all queries against one key block
        if math.prod(shape) > limit:
            raise AssertionError(
                f"{query['call']} made a tensor of shape {tuple(shape)} ({math.prod(shape)} elements); a block of "
                f"scores is at most {limit}, the full score matrix {bb * hh * ss * ss}: compute one block of keys at a "
                "time and merge")


def _layouts(submission, seed):
    for query, answer in _answers(submission, seed, "zigzag_indices"):
        yield query, answer, query["seq_len"] % (2 * query["P"]) == 0


@pytest.mark.points(1)
def check_zigzag_layout(submission, seed):
    """zigzag_indices gives rank r chunks r and 2P-1-r of 2P"""
    for query, answer, divides in _layouts(submission, seed):
        if divides:
            got = _value(answer, query["call"])
            want = oracles.ZIGZAG[query["seq_len"], query["P"]]
            if got != want:
                raise AssertionError(f"{query['call']} is {got}, expected {want}")


@pytest.mark.points(1)
def check_zigzag_balances_causal_work(submission, seed):
    """under zigzag_indices every rank's causal work is within one block of the mean"""
    for query, answer, divides in _layouts(submission, seed):
        if not divides or query["P"] == 1:
            continue
        layout = _value(answer, query["call"])
        s, P = query["seq_len"], query["P"]
        if not (isinstance(layout, list) and len(layout) == P and sorted(sum(layout, [])) == list(range(s))):
            raise AssertionError(f"{query['call']} is {str(layout)[:200]}: not every position exactly once")
        work = [oracles.causal_pairs(positions) for positions in layout]
        block = (s // (2 * P)) ** 2
        mean = sum(work) / P
        if max(abs(w - mean) for w in work) > block:
            raise AssertionError(f"{query['call']}: the ranks' unmasked (query, key) pairs are {work}, more than one "
                                 f"block ({block} pairs) from their mean {mean:g}")


@pytest.mark.points(1)
def check_sequence_not_in_2P_chunks_is_an_error(submission, seed):
    """a sequence that does not divide into 2P chunks raises ValueError, in zigzag_indices and causal ring_attention"""
    for query, answer, divides in _layouts(submission, seed):
        if not divides and "error" not in answer:
            raise AssertionError(f"{query['call']} returned {str(answer['value'])[:120]}; {query['seq_len']} "
                                 f"positions do not divide into 2P = {2 * query['P']} chunks: raise ValueError")
        if not divides and not answer["error"].startswith("ValueError"):
            raise AssertionError(f"{query['call']} raised {answer['error']}, expected ValueError")
    _expect_raises(submission, seed, "ring_odd_shard", "ring_attention(causal=True) on a shard of 3 positions")


@pytest.mark.points(1)
def check_balance(submission, seed):
    """balance places every sequence once, its busiest rank within 4/3 of the best placement's (brute force)"""
    for query, answer in _answers(submission, seed, "balance"):
        placement = _value(answer, query["call"])
        lens, P = query["seq_lens"], query["P"]
        if not (isinstance(placement, list) and len(placement) == P
                and sorted(sum(placement, [])) == list(range(len(lens)))):
            raise AssertionError(f"{query['call']} is {str(placement)[:200]}: expected {P} lists that hold every "
                                 f"index 0..{len(lens) - 1} exactly once")
        busiest = max(sum(oracles.sequence_work(lens[i]) for i in part) for part in placement)
        best = oracles.best_balance(lens, P)
        if busiest > best * 4 / 3:
            raise AssertionError(f"{query['call']} gives the busiest rank {busiest} pairs of work, the best placement "
                                 f"{best}: more than 4/3 of it (is a sequence's work L(L+1)/2, not L?)")


# --- ring and Ulysses --------------------------------------------------------------------------

JOB_TIMEOUT_S = 30  # a correct job of 4 processes takes a few seconds; a deadlock ends sooner, when the job idles
IDLE_TIMEOUT_S = 5


def _cases(P, seed):
    """{name: case} for P ranks: the whole q, k, v and upstream gradient (drawn from the
    grading's secret seed), how to call, and the positions each rank holds (the documented
    layout, from the table). Each rank receives only its own positions."""
    def draw(name):
        return int(seeds.rng(seed, "12", name, P).integers(2**62))

    ring, uly = (B, RING_HEADS, S, D), (B, ULYSSES_HEADS, S, D)
    cases = {
        "ring": {**oracles.qkv(draw("ring"), ring), "function": "ring", "causal": False},
        "ring_causal": {**oracles.qkv(draw("ring_causal"), ring), "function": "ring", "causal": True},
        "ring_one_chunk_each": {**oracles.qkv(draw("ring_one_chunk_each"), (1, 1, 2 * P, D)), "function": "ring",
                                "causal": True},
        "ring_one_position_each": {**oracles.qkv(draw("ring_one_position_each"), (1, 2, P, D)), "function": "ring",
                                   "causal": False},
        # scores of 1e4 carry rounding of ~2e-12 each: gradients agree to ~1e-9 of their size, not 1e-10
        "ring_huge_logits": {**oracles.near_huge(draw("ring_huge_logits"), ring), "function": "ring", "causal": True,
                             "noise": 1e-8},
        "ring_odd_shard": {"function": "ring", "causal": True, "shape": ring, "local_len": 3},
        "ulysses": {**oracles.qkv(draw("ulysses"), uly), "function": "ulysses", "causal": False},
        "ulysses_causal": {**oracles.qkv(draw("ulysses_causal"), uly), "function": "ulysses", "causal": True},
        "ulysses_positions": {**oracles.position_encoded(*uly), "function": "ulysses", "causal": True},
        "ulysses_heads_indivisible": {"function": "ulysses", "causal": False, "shape": (B, P + 1, S, D),
                                      "local_len": S // P},
    }
    for case in cases.values():
        if "q" in case:
            s = case["q"].shape[-2]
            case["positions"] = (oracles.ZIGZAG[s, P] if case["function"] == "ring" and case["causal"]
                                 else oracles.contiguous(s, P))
    return cases


def _part(case, rank):
    """What rank ``rank`` receives of a case: its own positions of q, k, v and upstream, alone."""
    if "q" not in case:
        return {k: v for k, v in case.items() if k in ("function", "causal", "shape", "local_len")}
    mine = case["positions"][rank]
    return {"function": case["function"], "causal": case["causal"],
            **{name: np.ascontiguousarray(case[name][..., mine, :]) for name in ("q", "k", "v", "upstream")}}


def _job(submission, seed, P):
    """{case name: outcome} of every case on P ranks, once per grading."""
    def run():
        cases = _cases(P, seed)

        def after_hang(name, pending):  # the same function would hang again, a timeout each
            return [n for n in pending if cases[n]["function"] == cases[name]["function"]]
        found = run_cases(submission, "torch", "cases_rank", list(cases), lambda name: P,
                          lambda name, rank: _part(cases[name], rank), timeout=JOB_TIMEOUT_S,
                          idle_timeout=IDLE_TIMEOUT_S, count_wire=True, after_hang=after_hang)
        return cases, settle(found, ("forward", "backward"))
    return submission.once(("cases_job", P), run)


def _case(submission, seed, name, sizes=WORLD_SIZES):
    """{P: (inputs, outcome)} for the case on every world size; the outcome's "records",
    one per rank."""
    found = {}
    for P in sizes:
        cases, outcomes = _job(submission, seed, P)
        outcome = outcomes[name]
        if outcome["status"] != "ok":
            raise failure_from(outcome, f"{name} on {P} ranks")
        found[P] = (cases[name], outcome)
    return found


def _expect_attention(submission, seed, names, grads=False):
    for name in names:
        for P, (case, outcome) in _case(submission, seed, name).items():
            found = oracles.torch_attention(case["q"], case["k"], case["v"], case["causal"], case["upstream"])
            want = dict(zip(("out", "dq", "dk", "dv"), found if grads else found[:1]))
            layout = case["positions"]
            for rank, record in enumerate(outcome["records"]):
                for label, whole in want.items():
                    where = f"{name} on {P} ranks, rank {rank}: {label}"
                    if record[label] is None:
                        raise AssertionError(f"{where} is None: no gradient reached it (does the backward return "
                                             "dq, dk and dv?)")
                    atol = max(ATOL, case.get("noise", 1e-10) * float(np.abs(whole).max()))
                    expect_array(record[label], whole[..., layout[rank], :], where, rtol=RTOL, atol=atol)


def _expect_raises(submission, seed, name, call):
    for P, (_, outcome) in _case(submission, seed, name).items():
        for rank, record in enumerate(outcome["records"]):
            if not record["raised"]:
                raise AssertionError(f"{call} on {P} ranks, rank {rank}: expected ValueError, got "
                                     f"{record['message'] or 'no error'}")


@pytest.mark.points(2)
def check_ring_attention(submission, seed):
    """ring_attention equals full attention on 2 and 4 ranks, down to one position per rank"""
    _expect_attention(submission, seed, ["ring", "ring_one_position_each"])


@pytest.mark.points(2)
def check_ring_attention_causal(submission, seed):
    """causal ring_attention on the zigzag layout equals full causal attention, down to one position per chunk"""
    _expect_attention(submission, seed, ["ring_causal", "ring_one_chunk_each"])


@pytest.mark.points(3)
def check_ring_attention_gradients(submission, seed):
    """ring_attention's dq, dk and dv equal dense attention's, causal and not, on 2 and 4 ranks"""
    _expect_attention(submission, seed, ["ring", "ring_causal", "ring_one_chunk_each"], grads=True)


@pytest.mark.points(1)
def check_ring_attention_huge_logits(submission, seed):
    """ring_attention stays exact, gradients included, when every score is near +1e4 or -1e4"""
    _expect_attention(submission, seed, ["ring_huge_logits"], grads=True)


@pytest.mark.points(1)
def check_ring_sends_P_minus_1_blocks(submission, seed):
    """forward, P-1 K/V blocks per rank cross between the ranks (the kernel's count), one at a time, and no collective"""
    with_the_work("the ring's traffic", lambda: _expect_attention(submission, seed, ["ring"]))
    for P, (case, outcome) in _case(submission, seed, "ring").items():
        block = case["k"][..., :S // P, :].size  # one rank's K (or V)
        where = f"ring_attention on {P} ranks, forward"
        logged = sum(sum(record["forward"]["send"]) for record in outcome["records"]) * 8
        expect_crossed(submission, outcome["wire"], "forward", gloo_bytes("send", P * (P - 1) * 2 * block * 8, P),
                       P * (P - 1) * 2, where, f"P-1 = {P - 1} K/V blocks of {2 * block} float64 per rank", logged)
        for rank, record in enumerate(outcome["records"]):
            moved = record["forward"]
            collectives = {k: len(v) for k, v in moved.items() if v and k not in ("send", "recv")}
            where = f"ring_attention on {P} ranks, rank {rank}, forward"
            assert not collectives, f"{where}: made collectives {collectives}; the blocks travel by send and receive"
            for kind in ("send", "recv"):
                total = sum(moved[kind])
                assert total == (P - 1) * 2 * block, (
                    f"{where}: {kind} {moved[kind]} elements ({total}), expected P-1 = {P - 1} K/V blocks of "
                    f"{2 * block} ({(P - 1) * 2 * block})")
                assert all(n in (block, 2 * block) for n in moved[kind]), (
                    f"{where}: {kind} messages of {moved[kind]} elements, expected one K, V or K/V block each "
                    f"({block} or {2 * block})")


@pytest.mark.points(1)
def check_ring_overlaps_transfers_with_compute(submission, seed):
    """forward, each of the P-1 transfers is posted before the current block's compute and waited for after"""
    with_the_work("overlapping transfers with compute", lambda: _expect_attention(submission, seed, ["ring"]))
    for P, (_, outcome) in _case(submission, seed, "ring").items():
        for rank, record in enumerate(outcome["records"]):
            transfers, overlapped = record["overlap"]
            assert transfers >= P - 1 and overlapped == transfers, (
                f"ring_attention on {P} ranks, rank {rank}: {overlapped} of its {transfers} transfers overlapped a "
                f"block's compute (expected all of at least {P - 1}): post the next block's isend/irecv before "
                "attending to the current block, and wait for them after")


@pytest.mark.points(1)
def check_no_rank_holds_the_whole_k_or_v(submission, seed):
    """on 4 ranks, neither ring nor Ulysses attention makes a tensor of the head dimension as large as the whole K"""
    # An in-process record (course.torch_audit.OpLog), credited only with the right answers: the ranks
    # receive only their shards, so the whole K exists nowhere until they send it; a rank's peak memory
    # cannot tell an all-gather of K and V from an honest ring's temporaries at 4 ranks (measured: the
    # reference's ring holds some 15 shards' worth at its peak, the whole K and V are 8).
    with_the_work("holding only a shard", lambda: _expect_attention(submission, seed, ["ring", "ulysses"]))
    for name in ("ring", "ulysses"):
        for P, (case, outcome) in _case(submission, seed, name, sizes=(4,)).items():
            whole = case["k"].size
            for rank, record in enumerate(outcome["records"]):
                shape = record["largest"]
                assert math.prod(shape) < whole, (
                    f"{name} attention on {P} ranks, rank {rank} made a tensor of shape {tuple(shape)}, as large as "
                    f"the whole K {case['k'].shape}: a rank holds its shard and one block at a time")


@pytest.mark.points(2)
def check_ulysses_attention(submission, seed):
    """ulysses_attention equals full attention, causal and not, on 2 and 4 ranks (one head each on 4)"""
    _expect_attention(submission, seed, ["ulysses", "ulysses_causal"])


@pytest.mark.points(1)
def check_ulysses_layout(submission, seed):
    """ulysses_attention puts every batch, head and position back where it came from (position-encoded values, exact)"""
    # Position-encoded attention picks each query's own key, which its rank holds already: a rank that
    # attends over its shard alone gets this case right, so it counts only with the general cases right.
    with_the_work("putting every position back", lambda: _expect_attention(submission, seed, ["ulysses"]))
    for P, (case, outcome) in _case(submission, seed, "ulysses_positions").items():
        layout = case["positions"]
        for rank, record in enumerate(outcome["records"]):
            got, want = np.asarray(record["out"]), case["v"][..., layout[rank], :]
            if got.shape != want.shape:
                raise AssertionError(f"ulysses_attention on {P} ranks, rank {rank}: output shape {got.shape}, "
                                     f"expected {want.shape}")
            wrong = np.argwhere(got != want)
            if len(wrong):
                b, h, i, e = wrong[0]
                came = oracles.where_from(got[b, h, i, e])
                told = (f"came from batch {came[0]}, head {came[1]}, position {came[2]}" if came else
                        f"is {got[b, h, i, e]!r}, from no single input position")
                raise AssertionError(
                    f"ulysses_attention on {P} ranks, rank {rank}: the output at batch {b}, head {h}, position "
                    f"{layout[rank][i]} {told}; {len(wrong)} of {got.size} elements are misplaced (check which "
                    "axis each all-to-all splits and in what order the received parts are put back)")


@pytest.mark.points(2)
def check_ulysses_attention_gradients(submission, seed):
    """ulysses_attention's dq, dk and dv equal dense attention's, causal and not"""
    _expect_attention(submission, seed, ["ulysses", "ulysses_causal"], grads=True)


@pytest.mark.points(1)
def check_ulysses_makes_two_all_to_alls_each_way(submission, seed):
    """Ulysses makes exactly 2 all-to-alls forward (q, k, v stacked, then the output) and 2 backward, and nothing else"""
    with_the_work("Ulysses' traffic", lambda: _expect_attention(submission, seed, ["ulysses"], grads=True))
    for P, (case, outcome) in _case(submission, seed, "ulysses").items():
        shard = case["q"][..., :S // P, :].size
        for phase in ("forward", "backward"):
            where = f"ulysses_attention on {P} ranks, {phase}"
            logged = sum((P - 1) * sum(r[phase]["all_to_all"]) for r in outcome["records"]) // P * 8
            expect_crossed(submission, outcome["wire"], phase, gloo_bytes("all_to_all", 4 * shard * 8, P),
                           2 * gloo_messages("all_to_all", P),
                           where, f"two all-to-alls of {3 * shard} and {shard} float64 per rank", logged)
        for rank, record in enumerate(outcome["records"]):
            for phase in ("forward", "backward"):
                moved = record[phase]
                other = {k: len(v) for k, v in moved.items() if v and k != "all_to_all"}
                where = f"ulysses_attention on {P} ranks, rank {rank}, {phase}"
                assert not other, f"{where}: also made {other}; only all-to-alls move data"
                assert sorted(moved["all_to_all"]) == [shard, 3 * shard], (
                    f"{where}: all-to-alls of {moved['all_to_all']} elements, expected exactly two: q, k and v "
                    f"stacked ({3 * shard}) and the output ({shard})")


@pytest.mark.points(1)
def check_ulysses_heads_not_divisible_raises(submission, seed):
    """ulysses_attention raises ValueError when the heads do not divide by P"""
    _expect_raises(submission, seed, "ulysses_heads_indivisible", "ulysses_attention with P + 1 heads")


# --- the GPU tier ------------------------------------------------------------------------------

BLOCKWISE_TO_SDPA = 0.1  # uncalibrated: no GPU run has set it yet (docs/gpu-tier.md)
# (seq_len, block, batch, heads, head_dim), timed runs: the GPU tier's, and a dry run's on the stand-ins.
SPEED_SIZES, SPEED_RUNS = (8192, 1024, 1, 16, 64), 5
DRY_RUN_SIZES, DRY_RUN_RUNS = (256, 64, 1, 2, 16), 2
SPEED_SAMPLES = 32  # sampled output positions per timed run (rows the grader recomputes in float64)
SPEED_RTOL, SPEED_ATOL = 1e-3, 1e-4  # float32 attention over up to 8192 keys, against float64


def _speed_recheck(shape):
    """``timed.judge``'s recheck: a run's sampled outputs against ``oracles.sampled_causal_attention``
    of its seed (one computation per seed: both measurements run on the same seeds)."""
    computed = {}

    def recheck(seed, kept):
        where = gpu_timing.sample_positions(seed, math.prod(shape), SPEED_SAMPLES)
        if seed not in computed:
            computed[seed] = oracles.sampled_causal_attention(seed, shape, where)
        return timed.sample_problem(kept, computed[seed], where, rtol=SPEED_RTOL, atol=SPEED_ATOL)
    return recheck


@pytest.mark.gpu
@pytest.mark.points(2)
def check_blockwise_attention_speed(submission, seed, metrics, gpu_dry_run):
    """blockwise_attention on one GPU: time as a fraction of torch's scaled_dot_product_attention (s = 8192, float32)"""
    (s, block, b, h, d), runs = (DRY_RUN_SIZES, DRY_RUN_RUNS) if gpu_dry_run else (SPEED_SIZES, SPEED_RUNS)
    m = submission.harness("blockwise_vs_sdpa", s, block, timed.draw_seeds(runs, seed, "blockwise_attention_speed"),
                           batch=b, heads=h, head_dim=d, samples=SPEED_SAMPLES)
    recheck = _speed_recheck((b, h, s, d))
    # The floor is the DRAM traffic (q, k, v read, the output written): the causal FLOPs (about
    # 2 b h s^2 d) at the card's FP32 peak are not a limit here, as SDPA's float32 kernel
    # (memory-efficient attention) runs on tensor cores (3xTF32) and may beat it honestly.
    work = {"moved_bytes": 4 * 4 * b * h * s * d, "dry_run": gpu_dry_run}
    ours = timed.judge(m["ours"], f"blockwise_attention(block={block}, causal=True)", recheck, **work)
    sdpa = timed.judge(m["sdpa"], "scaled_dot_product_attention(is_causal=True)", recheck, **work)
    ratio = sdpa.median_s / ours.median_s
    metrics.update(ratio=round(ratio, 3), threshold=BLOCKWISE_TO_SDPA, causal_tflops=round(
        2 * b * h * s * s * d / ours.median_s / 1e12, 3), **timed.metrics(m["ours"]["record"], ours=ours, sdpa=sdpa))
    timed.expect(ratio >= BLOCKWISE_TO_SDPA, gpu_dry_run,
                 f"blockwise_attention reached {ratio:.2f} of SDPA's speed on {m['ours']['record']['name']} (needs "
                 f"{BLOCKWISE_TO_SDPA}): are the blocks large batched matrix products, with no Python loop over "
                 f"heads or rows? Measured: {ours.describe()}; {sdpa.describe()}")
