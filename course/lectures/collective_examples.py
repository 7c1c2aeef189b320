"""What lecture 06 runs on MPI ranks, and the pictures and cost models it draws.

Rank functions are called as ``f(comm, *args)`` by ``course.mpi.run`` (they
must live in a module, not in the notebook). The lab's algorithms are not
here — students write those — only the naive versions the lecture audits,
the measurements, and *schedules*: who sends what to whom in each round of
each algorithm, as lists the drawing function turns into a picture.
"""
import contextlib
import math
import os

import matplotlib.pyplot as plt
import numpy as np

from course import mpi
from course.mpi_audit import AuditComm, Event, rounds, totals

# --- measurements ---------------------------------------------------------------------


def ping_pong(comm, sizes, repeats):
    """One-way time of a message of each size in bytes (median of ``repeats`` round trips / 2)."""
    from mpi4py import MPI

    out = []
    for nbytes in sizes:
        buf = np.zeros(max(nbytes, 1), np.uint8)[:nbytes]
        samples = []
        for _ in range(repeats):
            comm.Barrier()
            start = MPI.Wtime()
            if comm.rank == 0:
                comm.Send(buf, dest=1)
                comm.Recv(buf, source=1)
            elif comm.rank == 1:
                comm.Recv(buf, source=0)
                comm.Send(buf, dest=0)
            samples.append((MPI.Wtime() - start) / 2)
        out.append(float(np.median(samples)))
    return out


def time_allreduce(comm, sizes, repeats):
    """Fastest of ``repeats`` calls of MPI's Allreduce (slowest rank per call), per size in bytes (float32 sum).

    The minimum, not the median: on a shared, oversubscribed machine other
    processes only ever add time, and the fastest call is the algorithm's own."""
    from mpi4py import MPI

    out = []
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        y = np.empty_like(x)
        comm.Allreduce(x, y)  # warm-up
        samples = []
        for _ in range(repeats):
            comm.Barrier()
            start = MPI.Wtime()
            comm.Allreduce(x, y)
            samples.append(comm.allreduce(MPI.Wtime() - start, op=MPI.MAX))
        out.append(float(np.min(samples)))
    return out


def time_exchange_collectives(comm, sizes, repeats):
    """Fastest of ``repeats`` calls of MPI's Alltoall and Allgather with the same bytes per rank.

    For each size n (bytes each rank holds): Alltoall of an n-byte buffer (one n/p block to each
    rank), and Allgather of an n/p-byte contribution (an n-byte result). Both send (p - 1)/p * n
    bytes per rank. Returns ``{"alltoall": [...], "allgather": [...]}`` (seconds, slowest rank)."""
    from mpi4py import MPI

    p = comm.size
    out = {"alltoall": [], "allgather": []}
    for nbytes in sizes:
        block = nbytes // p
        full, result = np.ones(block * p, np.uint8), np.empty(block * p, np.uint8)
        calls = {"alltoall": lambda: comm.Alltoall(full, result),
                 "allgather": lambda: comm.Allgather(full[:block], result)}
        for name, call in calls.items():
            call()  # warm-up
            samples = []
            for _ in range(repeats):
                comm.Barrier()
                start = MPI.Wtime()
                call()
                samples.append(comm.allreduce(MPI.Wtime() - start, op=MPI.MAX))
            out[name].append(float(np.min(samples)))
    return out


@contextlib.contextmanager
def mpich_algorithm(name):
    """Ask MPICH to use one allreduce algorithm (``ring``, ``recursive_doubling`` …) for jobs started inside.

    MPICH reads these control variables from the environment of each rank, and
    ``course.mpi.run`` passes this process's environment on.
    """
    with rank_environment(MPIR_CVAR_DEVICE_COLLECTIVES="none", MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=name):
        yield


@contextlib.contextmanager
def rank_environment(**settings):
    """Environment variables for the ranks of jobs started inside (``course.mpi.run`` passes this
    process's environment on)."""
    saved = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def allreduce_times(algorithm, p, sizes, repeats=7):
    """Seconds per MPICH Allreduce with ``algorithm`` on ``p`` ranks, for each size in bytes."""
    with mpich_algorithm(algorithm):
        return mpi.run(time_allreduce, p, sizes, repeats, timeout=300).check().results[0]


