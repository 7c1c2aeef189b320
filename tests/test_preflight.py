"""The GPU tier's preflight (autograder.grading.preflight): one tiny kernel through each
stack a lab runs on the device, before any check. No GPU here: stand-ins for torch, CuPy
and numba.cuda raise what each library really raises on a card its build has no kernels
for, so the path from the failed kernel to exit 2 runs before a GPU does."""
import json
import types
import warnings

import pytest

from conftest import REPO

P100 = {"name": "Tesla P100-PCIE-16GB", "cc": [6, 0], "driver": "13.0"}
T4 = {"name": "Tesla T4", "cc": [7, 5], "driver": "12.4"}
# What the libraries print for cudaErrorNoKernelImageForDevice (runtime) and
# CUDA_ERROR_NO_BINARY_FOR_GPU (driver): cudaGetErrorString / cuGetErrorString's words.
NO_IMAGE = "no kernel image is available for execution on the device"


class AcceleratorError(RuntimeError):
    """torch's, since 2.9: CUDA errors of kernels raise it."""


class CUDARuntimeError(RuntimeError):
    """CuPy's: '%s: %s' % (cudaGetErrorName, cudaGetErrorString)."""


class CudaAPIError(Exception):
    """numba-cuda's: '[%s] %s' % (code, 'Call to <function> results in <name>')."""


def fake_torch(fails=True, arch_list=("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")):
    torch = types.SimpleNamespace(__version__="2.13.0+cu130", version=types.SimpleNamespace(cuda="13.0"))

    class Tensor:
        def __init__(self, value):
            self.value = value

        def __add__(self, other):
            return Tensor(self.value + other)

        def __matmul__(self, other):
            return Tensor(self.value * 32)

        def __getitem__(self, index):
            return self

        def sum(self):
            return Tensor(self.value * 32)

        def __float__(self):
            return float(self.value)

    def ones(*shape, device=None):
        if fails:
            warnings.warn("Found GPU0 Tesla P100-PCIE-16GB which is of compute capability (CC) 6.0.\n"
                          "The following list shows the CCs this version of PyTorch was built for and the hardware "
                          "CCs it supports:\n- 7.5 which supports hardware CC >=7.5")
            raise AcceleratorError(f"CUDA error: {NO_IMAGE}\nCUDA kernel errors might be asynchronously reported "
                                   "at some other API call, so the stacktrace below might be incorrect.\n"
                                   "For debugging consider passing CUDA_LAUNCH_BLOCKING=1")
        return Tensor(1.0)

    torch.ones = ones
    torch.cuda = types.SimpleNamespace(get_arch_list=lambda: list(arch_list), synchronize=lambda: None)
    return torch


def fake_cupy():
    def kernel(*args, **kwargs):
        def launch(x):
            raise CUDARuntimeError(f"cudaErrorNoKernelImageForDevice: {NO_IMAGE}")
        return launch

    return types.SimpleNamespace(
        __version__="14.2.0", float32="float32", ElementwiseKernel=kernel, zeros=lambda n, dtype: None, ones=None,
        cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(runtimeGetVersion=lambda: 13000)))


def fake_numba_cuda(error):
    class Launcher:
        def __getitem__(self, config):
            def launch(*args):
                raise error
            return launch

    return types.SimpleNamespace(jit=lambda f: Launcher(), to_device=lambda a: a, grid=lambda n: 0)


@pytest.fixture
def fresh(monkeypatch):
    """No stack proven yet in this process."""
    from autograder.grading import preflight

    monkeypatch.setattr(preflight, "_proven", set())
    return preflight


def probe_with(modules, device):
    """A probe that runs the real stack probes against stand-in libraries on a named card."""
    from autograder.sandbox import stack_probes

    def probe(stacks, layer):
        found = stack_probes.device_kernels(stacks, modules)
        found["device"] = device  # the driver's answer on that card
        return found
    return probe


def lab(number):
    from autograder.grading.labs import find_lab

    return find_lab(number)


def test_torch_without_kernels_for_the_card_is_an_infrastructure_error_naming_the_card_and_build(fresh):
    from autograder.grading.runner import IncompleteEnvironment

    with pytest.raises(IncompleteEnvironment) as raised:
        fresh.preflight([lab("07")], probe=probe_with({"torch": fake_torch()}, P100))
    message = str(raised.value)
    assert "the GPU tier cannot grade 07-training-memory here" in message
    assert "no kernels for Tesla P100-PCIE-16GB (compute capability 6.0, sm_60)" in message
    assert "torch 2.13.0+cu130 for CUDA 13.0, with kernels for sm_75 sm_80 sm_86 sm_90 sm_100 sm_120" in message
    assert f"AcceleratorError: CUDA error: {NO_IMAGE}" in message
    assert "The course does not support sm_60 (P100)" in message  # below the floor: ARCHITECTURES says why
    assert "No check ran" in message and "--tier cpu" in message
    assert "torch" not in fresh._proven


def test_cupy_and_numba_without_kernels_for_the_card_are_named_one_by_one(fresh):
    from autograder.grading.runner import IncompleteEnvironment

    numba = fake_numba_cuda(CudaAPIError("[<CUresult.CUDA_ERROR_NO_BINARY_FOR_GPU: 209>] Call to cuLibraryLoadData "
                                         "results in CUDA_ERROR_NO_BINARY_FOR_GPU"))
    with pytest.raises(IncompleteEnvironment) as raised:
        fresh.preflight([lab("03")], probe=probe_with({"numba.cuda": numba, "cupy": fake_cupy()}, T4))
    message = str(raised.value)
    assert message.count("the GPU tier cannot grade 03-shared-memory here") == 2  # numba, then CuPy
    assert "the installed numba.cuda has no kernels for Tesla T4 (compute capability 7.5, sm_75)" in message
    assert "CUDA_ERROR_NO_BINARY_FOR_GPU" in message and "numba-cuda 0.30.4, compiling with NVRTC" in message
    assert "the installed CuPy has no kernels for Tesla T4" in message
    assert "CuPy 14.2.0 for CUDA 13.0" in message and "cudaErrorNoKernelImageForDevice" in message
    assert "does not support sm_75" not in message  # T4 is supported: the build is at fault


