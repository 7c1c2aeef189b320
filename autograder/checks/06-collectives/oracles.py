"""Lab 06's answers, in the grader: every rank's inputs, MPI's result of each collective,
and what each algorithm may cost. Nothing here reaches the sandbox.

``run(submission, seed, ps, names)`` draws every rank's int64 vector of every case from
the grading's secret seed (``autograder.grading.seeds``), gives each rank only its own
(a rank job: ``autograder.grading.rank_jobs``; ``harness.collective_rank`` calls the
student's function), and compares each rank's result with what MPI's collective
gives, computed here with NumPy from every rank's inputs. It returns, per
"algorithm@p", the cases with each rank's mismatch (if any), the audit's totals and
rounds (the in-process record, for the cost checks' feedback), and the bytes each
rank sent in the student's call as the kernel counted them (MPICH over loopback TCP,
each rank's sockets its own user's), which the cost checks' points rest on.
"""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np

from autograder.grading import seeds
from autograder.grading.rank_jobs import crossed_in_phases, per_rank_in_phase, run_cases
from course.mpi_audit import COLLECTIVES, Event, rounds, totals

ALGORITHMS = ("bcast_binomial", "reduce_binomial", "allreduce_ring", "allreduce_recursive_doubling",
              "allgather_ring", "reduce_scatter_ring", "alltoall_pairwise")
JOB_TIMEOUT_S = 20  # a correct job (every algorithm at every p, 8 oversubscribed ranks) takes 3-4 s on 2 cores
COUNTED = (1001, 250)  # the sizes of the cases whose traffic the launcher counts (the cost checks')


