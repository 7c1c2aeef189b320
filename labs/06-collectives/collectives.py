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
    raise NotImplementedError('not implemented yet: chunk_bounds: Each offset adds up the sizes of the chunks before it; only the first few chunks are one element longer.')


# --- 2. Binomial trees -------------------------------------------------------------


def bcast_binomial(comm, buf, root=0):
    """Broadcast ``buf`` from ``root`` to every rank, in place, along a binomial tree.

    On ``root`` ``buf`` holds the data; elsewhere it is an array of the same
    shape and dtype to receive into. Returns ``buf``. Ranks are renumbered
    so the root is 0 (``(rank - root) % p``); in round k every rank that has
    the data sends it to the rank 2**k further on: ⌈log2 p⌉ rounds, p − 1
    messages in all, each rank receives once.
    """
    raise NotImplementedError('not implemented yet: bcast_binomial: Renumber so the root is 0; receive once from the rank your lowest set bit points to, then send at smaller strides.')


def reduce_binomial(comm, sendbuf, root=0):
    """The elementwise sum of every rank's ``sendbuf``, on ``root`` only.

    Returns a new array on ``root`` and ``None`` on the other ranks; ``sendbuf``
    is left as it was. The broadcast's tree, run backwards: in round k a rank
    whose bit k is set sends its partial sum to the rank 2**k below it and is done.
    """
    raise NotImplementedError("not implemented yet: reduce_binomial: The broadcast's tree run backwards: add in partial sums at growing strides, then send yours once and stop.")


# --- 3. The ring -----------------------------------------------------------------------


def _reduce_scatter_steps(comm, buf, bounds, scratch, shift=0):
    """p − 1 ring steps that leave in ``buf`` the full sum of chunk ``(rank + 1 - shift) % p``.

    In step s rank r sends chunk ``(r - s - shift) % p`` (its partial sum so far)
    to the right and adds the chunk ``(r - s - shift - 1) % p`` arriving from the left.
    """
    raise NotImplementedError('not implemented yet: _reduce_scatter_steps: Each step, pass one chunk to the right and add the chunk from the left into place, with no temporary copies.')


def _allgather_steps(comm, buf, bounds):
    """p − 1 ring steps that spread chunk ``(rank + 1) % p`` of each rank to all.

    In step s rank r forwards chunk ``(r - s + 1) % p`` to the right and receives
    chunk ``(r - s) % p`` from the left straight into its place in ``buf``.
    """
    raise NotImplementedError('not implemented yet: _allgather_steps: Each step, forward the chunk you completed or received last, receiving straight into its slot.')


def allreduce_ring(comm, x):
    """The elementwise sum of every rank's 1-D ``x``, on every rank (a new array).

    Reduce-scatter, then allgather, around the ring over the chunks of
    ``chunk_bounds(x.size, p)``: 2(p − 1) messages per rank, each about n/p
    elements, so every rank sends about 2(p − 1)/p · n elements whatever p is.
    """
    raise NotImplementedError('not implemented yet: allreduce_ring: On one copy of the input, with one scratch chunk: the reduce-scatter steps, then the allgather steps.')


def reduce_scatter_ring(comm, x):
    """Chunk ``rank`` of the elementwise sum of every rank's 1-D ``x``.

    Chunks come from ``chunk_bounds(x.size, p)``, so rank r returns
    ``sum(x)[b_r:b_{r+1}]`` — what ``MPI.Reduce_scatter`` returns with those
    counts. p − 1 messages per rank, (p − 1)/p · n elements.
    """
    raise NotImplementedError("not implemented yet: reduce_scatter_ring: Reuse the ring's reduce-scatter steps with the shift that leaves your own chunk complete.")


def allgather_ring(comm, x):
    """Every rank's 1-D ``x`` (all of the same length m), concatenated in rank order.

    Returns an array of p · m elements on every rank, as ``MPI.Allgather``
    would: p − 1 ring steps, each passing one block of m elements to the right.
    """
    raise NotImplementedError('not implemented yet: allgather_ring: Place your block in the result, then pass blocks around the ring for p - 1 steps, each into its slot.')


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
    raise NotImplementedError('not implemented yet: allreduce_recursive_doubling: Fold the extra ranks into neighbours, pair the rest by XOR on renumbered ranks, then send results back.')


# --- 5. All-to-all ------------------------------------------------------------------------------


def alltoall_pairwise(comm, x):
    """Block j of ``x`` goes to rank j; returns the blocks received, in rank order.

    ``x`` has p · m elements (block j is ``x[j*m:(j+1)*m]``); the result has
    block i = what rank i sent here, as ``MPI.Alltoall`` would. p − 1 steps: in
    step s send to ``rank + s`` and receive from ``rank - s`` (one Sendrecv), so
    every rank is busy in every step and nobody waits on a busy partner.
    """
    raise NotImplementedError('not implemented yet: alltoall_pairwise: Keep your own block; in step s exchange with the ranks s ahead and s behind in one call.')
