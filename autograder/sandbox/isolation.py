"""How far a call into student code is kept from the grader: the isolation layer.

Two layers, strongest first; the grader takes the first that works on this
machine (``detect()``, probed once per process) and every report says which.

``bubblewrap`` (Debian's ``bubblewrap``, the sandbox Flatpak is built on)
  The call runs in new PID, network, IPC and mount namespaces, on a file system
  built from an allow-list (``mounts``): the system's programs, libraries and
  configuration (``/usr`` less ``/usr/local``, ``/etc``, ``/sys``), this Python and
  its site-packages, the course toolkit (``course/``), the grader's code that runs
  beside the student's (``autograder/sandbox``, ``autograder/grading`` and a copy of
  the lab's harness modules), a copy of the submission, all read-only, and a private
  ``/tmp``. Nothing else exists there: not ``solutions/``, no lab's checks or
  oracles (``autograder/checks``, hidden even when installed in site-packages), no
  class folder, gradebook or report, no home folder.
  The network namespace has loopback only, so MPI ranks and torch workers
  still talk to each other and nothing else. When the PID namespace's first
  process ends, the kernel kills every process left in it. The grader's
  processes are not in the namespace, so they cannot be seen, signalled or
  traced.
``subreaper`` (no namespaces: bubblewrap is missing, or the machine refuses it,
  as unprivileged containers often do)
  A supervisor (``autograder.sandbox.reaper``) adopts every orphan the call leaves and
  kills them all when the call ends. The files and the network are the
  machine's: this layer hides no file. Student code reads whatever its user may
  read, so a class is graded with it only when asked (``k2c grade-class
  --allow-weak-isolation``), and Gradescope's scripts make the grader's files
  unreadable to ``nobody`` instead.

Under either, when the grader runs as root the student's code runs as
``nobody`` (65534:65534) with no capabilities, so it can write nothing of the
grader's and signal none of its processes. Run as an ordinary user (a student's
laptop), it runs as that user: under ``subreaper`` it could then signal the
grader or write the user's files, and the report says so.

``K2C_ISOLATION=bubblewrap|subreaper`` asks for one layer; the grader refuses
to run when it does not work here.
"""
from __future__ import annotations

import enum
import fnmatch
import functools
import os
import shutil
import sys
from dataclasses import dataclass

NOBODY = (65534, 65534)
GRADER_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # autograder/
PACKAGE_ROOT = os.path.dirname(GRADER_ROOT)  # holds autograder/ and course/
# What a call sees of the machine under bubblewrap, read-only: its programs, libraries and
# configuration. Nothing else of the machine is there (no /home, /root, /srv, /opt, /var,
# /work, /mnt...), only what ``mounts`` adds.
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/sys")
# Inside those, folders where people put their own files (a course checkout, a class
# folder): hidden again, except for the needed paths inside them.
MASKED = ("/usr/local", "/usr/src", "/usr/share/k2c")


class Layer(str, enum.Enum):
    """The isolation layers, strongest first."""
    BUBBLEWRAP = "bubblewrap"
    SUBREAPER = "subreaper"

    def weaker_than(self, other: "Layer") -> bool:
        order = list(Layer)
        return order.index(self) > order.index(other)


