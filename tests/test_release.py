"""`k2c release`: the student repository holds no solution code, and works as its README says."""
import ast
import io
import json
import os
import re
import subprocess
import sys
import sysconfig
import textwrap
import tokenize
from pathlib import Path

import pytest

from autograder.instructor import overlap
from autograder.instructor.release import ReleaseError, contents, leaks, release
from autograder.instructor.sync import strip_solutions
from conftest import REPO, k2c

BEGIN, END = re.compile(r"^\s*# BEGIN SOLUTION"), re.compile(r"^\s*# END SOLUTION\s*$")
TRIVIAL = 30  # squashed characters: `return grad, None` is shorter, and a starter may hold it by chance


def squash(text):
    return re.sub(r"[\s;]+", "", text)  # ';' too: a hint may write the lines of a body as one


def no_comments(code):
    try:
        tokens = tokenize.generate_tokens(io.StringIO(textwrap.dedent(code)).readline)
        return " ".join(t.string for t in tokens if t.type != tokenize.COMMENT)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return code


def solution_bodies():
    """``{(file:line of the function, name): {squashed body, and without comments}}``: for every
    function or method of solutions/, the statements of its body that lie between the markers."""
    bodies = {}
    for path in sorted((REPO / "solutions").rglob("*.py")):
        source = path.read_text()
        lines = source.splitlines()
        begins = [i for i, line in enumerate(lines, 1) if BEGIN.match(line)]
        ends = [i for i, line in enumerate(lines, 1) if END.match(line)]
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for begin, end in zip(begins, ends):
                inside = [s for s in node.body if begin < s.lineno and s.end_lineno < end]
                if inside:
                    text = "\n".join(lines[inside[0].lineno - 1:inside[-1].end_lineno])
                    key = (f"{path.relative_to(REPO)}:{node.lineno}", node.name)
                    bodies.setdefault(key, set()).update(
                        v for v in (squash(text), squash(no_comments(text))) if len(v) >= TRIVIAL)
    return {k: v for k, v in bodies.items() if v}


def released_texts(path):
    """A released file as searchable squashed texts: a notebook's cell sources and outputs (not
    its JSON), and any Python without its comments too."""
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        return []
    code = text if path.suffix == ".py" else ""
    if path.suffix == ".ipynb":
        cells = json.loads(text)["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        text = "\n".join(["".join(c["source"]) for c in cells] + [
            "".join(o.get("text", "")) + "".join("".join(v) for v in o.get("data", {}).values())
            for c in cells for o in c.get("outputs", [])])
    return [squash(text)] + ([squash(no_comments(code))] if code else [])


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


# --- cheap: the refusals --------------------------------------------------------------------------