def test_a_driver_older_than_the_build_and_a_missing_library_are_told_apart(fresh):
    from autograder.grading.runner import IncompleteEnvironment

    numba = fake_numba_cuda(CudaAPIError("[<CUresult.CUDA_ERROR_UNSUPPORTED_PTX_VERSION: 222>] Call to "
                                         "cuLinkAddData results in CUDA_ERROR_UNSUPPORTED_PTX_VERSION"))
    with pytest.raises(IncompleteEnvironment) as raised:  # CuPy is not installed here: its import fails for real
        fresh.preflight([lab("03")], probe=probe_with({"numba.cuda": numba}, T4))
    message = str(raised.value)
    assert "driver 12.4 is older than the installed numba.cuda needs on Tesla T4" in message
    assert "runs CuPy on the GPU, and it does not import here: ModuleNotFoundError" in message
    assert "pip install 'k2c[gpu]'" in message


def test_stacks_that_run_their_kernel_pass_once_per_process(fresh):
    calls = []
    working = probe_with({"torch": fake_torch(fails=False)}, T4)

    def probe(stacks, layer):
        calls.append(stacks)
        return working(stacks, layer)

    fresh.preflight([lab("07"), lab("12")], probe=probe)
    fresh.preflight([lab("12")], probe=probe)  # a later grading in the same process
    fresh.preflight([lab("05")], probe=probe)  # nothing of lab 05 runs on a GPU
    assert calls == [["torch"]] and fresh._proven == {"torch"}


def test_the_labs_say_what_they_run_on_the_device():
    from autograder.grading.labs import all_labs
    from autograder.sandbox.stack_probes import DEVICE_STACKS

    stacks = {lab.number: lab.device_stacks for lab in all_labs() if lab.device_stacks}
    assert stacks == {"02": ("numba",), "03": ("numba", "cupy"), "04": ("numba", "cupy", "torch"),
                      "07": ("torch",), "12": ("torch",)}
    assert all(set(s) <= set(DEVICE_STACKS) for s in stacks.values())


def test_k2c_grade_on_the_gpu_tier_stops_with_exit_2_before_any_check(fresh, monkeypatch, tmp_path, capsys):
    """The whole path: k2c grade --tier gpu, a card the installed torch has no kernels for,
    exit 2 and a results file that says why, with no score."""
    from autograder import cli
    from autograder.grading import runner

    monkeypatch.setattr(runner, "resolve_tier", lambda requested: requested)  # as on a machine with a GPU
    monkeypatch.setattr(fresh, "probe_in_sandbox", probe_with({"torch": fake_torch()}, P100))
    out = tmp_path / "results.json"
    code = cli.main(["grade", "07", "--submission", str(REPO / "solutions"), "--tier", "gpu", "--format", "json",
                     "-o", str(out)])
    assert code == cli.EXIT_USAGE
    report = json.loads(out.read_text())
    assert report["tests"] == [] and report["max_score"] == 0
    assert "no kernels for Tesla P100-PCIE-16GB (compute capability 6.0, sm_60)" in report["error"]
    assert "grading 07" not in capsys.readouterr().err  # stopped before the lab's checks began


@pytest.mark.parametrize("text, kind", [
    (f"AcceleratorError: CUDA error: {NO_IMAGE}", "no_kernel_image"),
    (f"CUDADriverError: CUDA_ERROR_NO_BINARY_FOR_GPU: {NO_IMAGE}", "no_kernel_image"),
    ("CCSupportError: GPU compute capability 6.0 is not supported(requires >=7.5)", "no_kernel_image"),
    ("CompileException: nvrtc: error: invalid value for --gpu-architecture (-arch)", "no_kernel_image"),
    ("CUDARuntimeError: cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version",
     "driver"),
    ("OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB", "other"),
])
def test_what_each_library_says_is_read_as_the_kind_of_failure_it_is(text, kind):
    from autograder.grading.preflight import kind_of_failure

    assert kind_of_failure(text) == kind


def test_a_gpu_node_whose_cuda_compilers_come_from_its_toolkit_still_grades(monkeypatch):
    """A cluster's GPU node (or the course's own GPU image) often has NVVM and ptxas from a CUDA
    toolkit, not from the pinned wheels: the lab still grades there (its compile checks find the
    toolkit, or skip saying why), and the readiness proof does not import wheels that are absent.
    A missing numba-cuda still stops grading."""
    from autograder.grading import runner

    absent = set(runner.COMPILER_WHEELS)
    monkeypatch.setattr(runner, "_installed", lambda dist: dist not in absent)
    assert runner.missing_stack(lab("02")) == ""
    proven = {}
    monkeypatch.setattr("autograder.sandbox.readiness.prove", lambda layer, modules: proven.update(modules=modules))
    monkeypatch.setattr(runner.isolation, "detect", lambda: "a layer")
    runner.proven_layer([lab("02")])
    assert "numba.cuda" in proven["modules"] and "nvidia.cu13" not in proven["modules"], proven
    absent.add("numba-cuda")
    assert "lab 02-cuda-model needs numba-cuda, which this environment lacks" in runner.missing_stack(lab("02"))
