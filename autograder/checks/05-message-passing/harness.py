"""Grader code that runs next to the student's ``heat_mpi`` in the sandbox.

``run_on_ranks(part, n, cases)`` (in the sandboxed child) starts one MPI job of
``n`` ranks with ``course.mpi`` and returns what every rank returned.
``rank_side`` (on every rank) imports the student's module, wraps the
communicator in an ``AuditComm`` with synchronous sends — so a send order that
deadlocks does so at any message size, not only once MPICH stops buffering —
runs one part of the lab on every case, and returns plain data: arrays and
the audit log as dicts.

Every part is its own job, so a deadlock in one (which costs its timeout)
takes no other part's points with it; all cases of a part share one job
because starting ranks is the slow bit.
"""
import numpy as np

from autograder.grading.traffic import crossed_in_phases
from course import mpi
from course.mpi_audit import AuditComm

LAUNCH_TIMEOUT_S = 15  # per job; lab.toml's timeout_s is larger, so the launcher's report comes back


def split_rows_table(cases):
    """``split_rows(n, size, rank)`` for every rank of every ``(n, size)`` case, in one call."""
    import heat_mpi

    return [[tuple(heat_mpi.split_rows(n, size, rank)) for rank in range(size)] for n, size in cases]


COUNTED = ("halo_1d", "halo_1d_nonblocking", "halo_rows")  # parts whose exchanges the launcher counts
COUNTED_RANKS = 4  # on this many ranks only: MPICH over TCP costs a few tenths of a second more per job


def run_on_ranks(part, n, cases):
    """Every rank's result of ``rank_side(part, cases)`` on ``n`` ranks; raises if the job did not finish.
    For a halo exchange on ``COUNTED_RANKS``, rank 0's result also holds the bytes that crossed
    in each case's exchange (``"wire"``), as the launcher counted them (MPICH over loopback TCP)."""
    counted = part in COUNTED and n == COUNTED_RANKS
    job = mpi.run(f"{__file__}:rank_side", n, part, cases, timeout=LAUNCH_TIMEOUT_S, count_wire=counted).check()
    results = job.results
    if counted:
        results[0]["wire"] = [crossed_in_phases([job], f"{part}:{k}", ("done",)) for k in range(len(cases))]
    return results


def _events(log):
    return [{"op": e.op, "peer": e.peer, "elements": e.elements, "nbytes": e.nbytes, "tag": e.tag,
             "source": e.source, "request": e.request} for e in log]


def _split(n, size, rank):
    # The grader's own block decomposition, so halo checks do not depend on the student's split_rows.
    # Counted out one row at a time, round-robin: rank r ends up with one of every size-th row.
    sizes = [len(range(r, n, size)) for r in range(size)]
    offset = sum(sizes[:rank])
    return offset, offset + sizes[rank]


def _with_poisoned_ghosts(u, comm):
    """This rank's block of the interior of ``u`` with its two ghosts (cells or rows): NaN
    where a neighbour must write, the boundary value at the edges of the domain."""
    lo, hi = _split(len(u) - 2, comm.size, comm.rank)
    ghosted = np.take(u, range(lo, hi + 2), axis=0).astype(float)  # owned part and the ghost each side
    if comm.rank > 0:
        ghosted[0] = np.nan
    if comm.rank < comm.size - 1:
        ghosted[-1] = np.nan
    return ghosted


def rank_side(comm, part, cases):
    import heat_mpi

    from course import wire

    out = {"results": [], "logs": []}
    for k, case in enumerate(cases):
        audited = AuditComm(comm, synchronous_sends=True)
        if part in COUNTED:  # course.wire.mark is a no-op in a job that is not counted
            local = _with_poisoned_ghosts(case["u"], comm)
            exchange = {"halo_1d": heat_mpi.exchange_halos, "halo_1d_nonblocking": heat_mpi.exchange_halos_nonblocking,
                        "halo_rows": heat_mpi.exchange_halo_rows}[part]
            wire.mark(f"{part}:{k}:start")
            exchange(audited, local)
            wire.mark(f"{part}:{k}:done")
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
        out["results"].append(None if result is None else
                              np.asarray(result) if isinstance(result, np.ndarray) else result)
        out["logs"].append(_events(audited.log))
    return out
