"""Grader code that runs next to the student's ``collectives`` in the sandbox: it calls,
and returns what it was given. It knows no answer.

``collective_rank`` is a rank function of a rank job (``autograder.sandbox.ranks``):
rank r receives only its own vectors, of every case it takes part in, grouped by the
number of ranks p. For each p the first p ranks split off a communicator of their own
(the student's functions see only it); the others wait at the next split. On every case
it calls the student's function on an audited communicator
(``course.mpi_audit.AuditComm``, synchronous sends, so a send order that only works
while MPI buffers small messages deadlocks at any size), marks the call's start and end
for the launcher's count of what crossed, and emits what the function returned and what
the audit recorded. The grader computes MPI's answer from every rank's inputs and
compares. A stub (``NotImplementedError`` on every rank before any message) is reported
for its algorithm and the job goes on to the next.
"""
from autograder.sandbox import ranks
from course.mpi_audit import AuditComm


def collective_rank(comm, parts):
    """Every rank: each pending algorithm at each p, in order; one record per (algorithm, p)."""
    from mpi4py import MPI

    import collectives as student

    rank = comm.Get_rank()
    for p in dict.fromkeys(part["p"] for part in parts):  # in order, once each
        group = comm.Split(0 if rank < p else MPI.UNDEFINED, rank)
        if group == MPI.COMM_NULL:
            continue
        for part in (part for part in parts if part["p"] == p and "cases" in part):
            ranks.emit({"case": part["case"], **_algorithm(group, student, part)})
        group.Free()


def _algorithm(comm, student, part):
    """This rank's record of one algorithm on every case of its size."""
    name, key = part["name"], part["case"]
    record = {"status": "ok", "cases": []}
    dup = comm.Dup()  # a context of its own: a stray message cannot reach the next algorithm
    try:
        for case in part["cases"]:
            audited = AuditComm(dup, synchronous_sends=True)
            where = f"{key}:{case['n']}:{case['root']}"
            if case["counted"]:  # a mark costs a few ms: only the cases the cost checks read
                ranks.mark(f"{where}:start", ranks=comm.Get_size())
            if name in ("bcast_binomial", "reduce_binomial"):
                got = getattr(student, name)(audited, case["x"], root=case["root"])
            else:
                got = getattr(student, name)(audited, case["x"])
            if case["counted"]:
                ranks.mark(f"{where}:done", ranks=comm.Get_size())
            record["cases"].append({"n": case["n"], "root": case["root"], "got": _returned(got),
                                    "log": [_plain(event) for event in audited.log]})
    except NotImplementedError as exc:  # a stub raises on every rank before sending anything
        record = {"status": "not_implemented", "message": str(exc)}
    dup.Free()
    return record


def _returned(got):
    """What the function returned, as the grader can receive it: an array, None, or what it was."""
    import numpy as np

    if got is None or isinstance(got, np.ndarray):
        return got
    try:
        array = np.asarray(got)
    except Exception:  # noqa: BLE001 - anything the student returns is reported, not raised
        return repr(got)[:200]
    return repr(got)[:200] if array.dtype.hasobject else array


def _plain(event):
    return [event.op, event.peer, event.elements, event.nbytes, event.tag, event.source, event.recv_elements,
            event.request]
