"""Where the labs are: one folder of checks per lab, ``autograder/checks/NN-slug``."""
from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass
from pathlib import Path

CHECKS_ROOT = Path(__file__).parent.parent / "checks"


class UsageError(Exception):
    """A mistake in how the grader was called; exit status 2."""


@dataclass(frozen=True)
class Lab:
    slug: str  # "02-cuda-model"
    title: str
    files: tuple[str, ...]  # the modules the student completes
    timeout_s: float  # per call into student code
    memory_mb: int
    refuse: tuple[str, ...] = ()  # library code the lab asks students to build themselves (course.refuse)
    refuse_why: str = ""
    # Files of earlier labs this lab imports ("08-data-parallel/ddp.py"): graded
    # next to the lab's own files, see ``with_used_files``.
    uses: tuple[str, ...] = ()
    # Distributions grading it needs beyond the grader's own (``k2c gradescope``
    # installs only these); None when lab.toml does not say: all the course's.
    requires: tuple[str, ...] | None = None

    @property
    def number(self) -> str:
        return self.slug.split("-", 1)[0]

    @property
    def checks_dir(self) -> Path:
        return CHECKS_ROOT / self.slug

    def checks_digest(self) -> str:
        """sha256 over the names and bytes of the lab's check files: which checks graded."""
        digest = hashlib.sha256()
        for path in sorted(p for p in self.checks_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            digest.update(path.relative_to(self.checks_dir).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
        return digest.hexdigest()


def all_labs() -> list[Lab]:
    labs = []
    for meta in sorted(CHECKS_ROOT.glob("*/lab.toml")):
        data = tomllib.loads(meta.read_text())
        labs.append(Lab(meta.parent.name, data["title"], tuple(data["files"]),
                        float(data.get("timeout_s", 60)), int(data.get("memory_mb", 4096)),
                        tuple(data.get("refuse", ())), data.get("refuse_why", ""),
                        tuple(data.get("uses", ())),
                        tuple(data["requires"]) if "requires" in data else None))
    return labs


def find_lab(name: str) -> Lab:
    """A lab by number (``2``, ``02``) or slug (``02-cuda-model``)."""
    labs = all_labs()
    for lab in labs:
        if name in (lab.slug, lab.number) or (name.isdigit() and int(name) == int(lab.number)):
            return lab
    known = ", ".join(lab.slug for lab in labs)
    raise UsageError(f"no lab called {name!r}; the labs are: {known} (or 'all')")


def with_used_files(lab: Lab, folder: Path, root: Path, into: Path) -> Path:
    """The folder to grade: ``folder`` itself, or for a lab that ``uses`` earlier
    labs' files, a copy of it in ``into`` with each used file beside the lab's own.

    A used file is always the student's own: already beside the lab's files (a
    flat upload), or the submission's earlier lab (``root/08-data-parallel/ddp.py``).
    It never comes from ``solutions/``: the student's code could read a reference
    file put in its folder and print it into its feedback. Without it the
    student's import fails, and the checks that need it say so.
    """
    if not lab.uses:
        return folder
    import shutil

    staged = into / folder.name
    shutil.copytree(folder, staged, symlinks=True, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    for used in lab.uses:
        target, source = staged / Path(used).name, Path(root) / used
        if source.is_file() and not target.exists():
            shutil.copyfile(source, target)
    return staged


def locate_submission(lab: Lab, root: Path) -> tuple[Path, str | None]:
    """The folder holding the lab's files: ``root/NN-slug`` or ``root`` itself.

    Returns the folder and, when the files are missing, a message saying so
    (the lab is then graded as zero with that message, not refused).
    """
    root = Path(root)
    if not root.is_dir():
        raise UsageError(f"submission folder {str(root)!r} does not exist")
    for candidate in (root / lab.slug, root):
        if all((candidate / f).is_file() for f in lab.files):
            return candidate.resolve(), None
    where = root / lab.slug if (root / lab.slug).is_dir() else root
    missing = [f for f in lab.files if not (where / f).is_file()]
    return where.resolve(), f"the submission has no {', '.join(missing)} (looked in {where})"
