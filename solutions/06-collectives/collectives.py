"""Lab 06 — collectives from point-to-point messages.

MPI's collectives (``Bcast``, ``Reduce``, ``Allreduce`` …) are built from
point-to-point messages by a handful of classic algorithms. Here you write
them yourself with ``Send``, ``Recv`` and ``Sendrecv`` only:

1. ``chunk_bounds`` — where an array of ``n`` elements splits into ``p``
   nearly equal chunks (the split every ring algorithm below uses);
2. ``bcast_binomial`` and ``reduce_binomial`` — binomial trees, ⌈log2 p⌉ rounds;
3. ``reduce_scatter_ring``, ``allgather_ring`` and ``allreduce_ring`` — the
   bandwidth-optimal ring: p − 1 steps of reduce-scatter, then p − 1 of allgather;
4. ``allreduce_recursive_doubling`` — log2 p rounds of whole-vector exchanges,
   with the fold that makes it work when p is not a power of two;
5. ``alltoall_pairwise`` — every rank sends a different block to every other.

Every function takes the communicator first and NumPy arrays; the reduction is
a sum. Only ``Send``, ``Recv``, ``Sendrecv`` (and ``Isend``/``Irecv``) on the
communicator you are given: the grader wraps it in an auditing communicator
(``course.mpi_audit.AuditComm``) that records every message, checks the counts
against each algorithm's cost, and refuses MPI's own collectives. Run the
checks with ``k2c grade 06`` (from the repository root).
"""
import numpy as np

# --- 1. Splitting n elements into p chunks --------------------------------------


def chunk_bounds(n, p):
    """Offsets ``[b_0, b_1, ..., b_p]`` of ``p`` contiguous chunks of ``range(n)``.

    Chunk ``i`` is ``[b_i, b_{i+1})``. The first ``n % p`` chunks hold one
    element more than the others, as with ``np.array_split``; chunks may be
    empty when ``n < p``. ``b_0 = 0`` and ``b_p = n``.
    """
    # BEGIN SOLUTION: Each offset adds up the sizes of the chunks before it; only the first few chunks are one element longer.
    base, extra = divmod(n, p)
    return [i * base + min(i, extra) for i in range(p + 1)]
    # END SOLUTION


# --- 2. Binomial trees -------------------------------------------------------------


def bcast_binomial(comm, buf, root=0):
    """Broadcast ``buf`` from ``root`` to every rank, in place, along a binomial tree.

    On ``root`` ``buf`` holds the data; elsewhere it is an array of the same
    shape and dtype to receive into. Returns ``buf``. Ranks are renumbered
    so the root is 0 (``(rank - root) % p``); in round k every rank that has
    the data sends it to the rank 2**k further on: ⌈log2 p⌉ rounds, p − 1
    messages in all, each rank receives once.
    """
    # BEGIN SOLUTION: Renumber so the root is 0; receive once from the rank your lowest set bit points to, then send at smaller strides.
    p, rank = comm.Get_size(), comm.Get_rank()
    v = (rank - root) % p
    mask = 1
    while mask < p:  # find my parent: the lowest set bit of v
        if v & mask:
            comm.Recv(buf, source=(v - mask + root) % p, tag=0)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:  # then pass it on to my children, farthest first
        if v + mask < p:
            comm.Send(buf, dest=(v + mask + root) % p, tag=0)
        mask >>= 1
    return buf
    # END SOLUTION


def reduce_binomial(comm, sendbuf, root=0):
    """The elementwise sum of every rank's ``sendbuf``, on ``root`` only.

    Returns a new array on ``root`` and ``None`` on the other ranks; ``sendbuf``
    is left as it was. The broadcast's tree, run backwards: in round k a rank
    whose bit k is set sends its partial sum to the rank 2**k below it and is done.
    """
    # BEGIN SOLUTION: The broadcast's tree run backwards: add in partial sums at growing strides, then send yours once and stop.
    p, rank = comm.Get_size(), comm.Get_rank()
    v = (rank - root) % p
    partial = np.array(sendbuf, copy=True)
    incoming = np.empty_like(partial)
    mask = 1
    while mask < p:
        if v & mask:
            comm.Send(partial, dest=(v - mask + root) % p, tag=1)
            return None
        if v + mask < p:
            comm.Recv(incoming, source=(v + mask + root) % p, tag=1)
            np.add(partial, incoming, out=partial)
        mask <<= 1
    return partial
    # END SOLUTION


