"""What checks use to compare a submission's answer with an oracle's, and to
prepare inputs that make mistakes visible."""
from __future__ import annotations

import inspect
import re

import numpy as np

POISON = np.nan  # float outputs start as NaN: an element nobody wrote stays NaN
INT_POISON = -(2**31) + 7


def poisoned(shape, dtype=np.float32) -> np.ndarray:
    """An output buffer filled with a value no correct kernel writes."""
    dtype = np.dtype(dtype)
    fill = POISON if dtype.kind == "f" else INT_POISON
    return np.full(shape, fill, dtype=dtype)


def by_tier(tier: str, cpu, gpu):
    """Size for this tier: small for the simulator, device-filling on a GPU."""
    return gpu if tier == "gpu" else cpu


def _index(flat: int, shape) -> str:
    idx = np.unravel_index(flat, shape)
    return "[" + ", ".join(str(int(i)) for i in idx) + "]"


def expect_array(got, want, what: str = "result", rtol: float = 1e-6, atol: float = 0.0,
                 exact: bool = False) -> None:
    """Assert ``got`` equals ``want``; the message says which element first differs and how."""
    want = np.asarray(want)
    if got is None:
        raise AssertionError(f"{what}: got None (did the function forget to return?)")
    got = np.asarray(got)
    if got.shape != want.shape:
        raise AssertionError(f"{what}: expected shape {want.shape}, got {got.shape}")
    if got.dtype.kind in "OUSV":
        raise AssertionError(f"{what}: expected numbers, got an array of {got.dtype}")
    if exact:
        bad = got != want
    else:
        bad = ~np.isclose(got, want, rtol=rtol, atol=atol, equal_nan=False)
    if not bad.any():
        return
    flat = bad.ravel()
    first = int(np.argmax(flat))
    g, w = got.ravel()[first], want.ravel()[first]
    unwritten = int(np.isnan(got).sum()) if got.dtype.kind == "f" else int((got == INT_POISON).sum())
    msg = (f"{what}{_index(first, want.shape)}: expected {w!r}, got {g!r}; "
           f"{int(flat.sum())} of {flat.size} elements differ")
    if unwritten:
        msg += f" ({unwritten} never written: the poison value is still there)"
    raise AssertionError(msg)


def expect_close(got, want, what: str, rel: float) -> None:
    """Assert a scalar is within a relative tolerance."""
    if got is None:
        raise AssertionError(f"{what}: got None (did the function forget to return?)")
    got = float(got)
    if not abs(got - want) <= rel * abs(want):
        raise AssertionError(f"{what}: expected {want:.6g} (±{rel:.0%}), got {got:.6g}")


def unstubbed(kernel):
    """Return a student's ``@cuda.jit`` kernel, or raise NotImplementedError if it is
    still the starter's stub. A kernel cannot raise on a real GPU, so the stub is
    found in its source before it is launched."""
    source = inspect.getsource(getattr(kernel, "py_func", None) or getattr(kernel, "fn", kernel))
    stub = re.search(r"raise NotImplementedError\((['\"])(.*?)\1\)", source)
    if stub:
        raise NotImplementedError(stub.group(2))
    return kernel


def compile_kernels(module_name: str, signatures: dict) -> dict:
    """Compile a submission's kernels ``{name: signature}`` for every architecture the
    course supports (``course.gpu_compile.TARGETS``): ``{"kernels": {name: {"sm_75": result,
    ...}}}``, a stub's ``{"not_implemented": hint}``, or ``{"unavailable": why}``. Runs in
    a sandboxed call with the simulator off (``Submission.compiling()``)."""
    import importlib

    from course import gpu_compile

    why = gpu_compile.unavailable()
    if why:
        return {"unavailable": why}
    module = importlib.import_module(module_name)
    kernels = {}
    for name, signature in signatures.items():
        try:
            kernel = unstubbed(getattr(module, name))
        except NotImplementedError as exc:
            kernels[name] = {"not_implemented": str(exc)}
            continue
        kernels[name] = gpu_compile.compile_for_targets(kernel, signature)
    return {"kernels": kernels}


