"""Write the student repository: ``k2c release DIR``.

The release is what a student clones: the lectures and the course toolkit
(``course/``), the handouts and starters (``labs/``, exactly what ``k2c sync``
writes), the grader with every lab's public checks (``autograder/``), the
one-node SLURM script, ``pyproject.toml``, ``environment.yml``, the docs' student
guide as ``STUDENT-GUIDE.md`` (in Markdown that GitHub renders:
``autograder.instructor.github_markdown``), and a Makefile,
README and ``.gitignore`` written for students. It leaves out everything that
holds or quotes reference code: ``solutions/``; ``tests/`` (its fixtures are
references with one mistake each); ``benchmarks/`` (they import ``solutions/``);
the rest of ``docs/`` (the instructor guide quotes a solution); the scripts that grade
``solutions/``; and each lab's hidden checks with the oracles only they use
(``lab.toml``'s ``hidden``): an oracle that computes the lab's answer would hand
it to a student's code that loads it.

Guards refuse a release before anything is written: ``labs/`` must be in sync
with ``solutions/`` (the instructor ships the starters they have seen); each
``hidden`` list must name files that exist, all of them ``*_hidden``, and every
``*_hidden`` file; no released check may import or name (``load_beside``) a
module the release leaves out, but through ``load_hidden_beside``, which is None
there (the check then grades what it can without it); and no solution region may appear in any
released file, notebooks included (a hint that spells out the answer, a helper
or lecture that copies one), nor more than half of any region's token 5-grams
(``autograder.instructor.overlap``: the lecture that shows the lab's own code
with other names), nor a hint longer than one sentence.
Notebooks are shipped without outputs: an output saved from a run on the
reference shows the reference's answers.
"""
from __future__ import annotations

import ast
import io
import json
import os
import re
import shutil
import subprocess
import textwrap
import tokenize
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

from autograder.grading.labs import hidden_problems
from autograder.instructor import github_markdown, overlap
from autograder.instructor.sync import BEGIN, END, SKIP, differences, expected_labs

FOLDERS = ("course", "autograder")
FILES = ("pyproject.toml", "environment.yml", "scripts/slurm-localhost.sh")
GUIDE = ("docs/student-guide.md", "STUDENT-GUIDE.md")  # the docs' page, and where the release holds it
# A region this short is one trivial line (``return grad, None``) that a starter
# or a check may hold on its own; anything longer in a released file is a leak.
MIN_LEAK_CHARS = 30
AUTHOR = ("Kernels to Clusters", "k2c-release@localhost")
_SKIP = SKIP | {".pytest_cache"}


class ReleaseError(Exception):
    """Why the release was refused (before anything was written, except when git fails)."""


@dataclass(frozen=True)
class Release:
    path: Path
    files: int
    nbytes: int
    regions: int  # solution regions searched for in every released file
    commit: str


def _count(items, noun):
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


# --- what goes in ---------------------------------------------------------------------------------


def _walk(folder: Path):
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if path.is_file() and not _SKIP.intersection(rel.parts) and path.suffix != ".pyc":
            yield rel, path


