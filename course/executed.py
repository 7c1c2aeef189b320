"""Lectures run once per test run, not twice.

nbval executes every lecture under ``make test``; ``course/lectures/conftest.py``
keeps what each cell printed and drew and, when every cell of a lecture
passed, saves the executed notebook here. The docs build (``docs/conf.py``)
shows that copy instead of running the lecture again, but only while it is
current: the copy records a digest of the lecture and of every Python file of
the course toolkit and its lecture helpers, and any change to them makes the
build execute the lecture itself, as it does when there is no copy.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

COURSE = Path(__file__).resolve().parent
FOLDER = COURSE.parent / "docs" / "_build" / "executed"
KEY = "k2c_executed_from"  # notebook metadata: the digest of what it was run from


def digest(lecture: Path) -> str:
    """The lecture's bytes and every ``.py`` file of ``course/`` (the toolkit and the lectures' helpers)."""
    h = hashlib.sha256(Path(lecture).read_bytes())
    for path in sorted(COURSE.rglob("*.py")):
        if "__pycache__" not in path.parts:
            h.update(str(path.relative_to(COURSE)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def save(executed: dict, lecture: Path, folder: Path | None = None) -> Path:
    """Write ``executed`` (a notebook as a dict) as the executed copy of ``lecture``, whole or not at all."""
    executed.setdefault("metadata", {})[KEY] = digest(lecture)
    folder = folder or FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / Path(lecture).name
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(executed, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    partial.replace(path)
    return path


def current(lecture: Path, folder: Path | None = None) -> dict | None:
    """The executed copy of ``lecture`` if it was run from exactly what is here now, else None."""
    path = (folder or FOLDER) / Path(lecture).name
    try:
        executed = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return executed if executed.get("metadata", {}).get(KEY) == digest(lecture) else None