def compile_cupy_kernels(module_name: str, builder: str) -> dict:
    """Compile the CuPy kernels that ``module.builder()`` makes, with NVRTC, for every
    architecture the course supports and for float and double (``course.gpu_compile``):
    ``{"kernels": {name: {"sm_75 float": result, ...}}}``, or a stub's
    ``{"not_implemented": hint}``. Needs neither a GPU nor CuPy."""
    import importlib

    from course import gpu_compile

    why = gpu_compile.nvrtc_unavailable()
    if why:
        return {"unavailable": why}
    build = getattr(importlib.import_module(module_name), builder)
    try:
        made = gpu_compile.capture_cupy_kernels(build)
    except NotImplementedError as exc:
        return {"not_implemented": str(exc)}
    kernels = {}
    for kernel in made:
        results = {}
        for placeholder in ("float", "double"):
            source = kernel["code"] if kernel["kind"] == "raw" else gpu_compile.elementwise_source(kernel, placeholder)
            for target, outcome in gpu_compile.compile_cuda_c_for_targets(source).items():
                results[f"{target} {placeholder}"] = outcome
            if kernel["kind"] == "raw":
                break
        kernels[kernel["name"]] = results
    return {"kernels": kernels}


def compiled_kernels(submission, module_name: str, signatures: dict, kernel: str) -> dict:
    """``compile_kernels`` for one kernel of a submission's module (its signature
    from ``signatures``), once per grading run, in a sandboxed call with the
    simulator off. One kernel at a time: a grading that selects a few checks
    compiles only the kernels they launch."""
    from autograder.grading.kernel_source import environment_dependence

    refused = environment_dependence(submission.path / f"{module_name}.py", kernel)
    if refused:  # read in the grader: a kernel that depends on where it runs is refused, on every target
        return {"kernels": {kernel: {"every target": {"ok": False, "refused": refused}}}}
    return submission.once(("compiled", module_name, kernel), lambda: submission.compiling().call(
        "autograder.grading.checking.compile_kernels", module_name, {kernel: signatures[kernel]}))


def require_compiles(submission, module_name: str, signatures: dict, kernel: str, shows: tuple = ()) -> None:
    """A kernel no GPU would compile, or whose compiled form lacks the work ``shows`` names
    (``expect_compiled``), loses the points of every check that launches it."""
    compiled = compiled_kernels(submission, module_name, signatures, kernel)
    failure = compile_failure(compiled, kernel) or missing_work(compiled, kernel, shows)
    assert not failure, failure


SIMULATOR_NOTE = "The simulator runs kernels as Python, so it worked there; a GPU would refuse it"


def with_the_work(claim: str, answer_is_right) -> None:
    """No property without the work. A check of what code never does (a race,
    a tensor too large, a message too many) holds vacuously for code that does
    nothing, so it awards its points only when the same call also returned the
    right answer: ``answer_is_right()`` asserts that answer (``expect_array``, an
    oracle's comparison), and its failure fails the check with ``claim`` named.
    A stub's ``NotImplementedError`` passes through, as "not implemented yet"."""
    try:
        answer_is_right()
    except AssertionError as exc:
        raise AssertionError(f"not credited: {claim} counts only for a call that also returns the right answer, "
                             f"and this one did not: {exc}") from None


def compile_failure(compiled: dict, name: str, note: str = SIMULATOR_NOTE) -> str:
    """Why kernel ``name`` does not compile for a GPU (``compile_kernels``' answer);
    "" when it does, is still a stub, or this machine cannot compile."""
    for target, outcome in compiled.get("kernels", {}).get(name, {}).items():
        if isinstance(outcome, dict) and "refused" in outcome:
            return f"{name} is refused: {outcome['refused']}"
        if isinstance(outcome, dict) and not outcome.get("ok", True):
            return f"{name} does not compile for a GPU ({target}): {outcome['error']}. {note}"
    return ""


PTXAS_METRICS = "ptxas"  # the metrics key of a compile check: {kernel: {"sm_75": {registers, ...}, ...}}
RESOURCES = ("registers", "shared_bytes", "spill_bytes")


WORK_NAMES = {"global_stores": "stores to global memory", "shared_accesses": "shared-memory loads or stores",
              "barriers": "barriers (syncthreads)", "atomics": "atomic updates"}


