"""``k2c gradescope LAB``: the autograder zip of one lab for a Gradescope assignment.

The zip holds ``setup.sh`` (run once, as root, when Gradescope builds the image),
``run_autograder`` (run for every submission) and a wheel of the course cut
down to what grading that lab needs: the grader, the lab's checks, and the
course modules that the grader, the checks and the lab's reference import.
Nothing of ``solutions/``, no other lab's checks, no lectures: there is no
reference in the image for a student's code to read and print. The wheel's dependencies are the
grader's own and the lab's ``requires`` (its ``lab.toml``), at the versions
``pyproject.toml`` pins.

Both scripts take their paths from ``K2C_AUTOGRADER_ROOT`` (default
``/autograder``) and ``K2C_VENV`` (default ``/opt/k2c``), so a test can stand
the same layout up in a temporary folder.
"""
from __future__ import annotations

import ast
import base64
import hashlib
import io
import re
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

from autograder.grading.labs import CHECKS_ROOT, Lab, UsageError

GRADER = CHECKS_ROOT.parent  # autograder/
REPO = GRADER.parent  # a checkout: pyproject.toml, course/, solutions/, labs/


def grader_sources() -> list[Path]:
    """The grader's own modules, every part but the checks: ``autograder/**.py``."""
    return sorted(p for p in GRADER.rglob("*.py") if "checks" not in p.relative_to(GRADER).parts
                  and "__pycache__" not in p.parts)
# What autograder/ itself imports from outside the standard library.
GRADER_REQUIRES = ("numpy", "pytest")
# Gradescope has no GPU: these come from an index of CPU-only builds (torch's is
# a few hundred MB instead of several GB with its CUDA libraries).
CPU_INDEX = {"torch": "https://download.pytorch.org/whl/cpu"}
# Fixed entry times, so that the same checkout gives the same zip.
EPOCH = (1980, 1, 1, 0, 0, 0)


@dataclass(frozen=True)
class Built:
    path: Path
    wheel: str
    requirements: tuple[str, ...]
    course_modules: tuple[str, ...]


def distribution(spec: str) -> str:
    """The normalized distribution name of a requirement: ``"Foo_Bar>=1"`` -> ``"foo-bar"``."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec).group(1)
    return re.sub(r"[-_.]+", "-", name).lower()


def project(repo: Path = REPO) -> dict:
    pyproject = repo / "pyproject.toml"
    if not pyproject.is_file():
        raise UsageError(f"k2c gradescope builds from a checkout of the course: no pyproject.toml in {repo}")
    return tomllib.loads(pyproject.read_text())["project"]


def requirements(lab: Lab, pinned: list[str]) -> list[str]:
    """The wheel's Requires-Dist: the grader's and the lab's distributions, as
    ``pinned`` (pyproject's dependencies) states them. A lab without ``requires``
    gets every pinned one; an entry with its own version specifier is kept as is."""
    by_name = {distribution(spec): spec for spec in pinned}
    wanted = GRADER_REQUIRES + (lab.requires if lab.requires is not None else tuple(by_name))
    found = {}
    for entry in wanted:
        name = distribution(entry)
        if re.search(r"[<>=!~;@\[]", entry):
            found.setdefault(name, entry.strip())
        elif name in by_name:
            found.setdefault(name, by_name[name])
        else:
            raise UsageError(f"lab {lab.slug} requires {entry!r}, which pyproject.toml's dependencies do not pin; "
                             "add it there or give a version in lab.toml")
    return list(found.values())


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, lazy imports inside functions included
    (``from a.b import c`` gives ``a.b`` and ``a.b.c``: ``c`` may be a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def lab_sources(lab: Lab, repo: Path = REPO) -> list[Path]:
    """The lab's own files and those it ``uses``, from the reference (the
    starter where a checkout has no solutions/): what students' code imports."""
    found = []
    for rel in [f"{lab.slug}/{name}" for name in lab.files] + list(lab.uses):
        for root in (repo / "solutions", repo / "labs"):
            if (root / rel).is_file():
                found.append(root / rel)
                break
        else:
            raise UsageError(f"neither solutions/ nor labs/ in {repo} has {rel}")
    return found


