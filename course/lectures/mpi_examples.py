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

from course.mpi_audit import AuditComm

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


def ring_pass(comm, nbytes, order):
    """Every rank sends ``nbytes`` to the rank after it and receives from the rank before, with ``Ssend``.

    ``order="send first"``: every rank sends, then receives. ``order="odd-even"``: even ranks send
    first, odd ranks receive first. Returns the sum of what arrived (``nbytes`` ones).
    """
    me, ranks = comm.Get_rank(), comm.Get_size()
    out, into = np.ones(nbytes, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8)
    send = lambda: comm.Ssend(out, dest=(me + 1) % ranks)          # noqa: E731
    receive = lambda: comm.Recv(into, source=(me - 1) % ranks)     # noqa: E731
    first, then = (receive, send) if order == "odd-even" and me % 2 else (send, receive)
    first()
    then()
    return int(into.sum())


# --- a periodic stencil, distributed ----------------------------------------------
# The lecture's instance: a ring-shaped (periodic) grid and a five-point moving average, so each
# rank needs TWO values from each neighbour and the neighbours wrap around. The lab's instance
# (fixed boundaries, one ghost cell, MPI.PROC_NULL at the edges) is for the student to write.

HALO = 2  # ghost cells on each side: the stencil reaches two points away


def owned_range(n, size, rank):
    """(first, last + 1) of rank's points: cut at floor(rank * n / size), so sizes differ by at most one.

    Another balanced split than the lab's: with 10 points on 4 ranks it gives 2, 3, 2, 3.
    """
    return rank * n // size, (rank + 1) * n // size


def smooth_serial(u, steps):
    """``steps`` rounds of the periodic five-point average, on one process."""
    for _ in range(steps):
        u = (np.roll(u, 2) + np.roll(u, 1) + u + np.roll(u, -1) + np.roll(u, -2)) / 5
    return u


def smooth_on_ranks(comm, u, steps):
    """The same average on a ring of ranks, HALO ghosts each side; returns (first, this rank's points).

    Every rank must own at least HALO points, or its ghosts would come from two ranks away.
    """
    me, ranks = comm.Get_rank(), comm.Get_size()
    before, after = (me - 1) % ranks, (me + 1) % ranks  # periodic: rank 0's left is the last rank
    first, last = owned_range(len(u), ranks, me)
    work = np.empty(last - first + 2 * HALO)
    work[HALO:-HALO] = u[first:last]
    for _ in range(steps):
        # my lowest two points go to the rank before me while the rank after me fills my upper ghosts ...
        comm.Sendrecv(work[HALO:2 * HALO], dest=before, sendtag=10, recvbuf=work[-HALO:], source=after, recvtag=10)
        # ... and the mirror image
        comm.Sendrecv(work[-2 * HALO:-HALO], dest=after, sendtag=11, recvbuf=work[:HALO], source=before, recvtag=11)
        work[HALO:-HALO] = (work[:-4] + work[1:-3] + work[2:-2] + work[3:-1] + work[4:]) / 5
    return first, work[HALO:-HALO].copy()


def smooth_counted(comm, u, steps):
    """:func:`smooth_on_ranks` on a communicator that records every message: this rank's totals
    (``course.mpi_audit.totals``: messages and elements sent and received, bytes sent)."""
    audited = AuditComm(comm)
    smooth_on_ranks(audited, u, steps)
    return audited.totals()


def smooth_nonblocking(comm, u, steps, tags=(10, 11)):
    """The same average with a non-blocking exchange: post both receives, start both sends, wait for all four.

    ``tags``: the tag of the messages that travel to the rank before, and of those to the rank after.
    With one tag for both (``tags=(10, 10)``) the exchange is right on some rank counts only.
    """
    me, ranks = comm.Get_rank(), comm.Get_size()
    before, after = (me - 1) % ranks, (me + 1) % ranks
    first, last = owned_range(len(u), ranks, me)
    work = np.empty(last - first + 2 * HALO)
    work[HALO:-HALO] = u[first:last]
    to_before, to_after = tags
    for _ in range(steps):
        requests = [comm.Irecv(work[:HALO], source=before, tag=to_after),       # lower ghosts: the rank before's top
                    comm.Irecv(work[-HALO:], source=after, tag=to_before),      # upper ghosts: the rank after's bottom
                    comm.Isend(work[HALO:2 * HALO], dest=before, tag=to_before),
                    comm.Isend(work[-2 * HALO:-HALO], dest=after, tag=to_after)]
        MPI.Request.Waitall(requests)
        work[HALO:-HALO] = (work[:-4] + work[1:-3] + work[2:-2] + work[3:-1] + work[4:]) / 5
    return first, work[HALO:-HALO].copy()


