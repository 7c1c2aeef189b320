"""What keeps one rank of a job from its peers: the ranks share the network, and nothing else.

On a cluster each rank has a machine of its own: what one rank knows reaches
another only over the network. Ranks on one machine could also meet in a
shared ``/tmp``, ``/dev/shm``, System V shared memory, a unix socket, or each
other's memory. ``enter(rank)`` closes those ways, in this order, in a rank's
process before anything of the student's loads:

1. a mount namespace and an IPC namespace of its own (``unshare``), with empty
   private ``/tmp``, ``/dev/shm`` and ``/var/tmp`` (tmpfs, size-capped), and its
   ``/proc/self/clear_refs`` masked, so the launcher's reading of its peak memory
   (``VmHWM``) cannot be reset;
2. a user of its own (``RANK_UID + rank``), no groups, no capabilities, no way to
   gain any (``PR_SET_NO_NEW_PRIVS``): no rank can signal, trace or read the
   memory of another, or of the launcher;
3. a seccomp filter: no new processes (threads only: a child could hold memory
   the launcher does not see, and outlive the measure), no unix-domain sockets
   (abstract ones would be a channel between ranks that no byte counter sees),
   no datagram or raw sockets. TCP over loopback remains: gloo's and MPICH's
   connections, whose bytes the kernel counts (``course.wire``).

Step 1 needs CAP_SYS_ADMIN and step 2 CAP_SETUID and CAP_SETGID in the launcher:
the grader run as root has them (in bubblewrap, the server keeps them for this;
``autograder.sandbox.isolation``). ``plan()`` says what this launcher can do:

- root with all three: every step (what the instructor's grader gives);
- root without CAP_SYS_ADMIN (a container that withholds it, as Docker does by
  default): users of their own and the filter, but ``/tmp`` and ``/dev/shm`` are
  shared: a rank never runs as root, and the report says the ranks could meet there;
- an ordinary user (a student's laptop): the filter alone; the ranks share the
  user, its files and ``/tmp``, and the report says so.
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct

RANK_UID = 64000  # rank r runs as RANK_UID + r (and group RANK_UID + r): users no system gives anyone
TMPFS_BYTES = 512 * 2**20  # each private /tmp, /dev/shm, /var/tmp: files count as the rank's memory too
PRIVATE_FOLDERS = ("/tmp", "/dev/shm", "/var/tmp")

CLONE_NEWNS, CLONE_NEWIPC = 0x00020000, 0x08000000
MS_REC, MS_PRIVATE, MS_BIND, MS_REMOUNT, MS_RDONLY, MS_NOSUID, MS_NODEV = 0x4000, 0x40000, 0x1000, 0x20, 0x1, 0x2, 0x4
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
_libc = ctypes.CDLL(None, use_errno=True)


CAP_SETGID, CAP_SETUID, CAP_SYS_ADMIN = 6, 7, 21


def _capabilities() -> int:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return 0


def plan() -> dict:
    """What ``enter`` does here: ``{"users": ranks get users of their own, "private":
    and their own /tmp, /dev/shm and IPC, "why": what is missing ("" when nothing)}``."""
    caps = _capabilities()
    users = os.geteuid() == 0 and bool(caps >> CAP_SETUID & 1) and bool(caps >> CAP_SETGID & 1)
    private = users and bool(caps >> CAP_SYS_ADMIN & 1)
    why = []
    if not users:
        why.append("the grader does not run as root, so its ranks share its user, its files and /tmp")
    elif not private:
        why.append("the launcher lacks CAP_SYS_ADMIN (a container that withholds it), so the ranks share /tmp "
                   "and /dev/shm")
    if _architecture() is None:
        why.append(f"no seccomp filter for {platform.machine()} (x86_64 and aarch64 only)")
    return {"users": users, "private": private, "why": "; ".join(why)}


def available() -> str:
    """"" when ranks can be kept fully apart here, else what is missing."""
    return plan()["why"]


def uid_of(rank: int) -> int:
    return RANK_UID + rank


def enter(rank: int, keep: list[str] = ()) -> None:
    """Make this process rank ``rank``'s, kept apart from its peers as far as ``plan()``
    allows (see the module docstring). ``keep``: folders the rank reads that lie in one
    of ``PRIVATE_FOLDERS`` (the submission's copy, the harness, its inputs, a Python
    installed under /tmp): shown again, read-only, at their own paths. Raises OSError
    when a step fails: a rank must not run half-isolated, nor ever as root."""
    can = plan()
    if can["private"]:
        _private_mounts(keep)
    if can["users"]:
        uid = uid_of(rank)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # clears every capability
    elif os.geteuid() == 0:
        raise OSError(errno.EPERM, "a rank must not run as root, and this launcher cannot make it another user")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    if _architecture() is not None:
        install_filter()


def _private_mounts(keep) -> None:
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWIPC), "unshare")
    _check(_libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    private = [f for f in PRIVATE_FOLDERS if os.path.isdir(f) and not os.path.islink(f)]
    kept = _outermost(p for p in keep if any(_under(p, f) for f in private))
    held = {path: os.open(path, os.O_PATH) for path in kept if os.path.exists(path)}  # before they are covered
    for folder in private:
        options = f"size={TMPFS_BYTES},mode=1777".encode()
        _check(_libc.mount(b"tmpfs", folder.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options),
               f"mount tmpfs on {folder}")
    for path, fd in held.items():
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(path, mode=0o755, exist_ok=True)  # root's, in the rank's fresh tmpfs: it cannot change them
        else:  # a single file (a package's __init__.py): a bind mount needs a file to cover
            os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o444))
        source = f"/proc/self/fd/{fd}".encode()
        _check(_libc.mount(source, path.encode(), None, MS_BIND | MS_REC, None), f"show {path} again")
        _check(_libc.mount(None, path.encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None),
               f"make {path} read-only")
        os.close(fd)
    clear_refs = f"/proc/{os.getpid()}/clear_refs".encode()
    _check(_libc.mount(b"/dev/null", clear_refs, None, MS_BIND, None), "mask clear_refs")


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _outermost(paths) -> list[str]:
    """The paths none of the others holds."""
    found: list[str] = []
    for path in sorted({os.path.realpath(p) for p in paths}):
        if not any(_under(path, kept) for kept in found):
            found.append(path)
    return found


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


# --- the seccomp filter -------------------------------------------------------------------

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
SYSCALLS = {  # the system calls the filter looks at, by architecture (None: the architecture has none)
    "x86_64": {"socket": 41, "clone": 56, "fork": 57, "vfork": 58, "clone3": 435},
    "aarch64": {"socket": 198, "clone": 220, "fork": None, "vfork": None, "clone3": 435},
}
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
SOCK_STREAM, SOCK_TYPE_MASK = 1, 0xF
CLONE_THREAD = 0x00010000
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO, SECCOMP_RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6] (little-endian: the low half first)
NR, ARCH, ARG0, ARG1 = 0, 4, 16, 24
LD_W_ABS, JEQ_K, JGE_K, JSET_K, AND_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x54, 0x06
X32_SYSCALL_BIT = 0x40000000  # x86_64's x32 calls: the same numbers with this bit, refused outright


def _architecture() -> str | None:
    machine = platform.machine()
    return machine if machine in AUDIT_ARCH else None


def _program() -> list[tuple[int, int, int, int]]:
    """The filter, as (code, jt, jf, k) instructions: see the module docstring."""
    arch = _architecture()
    calls = SYSCALLS[arch]
    eperm, enosys = SECCOMP_RET_ERRNO | errno.EPERM, SECCOMP_RET_ERRNO | errno.ENOSYS
    program = [(LD_W_ABS, 0, 0, ARCH), (JEQ_K, 1, 0, AUDIT_ARCH[arch]), (RET_K, 0, 0, SECCOMP_RET_KILL_PROCESS),
               (LD_W_ABS, 0, 0, NR), (JGE_K, 0, 1, X32_SYSCALL_BIT), (RET_K, 0, 0, eperm)]
    for name in ("fork", "vfork"):
        if calls[name] is not None:
            program += [(JEQ_K, 0, 1, calls[name]), (RET_K, 0, 0, eperm)]
    # clone3: "not here", and glibc falls back to clone for its threads
    program += [(JEQ_K, 0, 1, calls["clone3"]), (RET_K, 0, 0, enosys)]
    program += [(JEQ_K, 0, 4, calls["clone"]), (LD_W_ABS, 0, 0, ARG0), (JSET_K, 0, 1, CLONE_THREAD),
                (RET_K, 0, 0, SECCOMP_RET_ALLOW), (RET_K, 0, 0, eperm)]
    program += [(JEQ_K, 0, 10, calls["socket"]), (LD_W_ABS, 0, 0, ARG0),
                (JEQ_K, 6, 0, AF_NETLINK),  # interface lists (getifaddrs): read-only
                (JEQ_K, 1, 0, AF_INET), (JEQ_K, 0, 5, AF_INET6),
                (LD_W_ABS, 0, 0, ARG1), (AND_K, 0, 0, SOCK_TYPE_MASK), (JEQ_K, 1, 0, SOCK_STREAM),
                (RET_K, 0, 0, eperm), (RET_K, 0, 0, SECCOMP_RET_ALLOW), (RET_K, 0, 0, eperm)]
    return program + [(RET_K, 0, 0, SECCOMP_RET_ALLOW)]


def install_filter() -> None:
    """Install the filter on this process (and every thread it starts); it cannot be removed."""
    program = _program()
    code = b"".join(struct.pack("=HBBI", *instruction) for instruction in program)
    filters = ctypes.create_string_buffer(code)

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(program), ctypes.addressof(filters))
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp")
