"""Checks for lab 06: collectives built from point-to-point messages.

Inputs: every rank's int64 vector of every case is drawn in the grader from the
grading's secret seed, and each rank receives only its own (a rank job: each rank
has its own user, /tmp and /dev/shm, so the network is the only way between them).
Oracle: what MPI's collective gives on those inputs, computed in the grader with
NumPy (``oracles.py``), so results must be equal to the last bit.
Costs: their points rest on what the kernel counted, from outside the ranks: the
bytes that crossed in the student's call, in all and sent by each rank (each rank's
sockets are its own user's). The auditing communicator (``course.mpi_audit.AuditComm``)
records every message each rank sends and receives; its counts and rounds (the
longest chain of communication steps, the α term of each cost) explain a failure,
and count only where the kernel's per-rank bytes agree with them. A "collective"
that funnels everything through one rank gets the answer right and still loses
the cost points.

p in {2, 3, 4, 5, 8}, oversubscribed on however many cores there are; sizes
below p, not divisible by p, and one (1001) large enough for the cost checks.
Every algorithm the selected checks read runs in one MPI job of 8 ranks, each
p on a communicator of the job's first p ranks (see the harness), cached for
the whole grading run. Both tiers grade the same way:
this lab has no GPU part.
"""
import math

import numpy as np
import pytest

from autograder.grading import seeds
from autograder.grading.checking import expect_array, load_beside, with_the_work
from autograder.grading.submission import failure_from
from autograder.grading.traffic import MPI_HEADER_BYTES, expect_crossed, expect_sent_by_rank

oracles = load_beside(__file__, "oracles")

PS = (2, 3, 4, 5, 8)
POWERS_OF_TWO, OTHER_PS = (2, 4, 8), (3, 5)
COST_N = 1001  # the case cost checks read (n elements; for allgather and all-to-all, m = 250)
COST_M = 250
ALGORITHMS = ("bcast_binomial", "reduce_binomial", "allreduce_ring", "allreduce_recursive_doubling",
              "allgather_ring", "reduce_scatter_ring", "alltoall_pairwise")


def _selected(request):
    """The algorithms this grading run's checks read (all of them unless ``-k`` narrowed the run):
    the job runs only those, so a run of the bcast checks does not pay for the rings."""
    names = {item.name.split("[")[0].removeprefix("check_").removesuffix("_results").removesuffix("_cost")
             for item in request.session.items}
    return tuple(name for name in ALGORITHMS if name in names)


def _job(submission, seed, names):
    """The outcome of every algorithm in ``names`` on every p ("name@p"), computed once per grading
    run. The powers of two go first: an algorithm that hangs is not run at any later p (the call's
    time limit holds one hang per algorithm), and a recursive doubling that hangs only where it
    folds then still has its powers of two graded."""
    return submission.once(("collective_job", names),
                           lambda: oracles.run(submission, seed, POWERS_OF_TWO + OTHER_PS, names))


def _cases(submission, request, seed, name, ps=PS):
    """{p: the algorithm's cases}, or the error that says why it has none."""
    found = {}
    names = _selected(request)
    names = names if name in names else ALGORITHMS  # a check this file does not name as above: run them all
    for p in ps:
        outcome = _job(submission, seed, names)[f"{name}@{p}"]
        status, message = outcome["status"], outcome.get("message", "")
        if status == "ok":
            found[p] = outcome["cases"]
        elif status == "refused":
            raise AssertionError(f"{name} is refused: {message}. Build it from Send/Recv/Sendrecv on the "
                                 "communicator passed in")
        else:
            raise failure_from(outcome, f"{name} on {p} ranks")
    return found


def _expect_results(submission, request, seed, name, ps=PS):
    for p, cases in _cases(submission, request, seed, name, ps).items():
        for case in cases:
            if case["mismatches"]:
                where = f"n={case['n']}" + (f", root={case['root']}" if name.endswith("binomial") else "")
                raise AssertionError(f"{name} on {p} ranks ({where}) differs from MPI's own collective: "
                                     f"{case['mismatches'][0]}" + _hint(name, p, case["n"]))


def _hint(name, p, n):
    if name in ("allreduce_ring", "reduce_scatter_ring") and n % p:
        return f". n % p = {n % p}: do your chunks cover all n elements, split as chunk_bounds says?"
    if name == "allreduce_recursive_doubling" and p & (p - 1):
        return f". {p} is not a power of two: fold the extra ranks in first, then unfold"
    return ""