# --- naive collectives, audited ------------------------------------------------------------


def linear_bcast(comm, n):
    """The root sends the whole buffer to every other rank in turn: p - 1 rounds."""
    audited = AuditComm(comm)
    x = np.arange(n, dtype=np.int64) if audited.rank == 0 else np.empty(n, np.int64)
    if audited.rank == 0:
        for dest in range(1, audited.size):
            audited.Send(x, dest)
    else:
        audited.Recv(x, 0)
    return audited.log


def funnel_allreduce(comm, n):
    """Everyone sends to rank 0, which adds and sends the sum back: right answer, rank 0 does all the work."""
    audited = AuditComm(comm)
    total = np.full(n, audited.rank + 1, np.int64)
    if audited.rank == 0:
        incoming = np.empty_like(total)
        for source in range(1, audited.size):
            audited.Recv(incoming, source)
            total += incoming
        for dest in range(1, audited.size):
            audited.Send(total, dest)
    else:
        audited.Send(total, 0)
        audited.Recv(total, 0)
    return audited.log


def audit_summary(logs):
    """Per-rank messages and elements sent, and the longest chain of steps, from every rank's log."""
    per_rank = [totals(log) for log in logs]
    return {"messages_sent": [t["messages_sent"] for t in per_rank],
            "elements_sent": [t["elements_sent"] for t in per_rank], "rounds": rounds(logs)}


# --- schedules: who sends what to whom, round by round -------------------------------------

def binomial_bcast_schedule(p, root=0):
    """Rounds of (source, destination, label): in round k every rank that has the data sends 2**k further."""
    schedule, mask = [], 1
    while mask < p:
        schedule.append([((v + root) % p, (v + mask + root) % p, "") for v in range(mask) if v + mask < p])
        mask *= 2
    return schedule


def ring_allreduce_schedule(p):
    """2(p-1) rounds: p-1 of reduce-scatter (partial sums of chunk c), then p-1 of allgather (finished chunks)."""
    schedule = []
    for step in range(p - 1):
        schedule.append([(r, (r + 1) % p, f"+{(r - step) % p}") for r in range(p)])
    for step in range(p - 1):
        schedule.append([(r, (r + 1) % p, f"={(r - step + 1) % p}") for r in range(p)])
    return schedule


def recursive_doubling_schedule(p):
    """Rounds of whole-vector exchanges; when p is not a power of two, a fold round first and an unfold round last."""
    q = 1 << (p.bit_length() - 1)
    extra = p - q

    def real(v):
        return 2 * v + 1 if v < extra else v + extra

    schedule = []
    if extra:
        schedule.append([(2 * i, 2 * i + 1, "fold") for i in range(extra)])
    mask = 1
    while mask < q:
        schedule.append([(real(v), real(v ^ mask), "") for v in range(q)])
        mask *= 2
    if extra:
        schedule.append([(2 * i + 1, 2 * i, "sum") for i in range(extra)])
    return schedule


