"""Each realistic bug loses the points of the checks aimed at it, and only those."""
import pytest

from conftest import grade_json, statuses
from fixtures.buggy import BUGS


@pytest.mark.slow
@pytest.mark.parametrize("bug", BUGS, ids=[f"{b.lab[:2]}: {b.name}" for b in BUGS])
def test_bug_is_caught(bug, make_submission):
    folder = make_submission(bug.lab, bug.file, bug.edits)
    report, _ = grade_json(folder, bug.lab)
    got = statuses(report)
    failing = {name for name, status in got.items() if status not in ("passed", "skipped")}
    assert bug.must_fail <= failing, f"not caught: {sorted(bug.must_fail - failing)}; statuses {got}"
    assert failing <= bug.must_fail | bug.may_fail, f"collateral failures: {sorted(failing - bug.must_fail - bug.may_fail)}"
    assert report["score"] < report["max_score"]
    lost = {t["name"]: t for t in report["tests"] if t["name"] in bug.must_fail}
    for test in lost.values():
        assert test["points"] == 0 and test["feedback"], test
        assert "Traceback" not in test["feedback"]
