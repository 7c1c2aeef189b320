"""Correct code written another way than the reference scores full marks.

Alternatives live in ``tests/fixtures/alternative_*.py`` (one ``ALTERNATIVES``
list per file); each is graded on the checks it touches only.
"""
import pytest

from conftest import fixtures, grade_json

ALTERNATIVES, IDS = fixtures("alternative_*", "ALTERNATIVES")


@pytest.mark.slow
@pytest.mark.parametrize("alt", ALTERNATIVES, ids=IDS)
def test_alternative_scores_full_marks(alt, make_submission):
    folder = make_submission(alt.lab, alt.file, alt.edits)
    report, _ = grade_json(folder, alt.lab, *alt.grade_args)
    lost = {t["name"]: t["feedback"] for t in report["tests"] if t["status"] not in ("passed", "skipped")}
    assert report["tests"] and not lost, lost
    assert report["score"] == report["max_score"]


def test_every_lab_has_two_alternatives():
    from autograder.labs import all_labs

    per_lab = {lab.slug: sum(alt.lab == lab.slug for alt in ALTERNATIVES) for lab in all_labs()}
    assert all(count >= 2 for count in per_lab.values()), per_lab
