"""Reports of graded labs: a text table for people; JSON, Gradescope and JUnit for machines
(and, in ``report_ci``, a Markdown summary, Classroom 50's result.json and GitHub Classroom's reporter).

A lab whose files were not found (status ``missing``, ``runner.LabStatus``) ran
no check: every format says so in words, with the folders looked in, and
scores it 0 of the lab's maximum.
"""
from __future__ import annotations

import json
import textwrap
import xml.etree.ElementTree as ET

from autograder.grading import report_ci
from autograder.grading.checking import PTXAS_METRICS, RESOURCES
from autograder.grading.flags import described
from autograder.grading.runner import LabResult, LabStatus

FORMATS = ("text", "json", "gradescope", "junit", "markdown", "classroom50", "classroom")


def _pts(x: float) -> str:
    return f"{x:g}"


def _metrics(metrics: dict) -> str:
    """``k v, ...`` of what a check measured, without the compile table (``compile_rows``),
    which the reports show on its own; ``k: a 1, b 2; ...`` for nested dicts. A GPU-tier
    device ``record`` is left to the JSON report (its ``device`` line says it in short)."""
    def flat(d):
        return ", ".join(f"{k} {v}" for k, v in d.items())
    shown = {k: v for k, v in metrics.items() if k not in (PTXAS_METRICS, "record")}
    if shown and all(isinstance(v, dict) for v in shown.values()):
        return "; ".join(f"{k}: {flat(v)}" for k, v in shown.items())
    return flat(shown)


def compile_rows(r: LabResult) -> dict:
    """``{kernel: {"sm_75": {"registers", "shared_bytes", "spill_bytes"}, ...}}``: what ptxas
    said of every kernel the lab's compile checks built (``checking.expect_compiled``)."""
    rows = {}
    for c in r.checks:
        for kernel, by_arch in c.metrics.get(PTXAS_METRICS, {}).items():
            rows.setdefault(kernel, {}).update(by_arch)
    return rows


def _resources(found: dict) -> str:
    return "/".join(str(found.get(k, "?")) for k in RESOURCES)


def compile_table(rows: dict, indent: str = "  ") -> list[str]:
    """The compile table as text, one line per kernel, the architectures as columns:
    each cell registers per thread / shared bytes per block / bytes spilled."""
    if not rows:
        return []
    archs = sorted({a for by_arch in rows.values() for a in by_arch}, key=lambda a: int(a.removeprefix("sm_")))
    width = max(len(k) for k in rows)
    cell = max([len(a) for a in archs] + [len(_resources(f)) for by_arch in rows.values() for f in by_arch.values()])
    lines = [f"{indent}Compiled for each GPU architecture (ptxas): registers per thread / shared memory per block "
             "(bytes) / spills (bytes)",
             indent + "  " + f"{'kernel':<{width}}  " + " ".join(f"{a:<{cell}}" for a in archs).rstrip()]
    for kernel, by_arch in rows.items():
        cells = " ".join(f"{_resources(by_arch[a]) if a in by_arch else '-':<{cell}}" for a in archs)
        lines.append(indent + "  " + f"{kernel:<{width}}  " + cells.rstrip())
    return lines


def _isolation(r: LabResult) -> str:
    if not r.isolation and r.status is LabStatus.MISSING:
        return "none needed, no check ran"
    return f"{r.isolation.get('layer', '?')}, as {r.isolation.get('user', '?')}"


def _graded_on(r: LabResult) -> str:
    """``graded on NODE · CARD · SLURM job N``: which machine graded, and with which GPU."""
    where = r.graded_on
    if not where:
        return ""
    return (f"graded on {where.get('node', '?')} · {where.get('gpu', '?')}"
            + (f" · SLURM job {where['slurm_job']}" if where.get("slurm_job") else ""))


def _missing(r: LabResult) -> bool:
    return r.status is LabStatus.MISSING


def _flag_lines(r: LabResult) -> list[str]:
    """The flags for the instructor (``autograder.grading.flags``), under the score."""
    if not r.flags:
        return []
    return ["  Flags for the instructor (not part of the score; the instructor guide says how to read them):",
            *("    " + line for line in _flag_lines_of([(r, f) for f in r.flags]))]


def _flag_lines_of(flagged) -> list[str]:
    lines, shown = [], 0
    for r, f in flagged:
        if shown == 40:
            lines.append(f"… and {len(flagged) - shown} more (the JSON report has them all)")
            break
        lines.append(f"{f.line}  [{described(f.kind)}]")
        shown += 1
    return lines


