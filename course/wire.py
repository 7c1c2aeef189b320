"""What crossed between processes, as the kernel counted it: the payload bytes of
every TCP connection in this network namespace (Linux's sock_diag, what ``ss -ti``
prints as bytes_sent and bytes_received).

``course.dist`` ranks talk over loopback TCP, gloo's connections and the
rendezvous store's. The kernel counts each connection's bytes whatever the
process on either end does, so a count taken by a process that runs none of the
ranks' code (the launcher) is a measure a rank cannot turn off from inside, as it
can an in-process op log (a TorchDispatchMode). In the grader's sandbox the
namespace is the sandbox's own (bubblewrap's ``--unshare-net``), so only the job's
own connections are in it.

    seen = Connections()
    seen.sample()          # first: what is there already is not counted
    seen.sample()          # as often as the job may open and close connections
    seen.bytes_sent()      # over every connection within this machine opened since the first

``gloo_bytes`` gives what gloo's collectives send, all ranks together, as
measured here: a ring all-reduce, and a reduce-scatter that gloo runs as a whole
all-reduce (NCCL's costs half as much).

A connection counts from its first sample to its last: one opened and closed
between two samples is missed, which is why a job's ``Counter`` samples while the
job runs and once more before any rank may leave.

A job's launcher (``course.dist.run`` or ``course.mpi.run`` with
``count_wire=True``) keeps a ``Counter``; the ranks call ``mark(name)`` together
between the phases a harness wants counted apart, and ``job.wire["marks"]`` holds
the bytes that had crossed by each.
"""
from __future__ import annotations

import hashlib
import os
import socket
import struct
import sys
import time
from pathlib import Path

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_DONE, NLMSG_ERROR = 3, 2
INET_DIAG_INFO = 2
ALL_STATES = 0xFFF
# struct tcp_info (linux/tcp.h): tcpi_bytes_received at 128, tcpi_bytes_sent at 200 and
# tcpi_bytes_retrans at 208 (Linux 4.19 and later), all u64.
BYTES_RECEIVED, BYTES_SENT, BYTES_RETRANS = 128, 200, 208
_HEADER = struct.Struct("=IHHII")  # nlmsghdr
_REQUEST = struct.Struct("=BBBxI48s")  # inet_diag_req_v2, the socket id left zero: every socket
_MESSAGE = struct.Struct("=BBBB2s2s16s16sI8sIIIII")  # inet_diag_msg
_V4_MAPPED = bytes(10) + b"\xff\xff"


def _loopback(address: bytes) -> bool:
    """127.0.0.0/8 (as AF_INET, or mapped into IPv6, as the rendezvous store listens) or ::1."""
    return address[0] == 127 or address[:13] == _V4_MAPPED + b"\x7f" or address == bytes(15) + b"\x01"


def gloo_bytes(kind: str, nbytes: int, p: int) -> int:
    """Payload bytes that one collective of gloo sends, summed over its ``p`` ranks,
    for ``nbytes`` of input per rank (all-gather: each rank's shard)."""
    if p == 1:
        return 0
    per_kind = {
        "all_reduce": 2 * (p - 1) * nbytes,  # ring: reduce-scatter then all-gather, (p-1)/p each way per rank
        "reduce_scatter": 2 * (p - 1) * nbytes,  # gloo all-reduces the whole input, then keeps the shard
        "all_gather": p * (p - 1) * nbytes,  # every rank receives the p-1 shards it lacks
        "all_to_all": (p - 1) * nbytes,  # every rank keeps 1/p of its input and sends the rest
        "broadcast": (p - 1) * nbytes,  # the root sends the whole tensor to each
        "send": nbytes,
    }
    return per_kind[kind]


def gloo_messages(kind: str, p: int) -> int:
    """Messages that one collective of gloo sends, summed over its ``p`` ranks (each
    carries a few hundred bytes of gloo's own at most)."""
    per_rank = {"all_reduce": 2 * (p - 1), "reduce_scatter": 2 * (p - 1), "all_gather": p - 1,
                "all_to_all": p - 1, "broadcast": (p - 1) / p, "send": 1 / p}[kind]
    return round(per_rank * p)


def available() -> str:
    """"" where the kernel's counters can be read here, else why not."""
    if not sys.platform.startswith("linux"):
        return "the kernel's per-connection byte counters are read with Linux's sock_diag"
    try:
        list(_dump(socket.AF_INET))
    except OSError as exc:
        return f"sock_diag cannot be read here: {exc}"
    return ""


