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
    """How many of the function's ``prange`` loops numba made parallel (0: none).

    Only loops written with ``prange`` count: under ``parallel=True`` numba also
    parallelises whole-array NumPy (``np.zeros``, ``a.sum(axis=0)``), which a
    function with every loop a plain ``range`` still has.
    Returns -1 when the function is not compiled with ``@njit(parallel=True)``.
    """
    fn = _function(name)
    fn(*args)  # compile for these argument types
    if not getattr(fn, "targetoptions", {}).get("parallel"):
        return -1
    diagnostics = fn.get_metadata(fn.signatures[-1]).get("parfor_diagnostics")
    if diagnostics is None:
        return 0
    return sum(1 for parfor in diagnostics.initial_parfors
               if any(isinstance(pattern, tuple) and pattern and pattern[0] == "prange" for pattern in parfor.patterns))


def histogram_runs(cases, contended, times, loop_args):
    """parallel_histogram on each case, ``times`` times on the contended input, and its
    prange loops (``parallel_loops``), all from one compile of its parallel code."""
    fn = _function("parallel_histogram")
    return {"cases": [fn(*args) for args in cases], "contended": [fn(*contended) for _ in range(times)],
            "loops": parallel_loops("parallel_histogram", *loop_args)}


def races(name, *args):
    """Races in the function's prange loops, found by recording which iteration
    touches which element (``course.races``): deterministic, unlike a timed run."""
    from course.races import find_races
    return find_races(_function(name), *args)
