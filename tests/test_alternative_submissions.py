"""Correct code written another way than the reference scores full marks.

Alternatives live in ``tests/fixtures/alternative_*.py`` (one ``ALTERNATIVES``
list per file); each is graded on the checks it touches only.
"""
import importlib
from pathlib import Path

import pytest

from conftest import grade_json

ALTERNATIVES = [alt for path in sorted((Path(__file__).parent / "fixtures").glob("alternative_*.py"))
                for alt in importlib.import_module(f"fixtures.{path.stem}").ALTERNATIVES]


@pytest.mark.slow
@pytest.mark.parametrize("alt", ALTERNATIVES, ids=[f"{a.lab[:2]}: {a.name}" for a in ALTERNATIVES])
def test_alternative_scores_full_marks(alt, make_submission):
    folder = make_submission(alt.lab, alt.file, alt.edits)
    report, _ = grade_json(folder, alt.lab, *alt.grade_args)
    lost = {t["name"]: t["feedback"] for t in report["tests"] if t["status"] not in ("passed", "skipped")}
    assert report["tests"] and not lost, lost
    assert report["score"] == report["max_score"]
