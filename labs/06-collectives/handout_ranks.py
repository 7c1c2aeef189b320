"""What the handout runs on every rank: your collectives on an audited
communicator, next to MPI's own collective on the same inputs.

You do not need to edit this file. ``course.mpi.run(try_collectives, p, names, n, m)``
returns, per rank, ``{name: {...}}`` with whether your answer equals MPI's,
what the audit counted on this rank, and (on rank 0) the rounds of the whole job.
"""
import numpy as np

from course.mpi_audit import AuditComm, rounds

ALGORITHMS = ("bcast_binomial", "reduce_binomial", "allreduce_ring", "allreduce_recursive_doubling",
              "allgather_ring", "reduce_scatter_ring", "alltoall_pairwise")


def _yours_and_mpis(comm, audited, name, x):
    """(your result, MPI's) for one algorithm on this rank; root 0 for broadcast and reduce."""
    import collectives
    from mpi4py import MPI

    p, rank = comm.Get_size(), comm.Get_rank()
    if name == "bcast_binomial":
        buf = x.copy() if rank == 0 else np.zeros_like(x)
        want = x.copy()
        got = collectives.bcast_binomial(audited, buf, root=0)
        comm.Bcast(want, root=0)
    elif name == "reduce_binomial":
        got = collectives.reduce_binomial(audited, x.copy(), root=0)
        want = np.zeros_like(x) if rank == 0 else None
        comm.Reduce(x, want, op=MPI.SUM, root=0)
    elif name == "reduce_scatter_ring":
        got = collectives.reduce_scatter_ring(audited, x.copy())
        counts = [len(c) for c in np.array_split(x, p)]
        want = np.zeros(counts[rank], x.dtype)
        comm.Reduce_scatter(x, want, recvcounts=counts, op=MPI.SUM)
    elif name in ("allgather_ring", "alltoall_pairwise"):
        got = getattr(collectives, name)(audited, x.copy())
        want = np.zeros(x.size * p if name == "allgather_ring" else x.size, x.dtype)
        (comm.Allgather if name == "allgather_ring" else comm.Alltoall)(x, want)
    else:
        got = getattr(collectives, name)(audited, x.copy())
        want = np.zeros_like(x)
        comm.Allreduce(x, want, op=MPI.SUM)
    return got, want


def try_collectives(comm, names, n, m):
    """Each algorithm in ``names`` once: n elements (all-to-all: m per block; allgather: m per rank)."""
    out = {}
    for name in names:
        size = m * comm.size if name == "alltoall_pairwise" else m if name == "allgather_ring" else n
        x = np.random.default_rng([comm.rank, size]).integers(-100, 100, size, dtype=np.int64)
        audited = AuditComm(comm)
        try:
            got, want = _yours_and_mpis(comm, audited, name, x)
        except NotImplementedError as exc:  # a stub: every rank raises before sending anything
            out[name] = {"not_written": str(exc)}
            continue
        logs = comm.gather(audited.log, root=0)
        equal = (got is None) if want is None else (got is not None and np.array_equal(got, want))
        out[name] = {"equal": bool(equal), **audited.totals(), "rounds": rounds(logs) if comm.rank == 0 else None}
    return out