def smooth_nonblocking_tagged(comm, u, steps, tag_pairs):
    """:func:`smooth_nonblocking` once for each ``tags`` pair of ``tag_pairs``, in one job: a list of its results."""
    return [smooth_nonblocking(comm, u, steps, tags) for tags in tag_pairs]


# --- what a message costs ---------------------------------------------------------

def exchange_times(comm, sizes, repeats):
    """Ranks 0 and 1 swap ``nbytes`` both ways at once with one ``Sendrecv``: median seconds per swap, on rank 0.

    A swap loads both directions of the path together, as a halo exchange does. (The lab's
    ping-pong loads one direction at a time.)
    """
    me = comm.Get_rank()
    if me > 1:
        return None
    peer = 1 - me
    medians = []
    for nbytes in sizes:
        outgoing, incoming = np.ones(nbytes, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8)
        samples = []
        for k in range(repeats + 2):  # the first two swaps set up the connection and touch the pages
            t0 = time.perf_counter()
            comm.Sendrecv(outgoing, dest=peer, recvbuf=incoming, source=peer)
            if k >= 2:
                samples.append(time.perf_counter() - t0)
        medians.append(float(np.median(samples)))
    return medians if me == 0 else None


def stream_time(comm, nbytes, count):
    """Rank 0 streams ``count`` messages of ``nbytes`` to rank 1: the median time between two arrivals
    at rank 1, i.e. seconds per message with only one direction loaded (returned on rank 1)."""
    me = comm.Get_rank()
    if me > 1:
        return None
    data = np.ones(nbytes, dtype=np.uint8)
    if me == 0:
        for _ in range(count + 2):  # two more than timed: the first arrival only starts the clock
            comm.Send(data, 1, 3)  # (buffer, destination, tag)
        return None
    arrivals = []
    for _ in range(count + 2):
        comm.Recv(data, 0, 3)
        arrivals.append(time.perf_counter())
    return float(np.median(np.diff(arrivals[1:])))


def barrier_waits(comm, late_rank, delay_s):
    """Every rank enters a barrier; ``late_rank`` arrives ``delay_s`` late. Each rank's seconds inside it."""
    comm.Barrier()  # line everyone up first
    if comm.Get_rank() == late_rank:
        time.sleep(delay_s)
    t0 = time.perf_counter()
    comm.Barrier()
    return time.perf_counter() - t0


def straggler_steps(comm, steps, compute_s, slow_rank, slow_s):
    """``steps`` rounds of compute (a sleep: ``compute_s``, or ``slow_s`` on ``slow_rank``) and a barrier.

    Returns (seconds this rank computed, seconds from the first step's start to the last barrier's end).
    """
    comm.Barrier()
    computed, start = 0.0, time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        time.sleep(slow_s if comm.Get_rank() == slow_rank else compute_s)
        computed += time.perf_counter() - t0
        comm.Barrier()
    return computed, time.perf_counter() - start


# --- pictures ------------------------------------------------------------------------

COLOURS = plt.get_cmap("tab10").colors