def test_release_refuses_a_non_empty_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    proc = k2c("release", tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "is not empty (notes.txt)" in proc.stderr and "new or empty folder" in proc.stderr
    assert os.listdir(tmp_path) == ["notes.txt"]


def _course(root, solution, starter):
    for folder in ("course", "autograder", "scripts", "solutions/01-x", "labs/01-x"):
        (root / folder).mkdir(parents=True)
    for name in ("pyproject.toml", "environment.yml", "scripts/slurm-localhost.sh"):
        (root / name).write_text("")
    (root / "docs").mkdir()
    (root / "docs/student-guide.md").write_text("# Student guide\n\n## Hidden checks\n\nSome.\n")  # the README's link
    (root / "solutions/01-x/m.py").write_text(solution)
    (root / "labs/01-x/m.py").write_text(starter)
    return root


SOLUTION = ("def f(x):\n    # BEGIN SOLUTION: HINT\n    total = sum(v * v for v in x)  # squares\n"
            "    return total / len(x) - min(x)\n    # END SOLUTION\n")


def test_release_refuses_drifted_starters(tmp_path):
    source = _course(tmp_path, SOLUTION.replace("HINT", "a line"), "def f(x):\n    return 0\n")
    with pytest.raises(ReleaseError, match=r"(?s)drifted from solutions/ \(1 file\).*differs: labs/01-x/m.py.*k2c sync"):
        contents(source)


def test_a_hint_that_spells_out_the_body_is_a_leak(tmp_path):
    solution = SOLUTION.replace("HINT", "total = sum(v * v for v in x); return total / len(x) - min(x)")
    source = _course(tmp_path, solution, strip_solutions(solution))
    files = contents(source)
    found, searched = leaks(source / "solutions", files)
    assert searched == 1 and found == ["solutions/01-x/m.py:2 in labs/01-x/m.py"]
    with pytest.raises(ReleaseError, match="would leak"):
        release(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


LONGER = ("def f(xs, lo, hi):\n    # BEGIN SOLUTION: HINT\n    out = []\n    for i, v in enumerate(xs):\n"
          "        if lo <= v < hi and i % 2 == 0:\n            out.append((i, v * v - lo))\n"
          "    return sorted(out, key=lambda p: (p[1], -p[0]))\n    # END SOLUTION\n")


def test_the_overlap_measure_sees_an_answer_renamed_rewrapped_or_in_prose(tmp_path):
    solution = LONGER.replace("HINT", "keep the even positions in range")
    source = _course(tmp_path, solution, strip_solutions(solution))
    # A lecture helper holds the body re-wrapped, re-indented, one name changed: no exact copy,
    # most of the same tokens.
    (source / "course" / "helper.py").write_text(
        "def g(xs,lo,hi):\n  out=[]\n  for i,v in enumerate(xs):\n   if lo<=v<hi and i%2==0:\n"
        "    out.append((i,v*v-lo))\n  return sorted(out,key=lambda q:(q[1],-q[0]))\n")
    assert leaks(source / "solutions", contents(source))[0] == []
    (found,) = overlap.shares(source / "solutions", contents(source))
    assert found.size >= overlap.MIN_GRAMS and 0.7 < found.released < 1 and found.top_file == "course/helper.py"
    assert overlap.problems([found]) and not (tmp_path / "out").exists()
    with pytest.raises(ReleaseError, match=r"(?s)too much of the answers.*0\.\d\d of its 5-grams"):
        release(source, tmp_path / "out")
    # Half of it, in a notebook's markdown (prose counts: the names and operators are the code).
    (source / "course" / "helper.py").unlink()
    half = "Loop `for i, v in enumerate(xs): if lo <= v < hi and i % 2 == 0:` and so on."
    (source / "course" / "notes.ipynb").write_text(json.dumps({"cells": [{"cell_type": "markdown", "source": half}]}))
    (found,) = overlap.shares(source / "solutions", contents(source))
    assert 0.2 < found.released < 0.5 and found.top_file == "course/notes.ipynb"
    assert overlap.problems([found]) == []
    # A hint that is a sentence passes; lines of the answer, or a paragraph, do not.
    for hint, why in [("out.append((i, v * v - lo)) for even i, then return sorted(out, key=lambda p: (p[1], -p[0]))",
                       "of its 5-grams"), ("keep " + "the pairs at even positions whose values lie in range " * 3,
                                       "characters")]:
        solution = LONGER.replace("HINT", hint)
        (source / "solutions/01-x/m.py").write_text(solution)
        (source / "labs/01-x/m.py").write_text(strip_solutions(solution))
        (found,) = overlap.shares(source / "solutions", contents(source))
        assert any(why in line for line in overlap.problems([found])), (hint, found)


def test_the_release_holds_at_most_half_of_any_answer_and_hints_are_one_sentence(released):
    """Issue 33's measure on what `k2c release` wrote (read back from the student repository)."""
    files = {rel: ((released / rel).read_bytes(), False) for rel in git(released, "ls-files").splitlines()}
    found = overlap.shares(REPO / "solutions", files)
    assert len(found) > 100 and sum(s.size >= overlap.MIN_GRAMS for s in found) > 100
    assert overlap.problems(found) == []


def _hidden_lab(root, public_check, toml="hidden = [\"check_x_hidden.py\", \"oracles_hidden.py\"]\n"):
    """A course whose one lab has a public check, a hidden check and a hidden oracle."""
    source = _course(root, SOLUTION.replace("HINT", "a line"), strip_solutions(SOLUTION.replace("HINT", "a line")))
    checks = source / "autograder" / "checks" / "01-x"
    checks.mkdir(parents=True)
    (checks / "lab.toml").write_text('title = "x"\nfiles = ["m.py"]\n' + toml)
    (checks / "check_x.py").write_text(public_check)
    (checks / "check_x_hidden.py").write_text('oracle = load_beside(__file__, "oracles_hidden")\n')
    (checks / "oracles_hidden.py").write_text("def answer(x):\n    return x\n")
    return source


def test_hidden_checks_and_their_oracles_stay_out_of_the_release(tmp_path):
    files = contents(_hidden_lab(tmp_path, 'from autograder.grading.checking import load_beside\n'))
    assert {f for f in files if f.startswith("autograder/checks/")} == {"autograder/checks/01-x/lab.toml",
                                                                        "autograder/checks/01-x/check_x.py"}


@pytest.mark.parametrize("public_check", [
    'oracle = load_beside(__file__, "oracles_hidden")\n',
    "import oracles_hidden\n",
    "from check_x_hidden import oracle\n",
], ids=["load_beside", "import", "from-import"])
def test_a_public_check_that_uses_a_hidden_module_refuses_the_release(tmp_path, public_check):
    source = _hidden_lab(tmp_path, public_check)
    with pytest.raises(ReleaseError, match=r"check_x\.py uses (oracles|check_x)_hidden, which is not released"):
        release(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_public_check_may_load_a_hidden_oracle_where_it_is_there(tmp_path):
    """load_hidden_beside: None in the student repository, so the public check grades there
    without it; the same name through load_beside still refuses the release."""
    public = ('from autograder.grading.checking import load_hidden_beside\n'
              'hidden = load_hidden_beside(__file__, "oracles_hidden")\n')
    files = contents(_hidden_lab(tmp_path, public))
    assert "autograder/checks/01-x/oracles_hidden.py" not in files
    assert files["autograder/checks/01-x/check_x.py"][0].decode() == public
    with pytest.raises(ReleaseError, match=r"check_x\.py uses oracles_hidden"):
        contents(_hidden_lab(tmp_path / "again", public + 'also = load_beside(__file__, "oracles_hidden")\n'))


def test_load_hidden_beside_is_none_where_the_release_left_the_module_out(tmp_path):
    from autograder.grading.checking import load_hidden_beside

    (tmp_path / "check_y.py").write_text("")
    assert load_hidden_beside(str(tmp_path / "check_y.py"), "oracles_hidden") is None
    (tmp_path / "oracles_hidden.py").write_text("ANSWER = 42\n")
    assert load_hidden_beside(str(tmp_path / "check_y.py"), "oracles_hidden").ANSWER == 42
    with pytest.raises(ValueError, match="use load_beside"):
        load_hidden_beside(str(tmp_path / "check_y.py"), "oracles")


@pytest.mark.parametrize("toml, why", [
    ('hidden = ["oracles_hidden.py"]\n', "check_x_hidden.py is named as hidden, but lab.toml's hidden does not list it"),
    ('hidden = ["check_x_hidden.py", "oracles_hidden.py", "check_y_hidden.py"]\n', "which is not a file"),
    ('hidden = ["check_x_hidden.py", "oracles_hidden.py", "check_x.py"]\n', "a hidden file is named *_hidden.py"),
], ids=["unlisted", "missing", "misnamed"])
def test_a_hidden_list_that_would_ship_a_hidden_file_refuses_the_release(tmp_path, toml, why):
    with pytest.raises(ReleaseError, match="the hidden checks are not what lab.toml says") as refused:
        contents(_hidden_lab(tmp_path, "x = 1\n", toml))
    assert why in str(refused.value)


def test_every_labs_hidden_list_is_right():
    from autograder.grading.labs import all_labs, hidden_problems

    assert [p for lab in all_labs() for p in hidden_problems(lab.checks_dir, lab.hidden)] == []
    assert {lab.number for lab in all_labs() if lab.hidden} >= {"11", "12", "13"}


# --- the release itself ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    target = tmp_path_factory.mktemp("release") / "k2c-student"
    proc = k2c("release", target, "--ci", "13", timeout=120)  # with lab 13's workflow and grader wheel
    assert proc.returncode == 0, proc.stderr
    assert "no solution code in any of them" in proc.stderr and "one commit" in proc.stdout
    return target


pytestmark = pytest.mark.xdist_group("release")  # the two slow tests share one release


@pytest.mark.slow
def test_release_is_one_clean_commit_with_no_solution_code(released):
    assert git(released, "rev-list", "--count", "HEAD") == "1"
    assert git(released, "status", "--porcelain") == ""
    assert git(released, "log", "-1", "--format=%an <%ae>") == "Kernels to Clusters <k2c-release@localhost>"
    tracked = git(released, "ls-files").splitlines()
    assert {"README.md", "Makefile", "pyproject.toml", "environment.yml", ".gitignore"} <= set(tracked)
    assert {p.split("/")[0] for p in tracked} == {"README.md", "Makefile", "pyproject.toml", "environment.yml",
                                                  ".gitignore", "STUDENT-GUIDE.md", "course", "labs", "autograder",
                                                  "scripts", ".github", ".k2c"}
    # The README's pointers resolve: the student guide is in the release, as Markdown GitHub renders
    # (no MyST left), and its own links lead to files of the release or within itself.
    readme, guide = (released / "README.md").read_text(), (released / "STUDENT-GUIDE.md").read_text()
    assert "](STUDENT-GUIDE.md" in readme and guide.startswith("# Student guide\n")
    assert not re.search(r"^:::|\{\w+\}`|^: ", guide, re.M), "MyST syntax left in STUDENT-GUIDE.md"
    anchors = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", guide, re.M)}
    for name, text in (("README.md", readme), ("STUDENT-GUIDE.md", guide)):
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            path, _, anchor = target.partition("#")
            assert target.startswith("http") or (released / (path or name)).exists(), f"{name} links to {target}"
            assert not anchor or (path or name) != "STUDENT-GUIDE.md" or anchor in anchors, f"{name}: {target}"
    # --ci 13: the workflow, and the wheel it names (checked, like every file, for solution code: inside it too).
    assert ".github/workflows/k2c-grade-13.yml" in tracked
    (wheel,) = [p for p in tracked if p.startswith(".k2c/")]
    assert wheel.endswith("+ci13-py3-none-any.whl") and wheel in (released / ".github/workflows/k2c-grade-13.yml").read_text()
    # The starters are exactly the repository's (and so what `k2c sync` writes).
    for path in (REPO / "labs").rglob("*.py"):
        assert (released / path.relative_to(REPO)).read_bytes() == path.read_bytes(), path

    bodies = solution_bodies()
    assert len(bodies) > 100  # every lab's functions, not an empty search
    # The search finds a body where it is: in its own file, and in a notebook cell.
    where, name = next(iter(bodies))
    own = released_texts(REPO / where.split(":")[0])
    assert all(any(b in t for t in own) for b in bodies[(where, name)])
    cell = {"cells": [{"cell_type": "code", "source": [(REPO / where.split(":")[0]).read_text()], "outputs": []}]}
    (released.parent / "probe.ipynb").write_text(json.dumps(cell))
    assert all(any(b in t for t in released_texts(released.parent / "probe.ipynb")) for b in bodies[(where, name)])

    leaked = []
    for rel in tracked:
        path = released / rel
        texts = released_texts(path)
        if path.suffix == ".ipynb":
            cells = json.loads(path.read_text())["cells"]
            assert not any(c.get("outputs") for c in cells), f"{rel} ships outputs"
        leaked += [f"{name} ({where}) in {rel}" for (where, name), variants in bodies.items()
                   if any(b in t for b in variants for t in texts)]
    assert leaked == []

    # No hidden check or hidden oracle ships, and nothing of theirs: neither a file nor any
    # function body of them is in a released file; the public checks of labs 11-13 define
    # none of their labs' algorithms at module level (the grader's schedules, simulator,
    # attention, merge, layout, cost model or search; the harness's helpers that call the
    # student's functions may share their names).
    from autograder.grading.labs import all_labs

    hidden = {f"autograder/checks/{lab.slug}/{name}" for lab in all_labs() for name in lab.hidden}
    assert hidden and not hidden & set(tracked)
    assert not [rel for rel in tracked if rel.startswith("autograder/checks/") and "_hidden" in rel]
    hidden_bodies = {}
    for rel in hidden:
        source = (REPO / rel).read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and len(node.body) > 1:
                body = "\n".join(ast.get_source_segment(source, stmt) for stmt in node.body[1:])  # past the docstring
                if len(squash(body)) >= TRIVIAL:
                    hidden_bodies[f"{rel}:{node.name}"] = squash(no_comments(body))
    assert len(hidden_bodies) > 10
    released_code = {rel: texts for rel in tracked if rel.endswith(".py")
                     for texts in [released_texts(released / rel)]}
    assert [f"{where} in {rel}" for where, body in hidden_bodies.items() for rel, texts in released_code.items()
            if any(body in t for t in texts)] == []
    answers = {"11": {"make_schedule", "simulate"}, "12": {"attention", "attention_grads", "merge", "zigzag"},
               "13": {"cost", "stage_of", "best_plan", "best_uniform_plan", "module07_peak", "zero_table"}}
    for lab in all_labs():
        for rel in (p for p in tracked if p.startswith(f"autograder/checks/{lab.slug}/") and p.endswith(".py")):
            defined = {n.name for n in ast.parse((released / rel).read_text()).body if isinstance(n, ast.FunctionDef)}
            assert not defined & answers.get(lab.number, set()), (rel, defined & answers[lab.number])


def _light_venv(release):
    """The release's .venv, made in a second instead of minutes: a venv with no packages of its
    own that sees what this checkout's venv installed through symlinks inside it (bubblewrap
    binds the venv, so the sandbox sees them too): the site-packages, and what wheels put beside
    them (mpich's mpiexec and libmpi). It leaves out this checkout's own k2c, which would import
    autograder/ from here instead of from the release, and the scripts that run this checkout's
    Python (a `pip` there would install into it)."""
    venv, main = release / ".venv", Path(sys.prefix)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = Path(sysconfig.get_paths()["purelib"])
    view = venv / "main-packages"
    view.mkdir()
    for entry in purelib.iterdir():
        if not (entry.name.startswith("k2c-") or "k2c" in entry.name and entry.name.startswith("__editable__")
                or entry.name == "__pycache__"):
            (view / entry.name).symlink_to(entry)
    site = venv / purelib.relative_to(main)
    (site / "_main_packages.pth").write_text(f"import site; site.addsitedir({str(view)!r})\n")
    for folder in ("bin", "lib", "include", "share", "etc"):
        for entry in sorted((main / folder).glob("*")):
            ours = venv / folder / entry.name
            runs_main_python = entry.is_file() and entry.read_bytes()[:2] == b"#!" and \
                str(main).encode() in entry.read_bytes()[:200]
            if not (ours.exists() or ours.is_symlink() or runs_main_python):
                ours.parent.mkdir(exist_ok=True)
                ours.symlink_to(entry)


USED_FROM_LABS = """
import json, sys, tempfile
from pathlib import Path
import autograder, course
from autograder.grading.labs import all_labs, with_used_files
labs = Path(sys.argv[1]) / "labs"
lab = next(lab for lab in all_labs() if lab.uses)
with tempfile.TemporaryDirectory() as tmp:
    staged = with_used_files(lab, labs / lab.slug, labs, Path(tmp) / "a")
    from_labs = all((staged / Path(u).name).read_bytes() == (labs / u).read_bytes() for u in lab.uses)
    alone = with_used_files(lab, labs / lab.slug, labs / lab.slug, Path(tmp) / "b")
    none_else = not any((alone / Path(u).name).exists() for u in lab.uses)
print(json.dumps({"autograder": autograder.__file__, "course": course.__file__,
                  "lab": lab.slug, "from_labs": from_labs, "none_else": none_else}))
"""


@pytest.mark.slow
def test_readme_commands_set_up_and_grade_the_starters_at_zero(released, tmp_path):
    readme = (released / "README.md").read_text()
    block = re.search(r"## Setting up.*?```bash\n(.*?)```", readme, re.S)[1]
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["make setup", "make grade"]

    _light_venv(released)
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    setup = subprocess.run(commands[0].split(), cwd=released, env=env, capture_output=True, text=True, timeout=300)
    assert setup.returncode == 0, setup.stdout + setup.stderr
    assert "ready:" in setup.stdout
    # Nothing for a student to puzzle over: no build-backend or deprecation warning from the install.
    assert "Warning:" not in setup.stdout + setup.stderr, setup.stderr

    # The release's own grader is the one installed: run from elsewhere, it imports the
    # release's autograder and course, and stages a lab's `uses` files from the
    # student's labs/ and from nowhere else.
    probe = subprocess.run([str(released / ".venv/bin/python"), "-c", USED_FROM_LABS, str(released)],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    assert found["autograder"] == str(released / "autograder" / "__init__.py")
    assert found["course"] == str(released / "course" / "__init__.py")
    assert found["from_labs"] and found["none_else"], found

    # `make grade` grades every lab (minutes); one cheap lab shows the starters at zero.
    grade = subprocess.run([*commands[1].split(), "LAB=05"], cwd=released, env=env, capture_output=True, text=True,
                           timeout=300)
    assert grade.returncode == 0, grade.stdout + grade.stderr
    assert "k2c grade 05 --submission labs" in grade.stdout
    score = re.search(r"Score: (\S+)/(\S+)", grade.stdout)
    assert score and float(score[1]) == 0 and float(score[2]) > 0, grade.stdout
    statuses = re.findall(r"^\s+[\d.]+/[\d.]+\s+(\w+)\s", grade.stdout, re.M)
    assert "failed" in statuses and set(statuses) <= {"failed", "skipped"}, grade.stdout
    assert grade.stdout.count("not implemented yet") >= statuses.count("failed")
    from autograder.sandbox.isolation import detect
    assert f"isolation: {detect().layer.value}" in grade.stdout  # the same layer as in this checkout

    # The released grader lists only the public checks: those of this checkout not marked hidden.
    listed = subprocess.run([str(released / ".venv/bin/k2c"), "grade", "all", "--list", "--format", "json"],
                            cwd=released, env=env, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    from autograder.grading.labs import all_labs
    from autograder.grading.runner import list_checks
    for lab in (lab for lab in all_labs() if lab.hidden):
        ours = list_checks(lab)
        assert any(c.hidden for c in ours) and not any(c["hidden"] for c in json.loads(listed.stdout)[lab.slug])
        assert [c["name"] for c in json.loads(listed.stdout)[lab.slug]] == [c.name for c in ours if not c.hidden]

    # Setting up and grading leave the student's tree clean (.gitignore covers .venv, egg-info).
    assert git(released, "status", "--porcelain") == ""


@pytest.mark.slow
def test_lecture_13_runs_top_to_bottom_in_the_release_with_the_starters(released):
    """Students read lecture 13 before they do lab 13: in the release, with the starters, the lecture
    runs without an error, each cell that needs the lab (``%%needs_lab 13``) saying which function is
    not implemented yet instead of running, and the others running. The kernel imports the
    release's own course package and lab folder (a last cell, added here, says which)."""
    import nbformat
    from nbclient import NotebookClient

    folder = released / "course" / "lectures"
    lecture = nbformat.read(folder / "13-hybrid-parallel.ipynb", as_version=4)
    lecture.cells.append(nbformat.v4.new_code_cell("import course\nprint(course.__file__, ex.LAB_CODE)"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = str(released)  # before this checkout's editable install
    NotebookClient(lecture, timeout=120, resources={"metadata": {"path": str(folder)}}).execute(env=env)

    code = [c for c in lecture.cells if c.cell_type == "code"]
    printed = ["".join(o.get("text", "") for o in c.outputs if o.output_type == "stream") for c in code]
    needs_lab = [c.source.startswith("%%needs_lab 13\n") for c in code]
    assert sum(needs_lab) >= 20 and not needs_lab[0]  # the Setup cell runs in the release too
    skipped = [p for p, needs in zip(printed, needs_lab) if needs]
    assert all(p.count("\n") == 1 and "lab 13's planner.check_plan is not implemented yet" in p
               and "`k2c grade 13`" in p and "docs site" in p for p in skipped), skipped[0]
    assert all("not implemented yet" not in p for p, needs in zip(printed, needs_lab) if not needs)
    # the rooflines need only the toolkit (course.roofline) and the cluster's numbers: they run before the lab
    assert any("compute-bound above" in p for p, needs in zip(printed, needs_lab) if not needs), printed
    assert printed[-1].split() == [str(folder.parent / "__init__.py"), str(released / "labs" / "13-hybrid-parallel")]
