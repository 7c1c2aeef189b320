"""Where the labs are (one folder of checks per lab, ``autograder/checks/NN-slug``),
and where a submission holds a lab's files (``locate``; a zip is ``unpack``-ed first)."""
from __future__ import annotations

import hashlib
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

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
    # Files of the lab's checks folder that ``k2c release`` leaves out (lab.toml's
    # ``hidden``): hidden checks (``check_*_hidden.py``) and the oracles only they use
    # (``oracles_hidden.py``). Graded wherever the instructor grades; see ``hidden_problems``.
    hidden: tuple[str, ...] = ()
    # Programs its checks run, as (command, Debian package) pairs (lab.toml's ``system``,
    # "g++ = g++"): ``k2c gradescope``'s setup.sh installs those missing.
    system: tuple[tuple[str, str], ...] = ()
    # What its GPU-tier checks run on the device, of "numba", "cupy" and "torch" (lab.toml's
    # ``device_stacks``): the GPU tier's preflight runs one tiny kernel through each before
    # any check (autograder.grading.preflight). Empty: nothing of the lab runs on a GPU.
    device_stacks: tuple[str, ...] = ()

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
                        tuple(data["requires"]) if "requires" in data else None,
                        tuple(data.get("hidden", ())), tuple(data.get("system", {}).items()),
                        tuple(data.get("device_stacks", ()))))
    return labs


HIDDEN_MARK = "_hidden"  # every hidden file's stem ends so, and no public file's does


def hidden_problems(checks_dir: Path, hidden: tuple[str, ...] | list[str]) -> list[str]:
    """What is wrong with a lab's ``hidden`` list (``checks_dir`` is its checks folder): an
    entry that is no file of that folder, is not named ``*_hidden.py``, or is a harness
    (which runs beside the student's code, so it is public); a ``*_hidden`` file it does
    not list (it would be released)."""
    problems, slug = [], Path(checks_dir).name
    for name in hidden:
        path = Path(checks_dir) / name
        if not path.is_file() or path.parent != Path(checks_dir):
            problems.append(f"{slug}/lab.toml: hidden lists {name!r}, which is not a file of its checks folder")
        elif not Path(name).stem.endswith(HIDDEN_MARK) or name.startswith("harness"):
            problems.append(f"{slug}/lab.toml: hidden lists {name!r}: a hidden file is named *{HIDDEN_MARK}.py "
                            "and is not a harness (the harness runs beside the student's code)")
    for path in sorted(Path(checks_dir).glob(f"*{HIDDEN_MARK}.*")):
        if path.name not in hidden:
            problems.append(f"{slug}: {path.name} is named as hidden, but lab.toml's hidden does not list it")
    return problems


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
    flat upload), or the submission's earlier lab (``root/08-data-parallel/ddp.py``,
    where ``root`` is the folder the lab's folder was found in, ``locate``'s
    ``Found.root``: ``labs/`` of a student repository).
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


# Names that are never a submission's own: version control, caches, and what
# archivers and editors leave beside the files. Left out of zips, of digests,
# and when deciding whether a submission is one folder wrapped around the rest.
CLUTTER = frozenset({".git", "__pycache__", ".ipynb_checkpoints", "__MACOSX", ".venv"})
# A zip bigger than this unpacked, or with more members, is refused (a zip bomb
# would fill the disk before any grading started).
MAX_UNPACKED_BYTES = 256 * 2**20
MAX_MEMBERS = 5000


class Unreadable(Exception):
    """A submission's zip that cannot be unpacked safely."""