def missing_work(compiled: dict, name: str, shows: tuple) -> str:
    """What of ``shows`` kernel ``name``'s compiled form lacks on some target ("" when none)."""
    for target, outcome in compiled.get("kernels", {}).get(name, {}).items():
        work = outcome.get("work", {}) if isinstance(outcome, dict) else {}
        missing = [WORK_NAMES[what] for what in shows if work and not work.get(what)]
        if missing:
            return (f"{name} compiled for {target} has no {' and no '.join(missing)}: the kernel a GPU would run "
                    "does not do the work the simulator saw (does a branch depend on where it runs, or on a value "
                    "the compiler could prove constant?)")
    return ""


def expect_compiled(compiled: dict, name: str, metrics: dict | None = None, note: str = SIMULATOR_NOTE,
                    shows: tuple = ()) -> None:
    """Assert kernel ``name`` compiled for every target; ptxas's registers, shared
    memory and spills per architecture go into ``metrics["ptxas"]`` as one row per
    kernel (``{name: {"sm_75": {...}, ...}}``; a CuPy kernel's ``"sm_75 float"`` targets
    make rows ``"name float"`` and ``"name double"``), which the reports show as a
    table. ``shows``: the work the compiled kernel must show on every target
    (``course.gpu_compile.ptx_work``: "global_stores", "shared_accesses", "barriers",
    "atomics"), so that the kernel graded in the simulator is the one a GPU runs.
    Skips, with the reason, where this machine cannot compile."""
    import pytest

    from autograder.grading.submission import not_implemented_yet

    if "unavailable" in compiled:
        pytest.skip(f"cannot compile for a GPU here: {compiled['unavailable']}")
    if "not_implemented" in compiled:  # the code that makes the kernels is a stub
        raise not_implemented_yet(compiled["not_implemented"])
    result = compiled["kernels"][name]
    if "not_implemented" in result:
        raise not_implemented_yet(result["not_implemented"])
    failure = compile_failure(compiled, name, note)
    if failure:
        raise AssertionError(failure)
    failure = missing_work(compiled, name, shows)
    if failure:
        raise AssertionError(failure)
    if metrics is not None:
        rows = metrics.setdefault(PTXAS_METRICS, {})
        for target, outcome in result.items():
            arch, _, variant = target.partition(" ")
            rows.setdefault(f"{name} {variant}".strip(), {})[arch] = {k: outcome[k] for k in RESOURCES}
    return None


def run_cases(start_job, cases, ranks, merge, *, stem=str, name=str, explain=None, after_hang=None,
              counted=None) -> dict:
    """``{name(case): outcome}`` for every case, on ``ranks`` processes (or
    ``ranks(case)``, the ranks that save a record of it), in as few jobs as it can.

    Starting processes (MPI ranks, torch workers) is the slow part on a small
    machine, so one job runs many cases. ``start_job(pending, folder)`` starts
    it (``course.mpi.run`` or ``course.dist.run``) and returns the job; each
    rank takes the pending cases in order and saves its record of each with
    ``save_record(folder, stem(case), rank, record)`` as soon as it is done.
    ``merge(records)`` turns the ranks' records of a case into its outcome.

    When a job ends early, the first case that some rank did not finish is the
    one that hung or raised: it gets the job's status and ``explain(job)``, and
    the cases after it run again in a new job. ``after_hang(case, pending)``
    lists pending cases not worth running once ``case`` hung (each hang costs
    an idle stop, or a whole timeout if it spins); they are reported as not run.

    ``counted``: the phases of each case its ranks mark (``course.wire.mark(f"{name}:
    {phase}")``, after ``f"{name}:start"``) in jobs started with ``count_wire=True``;
    each outcome then holds ``"wire"``, the bytes that crossed in each phase
    (``autograder.grading.traffic.crossed_in_phases``).
    """
    import pickle
    import shutil
    import tempfile
    from pathlib import Path

    explain = explain or (lambda job: job.explain())
    outcomes, pending, jobs = {}, list(cases), []
    while pending:
        folder = tempfile.mkdtemp(prefix="k2c-cases-")
        try:
            job = start_job(pending, folder)
            jobs.append(job)
            rest = []
            for case in pending:
                files = [Path(folder) / f"{stem(case)}.{rank}.pkl"
                         for rank in range(ranks(case) if callable(ranks) else ranks)]
                if all(f.exists() for f in files):
                    outcomes[name(case)] = merge([pickle.loads(f.read_bytes()) for f in files])
                else:
                    rest.append(case)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if not rest:
            break
        failed, pending = rest[0], rest[1:]
        status = job.status if job.status in ("timeout", "raised", "not_implemented") else "crashed"
        outcomes[name(failed)] = {"status": status, "message": explain(job)}
        if status == "timeout" and after_hang:
            skipped = after_hang(failed, pending)
            for case in skipped:
                outcomes[name(case)] = {"status": "timeout", "message": f"not run: {name(failed)} hung first"}
            pending = [case for case in pending if case not in skipped]
    if counted:
        from autograder.grading.traffic import crossed_in_phases

        for key, outcome in outcomes.items():
            outcome["wire"] = crossed_in_phases(jobs, key, counted)
    return outcomes