def draw_schedule(schedule, p, ax=None, title="", wrap_dashed=False):
    """Ranks as horizontal lanes, rounds left to right, one arrow per message, labelled at its source.

    ``wrap_dashed``: draw messages to a lower-numbered rank dashed (a ring's wrap-around).
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(1.2 + 1.1 * len(schedule), 0.45 * p + 0.9), layout="constrained")
    for rank in range(p):
        ax.axhline(rank, color="0.85", lw=1, zorder=0)
    colours = plt.get_cmap("tab10")
    for k, messages in enumerate(schedule):
        for src, dst, label in messages:
            style = "--" if wrap_dashed and dst < src else "-"
            ax.annotate("", xy=(k + 0.85, dst), xytext=(k + 0.15, src),
                        arrowprops={"arrowstyle": "->", "color": colours(src % 10), "lw": 1.3, "ls": style})
            if label:
                ax.text(k + 0.1, src - 0.12, label, fontsize=7, ha="left", va="bottom", color=colours(src % 10))
    ax.set_xlim(0, max(len(schedule), 1))
    ax.set_ylim(p - 0.5, -0.6)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)], fontsize=8)
    ax.set_xticks([k + 0.5 for k in range(len(schedule))], [str(k + 1) for k in range(len(schedule))], fontsize=8)
    ax.set_xlabel("round")
    ax.set_title(title, fontsize=9)
    return ax


# --- the α–β costs ------------------------------------------------------------------------

def cost_binomial_bcast(p, nbytes, alpha, beta):
    return math.ceil(math.log2(p)) * (alpha + nbytes * beta)


def cost_ring_allreduce(p, nbytes, alpha, beta):
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes * beta


def cost_recursive_doubling(p, nbytes, alpha, beta):
    q = 1 << (p.bit_length() - 1)
    fold = 0 if q == p else 2  # the fold and unfold rounds
    return (math.log2(q) + fold) * (alpha + nbytes * beta)


def crossover_bytes(p, alpha, beta):
    """Message size above which the ring allreduce beats recursive doubling (p a power of two)."""
    rounds_saved = 2 * (p - 1) - math.log2(p)  # extra α the ring pays
    bytes_saved = math.log2(p) - 2 * (p - 1) / p  # β·n recursive doubling pays extra, per byte
    if bytes_saved <= 0:  # p = 2: both send the whole vector once; recursive doubling pays fewer α
        return math.inf
    return alpha * rounds_saved / (beta * bytes_saved)


def bus_bandwidth(collective, p, nbytes, seconds):
    """nccl-tests' two bandwidths: algorithm bandwidth n/t, and bus bandwidth, which scales it by the
    fraction of n each rank must move so that it can be set against one link's speed."""
    algbw = nbytes / seconds
    factor = {"allreduce": 2 * (p - 1) / p, "allgather": (p - 1) / p, "reduce_scatter": (p - 1) / p,
              "alltoall": (p - 1) / p}[collective]
    return algbw, algbw * factor


def cost_hierarchical_allgather(nbytes, gpu_bw, node_bw):
    """Bandwidth-bound all-gather of an nbytes result over many nodes: every GPU must take in about
    nbytes through its own links, every node about nbytes through its network ports; pipelined, the
    slower of the two decides."""
    return max(nbytes / gpu_bw, nbytes / node_bw)


# --- expert parallelism: a mixture-of-experts layer's token dispatch ------------------------
#
# Rank r holds ``tokens`` tokens of width ``width`` and expert r. A fixed, seeded gate picks one
# expert per token (top-1); tokens travel to their expert's rank by MPI's Alltoallv, are
# processed there, and come back by the inverse Alltoallv. Everything a rank uses is made from
# seeds, so the notebook can recompute any token's route and output in one process.

def moe_tokens(rank, tokens, width, seed=0):
    """The tokens rank ``rank`` holds: a seeded (tokens, width) float32 array."""
    return np.random.default_rng((seed, 1, rank)).standard_normal((tokens, width), dtype=np.float32)


def moe_gate(width, experts, seed=0):
    """The router's weights: logits = x @ gate, one column per expert."""
    return (np.random.default_rng((seed, 2)).standard_normal((width, experts), dtype=np.float32)
            / np.float32(math.sqrt(width)))


def moe_expert_weights(expert, width, seed=0):
    """Expert ``expert``'s feed-forward block: (width, 4 width) and (4 width, width) float32 matrices."""
    rng = np.random.default_rng((seed, 3, expert))
    w_in = rng.standard_normal((width, 4 * width), dtype=np.float32) / np.float32(math.sqrt(width))
    w_out = rng.standard_normal((4 * width, width), dtype=np.float32) / np.float32(math.sqrt(4 * width))
    return w_in, w_out


def moe_expert(x, weights):
    """What an expert does to its tokens: relu(x W_in) W_out, row by row."""
    w_in, w_out = weights
    return np.maximum(x @ w_in, 0) @ w_out