def cases(name: str, p: int) -> list[tuple[int, int]]:
    """(n, root) per case: n below p, not divisible by p, divisible, and one large enough for costs."""
    if name in ("allgather_ring", "alltoall_pairwise"):  # n: elements per rank (per block for all-to-all)
        return [(m, 0) for m in (1, 3, 250)]
    sizes = sorted({max(p - 1, 1), p + 1, 4 * p, 1001})
    if name in ("bcast_binomial", "reduce_binomial"):
        return [(n, 0) for n in sizes] + [(1001, p - 1), (p + 2, p // 2)]
    return [(n, 0) for n in sizes]


def inputs(seed: int, name: str, p: int, n: int, root: int) -> list[np.ndarray]:
    """Every rank's vector of one case, drawn from the grading's seed."""
    count = n * p if name == "alltoall_pairwise" else n
    return [seeds.rng(seed, "06", name, p, n, root, rank).integers(-1000, 1000, count, dtype=np.int64)
            for rank in range(p)]


def split_counts(n: int, p: int) -> list[int]:
    return [len(c) for c in np.array_split(np.arange(n), p)]


def expected(name: str, xs: list[np.ndarray], root: int) -> list:
    """What MPI's own collective leaves on each rank (None where it leaves nothing)."""
    p, total = len(xs), np.sum(xs, axis=0)
    if name == "bcast_binomial":
        return [xs[root].copy() for _ in range(p)]
    if name == "reduce_binomial":
        return [total if rank == root else None for rank in range(p)]
    if name in ("allreduce_ring", "allreduce_recursive_doubling"):
        return [total for _ in range(p)]
    if name == "reduce_scatter_ring":
        return np.split(total, np.cumsum(split_counts(total.size, p))[:-1])
    if name == "allgather_ring":
        return [np.concatenate(xs) for _ in range(p)]
    blocks = [np.split(x, p) for x in xs]  # all-to-all: rank r gets block r of every rank, in rank order
    return [np.concatenate([blocks[source][rank] for source in range(p)]) for rank in range(p)]


def compare(got, want, rank: int) -> str | None:
    """None when equal, else one line on the first difference."""
    if want is None:
        return None if got is None else f"rank {rank} returned {type(got).__name__}, expected None (not the root)"
    if got is None:
        return f"rank {rank} returned None"
    if isinstance(got, str):
        return f"rank {rank} returned {got}, expected an array"
    got = np.asarray(got)
    if got.shape != want.shape:
        return f"rank {rank} returned shape {got.shape}, expected {want.shape}"
    bad = np.flatnonzero(got != want)
    if bad.size:
        i = int(bad[0])
        return (f"rank {rank}: element [{i}] is {got[i]}, MPI gives {want[i]} "
                f"({bad.size} of {want.size} elements differ)")
    return None


def key(name: str, p: int) -> str:
    return f"{name}@{p}"


def run(submission, seed: int, ps, names=ALGORITHMS) -> dict:
    """{"algorithm@p": outcome} for every algorithm on every p; see the module docstring."""
    offences = source_offences(submission.path / "collectives.py")
    outcomes, pending = {}, []
    for p in ps:
        for name in names:
            found = offences.get(name, []) + offences.get("<module>", [])
            if found:
                outcomes[key(name, p)] = {"status": "refused", "message": "; ".join(found)}
            else:
                pending.append((name, p))
    drawn = {(name, p, n, root): inputs(seed, name, p, n, root) for name, p in pending for n, root in cases(name, p)}

    def part_of(case, rank):
        name, p = case
        if rank >= p:
            return {"p": p}  # it splits off no communicator for this p, but must call Split
        own = []
        for n, root in cases(name, p):
            x = drawn[(name, p, n, root)][rank]
            buffer = x.copy() if rank == root or name != "bcast_binomial" else np.zeros(n, np.int64)
            own.append({"n": n, "root": root, "x": buffer, "counted": n in COUNTED})
        return {"name": name, "p": p, "cases": own}

    # A hung algorithm would most likely hang at the next p too, and each hang costs a whole job
    # timeout: the call's own limit holds one hang per algorithm (7 x 20 s), not one per case.
    same_algorithm = lambda hung, rest: [case for case in rest if case[0] == hung[0]]  # noqa: E731
    found = run_cases(submission, "mpi", "collective_rank", pending, lambda case: case[1], part_of,
                      key=lambda case: key(*case), timeout=JOB_TIMEOUT_S, count_wire=True,
                      after_hang=same_algorithm, explain=_explain, everyone=True)
    for (name, p), outcome in ((case, found[key(*case)]) for case in pending):
        outcomes[key(name, p)] = _judged(name, p, outcome, drawn)
    return outcomes


def _judged(name: str, p: int, outcome: dict, drawn: dict) -> dict:
    """The ranks' records of one algorithm at one p, compared with MPI's answers."""
    if outcome["status"] != "ok":
        return {"status": outcome["status"], "message": outcome["message"]}
    records = outcome["records"]
    stub = next((r for r in records if r["status"] != "ok"), None)
    if stub:
        return {"status": stub["status"], "message": stub["message"]}
    job, judged = outcome["job"], []
    for k, (n, root) in enumerate(cases(name, p)):
        per_rank = [r["cases"][k] for r in records]
        want = expected(name, drawn[(name, p, n, root)], root)
        logs = [[Event(*event) for event in c["log"]] for c in per_rank]
        where = f"{key(name, p)}:{n}:{root}"
        sent = per_rank_in_phase(job, where, "done")  # the job's first p ranks ran this case
        judged.append({"n": n, "root": root, "rounds": rounds(logs),
                       "mismatches": [m for m in (compare(c["got"], w, rank)
                                                  for rank, (c, w) in enumerate(zip(per_rank, want))) if m],
                       "totals": [totals(log) for log in logs],
                       "wire": crossed_in_phases(job, where, ("done",)),
                       "sent_by_rank": None if sent is None else sent[:p]})
    return {"status": "ok", "cases": judged}


def _explain(job) -> str:
    if job.status == "timeout":  # which ranks never finished says nothing: those above p wait at the next split
        return (f"timed out after {job.timeout_s:g} s: likely deadlock; every rank was stopped. A blocking send "
                "or receive that no other rank matches waits forever")
    return _one_line(job.explain())


def _one_line(message: str) -> str:
    """MPICH's errors carry a stack of internal calls: keep the call that failed and the reason."""
    import re

    lines = message.strip().splitlines()
    if len(lines) == 1:
        return message
    call = re.search(r"(MPI_\w+?)(?:_c)?\(", message)
    reason = re.sub(r"^\w+\(\d+\):\s*", "", lines[-1])
    head = lines[0].replace(", error stack:", "")
    return f"{head} in {call.group(1) if call else 'an MPI call'}: {reason}"


# --- the source: MPI's collectives, or the raw communicator, are refused ----------------

def source_offences(path: Path) -> dict:
    """{function name (or "<module>"): [what it calls that the lab forbids, with line]}, read
    here from the submission's file (it never runs for this).

    ``comm.Allreduce(...)`` on the audited communicator is refused when it runs;
    this finds the bypasses: MPI.COMM_WORLD, the wrapper's ``_comm``, and
    collective calls on anything. Lower-case names (``reduce``, ``gather``) count
    only on a communicator argument, so ``np.add.reduce`` is fine.
    """
    try:
        tree = ast.parse(Path(path).read_text(errors="replace"))
    except (OSError, SyntaxError):
        return {}  # a file that does not parse fails at import, with its own message
    owner, communicators = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.args.args:
                communicators.add(node.args.args[0].arg)  # every function takes the communicator first
            if node.col_offset == 0:
                for inner in ast.walk(node):
                    owner.setdefault(id(inner), node.name)
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    found, filename = {}, Path(path).name
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES and id(node) in called and (
                node.attr[0].isupper() or (isinstance(node.value, ast.Name) and node.value.id in communicators)):
            what = f"calls .{node.attr}(), one of MPI's own collectives"
        elif isinstance(node, ast.Attribute) and node.attr in ("COMM_WORLD", "COMM_SELF", "_comm"):
            what = f"reaches past the communicator it was given ({node.attr})"
        elif isinstance(node, ast.Name) and node.id == "COMM_WORLD":
            what = "uses MPI.COMM_WORLD instead of the communicator it was given"
        if what:
            found.setdefault(owner.get(id(node), "<module>"), []).append(f"{filename}:{node.lineno} {what}")
    return found
