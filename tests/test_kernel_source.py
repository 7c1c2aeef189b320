"""A kernel may not depend on where it runs (autograder.grading.kernel_source): read in the
grader, without running the student's code."""
from autograder.grading.kernel_source import environment_dependence

SOURCE = '''
import os
import numba
from numba import cuda, config
from course.tier import current_tier

ON_SIM = numba.config.ENABLE_CUDASIM
SIMULATED = ON_SIM or False
TIER = current_tier()
TILE = 16
settings = {"tile": 16}


@cuda.jit(device=True)
def helper(x):
    if SIMULATED:
        return 0
    return x


@cuda.jit
def via_alias(out):
    out[0] = helper(1)


@cuda.jit
def via_environ(out):
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        out[0] = 1


@cuda.jit
def via_config(out):
    out[0] = 1 if config.ENABLE_CUDASIM else 0


@cuda.jit
def via_tier(out):
    out[0] = 1 if TIER == "cpu" else 0


@cuda.jit
def honest(out, x):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = x[i] * TILE + settings["tile"]


def host(x):  # host code may ask: it is not a kernel
    return ON_SIM
'''


def test_kernels_that_ask_where_they_run_are_named_and_honest_ones_are_not(tmp_path):
    path = tmp_path / "kernels.py"
    path.write_text(SOURCE)
    assert "reads SIMULATED" in environment_dependence(path, "via_alias")  # through a device function and an alias
    assert "line 7" in environment_dependence(path, "via_alias")  # and says where SIMULATED came from
    assert "asks where it runs" in environment_dependence(path, "via_environ")
    assert environment_dependence(path, "via_config")
    assert "reads TIER" in environment_dependence(path, "via_tier")
    assert environment_dependence(path, "honest") == ""
    assert environment_dependence(path, "host") == ""