def course_modules(lab: Lab, repo: Path = REPO) -> list[str]:
    """The course modules grading ``lab`` imports, directly or through one another
    (``course/__init__.py`` always: importing any of them runs it)."""
    course = repo / "course"
    # Not the self-test's: it probes only what the lab requires, through the modules the lab's own files import.
    # Nor the rank launcher's, which imports the launcher of the lab's kind only: torch's or MPI's (below).
    files = [p for p in grader_sources() if p.name not in ("selftest.py", "stack_probes.py", "ranks.py")] \
        + sorted(lab.checks_dir.glob("*.py")) + lab_sources(lab, repo)
    requires = set(lab.requires) if lab.requires is not None else {"torch", "mpich"}
    launchers = [name for dist, name in (("torch", "dist"), ("mpich", "mpi")) if dist in requires]
    extra = ["wire", "jobs", *launchers] if launchers else []  # a lab of several processes: its rank jobs' launcher
    wanted, queue = {"__init__", *extra}, [course / "__init__.py"] + files + [course / f"{name}.py" for name in extra]
    while queue:
        for module in imported_modules(queue.pop()):
            parts = module.split(".")
            if parts[0] == "course" and len(parts) > 1 and parts[1] not in wanted and (course / f"{parts[1]}.py").is_file():
                wanted.add(parts[1])
                queue.append(course / f"{parts[1]}.py")
    return sorted(wanted)


