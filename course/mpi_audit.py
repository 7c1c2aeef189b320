"""A communicator that records every message: what an algorithm *does*, not just what it returns.

    from course.mpi_audit import AuditComm, rounds
    audited = AuditComm(comm)            # wraps an mpi4py communicator
    ring_allreduce(audited, x)           # the algorithm runs as usual
    audited.log                          # [Event(op, peer, elements, nbytes, tag, ...), ...]
    audited.totals()                     # messages and elements sent and received by this rank

Point-to-point calls pass through to the real communicator (``Send``,
``Recv``, ``Sendrecv``, ``Isend``, ``Irecv``, their lowercase pickle-based
cousins, and the completion of the requests they return, by ``request.Wait()``
or ``MPI.Request.Waitall(requests)``); each becomes an :class:`Event` in this
rank's log. MPI's own collectives (``Bcast``,
``Allreduce``, ``barrier`` …) are refused with :class:`CollectiveNotAllowed`:
the labs build those from point-to-point messages.

Gather every rank's log (return ``audited.log`` from the rank) and
:func:`rounds` replays them together: it pairs each receive with its send (MPI
never lets two messages between one pair of ranks with one tag overtake each
other) and finds the longest chain of communication steps any rank waits on —
``ceil(log2 p)`` for a binomial-tree broadcast, ``p - 1`` for one that sends
to every rank in turn, one per ring step whether the step is a ``Sendrecv``
or an ``Irecv`` and ``Isend`` completed together.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

COLLECTIVES = {
    "Bcast", "bcast", "Reduce", "reduce", "Allreduce", "allreduce", "Gather", "gather", "Gatherv",
    "Allgather", "allgather", "Allgatherv", "Scatter", "scatter", "Scatterv", "Alltoall", "alltoall",
    "Alltoallv", "Reduce_scatter", "Reduce_scatter_block", "Scan", "scan", "Exscan", "exscan",
    "Barrier", "barrier", "Ibarrier", "Ibcast", "Iallreduce", "Ireduce", "Iallgather", "Ialltoall",
    "Ireduce_scatter", "Ireduce_scatter_block", "Igather", "Iscatter", "Neighbor_allgather",
    "Neighbor_alltoall",
}


class CollectiveNotAllowed(RuntimeError):
    pass


@dataclass(frozen=True)
class Event:
    op: str  # send, recv, sendrecv, isend, irecv, wait
    peer: int | None  # the other rank (for sendrecv: the destination; see source)
    elements: int = 0  # elements sent (send side) or received (recv side)
    nbytes: int = 0
    tag: int = 0
    source: int | None = None  # sendrecv: where the received part came from (negative: any)
    recv_elements: int = 0  # sendrecv: elements received
    request: int | None = None  # isend/irecv: the request's number; wait: the ones it completed


def _size(buf) -> tuple[int, int]:
    """(elements, bytes) of an mpi4py buffer argument: an array, or [array, MPI type]."""
    if isinstance(buf, (list, tuple)):
        buf = buf[0]
    array = np.asarray(buf)
    return int(array.size), int(array.nbytes)


def _pickled_size(obj) -> tuple[int, int]:
    import pickle

    data = pickle.dumps(obj)
    return (int(np.asarray(obj).size) if isinstance(obj, np.ndarray) else 1), len(data)


@functools.cache
def _request_type():
    """AuditRequest: an mpi4py ``Request`` (so ``MPI.Request.Waitall`` and the like take it)
    whose completion is recorded. Made on first use: importing mpi4py starts MPI."""
    from mpi4py import MPI

    class AuditRequest(MPI.Request):
        def __new__(cls, comm, request, number):
            self = super().__new__(cls, request)  # the same MPI request
            self._comm, self._request, self.number = comm, request, number  # _request keeps it alive
            return self

        def Wait(self, status=None):
            result = super().Wait(status)
            self._comm._completed(self)
            return result

        def Test(self, status=None):
            done = super().Test(status)
            if done:
                self._comm._completed(self)
            return done

        wait, test = Wait, Test

    return AuditRequest


class AuditComm:
    """Wraps a communicator; see the module docstring."""

    def __init__(self, comm, synchronous_sends: bool = False):
        """``synchronous_sends``: run ``Send`` as ``Ssend``, which returns only once the
        matching receive has started. MPI allows any ``Send`` to behave so; MPICH
        buffers small messages instead, which hides send orders that deadlock once
        messages are large. Graders turn it on so such an order deadlocks at any size."""
        from mpi4py import MPI

        self._comm, self._MPI = comm, MPI
        self._synchronous = synchronous_sends
        self._log: list[Event] = []
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._requests = 0
        self._pending = {}  # id -> request not seen complete yet (by id: requests compare by MPI handle)

    @property
    def log(self) -> list[Event]:
        self._flush()
        return self._log

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def _record(self, event: Event) -> None:
        self._flush()
        self._log.append(event)

    def _completed(self, request) -> None:
        if self._pending.pop(id(request), None) is not None:
            self._log.append(Event("wait", None, request=request.number))

    def _flush(self) -> None:
        """Record the requests completed behind our back (``MPI.Request.Waitall(requests)``
        sets each to REQUEST_NULL): they were done before whatever is recorded next."""
        for request in list(self._pending.values()):
            if request == self._MPI.REQUEST_NULL:
                self._completed(request)

    def _source(self, status, source):
        return status.Get_source() if source == self._MPI.ANY_SOURCE else source

    # -- blocking ------------------------------------------------------------------
    def Send(self, buf, dest, tag=0):
        elements, nbytes = _size(buf)
        self._record(Event("send", dest, elements, nbytes, tag))
        return (self._comm.Ssend if self._synchronous else self._comm.Send)(buf, dest, tag)

    def Recv(self, buf, source=None, tag=None, status=None):
        source, tag = self._any(source, tag)
        status = status or self._MPI.Status()
        self._comm.Recv(buf, source, tag, status)
        elements, nbytes = _size(buf)
        self._record(Event("recv", status.Get_source(), elements, nbytes, status.Get_tag()))

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=None, recvtag=None, status=None):
        source, recvtag = self._any(source, recvtag)
        status = status or self._MPI.Status()
        self._comm.Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag, status)
        elements, nbytes = _size(sendbuf)
        received = _size(recvbuf)[0] if recvbuf is not None else 0
        self._record(Event("sendrecv", dest, elements, nbytes, sendtag, status.Get_source(), received))

    def send(self, obj, dest, tag=0):
        elements, nbytes = _pickled_size(obj)
        self._record(Event("send", dest, elements, nbytes, tag))
        return self._comm.send(obj, dest, tag)

    def recv(self, buf=None, source=None, tag=None, status=None):
        source, tag = self._any(source, tag)
        status = status or self._MPI.Status()
        obj = self._comm.recv(buf, source, tag, status)
        elements, nbytes = _pickled_size(obj)
        self._record(Event("recv", status.Get_source(), elements, nbytes, status.Get_tag()))
        return obj

    def sendrecv(self, sendobj, dest, sendtag=0, recvbuf=None, source=None, recvtag=None, status=None):
        source, recvtag = self._any(source, recvtag)
        status = status or self._MPI.Status()
        obj = self._comm.sendrecv(sendobj, dest, sendtag, recvbuf, source, recvtag, status)
        elements, nbytes = _pickled_size(sendobj)
        self._record(Event("sendrecv", dest, elements, nbytes, sendtag, status.Get_source(),
                           _pickled_size(obj)[0]))
        return obj

    # -- non-blocking -----------------------------------------------------------------
    def Isend(self, buf, dest, tag=0):
        self._requests += 1
        elements, nbytes = _size(buf)
        self._record(Event("isend", dest, elements, nbytes, tag, request=self._requests))
        return self._request(self._comm.Isend(buf, dest, tag))

    def Irecv(self, buf, source=None, tag=None):
        # The source of an ANY_SOURCE receive is known only at Wait; labs name their sources.
        source, tag = self._any(source, tag)
        self._requests += 1
        elements, nbytes = _size(buf)
        self._record(Event("irecv", source, elements, nbytes, tag, request=self._requests))
        return self._request(self._comm.Irecv(buf, source, tag))

    def _request(self, request):
        request = _request_type()(self, request, self._requests)
        self._pending[id(request)] = request
        return request

    def _any(self, source, tag):
        return (self._MPI.ANY_SOURCE if source is None else source), (self._MPI.ANY_TAG if tag is None else tag)

    # -- everything else ------------------------------------------------------------------
    def __getattr__(self, name):
        if name in COLLECTIVES:
            raise CollectiveNotAllowed(
                f"comm.{name} is one of MPI's own collectives, which this communicator refuses: "
                "the code under test must use point-to-point calls only (Send/Recv/Sendrecv, Isend/Irecv)")
        raise AttributeError(f"the audited communicator offers point-to-point calls, rank and size only "
                             f"(no {name!r})")

    # -- what the log says -------------------------------------------------------------
    def totals(self) -> dict:
        """Messages and elements this rank sent and received."""
        return totals(self.log)


def totals(log) -> dict:
    sent = [e for e in log if e.op in ("send", "isend", "sendrecv")]
    received = [e for e in log if e.op in ("recv", "irecv")]
    return {"messages_sent": len(sent), "elements_sent": sum(e.elements for e in sent),
            "bytes_sent": sum(e.nbytes for e in sent),
            "messages_received": len(received) + sum(1 for e in log if e.op == "sendrecv"),
            "elements_received": sum(e.elements for e in received) + sum(e.recv_elements for e in log
                                                                          if e.op == "sendrecv")}


def rounds(logs: list[list[Event]]) -> int:
    """The longest chain of communication steps in a job, from every rank's log.

    A send (blocking or not, or the send half of a sendrecv) takes its rank one
    step: a rank sends one message at a time. A receive completes no earlier
    than the step of the send it matches; a non-blocking one counts at its
    wait, and posting it costs nothing. So one step of ``Irecv``, ``Isend`` and
    a wait on both is one round, as are ``Isend`` + ``Recv`` and a ``Sendrecv``.
    """
    # The k-th message from a to b with tag t is the k-th such receive at b.
    sends: dict[tuple, list] = {}
    for rank, log in enumerate(logs):
        for i, e in enumerate(log):
            if e.op in ("send", "isend", "sendrecv"):
                sends.setdefault((rank, e.peer, e.tag), []).append((rank, i))
    matched: dict[tuple, tuple] = {}
    taken: dict[tuple, int] = {}
    for rank, log in enumerate(logs):
        for i, e in enumerate(log):
            source = e.source if e.op == "sendrecv" else e.peer if e.op in ("recv", "irecv") else None
            if source is None or source < 0:
                continue
            key = (source, rank, e.tag)
            k = taken.get(key, 0)
            taken[key] = k + 1
            if k < len(sends.get(key, [])):
                matched[(rank, i)] = sends[key][k]

    request_event = {(rank, e.request): i for rank, log in enumerate(logs)
                     for i, e in enumerate(log) if e.op in ("isend", "irecv")}

    def arrival(r, j):
        """The send whose message event j of rank r waits for, if any."""
        e = logs[r][j]
        if e.op in ("recv", "sendrecv"):
            return matched.get((r, j))
        if e.op == "wait":
            return matched.get((r, request_event[(r, e.request)]))
        return None

    def inputs(r, j):
        """The events whose steps event j's step depends on: the rank's previous
        event, and the one before the matched send (that send goes out one step later)."""
        found = arrival(r, j)
        return [(r, j - 1)] + ([(found[0], found[1] - 1)] if found else [])

    # reached[(r, j)]: the step rank r has reached once event j is done; before its first event, 0.
    reached = {(rank, -1): 0 for rank in range(len(logs))}
    for rank, log in enumerate(logs):
        for i in range(len(log)):
            stack = [(rank, i)]
            while stack:  # depth-first, without recursion: chains can be long
                node = stack[-1]
                if node in reached:
                    stack.pop()
                    continue
                missing = [n for n in inputs(*node) if n not in reached]
                if missing:
                    stack.extend(missing)
                    continue
                stack.pop()
                r, j = node
                step = reached[(r, j - 1)] + (logs[r][j].op in ("send", "isend", "sendrecv"))
                found = arrival(r, j)
                if found:  # the message lands in the step its sender sent it in
                    step = max(step, reached[(found[0], found[1] - 1)] + 1)
                reached[node] = step
    return max(reached.values(), default=0)
