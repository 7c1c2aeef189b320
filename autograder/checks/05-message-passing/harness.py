"""Grader code that runs next to the student's ``heat_mpi`` in the sandbox: it calls, and
returns what it was given. It knows no answer.

``split_rows_table(cases)`` answers every ``split_rows`` query in one call.
``part_rank`` is a rank function of a rank job (``autograder.sandbox.ranks``): rank r
receives only its own part of every case (its block of the grid with a ghost each side,
the rest NaN: what a rank of a cluster would have), wraps the communicator in an
``AuditComm`` with synchronous sends (so a send order that deadlocks does so at any
message size, not only once MPICH stops buffering), runs one part of the lab on every
case, and emits what it returned with the audit's record. Halo exchanges are marked for
the launcher's count of what crossed, in all and per rank. The grader computes the
serial answers and compares.
"""
import numpy as np

from autograder.sandbox import ranks
from course.mpi_audit import AuditComm

COUNTED = ("halo_1d", "halo_1d_nonblocking", "halo_rows")  # parts whose exchanges the launcher counts


def split_rows_table(cases):
    """``split_rows(n, size, rank)`` for every rank of every ``(n, size)`` case, in one call."""
    import heat_mpi

    return [[tuple(heat_mpi.split_rows(n, size, rank)) for rank in range(size)] for n, size in cases]


def _events(log):
    return [{"op": e.op, "peer": e.peer, "elements": e.elements, "nbytes": e.nbytes, "tag": e.tag,
             "source": e.source, "request": e.request} for e in log]


def part_rank(comm, inputs):
    """Every case of one part, on this rank's own inputs; one record per case."""
    import heat_mpi

    part = inputs["part"]
    for k, case in enumerate(inputs["cases"]):
        audited = AuditComm(comm, synchronous_sends=True)
        if part in COUNTED:
            local = np.array(case["local"], dtype=float)
            exchange = {"halo_1d": heat_mpi.exchange_halos, "halo_1d_nonblocking": heat_mpi.exchange_halos_nonblocking,
                        "halo_rows": heat_mpi.exchange_halo_rows}[part]
            if case["counted"]:
                ranks.mark(f"{part}:{k}:start")
            exchange(audited, local)
            if case["counted"]:
                ranks.mark(f"{part}:{k}:done")
            result = local
        elif part in ("heat_1d", "heat_1d_nonblocking"):
            result = heat_mpi.run_heat_1d(audited, case["u"].copy(), case["steps"], case["alpha"],
                                          nonblocking=part == "heat_1d_nonblocking")
        elif part == "heat_2d":
            result = heat_mpi.run_heat_2d(audited, case["u"].copy(), case["steps"], case["alpha"])
        elif part == "ping_pong":
            result = heat_mpi.ping_pong(audited, case["sizes"], case["repeats"])
        else:
            raise ValueError(f"unknown part {part!r}")
        ranks.emit({"case": k, "result": _returned(result), "log": _events(audited.log)})


def _returned(result):
    """What the function returned, as the grader can receive it."""
    if result is None or isinstance(result, np.ndarray):
        return result
    if isinstance(result, (list, tuple)):
        try:
            return [float(t) for t in result]
        except (TypeError, ValueError):
            return repr(result)[:200]
    return repr(result)[:200]
