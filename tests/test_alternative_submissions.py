"""Correct code written another way than the reference scores full marks.

Alternatives live in ``tests/fixtures/alternative_*.py`` (one ``ALTERNATIVES``
list per file); each is graded on the checks it touches only, a lab's
alternatives in one grader process (conftest's ``graded_fixture``).
"""
import pytest

from conftest import fixture_params, fixtures

ALTERNATIVES, IDS = fixtures("alternative_*", "ALTERNATIVES")


@pytest.mark.slow
@pytest.mark.parametrize("alt", fixture_params(ALTERNATIVES, IDS))
def test_alternative_scores_full_marks(alt, graded_fixture):
    report = graded_fixture(alt)
    lost = {t["name"]: t["feedback"] for t in report["tests"] if t["status"] not in ("passed", "skipped")}
    assert report["tests"] and not lost, lost
    assert report["score"] == report["max_score"]


def test_every_lab_has_two_alternatives():
    from autograder.grading.labs import all_labs

    per_lab = {lab.slug: sum(alt.lab == lab.slug for alt in ALTERNATIVES) for lab in all_labs()}
    assert all(count >= 2 for count in per_lab.values()), per_lab
