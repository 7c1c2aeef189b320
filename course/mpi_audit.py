"""A communicator that records every message: what an algorithm *does*, not just what it returns.

    from course.mpi_audit import AuditComm, rounds
    audited = AuditComm(comm)            # wraps an mpi4py communicator
    ring_allreduce(audited, x)           # the algorithm runs as usual
    audited.log                          # [Event(op, peer, elements, nbytes, tag, ...), ...]
    audited.totals()                     # messages and elements sent and received by this rank

Point-to-point calls pass through to the real communicator (``Send``,
``Recv``, ``Sendrecv``, ``Isend``, ``Irecv``, their lowercase pickle-based
cousins, ``Wait``/``Waitall`` on the requests they return); each becomes an
:class:`Event` in this rank's log. MPI's own collectives (``Bcast``,
``Allreduce``, ``barrier`` …) are refused with :class:`CollectiveNotAllowed`:
the labs build those from point-to-point messages.

Gather every rank's log (return ``audited.log`` from the rank) and
:func:`rounds` replays them together: it pairs each receive with its send (MPI
never lets two messages between one pair of ranks with one tag overtake each
other) and finds the longest chain of communication steps any rank waits on —
``ceil(log2 p)`` for a binomial-tree broadcast, ``p - 1`` for one that sends
to every rank in turn.
"""
from __future__ import annotations

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


class AuditRequest:
    """A request from Isend/Irecv whose completion is recorded."""

    def __init__(self, comm: "AuditComm", request, number: int):
        self._comm, self._request, self.number = comm, request, number

    def Wait(self, status=None):
        result = self._request.Wait(status)
        self._comm._record(Event("wait", None, request=self.number))
        return result

    wait = Wait

    def Test(self, status=None):
        done = self._request.Test(status)
        if done:
            self._comm._record(Event("wait", None, request=self.number))
        return done

    @staticmethod
    def Waitall(requests, statuses=None):
        for r in requests:
            r.Wait()

    waitall = Waitall


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
        self.log: list[Event] = []
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._requests = 0

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def _record(self, event: Event) -> None:
        self.log.append(event)

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
        return AuditRequest(self, self._comm.Isend(buf, dest, tag), self._requests)

    def Irecv(self, buf, source=None, tag=None):
        # The source of an ANY_SOURCE receive is known only at Wait; labs name their sources.
        source, tag = self._any(source, tag)
        self._requests += 1
        elements, nbytes = _size(buf)
        self._record(Event("irecv", source, elements, nbytes, tag, request=self._requests))
        return AuditRequest(self, self._comm.Irecv(buf, source, tag), self._requests)

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

    A send takes its rank one step; a receive completes no earlier than the step
    of the send it matches; a sendrecv is one step that both sends and waits for
    its message. Non-blocking sends and receives are steps too (posted at once);
    a wait completes no earlier than what it waits for.
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

    def needs(node):
        """The values a node's value is the max of (its inputs), and its own increment."""
        kind, r, j = node
        e, previous = logs[r][j], [("done", r, j - 1)] if j > 0 else []
        if kind == "posted":  # a send or a posted request takes its rank one step
            return previous, 1
        inputs = [("posted", r, j)] if e.op in ("send", "isend", "irecv", "sendrecv") else previous
        if e.op in ("recv", "sendrecv") and (r, j) in matched:
            inputs.append(("posted",) + matched[(r, j)])
        if e.op == "wait":
            posted = request_event[(r, e.request)]
            inputs.append(("done", r, posted))
            if (r, posted) in matched:  # an irecv's message has landed by its wait
                inputs.append(("posted",) + matched[(r, posted)])
        return inputs, 0

    value: dict[tuple, int] = {}
    for rank, log in enumerate(logs):
        for i in range(len(log)):
            stack = [("done", rank, i)]
            while stack:  # depth-first, without recursion: chains can be long
                node = stack[-1]
                if node in value:
                    stack.pop()
                    continue
                inputs, increment = needs(node)
                missing = [n for n in inputs if n not in value]
                if missing:
                    stack.extend(missing)
                    continue
                stack.pop()
                value[node] = max([value[n] for n in inputs], default=0) + increment
    return max((v for (kind, _, _), v in value.items() if kind == "done"), default=0)
