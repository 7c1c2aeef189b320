"""Lab 05 — Message passing with MPI.

The heat equation on a grid split across MPI ranks, then a measurement of what
one message costs:

1. ``split_rows`` — which rows (or points) each rank owns in a block decomposition;
2. ``exchange_halos`` — 1D: swap one ghost cell with each neighbour (``Sendrecv``);
   ``exchange_halos_nonblocking`` — the same with ``Irecv``/``Isend`` and waits;
3. ``heat_step_1d`` and ``run_heat_1d`` — the explicit heat equation, distributed;
4. ``exchange_halo_rows``, ``heat_step_2d`` and ``run_heat_2d`` — the same in 2D,
   with whole ghost rows;
5. ``ping_pong`` and ``fit_alpha_beta`` — time messages between two ranks and fit
   the α–β model ``t(n) = α + β·n``.

Every function that talks takes the communicator ``comm`` first and uses only
it (never ``MPI.COMM_WORLD``): the grader hands you a communicator that records
your messages. Use point-to-point calls only (``Sendrecv``, ``Send``, ``Recv``,
``Isend``, ``Irecv`` and ``request.Wait()``).

The grid has fixed (Dirichlet) boundary values: ``u[0]`` and ``u[-1]`` (in 2D
the first and last row and column) never change. Only the interior is split
between ranks. Each rank keeps its block with one ghost cell (row) on each
side; at the edges of the domain that ghost holds the boundary value, and the
neighbour there is ``MPI.PROC_NULL``, which makes a send or receive do nothing.

Run the checks with ``k2c grade 05`` (from the repository root), or try the
functions on N ranks from a notebook with ``course.mpi.run("heat_mpi:...", N, ...)``.
"""
import time

import numpy as np
from mpi4py import MPI

# --- 1. Block decomposition ----------------------------------------------------


def split_rows(n, size, rank):
    """``(start, stop)``: the rows ``start <= i < stop`` of ``n`` that ``rank`` of ``size`` owns.

    Blocks are contiguous and in rank order; they cover ``0 .. n`` exactly once.
    When ``size`` does not divide ``n``, the first ``n % size`` ranks get one row
    more than the others (10 rows on 4 ranks: 3, 3, 2, 2).
    """
    raise NotImplementedError("not implemented yet: split_rows: Rank r's block starts after the rows of all earlier ranks; count the ones that got an extra row.")


def neighbours(comm):
    """``(left, right)``: the ranks before and after this one; ``MPI.PROC_NULL`` past the domain's edges."""
    raise NotImplementedError('not implemented yet: neighbours: The domain is not periodic: the first rank has no neighbour before it and the last none after it.')


# --- 2. Halo exchange in 1D ------------------------------------------------------


def exchange_halos(comm, u):
    """Fill the ghost cells ``u[0]`` and ``u[-1]`` from the neighbours, in place.

    ``u[1:-1]`` is this rank's block. The left neighbour's last owned value
    goes into ``u[0]``, the right neighbour's first into ``u[-1]``; at the edges
    of the domain the ghost keeps its (boundary) value. One ``comm.Sendrecv`` per
    direction: each rank sends and receives in one call, so no order of calls
    can deadlock.
    """
    left, right = neighbours(comm)
    raise NotImplementedError('not implemented yet: exchange_halos: One Sendrecv per direction, each sending an edge value and receiving the opposite ghost; slices are views.')


def exchange_halos_nonblocking(comm, u):
    """The same exchange as :func:`exchange_halos`, with non-blocking calls.

    Post both receives first (``comm.Irecv``), then both sends (``comm.Isend``),
    then wait for all four requests (``request.Wait()`` on each). A receive that
    is already posted when its message arrives needs no buffering, and nothing
    waits until everything is under way.
    """
    left, right = neighbours(comm)
    raise NotImplementedError("not implemented yet: exchange_halos_nonblocking: Post both receives, then both sends, then wait on every request; each send's tag must match its receive.")


# --- 3. The heat equation in 1D --------------------------------------------------