def unpack(archive: Path, into: Path) -> Path:
    """Unpack a student's zip into ``into`` and return the folder to grade.
    Members that would land outside ``into`` (absolute paths, ``..``), links,
    and archives past the size limits are refused; a zip of one folder is
    graded from inside that folder."""
    archive, into = Path(archive), Path(into)
    try:
        with zipfile.ZipFile(archive) as z:
            members = [m for m in z.infolist() if not m.is_dir()]
            if len(members) > MAX_MEMBERS:
                raise Unreadable(f"{archive.name} has {len(members)} files (at most {MAX_MEMBERS})")
            budget = MAX_UNPACKED_BYTES
            for m in members:
                name = PurePosixPath(m.filename.replace("\\", "/"))
                if name.is_absolute() or ".." in name.parts:
                    raise Unreadable(f"{archive.name} holds {m.filename!r}, a path outside the submission")
                if (m.external_attr >> 16) & 0o170000 == 0o120000 or CLUTTER & set(name.parts):
                    continue  # links, and clutter such as __MACOSX/
                target = into.joinpath(*name.parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                with z.open(m) as src, open(target, "wb") as dst:
                    while chunk := src.read(2**20):  # the sizes in the header can lie: count what comes out
                        budget -= len(chunk)
                        if budget < 0:
                            raise Unreadable(f"{archive.name} unpacks to more than {MAX_UNPACKED_BYTES >> 20} MiB")
                        dst.write(chunk)
    except (zipfile.BadZipFile, OSError, RuntimeError, ValueError) as exc:  # RuntimeError: encrypted members
        raise Unreadable(f"{archive.name} is not a readable zip: {exc}") from None
    into.mkdir(parents=True, exist_ok=True)  # a zip of nothing
    root = into
    while (inner := _wrapped(root)) is not None:
        root = inner
    return root


def _wrapped(folder: Path) -> Path | None:
    """The one folder ``folder`` holds besides clutter and hidden names, if that is all it holds."""
    inside = [p for p in folder.iterdir() if p.name not in CLUTTER and not p.name.startswith(".")]
    if len(inside) == 1 and inside[0].is_dir() and not inside[0].is_symlink():
        return inside[0]
    return None


@dataclass(frozen=True)
class Found:
    """Where a submission holds a lab's files (``locate``)."""
    folder: Path | None  # the folder holding the lab's files; None when it holds none of them
    root: Path | None  # where the lab's earlier labs are (``with_used_files``): the folder around ``folder``'s
    missing: tuple[str, ...]  # the lab's files that ``folder`` lacks, when it has only some
    searched: tuple[str, ...]  # the folders looked in, relative to the submission ("." for its top)

    def missing_message(self, shown: Path | str | None = None) -> str | None:
        """When only some of the lab's files are there: what the checks say instead of
        grading (``shown``: how to name the folder, default ``folder``)."""
        if self.folder is None or not self.missing:
            return None
        return f"the submission has no {', '.join(self.missing)} (looked in {shown or self.folder})"


def locate(lab: Lab, root: Path, shown_from: Path | None = None) -> Found:
    """Find ``lab``'s files in the submission ``root``, in any of its shapes:

    - the lab's files at the top (a flat upload, as Gradescope hands over);
    - ``NN-slug/`` at the top (like ``labs/`` or ``solutions/`` themselves);
    - ``labs/NN-slug/``: a student repository (``k2c release``'s clone, which
      GitHub Classroom and Gradescope's GitHub upload hand over);
    - any of those inside one wrapping folder (``root`` holding that folder
      alone, clutter such as ``.git`` or ``__MACOSX`` aside).

    The first folder with all of the lab's files wins, else the first with
    some of them (the checks then say which are missing). With none, ``folder``
    is None and ``searched`` lists where it looked, relative to ``shown_from``
    (default ``root``). ``root`` of the result is where the lab's earlier labs
    sit: ``labs/`` for ``labs/NN-slug/``, the top for ``NN-slug/`` and for a
    flat upload (whose used files are beside the lab's own). ``solutions/`` is
    never looked in unless it is the submission itself.
    """
    root = Path(root)
    if not root.is_dir():
        raise UsageError(f"submission folder {str(root)!r} does not exist")
    shown_from = Path(shown_from) if shown_from is not None else root
    bases = [root]
    if (inner := _wrapped(root)) is not None:
        bases.append(inner)
    candidates: list[tuple[Path, Path]] = []  # (folder, the root of its labs)
    for base in bases:
        for folder, labs_root in ((base, base), (base / lab.slug, base), (base / "labs" / lab.slug, base / "labs")):
            if all(folder.resolve() != seen.resolve() for seen, _ in candidates):
                candidates.append((folder, labs_root))
    partial = None
    for folder, labs_root in candidates:
        present = [f for f in lab.files if (folder / f).is_file()]
        if len(present) == len(lab.files):
            return Found(folder.resolve(), labs_root.resolve(), (), ())
        if present and partial is None:
            partial = Found(folder.resolve(), labs_root.resolve(),
                            tuple(f for f in lab.files if f not in present), ())
    searched = tuple(_shown(folder, shown_from) for folder, _ in candidates)
    if partial is not None:
        return Found(partial.folder, partial.root, partial.missing, searched)
    return Found(None, None, (), searched)


def _shown(folder: Path, base: Path) -> str:
    try:
        rel = folder.relative_to(base).as_posix()
    except ValueError:
        return str(folder)
    return "./" if rel == "." else rel + "/"
