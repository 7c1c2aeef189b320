"""What every benchmark script does with its table: print it, and write it as the
fragment ``docs/benchmarks.md`` includes (``docs/conf.py`` excludes the folder)."""
import datetime
import os
import platform
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FRAGMENTS = ROOT / "docs" / "benchmarks"


def machine(processes: int) -> str:
    """"4 processes on 2 cores (oversubscribed), x86_64": where a run was taken."""
    cores = os.cpu_count()
    return (f"{processes} processes on {cores} cores{' (oversubscribed)' if processes > cores else ''}, "
            f"{platform.processor() or platform.machine()}")


def publish(script: str, fragment: str, what: str, where: str, table: str, write: bool = True) -> None:
    """Print ``where`` and ``table``; unless ``write`` is false, save them to
    ``docs/benchmarks/<fragment>`` under the sentence "<what>, measured <today>: <where>."."""
    print(where)
    print(table)
    if not write:
        return
    output = FRAGMENTS / fragment
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(f"<!-- written by benchmarks/{Path(script).name}; rerun it to refresh -->\n"
                      f"{what}, measured {datetime.date.today().isoformat()}: {where}.\n\n{table}\n")
    print(f"wrote {output.relative_to(ROOT)}")
