"""Reports of graded labs: a text table for people, JSON, Gradescope and JUnit for machines."""
from __future__ import annotations

import json
import textwrap
import xml.etree.ElementTree as ET

from autograder.runner import LabResult

FORMATS = ("text", "json", "gradescope", "junit")


def _pts(x: float) -> str:
    return f"{x:g}"


def _metrics(metrics: dict) -> str:
    """``sm_80: registers 18, shared_bytes 0; sm_90: ...`` for nested dicts, ``k v, ...`` for flat ones."""
    def flat(d):
        return ", ".join(f"{k} {v}" for k, v in d.items())
    if all(isinstance(v, dict) for v in metrics.values()):
        return "; ".join(f"{k}: {flat(v)}" for k, v in metrics.items())
    return flat(metrics)


def _isolation(r: LabResult) -> str:
    return f"{r.isolation.get('layer', '?')}, as {r.isolation.get('user', '?')}"


def text(results: list[LabResult]) -> str:
    lines = []
    for r in results:
        lines.append(f"Lab {r.lab} — {r.title}")
        lines.append(f"  {r.tier.upper()} tier · submission {r.submission}")
        lines.append(f"  isolation: {_isolation(r)} · checks sha256 {r.checks_digest[:12]}")
        lines.append(f"  {'points':>7}  {'status':<8} check")
        for c in r.checks:
            pts = "-" if c.status == "skipped" else f"{_pts(c.points)}/{_pts(c.max_points)}"
            lines.append(f"  {pts:>7}  {c.status:<8} {c.title}")
            if c.metrics and not c.feedback:  # what a passing check measured (ptxas's registers, ratios)
                lines.extend(" " * 19 + w for w in textwrap.wrap("measured: " + _metrics(c.metrics), 96,
                                                                  subsequent_indent="    "))
            if c.feedback:
                for para in c.feedback.splitlines()[:8]:
                    wrapped = textwrap.wrap(para, 96, initial_indent="→ " if para == c.feedback.splitlines()[0] else "  ",
                                            subsequent_indent="    ") or [""]
                    lines.extend(" " * 19 + w for w in wrapped)
        lines.append(f"  Score: {_pts(r.score)}/{_pts(r.max_score)}   ({r.duration_s:.1f} s)")
        lines.append("")
    if len(results) > 1:
        lines.append("Scoreboard")
        for r in results:
            lines.append(f"  {r.lab:<28} {_pts(r.score):>6}/{_pts(r.max_score):<6} {r.tier.upper()} tier")
        total, top = sum(r.score for r in results), sum(r.max_score for r in results)
        lines.append(f"  {'total':<28} {_pts(total):>6}/{_pts(top):<6}")
    return "\n".join(lines) + "\n"


def _lab_json(r: LabResult) -> dict:
    return {
        "lab": r.lab, "title": r.title, "tier": r.tier, "submission": r.submission,
        "score": r.score, "max_score": r.max_score, "duration_s": round(r.duration_s, 3),
        "isolation": r.isolation, "checks_sha256": r.checks_digest,
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


def gradescope(results: list[LabResult]) -> str:
    """Gradescope's results.json: score, execution_time, output, tests[]."""
    tests = []
    for r in results:
        for c in r.checks:
            test = {"name": f"{r.lab}: {c.title}" if len(results) > 1 else c.title,
                    "score": c.points, "max_score": 0 if c.status == "skipped" else c.max_points,
                    "output": f"[{c.status}] {c.feedback}".strip(), "visibility": "visible"}
            if c.status != "skipped":
                test["status"] = "passed" if c.status == "passed" else "failed"
            tests.append(test)
    tiers = sorted({r.tier for r in results})
    layers = sorted({_isolation(r) for r in results})
    return json.dumps({
        "score": sum(r.score for r in results),
        "execution_time": round(sum(r.duration_s for r in results), 1),
        "output": f"Graded on the {'/'.join(t.upper() for t in tiers)} tier by k2c (isolation: {'; '.join(layers)}).",
        "stdout_visibility": "hidden",
        "extra_data": {"isolation": results[0].isolation if results else {},
                       "checks_sha256": {r.lab: r.checks_digest for r in results}},
        "tests": tests,
    }, indent=2) + "\n"


def junit(results: list[LabResult]) -> str:
    suites = ET.Element("testsuites")
    for r in results:
        suite = ET.SubElement(suites, "testsuite", name=r.lab, tests=str(len(r.checks)),
                              failures=str(sum(c.status == "failed" for c in r.checks)),
                              errors=str(sum(c.status in ("error", "timeout") for c in r.checks)),
                              skipped=str(sum(c.status == "skipped" for c in r.checks)),
                              time=f"{r.duration_s:.3f}")
        properties = ET.SubElement(suite, "properties")
        for name, value in (("tier", r.tier), ("isolation", _isolation(r)), ("checks_sha256", r.checks_digest)):
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
    return {"text": text, "json": as_json, "gradescope": gradescope, "junit": junit}[fmt](results)


def failure(fmt: str, message: str) -> str:
    """A report for a run that could not grade at all, so a results file still
    exists and says why (Gradescope shows ``output`` to the student)."""
    text = f"The autograder could not run: {message}"
    if fmt == "gradescope":
        return json.dumps({"score": 0, "output": text, "tests": []}, indent=2) + "\n"
    if fmt == "json":
        return json.dumps({"error": message, "score": 0, "max_score": 0, "tests": []}, indent=2) + "\n"
    if fmt == "junit":
        suites = ET.Element("testsuites")
        case = ET.SubElement(ET.SubElement(suites, "testsuite", name="k2c", tests="1", errors="1"), "testcase",
                             classname="k2c", name="grading")
        ET.SubElement(case, "error", message=text).text = text
        return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"
    return text + "\n"
