"""course.numba_internals: every internal of numba-cuda (and CuPy) the course replaces or
relies on, listed with the version it was written for. numba-cuda is in maintenance mode;
the day the installed version differs from the pin, these tests say what to check."""
import re

from conftest import REPO


def test_the_installed_numba_cuda_is_the_version_every_internal_was_written_for():
    from course import numba_internals

    mismatches = numba_internals.version_mismatches()
    assert not mismatches, "\n".join(mismatches)


def test_a_new_version_names_each_internal_what_to_check_and_the_pin_to_move():
    from course import numba_internals

    lines = numba_internals.version_mismatches(numba_cuda="0.31.0", cupy="")
    assert len(lines) == sum(item.package == "numba-cuda" for item in numba_internals.INTERNALS)
    assert ("numba-cuda 0.31.0 is installed; course.cuda_sim.install replaces "
            "numba.cuda.simulator.kernel.BlockThread.run, written for 0.30.4: check ") in "\n".join(lines)
    assert all(line.endswith("then update pyproject.toml's numba-cuda pin and course/numba_internals.py's "
                             "WRITTEN_FOR") for line in lines)
    cupy = numba_internals.version_mismatches(numba_cuda=numba_internals.WRITTEN_FOR, cupy="15.0.0")
    assert cupy and all(line.startswith("CuPy 15.0.0 is installed; course.gpu_compile.capture_cupy_kernels relies "
                                        "on cupy.") for line in cupy)


def test_every_listed_internal_is_in_the_installed_numba_cuda(monkeypatch):
    """Resolved in a process with the simulator off, where numba.cuda is the real one."""
    import json
    import os
    import subprocess
    import sys

    from course import numba_internals

    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", "import json; from course import numba_internals as n; "
                           "print(json.dumps(n.missing_internals()))"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == []
    made_up = (numba_internals.Internal("course.x", "numba.cuda.simulator.kernel.BlockThread.gone", "replaces", "", ""),
               numba_internals.Internal("course.x", "numba.cuda.simulator.kernel.BlockThread.run", "replaces", "", "",
                                        ("_no_such_attribute",)))
    monkeypatch.setattr(numba_internals, "INTERNALS", made_up)
    missing = numba_internals.missing_internals()
    assert len(missing) == 2 and "BlockThread.gone" in missing[0] and "self._no_such_attribute" in missing[1], missing


def test_pyproject_pins_the_numba_cuda_the_internals_were_written_for():
    from course import numba_internals

    pin = re.search(r'"numba-cuda==([^;"]+)', (REPO / "pyproject.toml").read_text()).group(1).strip()
    assert pin == numba_internals.WRITTEN_FOR


def test_every_file_that_reaches_into_numba_cuda_is_listed():
    """Code that imports numba-cuda's modules beyond ``from numba import cuda`` uses its
    internals: each such file is an owner in INTERNALS, so nothing is left off the list."""
    import ast

    from course import numba_internals

    internal = re.compile(r"numba\.cuda\.(simulator|compiler|dispatcher|codegen|cudadrv|memory_management|errors|np)"
                          r"\b|numba\.cuda$")

    def reaches(path):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(internal.match(a.name) and a.name != "numba.cuda"
                                                    for a in node.names):
                return True
            if isinstance(node, ast.ImportFrom) and node.module and internal.match(node.module) and (
                    node.module != "numba.cuda" or any(internal.match(f"numba.cuda.{a.name}") for a in node.names)):
                return True
        return False

    owners = {item.owner for item in numba_internals.INTERNALS}
    unlisted = []
    for path in sorted([*(REPO / "course").glob("*.py"), *(REPO / "autograder").rglob("*.py")]):
        relative = path.relative_to(REPO).as_posix()
        module = relative.removesuffix(".py").replace("/", ".")
        if module == "course.numba_internals" or not reaches(path):
            continue
        if not any(owner == relative or owner == module or owner.startswith(module + ".") for owner in owners):
            unlisted.append(relative)
    assert not unlisted, f"list what these use of numba-cuda's internals in course/numba_internals.py: {unlisted}"