def draw_decomposition(n, size, ax=None):
    """A periodic grid of n points split over size ranks; each rank's HALO ghosts each side drawn hatched."""
    if ax is None:
        _, ax = plt.subplots(figsize=(0.42 * (n + 2 * HALO) + 2.4, 0.55 * size + 1.0), layout="constrained")
    for x in range(n):
        ax.add_patch(Rectangle((x, size), 0.95, 0.8, facecolor="0.9", edgecolor="0.6"))
    ax.text(n + HALO + 0.4, size + 0.4, "global grid (periodic: point n-1 touches point 0)", va="center", fontsize=8)
    for rank in range(size):
        first, last = owned_range(n, size, rank)
        y = size - 1 - rank
        for x in range(first - HALO, last + HALO):  # drawn at its place; a ghost past an end wraps around
            ghost = not first <= x < last
            ax.add_patch(Rectangle((x, y), 0.95, 0.8, facecolor="white" if ghost else COLOURS[rank % 10],
                                   edgecolor=COLOURS[rank % 10], hatch="///" if ghost else None))
            if ghost and not 0 <= x < n:
                ax.text(x + 0.47, y + 0.4, str(x % n), ha="center", va="center", fontsize=6)
        ax.text(n + HALO + 0.4, y + 0.4, f"rank {rank}: points {first}..{last - 1}  ({last - first})",
                va="center", fontsize=8)
    ax.set_xlim(-HALO - 0.2, n + HALO + 10)
    ax.set_ylim(-0.2, size + 1)
    ax.axis("off")
    ax.set_title(f"{n} points on {size} ranks; hatched: {HALO} ghost cells each side (numbers: wrapped points)",
                 fontsize=9)
    return ax


def draw_halo_exchange(ax=None):
    """Two neighbouring ranks: each one's HALO edge points travel, in one message, into the other's ghosts."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 2.0), layout="constrained")
    boundary = 5  # rank 0 owns the points below it, rank 1 those from it on
    cells = {0: range(0, boundary + HALO), 1: range(boundary - HALO, 2 * boundary)}
    for rank, xs in cells.items():
        y = 1.4 if rank == 0 else 0
        for x in xs:
            ghost = x >= boundary if rank == 0 else x < boundary
            ax.add_patch(Rectangle((x + 0.05, y), 0.9, 0.7, facecolor="white" if ghost else COLOURS[rank],
                                   edgecolor=COLOURS[rank], hatch="///" if ghost else None))
        ax.text(min(xs) - 0.2, y + 0.35, f"rank {rank}", ha="right", va="center", fontsize=9)
    down = boundary - HALO / 2  # the middle of rank 0's top HALO points, and of rank 1's first ones
    arrows = [((down, 1.4), (down, 0.7), f"rank 0's last {HALO} points -> rank 1's lower ghosts"),
              ((boundary + HALO / 2, 0.7), (boundary + HALO / 2, 1.4), f"rank 1's first {HALO} points -> rank 0's upper ghosts")]
    for (start, end, label), dx in zip(arrows, (-1, 1)):
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12, color="k"))
        ax.text(boundary + dx * 3.6, 1.05, label, ha="center", va="center", fontsize=8)
    ax.set_xlim(-1.5, 11.5)
    ax.set_ylim(-0.2, 2.3)
    ax.axis("off")
    return ax


# --- reference hardware ----------------------------------------------------------------
# One table of published per-GPU link speeds (GB/s in EACH direction), shared by the lectures
# that put numbers on a cluster. NVIDIA quotes NVLink as 900 GB/s "bidirectional": 450 each way.
HARDWARE = {
    "nvlink4_link_GBps": 25.0,      # one NVLink 4 link, each direction
    "nvlink4_links_per_gpu": 18,    # H100 SXM
    "pcie5_x16_GBps": 64.0,         # PCIe 5.0, 16 lanes, each direction (nominal)
    "ib_ndr_Gbps": 400.0,           # one InfiniBand NDR NIC per GPU, in gigaBITS per second
    "gpus_per_node": 8,             # an HGX/DGX H100 node; NVSwitch connects all eight
    "nvlink_measured_GBps": 370.0,  # a published all-gather measurement on H100, large messages
}


def nvlink_GBps(hw=HARDWARE):
    """One H100's NVLink bandwidth, each direction: links times the speed of one."""
    return hw["nvlink4_links_per_gpu"] * hw["nvlink4_link_GBps"]


def ib_GBps(hw=HARDWARE):
    """One GPU's InfiniBand bandwidth, each direction, in gigaBYTES per second."""
    return hw["ib_ndr_Gbps"] / 8


def timed(f):
    """Seconds one call of ``f()`` takes."""
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0