def heat_step_1d(u, alpha):
    """One explicit step: a new array whose interior is

    ``u[i] + alpha * (u[i-1] - 2*u[i] + u[i+1])``

    evaluated in exactly that order (so every rank gets the bits the serial
    code gets), and whose first and last values are copied from ``u``.
    """
    raise NotImplementedError('not implemented yet: heat_step_1d: Copy the array, then update the whole interior at once from shifted slices: no Python loop.')


def run_heat_1d(comm, u, steps, alpha, nonblocking=False):
    """Run ``steps`` heat steps of the global grid ``u`` (boundary included) on all ranks.

    The ``len(u) - 2`` interior points are split with :func:`split_rows`; each
    rank copies its block and the two values around it, then, every step,
    exchanges halos (:func:`exchange_halos_nonblocking` if ``nonblocking``) and
    takes a step. Returns this rank's block of the result (its interior points
    only, without ghosts): concatenated in rank order, the blocks are the
    interior of the serial result.
    """
    exchange = exchange_halos_nonblocking if nonblocking else exchange_halos
    raise NotImplementedError('not implemented yet: run_heat_1d: Take your block and one ghost each side from the global grid, then alternate exchange and step.')


# --- 4. The heat equation in 2D, split by rows ------------------------------------


def exchange_halo_rows(comm, u):
    """Fill the ghost rows ``u[0, :]`` and ``u[-1, :]`` from the neighbours, in place.

    The 2D version of :func:`exchange_halos`: the rank above sends its last
    owned row into ``u[0]``, the rank below its first owned row into ``u[-1]``.
    A row of a C-ordered array is contiguous, so ``u[1]`` can be sent as it is.
    """
    up, down = neighbours(comm)
    raise NotImplementedError('not implemented yet: exchange_halo_rows: As in 1D, but each message is a whole row: your first owned row goes up, your last goes down.')


def heat_step_2d(u, alpha):
    """One explicit step in 2D: a new array whose interior is

    ``u[i, j] + alpha * (u[i-1, j] + u[i+1, j] + u[i, j-1] + u[i, j+1] - 4*u[i, j])``

    evaluated in exactly that order; the first and last rows and columns are copied from ``u``.
    """
    raise NotImplementedError('not implemented yet: heat_step_2d: Copy the array, then update the interior from four shifted views of it.')


def run_heat_2d(comm, u, steps, alpha):
    """Run ``steps`` 2D heat steps of the global grid ``u`` (boundary rows and columns included).

    The ``u.shape[0] - 2`` interior rows are split with :func:`split_rows`;
    every rank keeps whole rows (boundary columns included) plus one ghost row
    above and below. Returns this rank's owned rows of the result, all
    columns: stacked in rank order they are ``serial_result[1:-1, :]``.
    """
    raise NotImplementedError('not implemented yet: run_heat_2d: The 1D driver with rows in place of points: your rows plus a ghost row above and below.')


# --- 5. What a message costs -------------------------------------------------------


def ping_pong(comm, sizes, repeats):
    """One-way message times between ranks 0 and 1, one per size in ``sizes`` (bytes).

    For each size, rank 0 sends a ``np.uint8`` buffer of that many bytes to rank 1
    and rank 1 sends it straight back, ``repeats`` times (after one round trip
    that is not timed, to warm up). The one-way time is the timed total over
    ``2 * repeats``. Rank 0 returns the list of one-way times in seconds; rank 1
    returns ``None`` and ranks above 1 take no part (and return ``None``).
    """
    raise NotImplementedError('not implemented yet: ping_pong: Rank 0 sends then receives, rank 1 receives then sends back; start the clock after the warm-up trip.')


def fit_alpha_beta(sizes, times):
    """Least-squares fit of ``t = alpha + beta * n``: returns ``(alpha, beta)`` as floats.

    ``alpha`` is the latency (seconds per message), ``beta`` the inverse
    bandwidth (seconds per byte).
    """
    raise NotImplementedError("not implemented yet: fit_alpha_beta: A linear least-squares fit with an intercept column; NumPy's linear algebra module has one.")
