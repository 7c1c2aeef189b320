"""The functions lecture 05 runs on MPI ranks, and the pictures it draws.

Every rank-side function is called as ``f(comm, *args)`` by ``course.mpi.run``:
it lives in this module, not in the notebook, because each rank is a fresh
Python process that imports it. Communicators are passed in, never taken from
``MPI.COMM_WORLD``, so each function says which processes talk.
"""
import os
import time

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyArrowPatch, Rectangle
from mpi4py import MPI

# --- ranks and point-to-point -------------------------------------------------


def whoami(comm):
    """Rank, size and process id: every rank is its own process."""
    return comm.Get_rank(), comm.Get_size(), os.getpid()


def pass_along(comm, values):
    """Rank 0 sends an array to rank 1, which adds its rank and sends it on, ... around to rank 0."""
    rank, size = comm.Get_rank(), comm.Get_size()
    buf = np.empty(len(values), dtype=np.float64)
    if rank == 0:
        comm.Send(np.asarray(values, dtype=np.float64), dest=1 % size)
        comm.Recv(buf, source=size - 1)
        return buf
    comm.Recv(buf, source=rank - 1)
    comm.Send(buf + rank, dest=(rank + 1) % size)
    return None


# --- deadlock ------------------------------------------------------------------

def swap_send_first(comm, nbytes, synchronous=False):
    """Ranks 0 and 1 each send ``nbytes`` to the other, then receive: unsafe.

    Both ranks are in ``Send`` at once. That returns only if MPI copies the
    message aside (MPICH does for small messages) or the other side is already
    receiving, which it is not: it is sending too. ``synchronous`` uses
    ``Ssend``, which never buffers.
    """
    other = 1 - comm.Get_rank()
    out, into = np.ones(nbytes, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8)
    (comm.Ssend if synchronous else comm.Send)(out, dest=other)
    comm.Recv(into, source=other)
    return int(into.sum())


def largest_buffered_send(comm, sizes):
    """Try :func:`swap_send_first` at increasing sizes; print each one that got through.

    The job hangs at the first size MPICH does not buffer; its printed output
    says which sizes went through before that.
    """
    for nbytes in sizes:
        swap_send_first(comm, nbytes)
        if comm.Get_rank() == 0:
            print(f"swapped {nbytes} bytes", flush=True)
    return "no deadlock"


def swap_sendrecv(comm, nbytes):
    """The safe swap: one ``Sendrecv`` both sends and receives, so MPI orders the halves."""
    other = 1 - comm.Get_rank()
    out, into = np.ones(nbytes, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8)
    comm.Sendrecv(out, dest=other, recvbuf=into, source=other)
    return int(into.sum())


def swap_nonblocking(comm, nbytes):
    """The other safe swap: post the receive, start the send, then wait for both."""
    other = 1 - comm.Get_rank()
    out, into = np.ones(nbytes, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8)
    requests = [comm.Irecv(into, source=other), comm.Isend(out, dest=other)]
    MPI.Request.Waitall(requests)
    return int(into.sum())


# --- the heat equation, distributed ------------------------------------------------

