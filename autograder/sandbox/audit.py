"""Flags for the instructor: what a call's code did that an honest solution has no
reason to do, recorded as it happens. They never change a score.

``install`` runs in the call's child before anything of the student's loads. It adds
a Python audit hook (PEP 578: ``sys.addaudithook``; no Python code can remove one)
that watches file opens and listings, imports, ``exec``/``compile``, ``ctypes``,
and the ways to reach the grader's own objects (``gc``, tracing). Each new flag is
written at once, as one line, into a pipe whose other end the sandbox's server
reads, so what was written stays written whatever the code does next (a hook that
finds its pipe closed or replaced stops writing, and the missing ``end`` says so). Forked
processes (torch ranks forked from the call) inherit the hook and the pipe; MPI
ranks, new interpreters started by ``mpiexec``, do not (the static read of the
submission, ``autograder.grading.flags``, covers what their code says).

The channel: every line carries a nonce that only the hook's closure holds (it is
made after the fork, never in a frame student code can walk to), the writer's pid
and a sequence number; the hook's first line is ``begin`` and, once the student's
function has returned to the child, its last is ``end``. A line with another nonce,
a gap in a sequence, or a call that returned without ``end`` (the pipe was closed
or replaced) is the flag ``channel`` (``check_channel``, in the grader).
"""
from __future__ import annotations

import enum
import json
import os
import sys

MAX_FLAGS = 50  # of each kind and verb, per process; then one "and more" line
END_EVENT = "k2c.audit.end"


class Flag(str, enum.Enum):
    """The kinds of flag, one vocabulary for every report (the instructor guide reads them)."""
    FILES = "files"  # opened or listed files outside its own folder, the system and the toolkit
    GRADER = "grader"  # imported the grader's modules
    CODE = "code"  # ran exec or compile itself, or loaded code from a file by path
    CTYPES = "ctypes"  # used ctypes
    PRIVATE = "private"  # torch's private dispatch or c10d internals
    TOOLKIT = "toolkit"  # changed sys.modules entries or attributes of the course toolkit
    INTROSPECTION = "introspection"  # gc's object lists, tracing or frames (sys._getframe, inspect): ways to the grader's objects
    CHANNEL = "channel"  # the channel that carries these records was broken or tampered with
    UNLOGGED = "unlogged"  # far more crossed between ranks (the kernel's count) than the op log saw
    MEMORY = "memory"  # a rank's peak memory was reset from inside (VmHWM below what the launcher had seen)


DESCRIPTION = {
    Flag.FILES: "opened or listed files outside its own folder and the toolkit",
    Flag.GRADER: "imported grader modules",
    Flag.CODE: "used exec, compile or importlib on files",
    Flag.CTYPES: "used ctypes",
    Flag.PRIVATE: "used torch's private dispatch or c10d internals",
    Flag.TOOLKIT: "changed the course toolkit's modules",
    Flag.INTROSPECTION: "searched the interpreter for other code's objects (gc, tracing, frames)",
    Flag.CHANNEL: "the channel that records these flags was broken or tampered with",
    Flag.UNLOGGED: "sent far more between ranks than the in-process op log saw (the log switched off or gone around)",
    Flag.MEMORY: "a rank's peak memory fell below what the launcher had seen it hold (reset from inside)",
}

# Names whose use is flagged wherever it is made.
PRIVATE_MODULES = ("torch.utils._python_dispatch", "torch._C._distributed_c10d")
_INTROSPECTION_EVENTS = {"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys.settrace",
                         "sys.setprofile", "sys._current_frames", "sys._getframe"}
_CTYPES_EVENTS = {"ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.addressof", "ctypes.string_at",
                  "ctypes.call_function"}
_WATCHED = {"open", "os.listdir", "os.scandir", "import", "exec", "compile", END_EVENT} | _INTROSPECTION_EVENTS \
    | _CTYPES_EVENTS


def _under(path: str, roots) -> bool:
    return any(path == r or path.startswith(r + "/") for r in roots)