def text(results: list[LabResult]) -> str:
    lines = []
    for r in results:
        lines.append(f"Lab {r.lab} — {r.title}")
        dry = " · GPU checks as a dry run on stand-ins (they award nothing)" if r.gpu_dry_run else ""
        lines.append(f"  {r.tier.upper()} tier{dry} · submission {r.submission}")
        if r.graded_on:
            lines.append(f"  {_graded_on(r)}")
        if _missing(r):
            lines.append(f"  MISSING: no lab files found. None of {', '.join(r.files)} is in the submission;")
            lines.append("  no check ran. Looked in:")
            lines.extend(f"    {where}" for where in r.searched)
            lines.append(f"  Score: 0/{_pts(r.max_score)} (missing)   ({r.duration_s:.1f} s)")
            lines.append("")
            continue
        lines.append(f"  isolation: {_isolation(r)} · checks sha256 {r.checks_digest[:12]}")
        if r.isolation.get("readable"):
            lines.append(f"  student code could read: {r.isolation['readable']}")
        if r.isolation.get("warning"):
            lines.append(f"  WARNING: {r.isolation['warning']}")
        lines.append(f"  {'points':>7}  {'status':<8} check")
        for c in r.checks:
            pts = "-" if c.status == "skipped" else f"{_pts(c.points)}/{_pts(c.max_points)}"
            lines.append(f"  {pts:>7}  {c.status:<8} {c.title}")
            if _metrics(c.metrics) and not c.feedback:  # what a passing check measured (ratios; ptxas's: below)
                lines.extend(" " * 19 + w for w in textwrap.wrap("measured: " + _metrics(c.metrics), 96,
                                                                  subsequent_indent="    "))
            if c.feedback:
                for para in c.feedback.splitlines()[:8]:
                    wrapped = textwrap.wrap(para, 96, initial_indent="→ " if para == c.feedback.splitlines()[0] else "  ",
                                            subsequent_indent="    ") or [""]
                    lines.extend(" " * 19 + w for w in wrapped)
        lines.extend(compile_table(compile_rows(r)))
        lines.append(f"  Score: {_pts(r.score)}/{_pts(r.max_score)}   ({r.duration_s:.1f} s)")
        if r.seed is not None:
            lines.append(f"  graded inputs drawn from seed {r.seed} (K2C_GRADING_SEED={r.seed} draws them again)")
        lines.extend(_flag_lines(r))
        lines.append("")
    if len(results) > 1:
        lines.append("Scoreboard")
        for r in results:
            lines.append(f"  {r.lab:<28} {_pts(r.score):>6}/{_pts(r.max_score):<6} {r.tier.upper()} tier"
                         + ("  MISSING: no lab files found" if _missing(r) else ""))
        total, top = sum(r.score for r in results), sum(r.max_score for r in results)
        lines.append(f"  {'total':<28} {_pts(total):>6}/{_pts(top):<6}")
    return "\n".join(lines) + "\n"


def _lab_json(r: LabResult) -> dict:
    return {
        "lab": r.lab, "title": r.title, "tier": r.tier, **({"gpu_dry_run": True} if r.gpu_dry_run else {}),
        "submission": r.submission, "status": r.status.value,
        **({"message": r.message, "files": list(r.files), "searched": list(r.searched)} if _missing(r) else {}),
        "score": r.score, "max_score": r.max_score, "duration_s": round(r.duration_s, 3),
        "student_s": round(r.student_s, 3),
        "isolation": r.isolation, "graded_on": r.graded_on, "checks_sha256": r.checks_digest,
        **({"seed": str(r.seed)} if r.seed is not None else {}),
        "flags": [f.as_dict() for f in r.flags],
        # ptxas's registers, shared memory and spills per kernel and architecture (the compile checks')
        **({"compiled": compile_rows(r)} if compile_rows(r) else {}),
        "tests": [{"name": c.name, "title": c.title, "points": c.points, "max_points": c.max_points,
                   "status": c.status, "feedback": c.feedback, "duration_s": round(c.duration_s, 3),
                   **({"metrics": c.metrics} if c.metrics else {})}
                  for c in r.checks],
    }


def as_json(results: list[LabResult]) -> str:
    if len(results) == 1:
        return json.dumps(_lab_json(results[0]), indent=2) + "\n"
    return json.dumps({"score": sum(r.score for r in results), "max_score": sum(r.max_score for r in results),
                       "labs": [_lab_json(r) for r in results]}, indent=2) + "\n"


