"""Grader code that runs next to the student's ``cpu_parallel`` in the sandbox."""


def _function(name):
    import cpu_parallel
    return getattr(cpu_parallel, name)


def call_repeatedly(name, times, *args):
    """Call a function several times on the same input: a race shows up as
    answers that differ from run to run, or from the oracle."""
    fn = _function(name)
    return [fn(*args) for _ in range(times)]


def parallel_loops(name, *args):
    """How many parallel loops numba made of the function (0: it runs serially).

    Returns -1 when the function is not compiled with ``@njit(parallel=True)``.
    """
    fn = _function(name)
    fn(*args)  # compile for these argument types
    if not getattr(fn, "targetoptions", {}).get("parallel"):
        return -1
    diagnostics = fn.get_metadata(fn.signatures[-1]).get("parfor_diagnostics")
    return len(diagnostics.initial_parfors) if diagnostics is not None else 0


def races(name, *args):
    """Races in the function's prange loops, found by recording which iteration
    touches which element (``course.races``): deterministic, unlike a timed run."""
    from course.races import find_races
    return find_races(_function(name), *args)
