"""The ``k2c`` command: ``k2c grade``, ``k2c sync``, ``k2c doctor``."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

EXIT_OK, EXIT_BELOW_FULL, EXIT_USAGE = 0, 1, 2


def _progress(result) -> None:
    mark = {"passed": ".", "failed": "F", "error": "E", "timeout": "T", "skipped": "s"}[result.status]
    # Checks run with sys.stderr captured; progress goes to the real terminal.
    sys.__stderr__.write(mark)
    sys.__stderr__.flush()


def write_results(path: str, text: str) -> None:
    """Write the report whole or not at all: a temporary file beside it, then a rename.
    It runs after every call into the submission has ended with all its processes,
    and no sandboxed process can reach this folder, so nothing rewrites it later."""
    import tempfile

    target = Path(path)
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


def _default_submission() -> Path:
    return Path("labs") if Path("labs").is_dir() else Path(".")


def cmd_grade(args) -> int:
    from autograder import report
    from autograder.labs import UsageError

    try:
        return _grade(args)
    except UsageError as exc:
        if args.output:  # a results file always exists, and says why grading failed
            write_results(args.output, report.failure(args.format, str(exc)))
        raise


def _grade(args) -> int:
    from autograder import report
    from autograder.labs import all_labs, find_lab
    from autograder.runner import grade, resolve_tier

    tier = resolve_tier(args.tier)
    labs = all_labs() if args.lab == "all" else [find_lab(args.lab)]
    root = Path(args.submission) if args.submission else _default_submission()
    results = []
    for lab in labs:
        sys.stderr.write(f"grading {lab.slug} ({tier.upper()} tier, {root}) ")
        sys.stderr.flush()
        result = grade(lab, root, tier, timeout_s=args.timeout, select=args.k, on_result=_progress)
        sys.stderr.write(f" {result.duration_s:.1f} s\n")
        results.append(result)
    rendered = report.render(results, args.format)
    if args.output:
        write_results(args.output, rendered)
        if args.format != "text":
            sys.stdout.write(report.render(results, "text"))
    else:
        sys.stdout.write(rendered)
    full = all(r.score >= r.max_score for r in results)
    return EXIT_BELOW_FULL if args.require_full and not full else EXIT_OK


def cmd_sync(args) -> int:
    from autograder.sync import MarkerError, differences, sync

    solutions, labs = Path(args.solutions), Path(args.labs)
    if not solutions.is_dir():
        print(f"k2c sync: no {solutions}/ here; run it from the repository root", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.check:
            diffs = differences(solutions, labs)
            for d in diffs:
                print(d)
            if diffs:
                print(f"{labs}/ has drifted from {solutions}/: run 'k2c sync' and commit the result", file=sys.stderr)
                return 1
            print(f"{labs}/ is in sync with {solutions}/")
            return EXIT_OK
        changed = sync(solutions, labs)
    except MarkerError as exc:
        print(f"k2c sync: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print("\n".join(changed) if changed else "nothing to do: labs/ already matches")
    return EXIT_OK


def cmd_doctor(args) -> int:
    from autograder.doctor import report

    text, healthy = report()
    sys.stdout.write(text)
    return EXIT_OK if healthy else 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k2c", description="Kernels to Clusters: grade labs, generate starters, check the machine.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("grade", help="grade a lab (or all labs) of a submission")
    g.add_argument("lab", help="lab number (02), slug (02-cuda-model) or 'all'")
    g.add_argument("--submission", metavar="DIR",
                   help="folder holding NN-slug/ lab folders, or the lab's files themselves (default: ./labs, else .)")
    g.add_argument("--tier", choices=("auto", "cpu", "gpu"), default="auto")
    g.add_argument("--format", choices=("text", "json", "gradescope", "junit"), default="text")
    g.add_argument("-o", "--output", metavar="FILE", help="write the report here (the text table still goes to stdout)")
    g.add_argument("--timeout", type=float, metavar="SECONDS", help="limit for each call into the submission")
    g.add_argument("--require-full", action="store_true", help="exit 1 when the score is below the maximum")
    g.add_argument("-k", metavar="EXPR", help="only the checks whose names match (pytest -k syntax)")
    g.set_defaults(run=cmd_grade)

    s = sub.add_parser("sync", help="regenerate labs/ from solutions/")
    s.add_argument("--check", action="store_true", help="only report drift; exit 1 if labs/ differs")
    s.add_argument("--solutions", default="solutions", help=argparse.SUPPRESS)
    s.add_argument("--labs", default="labs", help=argparse.SUPPRESS)
    s.set_defaults(run=cmd_sync)

    d = sub.add_parser("doctor", help="what this machine offers, and what to install")
    d.set_defaults(run=cmd_doctor)
    return p


def main(argv: list[str] | None = None) -> int:
    from autograder.labs import UsageError

    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except UsageError as exc:
        print(f"k2c: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("k2c: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