# Gradescope's results.json (its "autograder specifications"): a test's status
# is "passed" or "failed", and optional: without it Gradescope judges the test by
# its score against its max_score. A skipped check did not run, so it is neither:
# it has no status and no score (0 of 0 would read as passed), and its name and
# output begin "skipped:" with the reason.
GRADESCOPE_STATUS = {"passed": "passed", "failed": "failed", "error": "failed", "timeout": "failed"}
# What a performance check measured against a baseline timed in the same run,
# higher is better: labs 02, 03 and 12 record ``ratio``, lab 04 ``speedup``.
LEADERBOARD_METRICS = ("ratio", "speedup")


def _lab_number(r: LabResult, position: int) -> int:
    head = r.lab.split("-", 1)[0]
    return int(head) if head.isdigit() else position


def leaderboard(results: list[LabResult]) -> list[dict]:
    """Gradescope's leaderboard entries ``{name, value, order}``: each GPU-tier
    check's measured ratio. The CPU tier measures no speed, so it has none."""
    board = []
    for r in results:
        if r.tier != "gpu":
            continue
        for c in r.checks:
            key = next((k for k in LEADERBOARD_METRICS if isinstance(c.metrics.get(k), (int, float))
                        and not isinstance(c.metrics.get(k), bool)), None)
            if key:
                name = f"{c.name} {key}" if len(results) == 1 else f"{r.lab[:2]} {c.name} {key}"
                board.append({"name": name, "value": c.metrics[key], "order": "desc"})
    return board


def gradescope(results: list[LabResult]) -> str:
    """Gradescope's results.json: the total, the time, a line on how it was graded,
    one test per check, and on the GPU tier a leaderboard of measured ratios."""
    tests = []
    for position, r in enumerate(results, 1):
        for i, c in enumerate(r.checks, 1):
            output = f"[{c.status}] {c.feedback}".strip()
            if _metrics(c.metrics):
                output += "\nmeasured: " + _metrics(c.metrics)
            if c.metrics.get(PTXAS_METRICS):
                output += "\n" + "\n".join(compile_table(c.metrics[PTXAS_METRICS], indent=""))
            name = f"{r.lab}: {c.title}" if len(results) > 1 else c.title
            test = {"name": name, "number": f"{_lab_number(r, position)}.{i}", "output": output,
                    "tags": [r.lab, c.status], "visibility": "visible"}
            if c.status == "skipped":
                test.update(name=f"skipped: {name}", output=f"skipped: {c.feedback}".strip())
            else:
                test.update(score=c.points, max_score=c.max_points, status=GRADESCOPE_STATUS[c.status])
            tests.append(test)
    flagged = [(r, f) for r in results for f in r.flags]
    if flagged:  # for the instructor only: Gradescope never shows a hidden test to the student
        tests.append({"name": "Flags for the instructor (not part of the score)", "score": 0, "max_score": 0,
                      "output": "\n".join(_flag_lines_of(flagged)), "visibility": "hidden",
                      "tags": ["flags"]})
    tiers = sorted({r.tier for r in results})
    layers = sorted({_isolation(r) for r in results})
    output = f"Graded on the {'/'.join(t.upper() for t in tiers)} tier by k2c (isolation: {'; '.join(layers)})."
    missing = [r for r in results if _missing(r)]
    if missing:  # no test to show it in: the top of the results page says it
        output = "\n\n".join(
            [f"Lab {r.lab}: no lab files found, so nothing was graded (0/{_pts(r.max_score)}). None of "
             f"{', '.join(r.files)} is in your submission. Looked in: {', '.join(r.searched)}. Upload the "
             f"lab's files themselves, or your repository with them in labs/{r.lab}/." for r in missing]
            + ([output] if len(missing) < len(results) else []))
    report = {
        "score": sum(r.score for r in results),
        "execution_time": round(sum(r.duration_s for r in results), 1),
        "output": output,
        "visibility": "visible",
        # run_autograder's stdout is the grader's own table and progress: the tests say the same, for students.
        "stdout_visibility": "hidden",
        "extra_data": {"isolation": results[0].isolation if results else {},
                       "checks_sha256": {r.lab: r.checks_digest for r in results},
                       "seed": {r.lab: str(r.seed) for r in results if r.seed is not None},
                       "status": {r.lab: r.status.value for r in results}},
        "tests": tests,
    }
    board = leaderboard(results)
    if board:
        report["leaderboard"] = board
    return json.dumps(report, indent=2) + "\n"


