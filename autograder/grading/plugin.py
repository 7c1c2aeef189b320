"""The pytest plugin that turns per-lab checks into a score.

It runs in the grader's own process. Points come from ``@pytest.mark.points(n)``
and statuses from how each check ended; nothing the student's code prints or
writes is read here, only the values that checks compared.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

from autograder.grading.submission import Submission, SubmissionError


@dataclass
class CheckResult:
    name: str
    title: str
    points: float
    max_points: float
    status: str  # passed, failed, error, timeout, skipped
    feedback: str
    duration_s: float
    metrics: dict = field(default_factory=dict)  # numbers a check measured (bandwidths, ratios)


def register_marks(config) -> None:
    """The marks checks carry: ``points(n)`` and ``gpu``."""
    config.addinivalue_line("markers", "points(n): what the check is worth")
    config.addinivalue_line("markers", "gpu: needs the GPU tier (a CUDA device)")


def check_title(item) -> str:
    """A check's title: the first line of its docstring, and its parameters' id."""
    doc = (getattr(item, "function", None) and item.function.__doc__) or ""
    title = doc.strip().splitlines()[0] if doc.strip() else item.name
    if getattr(item, "callspec", None):
        title += f" [{item.callspec.id}]"
    return title


def _status_and_feedback(excinfo) -> tuple[str, str]:
    exc = excinfo.value
    if isinstance(exc, SubmissionError):
        return exc.status, str(exc)
    if isinstance(exc, AssertionError):
        text = str(exc).split("\nassert ")[0].strip() or "the result is wrong"
        return "failed", text
    return "error", f"{type(exc).__name__}: {str(exc)[:500]}"


DRY_RUN_PASSED = "GPU tier; dry run passed on a stand-in device (awards nothing)"
DRY_RUN_FAILED = "GPU tier; dry run FAILED on a stand-in device (awards nothing): "
DRY_RUN_SKIPPED = "GPU tier; dry run skipped (awards nothing): "


class GradingPlugin:
    """``dry_run_gpu`` (CPU tier only): the ``gpu`` checks that take the ``gpu_dry_run``
    fixture run instead of being skipped, at tiny sizes on the stand-ins of
    ``course.gpu_stand_in`` (the fixture is True), and are reported as skipped, saying
    whether the dry run passed: never passed, never a point. Other ``gpu`` checks (those
    that do not take the fixture) stay skipped, saying they have no dry run."""

    def __init__(self, submission: Submission, tier: str, missing: str | None = None, on_result=None,
                 seed: int = 0, dry_run_gpu: bool = False):
        self._submission = submission
        self._tier = tier
        self.grading_seed = seed
        self._missing = missing
        self._on_result = on_result
        self._dry_run_gpu = dry_run_gpu and tier != "gpu"
        self.results: list[CheckResult] = []
        self._started: dict[str, float] = {}
        self._metrics: dict[str, dict] = {}

    # Fixtures the checks ask for.
    @pytest.fixture
    def submission(self) -> Submission:
        if self._missing:
            pytest.fail(self._missing, pytrace=False)
        return self._submission

    @pytest.fixture
    def tier(self) -> str:
        return self._tier

    @pytest.fixture
    def seed(self) -> int:
        """This grading's secret seed (``autograder.grading.seeds``): the graded cases' inputs
        come from it, in the grader."""
        return self.grading_seed

    @pytest.fixture
    def gpu_dry_run(self) -> bool:
        """Whether a ``gpu`` check runs as a dry run on the CPU tier: tiny sizes, stand-ins."""
        return self._dry_run_gpu

    @pytest.fixture
    def metrics(self, request) -> dict:
        """A dict a check fills with what it measured; it goes into the report."""
        found = {}
        self._metrics[request.node.nodeid] = found
        return found

    def pytest_configure(self, config):
        register_marks(config)

    def pytest_collection_modifyitems(self, items):
        for item in items:
            if item.get_closest_marker("gpu") and self._tier != "gpu" and not self._dry_runs(item):
                why = "; it has no dry run" if self._dry_run_gpu else ""
                item.add_marker(pytest.mark.skip(
                    reason=f"needs a CUDA GPU (GPU tier); this run is {self._tier.upper()} tier{why}"))

    def _dry_runs(self, item) -> bool:
        """Whether ``item``, a ``gpu`` check, runs as a dry run: in a dry run, if it takes the
        ``gpu_dry_run`` fixture (it knows its tiny sizes); the others stay skipped."""
        return self._dry_run_gpu and "gpu_dry_run" in getattr(item, "fixturenames", ())

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        marker = item.get_closest_marker("points")
        max_points = float(marker.args[0]) if marker else 1.0
        if report.when == "setup":
            self._started[item.nodeid] = time.monotonic()
        if self._dry_runs(item) and item.get_closest_marker("gpu"):
            if report.skipped or (report.failed and report.when in ("setup", "call")):
                if report.skipped:
                    why = call.excinfo.value.msg if call.excinfo and hasattr(call.excinfo.value, "msg") else "skipped"
                    feedback = DRY_RUN_SKIPPED + str(why)
                else:
                    feedback = DRY_RUN_FAILED + _status_and_feedback(call.excinfo)[1]
                self._record(item, max_points, "skipped", feedback, self._elapsed(item))
            elif report.passed and report.when == "call":
                self._record(item, max_points, "skipped", DRY_RUN_PASSED, self._elapsed(item))
            return
        if report.skipped:
            reason = call.excinfo.value.msg if call.excinfo and hasattr(call.excinfo.value, "msg") else "skipped"
            self._record(item, max_points, "skipped", str(reason), 0.0)
        elif report.failed and report.when in ("setup", "call"):
            status, feedback = _status_and_feedback(call.excinfo)
            if report.when == "setup" and not isinstance(call.excinfo.value, SubmissionError):
                status = "error"
                feedback = getattr(call.excinfo.value, "msg", None) or feedback
            self._record(item, max_points, status, feedback, self._elapsed(item))
        elif report.passed and report.when == "call":
            self._record(item, max_points, "passed", "", self._elapsed(item), points=max_points)

    def _elapsed(self, item) -> float:
        return time.monotonic() - self._started.get(item.nodeid, time.monotonic())

    def _record(self, item, max_points, status, feedback, duration, points=0.0):
        result = CheckResult(item.name.removeprefix("check_"), check_title(item), points,
                             max_points, status, feedback, duration, self._metrics.get(item.nodeid, {}))
        self.results.append(result)
        if self._on_result:
            self._on_result(result)