def moe_route(x, gate, skew=0.0):
    """Top-1 routing: each token's expert, the argmax of its logits. ``skew`` is added to expert 0's
    logit, a router that has learned to prefer one expert."""
    logits = x @ gate
    logits[:, 0] += skew
    return np.argmax(logits, axis=1)


def moe_capacity(tokens, experts, capacity_factor):
    """Tokens one rank may send to one expert: floor(c * T / E) of its T tokens (no limit for c = None).
    Each of the E ranks sends at most that many, so an expert receives at most c * (E T) / E: c times
    its fair share of all the tokens."""
    return tokens if capacity_factor is None else int(capacity_factor * tokens / experts)


def moe_keep(expert_of, experts, capacity):
    """Which tokens go to their expert: the first ``capacity`` routed to each, in token order; the
    others are dropped (they skip the layer: the residual connection carries them through)."""
    keep = np.zeros(len(expert_of), bool)
    for e in range(experts):
        keep[np.flatnonzero(expert_of == e)[:capacity]] = True
    return keep


class AlltoallAudit(AuditComm):
    """An AuditComm that lets MPI's ``Alltoall`` and ``Alltoallv`` through and records what they move:
    each block for another rank as one send event, each block from another rank as one receive
    event, whose ``tag`` numbers the all-to-all call it belongs to (0, 1, 2 ... on every rank alike).
    A rank's block for itself is a copy in its own memory, not a message, and is not recorded.
    Every other collective is still refused."""

    def __init__(self, comm):
        super().__init__(comm)
        self.calls = 0  # all-to-all calls made so far: the tag of the next one's events

    def Alltoall(self, sendbuf, recvbuf):
        self._comm.Alltoall(sendbuf, recvbuf)
        block = np.asarray(sendbuf).size // self.size
        self._record_blocks(np.full(self.size, block), np.full(self.size, block), np.asarray(sendbuf).itemsize)

    def Alltoallv(self, sendspec, recvspec):
        """``sendspec``/``recvspec``: ``[buffer, counts]`` (elements per rank, packed in rank order)."""
        (sendbuf, send_counts), (recvbuf, recv_counts) = sendspec, recvspec
        self._comm.Alltoallv([sendbuf, send_counts], [recvbuf, recv_counts])
        self._record_blocks(np.asarray(send_counts), np.asarray(recv_counts), np.asarray(sendbuf).itemsize)

    def _record_blocks(self, send_counts, recv_counts, itemsize):
        for op, counts in (("send", send_counts), ("recv", recv_counts)):
            for peer in range(self.size):
                if peer != self.rank and counts[peer]:
                    elements = int(counts[peer])
                    self._record(Event(op, peer, elements, elements * itemsize, tag=self.calls))
        self.calls += 1


def alltoall_traffic(log):
    """Bytes this rank sent and received in each all-to-all call of an AlltoallAudit's log:
    ``{call: {"sent": bytes, "received": bytes}}``."""
    traffic = {}
    for event in log:
        direction = {"send": "sent", "recv": "received"}[event.op]
        traffic.setdefault(event.tag, {"sent": 0, "received": 0})[direction] += event.nbytes
    return traffic


def moe_layer(comm, x, gate, weights, skew=0.0, capacity_factor=None, clock=None):
    """One expert-parallel MoE layer on this rank's tokens ``x``; ``weights``: this rank's expert.

    Route, drop past capacity, exchange counts (Alltoall), send tokens to their experts
    (Alltoallv), apply the expert, send the results back (the inverse Alltoallv: the counts
    swap roles), put them back in token order. Returns (output, expert of each token, kept,
    tokens received per source rank). ``clock``: a dict that collects each phase's seconds."""
    from mpi4py import MPI

    p, (tokens, width) = comm.Get_size(), x.shape
    tick = MPI.Wtime()

    def lap(name):
        nonlocal tick
        now = MPI.Wtime()
        if clock is not None:
            clock[name] = clock.get(name, 0.0) + now - tick
        tick = now

    expert_of = moe_route(x, gate, skew)
    keep = moe_keep(expert_of, p, moe_capacity(tokens, p, capacity_factor))
    kept = np.flatnonzero(keep)
    order = kept[np.argsort(expert_of[kept], kind="stable")]        # kept tokens, grouped by expert
    send_tokens = np.bincount(expert_of[kept], minlength=p).astype(np.int64)
    recv_tokens = np.empty(p, np.int64)
    comm.Alltoall(send_tokens, recv_tokens)                        # everyone learns what is coming
    inbox = np.empty((recv_tokens.sum(), width), np.float32)
    lap("route")
    comm.Alltoallv([np.ascontiguousarray(x[order]), send_tokens * width], [inbox, recv_tokens * width])
    lap("dispatch")
    processed = moe_expert(inbox, weights).astype(np.float32)
    lap("expert")
    returned = np.empty((len(order), width), np.float32)
    comm.Alltoallv([processed, recv_tokens * width], [returned, send_tokens * width])
    lap("combine")
    out = x.copy()                                                 # dropped tokens pass through
    out[order] = returned
    return out, expert_of, keep, recv_tokens


