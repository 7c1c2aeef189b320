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
    raise NotImplementedError('not implemented yet: chunk_bounds: divmod(n, p) gives the base size and how many chunks get one extra; chunk i starts after i base chunks and min(i, extra) extras')


# --- 2. Binomial trees -------------------------------------------------------------


def bcast_binomial(comm, buf, root=0):
    """Broadcast ``buf`` from ``root`` to every rank, in place, along a binomial tree.

    On ``root`` ``buf`` holds the data; elsewhere it is an array of the same
    shape and dtype to receive into. Returns ``buf``. Ranks are renumbered
    so the root is 0 (``(rank - root) % p``); in round k every rank that has
    the data sends it to the rank 2**k further on: ⌈log2 p⌉ rounds, p − 1
    messages in all, each rank receives once.
    """
    raise NotImplementedError('not implemented yet: bcast_binomial: relative rank v = (rank - root) % p. A rank receives once, from v minus its lowest set bit; then it sends to v + mask for each smaller power of two mask (largest first) while v + mask < p')


def reduce_binomial(comm, sendbuf, root=0):
    """The elementwise sum of every rank's ``sendbuf``, on ``root`` only.

    Returns a new array on ``root`` and ``None`` on the other ranks; ``sendbuf``
    is left as it was. The broadcast's tree, run backwards: in round k a rank
    whose bit k is set sends its partial sum to the rank 2**k below it and is done.
    """
    raise NotImplementedError('not implemented yet: reduce_binomial: mirror bcast_binomial: with v = (rank - root) % p, for mask = 1, 2, 4, ...: if v & mask, send the partial sum to v - mask and stop; else receive from v + mask (when < p) and add')


# --- 3. The ring -----------------------------------------------------------------------


def _reduce_scatter_steps(comm, buf, bounds, scratch, shift=0):
    """p − 1 ring steps that leave in ``buf`` the full sum of chunk ``(rank + 1 - shift) % p``.

    In step s rank r sends chunk ``(r - s - shift) % p`` (its partial sum so far)
    to the right and adds the chunk ``(r - s - shift - 1) % p`` arriving from the left.
    """
    raise NotImplementedError('not implemented yet: _reduce_scatter_steps: neighbours right = (rank + 1) % p, left = (rank - 1) % p; Sendrecv a view of buf into scratch[:size], then np.add(..., out=view): no copies')


def _allgather_steps(comm, buf, bounds):
    """p − 1 ring steps that spread chunk ``(rank + 1) % p`` of each rank to all.

    In step s rank r forwards chunk ``(r - s + 1) % p`` to the right and receives
    chunk ``(r - s) % p`` from the left straight into its place in ``buf``.
    """
    raise NotImplementedError('not implemented yet: _allgather_steps: the same neighbours; each step forwards the chunk received in the step before; receive directly into the view of buf where it belongs')


def allreduce_ring(comm, x):
    """The elementwise sum of every rank's 1-D ``x``, on every rank (a new array).

    Reduce-scatter, then allgather, around the ring over the chunks of
    ``chunk_bounds(x.size, p)``: 2(p − 1) messages per rank, each about n/p
    elements, so every rank sends about 2(p − 1)/p · n elements whatever p is.
    """
    raise NotImplementedError('not implemented yet: allreduce_ring: copy x into the result buffer once, allocate one scratch chunk, then _reduce_scatter_steps followed by _allgather_steps')


def reduce_scatter_ring(comm, x):
    """Chunk ``rank`` of the elementwise sum of every rank's 1-D ``x``.

    Chunks come from ``chunk_bounds(x.size, p)``, so rank r returns
    ``sum(x)[b_r:b_{r+1}]`` — what ``MPI.Reduce_scatter`` returns with those
    counts. p − 1 messages per rank, (p − 1)/p · n elements.
    """
    raise NotImplementedError("not implemented yet: reduce_scatter_ring: the ring's reduce-scatter steps with shift=1 leave chunk rank complete; work on a copy of x")


def allgather_ring(comm, x):
    """Every rank's 1-D ``x`` (all of the same length m), concatenated in rank order.

    Returns an array of p · m elements on every rank, as ``MPI.Allgather``
    would: p − 1 ring steps, each passing one block of m elements to the right.
    """
    raise NotImplementedError('not implemented yet: allgather_ring: put x in block rank of the result; in step s send block (rank - s) % p to the right and receive block (rank - s - 1) % p from the left into its place')


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
    raise NotImplementedError('not implemented yet: allreduce_recursive_doubling: q = 1 << (p.bit_length() - 1), extra = p - q. Fold: even ranks below 2*extra send to rank + 1 and wait for the answer; the rest get new numbers (rank // 2 below 2*extra, rank - extra above). Pair new numbers by XOR; map a new number back to a rank before sending')


# --- 5. All-to-all ------------------------------------------------------------------------------


def alltoall_pairwise(comm, x):
    """Block j of ``x`` goes to rank j; returns the blocks received, in rank order.

    ``x`` has p · m elements (block j is ``x[j*m:(j+1)*m]``); the result has
    block i = what rank i sent here, as ``MPI.Alltoall`` would. p − 1 steps: in
    step s send to ``rank + s`` and receive from ``rank - s`` (one Sendrecv), so
    every rank is busy in every step and nobody waits on a busy partner.
    """
    raise NotImplementedError('not implemented yet: alltoall_pairwise: m = x.size // p; copy your own block, then for s in 1..p-1 Sendrecv block (rank + s) % p to rank + s, receiving block (rank - s) % p from rank - s')
