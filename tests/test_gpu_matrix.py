"""The compile table in the reports (text, JSON, Gradescope) and the GPU tables of the docs
(docs/gpus.md: the support matrix, the numba-cuda internals, the compile matrix)."""
import json
import re

import pytest

from conftest import REPO, load_check_file

ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")


def _resources(registers, shared=0, spills=0):
    return {"ok": True, "registers": registers, "shared_bytes": shared, "spill_bytes": spills, "stack_bytes": 0,
            "seconds": 0.01}


def _compiled_check(name, compiled):
    """A passing compile check of ``name``, its metrics filled as ``expect_compiled`` fills them."""
    from autograder.grading.checking import expect_compiled
    from autograder.grading.plugin import CheckResult

    metrics = {}
    expect_compiled(compiled, name, metrics)
    return CheckResult(f"compiles_for_a_gpu[{name}]", f"compiles for every GPU [{name}]", 1, 1, "passed", "", 0.3,
                       metrics)


@pytest.fixture
def graded():
    """Lab 02 with two compiled kernels, a CuPy kernel's float and double, and a ratio."""
    from autograder.grading.plugin import CheckResult
    from autograder.grading.runner import LabResult

    relu = {"kernels": {"relu_kernel": {a: _resources(18 - (a == "sm_90") * 2) for a in ARCHS}}}
    matmul = {"kernels": {"tiled_matmul_kernel": {a: _resources(32 + (a == "sm_75") * 13, 2048) for a in ARCHS}}}
    cupy = {"kernels": {"k2c_bias_gelu": {f"{a} {p}": _resources(36 if p == "float" else 30)
                                          for p in ("float", "double") for a in ARCHS}}}
    checks = [_compiled_check("relu_kernel", relu), _compiled_check("tiled_matmul_kernel", matmul),
              _compiled_check("k2c_bias_gelu", cupy),
              CheckResult("saxpy_bandwidth", "saxpy streams", 3, 3, "passed", "", 1.0, {"ratio": 0.91})]
    return LabResult("02-cuda-model", "The CUDA programming model", "cpu", "/submission", checks, 3.5,
                     {"layer": "bubblewrap", "user": "nobody (uid 65534)"}, "ab" * 32)


def test_a_compile_check_puts_one_row_per_kernel_into_its_metrics(graded):
    rows = graded.checks[0].metrics["ptxas"]
    assert list(rows) == ["relu_kernel"] and list(rows["relu_kernel"]) == list(ARCHS)
    assert rows["relu_kernel"]["sm_90"] == {"registers": 16, "shared_bytes": 0, "spill_bytes": 0}
    assert list(graded.checks[2].metrics["ptxas"]) == ["k2c_bias_gelu float", "k2c_bias_gelu double"]


def test_the_text_report_shows_a_line_per_kernel_with_the_architectures_as_columns(graded):
    from autograder.grading import report

    text = report.text([graded])
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["kernel"])
    assert lines[header].split() == ["kernel", *ARCHS]
    assert "registers per thread / shared memory per block (bytes) / spills (bytes)" in lines[header - 1]
    table = [line.split() for line in lines[header + 1:header + 5]]
    assert table[0] == ["relu_kernel", *(["18/0/0"] * 4), "16/0/0", "18/0/0", "18/0/0"]
    assert table[1] == ["tiled_matmul_kernel", "45/2048/0", *(["32/2048/0"] * 6)]
    assert table[2][:2] == ["k2c_bias_gelu", "float"] and table[3][:3] == ["k2c_bias_gelu", "double", "30/0/0"]
    assert max(len(line) for line in lines[header - 1:header + 5]) <= 120
    assert "registers 18" not in text and "measured: ratio 0.91" in text  # the table alone, other measurements kept
    assert lines[header + 5].startswith("  Score:")


def test_the_json_and_gradescope_reports_carry_the_table(graded):
    from autograder.grading import report

    lab = json.loads(report.as_json([graded]))
    assert lab["compiled"]["tiled_matmul_kernel"]["sm_75"] == {"registers": 45, "shared_bytes": 2048,
                                                               "spill_bytes": 0}
    assert list(lab["compiled"]) == ["relu_kernel", "tiled_matmul_kernel", "k2c_bias_gelu float",
                                     "k2c_bias_gelu double"]
    assert lab["tests"][0]["metrics"]["ptxas"]["relu_kernel"]["sm_120"]["registers"] == 18
    tests = json.loads(report.gradescope([graded]))["tests"]
    assert "relu_kernel" in tests[0]["output"] and "sm_120" in tests[0]["output"]
    assert "measured: ratio 0.91" in tests[3]["output"]


def test_the_docs_support_matrix_and_internals_are_what_the_code_says():
    """docs/gpu-results/*.md are written by scripts/compile_matrix.py: rerun it when they differ."""
    from autograder import gpu_matrix

    folder = REPO / "docs" / "gpu-results"
    assert (folder / "support-matrix.md").read_text() == gpu_matrix.support_matrix()
    assert (folder / "numba-internals.md").read_text() == gpu_matrix.internals_table()


def test_the_docs_compile_matrix_covers_every_target_and_every_compiled_kernel():
    """Its numbers come from a grading (scripts/compile_matrix.py); its rows and columns must
    be the compile checks' kernels and today's targets."""
    from course import gpu_compile

    text = (REPO / "docs" / "gpu-results" / "compile-matrix.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| lab | kernel |"))
    assert [cell.strip() for cell in header.strip("|").split("|")][2:] == [gpu_compile.sm(cc)
                                                                          for cc in gpu_compile.TARGETS]
    rows = re.findall(r"^\| (\d\d) \| `([^`]+)` \|", text, re.M)
    kernels = [("02", k) for k in load_check_file("02-cuda-model", "check_cuda_basics").SIGNATURES]
    kernels += [("03", k) for k in load_check_file("03-shared-memory", "check_shared_kernels").SIGNATURES]
    assert rows == kernels + [("04", "k2c_bias_gelu float"), ("04", "k2c_bias_gelu double")]


def test_the_gpus_page_includes_the_tables_and_is_in_the_toctree():
    page = (REPO / "docs" / "gpus.md").read_text()
    for table in ("support-matrix.md", "compile-matrix.md", "numba-internals.md"):
        assert f"```{{include}} gpu-results/{table}" in page
    assert "\ngpus\n" in (REPO / "docs" / "index.md").read_text()
