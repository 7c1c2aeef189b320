"""Grader code that runs next to the student's ``collectives`` in the sandbox.

``collective_job(ps)`` runs every algorithm of the lab, at every size, for
every p of ``ps``, in as few MPI jobs as it can: starting ranks is the slow
part on a small machine, so one job of max(ps) ranks runs them all, each p on
a communicator split off its first p ranks. On every rank, ``rank_side`` calls the student's function on
an audited communicator (``course.mpi_audit.AuditComm``, synchronous sends so
a send order that only works while MPI buffers small messages deadlocks at
any size), then MPI's own collective on the raw communicator with the same
inputs as the oracle. Each rank writes what it saw to a file per algorithm as
soon as that algorithm is done, so when a job hangs or a rank raises, the
files say which algorithm it was; the cases after it run again in a new job
without it (and, after a hang, without that algorithm's other p). A stub (``NotImplementedError`` on every rank before any
message) is recorded and skipped within the same job.

What comes back is plain data: per case, which ranks got a wrong answer
(first differing element), each rank's message and element totals, the
longest chain of communication steps (``course.mpi_audit.rounds``), and the
bytes that crossed between the ranks in the student's call, as the launcher
counted them (``count_wire``: MPICH over loopback TCP; ``course.wire``).
"""
import ast
import importlib.util
import re
from pathlib import Path

import numpy as np

from autograder.grading.checking import first_failure, run_cases, save_record
from autograder.grading.traffic import crossed_in_phases
from course import mpi
from course.mpi_audit import COLLECTIVES, AuditComm, rounds, totals

ALGORITHMS = ("bcast_binomial", "reduce_binomial", "allreduce_ring", "allreduce_recursive_doubling",
              "allgather_ring", "reduce_scatter_ring", "alltoall_pairwise")
SEED = 2026
JOB_TIMEOUT_S = 20  # a correct job (every algorithm at every p, 8 oversubscribed ranks) takes 3-4 s on 2 cores; for deadlocks


COUNTED = (1001, 250)  # the sizes of the cases whose traffic the launcher counts (the cost checks')


