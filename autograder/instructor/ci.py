"""``k2c ci LAB``: grade a lab in GitHub Actions or Classroom 50, with no private repository.

GitHub Classroom is being sunset, and a workflow that installs the grader from
the course repository cannot run: that repository holds ``solutions/`` and is
private. This writes, into one folder, what a student repository needs instead:

- a wheel of the grader cut down as ``k2c gradescope`` cuts it, to this lab and
  the earlier labs whose files it uses (lab 13 uses 07-10): the grader, those
  labs' *public* checks and the course modules they import. No ``solutions/``,
  no hidden check and no oracle only a hidden check uses: anyone who can read
  the student repository can read this wheel, as they can read the release;
- ``k2c-grade.yml``, a GitHub Actions workflow for the student repository's
  ``.github/workflows/``: it checks the wheel against its sha256, installs it
  (torch from its CPU index), runs ``k2c selftest``, grades the lab and the labs
  it uses from the repository's ``labs/``, and writes the job summary and a
  JUnit file (kept as an artifact); ``github-classroom.yml`` is the same for
  GitHub Classroom's grading reporter, while that product lasts;
- ``autograder.py``, Classroom 50's autograder for the assignment (its folder
  ``CLASSROOM/autograders/ASSIGNMENT/`` holds it beside the wheel): it writes
  ``result.json`` (``k2c grade --format classroom50``) and ``release-body.md``.

``k2c release DIR --ci LAB`` commits the workflow and the wheel (under ``.k2c/``)
into the student repository. Grading in a repository the student can push to
is feedback, not proof: a student can edit the workflow. Grades that count come
from the instructor's own run (``k2c grade-class``), Gradescope, or Classroom 50,
whose runner fetches the autograder from the instructor's repository.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from autograder.grading.labs import Lab, find_lab
from autograder.instructor import gradescope
from autograder.instructor.gradescope import CPU_INDEX, GRADER, REPO, distribution

WHEEL_FOLDER = ".k2c"  # where `k2c release --ci` commits the wheel in the student repository


@dataclass(frozen=True)
class Built:
    folder: Path
    wheel: str
    sha256: str
    labs: tuple[str, ...]  # the lab first, then those it uses
    requirements: tuple[str, ...]


def graded_labs(lab: Lab) -> list[Lab]:
    """The lab, then each earlier lab whose files it uses (lab.toml's ``uses``)."""
    used = sorted({Path(rel).parts[0] for rel in lab.uses})
    return [lab] + [find_lab(slug) for slug in used if slug != lab.slug]


def public_check_files(lab: Lab) -> dict[str, Path]:
    """The lab's check files a student may read: all but lab.toml's ``hidden``."""
    hidden = set(lab.hidden)
    return {f"autograder/checks/{lab.slug}/{p.relative_to(lab.checks_dir).as_posix()}": p
            for p in sorted(lab.checks_dir.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts and p.relative_to(lab.checks_dir).as_posix() not in hidden}


def wheel_files(labs: list[Lab], repo: Path = REPO) -> dict[str, Path]:
    files = {f"autograder/{p.relative_to(GRADER).as_posix()}": p for p in gradescope.grader_sources()}
    for lab in labs:
        files.update(public_check_files(lab))
        files.update({f"course/{name}.py": repo / "course" / f"{name}.py"
                      for name in gradescope.course_modules(lab, repo)})
    return files


def requirements(labs: list[Lab], repo: Path = REPO) -> list[str]:
    pinned = gradescope.project(repo).get("dependencies", [])
    found: dict[str, str] = {}
    for lab in labs:
        for spec in gradescope.requirements(lab, pinned):
            found.setdefault(distribution(spec), spec)
    return list(found.values())


# The steps both workflows start with: the submission, Python, and the grader from its wheel.
INSTALL = r"""      - uses: actions/checkout@v4
      - uses: actions/setup-python@v5
        with:
          python-version: "3.12"
      - name: Install the grader
        run: |
          echo "$K2C_WHEEL_SHA256  $K2C_WHEEL" | sha256sum --check
          # bubblewrap: the sandbox's strongest layer (the grader falls back by itself where it cannot run)
          sudo apt-get update -qq && sudo apt-get install -y -qq bubblewrap
          python -m venv "$RUNNER_TEMP/k2c"
@CPU_INDEX@          "$RUNNER_TEMP/k2c/bin/pip" install --quiet "$K2C_WHEEL"
          echo "$RUNNER_TEMP/k2c/bin" >> "$GITHUB_PATH"
      - name: Check the grader runs here
        run: k2c selftest "$LABS"
"""

HEADER = r"""# Grades lab @LAB@ (and the labs it uses: @USES@) on every push, with no private
# repository: written by `k2c ci @LAB@`. The grader is the wheel below, checked
# against its sha256; it holds the labs' public checks and no solution.
"""

ENV = r"""env:
  LABS: "@LABS@"
  K2C_WHEEL: "@WHEEL_PATH@"
  K2C_WHEEL_SHA256: "@SHA256@"
"""

WORKFLOW = HEADER + r"""name: Grade lab @LAB@
"on":
  push:
  workflow_dispatch:
permissions:
  contents: read
""" + ENV + r"""jobs:
  grade:
    runs-on: ubuntu-latest
    timeout-minutes: 60
    steps:
""" + INSTALL + r"""      - name: Grade
        run: |
          k2c grade "$LABS" --submission labs --format junit -o k2c-junit.xml \
              --summary "$GITHUB_STEP_SUMMARY" --require-full
      - name: Keep the JUnit report
        if: ${{ !cancelled() }}
        uses: actions/upload-artifact@v4
        with:
          name: k2c-junit
          path: k2c-junit.xml
"""

# GitHub Classroom (being sunset in 2026): its grading reporter reads the result from
# the environment variable named after the grading step's id (K2C_RESULTS for id k2c)
# and sends "Points X/Y" to Classroom; report_ci.classroom says how partial credit reads.
GITHUB_CLASSROOM = HEADER + r"""# For GitHub Classroom, which is being sunset: prefer k2c-grade.yml or Classroom 50.
name: Autograding Tests
"on": [push, repository_dispatch, workflow_dispatch]
permissions:
  checks: write
  actions: read
  contents: read
""" + ENV + r"""jobs:
  run-autograding-tests:
    runs-on: ubuntu-latest
    if: github.actor != 'github-classroom[bot]'
    timeout-minutes: 60
    steps:
""" + INSTALL + r"""      - name: Grade
        id: k2c
        run: |
          status=0
          k2c grade "$LABS" --submission labs --format classroom -o classroom.b64 \
              --summary "$GITHUB_STEP_SUMMARY" || status=$?
          echo "result=$(cat classroom.b64)" >> "$GITHUB_OUTPUT"
          exit "$status"
      - name: Autograding Reporter
        if: ${{ !cancelled() && steps.k2c.outputs.result != '' }}
        uses: classroom-resources/autograding-grading-reporter@v1
        env:
          K2C_RESULTS: "${{ steps.k2c.outputs.result }}"
        with:
          runners: k2c
"""

CLASSROOM50 = r'''"""Classroom 50's autograder for k2c lab @LAB@ (written by `k2c ci @LAB@`).

Its folder, CLASSROOM/autograders/ASSIGNMENT/, holds it beside @WHEEL@. The runner
runs it in the student's checkout: it installs that wheel (checked against its
sha256) into a virtual environment, checks the stack runs (`k2c selftest`), and
grades lab @LAB@ from the checkout's labs/ into ./result.json and ./release-body.md.
It exits 0 when grading ran (the score is in result.json) and 1 when it could not:
the runner then records an infrastructure error, not a student's zero.
"""
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
WHEEL = HERE / "@WHEEL@"
SHA256 = "@SHA256@"
LAB = "@LAB@"
CPU_BUILDS = @CPU_BUILDS@  # (index, requirement): torch's CPU build, not its multi-GB CUDA one

if hashlib.sha256(WHEEL.read_bytes()).hexdigest() != SHA256:
    sys.exit(f"{WHEEL.name} is not the wheel `k2c ci {LAB}` wrote (sha256 differs)")
# K2C_VENV: an environment to install into instead of a new one (a runner image that has torch)
venv = Path(os.environ.get("K2C_VENV") or Path(tempfile.mkdtemp(prefix="k2c-")) / "venv")
if not (venv / "bin" / "pip").exists():
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
pip = [str(venv / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check"]
for index, requirement in CPU_BUILDS:
    subprocess.run(pip + ["--index-url", index, requirement], check=True)
subprocess.run(pip + [str(WHEEL)], check=True)
k2c = str(venv / "bin" / "k2c")
if subprocess.run([k2c, "selftest", LAB]).returncode != 0:
    sys.exit("this runner cannot grade lab " + LAB + ": see the lines above")
graded = subprocess.run([k2c, "grade", LAB, "--submission", "labs" if Path("labs").is_dir() else ".",
                         "--format", "classroom50", "-o", "result.json", "--summary", "release-body.md"],
                        env=dict(os.environ))
sys.exit(0 if graded.returncode in (0, 1) else 1)
'''


def _cpu_builds(requires: list[str]) -> list[tuple[str, str]]:
    return [(CPU_INDEX[distribution(spec)], spec) for spec in requires if distribution(spec) in CPU_INDEX]


def build(lab: Lab, folder: Path, repo: Path = REPO, wheel_path: str | None = None) -> Built:
    """Write the wheel, the workflow and Classroom 50's autograder.py into ``folder``.
    ``wheel_path``: where the workflow finds the wheel in the student repository
    (default: ``.k2c/`` and the wheel's name, where ``k2c release --ci`` commits it)."""
    labs = graded_labs(lab)
    requires = requirements(labs, repo)
    version = gradescope.project(repo)["version"]
    name, data = gradescope.wheel(f"{version}+ci{lab.number}", requires, wheel_files(labs, repo),
                                  f"k2c's grader for lab {lab.slug} and the labs it uses, public checks only")
    sha = hashlib.sha256(data).hexdigest()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)
    numbers = ",".join(l.number for l in labs)
    cpu = "".join(f'          "$RUNNER_TEMP/k2c/bin/pip" install --quiet --index-url {index} "{spec}"\n'
                  for index, spec in _cpu_builds(requires))
    for template, file in ((WORKFLOW, "k2c-grade.yml"), (GITHUB_CLASSROOM, "github-classroom.yml")):
        (folder / file).write_text(
            template.replace("@LABS@", numbers).replace("@LAB@", lab.number)
            .replace("@USES@", ", ".join(l.number for l in labs[1:]) or "none")
            .replace("@WHEEL_PATH@", wheel_path or f"{WHEEL_FOLDER}/{name}").replace("@SHA256@", sha)
            .replace("@CPU_INDEX@", cpu))
    autograder = (CLASSROOM50.replace("@LAB@", lab.number).replace("@WHEEL@", name).replace("@SHA256@", sha)
                  .replace("@CPU_BUILDS@", repr(_cpu_builds(requires))))
    (folder / "autograder.py").write_text(autograder)
    return Built(folder, name, sha, tuple(l.slug for l in labs), tuple(requires))