def junit(results: list[LabResult]) -> str:
    suites = ET.Element("testsuites")
    for r in results:
        if _missing(r):  # one failing case, so that CI shows it red and why
            suite = ET.SubElement(suites, "testsuite", name=r.lab, tests="1", failures="1", errors="0",
                                  skipped="0", time=f"{r.duration_s:.3f}")
            properties = ET.SubElement(suite, "properties")
            for name, value in (("tier", r.tier), ("status", r.status.value), ("checks_sha256", r.checks_digest),
                                ("searched", ", ".join(r.searched))):
                ET.SubElement(properties, "property", name=name, value=value)
            case = ET.SubElement(suite, "testcase", classname=r.lab, name="the lab's files", time="0.000")
            ET.SubElement(case, "failure", type="missing", message=r.message).text = r.message
            ET.SubElement(case, "system-out").text = f"points 0/{_pts(r.max_score)}"
            continue
        suite = ET.SubElement(suites, "testsuite", name=r.lab, tests=str(len(r.checks)),
                              failures=str(sum(c.status == "failed" for c in r.checks)),
                              errors=str(sum(c.status in ("error", "timeout") for c in r.checks)),
                              skipped=str(sum(c.status == "skipped" for c in r.checks)),
                              time=f"{r.duration_s:.3f}")
        properties = ET.SubElement(suite, "properties")
        for name, value in (("tier", r.tier), ("status", r.status.value), ("isolation", _isolation(r)),
                            ("checks_sha256", r.checks_digest)):
            ET.SubElement(properties, "property", name=name, value=value)
        for c in r.checks:
            case = ET.SubElement(suite, "testcase", classname=r.lab, name=c.title, time=f"{c.duration_s:.3f}")
            if c.status == "failed":
                ET.SubElement(case, "failure", message=c.feedback.splitlines()[0] if c.feedback else "failed").text = c.feedback
            elif c.status in ("error", "timeout"):
                ET.SubElement(case, "error", message=f"{c.status}: " + (c.feedback.splitlines()[0] if c.feedback else "")).text = c.feedback
            elif c.status == "skipped":
                ET.SubElement(case, "skipped", message=c.feedback)
            ET.SubElement(case, "system-out").text = f"points {_pts(c.points)}/{_pts(c.max_points)}"
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


def render(results: list[LabResult], fmt: str) -> str:
    return {"text": text, "json": as_json, "gradescope": gradescope, "junit": junit,
            "markdown": report_ci.markdown, "classroom50": report_ci.classroom50,
            "classroom": report_ci.classroom}[fmt](results)


def failure(fmt: str, message: str) -> str:
    """A report for a run that could not grade at all, so a results file still
    exists and says why (Gradescope shows ``output`` to the student)."""
    text = f"The autograder could not run: {message}"
    if fmt == "gradescope":
        return json.dumps({"score": 0, "execution_time": 0, "output": text, "visibility": "visible",
                           "stdout_visibility": "hidden", "tests": []}, indent=2) + "\n"
    if fmt == "classroom":  # the reporter prints an "error" test's message: the student sees why
        return report_ci.base64_json({"version": 1, "status": "error", "max_score": 0, "tests": [
            report_ci.reporter_test("k2c grade", "error", 0, text, "", 0)]})
    if fmt == "markdown":
        return f"### {text}\n"
    if fmt == "classroom50":  # k2c exits 2 as well: Classroom 50's runner then records an infrastructure error
        return report_ci.classroom50([], message=text)
    if fmt == "json":
        return json.dumps({"error": message, "score": 0, "max_score": 0, "tests": []}, indent=2) + "\n"
    if fmt == "junit":
        suites = ET.Element("testsuites")
        case = ET.SubElement(ET.SubElement(suites, "testsuite", name="k2c", tests="1", errors="1"), "testcase",
                             classname="k2c", name="grading")
        ET.SubElement(case, "error", message=text).text = text
        return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"
    return text + "\n"

def write_results(path: str, text: str) -> None:
    """Write the report whole or not at all: a temporary file beside it, then a rename.
    It runs after every call into the submission has ended with all its processes,
    and no sandboxed process can reach this folder, so nothing rewrites it later."""
    import os
    import stat
    import tempfile
    from pathlib import Path

    target = Path(path)
    if target.exists() and not stat.S_ISREG(target.stat().st_mode):
        # /dev/null, /dev/stdout, a pipe: written to, never replaced (a rename as
        # root would put a plain file where /dev/null was).
        with open(target, "w") as f:
            f.write(text)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