def moe_job(comm, tokens, width, cases, repeats=0, seed=0):
    """Run the MoE layer once, audited, for each case ``(skew, capacity_factor)``; with ``repeats``,
    also time each case that many times on the plain communicator.

    Returns, per case, ``{"output", "expert_of", "keep", "received", "log", "phases"}``, and with
    ``repeats`` ``"seconds"``: per repeat, this rank's seconds in each phase and the step's
    (``"step"``, the slowest rank's time from a common start)."""
    from mpi4py import MPI

    x = moe_tokens(comm.rank, tokens, width, seed)
    gate, weights = moe_gate(width, comm.size, seed), moe_expert_weights(comm.rank, width, seed)
    results = []
    for skew, capacity_factor in cases:
        audited = AlltoallAudit(comm)
        out, expert_of, keep, received = moe_layer(audited, x, gate, weights, skew, capacity_factor)
        result = {"output": out, "expert_of": expert_of, "keep": keep, "received": received,
                  "log": audited.log}
        seconds = []
        for _ in range(repeats):
            clock = {}
            comm.Barrier()
            start = MPI.Wtime()
            moe_layer(comm, x, gate, weights, skew, capacity_factor, clock)
            clock["step"] = comm.allreduce(MPI.Wtime() - start, op=MPI.MAX)
            seconds.append(clock)
        result["seconds"] = seconds
        results.append(result)
    return results


def moe_reference(p, tokens, width, skew=0.0, capacity_factor=None, seed=0):
    """The same layer in one process: every token through its own expert, or unchanged when dropped.
    Returns (outputs by rank, expert of each token by rank, kept by rank)."""
    gate = moe_gate(width, p, seed)
    experts = [moe_expert_weights(e, width, seed) for e in range(p)]
    outputs, routes, kept = [], [], []
    for rank in range(p):
        x = moe_tokens(rank, tokens, width, seed)
        expert_of = moe_route(x, gate, skew)
        keep = moe_keep(expert_of, p, moe_capacity(tokens, p, capacity_factor))
        out = x.copy()
        for i in np.flatnonzero(keep):
            out[i] = moe_expert(x[i:i + 1], experts[expert_of[i]])[0]
        outputs.append(out)
        routes.append(expert_of)
        kept.append(keep)
    return outputs, routes, kept


def moe_times(p, tokens, width, cases, repeats=7, seed=0):
    """Time the MoE layer on ``p`` ranks for each case ``(skew, capacity_factor)``, each rank's
    matrix products on one thread: one core per rank, as one GPU per rank. Returns ``moe_job``'s
    results by rank."""
    with rank_environment(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1"):
        return mpi.run(moe_job, p, tokens, width, cases, repeats, seed, timeout=120).check().results


def moe_routing_matrix(routes, kept, p):
    """N[r, e]: the tokens rank r sends to expert e (those its router picked and capacity kept)."""
    matrix = np.zeros((p, p), np.int64)
    for rank, (expert_of, keep) in enumerate(zip(routes, kept)):
        matrix[rank] = np.bincount(expert_of[keep], minlength=p)
    return matrix
