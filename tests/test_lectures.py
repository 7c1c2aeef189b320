"""The shape of a lecture: enough prose to teach, and worked problems with checked answers.

Prose is what the markdown cells say, without code blocks, inline code, maths
or HTML. A worked problem is a markdown cell whose first line starts with
``**Problem``; the cells right after it tagged ``answer`` hold its answer, and
at least one of them is a code cell that asserts it, so nbval checks the
answer every time the lecture runs. ``python tests/test_lectures.py`` prints
the table.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

LECTURES = Path(__file__).resolve().parents[1] / "course" / "lectures"
PART_II_III = [f"{n:02d}" for n in range(5, 14)]
MIN_WORDS, MIN_PROBLEMS = 3000, 3
WORD = re.compile(r"[A-Za-z][A-Za-z'’-]*")
NOT_PROSE = re.compile(r"```.*?```|\$\$.*?\$\$|\$[^$\n]+\$|`[^`\n]+`|<[^>\n]+>", re.S)


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _source(cell: dict) -> str:
    return "".join(cell.get("source", ""))


def prose_words(path: Path) -> int:
    return sum(len(WORD.findall(NOT_PROSE.sub(" ", _source(c)))) for c in _cells(path) if c["cell_type"] == "markdown")


def problems(path: Path) -> list[tuple[str, bool]]:
    """``(first line, answered)`` for each worked problem: answered when tagged cells follow it and one asserts."""
    return [(p["title"], p["answered"]) for p in worked_problems(path)]


def worked_problems(path: Path) -> list[dict]:
    """Each worked problem as ``{"title", "answered", "independent", "diagnosis", "collapsed"}``:
    checked independently when one of its answer's code cells is tagged ``independent`` (it
    checks against something other than the answer's own arithmetic); a diagnosis when the
    problem's cell is tagged ``diagnosis``; collapsed when every markdown answer is a
    ``<details>`` block and every code answer is tagged ``hide-cell`` and hidden in Jupyter."""
    cells, found = _cells(path), []
    for i, cell in enumerate(cells):
        text = _source(cell).lstrip()
        if cell["cell_type"] != "markdown" or not text.startswith("**Problem"):
            continue
        answer = []
        for after in cells[i + 1:]:
            if "answer" not in after.get("metadata", {}).get("tags", []):
                break
            answer.append(after)
        code = [c for c in answer if c["cell_type"] == "code"]
        prose = [_source(c).strip() for c in answer if c["cell_type"] == "markdown"]
        hidden = [c for c in code if "hide-cell" in c["metadata"].get("tags", [])
                  and c["metadata"].get("jupyter", {}).get("source_hidden")]
        found.append({
            "title": text.splitlines()[0],
            "answered": any(re.search(r"^\s*assert\b", _source(c), re.M) for c in code),
            "independent": any("independent" in c["metadata"].get("tags", []) for c in code),
            "diagnosis": "diagnosis" in cell.get("metadata", {}).get("tags", []),
            "collapsed": bool(answer) and len(hidden) == len(code) and all(
                p.startswith("<details><summary>Answer</summary>") and p.endswith("</details>") for p in prose),
        })
    return found


def lecture(number: str) -> Path:
    (path,) = LECTURES.glob(f"{number}-*.ipynb")
    return path


@pytest.mark.parametrize("number", PART_II_III)
def test_a_part_ii_iii_lecture_teaches_in_prose_and_works_problems(number):
    path = lecture(number)
    words, found = prose_words(path), problems(path)
    assert words >= MIN_WORDS, f"{path.name}: {words} words of prose, at least {MIN_WORDS} wanted"
    unanswered = [first for first, answered in found if not answered]
    assert not unanswered, f"{path.name}: problems without an asserted answer (cells tagged 'answer'): {unanswered}"
    assert len(found) >= MIN_PROBLEMS, f"{path.name}: {len(found)} worked problems, at least {MIN_PROBLEMS} wanted"


# Every lecture's worked problems follow the convention (issue 45).
CONVENTION = [f"{n:02d}" for n in range(1, 14)]


@pytest.mark.parametrize("number", CONVENTION)
def test_worked_problems_are_checked_independently_include_a_diagnosis_and_start_collapsed(number):
    path = lecture(number)
    found = worked_problems(path)
    assert len(found) >= MIN_PROBLEMS, f"{path.name}: {len(found)} worked problems, at least {MIN_PROBLEMS} wanted"
    assert all(p["answered"] for p in found), [p["title"] for p in found if not p["answered"]]
    independent = sum(p["independent"] for p in found)
    assert 2 * independent >= len(found), (
        f"{path.name}: {independent} of {len(found)} problems checked against something independent of the answer "
        "(a code cell of the answer tagged 'independent'); at least half wanted")
    assert any(p["diagnosis"] for p in found), f"{path.name}: no problem tagged 'diagnosis' (explain a measurement)"
    assert all(p["collapsed"] for p in found), [p["title"] for p in found if not p["collapsed"]]


def test_the_measures_see_prose_problems_and_answers(tmp_path):
    def cell(kind, source, tags=()):
        return {"cell_type": kind, "source": source, "metadata": {"tags": list(tags)},
                **({"outputs": [], "execution_count": None} if kind == "code" else {})}

    path = tmp_path / "99-x.ipynb"
    path.write_text(json.dumps({"cells": [
        cell("markdown", "Three words here `not_these` $x + y$\n```\nnor this\n```"),
        cell("markdown", "**Problem 1.** How many?"), cell("code", "n = 2\nassert n == 2", ["answer"]),
        cell("markdown", "**Problem 2.** Why?"), cell("markdown", "Because.", ["answer"]),
        cell("markdown", "**Problem 3.** Untagged."), cell("code", "assert True"),
    ]}))
    folded = {"tags": ["answer", "hide-cell", "independent"], "jupyter": {"source_hidden": True}}
    path.with_name("98-y.ipynb").write_text(json.dumps({"cells": [
        {**cell("markdown", "**Problem 1.** Why?"), "metadata": {"tags": ["diagnosis"]}},
        cell("markdown", "<details><summary>Answer</summary>\n\nBecause.\n\n</details>", ["answer"]),
        {**cell("code", "assert 1"), "metadata": folded},
        cell("markdown", "**Problem 2.** Shown?"), cell("code", "assert 2", ["answer", "independent"]),
    ]}))
    first, second = worked_problems(path.with_name("98-y.ipynb"))
    assert first == {"title": "**Problem 1.** Why?", "answered": True, "independent": True, "diagnosis": True,
                     "collapsed": True}
    assert second["independent"] and not second["diagnosis"] and not second["collapsed"]
    assert prose_words(path) == 3 + 3 + 2 + 1 + 2
    assert problems(path) == [("**Problem 1.** How many?", True), ("**Problem 2.** Why?", False),
                              ("**Problem 3.** Untagged.", False)]


if __name__ == "__main__":
    for path in sorted(LECTURES.glob("[0-9][0-9]-*.ipynb")):
        found = problems(path)
        print(f"{path.name:32} {prose_words(path):6d} words  {sum(a for _, a in found)}/{len(found)} problems answered")


def test_needs_lab_runs_a_cell_as_ipython_does_once_the_lab_is_done_and_else_skips_it_saying_why(
        monkeypatch, capsys, tmp_path):
    """Lecture 13's ``%%needs_lab 13`` (hybrid_examples): with the lab done, a cell runs as without the
    magic (an error fails it, so nbval still checks its asserts; its last expression is its result
    unless a ';' ends it); with a starter left it prints one line naming it and runs nothing, but in
    the course repository (the reference solutions) a starter left is an error."""
    from IPython.core.interactiveshell import InteractiveShell

    import builtins

    from traitlets.config import Config

    monkeypatch.syspath_prepend(str(LECTURES))
    shell = InteractiveShell.instance(config=Config({"HistoryManager": {"enabled": False}}))
    added = {"__IPYTHON__", "display"} - set(vars(builtins))
    try:
        _needs_lab_in(shell, monkeypatch, capsys, tmp_path)
    finally:  # the next test in this process sees no IPython
        InteractiveShell.clear_instance()
        for name in added:
            vars(builtins).pop(name, None)


def _needs_lab_in(shell, monkeypatch, capsys, tmp_path):
    import importlib.util

    from IPython.core.error import UsageError

    shell.run_line_magic("load_ext", "hybrid_examples")
    import hybrid_examples as ex

    monkeypatch.setitem(ex._stubs, "13", None)  # done (the probe itself runs in the lecture, under nbval)
    assert shell.run_cell("%%needs_lab 13\nx = 20\nx + 1").result == 21 and shell.user_ns["x"] == 20
    assert shell.run_cell("%%needs_lab 13\nx + 1;").result is None
    failed = shell.run_cell("%%needs_lab 13\nassert x == 0, 'checked'")
    assert isinstance(failed.error_in_exec, AssertionError) and str(failed.error_in_exec) == "checked"
    assert isinstance(shell.run_cell("%%needs_lab 7\nx = 0").error_in_exec, UsageError)
    capsys.readouterr()

    # A starter's NotImplementedError names its function and lab; torch's own is no starter's.
    spec = importlib.util.spec_from_file_location("cluster", LECTURES.parents[1] / "labs/13-hybrid-parallel/cluster.py")
    starter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(starter)
    with pytest.raises(NotImplementedError) as raised:
        starter.rank_from_env({})
    assert ex._stub_in(raised.value) == ("13", "cluster.rank_from_env")
    assert ex._stub_in(NotImplementedError("Could not run 'aten::add' with arguments from the 'Meta' backend")) is None

    monkeypatch.setitem(ex._stubs, "13", ("10", "tensor_parallel.VocabParallelEmbedding.__init__"))
    monkeypatch.setattr(ex, "LAB_CODE", tmp_path / "labs" / "13-hybrid-parallel")  # a student's repository
    skipped = shell.run_cell("%%needs_lab 13\nx = 99")
    out = capsys.readouterr().out
    assert skipped.success and shell.user_ns["x"] == 20
    assert out.count("\n") == 1 and "lab 10's tensor_parallel.VocabParallelEmbedding.__init__ is not implemented yet" \
        in out and "`k2c grade 10`" in out
    monkeypatch.setattr(ex, "LAB_CODE", tmp_path / "solutions" / "13-hybrid-parallel")  # the course repository
    assert isinstance(shell.run_cell("%%needs_lab 13\nx = 99").error_in_exec, RuntimeError)
