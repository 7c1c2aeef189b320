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

    start, stop = heat_mpi.split_rows(len(u) - 2, comm.Get_size(), comm.Get_rank())
    local = np.array(u[start:stop + 2], dtype=np.float64)
    if comm.Get_rank() > 0:
        local[0] = np.nan  # a neighbour's value belongs here: NaN shows if it never came
    if comm.Get_rank() < comm.Get_size() - 1:
        local[-1] = np.nan
    audited = AuditComm(comm, synchronous_sends=True)
    exchange = {"sendrecv": heat_mpi.exchange_halos, "nonblocking": heat_mpi.exchange_halos_nonblocking,
                "rows": heat_mpi.exchange_halo_rows}[how]
    exchange(audited, local)
    return local, [e.op for e in audited.log]
