"""Generate the student starters in ``labs/`` from the references in ``solutions/``.

In a reference, the code a student writes stands between two marker lines::

    # BEGIN SOLUTION: a hint for the student
    ...
    # END SOLUTION

``k2c sync`` replaces each such region with a ``raise NotImplementedError`` that
names the function and carries the hint; every other file is copied as it is.
"""
from __future__ import annotations

import re
from pathlib import Path

BEGIN = re.compile(r"^(?P<indent>\s*)# BEGIN SOLUTION(?::\s*(?P<hint>.*?))?\s*$")
END = re.compile(r"^\s*# END SOLUTION\s*$")
DEF = re.compile(r"^(?P<indent>\s*)def (?P<name>\w+)\s*\(")
SKIP = {"__pycache__", ".ipynb_checkpoints"}


class MarkerError(ValueError):
    pass


def strip_solutions(source: str, filename: str = "<source>") -> str:
    out: list[str] = []
    lines = source.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        m = BEGIN.match(lines[i])
        if not m:
            if END.match(lines[i]):
                raise MarkerError(f"{filename}:{i + 1}: END SOLUTION without BEGIN")
            out.append(lines[i])
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and not END.match(lines[i]):
            if BEGIN.match(lines[i]):
                raise MarkerError(f"{filename}:{i + 1}: BEGIN SOLUTION inside another region")
            i += 1
        if i == len(lines):
            raise MarkerError(f"{filename}:{start + 1}: BEGIN SOLUTION without END")
        i += 1
        name = next((d["name"] for d in map(DEF.match, reversed(out)) if d
                     and len(d["indent"]) < len(m["indent"])), None)
        message = "not implemented yet" + (f": {name}" if name else "") + (f": {m['hint']}" if m["hint"] else "")
        out.append(f"{m['indent']}raise NotImplementedError({message!r})\n")
    return "".join(out)


def _files(root: Path) -> dict[Path, Path]:
    return {p.relative_to(root): p for p in sorted(root.rglob("*"))
            if p.is_file() and not SKIP.intersection(p.relative_to(root).parts)}


def expected_labs(solutions: Path) -> dict[Path, bytes]:
    """What ``labs/`` should hold: relative path -> content."""
    expected = {}
    for rel, path in _files(solutions).items():
        if path.suffix == ".py":
            expected[rel] = strip_solutions(path.read_text(), str(path)).encode()
        else:
            expected[rel] = path.read_bytes()
    return expected


def differences(solutions: Path, labs: Path) -> list[str]:
    expected = expected_labs(solutions)
    actual = _files(labs) if labs.is_dir() else {}
    diffs = [f"missing: labs/{rel}" for rel in expected if rel not in actual]
    diffs += [f"differs: labs/{rel}" for rel in expected if rel in actual and actual[rel].read_bytes() != expected[rel]]
    diffs += [f"not in solutions/: labs/{rel}" for rel in actual if rel not in expected]
    return diffs


def sync(solutions: Path, labs: Path) -> list[str]:
    """Rewrite ``labs/`` to match; return what changed."""
    changed = differences(solutions, labs)
    expected = expected_labs(solutions)
    if labs.is_dir():
        for rel, path in _files(labs).items():
            if rel not in expected:
                path.unlink()
    for rel, content in expected.items():
        target = labs / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.is_file() or target.read_bytes() != content:
            target.write_bytes(content)
    for d in sorted((p for p in labs.rglob("*") if p.is_dir()), reverse=True):
        if not any(d.iterdir()) and not SKIP.intersection(d.parts):
            d.rmdir()
    return changed
