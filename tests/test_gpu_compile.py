"""course.gpu_compile: kernels compiled for real GPUs with no GPU here, and the
compiler's complaints about simulator-only Python put in a student's words."""
import json
import os
import subprocess
import sys

from conftest import REPO

KERNELS = r'''
import json, sys
import numpy as np
from numba import cuda
from course import gpu_compile

@cuda.jit(device=True)
def twice(a):
    return a * 2.0

def plain(a):
    return a * 2.0

def with_device_function(out, x):  # needs the fixed device: the compiler asks the driver for its capability
    i = cuda.grid(1)
    if i < x.size:
        out[i] = twice(x[i])

def with_shared(out, x):
    tile = cuda.shared.array(128, np.float32)
    i = cuda.threadIdx.x
    tile[i] = x[i]
    cuda.syncthreads()
    out[i] = tile[127 - i]

def with_zeros(out, x):
    scratch = np.zeros(4)
    out[0] = scratch[0]

def with_plain_helper(out, x):
    out[0] = plain(x[0])

def with_list(out, x):
    values = []
    values.append(x[0])
    out[0] = values[0]

def with_shared_sized_at_run_time(out, x):
    tile = cuda.shared.array(x.size, np.float32)
    out[0] = tile[0]

def returning(out, x):
    return x[0]

SIGNATURE = "void(float32[:], float32[:])"


def one_compile_per_target(f):
    """What numba-cuda's own compile_ptx and ptxas make of f for each target: the
    reference that lowering once, then NVVM and ptxas per target, must agree with."""
    found = {}
    for cc in gpu_compile.TARGETS:
        with numba_internals.fixed_device(cc):
            ptx, _ = cuda.compile_ptx(f, SIGNATURE, cc=cc)
        found[gpu_compile.sm(cc)] = {k: v for k, v in gpu_compile.resources(ptx, cc).items()}
    return found


from course import numba_internals
print(json.dumps({"unavailable": gpu_compile.unavailable(), "results": {
    f.__name__: gpu_compile.compile_for_targets(f, SIGNATURE)
    for f in (with_device_function, with_shared, with_zeros, with_plain_helper, with_list,
              with_shared_sized_at_run_time, returning)},
    "per_target": {f.__name__: one_compile_per_target(f) for f in (with_device_function, with_shared)}}))
'''

ADVICE = {
    "with_zeros": "np.zeros is not available inside a CUDA kernel",
    "with_plain_helper": "plain is a plain Python function: mark it @cuda.jit(device=True)",
    "with_list": "Python lists are not available inside a CUDA kernel",
    "with_shared_sized_at_run_time": "need a size fixed when the kernel compiles",
    "returning": "a kernel cannot return a value",
}


def test_kernels_compile_for_every_supported_gpu_without_one_and_mistakes_are_explained():
    """Every architecture of TARGETS, T4's sm_75 to RTX 50xx's sm_120, from one lowering per
    kernel: what ptxas says of each equals what numba-cuda's own compile for that target gives."""
    from course import gpu_compile

    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", KERNELS], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found["unavailable"] == "", found["unavailable"]  # `make test` installs the CUDA 13.0 compilers
    results = found["results"]
    targets = [gpu_compile.sm(cc) for cc in gpu_compile.TARGETS]
    assert targets[0] == "sm_75" and len(targets) >= 7, targets
    assert all(list(by_target) == targets for by_target in results.values()), results
    for name in ("with_device_function", "with_shared"):
        for target, result in results[name].items():
            assert result["ok"] and result["registers"] > 0, (name, target, result)
            want = found["per_target"][name][target]
            assert {k: result[k] for k in want} == want, (name, target, result, want)
    assert all(t["shared_bytes"] == 128 * 4 for t in results["with_shared"].values())  # ptxas's count of the tile
    for name, advice in ADVICE.items():
        for target in results[name].values():
            assert not target["ok"] and advice in target["error"], (name, target)


def test_every_architecture_is_compiled_for_or_left_out_with_its_reason():
    """The pinned compilers build every target; an architecture left out says why, and a
    reason about the compilers stays true (the day they build it, this says to move it in)."""
    from course import gpu_compile

    assert gpu_compile.compiler_gaps() == {}, gpu_compile.compiler_gaps()
    assert set(gpu_compile.TARGETS) == {a.cc for a in gpu_compile.ARCHITECTURES if not a.left_out}
    for arch in gpu_compile.ARCHITECTURES:
        if "pinned compilers" in arch.left_out:
            assert gpu_compile.compiler_gaps([arch.cc]), (
                f"the pinned compilers now build {arch.sm}: move {arch.cards} into the compile checks")
        elif arch.left_out:
            assert "floor" in arch.left_out, arch


def test_a_target_the_compilers_here_cannot_build_skips_the_compile_checks_with_the_reason(monkeypatch):
    """A machine whose compilers lack a target the checks build for is the machine's fault:
    the compile checks skip, naming the architecture, never fail a student's kernel."""
    from course import gpu_compile

    monkeypatch.setattr(gpu_compile, "TARGETS", gpu_compile.TARGETS + ((7, 0),))  # CUDA 13 dropped Volta
    why = gpu_compile._gaps_reason()
    assert "cannot build sm_70 (ptxas and NVRTC here do not know it)" in why and "install the pinned" in why, why


