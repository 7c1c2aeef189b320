"""Flags for the instructor, from both sides: what the calls recorded as they ran
(``autograder.sandbox.audit``, carried back with each call's outcome), and what a
static read of the submission's source finds, which adds the code that never ran.

A flag says that the submission did something an honest solution has no reason to
do; it never changes the score. The kinds are ``autograder.sandbox.audit.Flag``.
The static read parses the student's files in the grader's process without running
them (``ast``), file by file, and gives up on a file it cannot parse or that is too
large: a file that does not parse is the checks' business, not a flag.
"""
from __future__ import annotations

import ast
from dataclasses import asdict, dataclass
from pathlib import Path

from autograder.sandbox.audit import DESCRIPTION, PRIVATE_MODULES, Flag

MAX_SOURCE_BYTES = 2**20
MAX_FILES = 200


@dataclass(frozen=True)
class Found:
    kind: str  # a Flag value
    detail: str
    seen: str  # "running" (the audit hook) or "source" (the static read)

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def line(self) -> str:
        return f"{self.kind}: {self.detail} ({'while running' if self.seen == 'running' else 'in the source'})"


# Attribute names that only code looking for the grader's objects or the toolkit's
# internals uses, by kind.
_ATTRIBUTES = {
    "_python_dispatch": Flag.PRIVATE, "_distributed_c10d": Flag.PRIVATE, "_disable_current_modes": Flag.PRIVATE,
    "get_objects": Flag.INTROSPECTION, "get_referrers": Flag.INTROSPECTION, "get_referents": Flag.INTROSPECTION,
    "settrace": Flag.INTROSPECTION, "setprofile": Flag.INTROSPECTION, "_getframe": Flag.INTROSPECTION,
    "_current_frames": Flag.INTROSPECTION, "f_back": Flag.INTROSPECTION, "tb_frame": Flag.INTROSPECTION,
    # a function's or a frame's insides: the way to a recorder's list or another's locals
    "__globals__": Flag.INTROSPECTION, "__closure__": Flag.INTROSPECTION, "__wrapped__": Flag.INTROSPECTION,
    "f_locals": Flag.INTROSPECTION, "f_globals": Flag.INTROSPECTION, "gi_frame": Flag.INTROSPECTION,
    "cr_frame": Flag.INTROSPECTION, "cell_contents": Flag.INTROSPECTION,
    "spec_from_file_location": Flag.CODE, "run_path": Flag.CODE, "exec_module": Flag.CODE,
    "SourceFileLoader": Flag.CODE,
}
_CALLS = {"exec": Flag.CODE, "eval": Flag.CODE, "compile": Flag.CODE, "__import__": Flag.CODE}
# Strings that name the grader's or another lab's files.
_NAMES = ("solutions/", "solutions\\", "autograder/checks", "autograder/", "oracles.py", "oracles_hidden", "harness.py",
          "gradebook", "k2c-sandbox-", "k2c-grade-")
_FILE_CALLS = {"open", "glob", "iglob", "listdir", "scandir", "walk", "Path", "rglob", "read_text", "read_bytes"}
_OWN = ("/tmp", "/dev/", "/proc/self", "/proc/cpuinfo", "/proc/meminfo", "/sys/")


