"""The ``k2c`` command: ``k2c grade``, ``k2c sync``, ``k2c doctor``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXIT_OK, EXIT_BELOW_FULL, EXIT_USAGE = 0, 1, 2


def _progress(result) -> None:
    mark = {"passed": ".", "failed": "F", "error": "E", "timeout": "T", "skipped": "s"}[result.status]
    # Checks run with sys.stderr captured; progress goes to the real terminal.
    sys.__stderr__.write(mark)
    sys.__stderr__.flush()



def _default_submission() -> Path:
    return Path("labs") if Path("labs").is_dir() else Path(".")


def cmd_grade(args) -> int:
    from autograder.grading import report
    from autograder.grading.report import write_results
    from autograder.grading.labs import UsageError

    try:
        return _grade(args)
    except UsageError as exc:
        if args.output:  # a results file always exists, and says why grading failed
            write_results(args.output, report.failure(args.format, str(exc)))
        if args.summary:
            _append(args.summary, report.failure("markdown", str(exc)))
        raise


def _append(path: str, text: str) -> None:
    """Add to a summary file (GitHub's $GITHUB_STEP_SUMMARY collects what each step appends)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


def _grade(args) -> int:
    from autograder.grading import report
    from autograder.grading.report import write_results
    from autograder.grading.labs import UsageError, all_labs, find_lab
    from autograder.grading.runner import LabStatus, NoCheckSelected, grade, ready_to_grade, resolve_tier

    labs = all_labs() if args.lab == "all" else [find_lab(part) for part in args.lab.split(",")]
    if args.list:
        return _list(labs, args.k, args.format)
    site = _slurm_site(args)
    if site:  # the job grades, on a node: this machine neither picks the tier nor proves itself ready
        from autograder.instructor.slurm_job import grade_in_job

        return grade_in_job(args, labs, *site)
    tier = resolve_tier(args.tier)
    if args.dry_run_gpu and tier != "cpu":
        raise UsageError("--dry-run-gpu runs the GPU tier's checks on stand-ins on the CPU tier: this run is GPU "
                         "tier, which runs them for real (use --tier cpu for a dry run)")
    ready_to_grade(labs, tier)  # before any check: no score from a machine that cannot grade
    root = Path(args.submission) if args.submission else _default_submission()
    results = []
    for lab in labs:
        dry = ", GPU checks as a dry run" if args.dry_run_gpu else ""
        sys.stderr.write(f"grading {lab.slug} ({tier.upper()} tier{dry}, {args.shown_as or root}) ")
        sys.stderr.flush()
        try:
            result = grade(lab, root, tier, timeout_s=args.timeout, select=args.k, on_result=_progress,
                           dry_run_gpu=args.dry_run_gpu, budget_s=args.budget)
        except NoCheckSelected:
            if len(labs) == 1:
                sys.stderr.write("\n")
                raise
            sys.stderr.write("no check matches -k: skipped\n")  # `all -k ring` grades the labs that have one
            continue
        if result.status is LabStatus.MISSING:
            sys.stderr.write(f"missing: no lab files found ({', '.join(result.searched)})")
        sys.stderr.write(f" {result.duration_s:.1f} s\n")
        results.append(result)
    if not results:
        raise UsageError(f"no check of any lab matches -k {args.k!r}")
    if args.shown_as:  # graded from --slurm's copy: the report names the submission that was copied
        copied = str(root.resolve())
        for result in results:
            if result.submission.startswith(copied):
                result.submission = args.shown_as + result.submission[len(copied):]
    rendered = report.render(results, args.format)
    if args.output:
        write_results(args.output, rendered)
        if args.format != "text":
            sys.stdout.write(report.render(results, "text"))
    else:
        sys.stdout.write(rendered)
    if args.summary:
        _append(args.summary, report.render(results, "markdown"))
    full = all(r.status is LabStatus.GRADED and r.score >= r.max_score for r in results)
    return EXIT_BELOW_FULL if args.require_full and not full else EXIT_OK


def _list(labs, select, format) -> int:
    import dataclasses
    import json

    from autograder.grading.runner import list_checks

    if format == "json":
        print(json.dumps({lab.slug: [dataclasses.asdict(c) for c in list_checks(lab, select)] for lab in labs},
                         indent=1))
        return EXIT_OK
    for lab in labs:
        checks = list_checks(lab, select)
        print(f"Lab {lab.slug} — {lab.title}: {len(checks)} checks, "
              f"{sum(c.max_points for c in checks):g} points")
        for check in checks:
            tier = "  (GPU tier)" if check.gpu else ""
            print(f"  {check.max_points:>4g}  {check.name}{tier}\n        {check.title}")
    return EXIT_OK


def cmd_grade_class(args) -> int:
    from autograder.instructor.gradebook import RowStatus, Settings, default_jobs, grade_class
    from autograder.grading.labs import find_lab
    from autograder.grading.runner import resolve_tier

    lab = find_lab(args.lab)
    site = _slurm_site(args)  # with --slurm the tier is the job's, not this machine's
    tier = site[0] if site else resolve_tier(args.tier)
    if not args.slurm:  # with --slurm no student code runs here: each task checks its node (gradebook_slurm)
        _require_isolation(lab, args.allow_weak_isolation, tier)
    output = Path(args.output or f"gradebook-{lab.slug}.csv")
    settings = Settings(lab.slug, tier, args.timeout, args.k, args.limit, args.budget)
    jobs = args.jobs if args.jobs else (None if args.slurm else default_jobs(lab))
    run_array = None
    if site:
        from autograder.instructor.gradebook_slurm import array_runner

        run_array = array_runner(args.chunk, *site[1:], args.allow_weak_isolation)
    rows = grade_class(lab, Path(args.dir), output, settings, jobs, args.resume, run_array)
    counts = {s: sum(r.status == s for r in rows) for s in RowStatus}
    summary = ", ".join(f"{n} {s.value}" for s, n in counts.items() if n)
    print(f"{len(rows)} submissions ({summary}): {output} and {output.with_suffix('.json')}")
    return EXIT_OK


def _slurm_site(args):
    """With ``--slurm``: the tier its jobs grade on and the site's settings for them
    (``gradebook_slurm.SlurmSite``), with where those came from; None without it."""
    from autograder.grading.labs import UsageError

    given = {"partition": args.partition, "account": args.account, "time": args.time,
             "cpus_per_task": args.cpus_per_task, "mem": args.mem,
             "options": tuple(args.sbatch_options) if args.sbatch_options else None,
             "gpus": args.gpus, "gres": args.gres, "gpu_partition": args.gpu_partition}
    if not args.slurm:
        if args.slurm_config or any(v is not None for v in given.values()):
            raise UsageError("--slurm-config, --partition, --account, --time, --cpus-per-task, --mem, "
                             "--sbatch-option, --gpus, --gres and --gpu-partition are SLURM's settings: "
                             "give them with --slurm")
        return None
    from autograder.instructor.gradebook_slurm import SlurmSite, slurm_tier

    tier = slurm_tier(args.tier, any(given[k] is not None for k in ("gpus", "gres", "gpu_partition")))
    site, origin = SlurmSite.resolve(args.slurm_config, tier, **given)
    return tier, site, origin


def _require_isolation(lab, allow_weak: bool, tier: str = "cpu") -> None:
    """A class is graded where this machine can grade at all (the readiness proof), and
    where student code cannot read the other students' files, or the solutions: under
    bubblewrap. The subreaper layer hides no file (autograder.sandbox.isolation)."""
    from autograder.grading.labs import UsageError
    from autograder.grading.runner import ready_to_grade

    layer = ready_to_grade([lab], tier)  # exit 2, with the cause and the remedy, before any row
    if layer.hides_files:
        return
    if not allow_weak:
        raise UsageError(
            f"grade-class refuses to grade here: this machine gives the {layer.layer.value} layer "
            f"({layer.fallback_reason or 'bubblewrap is not in use'}), under which student code could read "
            f"{layer.readable}: classmates' submissions, the gradebook, the solutions. Install bubblewrap "
            "(Debian/Ubuntu: apt-get install bubblewrap; 'k2c doctor' checks it), or pass "
            "--allow-weak-isolation to grade anyway (the gradebook's isolation column records the layer)")
    sys.stderr.write(f"warning: grading with the {layer.layer.value} layer (--allow-weak-isolation): student code "
                     f"could read {layer.readable}\n")


def cmd_sync(args) -> int:
    from autograder.instructor.sync import MarkerError, differences, sync

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


def cmd_selftest(args) -> int:
    from autograder import selftest
    from autograder.grading.labs import all_labs, find_lab

    labs = all_labs() if args.lab == "all" else [find_lab(part) for part in args.lab.split(",")]
    print(f"running what grading {'every lab' if args.lab == 'all' else ', '.join(l.slug for l in labs)} needs:")
    return EXIT_OK if selftest.run(labs) else EXIT_USAGE


def cmd_gradescope(args) -> int:
    from autograder.instructor.gradescope import build
    from autograder.grading.labs import UsageError, find_lab

    if args.lab == "all":  # a Gradescope assignment grades one lab
        raise UsageError("k2c gradescope builds one lab's autograder: name a lab (06 or 06-collectives), not 'all'")
    lab = find_lab(args.lab)
    built = build(lab, Path(args.output or f"gradescope-{lab.slug}.zip"))
    print(f"wrote {built.path}: setup.sh, run_autograder, {built.wheel}")
    print(f"  the wheel: the grader, the checks of {lab.slug}, course.{{{', '.join(built.course_modules)}}}")
    print(f"  setup.sh installs: {', '.join(built.requirements)}")
    return EXIT_OK


def cmd_ci(args) -> int:
    from autograder.instructor.ci import build
    from autograder.grading.labs import UsageError, find_lab

    if args.lab == "all":
        raise UsageError("k2c ci writes one lab's workflow and grader: name a lab (13 or 13-hybrid-parallel)")
    lab = find_lab(args.lab)
    built = build(lab, Path(args.output or f"ci-{lab.slug}"))
    print(f"wrote {built.folder}: {built.wheel} (sha256 {built.sha256[:12]}), k2c-grade.yml, github-classroom.yml, autograder.py")
    print(f"  the wheel grades {', '.join(built.labs)} with their public checks; no solutions, no hidden checks")
    print(f"  GitHub Actions: commit k2c-grade.yml to .github/workflows/ and the wheel to .k2c/ "
          f"(k2c release DIR --ci {lab.number} does both)")
    print("  Classroom 50: put autograder.py and the wheel in CLASSROOM/autograders/ASSIGNMENT/")
    return EXIT_OK


def cmd_release(args) -> int:
    from autograder.instructor.release import AUTHOR, ReleaseError, parse_author, release
    from autograder.grading.labs import find_lab

    def say(line):
        print(f"k2c release: {line}", file=sys.stderr)

    try:
        author = parse_author(args.author) if args.author else AUTHOR
        done = release(Path(args.source), Path(args.dir), author, say,
                       ci_labs=[find_lab(lab) for lab in args.ci or ()])
    except ReleaseError as exc:
        print(f"k2c release: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {done.path}: {done.files} files, {done.nbytes / 1e6:.1f} MB, one commit ({done.commit}) on branch main")
    print(f"  try it: cd {done.path} && make setup && make grade")
    print("  publish it: git remote add origin URL && git push -u origin main")
    return EXIT_OK


def _slurm_options(command: argparse.ArgumentParser, unit: str) -> None:
    """The site's SLURM settings, as ``k2c grade`` and ``grade-class`` take them with ``--slurm``."""
    site = command.add_argument_group("the site's SLURM settings (with --slurm; over those of --slurm-config)")
    site.add_argument("--slurm-config", metavar="TOML",
                      help="partition, account, time, cpus-per-task, mem, options, and a [gpu] table for the GPU "
                           "tier (default: ./k2c-slurm.toml if any)")
    site.add_argument("--partition", help="sbatch --partition")
    site.add_argument("--account", help="sbatch --account")
    default = "the grading's limit" if unit == "task" else "an hour a lab, plus 5 minutes"
    site.add_argument("--time", help=f"sbatch --time per {unit} (minutes or H:MM:SS; default: {default})")
    site.add_argument("--cpus-per-task", type=int, metavar="N", help="sbatch --cpus-per-task")
    site.add_argument("--mem", help=f"sbatch --mem per {unit} (4G)")
    site.add_argument("--sbatch-option", action="append", metavar="OPT", dest="sbatch_options",
                      help="any other sbatch option, as on its command line (--qos=short); repeatable")
    site.add_argument("--gpus", metavar="[TYPE:]N", help="GPU tier: sbatch --gpus (implies --tier gpu)")
    site.add_argument("--gres", metavar="gpu[:TYPE]:N",
                      help="GPU tier: sbatch --gres (implies --tier gpu; default gpu:1 when nothing asks for a GPU)")
    site.add_argument("--gpu-partition", metavar="P", help="GPU tier: the partition (implies --tier gpu)")


def parser() -> argparse.ArgumentParser:
    from autograder.grading.submission import BUDGET_CALL_LIMITS, BUDGET_FLOOR_S

    p = argparse.ArgumentParser(prog="k2c", description="Kernels to Clusters: grade labs, generate starters, check the machine.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("grade", help="grade a lab (or all labs) of a submission")
    g.add_argument("lab", help="lab number (02), slug (02-cuda-model), several (13,07,08) or 'all'")
    g.add_argument("--submission", metavar="DIR|ZIP",
                   help="a folder or .zip holding the lab's files, NN-slug/ lab folders, or a student repository "
                        "(labs/NN-slug/), perhaps inside one wrapping folder (default: ./labs, else .)")
    g.add_argument("--tier", choices=("auto", "cpu", "gpu"), default="auto")
    g.add_argument("--format", choices=("text", "json", "gradescope", "junit", "markdown", "classroom50", "classroom"),
                   default="text")
    g.add_argument("--summary", metavar="FILE",
                   help="also add a Markdown summary to FILE (in GitHub Actions: \"$GITHUB_STEP_SUMMARY\")")
    g.add_argument("-o", "--output", metavar="FILE", help="write the report here (the text table still goes to stdout)")
    g.add_argument("--timeout", type=float, metavar="SECONDS", help="limit for each call into the submission")
    g.add_argument("--budget", type=float, metavar="SECONDS",
                   help="limit for all the calls of one lab's grading together; past it the checks left are "
                        f"reported as not run (default: {BUDGET_CALL_LIMITS} call limits, at least "
                        f"{BUDGET_FLOOR_S:g} s)")
    g.add_argument("--require-full", action="store_true", help="exit 1 when the score is below the maximum")
    g.add_argument("-k", metavar="EXPR", help="only the checks whose names match (pytest -k syntax)")
    g.add_argument("--list", action="store_true", help="list the checks (name, points, title; --format json too) and grade nothing")
    g.add_argument("--dry-run-gpu", action="store_true",
                   help="CPU tier: run the GPU tier's checks at tiny sizes on stand-in devices instead of skipping "
                        "them; they show as skipped ('dry run passed' or why not) and award nothing")
    g.add_argument("--slurm", action="store_true",
                   help="grade in one SLURM job (sbatch --wait) and print its report here, with the same exit status")
    g.add_argument("--shown-as", help=argparse.SUPPRESS)  # --slurm's copy of the submission: the report names this
    _slurm_options(g, "job")
    g.set_defaults(run=cmd_grade)

    c = sub.add_parser("grade-class", help="grade a folder of submissions (one folder or zip per student) into a gradebook")
    c.add_argument("lab", help="lab number (06) or slug (06-collectives)")
    c.add_argument("dir", metavar="DIR", help="one folder or .zip per student, named by the student's id")
    c.add_argument("-o", "--output", metavar="CSV",
                   help="the gradebook (default gradebook-NN-slug.csv); the full reports go beside it as .json")
    c.add_argument("--jobs", "-j", type=int, metavar="N",
                   help="gradings at once (default: the cores, as memory allows; with --slurm: no limit)")
    c.add_argument("--resume", action="store_true",
                   help="keep the rows of the gradebook's .json whose submission is unchanged")
    c.add_argument("--slurm", action="store_true", help="grade as a SLURM job array and wait for it")
    c.add_argument("--chunk", type=int, default=1, metavar="K", help="with --slurm: submissions per array task")
    _slurm_options(c, "task")
    c.add_argument("--allow-weak-isolation", action="store_true",
                   help="grade even where bubblewrap is missing: student code could then read every file its "
                        "user may read, classmates' submissions included (the gradebook records the layer)")
    c.add_argument("--tier", choices=("auto", "cpu", "gpu"), default="auto")
    c.add_argument("--timeout", type=float, metavar="SECONDS", help="limit for each call into a submission")
    c.add_argument("--budget", type=float, metavar="SECONDS",
                   help="limit for all the calls of one submission's grading together; past it its checks left "
                        f"are reported as not run (default: {BUDGET_CALL_LIMITS} call limits, at least "
                        f"{BUDGET_FLOOR_S:g} s)")
    c.add_argument("--limit", type=float, default=3600.0, metavar="SECONDS",
                   help="limit for one submission's whole grading (default 3600)")
    c.add_argument("-k", metavar="EXPR", help="only the checks whose names match (pytest -k syntax)")
    c.set_defaults(run=cmd_grade_class)

    s = sub.add_parser("sync", help="regenerate labs/ from solutions/")
    s.add_argument("--check", action="store_true", help="only report drift; exit 1 if labs/ differs")
    s.add_argument("--solutions", default="solutions", help=argparse.SUPPRESS)
    s.add_argument("--labs", default="labs", help=argparse.SUPPRESS)
    s.set_defaults(run=cmd_sync)

    d = sub.add_parser("doctor", help="what this machine offers, and what to install")
    d.set_defaults(run=cmd_doctor)

    t = sub.add_parser("selftest", help="run the stack grading needs (sandbox, MPI, gloo, GPU compilers) once, for real")
    t.add_argument("lab", nargs="?", default="all", help="only what this lab needs (default: every lab)")
    t.set_defaults(run=cmd_selftest)

    z = sub.add_parser("gradescope", help="build the Gradescope autograder zip of one lab")
    z.add_argument("lab", help="lab number (06) or slug (06-collectives)")
    z.add_argument("-o", "--output", metavar="FILE", help="the zip to write (default: gradescope-NN-slug.zip)")
    z.set_defaults(run=cmd_gradescope)

    r = sub.add_parser("release", help="write the student repository (no solutions/) into a new folder, as one git commit")
    r.add_argument("dir", metavar="DIR", help="a new or empty folder")
    r.add_argument("--author", metavar="'NAME <EMAIL>'", help="the commit's author (default: Kernels to Clusters)")
    r.add_argument("--ci", action="append", metavar="LAB",
                   help="also commit lab LAB's GitHub Actions workflow and grader wheel (k2c ci); repeatable")
    r.add_argument("--source", default=".", help=argparse.SUPPRESS)
    r.set_defaults(run=cmd_release)

    ci = sub.add_parser("ci", help="write one lab's grader wheel, GitHub Actions workflow and Classroom 50 autograder")
    ci.add_argument("lab", help="lab number (13) or slug (13-hybrid-parallel)")
    ci.add_argument("-o", "--output", metavar="DIR", help="the folder to write (default: ci-NN-slug)")
    ci.set_defaults(run=cmd_ci)
    return p


def main(argv: list[str] | None = None) -> int:
    from autograder.grading.labs import UsageError

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