def _cost_case(cases, n, root=0, what="this case"):
    """The case the cost checks read; its costs count only where its answer is right."""
    case = next(c for c in cases if c["n"] == n and c["root"] == root)

    def answer_is_right():
        assert not case["mismatches"], f"{what}: {case['mismatches'][0]}"
    with_the_work(f"the cost of {what}", answer_is_right)
    return case


def _expect_crossed(submission, case, what, elements, messages, pattern, by_rank, within=0):
    """What crossed in the student's call, as the launcher counted it (MPICH over loopback
    TCP): ``elements`` int64 in all, in ``messages`` messages; and ``by_rank``, the elements
    the ranks sent, in some order (give or take ``within`` each), as each rank's own
    sockets' counts say."""
    expect_crossed(submission, case["wire"], "done", 8 * elements, messages, what, pattern,
                   logged=8 * sum(t["elements_sent"] for t in case["totals"]), header=MPI_HEADER_BYTES)
    expect_sent_by_rank(case["sent_by_rank"], [8 * e for e in by_rank], what, messages, slack=8 * within,
                        header=MPI_HEADER_BYTES)


def _log2_ceil(p):
    return math.ceil(math.log2(p))


# --- chunk_bounds ------------------------------------------------------------------

@pytest.mark.points(1)
def check_chunk_bounds(submission, seed):
    """chunk_bounds(n, p) splits n elements as np.array_split does (n % p != 0, n < p)"""
    rng = seeds.rng(seed, "06", "chunks")
    drawn = [(int(rng.integers(0, 5000)), int(rng.integers(1, 33))) for _ in range(3)]
    for n, p in [(10, 3), (1001, 8), (3, 5), (0, 4), (12, 4), (7, 1)] + drawn:
        got = submission.call("collectives.chunk_bounds", n, p)
        want = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(n), p)])
        expect_array(np.asarray(got), want, f"chunk_bounds({n}, {p})", exact=True)


# --- results: equal to MPI's own collective -------------------------------------------

@pytest.mark.points(2)
def check_bcast_binomial_results(submission, request, seed):
    """bcast_binomial equals MPI's Bcast (p = 2, 3, 4, 5, 8; roots 0, p-1 and p//2)"""
    _expect_results(submission, request, seed, "bcast_binomial")


@pytest.mark.points(2)
def check_reduce_binomial_results(submission, request, seed):
    """reduce_binomial equals MPI's Reduce (sum) on the root, None elsewhere"""
    _expect_results(submission, request, seed, "reduce_binomial")


@pytest.mark.points(2)
def check_allreduce_ring_results(submission, request, seed):
    """allreduce_ring equals MPI's Allreduce (sum), sizes not divisible by p and n < p"""
    _expect_results(submission, request, seed, "allreduce_ring")


@pytest.mark.points(2)
@pytest.mark.parametrize("ps", [POWERS_OF_TWO, OTHER_PS], ids=["p = 2, 4, 8", "p = 3, 5"])
def check_allreduce_recursive_doubling_results(submission, request, seed, ps):
    """allreduce_recursive_doubling equals MPI's Allreduce (sum)"""
    _expect_results(submission, request, seed, "allreduce_recursive_doubling", ps)


@pytest.mark.points(2)
def check_allgather_ring_results(submission, request, seed):
    """allgather_ring equals MPI's Allgather"""
    _expect_results(submission, request, seed, "allgather_ring")


@pytest.mark.points(2)
def check_reduce_scatter_ring_results(submission, request, seed):
    """reduce_scatter_ring equals MPI's Reduce_scatter with counts from np.array_split"""
    _expect_results(submission, request, seed, "reduce_scatter_ring")


@pytest.mark.points(2)
def check_alltoall_pairwise_results(submission, request, seed):
    """alltoall_pairwise equals MPI's Alltoall"""
    _expect_results(submission, request, seed, "alltoall_pairwise")


# --- costs: what the kernel counted, each rank's own; the audit explains ------------------

