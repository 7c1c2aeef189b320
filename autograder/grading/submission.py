"""The ``submission`` fixture: how a check calls into student code.

``submission.call("cuda_basics.relu", x)`` imports the student's module and calls
the function in a sandboxed child; ``submission.harness("launch_relu", ...)``
runs a function of the lab's ``harness.py`` (grader code that must run next to
the student's code, e.g. to launch their kernel on poisoned buffers) there.
Either returns plain data, or raises one of the errors below, which the
grading plugin turns into a status and a message a student can act on.

A grading spends a bounded time in the student's code. Each call has the lab's
call limit; a function that ran out of time once is not called again in the same
grading (its later calls fail at once, saying why), so a submission whose functions
never return costs about one call limit per function, not one per check; and
past the grading's budget (``budget_s``) no call runs at all: the checks left
are reported as not run, with the reason.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from autograder.sandbox import Limits, Outcome, Sandbox


class SubmissionError(Exception):
    """The student's code did not return a value; ``str()`` says why."""
    status = "error"

    def __init__(self, message: str, outcome: Outcome):
        super().__init__(message)
        self.outcome = outcome


class NotImplementedYet(SubmissionError):
    status = "failed"


class SubmissionTimeout(SubmissionError):
    status = "timeout"


# A grading's default budget for the time its calls run, in call limits, and at least
# BUDGET_FLOOR_S (runner.grade_budget_s): `--timeout 5` must not leave a grading 25 s. A whole
# lab's reference spends under half of one limit in all (the most, lab 05: 18 s of calls against
# its 40 s limit, on a busy 2-core machine; lab 04: 11 s of 90 s).
BUDGET_CALL_LIMITS = 5
BUDGET_FLOOR_S = 300.0


def not_implemented_yet(message: str) -> NotImplementedYet:
    """The error a stub's ``NotImplementedError`` becomes in a check: its message,
    starting "not implemented yet"."""
    text = message if message.startswith("not implemented yet") else f"not implemented yet: {message}"
    return NotImplementedYet(text, Outcome("not_implemented", message=text))


def failure_from(outcome: dict, where: str) -> SubmissionError:
    """The error to raise for a harness's outcome ``{"status", "message"}`` that
    is not ok (``where`` names the case, e.g. "ring_allreduce on 4 ranks"): a
    stub's ``NotImplementedYet``, a hang's ``SubmissionTimeout``, else a
    ``SubmissionError``."""
    status, message = outcome["status"], outcome.get("message", "")
    if status == "not_implemented":
        return not_implemented_yet(message)
    if status == "timeout":
        return SubmissionTimeout(f"{where}: {message}", Outcome("timeout", message=message))
    return SubmissionError(f"{where}: {message}", Outcome(status, message=message))


def _shorten(text: str, lines: int = 6, chars: int = 600) -> str:
    kept = text.strip().splitlines()[:lines]
    text = "\n".join(kept)
    return text if len(text) <= chars else text[:chars] + "…"


def explain(outcome: Outcome) -> str:
    """One short paragraph on why a call failed."""
    if outcome.status == "not_implemented":
        msg = outcome.message.strip() or "not implemented yet"
        return msg if msg.startswith("not implemented yet") else f"not implemented yet: {msg}"
    if outcome.status == "raised":
        text = f"{outcome.error_type}: {_shorten(outcome.message)}"
        if outcome.where:
            text += "\n  at " + "\n  at ".join(outcome.where)
        return text
    text = outcome.message
    printed = outcome.output.strip()
    if printed and outcome.status in ("crashed", "no_result", "exit", "memory"):
        text += f"\n  last output: {_shorten(printed[-300:], lines=3)}"
    return text


def function_of(target: dict, args, kwargs, simulator: bool) -> tuple | None:
    """Which code of the student's a call runs, as far as the grader can tell, for remembering
    what hung: the target (a module's function, or a harness function), and the names a
    grader function is given of the student's code it runs (``harness("races",
    "parallel_sum", ...)``, ``compile_kernels("cuda_basics", "relu_kernel")``): its string
    arguments, and tuples or lists of strings. In the simulator or not: a kernel too slow
    for the simulator may finish on a GPU. None for a rank job: its launcher stops a job
    that hangs at the job's own timeout and says which cases it left
    (``autograder.grading.rank_jobs.run_cases``), and its cases are in its inputs."""
    if target["kind"] == "ranks":
        return None
    def named(value):
        if isinstance(value, str):
            return value
        if isinstance(value, (tuple, list)) and value and all(isinstance(v, str) for v in value):
            return tuple(value)
        return None
    names = tuple(n for n in (*map(named, args), *(named(v) for _, v in sorted(kwargs.items()))) if n is not None)
    where = target.get("module") if target["kind"] != "harness" else "harness"
    return (simulator, target["kind"], where, target.get("func", ""), names)


