"""Turn a `k2c grade all --format json` report into the Markdown table the docs show."""
import json
import platform
import sys
from datetime import datetime, timezone


def main(path: str) -> None:
    report = json.load(open(path))
    labs = report["labs"] if "labs" in report else [report]
    tiers = "/".join(sorted({lab["tier"].upper() for lab in labs}))
    print(f"{tiers} tier on `solutions/`, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, host {platform.node()}\n")
    print("| lab | check | status | points | measured |")
    print("| --- | --- | --- | --- | --- |")
    for lab in labs:
        for t in lab["tests"]:
            measured = ", ".join(f"{k} {v}" for k, v in t.get("metrics", {}).items())
            print(f"| {lab['lab']} | {t['title']} | {t['status']} | {t['points']:g}/{t['max_points']:g} | {measured} |")
    for lab in labs:
        print(f"\n{lab['lab']}: {lab['score']:g}/{lab['max_score']:g} in {lab['duration_s']:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1])