def cases(name, p):
    """(n, root) per case: n below p, not divisible by p, divisible, and one large enough for costs."""
    if name in ("allgather_ring", "alltoall_pairwise"):  # n: elements per rank (per block for all-to-all)
        return [(m, 0) for m in (1, 3, 250)]
    sizes = sorted({max(p - 1, 1), p + 1, 4 * p, 1001})
    if name in ("bcast_binomial", "reduce_binomial"):
        return [(n, 0) for n in sizes] + [(1001, p - 1), (p + 2, p // 2)]
    return [(n, 0) for n in sizes]


def _inputs(rank, n, p, name):
    rng = np.random.default_rng([SEED, rank, n, p])
    count = n * p if name == "alltoall_pairwise" else n
    return rng.integers(-1000, 1000, count, dtype=np.int64)


def _split_counts(n, p):
    return [len(c) for c in np.array_split(np.arange(n), p)]


def _run_case(comm, audited, student, name, n, root):
    """(what the student's function gave on this rank, what MPI gives), for one case.
    The launcher counts what crossed in the student's call alone (``course.wire.mark``)."""
    from mpi4py import MPI

    from course import wire

    p, rank = comm.Get_size(), comm.Get_rank()
    x = _inputs(rank, n, p, name)
    buf = x.copy() if rank == root or name != "bcast_binomial" else np.zeros(n, np.int64)
    counted = n in COUNTED  # a mark costs a few ms: only the cases the cost checks read
    if counted:
        wire.mark(f"{case_key(name, p, n, root)}:start", ranks=p)
    if name in ("bcast_binomial", "reduce_binomial"):
        got = getattr(student, name)(audited, buf, root=root)
    else:
        got = getattr(student, name)(audited, buf)
    if counted:
        wire.mark(f"{case_key(name, p, n, root)}:done", ranks=p)
    if name == "bcast_binomial":
        want = x.copy()
        comm.Bcast(want, root=root)
    elif name == "reduce_binomial":
        want = np.zeros(n, np.int64) if rank == root else None
        comm.Reduce(x, want, op=MPI.SUM, root=root)
    elif name in ("allreduce_ring", "allreduce_recursive_doubling"):
        want = np.zeros(n, np.int64)
        comm.Allreduce(x, want, op=MPI.SUM)
    elif name == "reduce_scatter_ring":
        counts = _split_counts(n, p)
        want = np.zeros(counts[rank], np.int64)
        comm.Reduce_scatter(x, want, recvcounts=counts, op=MPI.SUM)
    elif name == "allgather_ring":
        want = np.zeros(n * p, np.int64)
        comm.Allgather(x, want)
    else:
        want = np.zeros(n * p, np.int64)
        comm.Alltoall(x, want)
    return got, want


def case_key(name, p, n, root):
    return f"{name}@{p}:{n}:{root}"


def _compare(got, want, rank):
    """None when equal, else one line on the first difference."""
    if want is None:
        return None if got is None else f"rank {rank} returned {type(got).__name__}, expected None (not the root)"
    if got is None:
        return f"rank {rank} returned None"
    got = np.asarray(got)
    if got.shape != want.shape:
        return f"rank {rank} returned shape {got.shape}, expected {want.shape}"
    bad = np.flatnonzero(got != want)
    if bad.size:
        i = int(bad[0])
        return (f"rank {rank}: element [{i}] is {got[i]}, MPI gives {want[i]} "
                f"({bad.size} of {want.size} elements differ)")
    return None


def rank_side(comm, pending, folder):
    """Every rank: run each pending (algorithm, p) case on the first p ranks; write a file per case.

    The cases come grouped by p: for each p the first p ranks split off a
    communicator of their own (the student's functions see only it), the others
    wait at the next split."""
    from mpi4py import MPI

    import collectives as student

    rank = comm.Get_rank()
    for p in dict.fromkeys(q for _, q in pending):  # in order, once each
        group = comm.Split(0 if rank < p else MPI.UNDEFINED, rank)
        if group == MPI.COMM_NULL:
            continue
        for name in [name for name, q in pending if q == p]:
            save_record(folder, _stem((name, p)), rank, _algorithm_record(group, student, name))
        group.Free()
    return None


def _algorithm_record(comm, student, name):
    """This rank's record of one algorithm on every case of ``comm``'s size."""
    p, rank = comm.Get_size(), comm.Get_rank()
    record = {"status": "ok", "cases": []}
    dup = comm.Dup()  # a context of its own: a stray message cannot reach the next algorithm
    try:
        for n, root in cases(name, p):
            audited = AuditComm(dup, synchronous_sends=True)
            got, want = _run_case(comm, audited, student, name, n, root)
            logs = comm.gather(audited.log, root=0)
            case = {"n": n, "root": root, "mismatch": _compare(got, want, rank), "totals": totals(audited.log)}
            if rank == 0:
                case["rounds"] = rounds(logs)
            record["cases"].append(case)
    except NotImplementedError as exc:  # a stub raises on every rank before sending anything
        record = {"status": "not_implemented", "message": str(exc)}
    dup.Free()
    return record


def _stem(case):
    name, p = case
    return f"{name}@{p}"


def _merge(records):
    """One record per rank -> one per algorithm: cases with per-rank lists."""
    failure = first_failure(records)
    if failure:
        return failure
    first = records[0]
    merged = []
    for k, case in enumerate(first["cases"]):
        per_rank = [r["cases"][k] for r in records]
        merged.append({"n": case["n"], "root": case["root"], "rounds": case["rounds"],
                       "mismatches": [c["mismatch"] for c in per_rank if c["mismatch"]],
                       "totals": [c["totals"] for c in per_rank]})
    return {"status": "ok", "cases": merged}


def collective_job(ps, names=ALGORITHMS):
    """{"algorithm@p": outcome} for every algorithm on every p; see the module docstring."""
    offences = source_offences()
    outcomes = {}
    pending = []
    for p in ps:
        for name in names:
            found = offences.get(name, []) + offences.get("<module>", [])
            if found:
                outcomes[_stem((name, p))] = {"status": "refused", "message": "; ".join(found)}
            else:
                pending.append((name, p))

    jobs = []

    def start(pending, folder):
        jobs.append(mpi.run(f"{__file__}:rank_side", max(p for _, p in pending), pending, folder,
                            timeout=JOB_TIMEOUT_S, count_wire=True))
        return jobs[-1]
    # A hung algorithm would most likely hang at the next p too, and each hang costs a whole job
    # timeout: the call's own limit (150 s) holds one hang per algorithm (7 x 20 s), not one per case.
    same_algorithm = lambda hung, pending: [case for case in pending if case[0] == hung[0]]
    outcomes.update(run_cases(start, pending, lambda case: case[1], _merge, stem=_stem, name=_stem,
                              explain=_explain, after_hang=same_algorithm))
    for name, p in pending:
        for case in outcomes[_stem((name, p))].get("cases", []):
            case["wire"] = crossed_in_phases(jobs, case_key(name, p, case["n"], case["root"]), ("done",))
    return outcomes


def _explain(job):
    if job.status == "timeout":  # which ranks never finished says nothing: those above p wait at the next split
        return (f"timed out after {job.timeout_s:g} s: likely deadlock; every rank was stopped. A blocking send "
                "or receive that no other rank matches waits forever")
    return _one_line(job.explain())


def _one_line(message):
    """MPICH's errors carry a stack of internal calls: keep the call that failed and the reason."""
    lines = message.strip().splitlines()
    if len(lines) == 1:
        return message
    call = re.search(r"(MPI_\w+?)(?:_c)?\(", message)
    reason = re.sub(r"^\w+\(\d+\):\s*", "", lines[-1])
    head = lines[0].replace(", error stack:", "")
    return f"{head} in {call.group(1) if call else 'an MPI call'}: {reason}"


# --- the source: MPI's collectives, or the raw communicator, are refused ----------------

def _student_source():
    spec = importlib.util.find_spec("collectives")
    return Path(spec.origin).read_text(), Path(spec.origin).name


def source_offences():
    """{function name (or "<module>"): [what it calls that the lab forbids, with line]}.

    ``comm.Allreduce(...)`` on the audited communicator is refused when it runs;
    this finds the bypasses: MPI.COMM_WORLD, the wrapper's ``_comm``, and
    collective calls on anything. Lower-case names (``reduce``, ``gather``) count
    only on a communicator argument, so ``np.add.reduce`` is fine.
    """
    source, filename = _student_source()
    tree = ast.parse(source)
    owner, communicators = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.args.args:
                communicators.add(node.args.args[0].arg)  # every function takes the communicator first
            if node.col_offset == 0:
                for inner in ast.walk(node):
                    owner.setdefault(id(inner), node.name)
    found = {}
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES and _is_called(node, tree) and (
                node.attr[0].isupper() or (isinstance(node.value, ast.Name) and node.value.id in communicators)):
            what = f"calls .{node.attr}(), one of MPI's own collectives"
        elif isinstance(node, ast.Attribute) and node.attr in ("COMM_WORLD", "COMM_SELF", "_comm"):
            what = f"reaches past the communicator it was given ({node.attr})"
        elif isinstance(node, ast.Name) and node.id == "COMM_WORLD":
            what = "uses MPI.COMM_WORLD instead of the communicator it was given"
        if what:
            found.setdefault(owner.get(id(node), "<module>"), []).append(f"{filename}:{node.lineno} {what}")
    return found


def _is_called(attribute, tree):
    return any(isinstance(n, ast.Call) and n.func is attribute for n in ast.walk(tree))
