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
    """What numba made of the function's ``prange`` loops: ``{"loops": how many it made
    parallel (0: none; -1: not compiled with ``@njit(parallel=True)``), "reads": the
    function's arguments those loops index}``.

    Only loops written with ``prange`` count: under ``parallel=True`` numba also
    parallelises whole-array NumPy (``np.zeros``, ``a.sum(axis=0)``), which a
    function with every loop a plain ``range`` still has. Which arguments a parallel
    loop's body reads (``x[i]``, through any plain alias) says whether the work happens
    in it, or the loop only copies what whole-array NumPy computed before it.
    """
    from numba.core import ir

    fn = _function(name)
    fn(*args)  # compile for these argument types
    if not getattr(fn, "targetoptions", {}).get("parallel"):
        return {"loops": -1, "reads": []}
    diagnostics = fn.get_metadata(fn.signatures[-1]).get("parfor_diagnostics")
    if diagnostics is None:
        return {"loops": 0, "reads": []}
    arguments = set(diagnostics.func_ir.arg_names)
    aliases = {}  # variable -> the argument it is, through plain assignments and SSA's renamings
    for block in diagnostics.func_ir.blocks.values():
        for stmt in block.body:
            if isinstance(stmt, ir.Assign) and isinstance(stmt.value, (ir.Var, ir.Arg)):
                source = stmt.value.name
                aliases[stmt.target.name] = aliases.get(source, source)
    loops, reads = 0, set()
    for parfor in diagnostics.initial_parfors:
        if not any(isinstance(pattern, tuple) and pattern and pattern[0] == "prange" for pattern in parfor.patterns):
            continue
        loops += 1
        for block in parfor.loop_body.values():
            for stmt in block.body:
                if isinstance(stmt, ir.Assign) and isinstance(stmt.value, ir.Expr) \
                        and stmt.value.op in ("getitem", "static_getitem"):
                    var = stmt.value.value.name
                    origin = aliases.get(var, var).split(".")[0]
                    if origin in arguments:
                        reads.add(origin)
    return {"loops": loops, "reads": sorted(reads)}


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