def shown(function: tuple) -> str:
    """``function_of``'s key as a student reads it: ``cupy_streams.softmax_rows``, or
    ``the lab's harness recorded_pipeline('affine'), which runs your code,``."""
    _, kind, where, func, names = function
    called = func + ("(" + ", ".join(map(repr, names)) + ")" if names else "")
    if kind == "harness":
        return f"the lab's harness {called}, which runs your code,"
    return f"the import of {where}" if kind == "import" else f"{where}.{called}"


class Submission:
    def __init__(self, path: Path, harness_path: Path, tier: str, limits: Limits, env: dict[str, str],
                 sandbox_for=None, budget_s: float | None = None):
        self.path = Path(path)
        self.harness_path = Path(harness_path)
        self.tier = tier
        self.limits = limits
        self.env = env
        self._simulated: Submission | None = None
        self._compiling: Submission | None = None
        self._once: dict = {}
        self._sandbox: Sandbox | None = None  # every call of this grading run, one warm process (sandbox.Sandbox)
        # None: that sandbox is this run's own, ended with it. Else a function (path, limits, env) -> a
        # Sandbox its caller keeps and ends (tests/grade_batch.py: one server for many trusted fixtures).
        self.sandbox_for = sandbox_for
        # Wall seconds spent in calls into the student's code, shared with the
        # simulator and compiling variants: the rest of a grading is the grader's.
        self.calls_s = [0.0]
        # What the calls did that an honest solution has no reason to do (autograder.sandbox.audit),
        # shared with the variants like calls_s: (kind, detail) records, for the instructor.
        self.flags: list = []
        # Set when the machine, not the submission, failed a call (a rank that could not be kept
        # apart): the grading then ends with exit 2 and this reason, never a score (runner).
        self.cannot_grade = ""
        # The code that ran out of time once (function_of -> why), not called again in this grading;
        # shared with the variants (the key says whether it ran in the simulator).
        self.hung: dict[tuple, str] = {}
        # The most wall seconds this grading's calls may run, all together (None: no limit): once
        # spent, no call starts, and each is reported as not run, saying why. What counts is how
        # long each call ran (``Outcome.duration_s``), not the start of a sandbox, which is the
        # grader's (seconds to import torch, more on a busy machine, after every timeout).
        self.budget_s = budget_s
        self.ran_s = [0.0]  # shared with the variants, like calls_s

    def in_simulator(self) -> "Submission":
        """The same submission run in numba's CUDA simulator, whatever the tier: for
        checks that inspect what a kernel does to memory (``course.cuda_audit``),
        which only the simulator can show, rather than how fast it runs."""
        if self.tier == "cpu" and self.env.get("NUMBA_ENABLE_CUDASIM") == "1":
            return self  # the CPU tier runs in the simulator already
        if self._simulated is None:
            self._simulated = self._variant("cpu", dict(self.env, NUMBA_ENABLE_CUDASIM="1"))
        return self._simulated

    def compiling(self) -> "Submission":
        """The same submission with the simulator off, whatever the tier: for calls
        that compile its kernels for a real GPU (``autograder.grading.checking.compile_kernels``),
        which needs no GPU but must not run in the simulator."""
        if self._compiling is None:
            self._compiling = self._variant(self.tier, dict(self.env, NUMBA_ENABLE_CUDASIM="0"))
        return self._compiling

    def _variant(self, tier: str, env: dict[str, str]) -> "Submission":
        """The same submission in another environment, one grading with this one: the time
        spent, the budget, what hung and the flags are shared."""
        other = Submission(self.path, self.harness_path, tier, self.limits, env, self.sandbox_for, self.budget_s)
        other.calls_s, other.ran_s, other.flags, other.hung = self.calls_s, self.ran_s, self.flags, self.hung
        return other

    def close(self) -> None:
        """End the sandboxes of this grading run (its simulator and compiling variants too)."""
        for submission in (self, self._simulated, self._compiling):
            if submission is not None and submission._sandbox is not None:
                if submission.sandbox_for is None:
                    submission._sandbox.close()
                else:
                    submission._sandbox.forget(str(submission.path))
                submission._sandbox = None

    def once(self, key, compute):
        """``compute()``, run once per grading run for ``key``: several checks that
        read one expensive run (an MPI job, a simulated launch, a compile) share its
        value, or see the same error."""
        if key not in self._once:
            try:
                self._once[key] = (True, compute())
            except SubmissionError as exc:
                self._once[key] = (False, exc)
        ok, value = self._once[key]
        if not ok:
            raise value
        return value

    def harness_once(self, key, func: str, *args):
        """``harness(func, *args)``, once per grading run for ``key`` (see ``once``)."""
        return self.once(key, lambda: self.harness(func, *args))

    def import_failure(self, modules) -> str:
        """Why one of ``modules`` (the lab's files) does not import, in one line with
        the line number ("" when they all do): one sandboxed call each, before any check,
        so that a syntax error costs one call instead of a failed job per case."""
        for module in modules:
            try:
                self._run({"kind": "import", "module": module}, [], {})
            except SubmissionError as exc:
                outcome = exc.outcome
                if outcome.status == "raised":
                    why = f"{outcome.error_type}: {outcome.message.strip().splitlines()[0] if outcome.message.strip() else ''}"
                    if outcome.where:  # where in the student's file (a SyntaxError names its line itself)
                        why += f" (at {outcome.where[-1].split(' in ')[0]})"
                else:
                    why = str(exc).splitlines()[0]
                return f"{module}.py does not import, so no check could run it: {why}"
        return ""

    def call(self, dotted_name: str, *args, **kwargs):
        module, func = dotted_name.rsplit(".", 1)
        return self._run({"kind": "module", "module": module, "func": func}, args, kwargs)

    def harness(self, func: str, *args, **kwargs):
        return self._run({"kind": "harness", "path": str(self.harness_path), "func": func}, args, kwargs)

    def rank_job(self, kind: str, func: str, inputs: list, *, timeout: float, idle_timeout: float | None = None,
                 count_wire: bool = False, env: dict | None = None, exact_peaks: bool = True):
        """Run the harness's rank function ``func`` on ``len(inputs)`` ranks (``kind``: "torch"
        or "mpi"), rank r receiving ``inputs[r]`` alone (``autograder.sandbox.ranks``); the
        decoded ``autograder.grading.rank_jobs.RankJob``. Raises ``SubmissionError`` only when
        the launcher itself failed; a job that hung or raised comes back with its status.
        ``exact_peaks=False`` for a job that times its ranks rather than reads their peak
        memory: large temporaries then come from the allocator's reused memory, as they
        would outside the grader, not fresh from the kernel each time."""
        import shutil

        from autograder.grading.rank_jobs import decode
        from autograder.sandbox import codec

        if self._sandbox is None:
            self._sandbox = (self.sandbox_for or Sandbox)(str(self.path), self.limits, self.env)
        paths = self._sandbox.stage_rank_inputs([codec.encode(part) for part in inputs])
        job = {"kind": kind, "target": f"{self.harness_path}:{func}", "n": len(inputs), "inputs": paths,
               "timeout": timeout, "idle_timeout": idle_timeout, "count_wire": count_wire, "env": env or {},
               "exact_peaks": exact_peaks}
        try:
            value = self._run({"kind": "ranks", "job": job}, [], {})
        finally:
            shutil.rmtree(os.path.dirname(paths[0]), ignore_errors=True)
        decoded = decode(kind, value)
        self.flags.extend(decoded.flags)
        if decoded.status == "infrastructure":  # the grading stops: exit 2, no score (runner)
            self.cannot_grade = self.cannot_grade or decoded.explain()
            raise SubmissionError(f"this machine cannot grade this check: {decoded.explain()}",
                                  Outcome("crashed", message=decoded.explain()))
        return decoded

    def _run(self, target: dict, args, kwargs):
        simulator = self.env.get("NUMBA_ENABLE_CUDASIM") == "1"
        function = function_of(target, args, kwargs, simulator)
        self._refuse_if_out_of_time(function)
        request = {"submission": str(self.path), "target": target, "args": list(args), "kwargs": kwargs,
                   "simulator": simulator}
        started = time.monotonic()
        if self._sandbox is None:
            self._sandbox = (self.sandbox_for or Sandbox)(str(self.path), self.limits, self.env)
        try:
            outcome = self._sandbox.call(request)
        finally:
            self.calls_s[0] += time.monotonic() - started
        self.ran_s[0] += outcome.duration_s
        self.flags.extend(outcome.flags)
        if outcome.status == "ok":
            return outcome.value
        if outcome.status == "timeout" and function is not None:
            self.hung[function] = self._not_again(function, outcome)
        error = {"not_implemented": NotImplementedYet, "timeout": SubmissionTimeout}.get(
            outcome.status, SubmissionError)
        raise error(explain(outcome), outcome)

    def _refuse_if_out_of_time(self, function: tuple | None) -> None:
        """Raise ``SubmissionTimeout``, without a call, when ``function`` ran out of time earlier
        in this grading, or when the grading's budget is spent."""
        why = self.hung.get(function)
        if why is None and self.budget_s is not None and self.ran_s[0] >= self.budget_s:
            cause = (f"{len(self.hung)} function(s) ran out of time: fix those (the checks above say which)"
                     if self.hung else "your calls are slow: look for work done again and again")
            why = (f"not run: this grading has spent its budget of {self.budget_s:g} s in your code "
                   f"({self.ran_s[0]:.0f} s), so no further call runs; {cause}, and the checks left will run")
        if why is not None:
            raise SubmissionTimeout(why, Outcome("timeout", message=why))

    def _not_again(self, function: tuple, outcome: Outcome) -> str:
        """Why later calls of ``function`` do not run, once it has run out of time."""
        if outcome.limit == "time":  # the sandbox stopped it at the call limit
            return (f"not run: {shown(function)} did not finish within {self.limits.timeout_s:g} s in an "
                    "earlier call (an infinite loop? a deadlock?), so this grading does not call it again")
        first = (outcome.message.strip().splitlines() or ["it timed out"])[0]
        return f"not run: {shown(function)} ran out of time in an earlier call ({first}), so this grading does " \
               "not call it again"