@dataclass(frozen=True)
class Isolation:
    layer: Layer
    uid: int | None  # the student's processes' user; None: the grader's own
    gid: int | None
    fallback_reason: str = ""  # why a stronger layer was not used

    @property
    def user(self) -> str:
        if self.uid is not None:
            return f"nobody (uid {self.uid})"
        return "root without capabilities" if os.geteuid() == 0 else f"the grader's own user (uid {os.geteuid()})"

    @property
    def summary(self) -> str:
        """One line for reports: ``bubblewrap, as nobody (uid 65534)``."""
        return f"{self.layer.value}, as {self.user}"

    def describe(self) -> str:
        """What this layer does and does not keep from the grader, in a few sentences."""
        if self.layer is Layer.BUBBLEWRAP:
            text = ("own PID, network (loopback only) and mount namespaces; an allow-listed, read-only file "
                    f"system with a private /tmp; runs as {self.user}")
        else:
            text = (f"no namespaces; a supervisor reaps every process when a call ends; runs as {self.user}; "
                    "the machine's files and network are reachable")
            if self.warning:
                text += "; " + self.warning
        return text + (f" ({self.fallback_reason})" if self.fallback_reason else "")

    @property
    def warning(self) -> str:
        """What student code could do to the grader's user under this layer ("" when nothing):
        run as that user with no namespaces, it could signal the grader or write that user's files."""
        if self.layer is Layer.SUBREAPER and self.uid is None and os.geteuid() != 0:
            return "student code could signal the grader or write your files: grade untrusted code elsewhere"
        return ""

    @property
    def readable(self) -> str:
        """What student code could read under this layer, in one sentence for reports."""
        if self.layer is Layer.BUBBLEWRAP:
            return ("its own files, a private /tmp, the system's programs and libraries, Python and its "
                    "packages, the course toolkit and the lab's harness; no solutions, checks, oracles or "
                    "other submissions")
        return f"every file that {self.user} may read on this machine (this layer hides no file)"

    @property
    def hides_files(self) -> bool:
        return self.layer is Layer.BUBBLEWRAP

    @property
    def ranks_apart(self) -> bool:
        """Whether the ranks of a job get users, ``/tmp`` and ``/dev/shm`` of their own
        (``autograder.sandbox.rank_isolation``): only where the grader is root."""
        return self.uid is not None

    def as_dict(self) -> dict:
        return {"layer": self.layer.value, "user": self.user, "detail": self.describe(), "readable": self.readable,
                "ranks_apart": self.ranks_apart, **({"warning": self.warning} if self.warning else {})}

    def command(self, inner: list[str], scratch: str, expose: list[str], devices: bool) -> list[str]:
        """The command line that runs ``inner`` (a Python command) isolated, in ``scratch``,
        seeing ``expose`` (and ``needed_paths()``) read-only at their own paths (``mounts``)."""
        if self.layer is Layer.SUBREAPER:
            return [sys.executable, "-m", "autograder.sandbox.reaper", "--", *inner]
        args = ["bwrap", "--die-with-parent", "--new-session",
                "--unshare-pid", "--unshare-net", "--unshare-ipc",
                *mounts(scratch, expose, devices)]
        # The server (autograder.sandbox.child) keeps only what it needs to make each call's child
        # nobody, which has no capabilities at all, and to kill what that child leaves; and to give
        # each rank of a job (autograder.sandbox.ranks) a user and mounts of its own
        # (autograder.sandbox.rank_isolation: CAP_SYS_ADMIN, for its namespaces and private /tmp).
        # None of the student's code runs with them.
        args += ["--cap-drop", "ALL"]
        if self.uid is not None:
            args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_KILL",
                     "--cap-add", "CAP_SYS_ADMIN"]
        return args + ["--chdir", "/tmp", "--", *inner]

    def child_env(self, scratch: str) -> dict[str, str]:
        """What the server needs to know: who its children become
        (``autograder.sandbox.reaper.drop_privileges``), their scratch folder as HOME and
        TMPDIR, as the student's code sees it, and the folders it empties after each call."""
        inside = "/tmp" if self.layer is Layer.BUBBLEWRAP else scratch
        run_as = "" if self.uid is None else f"{self.uid}:{self.gid}"
        emptied = [inside, "/dev/shm"] if self.layer is Layer.BUBBLEWRAP else [inside]  # /dev/shm: the sandbox's own
        return {"HOME": inside, "TMPDIR": inside, "K2C_RUN_AS": run_as, "K2C_SCRATCH": os.pathsep.join(emptied)}


def needed_paths() -> list[str]:
    """What the child must read besides the system: this Python and its environment
    (site-packages), and the parts of the course it runs: the toolkit (``course/``) and
    the grader's sandbox and grading code. Not the checks, the instructor's tools, nor
    anything else beside them (``solutions/``, a class folder): see ``hidden_paths``."""
    paths = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)),
             *_linked_from_environment(), *_child_code()}
    return sorted(p for p in paths if p)


def _child_code() -> list[str]:
    """The course's packages that a call imports: the toolkit, and of the grader only
    what runs beside student code (the child server, the codec, the harnesses' helpers)."""
    return [os.path.join(PACKAGE_ROOT, "course"), os.path.join(GRADER_ROOT, "__init__.py"),
            *(os.path.join(GRADER_ROOT, part) for part in CHILD_PARTS)]


# The grader's parts a call imports; the rest (checks/, instructor/, the CLI) stays out.
CHILD_PARTS = ("sandbox", "grading")


def hidden_paths() -> list[str]:
    """What stays hidden even where a needed path would show it: the grader's other parts
    when it is installed in site-packages (every lab's checks and oracles), and a
    checkout's own files around the toolkit (``solutions/``, ``labs/``, ``tests/``...)
    when the checkout lies inside a needed folder."""
    hidden = [os.path.join(GRADER_ROOT, name) for name in sorted(os.listdir(GRADER_ROOT))
              if name not in (*CHILD_PARTS, "__init__.py", "__pycache__")]
    if os.path.basename(PACKAGE_ROOT) not in ("site-packages", "dist-packages"):
        hidden += [os.path.join(PACKAGE_ROOT, name) for name in sorted(os.listdir(PACKAGE_ROOT))
                   if name not in ("course", "autograder")]
    needed = needed_paths()
    return [h for h in hidden if not any(_under(n, h) for n in needed)]  # a .venv inside the checkout stays


@functools.lru_cache(maxsize=1)
def _linked_from_environment() -> frozenset[str]:
    """The folders that entries of this environment's site-packages, bin/ and lib/ link
    into (an environment built of links to another's packages): without them
    the child would see dangling links."""
    folders = [p for p in sys.path if p.startswith(sys.prefix + os.sep) and os.path.isdir(p)]
    folders += [os.path.join(sys.prefix, "bin"), os.path.join(sys.prefix, "lib")]  # mpiexec, libmpi
    found = set()
    for folder in folders:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            path = os.path.join(folder, name)
            if os.path.islink(path):
                found.add(os.path.dirname(os.path.realpath(path)))
            elif name.endswith(".pth"):
                found.update(_pth_folders(path))
    return frozenset(found)


