"""Each realistic bug, and each shortcut written by reading the checks, loses exactly the
points of the checks it names, and no others.

Bugs live in ``tests/fixtures/buggy*.py`` (one ``BUGS`` list per file); every
file found there is collected, so a new lab adds its own file. A lab's bugs are
graded in one grader process (conftest's ``graded_fixture``).
"""
import pytest

from conftest import fixture_params, fixtures, statuses

BUGS, IDS = fixtures("buggy*", "BUGS")
# Shortcuts written by reading the checks (tests/fixtures/shortcut_NN.py) are graded the same way.
SHORTCUTS, SHORTCUT_IDS = fixtures("shortcut*", "SHORTCUTS")
BUGS, IDS = BUGS + SHORTCUTS, IDS + [f"shortcut {name}" for name in SHORTCUT_IDS]


@pytest.mark.slow
@pytest.mark.parametrize("bug", fixture_params(BUGS, IDS))
def test_bug_is_caught(bug, graded_fixture):
    report = graded_fixture(bug)
    got = statuses(report)
    failing = {name for name, status in got.items() if status not in ("passed", "skipped")}
    assert bug.must_fail <= failing, f"not caught: {sorted(bug.must_fail - failing)}; statuses {got}"
    collateral = {t["name"]: t["feedback"] for t in report["tests"] if t["name"] in failing - bug.must_fail}
    assert not collateral, f"collateral failures: {collateral}"
    lost = {t["name"]: t for t in report["tests"] if t["name"] in bug.must_fail}
    # Exactly the points of the checks it names, no partial credit kept or lost elsewhere.
    assert report["max_score"] - report["score"] == sum(t["max_points"] for t in lost.values())
    for test in lost.values():
        assert test["points"] == 0 and test["feedback"], test
        assert "Traceback" not in test["feedback"]
        assert bug.says in test["feedback"], test
