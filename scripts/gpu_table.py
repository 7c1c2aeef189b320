"""Turn a `k2c grade all --format json` report into the Markdown table the docs show.

The report of a GPU-tier run, or of a dry run (`--dry-run-gpu`: the GPU checks on stand-in
devices on the CPU tier), which the table says in its first line. The device record of the
performance checks (course.gpu_timing) goes above the table, once per device; the compile
checks' registers, shared memory and spills per kernel and architecture go below it
(autograder.gpu_matrix).
"""
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autograder import gpu_matrix  # noqa: E402

# Metrics that are not numbers of one check: the record and its one-line summary go above
# the table, the long description of how each time was measured stays in the JSON.
# The compile checks' registers, shared memory and spills ("ptxas") are a table of their own.
NOT_IN_THE_TABLE = ("record", "device", "measured", "ptxas")


def _device_lines(labs) -> list[str]:
    seen = []
    for lab in labs:
        for t in lab["tests"]:
            line = t.get("metrics", {}).get("device")
            if line and line not in seen:
                seen.append(line)
    return [f"Device: {line}" for line in seen]


def _status(test: dict) -> str:
    return f"skipped: {test['feedback']}" if test["status"] == "skipped" else test["status"]


def main(path: str) -> None:
    report = json.load(open(path))
    labs = report["labs"] if "labs" in report else [report]
    tiers = "/".join(sorted({lab["tier"].upper() for lab in labs}))
    print(f"{tiers} tier on `solutions/`, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, host {platform.node()}\n")
    if any(lab.get("gpu_dry_run") for lab in labs):
        print("**A dry run**: the GPU tier's checks ran at tiny sizes on stand-in devices on the CPU tier "
              "(`k2c grade --dry-run-gpu`). Nothing here was measured on a GPU, and the checks award nothing.\n")
    for line in _device_lines(labs):
        print(f"{line}\n")
    print("| lab | check | status | points | measured |")
    print("| --- | --- | --- | --- | --- |")
    for lab in labs:
        for t in lab["tests"]:
            measured = ", ".join(f"{k} {v}" for k, v in t.get("metrics", {}).items() if k not in NOT_IN_THE_TABLE)
            print(f"| {lab['lab']} | {t['title']} | {_status(t)} | {t['points']:g}/{t['max_points']:g} | {measured} |")
    for lab in labs:
        print(f"\n{lab['lab']}: {lab['score']:g}/{lab['max_score']:g} in {lab['duration_s']:.1f} s")
    if gpu_matrix.compile_rows(report):
        print("\nCompiled for each architecture (registers / shared bytes / spilled bytes, from ptxas):\n")
        print(gpu_matrix.compile_matrix(report), end="")


if __name__ == "__main__":
    main(sys.argv[1])