def _pth_folders(pth: str) -> list[str]:
    """The folders a site-packages ``.pth`` file adds to ``sys.path`` (an environment that
    layers itself over another's packages), but never the checkout that holds the course
    (an editable install's): its toolkit and grader are bound part by part (``_child_code``)."""
    try:
        with open(pth, encoding="utf-8", errors="replace") as f:
            lines = [line.strip() for line in f]
    except OSError:
        return []
    folders = [os.path.realpath(os.path.join(os.path.dirname(pth), line)) for line in lines
               if line and not line.startswith(("#", "import ", "import\t"))]
    # Another environment's site-packages: that whole environment (its lib/ holds the MPI library).
    folders = [os.path.dirname(os.path.dirname(os.path.dirname(f)))
               if fnmatch.fnmatch(f, "*/lib/python3*/site-packages") else f for f in folders]
    return [f for f in folders if os.path.isdir(f) and not _under(PACKAGE_ROOT, f)]



def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def mounts(scratch: str, expose: list[str], devices: bool) -> list[str]:
    """bubblewrap's mounts, an allow-list: an empty root; the system folders (``SYSTEM``,
    less ``MASKED``); ``/dev``, ``/proc``, a private ``/dev/shm``; ``scratch`` as ``/tmp``;
    then ``needed_paths()`` and ``expose`` read-only at their own paths; last, an empty
    folder over each of ``hidden_paths()`` that would be shown."""
    args: list[str] = []
    events: list[tuple[str, bool]] = []  # (path, shown) in mount order: the last one over a path decides

    def shown(path: str) -> bool:
        return next((kind for where, kind in reversed(events) if _under(path, where)), False)

    for path in SYSTEM:
        if os.path.islink(path):  # /bin -> usr/bin on a merged /usr
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
            events.append((path, True))
    for path in MASKED:
        if os.path.isdir(path):
            args += ["--tmpfs", path]
            events.append((path, False))
    args += [*(["--dev-bind", "/dev", "/dev"] if devices else ["--dev", "/dev"]),  # GPUs need the host's /dev
             "--proc", "/proc", "--perms", "1777", "--tmpfs", "/dev/shm", "--bind", scratch, "/tmp"]
    events += [("/dev", True), ("/proc", True), ("/tmp", False)]  # /tmp is the scratch folder, not the host's
    made = {"/"}
    wanted = sorted({p for path in [*needed_paths(), *expose]
                     for p in (os.path.abspath(path), os.path.realpath(path)) if os.path.exists(p)})
    for path in wanted:
        if shown(path):
            continue
        # bubblewrap would make the folders on the way 0700, which nobody cannot pass.
        parts = path.strip("/").split("/")[:-1]
        for i in range(len(parts)):
            folder = "/" + "/".join(parts[:i + 1])
            if folder not in made and not shown(folder):
                args += ["--perms", "0755", "--dir", folder]
                made.add(folder)
        args += ["--ro-bind", path, path]
        events.append((path, True))
    for path in hidden_paths():
        if not os.path.exists(path) or not shown(path) or any(_under(w, path) for w in wanted):
            continue
        args += ["--tmpfs", path] if os.path.isdir(path) else ["--ro-bind", "/dev/null", path]
        events.append((path, False))
    return args + ["--remount-ro", "/"]


def _candidates(requested: str | None) -> list[Isolation]:
    """The layers to try, strongest first. As root, never the subreaper layer as root:
    without namespaces root keeps every capability, and could rewrite the grader."""
    layers = [Layer(requested)] if requested else list(Layer)
    if os.geteuid() != 0:
        return [Isolation(layer, None, None) for layer in layers]
    return [Isolation(layer, uid, gid) for layer in layers for uid, gid in (NOBODY, (None, None))
            if layer is Layer.BUBBLEWRAP or uid is not None]


def _probe(isolation: Isolation) -> str:
    """"" when this layer can grade here, else why not: a fresh Python in it, as its user,
    imports the toolkit and the sandbox's server (``autograder.sandbox.readiness``)."""
    if isolation.layer is Layer.BUBBLEWRAP and not shutil.which("bwrap"):
        return "bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    from autograder.sandbox import readiness

    try:
        readiness.prove(isolation)
    except readiness.Unready as exc:
        return f"{isolation.layer.value}: {exc}"
    return ""


@functools.cache
def detect() -> Isolation:
    """The strongest layer that works on this machine (``K2C_ISOLATION`` may name one)."""
    requested = os.environ.get("K2C_ISOLATION") or None
    if requested and requested not in {layer.value for layer in Layer}:
        raise RuntimeError(f"K2C_ISOLATION={requested!r}: choose one of {', '.join(l.value for l in Layer)}")
    reasons = []
    for candidate in _candidates(requested):
        why = _probe(candidate)
        if not why:
            return Isolation(candidate.layer, candidate.uid, candidate.gid, "; ".join(reasons))
        if why not in reasons:
            reasons.append(why)
    raise RuntimeError("this machine cannot grade: no isolation layer works here: " + "; ".join(reasons))