def install(fd: int, submission: str, allowed: list[str], denied: list[str], ender) -> None:
    """Watch this process (and its forks) from now on; flags go to ``fd``.
    ``submission``: the student's folder; ``allowed``: folders the call may read besides
    it (system, Python, toolkit, scratch); ``denied``: folders inside those it must not;
    ``ender``: the code object of the one function that may call ``end``."""
    import secrets

    nonce = secrets.token_hex(12)
    pipe = os.fstat(fd)
    pipe_id = (pipe.st_dev, pipe.st_ino)
    submission = os.path.realpath(submission)
    allowed = tuple(os.path.realpath(p) for p in allowed if p) + (submission,)
    denied = tuple(os.path.realpath(p) for p in denied if p)
    # The standard library's own callers: what they do on the student's behalf is the student's
    # (``inspect.stack()`` walks frames with ``sys._getframe``).
    library = (_stdlib("importlib"), _stdlib("runpy.py"), _stdlib("ctypes"), _stdlib("inspect.py"),
               _stdlib("traceback.py"))
    state = {"pid": os.getpid(), "seq": 0, "seen": set(), "counts": {}, "busy": False, "broken": False}
    toolkit = _snapshot()

    def write(kind: str, detail: str) -> None:
        if state["broken"]:
            return
        pid = os.getpid()
        if pid != state["pid"]:  # a fork: its own sequence, its own flags
            state.update(pid=pid, seq=0, seen=set(), counts={})
        state["seq"] += 1
        line = f"{nonce} {pid} {state['seq']} " + json.dumps([kind, detail[:300]]) + "\n"
        try:
            now = os.fstat(fd)
            if (now.st_dev, now.st_ino) != pipe_id:
                raise OSError("replaced")
            os.write(fd, line.encode())
        except OSError:  # closed or replaced: nothing more can be said, and the missing end says so
            state["broken"] = True

    def flag(kind: Flag, detail: str) -> None:
        key = (kind, detail)
        if key in state["seen"]:
            return
        state["seen"].add(key)
        what = (kind, detail.split(" ", 1)[0])  # "listed", "opened", "imported"...
        count = state["counts"][what] = state["counts"].get(what, 0) + 1
        if count > MAX_FLAGS:  # per kind and verb, so that a flood of one (a glob's listings) hides no other
            if count == MAX_FLAGS + 1:
                write(kind.value, "… and more of this kind, not recorded")
            return
        write(kind.value, detail)

    def students(depth: int) -> str | None:
        """The student's file that made this happen: the nearest frame outside the
        import machinery, runpy and ctypes, if it is in the submission."""
        frame = sys._getframe(depth)
        while frame is not None:
            name = frame.f_code.co_filename
            if not (name.startswith("<frozen ") or _under(name, library)):
                break
            frame = frame.f_back
        if frame is not None and _under(frame.f_code.co_filename, (submission,)):
            return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
        return None

    def path_of(value) -> str | None:
        if isinstance(value, bytes):
            value = value.decode(errors="replace")
        if not isinstance(value, str):
            return None  # a file descriptor
        return os.path.normpath(os.path.join(os.getcwd(), value))

    def outside(path: str) -> bool:
        if _under(path, denied):
            return True
        if path.startswith("/proc/") and path.endswith("/mem"):
            return True  # another way to read this process's memory
        return not _under(path, allowed) and not _under(os.path.realpath(path), allowed)

    def hook(event: str, args) -> None:
        if event not in _WATCHED or state["busy"]:
            return
        state["busy"] = True
        try:
            if event == END_EVENT:
                # Only from the child's own code (``end`` called by ``autograder.sandbox.child._call``).
                if os.getpid() == state["pid"] and sys._getframe(2).f_code is ender:
                    _toolkit_changes(toolkit, flag)
                    write("end", "")
            elif event in ("open", "os.listdir", "os.scandir"):
                path = path_of(args[0] if args else ".")
                if path is not None and outside(path):
                    verb = "opened" if event == "open" else "listed"
                    flag(Flag.FILES, f"{verb} {path}")
            elif event == "import":
                module = str(args[0])
                if module.split(".")[0] == "autograder" and students(2):
                    flag(Flag.GRADER, f"imported {module} ({students(2)})")
                elif module.startswith(PRIVATE_MODULES) and students(2):
                    flag(Flag.PRIVATE, f"imported {module} ({students(2)})")
                elif module == "ctypes" and students(2):
                    flag(Flag.CTYPES, f"imported ctypes ({students(2)})")
            elif event in ("exec", "compile"):
                caller = sys._getframe(1)  # the frame that called exec() or compile() itself
                if _under(caller.f_code.co_filename, (submission,)):
                    flag(Flag.CODE, f"called {event} ({os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno})")
                elif event == "compile" and len(args) > 1:
                    path = path_of(args[1])
                    if path and os.path.isabs(str(args[1])) and outside(path):
                        flag(Flag.CODE, f"loaded code from {path}")
            elif event in _INTROSPECTION_EVENTS:
                where = students(2)
                if where:
                    flag(Flag.INTROSPECTION, f"called {event} ({where})")
            elif event.startswith("ctypes."):
                where = students(2)
                if where:
                    flag(Flag.CTYPES, f"{event} ({where})")
        except BaseException:  # noqa: BLE001 - a hook must never raise into the code it watches
            pass
        finally:
            state["busy"] = False

    write("begin", "")
    sys.addaudithook(hook)


def end() -> None:
    """Called by the child once the student's function has returned: the last line."""
    sys.audit(END_EVENT, os.getpid())


