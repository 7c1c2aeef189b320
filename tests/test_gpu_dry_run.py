"""The GPU tier's dry run on the CPU tier (`k2c grade --dry-run-gpu`): every GPU-tier check of
labs 02-04, and lab 12's speed check, runs its harness functions, course.gpu_timing and its judge at tiny
sizes on the stand-ins of course.gpu_stand_in (the kernels in numba's simulator, lab 12's torch on the
CPU), lab 07's check its training step on the CPU with a stand-in for torch.cuda's memory calls (its
oracles.py), and each is reported as
skipped, awarding nothing; scripts/gpu_table.py makes its table from the dry run's JSON."""
import json
import subprocess
import sys

import pytest

from autograder.grading.labs import UsageError, find_lab
from autograder.grading.plugin import DRY_RUN_FAILED, DRY_RUN_PASSED
from autograder.grading.runner import grade, list_checks
from conftest import REPO, k2c, load_check_file

pytestmark = pytest.mark.xdist_group("gpu-dry-run")  # one worker grades the dry run once (a module fixture)
LABS = ("02-cuda-model", "03-shared-memory", "04-cupy-streams", "07-training-memory", "12-context-parallel")


def gpu_checks(slug) -> set[str]:
    return {c.name for c in list_checks(find_lab(slug)) if c.gpu}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """Labs 02-04's, 07's and 12's references, their GPU checks only, dry run: (the JSON report, its path,
    the process, which printed the text report)."""
    wanted = {slug: gpu_checks(slug) for slug in LABS}
    out = tmp_path_factory.mktemp("dry-run") / "gpu-dry-run.json"
    proc = k2c("grade", ",".join(s[:2] for s in LABS), "--submission", REPO / "solutions", "--dry-run-gpu",
               "-k", " or ".join(sorted({n.split("[")[0] for names in wanted.values() for n in names})),
               "--format", "json", "-o", out, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), out, proc, wanted


def test_every_gpu_check_of_labs_02_to_04_07_and_12_passes_its_dry_run_and_awards_nothing(dry_run):
    report, _, proc, wanted = dry_run
    assert [lab["lab"] for lab in report["labs"]] == list(LABS)
    assert report["score"] == report["max_score"] == 0
    for lab in report["labs"]:
        assert lab["gpu_dry_run"] is True and lab["tier"] == "cpu"
        assert {t["name"] for t in lab["tests"]} == wanted[lab["lab"]] and len(wanted[lab["lab"]]) >= 1
        for t in lab["tests"]:
            assert (t["status"], t["points"], t["feedback"]) == ("skipped", 0, DRY_RUN_PASSED), (lab["lab"], t)
    timed_checks = [t for lab in report["labs"] for t in lab["tests"] if "record" in t.get("metrics", {})]
    assert {t["name"] for t in timed_checks} == {
        "saxpy_bandwidth", "reduce_speed", "matmul_speed", "histogram_speed", "fused_faster_than_unfused",
        "pipeline_overlap_speedup", "roofline_measured", "blockwise_attention_speed"}
    for t in timed_checks:
        metrics = t["metrics"]
        assert metrics["record"]["stand_in"] is True and metrics["record"]["libraries"]["numba"]
        assert "timed runs after 1 warm-up (new inputs, L2 flushed and output checked every run" in metrics["measured"]
        assert "floor " in metrics["measured"] and any(k.endswith("_floor_ms") for k in metrics)
    assert "GPU checks as a dry run on stand-ins (they award nothing)" in proc.stdout
    assert proc.stdout.count(DRY_RUN_PASSED) == sum(len(names) for names in wanted.values())


def test_the_gpu_result_table_is_made_from_a_dry_runs_json(dry_run):
    _, path, _, wanted = dry_run
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_table.py"), str(path)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout
    assert table.startswith("CPU tier on `solutions/`") and "**A dry run**" in table
    assert "Device: stand-in device (CPU tier dry run: nothing here ran on a GPU) (sm_90" in table
    rows = [line for line in table.splitlines() if line.startswith(("| 0", "| 12"))]
    assert len(rows) == sum(len(names) for names in wanted.values())
    assert all(f"| skipped: {DRY_RUN_PASSED} | 0/" in row for row in rows)
    saxpy = next(row for row in rows if "saxpy_kernel streams" in row)
    assert "ratio " in saxpy and "saxpy_floor_ms " in saxpy and "record" not in saxpy
    assert "02-cuda-model: 0/0" in table


def test_a_failing_dry_run_is_reported_skipped_with_its_reason(make_submission):
    """A saxpy_kernel that leaves most of the output unwritten: the dry run's recheck of the
    first timed run finds it, and the check still awards nothing (skipped, not failed)."""
    folder = make_submission("02-cuda-model", "cuda_basics.py", [(
        "    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x\n", "    i = cuda.threadIdx.x\n")])
    proc = k2c("grade", "02", "--submission", folder, "--dry-run-gpu", "-k", "saxpy_bandwidth", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    (check,) = json.loads(proc.stdout)["tests"]
    assert (check["status"], check["points"]) == ("skipped", 0)
    assert check["feedback"].startswith(DRY_RUN_FAILED + "saxpy_kernel: the output of timed run 1 of 2 is wrong: at")


def test_a_dry_run_is_for_the_cpu_tier_only():
    with pytest.raises(UsageError, match="a dry run of the GPU tier runs on the CPU tier"):
        grade(find_lab("02"), REPO / "solutions", "gpu", dry_run_gpu=True)


def test_the_spin_kernel_of_lab_04s_pipeline_compiles_with_nvrtc():
    """The dry run builds the harness's own ElementwiseKernel for the host; NVRTC compiles it
    for the GPU targets here, as CuPy will on the first GPU run."""
    from course import gpu_compile

    if gpu_compile.nvrtc_unavailable():
        pytest.skip(gpu_compile.nvrtc_unavailable())
    harness = load_check_file("04-cupy-streams", "harness")
    (kernel,) = gpu_compile.capture_cupy_kernels(harness._spin_kernel)
    harness._SPIN = None
    for placeholder in ("float", "double"):
        results = gpu_compile.compile_cuda_c_for_targets(gpu_compile.elementwise_source(kernel, placeholder))
        assert len(results) == len(gpu_compile.TARGETS) and all(r["ok"] for r in results.values()), results


def test_gpu_checks_without_a_dry_run_stay_skipped_saying_so():
    """A GPU check that does not take the gpu_dry_run fixture does not
    know its tiny sizes: a dry run leaves it skipped, and says it has no dry run."""
    from autograder.grading.plugin import GradingPlugin

    class Check:
        def __init__(self, *fixtures):
            self.fixturenames, self.added = fixtures, []

        def get_closest_marker(self, name):
            return name == "gpu" or None

        def add_marker(self, mark):
            self.added.append(mark)

    knows, does_not = Check("submission", "gpu_dry_run"), Check("submission", "metrics")
    GradingPlugin(None, "cpu", dry_run_gpu=True).pytest_collection_modifyitems([knows, does_not])
    assert knows.added == []
    assert [m.kwargs["reason"] for m in does_not.added] == [
        "needs a CUDA GPU (GPU tier); this run is CPU tier; it has no dry run"]
    plain = Check("submission", "gpu_dry_run")
    GradingPlugin(None, "cpu").pytest_collection_modifyitems([plain])
    assert [m.kwargs["reason"] for m in plain.added] == ["needs a CUDA GPU (GPU tier); this run is CPU tier"]
