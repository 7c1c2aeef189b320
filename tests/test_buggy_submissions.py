"""Each realistic bug loses the points of the checks aimed at it, and only those.

Bugs live in ``tests/fixtures/buggy*.py`` (one ``BUGS`` list per file); every
file found there is collected, so a new lab adds its own file.
"""
import pytest

from conftest import fixtures, grade_json, statuses

BUGS, IDS = fixtures("buggy*", "BUGS")


@pytest.mark.slow
@pytest.mark.parametrize("bug", BUGS, ids=IDS)
def test_bug_is_caught(bug, make_submission):
    folder = make_submission(bug.lab, bug.file, bug.edits)
    report, _ = grade_json(folder, bug.lab, *bug.grade_args)
    got = statuses(report)
    failing = {name for name, status in got.items() if status not in ("passed", "skipped")}
    assert bug.must_fail <= failing, f"not caught: {sorted(bug.must_fail - failing)}; statuses {got}"
    collateral = {t["name"]: t["feedback"] for t in report["tests"] if t["name"] in failing - bug.must_fail - bug.may_fail}
    assert not collateral, f"collateral failures: {collateral}"
    assert report["score"] < report["max_score"]
    lost = {t["name"]: t for t in report["tests"] if t["name"] in bug.must_fail}
    for test in lost.values():
        assert test["points"] == 0 and test["feedback"], test
        assert "Traceback" not in test["feedback"]
        assert bug.says in test["feedback"], test