# --- 3. The ring -----------------------------------------------------------------------


def _reduce_scatter_steps(comm, buf, bounds, scratch, shift=0):
    """p − 1 ring steps that leave in ``buf`` the full sum of chunk ``(rank + 1 - shift) % p``.

    In step s rank r sends chunk ``(r - s - shift) % p`` (its partial sum so far)
    to the right and adds the chunk ``(r - s - shift - 1) % p`` arriving from the left.
    """
    # BEGIN SOLUTION: Each step, pass one chunk to the right and add the chunk from the left into place, with no temporary copies.
    p, rank = comm.Get_size(), comm.Get_rank()
    right, left = (rank + 1) % p, (rank - 1) % p
    for step in range(p - 1):
        send, recv = (rank - step - shift) % p, (rank - step - shift - 1) % p
        incoming = scratch[:bounds[recv + 1] - bounds[recv]]
        comm.Sendrecv(buf[bounds[send]:bounds[send + 1]], dest=right, sendtag=2,
                      recvbuf=incoming, source=left, recvtag=2)
        mine = buf[bounds[recv]:bounds[recv + 1]]
        np.add(mine, incoming, out=mine)
    # END SOLUTION


def _allgather_steps(comm, buf, bounds):
    """p − 1 ring steps that spread chunk ``(rank + 1) % p`` of each rank to all.

    In step s rank r forwards chunk ``(r - s + 1) % p`` to the right and receives
    chunk ``(r - s) % p`` from the left straight into its place in ``buf``.
    """
    # BEGIN SOLUTION: Each step, forward the chunk you completed or received last, receiving straight into its slot.
    p, rank = comm.Get_size(), comm.Get_rank()
    right, left = (rank + 1) % p, (rank - 1) % p
    for step in range(p - 1):
        send, recv = (rank - step + 1) % p, (rank - step) % p
        comm.Sendrecv(buf[bounds[send]:bounds[send + 1]], dest=right, sendtag=3,
                      recvbuf=buf[bounds[recv]:bounds[recv + 1]], source=left, recvtag=3)
    # END SOLUTION


def allreduce_ring(comm, x):
    """The elementwise sum of every rank's 1-D ``x``, on every rank (a new array).

    Reduce-scatter, then allgather, around the ring over the chunks of
    ``chunk_bounds(x.size, p)``: 2(p − 1) messages per rank, each about n/p
    elements, so every rank sends about 2(p − 1)/p · n elements whatever p is.
    """
    # BEGIN SOLUTION: On one copy of the input, with one scratch chunk: the reduce-scatter steps, then the allgather steps.
    p = comm.Get_size()
    total = np.array(x, copy=True)
    bounds = chunk_bounds(total.size, p)
    scratch = np.empty(bounds[1] - bounds[0], dtype=total.dtype)  # chunk 0 is a largest one
    _reduce_scatter_steps(comm, total, bounds, scratch)
    _allgather_steps(comm, total, bounds)
    return total
    # END SOLUTION


def reduce_scatter_ring(comm, x):
    """Chunk ``rank`` of the elementwise sum of every rank's 1-D ``x``.

    Chunks come from ``chunk_bounds(x.size, p)``, so rank r returns
    ``sum(x)[b_r:b_{r+1}]`` — what ``MPI.Reduce_scatter`` returns with those
    counts. p − 1 messages per rank, (p − 1)/p · n elements.
    """
    # BEGIN SOLUTION: Reuse the ring's reduce-scatter steps with the shift that leaves your own chunk complete.
    p, rank = comm.Get_size(), comm.Get_rank()
    work = np.array(x, copy=True)
    bounds = chunk_bounds(work.size, p)
    scratch = np.empty(bounds[1] - bounds[0], dtype=work.dtype)
    _reduce_scatter_steps(comm, work, bounds, scratch, shift=1)
    return work[bounds[rank]:bounds[rank + 1]].copy()
    # END SOLUTION