def _stdlib(name: str) -> str:
    return os.path.join(os.path.dirname(os.__file__), name)


def _toolkit(name: str) -> bool:
    return name.split(".")[0] in ("course", "autograder", "k2c_harness")


def _snapshot() -> dict:
    """The toolkit's modules (the harness's too) and their attributes, and the attributes of
    the classes they define (a recorder's methods), as they are before student code loads."""
    found = {}
    for name, module in list(sys.modules.items()):
        if _toolkit(name):
            attributes = {k: id(v) for k, v in vars(module).items() if not k.startswith("__")}
            classes = {k: {a: id(b) for a, b in vars(v).items()} for k, v in vars(module).items()
                       if isinstance(v, type) and getattr(v, "__module__", "") == name}
            found[name] = (id(module), attributes, classes)
    return found


def _foreign_methods(name: str, module) -> list[str]:
    """"Class.method" for the methods of ``module``'s classes that the class's own body did
    not define (a function whose qualified name is another's): a toolkit module loaded after
    the snapshot, whose earlier state is unknown, patched all the same."""
    found = []
    for cls_name, cls in list(vars(module).items()):
        if not isinstance(cls, type) or getattr(cls, "__module__", "") != name:
            continue
        for attr, value in list(vars(cls).items()):
            function = getattr(value, "__func__", value)
            if callable(function) and hasattr(function, "__qualname__") and hasattr(function, "__code__") \
                    and not function.__qualname__.startswith(cls.__qualname__ + "."):
                found.append(f"{cls_name}.{attr}")
    return found


def _toolkit_changes(before: dict, flag) -> None:
    for name, module in list(sys.modules.items()):
        if _toolkit(name) and name not in before and module is not None:
            foreign = _foreign_methods(name, module)
            if foreign:
                flag(Flag.TOOLKIT, f"changed the classes of {name}: {', '.join(foreign[:5])}")
    for name, (module_id, attributes, classes) in before.items():
        module = sys.modules.get(name)
        if module is None or id(module) != module_id:
            flag(Flag.TOOLKIT, f"replaced or removed sys.modules[{name!r}]")
            continue
        now = vars(module)
        changed = sorted(k for k, v in attributes.items() if k not in now or id(now[k]) != v)
        if changed:
            flag(Flag.TOOLKIT, f"changed {name}: {', '.join(changed[:5])}")
        for cls_name, members in classes.items():
            cls = now.get(cls_name)
            if not isinstance(cls, type):
                continue
            current = vars(cls)
            replaced = sorted(a for a, v in members.items() if a not in current or id(current[a]) != v)
            added = sorted(a for a in current if a not in members)
            if replaced or added:
                flag(Flag.TOOLKIT, f"changed the class {name}.{cls_name}: {', '.join((replaced + added)[:5])}")


def check_channel(data: bytes, child_pid_expected_end: bool) -> list[tuple[str, str]]:
    """The flags in what the hook wrote (``(kind, detail)``), with a ``channel`` flag when
    the records were broken or tampered with. ``child_pid_expected_end``: the call
    returned to the child, so its ``end`` line must be there. Runs in the grader."""
    flags: list[tuple[str, str]] = []
    problems: list[str] = []
    lines = data.decode(errors="replace").splitlines()
    if not lines:
        return [(Flag.CHANNEL.value, "no record came back: the hook's pipe was closed before it could start")] \
            if child_pid_expected_end else []
    head = lines[0].split(" ", 3)
    nonce, first_pid = head[0], head[1] if len(head) > 1 else ""
    if len(head) != 4 or head[2] != "1" or _kind(head[3]) != "begin":
        problems.append("the first record is not the hook's")
    sequences: dict[str, int] = {}
    ended = False
    for line in lines:
        parts = line.split(" ", 3)
        if len(parts) != 4 or parts[0] != nonce:
            problems.append("a record the hook did not write")
            continue
        _, pid, seq, body = parts
        if not seq.isdigit() or int(seq) != sequences.get(pid, 0) + 1:
            problems.append("records out of sequence")
        sequences[pid] = int(seq) if seq.isdigit() else sequences.get(pid, 0)
        try:
            kind, detail = json.loads(body)
        except (ValueError, TypeError):
            problems.append("an unreadable record")
            continue
        if kind == "end" and pid == first_pid:
            ended = True
        elif kind not in ("begin", "end"):
            flags.append((str(kind), str(detail)))
    if child_pid_expected_end and not ended:
        problems.append("the call returned, but its last record never came (the pipe was closed or replaced)")
    if problems:
        flags.append((Flag.CHANNEL.value, "; ".join(dict.fromkeys(problems))))
    return flags


def _kind(body: str) -> str:
    try:
        return str(json.loads(body)[0])
    except (ValueError, TypeError, IndexError):
        return ""