def _module_kind(name: str) -> Flag | None:
    if name.split(".")[0] == "autograder":
        return Flag.GRADER
    if name.split(".")[0] == "ctypes":
        return Flag.CTYPES
    if name.split(".")[0] in ("importlib", "runpy"):
        return Flag.CODE
    if any(name == m or name.startswith(m + ".") for m in PRIVATE_MODULES):
        return Flag.PRIVATE
    return None


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _read(tree: ast.AST, where) -> list[tuple[Flag, str]]:
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            for alias in node.names:
                kind = _module_kind(alias.name)
                if kind:
                    found.append((kind, f"imports {alias.name} ({where(line)})"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for name in [node.module] + [f"{node.module}.{a.name}" for a in node.names]:
                kind = _module_kind(name)
                if kind:
                    found.append((kind, f"imports {name} ({where(line)})"))
                    break
        elif isinstance(node, ast.Attribute) and node.attr in _ATTRIBUTES:
            found.append((_ATTRIBUTES[node.attr], f"uses {_dotted(node) or node.attr} ({where(line)})"))
        elif isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else \
                node.func.attr if isinstance(node.func, ast.Attribute) else ""
            if isinstance(node.func, ast.Name) and name in _CALLS:
                found.append((_CALLS[name], f"calls {name}() ({where(line)})"))
            if name in _FILE_CALLS:
                for arg in node.args[:1]:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _outside(arg.value):
                        found.append((Flag.FILES, f"{name}({arg.value!r}) ({where(line)})"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            named = next((n for n in _NAMES if n in node.value), None)
            if named:  # a long string too: the part around the name
                at = node.value.index(named)
                excerpt = node.value if len(node.value) <= 120 else "…" + node.value[max(0, at - 40):at + 60] + "…"
                found.append((Flag.FILES, f"names {excerpt!r} ({where(line)})"))
        elif isinstance(node, (ast.Assign, ast.Delete, ast.AugAssign)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                if isinstance(target, ast.Subscript) and _dotted(target.value) == "sys.modules":
                    found.append((Flag.TOOLKIT, f"changes sys.modules ({where(line)})"))
                elif isinstance(target, ast.Attribute) and _dotted(target).split(".")[0] == "course":
                    found.append((Flag.TOOLKIT, f"sets {_dotted(target)} ({where(line)})"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and _dotted(node.func.value) == "sys.modules" and node.func.attr in ("pop", "update", "clear",
                                                                                     "__setitem__", "setdefault"):
            found.append((Flag.TOOLKIT, f"calls sys.modules.{node.func.attr} ({where(line)})"))
    return found


def _outside(path: str) -> bool:
    """A literal path that points out of the submission's own folder."""
    if path.startswith("~") or ".." in path.split("/"):
        return True
    return path.startswith("/") and not path.startswith(_OWN)


def static_flags(folder: Path) -> list[Found]:
    """What the submission's Python files say they do (see the module's docstring)."""
    found: dict[tuple[str, str], Found] = {}
    files = sorted(p for p in Path(folder).rglob("*.py") if p.is_file() and not p.is_symlink()
                   and "__pycache__" not in p.parts)[:MAX_FILES]
    for path in files:
        try:
            if path.stat().st_size > MAX_SOURCE_BYTES:
                continue
            tree = ast.parse(path.read_bytes(), str(path))
        except (SyntaxError, ValueError, OSError, RecursionError, MemoryError):
            continue
        rel = path.relative_to(folder).as_posix()
        for kind, detail in _read(tree, lambda line, rel=rel: f"{rel}:{line}"):
            found.setdefault((kind.value, detail), Found(kind.value, detail, "source"))
    return list(found.values())


def running_flags(records) -> list[Found]:
    """The audit hook's ``(kind, detail)`` records, as flags (duplicates once)."""
    kinds = {f.value for f in Flag}
    found: dict[tuple[str, str], Found] = {}
    for kind, detail in records:
        kind = kind if kind in kinds else Flag.CHANNEL.value
        found.setdefault((kind, detail), Found(kind, detail, "running"))
    return list(found.values())


def summary(flags: list[Found]) -> str:
    """One cell of the gradebook: the kinds, with how often each was seen."""
    counts: dict[str, int] = {}
    for flag in flags:
        counts[flag.kind] = counts.get(flag.kind, 0) + 1
    return " ".join(f"{kind}×{n}" if n > 1 else kind for kind, n in sorted(counts.items()))


def described(kind: str) -> str:
    try:
        return DESCRIPTION[Flag(kind)]
    except ValueError:
        return kind