def allgather_ring(comm, x):
    """Every rank's 1-D ``x`` (all of the same length m), concatenated in rank order.

    Returns an array of p · m elements on every rank, as ``MPI.Allgather``
    would: p − 1 ring steps, each passing one block of m elements to the right.
    """
    # BEGIN SOLUTION: Place your block in the result, then pass blocks around the ring for p - 1 steps, each into its slot.
    p, rank = comm.Get_size(), comm.Get_rank()
    m = x.size
    gathered = np.empty(p * m, dtype=x.dtype)
    gathered[rank * m:(rank + 1) * m] = x
    right, left = (rank + 1) % p, (rank - 1) % p
    for step in range(p - 1):
        send, recv = (rank - step) % p, (rank - step - 1) % p
        comm.Sendrecv(gathered[send * m:(send + 1) * m], dest=right, sendtag=4,
                      recvbuf=gathered[recv * m:(recv + 1) * m], source=left, recvtag=4)
    return gathered
    # END SOLUTION


# --- 4. Recursive doubling -----------------------------------------------------------------


def allreduce_recursive_doubling(comm, x):
    """The elementwise sum of every rank's 1-D ``x``, on every rank (a new array).

    log2 p rounds: in round k rank r exchanges its whole partial sum with rank
    ``r ^ 2**k`` and adds. When p is not a power of two, let q be the largest
    power of two below p and e = p − q: first each of ranks 1, 3, …, 2e − 1
    receives from the even rank just below it (which then sits out), the q
    remaining ranks run recursive doubling among themselves, and the result is
    sent back to the ranks that sat out — two rounds more.
    """
    # BEGIN SOLUTION: Fold the extra ranks into neighbours, pair the rest by XOR on renumbered ranks, then send results back.
    p, rank = comm.Get_size(), comm.Get_rank()
    total = np.array(x, copy=True)
    incoming = np.empty_like(total)
    q = 1 << (p.bit_length() - 1)
    extra = p - q
    if rank < 2 * extra:  # fold the extra ranks into their odd neighbours
        if rank % 2 == 0:
            comm.Send(total, dest=rank + 1, tag=5)
            comm.Recv(total, source=rank + 1, tag=6)
            return total
        comm.Recv(incoming, source=rank - 1, tag=5)
        np.add(total, incoming, out=total)
        new = rank // 2
    else:
        new = rank - extra

    def real_rank(n):
        return 2 * n + 1 if n < extra else n + extra

    mask = 1
    while mask < q:
        partner = real_rank(new ^ mask)
        comm.Sendrecv(total, dest=partner, sendtag=7, recvbuf=incoming, source=partner, recvtag=7)
        np.add(total, incoming, out=total)
        mask <<= 1
    if rank < 2 * extra:  # unfold: hand the result back to the rank that sat out
        comm.Send(total, dest=rank - 1, tag=6)
    return total
    # END SOLUTION


# --- 5. All-to-all ------------------------------------------------------------------------------


def alltoall_pairwise(comm, x):
    """Block j of ``x`` goes to rank j; returns the blocks received, in rank order.

    ``x`` has p · m elements (block j is ``x[j*m:(j+1)*m]``); the result has
    block i = what rank i sent here, as ``MPI.Alltoall`` would. p − 1 steps: in
    step s send to ``rank + s`` and receive from ``rank - s`` (one Sendrecv), so
    every rank is busy in every step and nobody waits on a busy partner.
    """
    # BEGIN SOLUTION: Keep your own block; in step s exchange with the ranks s ahead and s behind in one call.
    p, rank = comm.Get_size(), comm.Get_rank()
    m = x.size // p
    received = np.empty_like(x)
    received[rank * m:(rank + 1) * m] = x[rank * m:(rank + 1) * m]
    for step in range(1, p):
        to, frm = (rank + step) % p, (rank - step) % p
        comm.Sendrecv(x[to * m:(to + 1) * m], dest=to, sendtag=8,
                      recvbuf=received[frm * m:(frm + 1) * m], source=frm, recvtag=8)
    return received
    # END SOLUTION