def _bcast_sends(p, n):
    """Elements each rank of a binomial broadcast sends (renumbered so the root is 0), sorted:
    rank v passes the vector on at every stride below its lowest set bit (the root: below p)."""
    sends = []
    for v in range(p):
        low = v & -v if v else 1 << p.bit_length()
        sends.append(n * sum(1 for k in range(p.bit_length()) if (1 << k) < low and v + (1 << k) < p))
    return sorted(sends)


def _doubling_sends(p, n):
    """Elements each rank of recursive doubling sends, sorted: whatever ranks fold in (p - q of
    them send once), the q others exchange log2 q whole vectors, and p - q of those unfold once more."""
    q = 1 << (p.bit_length() - 1)
    steps = int(math.log2(q))
    return sorted([n] * (p - q) + [(steps + 1) * n] * (p - q) + [steps * n] * (2 * q - p))


@pytest.mark.points(1)
def check_bcast_binomial_cost(submission, request, seed):
    """bcast_binomial: each rank sends as a binomial tree's rank does (kernel's count); ceil(log2 p) rounds"""
    for p, cases in _cases(submission, request, seed, "bcast_binomial").items():
        for root in (0, p - 1):
            case = _cost_case(cases, COST_N, root, f"bcast_binomial on {p} ranks, root {root}")
            sent = sum(t["messages_sent"] for t in case["totals"])
            received = [t["messages_received"] for t in case["totals"]]
            what = f"bcast_binomial on {p} ranks, root {root}"
            assert sent == p - 1, f"{what}: {sent} messages in all, a broadcast needs exactly p - 1 = {p - 1}"
            others = [r for r in range(p) if r != root]
            assert all(received[r] == 1 for r in others) and received[root] == 0, (
                f"{what}: messages received per rank {received}; each rank but the root should receive once")
            assert case["rounds"] == _log2_ceil(p), (
                f"{what}: {case['rounds']} rounds (longest chain of messages), a binomial tree takes "
                f"ceil(log2 p) = {_log2_ceil(p)}: every rank that has the data must pass it on in every round")
            _expect_crossed(submission, case, what, (p - 1) * COST_N, p - 1, "p - 1 copies of the vector",
                            by_rank=_bcast_sends(p, COST_N))


@pytest.mark.points(1)
def check_reduce_binomial_cost(submission, request, seed):
    """reduce_binomial: every other rank sends once (kernel's count); no rank receives more than ceil(log2 p) messages"""
    for p, cases in _cases(submission, request, seed, "reduce_binomial").items():
        for root in (0, p - 1):
            case = _cost_case(cases, COST_N, root, f"reduce_binomial on {p} ranks, root {root}")
            sent = [t["messages_sent"] for t in case["totals"]]
            received = [t["messages_received"] for t in case["totals"]]
            what = f"reduce_binomial on {p} ranks, root {root}"
            assert sent[root] == 0 and all(sent[r] == 1 for r in range(p) if r != root), (
                f"{what}: messages sent per rank {sent}; each rank but the root sends its partial sum once")
            assert max(received) <= _log2_ceil(p), (
                f"{what}: a rank receives {max(received)} messages (per rank: {received}); in a binomial tree "
                f"none receives more than ceil(log2 p) = {_log2_ceil(p)}: partial sums must be combined on the way")
            _expect_crossed(submission, case, what, (p - 1) * COST_N, p - 1, "p - 1 partial sums of the vector",
                            by_rank=[0] + [COST_N] * (p - 1))


@pytest.mark.points(2)
def check_allreduce_ring_cost(submission, request, seed, metrics):
    """allreduce_ring: 2(p-1)/p * n elements sent by every rank (kernel's count), 2(p-1) messages and rounds"""
    for p, cases in _cases(submission, request, seed, "allreduce_ring").items():
        case = _cost_case(cases, COST_N, what=f"allreduce_ring on {p} ranks")
        messages = [t["messages_sent"] for t in case["totals"]]
        elements = [t["elements_sent"] for t in case["totals"]]
        ideal = 2 * (p - 1) / p * COST_N
        metrics[f"p{p}_elements_per_rank"] = max(elements)
        what = f"allreduce_ring on {p} ranks, n = {COST_N}"
        assert all(m == 2 * (p - 1) for m in messages), (
            f"{what}: messages sent per rank {messages}, the ring sends 2(p-1) = {2 * (p - 1)} from every rank "
            "(p-1 reduce-scatter steps, p-1 allgather steps)")
        assert all(abs(e - ideal) <= 2 for e in elements), (
            f"{what}: elements sent per rank {elements}, the ring sends 2(p-1)/p * n = {ideal:.1f} "
            "(one chunk of about n/p per step)")
        assert case["rounds"] == 2 * (p - 1), f"{what}: {case['rounds']} rounds, expected 2(p-1) = {2 * (p - 1)}"
        _expect_crossed(submission, case, what, 2 * (p - 1) * COST_N, 2 * p * (p - 1),
                        "every rank sending all chunks but one, twice", by_rank=[ideal] * p, within=2)