def _without_outputs(data: bytes) -> bytes:
    """The notebook with every code cell's outputs and execution count cleared
    (unchanged bytes when there were none, so clean notebooks ship as they are)."""
    notebook = json.loads(data)  # contents() turns a broken notebook into a ReleaseError
    dirty = False
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") == "code" and (cell.get("outputs") or cell.get("execution_count") is not None
                                                 or "execution" in cell.get("metadata", {})):
            cell["outputs"], cell["execution_count"] = [], None
            cell.get("metadata", {}).pop("execution", None)
            dirty = True
    if not dirty:
        return data
    return (json.dumps(notebook, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode()


def contents(source: Path) -> dict[str, tuple[bytes, bool]]:
    """Every released file: relative path -> (bytes, executable)."""
    source = Path(source)
    for needed in ("solutions", "labs", *FOLDERS):
        if not (source / needed).is_dir():
            raise ReleaseError(f"no {needed}/ in {source.resolve()}: run 'k2c release' from the course repository's root")
    drift = differences(source / "solutions", source / "labs")
    if drift:
        shown = "\n  ".join(drift[:10]) + ("\n  …" if len(drift) > 10 else "")
        raise ReleaseError(f"labs/ has drifted from solutions/ ({_count(drift, 'file')}):\n  {shown}\n"
                           "run 'k2c sync', review and commit the starters, then release")
    hidden = hidden_checks(source)
    files: dict[str, tuple[bytes, bool]] = {}
    for folder in FOLDERS:
        for rel, path in _walk(source / folder):
            if f"{folder}/{rel.as_posix()}" not in hidden:
                files[f"{folder}/{rel.as_posix()}"] = (path.read_bytes(), os.access(path, os.X_OK))
    unreleased = references_to_unreleased(source, files)
    if unreleased:
        shown = "\n  ".join(unreleased[:10]) + ("\n  …" if len(unreleased) > 10 else "")
        raise ReleaseError(f"a released check uses a module the release leaves out ({_count(unreleased, 'place')}):"
                           f"\n  {shown}\nmove what uses it into a hidden check (lab.toml's hidden), then release")
    for rel, data in expected_labs(source / "solutions").items():
        files[f"labs/{rel.as_posix()}"] = (data, False)
    for rel in FILES:
        path = source / rel
        if not path.is_file():
            raise ReleaseError(f"{rel} is missing from {source.resolve()}")
        files[rel] = (path.read_bytes(), os.access(path, os.X_OK))
    for rel, (data, executable) in files.items():
        if rel.endswith(".ipynb"):
            try:
                files[rel] = (_without_outputs(data), executable)
            except ValueError as exc:
                raise ReleaseError(f"{rel} is not a notebook that can be read: {exc}") from None
    files.update({"README.md": (README.encode(), False), "Makefile": (MAKEFILE.encode(), False),
                  ".gitignore": (GITIGNORE.encode(), False)})
    files[GUIDE[1]] = (student_guide(source, files).encode(), False)
    return files


def student_guide(source: Path, files: dict[str, tuple[bytes, bool]]) -> str:
    """The docs' student guide as GitHub shows it; its links to other pages of the site, which
    the release does not hold, become their text."""
    path = source / GUIDE[0]
    if not path.is_file():
        raise ReleaseError(f"{GUIDE[0]} is missing from {source.resolve()}: the release's README points to it")
    folders = {rel.rsplit("/", 1)[0] for rel in files if "/" in rel}
    try:
        return github_markdown.from_myst(path.read_text(), lambda target: target.rstrip("/") in files
                                         or target.rstrip("/") in folders)
    except ValueError as exc:
        raise ReleaseError(f"{GUIDE[0]}: {exc}") from None


# --- hidden checks ---------------------------------------------------------------------------------


def hidden_checks(source: Path) -> set[str]:
    """The released paths (``autograder/checks/NN-slug/name``) of every file a lab's
    ``lab.toml`` lists as ``hidden``: the checks the student repository leaves out, and
    the oracles only they use. A list that names no such file, or a ``*_hidden`` file
    it does not list, refuses the release (it would ship a hidden file)."""
    found, problems = set(), []
    for meta in sorted((Path(source) / "autograder" / "checks").glob("*/lab.toml")):
        try:
            hidden = tomllib.loads(meta.read_text()).get("hidden", [])
        except tomllib.TOMLDecodeError as exc:
            raise ReleaseError(f"{meta} cannot be read: {exc}") from None
        problems += hidden_problems(meta.parent, hidden)
        found.update(f"autograder/checks/{meta.parent.name}/{name}" for name in hidden)
    if problems:
        raise ReleaseError("the hidden checks are not what lab.toml says:\n  " + "\n  ".join(problems))
    return found


def _names_used(code: str) -> set[str]:
    """Every module name a file imports (each dotted part) and every string constant in it
    that could name one (``load_beside(__file__, "oracles")``), but a hidden module it loads
    with ``load_hidden_beside``: that call is None where the module is left out, and the
    check grades without it (the student's own grading)."""
    tree = ast.parse(code)
    optional = {id(arg) for node in ast.walk(tree) if isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", "")) == "load_hidden_beside"
                for arg in node.args[1:2]}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(part for alias in node.names for part in alias.name.split("."))
        elif isinstance(node, ast.ImportFrom):
            names.update((node.module or "").split("."))
            names.update(alias.name for alias in node.names)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier()
              and id(node) not in optional):
            names.add(node.value)
    return names


def references_to_unreleased(source: Path, files: dict[str, tuple[bytes, bool]]) -> list[str]:
    """``["autograder/checks/NN-slug/check_x.py uses oracles_hidden", ...]``: each released
    file of a lab's checks that imports or names (as a string, as ``load_beside`` does) a
    module of that folder the release leaves out. A public check that needs a hidden
    oracle would fail to load in the student repository, or the oracle would have to ship."""
    found = []
    for folder in sorted((Path(source) / "autograder" / "checks").glob("*/")):
        prefix = f"autograder/checks/{folder.name}/"
        left_out = {p.stem for p in folder.glob("*.py") if prefix + p.name not in files}
        for rel, (data, _) in sorted(files.items()):
            if rel.startswith(prefix) and rel.endswith(".py") and left_out:
                try:
                    used = _names_used(data.decode())
                except (SyntaxError, UnicodeDecodeError):
                    continue
                found += [f"{rel} uses {name}, which is not released" for name in sorted(used & left_out)]
    return found


# --- the leak guard -------------------------------------------------------------------------------


def _squash(text: str) -> str:
    # Whitespace and ';' go: a region re-indented, re-wrapped or written on one
    # line as a hint ("a = f(x); return a") is still the same code.
    return re.sub(r"[\s;]+", "", text)


def _without_comments(code: str) -> str:
    """``code`` without its comments (the same text when it does not tokenize)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(textwrap.dedent(code)).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return code
    return " ".join(t.string for t in tokens if t.type != tokenize.COMMENT)


def solution_regions(solutions: Path) -> list[tuple[str, str]]:
    """``(where, squashed code)`` for every region between the markers of ``solutions/``,
    with and without its comments, above the trivial length."""
    found = []
    for path in sorted(Path(solutions).rglob("*.py")):
        lines, start = path.read_text().splitlines(), None
        for i, line in enumerate(lines):
            if BEGIN.match(line):
                start = i
            elif END.match(line) and start is not None:
                code = "\n".join(lines[start + 1:i])
                for variant in {_squash(code), _squash(_without_comments(code))}:
                    if len(variant) >= MIN_LEAK_CHARS:
                        found.append((f"{path.relative_to(solutions.parent)}:{start + 1}", variant))
                start = None
    return found


def searchable(rel: str, data: bytes) -> list[str]:
    """The texts of a released file to search, squashed: as it is, and for
    Python (a module, a notebook's code cells) without comments too. A notebook
    is searched as its cells' sources and outputs, not as escaped JSON."""
    if rel.endswith(".whl"):  # a grader wheel (k2c release --ci): each file in it
        with zipfile.ZipFile(io.BytesIO(data)) as wheel:
            return [t for name in wheel.namelist() for t in searchable(name, wheel.read(name))]
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return []
    code = text if rel.endswith(".py") else ""
    if rel.endswith(".ipynb"):
        cells = json.loads(text).get("cells", [])
        parts = ["".join(c.get("source", "")) for c in cells]
        code = "\n".join(p for p, c in zip(parts, cells) if c.get("cell_type") == "code")
        for cell in cells:
            for output in cell.get("outputs", []):
                parts.append("".join(output.get("text", "")))
                parts += ["".join(v) if isinstance(v, list) else str(v) for v in output.get("data", {}).values()]
        text = "\n".join(parts)
    return [_squash(text)] + ([_squash(_without_comments(code))] if code else [])


def leaks(solutions: Path, files: dict[str, tuple[bytes, bool]]) -> tuple[list[str], int]:
    """``(["solutions/...:line in released/file", ...], number of regions searched)``."""
    regions = solution_regions(solutions)
    texts = {rel: searchable(rel, data) for rel, (data, _) in files.items()}
    found = sorted({f"{where} in {rel}" for where, code in regions
                    for rel, variants in texts.items() if any(code in t for t in variants)})
    return found, len({where for where, _ in regions})


# --- writing it -----------------------------------------------------------------------------------


def _check_target(target: Path, source: Path) -> None:
    if target.exists() and not target.is_dir():
        raise ReleaseError(f"{target} is a file: give a new or empty folder for the student repository")
    if target.is_dir() and any(target.iterdir()):
        entries = sorted(p.name for p in target.iterdir())
        shown = ", ".join(entries[:5]) + (", …" if len(entries) > 5 else "")
        raise ReleaseError(f"{target} is not empty ({shown}); the release is a fresh git "
                           "repository, so give a new or empty folder (to update a published one, release into a "
                           "new folder and copy its files over your clone)")
    inside = target.resolve()
    for folder in (source / f for f in (*FOLDERS, "labs", "solutions")):
        if inside == folder.resolve() or folder.resolve() in inside.parents:
            raise ReleaseError(f"{target} is inside {folder.name}/, which the release copies: choose a folder elsewhere")


def _git(target: Path, *args: str, author: tuple[str, str]) -> str:
    # The release must commit on a machine with no git identity and must not
    # follow a GIT_DIR or hooks of whoever runs it.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_AUTHOR_NAME=author[0], GIT_AUTHOR_EMAIL=author[1],
               GIT_COMMITTER_NAME=author[0], GIT_COMMITTER_EMAIL=author[1])
    done = subprocess.run(["git", "-c", "core.hooksPath=/dev/null", "-c", "commit.gpgsign=false",
                           "-c", "core.autocrlf=false", "-C", str(target), *args],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise ReleaseError(f"git {args[0]} failed in {target}: {done.stderr.strip() or done.stdout.strip()}; "
                           "the folder is incomplete: delete it and release again")
    return done.stdout.strip()


def parse_author(text: str) -> tuple[str, str]:
    m = re.fullmatch(r"\s*(.+?)\s*<([^<>\s]+@[^<>\s]+)>\s*", text)
    if not m:
        raise ReleaseError(f"--author {text!r}: write it as 'Name <email>'")
    return m[1], m[2]


def ci_files(labs, source: Path) -> dict[str, tuple[bytes, bool]]:
    """For each lab of ``k2c release --ci``: its workflow and its grader wheel (``autograder.instructor.ci``)."""
    import tempfile

    from autograder.instructor import ci

    files = {}
    for lab in labs:
        with tempfile.TemporaryDirectory() as folder:
            built = ci.build(lab, Path(folder), source)
            files[f"{ci.WHEEL_FOLDER}/{built.wheel}"] = ((Path(folder) / built.wheel).read_bytes(), False)
            files[f".github/workflows/k2c-grade-{lab.number}.yml"] = ((Path(folder) / "k2c-grade.yml").read_bytes(),
                                                                      False)
    return files


def release(source: Path, target: Path, author: tuple[str, str] = AUTHOR, say=lambda line: None,
            ci_labs=()) -> Release:
    """Write the student repository into ``target`` (new or empty) and commit it."""
    source, target = Path(source), Path(target)
    if not shutil.which("git"):
        raise ReleaseError("git is not installed: the release is a git repository (Debian/Ubuntu: apt-get install git)")
    _check_target(target, source)
    files = contents(source)
    files.update(ci_files(ci_labs, source))
    say(f"labs/ is in sync with solutions/; {len(files)} files to release")
    found, regions = leaks(source / "solutions", files)
    if found:
        shown = "\n  ".join(found[:20]) + ("\n  …" if len(found) > 20 else "")
        raise ReleaseError(f"solution code would leak into the release ({_count(found, 'place')}):\n  {shown}\n"
                           "rewrite those hints or files so they no longer hold the reference, then release")
    say(f"no solution code in any of them ({regions} solution regions searched for, notebooks included)")
    found = overlap.shares(source / "solutions", files)
    too_much = overlap.problems(found)
    if too_much:
        shown = "\n  ".join(too_much[:20]) + ("\n  …" if len(too_much) > 20 else "")
        raise ReleaseError(f"the release would hand out too much of the answers ({_count(too_much, 'place')}):\n  "
                           f"{shown}\nteach on another instance, or cut the hint to a direction, then release "
                           "('python -m autograder.instructor.overlap NN' shows a lab's table)")
    worst = max((s for s in found if s.size >= overlap.MIN_GRAMS), key=lambda s: s.released, default=None)
    if worst:
        idioms = [s for s in found if s.size < overlap.MIN_GRAMS]
        idiom = max(idioms, key=lambda s: s.released, default=None)
        say(f"at most {worst.released:.2f} of a solution region's token 5-grams are in the release "
            f"({worst.where}; bound {overlap.MAX_SHARE})"
            + (f"; {len(idioms)} regions of under {overlap.MIN_GRAMS} windows (a line of idiom, exact search only) "
               f"at most {idiom.released:.2f} ({idiom.where})" if idiom else "")
            + f"; hints at most {max(s.hint_chars for s in found)} characters (bound {overlap.MAX_HINT_CHARS})")
    target.mkdir(parents=True, exist_ok=True)
    for rel, (data, executable) in files.items():
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.chmod(path, 0o755 if executable else 0o644)
    _git(target, "init", "-q", "-b", "main", author=author)
    _git(target, "add", "-A", "--force", ".", author=author)
    _git(target, "commit", "-q", "-m", COMMIT_MESSAGE, author=author)
    commit = _git(target, "rev-parse", "--short", "HEAD", author=author)
    return Release(target, len(files), sum(len(d) for d, _ in files.values()), regions, commit)


COMMIT_MESSAGE = """Kernels to Clusters: the student repository

Lectures, handouts and starters, the course toolkit and the grader with each
lab's public checks, as written by `k2c release`. Reference solutions and the
hidden checks are not included.
"""

GITIGNORE = """\
.venv/
__pycache__/
*.pyc
*.egg-info/
build/
.ipynb_checkpoints/
.pytest_cache/
results*.json
"""

MAKEFILE = """\
# Kernels to Clusters, the student repository: `make setup`, then `make grade`.
# PYTHON (the interpreter that creates the venv) and VENV (where) may be overridden.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SUBMISSION ?= labs
LAB ?= all
INSTALLED := $(VENV)/.installed

.PHONY: setup grade doctor

setup: $(INSTALLED)
\t@echo "ready: 'make grade LAB=01' grades lab 01; '$(BIN)/jupyter lab' opens the lectures and handouts"

grade: $(INSTALLED)
\t$(BIN)/k2c grade $(LAB) --submission $(SUBMISSION)

doctor: $(INSTALLED)
\t$(BIN)/k2c doctor

$(BIN)/python:
\t@$(PYTHON) -m venv $(VENV) || { \\
\t  echo "$(PYTHON) -m venv failed: install your system's venv package (Debian/Ubuntu: sudo apt-get install python3-venv)"; \\
\t  exit 1; }
\t$(BIN)/python -m pip install --quiet --upgrade pip

# PYTHONWARNINGS: setuptools notes on every editable install that a folder may shadow a package.
$(INSTALLED): pyproject.toml | $(BIN)/python
\t@echo "installing the course, the grader and their dependencies into $(VENV) (several minutes the first time)"
\tPYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip install --quiet -e .
\t@touch $@
"""

README = """\
# Kernels to Clusters (k2c)

A course on parallel computing for deep learning, from one CUDA thread to a
training job spread over a cluster: numba and CuPy kernels, MPI collectives,
and data-, tensor- and pipeline-parallel training in PyTorch. This repository
is yours: the lectures, a lab for each module for you to complete, and the
grader that checks your labs on a laptop without a GPU (the CPU tier) or on a
GPU node (the GPU tier).

## Setting up

On Linux or macOS with Python 3.11 or newer (and `make`):

```bash
make setup    # create .venv with the course, the grader and their dependencies (several minutes, once)
make grade    # grade every lab in labs/: the starters score zero, "not implemented yet" for each check
```

`make grade LAB=02` grades one lab. Conda users can create the same
environment with `conda env create -f environment.yml`.

## Doing a lab

1. Read the lecture, `course/lectures/NN-slug.ipynb`, then open the lab's
   handout `labs/NN-slug/handout.ipynb` in Jupyter (`.venv/bin/jupyter lab`).
2. Fill in the module next to it (e.g. `labs/02-cuda-model/cuda_basics.py`).
   Each function you write raises `NotImplementedError("not implemented yet:
   ...")` with a hint until you replace that line with your code.
3. Grade it: `make grade LAB=02` (or `.venv/bin/k2c grade 02`). Each check says
   what it expected, what it got, and where.

[The student guide](STUDENT-GUIDE.md) says more: how to read the grader's
feedback, what each status means, and what the checks look for.

Some labs build on earlier ones and import your own modules from those labs'
folders in `labs/`, so do the labs in order. `.venv/bin/k2c doctor` says what
this machine offers (GPU or CUDA simulator, MPI, torch backends) and what to
install when something is missing.

## What is where

| folder | what is in it |
| --- | --- |
| `course/lectures/` | the lectures (notebooks) and the modules they run |
| `course/` | the toolkit the lectures, the labs and the grader share |
| `labs/NN-slug/` | each lab's handout and the code you write |
| `autograder/` | the grader (`k2c`) and each lab's checks, in `autograder/checks/NN-slug/` |
| `scripts/slurm-localhost.sh` | a one-node SLURM cluster on this machine, for the last module |
| `STUDENT-GUIDE.md` | setting up, doing a lab, and reading the grader's feedback |

Your code runs in a sandbox, one call at a time, under a time and a memory
limit, so a crash costs one check and a hang the checks of the function that
hangs, never the run. The grade that counts
is the one your instructor's copy of the grader gives: editing `autograder/`
here changes only what you see. That copy also runs a few hidden checks, which
are not in this repository: the same functions on other inputs, against the
complete reference answers (the public checks give you feedback on every
function; [the student guide](STUDENT-GUIDE.md#hidden-checks) lists what each
lab's hidden checks test). In lab 13 it also grades, in each planner check,
cases drawn for that grading; here those checks grade their public cases only,
and say so ("drawn cases not graded here").
"""