def _dump(family: int):
    """(local port, remote port, inode, bytes sent, bytes received, owner's uid) of every
    TCP socket between two loopback addresses, or from an address to itself."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as nl:
        request = _REQUEST.pack(family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), ALL_STATES, b"")
        nl.send(_HEADER.pack(_HEADER.size + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0)
                + request)
        while True:
            data = nl.recv(1 << 16)
            offset = 0
            while offset + _HEADER.size <= len(data):
                length, kind, _, _, _ = _HEADER.unpack_from(data, offset)
                if kind == NLMSG_DONE:
                    return
                if kind == NLMSG_ERROR:
                    raise OSError("sock_diag answered with an error")
                found = _parse(data[offset + _HEADER.size:offset + length])
                if found:
                    yield found
                offset += (length + 3) & ~3


def _parse(body: bytes):
    fields = _MESSAGE.unpack_from(body)
    if not (_loopback(fields[6]) and _loopback(fields[7]) or fields[6] == fields[7]):
        return None  # a connection leaving this machine (one to itself may use any of its addresses)
    sport, dport, uid, inode = int.from_bytes(fields[4], "big"), int.from_bytes(fields[5], "big"), fields[13], fields[14]
    sent = received = 0
    offset = _MESSAGE.size
    while offset + 4 <= len(body):
        length, kind = struct.unpack_from("=HH", body, offset)
        if length < 4:
            break
        if kind == INET_DIAG_INFO:
            info = body[offset + 4:offset + length]
            if len(info) >= BYTES_RETRANS + 8:
                sent = (struct.unpack_from("=Q", info, BYTES_SENT)[0]
                        - struct.unpack_from("=Q", info, BYTES_RETRANS)[0])
            if len(info) >= BYTES_RECEIVED + 8:
                received = struct.unpack_from("=Q", info, BYTES_RECEIVED)[0]
        offset += (length + 3) & ~3
    return sport, dport, inode, sent, received, uid


class Connections:
    """Every TCP connection within this machine in this namespace seen by ``sample``
    and not by the first, with the most bytes each was seen to have sent."""

    def __init__(self):
        self.before: set = set()  # connections that were there before the job: not its
        self.sent: dict = {}  # (local port, remote port, inode) -> bytes sent
        self.owner: dict = {}  # (local port, remote port, inode) -> the uid of the socket's owner
        self.started = False

    def sample(self) -> None:
        seen = set()
        for family in (socket.AF_INET, socket.AF_INET6):
            for sport, dport, inode, sent, _, uid in _dump(family):
                key = (sport, dport, inode)
                seen.add(key)
                if not self.started:
                    self.before.add(key)
                elif key not in self.before and dport:
                    self.sent[key] = max(sent, self.sent.get(key, 0))
                    self.owner[key] = uid
        self.started = True

    def bytes_sent(self) -> int:
        return sum(self.sent.values())

    def bytes_sent_by_uid(self) -> dict:
        """{uid: bytes sent over the connections that user's sockets hold}: per rank, where
        each rank has a user of its own (``autograder.sandbox.rank_isolation``)."""
        found: dict = {}
        for key, sent in self.sent.items():
            found[self.owner[key]] = found.get(self.owner[key], 0) + sent
        return found

    def as_dict(self) -> dict:
        return {"bytes": self.bytes_sent(), "connections": len(self.sent)}


# --- a job's count, and the marks its ranks make ------------------------------------------------

WIRE_FOLDER, WIRE_RANK, WIRE_RANKS = "K2C_WIRE_FOLDER", "K2C_WIRE_RANK", "K2C_WIRE_RANKS"  # set in each rank


def _key(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()[:16]


class Counter:
    """What crossed between a job's ranks, counted by its launcher, which runs none of
    their code: every TCP connection made within this machine since the counter was
    made (before any rank starts). It samples whenever ``sample`` is called (the
    launcher's wait loop), at every ``mark`` once all its ranks have made it, and
    once more when every rank has replied (``rank-N.pkl``); the ranks wait for that
    last count (the file ``counted``) before they leave, which closes their
    connections."""

    def __init__(self, folder: Path, n: int):
        self.folder, self.n, self.why_not = Path(folder), n, available()
        self.seen = None if self.why_not else Connections()
        self.marks = []  # (name, bytes sent by then), in the order they were made
        self.done: set = set()
        self.counted = False
        self.sample()  # what is there before the job is not the job's

    def sample(self) -> None:
        if self.seen is None or self.counted:
            return
        self.seen.sample()
        waiting: dict = {}
        for path in self.folder.glob("mark-*"):
            key, _ = path.name[5:].split("-", 1)
            if key not in self.done and not path.name.endswith(".tmp"):
                waiting.setdefault(key, []).append(path)
        for key, paths in waiting.items():
            ranks, name = paths[0].read_text().split("\n", 1)
            if len(paths) >= int(ranks):
                self.seen.sample()
                self.marks.append((name, self.seen.bytes_sent()))
                self.done.add(key)
                (self.folder / f"marked-{key}").write_text("")
        if all((self.folder / f"rank-{rank}.pkl").exists() for rank in range(self.n)):
            self.seen.sample()
            self.counted = True
            (self.folder / "counted").write_text("")

    def as_dict(self) -> dict:
        if self.seen is None:
            return {"unavailable": self.why_not}
        return {**self.seen.as_dict(), "marks": self.marks, "complete": self.counted}


def mark(name: str, ranks: int | None = None, timeout: float = 30) -> None:
    """Made by ranks 0 .. ``ranks`` - 1 of a counted job (all of them by default), each
    once, with the same ``name`` (unique in the job): the launcher notes the bytes
    that have crossed by then, and each rank waits until it has. Outside a counted
    job, a no-op."""
    folder = os.environ.get(WIRE_FOLDER)
    if not folder:
        return
    rank, ranks = os.environ[WIRE_RANK], ranks or int(os.environ[WIRE_RANKS])
    key = _key(name)
    path = Path(folder) / f"mark-{key}-{rank}"
    path.with_suffix(".tmp").write_text(f"{ranks}\n{name}")
    path.with_suffix(".tmp").rename(path)
    waited = time.monotonic() + timeout
    while not (Path(folder) / f"marked-{key}").exists():
        if time.monotonic() > waited:
            raise RuntimeError(f"course.wire.mark({name!r}): the launcher did not count within {timeout:g} s")
        time.sleep(0.001)


def wait_until_counted(folder, timeout: float = 30) -> None:
    """A rank that has replied: wait for the launcher's last count before leaving."""
    waited = time.monotonic() + timeout
    while not (Path(folder) / "counted").exists() and time.monotonic() < waited:
        time.sleep(0.002)