@pytest.mark.points(1)
def check_allreduce_recursive_doubling_cost(submission, request, seed):
    """allreduce_recursive_doubling: log2 p rounds of whole vectors (+2 for the fold when p is not a power of two)"""
    for p, cases in _cases(submission, request, seed, "allreduce_recursive_doubling").items():
        case = _cost_case(cases, COST_N, what=f"allreduce_recursive_doubling on {p} ranks")
        q = 1 << (p.bit_length() - 1)
        want_rounds = int(math.log2(q)) + (0 if q == p else 2)
        messages = [t["messages_sent"] for t in case["totals"]]
        elements = [t["elements_sent"] for t in case["totals"]]
        what = f"allreduce_recursive_doubling on {p} ranks, n = {COST_N}"
        assert max(messages) <= int(math.log2(q)) + 1, (
            f"{what}: messages sent per rank {messages}; at most log2 {q} (+1 for the unfold) each")
        assert all(e == m * COST_N for e, m in zip(elements, messages)), (
            f"{what}: elements sent per rank {elements} for {messages} messages; every message is the whole vector")
        assert case["rounds"] == want_rounds, (
            f"{what}: {case['rounds']} rounds, expected {want_rounds}"
            + ("" if q == p else f" (log2 {q} among the largest power of two, +1 fold, +1 unfold)"))
        whole = q * int(math.log2(q)) + 2 * (p - q)  # whole vectors: the exchanges, then the fold and the unfold
        _expect_crossed(submission, case, what, whole * COST_N, whole, f"{whole} whole vectors",
                        by_rank=_doubling_sends(p, COST_N))


@pytest.mark.points(1)
def check_allgather_ring_cost(submission, request, seed):
    """allgather_ring: (p - 1) m elements from every rank (kernel's count), p - 1 messages and rounds"""
    _ring_cost(submission, request, seed, "allgather_ring", COST_M, lambda p: (p - 1) * COST_M, exact=True)


@pytest.mark.points(1)
def check_reduce_scatter_ring_cost(submission, request, seed):
    """reduce_scatter_ring: about (p-1)/p * n elements from every rank (kernel's count), p - 1 messages and rounds"""
    _ring_cost(submission, request, seed, "reduce_scatter_ring", COST_N, lambda p: (p - 1) / p * COST_N,
               exact=False)


@pytest.mark.points(1)
def check_alltoall_pairwise_cost(submission, request, seed):
    """alltoall_pairwise: p - 1 blocks from every rank (kernel's count), in p - 1 messages"""
    _ring_cost(submission, request, seed, "alltoall_pairwise", COST_M, lambda p: (p - 1) * COST_M, exact=True,
               check_rounds=False)


def _ring_cost(submission, request, seed, name, n, ideal_elements, exact, check_rounds=True):
    for p, cases in _cases(submission, request, seed, name).items():
        case = _cost_case(cases, n, what=f"{name} on {p} ranks")
        messages = [t["messages_sent"] for t in case["totals"]]
        elements = [t["elements_sent"] for t in case["totals"]]
        ideal = ideal_elements(p)
        what = f"{name} on {p} ranks, n = {n}"
        assert all(m == p - 1 for m in messages), (
            f"{what}: messages sent per rank {messages}, expected p - 1 = {p - 1} from every rank")
        assert all(abs(e - ideal) <= (0 if exact else 1) for e in elements), (
            f"{what}: elements sent per rank {elements}, expected {ideal:g} from every rank")
        if check_rounds:
            assert case["rounds"] == p - 1, f"{what}: {case['rounds']} rounds, expected p - 1 = {p - 1}"
        _expect_crossed(submission, case, what, round(p * ideal), p * (p - 1), f"{ideal:g} elements from every rank",
                        by_rank=[ideal] * p, within=0 if exact else 1)