def wheel_files(lab: Lab, repo: Path = REPO) -> dict[str, Path]:
    """What the wheel holds, by its path inside the wheel."""
    files = {f"autograder/{p.relative_to(GRADER).as_posix()}": p for p in grader_sources()}
    # The same files as Lab.checks_digest hashes, so a report's checks_sha256 matches the checkout's.
    files.update({f"autograder/checks/{lab.slug}/{p.relative_to(lab.checks_dir).as_posix()}": p
                  for p in sorted(lab.checks_dir.rglob("*")) if p.is_file() and "__pycache__" not in p.parts})
    files.update({f"course/{name}.py": repo / "course" / f"{name}.py" for name in course_modules(lab, repo)})
    return files


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _add(archive: zipfile.ZipFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = zipfile.ZipInfo(name, EPOCH)
    info.external_attr = (0o100000 | mode) << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    archive.writestr(info, data)


def wheel(version: str, requires: list[str], files: dict[str, Path], summary: str) -> tuple[str, bytes]:
    """A pure-Python wheel (the binary distribution format: the files, then a
    dist-info folder with METADATA, WHEEL, the console script and a RECORD of
    every file's hash), written directly: no build backend, no network."""
    dist_info = f"k2c-{version}.dist-info"
    contents = {name: path.read_bytes() for name, path in files.items()}
    contents[f"{dist_info}/METADATA"] = "\n".join(
        ["Metadata-Version: 2.1", "Name: k2c", f"Version: {version}", f"Summary: {summary}",
         "Requires-Python: >=3.11", *(f"Requires-Dist: {r}" for r in requires)]).encode() + b"\n"
    contents[f"{dist_info}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: k2c gradescope\n"
                                      b"Root-Is-Purelib: true\nTag: py3-none-any\n")
    contents[f"{dist_info}/entry_points.txt"] = b"[console_scripts]\nk2c = autograder.cli:main\n"
    contents[f"{dist_info}/top_level.txt"] = b"autograder\ncourse\n"
    record = "".join(f"{name},{_digest(data)},{len(data)}\n" for name, data in contents.items())
    contents[f"{dist_info}/RECORD"] = (record + f"{dist_info}/RECORD,,\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in contents.items():
            _add(archive, name, data)
    return f"k2c-{version}-py3-none-any.whl", buffer.getvalue()


SETUP = r"""#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the image of lab @LAB@'s autograder
# (written by `k2c gradescope @LAB@`). K2C_AUTOGRADER_ROOT, K2C_VENV and K2C_PYTHON
# override Gradescope's paths and the interpreter.
set -euo pipefail
root="${K2C_AUTOGRADER_ROOT:-/autograder}"
venv="${K2C_VENV:-/opt/k2c}"
python="${K2C_PYTHON:-python3}"

# System packages, only those missing: Python's venv, bubblewrap, the grader's strongest
# isolation (where the container refuses it, the grader falls back by itself), and the
# programs this lab's checks run (lab.toml's system).
missing=()
"$python" -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
command -v bwrap >/dev/null || missing+=(bubblewrap)
@SYSTEM@if [ "${#missing[@]}" -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "setup.sh: k2c needs Python 3.11 or newer; $python is $("$python" -V 2>&1): choose a newer base image" >&2
  exit 1
fi

"$python" -m venv "$venv"
@CPU_INDEX@"$venv/bin/pip" install --quiet --disable-pip-version-check "$root"/source/k2c-*.whl
@HIDE@

# Fail the image build, not the first student's submission, when something is
# missing: the stack this lab's checks run must run here (the sandbox with one call
# through it, 2 MPI ranks, 2 gloo processes, a compile for every GPU target: what the lab needs),
# and an empty submission must grade (to zero) with every check collected.
if ! "$venv/bin/k2c" selftest @SLUG@; then
  echo "setup.sh: this image cannot grade lab @SLUG@: see the ✗ lines above" >&2
  exit 1
fi
empty="$(mktemp -d)"
"$venv/bin/k2c" grade @SLUG@ --submission "$empty" --format json -o "$empty/report.json" >/dev/null
rm -rf "$empty"
echo "setup.sh: k2c is ready in $venv for lab @SLUG@"
"""

RUN = r"""#!/usr/bin/env bash
# Gradescope runs this for every submission of lab @LAB@ (written by `k2c gradescope @LAB@`).
# The grader writes results.json itself, after every call into the submission has ended;
# K2C_AUTOGRADER_ROOT and K2C_VENV override Gradescope's paths.
set -uo pipefail
root="${K2C_AUTOGRADER_ROOT:-/autograder}"
venv="${K2C_VENV:-/opt/k2c}"
mkdir -p "$root/results"
@HIDE@
exec "$venv/bin/k2c" grade @SLUG@ --submission "$root/submission" \
    --format gradescope -o "$root/results/results.json"
"""


# Where a container refuses bubblewrap, the grader falls back to the subreaper layer, which
# hides no file: student code, as nobody, reads what nobody may read. So the grader's files
# are root's alone: the checks and oracles, the instructor's tools, this bundle (its wheel
# holds them too) and Gradescope's metadata. The grader runs as root and copies the harness
# modules a call needs into the sandbox itself. Both scripts do it (an image may be rebuilt).
HIDE = r"""# The grader's files, unreadable to nobody (student code) under any isolation layer.
grader="$("$venv/bin/python" -c 'import autograder, os; print(os.path.dirname(autograder.__file__))')"
chmod -R go-rwx "$grader/checks" "$grader/instructor" "$grader/cli.py" "$grader/doctor.py" "$root/source"
chmod go-rwx "$root/submission_metadata.json" 2>/dev/null || true"""


def scripts(lab: Lab, requires: list[str]) -> tuple[str, str]:
    cpu_builds = "".join(
        f'"$venv/bin/pip" install --quiet --disable-pip-version-check --index-url {CPU_INDEX[distribution(spec)]}'
        f' "{spec}"\n'
        for spec in requires if distribution(spec) in CPU_INDEX)

    def fill(text):
        return text.replace("@LAB@", lab.number).replace("@SLUG@", lab.slug).replace("@CPU_INDEX@", cpu_builds) \
            .replace("@HIDE@", HIDE) \
            .replace("@SYSTEM@", "".join(f"command -v {command} >/dev/null || missing+=({package})\n"
                                         for command, package in lab.system))
    return fill(SETUP), fill(RUN)


def build(lab: Lab, output: Path, repo: Path = REPO) -> Built:
    meta = project(repo)
    requires = requirements(lab, meta.get("dependencies", []))
    files = wheel_files(lab, repo)
    # The local version label says which lab's cut of the course this is.
    name, data = wheel(f"{meta['version']}+lab{lab.number}", requires, files,
                       f"k2c's autograder for lab {lab.slug} only")
    setup, run = scripts(lab, requires)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(output, "w") as archive:
        _add(archive, "setup.sh", setup.encode(), 0o755)
        _add(archive, "run_autograder", run.encode(), 0o755)
        _add(archive, name, data)
    modules = tuple(n.removeprefix("course/").removesuffix(".py") for n in files if n.startswith("course/"))
    return Built(output, name, tuple(requires), modules)