def first_failure(records):
    """The first rank record of a case that is not ``ok``, as ``{"status", "message"}``;
    None when every rank's is ok. The head of a ``merge`` for ``run_cases``."""
    for record in records:
        if record["status"] != "ok":
            return {"status": record["status"], "message": record["message"]}
    return None


def rank_records(records) -> dict:
    """The plainest ``merge`` for ``run_cases``: the first failure, else every rank's record."""
    return first_failure(records) or {"status": "ok", "ranks": records}


def save_record(folder, stem, rank, record) -> None:
    """A rank's record of one case, for ``run_cases``: written whole or not at
    all (a job stopped at its timeout may kill the rank at any moment)."""
    import pickle
    from pathlib import Path

    path = Path(folder) / f"{stem}.{rank}.pkl"
    path.with_suffix(".tmp").write_bytes(pickle.dumps(record))
    path.with_suffix(".tmp").rename(path)


def load_beside(check_file: str, name: str):
    """The module ``name`` (``name.py``) in the folder of ``check_file``: a lab's own
    oracles, which its check file imports. Checks are imported by path, so their
    folder is not on ``sys.path``."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(check_file).with_name(f"{name}.py")
    key = f"k2c_checks_{path.parent.name.replace('-', '_')}_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[key] = module
    return sys.modules[key]


def load_hidden_beside(check_file: str, name: str):
    """The hidden module ``name`` beside ``check_file`` (a ``*_hidden.py`` of lab.toml's
    ``hidden``), or None where it is not there: in the student repository, which ``k2c
    release`` writes without it. A public check grades with it what only the hidden oracles
    can answer (cases drawn from the grading's seed) wherever the instructor grades, and
    says, where it is None, that the student's own grading does not grade those. The
    release lets a public check name a hidden module only through this function."""
    from pathlib import Path

    if not name.endswith("_hidden"):
        raise ValueError(f"load_hidden_beside loads a hidden module (*_hidden), not {name!r}: use load_beside")
    return load_beside(check_file, name) if Path(check_file).with_name(f"{name}.py").is_file() else None


def plain(value, tuples=True):
    """A student's value as plain data the codec carries (None, bools, numbers,
    str, lists, tuples, dicts with str keys): numpy and torch scalars become
    Python numbers, anything else its repr. ``tuples=False`` turns tuples into
    lists, for answers that a check reads as lists either way."""
    import numbers

    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, tuple) and tuples:
        return tuple(plain(v, tuples) for v in value)
    if isinstance(value, (list, tuple)):
        return [plain(v, tuples) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v, tuples) for k, v in value.items()}
    try:  # a 0-d tensor or array
        return float(value)
    except (TypeError, ValueError):
        return repr(value)[:200]


class TooLong(BaseException):
    """Raised by ``within`` when time is up; a BaseException, so that student code's
    own ``except Exception`` does not swallow it."""


def within(seconds, function, *args):
    """``function(*args)``, stopped with ``TooLong`` after ``seconds`` (a student's
    function that loops forever costs its own query only). Runs unguarded where no
    timer signal can be set (not the main thread)."""
    import signal

    def stop(*_):
        raise TooLong()
    try:
        previous = signal.signal(signal.SIGALRM, stop)
    except ValueError:  # not the main thread
        return function(*args)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return function(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

