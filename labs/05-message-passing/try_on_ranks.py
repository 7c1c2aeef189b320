"""Rank-side helpers for the handout (nothing to write here).

``course.mpi.run`` can only start functions that live in a ``.py`` module and
sends back what each rank *returns*; ``exchange_halos`` and friends work in
place and return nothing. These wrappers build a rank's block with NaN ghosts,
run one exchange on a communicator that records each call, and return the
block and the names of the calls, in order.
"""
import numpy as np

from course.mpi_audit import AuditComm


def halos_after_exchange(comm, u, how="sendrecv"):
    """This rank's block of ``u`` (ghosts included) after one exchange, and the calls it made.

    ``how``: ``"sendrecv"`` (``exchange_halos``), ``"nonblocking"``
    (``exchange_halos_nonblocking``) or ``"rows"`` (``exchange_halo_rows``, for a 2D ``u``).
    """
    import heat_mpi

    me, ranks = comm.Get_rank(), comm.Get_size()
    first, last = heat_mpi.split_rows(u.shape[0] - 2, ranks, me)
    with_ghosts = u[first:last + 2].astype(np.float64)  # a copy: owned points (rows) and one ghost each side
    if me > 0:
        with_ghosts[0] = np.nan  # a neighbour's value belongs here: NaN shows if it never came
    if me < ranks - 1:
        with_ghosts[-1] = np.nan
    audited = AuditComm(comm, synchronous_sends=True)
    exchange = {"sendrecv": heat_mpi.exchange_halos, "nonblocking": heat_mpi.exchange_halos_nonblocking,
                "rows": heat_mpi.exchange_halo_rows}[how]
    exchange(audited, with_ghosts)
    return with_ghosts, [e.op for e in audited.log]