def block(n, size, rank):
    """(start, stop) of rank's block of n rows: the first n % size ranks get one more."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def heat_serial(u, steps, alpha):
    for _ in range(steps):
        new = u.copy()
        new[1:-1] = u[1:-1] + alpha * (u[:-2] - 2 * u[1:-1] + u[2:])
        u = new
    return u


def heat_on_ranks(comm, u, steps, alpha):
    """The 1D heat equation with one ghost cell each side; returns (start, this rank's points)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    left = rank - 1 if rank > 0 else MPI.PROC_NULL
    right = rank + 1 if rank < size - 1 else MPI.PROC_NULL
    start, stop = block(len(u) - 2, size, rank)
    local = u[start:stop + 2].copy()  # interior point k is u[k + 1]: the block and its two ghosts
    for _ in range(steps):
        comm.Sendrecv(local[1:2], dest=left, recvbuf=local[-1:], source=right)
        comm.Sendrecv(local[-2:-1], dest=right, recvbuf=local[0:1], source=left)
        local = heat_serial(local, 1, alpha)
    return start, local[1:-1]


# --- what a message costs ---------------------------------------------------------

def ping_pong(comm, sizes, repeats):
    """One-way times between ranks 0 and 1 (median of ``repeats`` round trips, halved), on rank 0."""
    rank = comm.Get_rank()
    if rank > 1:
        return None
    times = []
    for nbytes in sizes:
        buf = np.zeros(nbytes, dtype=np.uint8)
        trips = []
        for trip in range(repeats + 2):  # two untimed round trips first: connections, page faults
            start = time.perf_counter()
            if rank == 0:
                comm.Send(buf, dest=1)
                comm.Recv(buf, source=1)
            else:
                comm.Recv(buf, source=0)
                comm.Send(buf, dest=0)
            if trip >= 2:
                trips.append(time.perf_counter() - start)
        times.append(float(np.median(trips)) / 2)
    return times if rank == 0 else None


# --- pictures ------------------------------------------------------------------------

COLOURS = plt.get_cmap("tab10").colors


def draw_decomposition(n, size, ax=None):
    """n interior points and 2 boundary points split over size ranks; ghosts drawn hatched."""
    if ax is None:
        _, ax = plt.subplots(figsize=(0.42 * (n + 2) + 1.2, 0.55 * size + 1.0), layout="constrained")
    for x in range(n + 2):
        boundary = x in (0, n + 1)
        ax.add_patch(Rectangle((x, size), 0.95, 0.8, facecolor="0.6" if boundary else "0.9", edgecolor="0.6"))
    ax.text(n + 2.2, size + 0.4, "global grid (grey: fixed boundary)", va="center", fontsize=8)
    for rank in range(size):
        start, stop = block(n, size, rank)
        y = size - 1 - rank
        for x in range(start, stop + 2):  # global index of the block and its ghosts
            ghost = x in (start, stop + 1)
            ax.add_patch(Rectangle((x, y), 0.95, 0.8, facecolor="white" if ghost else COLOURS[rank % 10],
                                   edgecolor=COLOURS[rank % 10], hatch="///" if ghost else None))
        ax.text(n + 2.2, y + 0.4, f"rank {rank}: points {start + 1}..{stop}  ({stop - start})",
                va="center", fontsize=8)
    ax.set_xlim(-0.2, n + 9)
    ax.set_ylim(-0.2, size + 1)
    ax.axis("off")
    ax.set_title(f"{n} interior points on {size} ranks; hatched: ghost cells", fontsize=9)
    return ax


def draw_halo_exchange(ax=None):
    """Two neighbouring ranks: each one's edge value travels into the other's ghost cell."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 2.0), layout="constrained")
    cells = {0: range(0, 6), 1: range(4, 10)}  # rank 1's block starts where rank 0's ends
    for rank, xs in cells.items():
        y = 1.4 if rank == 0 else 0
        for x in xs:
            ghost = x == xs[-1] if rank == 0 else x == xs[0]
            ax.add_patch(Rectangle((x + 0.05, y), 0.9, 0.7, facecolor="white" if ghost else COLOURS[rank],
                                   edgecolor=COLOURS[rank], hatch="///" if ghost else None))
        ax.text(xs[0] - 0.2, y + 0.35, f"rank {rank}", ha="right", va="center", fontsize=9)
    arrows = [((4.5, 1.4), (4.5, 0.7), "rank 0's last point -> rank 1's left ghost"),
              ((5.5, 0.7), (5.5, 1.4), "rank 1's first point -> rank 0's right ghost")]
    for (start, end, label), dx in zip(arrows, (-1, 1)):
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12, color="k"))
        ax.text(5 + dx * 3.2, 1.05, label, ha="center", va="center", fontsize=8)
    ax.set_xlim(-1.5, 11)
    ax.set_ylim(-0.2, 2.3)
    ax.axis("off")
    return ax