def test_the_compile_checks_name_the_architectures_they_build():
    from course import gpu_compile

    span = f"{gpu_compile.sm(min(gpu_compile.TARGETS))} to {gpu_compile.sm(max(gpu_compile.TARGETS))}"
    for path in ("02-cuda-model/check_cuda_basics.py", "03-shared-memory/check_shared_kernels.py",
                 "04-cupy-streams/check_cupy_streams.py"):
        text = (REPO / "autograder" / "checks" / path).read_text()
        assert f"every GPU the course supports, {span}" in text, path


def test_compiling_in_the_simulator_is_refused_with_the_reason():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", "from course import gpu_compile; print(gpu_compile.unavailable())"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert "simulator is on" in proc.stdout, proc.stdout + proc.stderr


def test_off_linux_the_compile_checks_skip_with_the_reason(monkeypatch):
    """The compiler wheels are Linux-only (pyproject.toml's markers): on macOS a compile
    check is skipped, saying why, not failed and not passed."""
    import pytest

    import numba.core.config  # noqa: F401 - loaded as on Linux: llvmlite picks its library by sys.platform
    from autograder.grading import checking
    from course import gpu_compile

    monkeypatch.setattr(sys, "platform", "darwin")
    for why in (gpu_compile.unavailable(), gpu_compile.nvrtc_unavailable()):
        assert "Linux wheels only" in why and "darwin" in why, why
    compiled = checking.compile_kernels("math", {"sqrt": "float32(float32)"})
    assert compiled == {"unavailable": gpu_compile.unavailable()}
    with pytest.raises(pytest.skip.Exception, match="cannot compile for a GPU here: .*Linux wheels only"):
        checking.expect_compiled(compiled, "sqrt")


def test_an_elementwise_kernel_runs_on_the_host_from_its_generated_loop(tmp_path):
    import numpy as np
    import pytest

    from course import gpu_compile

    if gpu_compile.host_unavailable():
        pytest.skip(gpu_compile.host_unavailable())
    axpb = {"kind": "elementwise", "in_params": "T x, T b, float32 a", "out_params": "T y", "name": "axpb",
            "operation": "y = fmul(a, x) + __fdividef(b, 2.0f);",
            "preamble": "template <typename U> __device__ U fmul(float a, U x) { return U(a) * x; }"}
    warp = dict(axpb, operation="y = __shfl_sync(0xffffffff, x, 0);")
    sources = {"float": gpu_compile.elementwise_source(axpb, "float"),
               "double": gpu_compile.elementwise_source(axpb, "double"), "warp": gpu_compile.elementwise_source(warp)}
    built = gpu_compile.build_on_host(sources, str(tmp_path))
    assert built["float"]["ok"] and built["double"]["ok"], built
    assert not built["warp"]["ok"] and "__shfl_sync" in built["warp"]["error"]  # only a GPU has it
    x = np.arange(6, dtype=np.float64).reshape(2, 3)
    for placeholder in ("float", "double"):
        (y,) = gpu_compile.run_elementwise_on_host(axpb, built[placeholder]["library"], placeholder,
                                                   [x, np.array([2.0, 4.0, 6.0]), np.float32(3)])
        assert y.dtype == gpu_compile.HOST_DTYPES[placeholder]  # T is the placeholder; bias broadcast along rows
        np.testing.assert_array_equal(y, 3 * x + np.array([1.0, 2.0, 3.0]))


def test_ptx_work_counts_what_the_compiled_kernel_does():
    """Stores (global or generic), shared-memory accesses, barriers, atomics, warp shuffles and
    votes, as PTX spells them (a syncwarp, bar.warp.sync, is not a block's barrier)."""
    from course.gpu_compile import ptx_work

    ptx = ("\tld.param.u64 \t%rd1, [p];\n\tst.u32 \t[%rd15], %r6;\n\t@%p1 st.global.f32 \t[%rd2], %f1;\n"
           "\tst.shared.f32 \t[%r1], %f2;\n\tld.shared.f32 \t%f3, [%r2];\n\tbar.sync \t0;\n"
           "\tatom.global.add.u32 \t%r3, [%rd4], 1;\n\tst.param.b32 \t[retval], %r1;\n\tst.local.u32 \t[%rd9], %r2;\n"
           "\tshfl.sync.down.b32 \t%r9|%p4, %r4, %r7, %r6, %r8;\n\t@%p2 shfl.sync.bfly.b32 \t%r11|%p5, %r10, %r7, %r6, %r8;\n"
           "\tvote.sync.ballot.b32 \t%r1, %p14, %r8;\n\tbar.warp.sync \t-1;\n")
    assert ptx_work(ptx) == {"global_stores": 2, "shared_accesses": 2, "barriers": 1, "atomics": 1,
                             "warp_shuffles": 2, "warp_votes": 1}
