"""What travels between grader and sandbox, and the two dependency lists."""
import re
import tomllib

import numpy as np
import pytest
import yaml

from autograder.sandbox.codec import CodecError, decode, encode
from conftest import REPO


def test_codec_round_trip():
    value = {"a": np.arange(6).reshape(2, 3), "b": (1, 2.5, "s", None, True), "c": [np.float32(1.5)]}
    back = decode(encode(value))
    assert np.array_equal(back["a"], value["a"]) and back["b"] == value["b"] and back["c"] == [1.5]


@pytest.mark.parametrize("bad", [object(), np.array([object()]), {1: 2}])
def test_codec_refuses_what_is_not_plain_data(bad):
    with pytest.raises(CodecError):
        encode(bad)


def test_codec_refuses_forged_bytes():
    with pytest.raises(CodecError):
        decode(b"\x05\x00\x00\x00\x00\x00\x00\x00{garbage")
    pickled = __import__("pickle").dumps({"status": "ok"})
    with pytest.raises(CodecError):
        decode(pickled)


CONDA_TO_PYPI = {"pytorch": "torch"}


def _name_and_spec(requirement: str) -> tuple[str, str]:
    m = re.match(r"^([A-Za-z0-9_.\-]+)\s*(.*)$", requirement.strip())
    return m.group(1).lower(), m.group(2).replace(" ", "").replace("=", "==").replace("====", "==").replace(">==", ">=")


def test_environment_yml_agrees_with_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pip_side = dict(_name_and_spec(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"])
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    conda_side = {}
    for dep in env["dependencies"]:
        if isinstance(dep, str) and not dep.startswith(("python=", "pip")):
            name, spec = _name_and_spec(dep)
            conda_side[CONDA_TO_PYPI.get(name, name)] = spec
        elif isinstance(dep, dict):  # what conda takes from PyPI
            for req in dep["pip"]:
                if not req.startswith("--"):
                    name, spec = _name_and_spec(req)
                    conda_side[name] = spec
    assert conda_side == pip_side
    assert "conda-forge" in env["channels"]


# pip evaluates environment markers against the machine it runs on, whatever --platform
# says, so from Linux it would still ask for the Linux-only compilers (and torch's CUDA
# libraries) for a Mac. uv resolves for a target platform, markers included; with
# --only-binary :all: every one of its pins must have a wheel there. uv reads neither
# pip's config nor PIP_FIND_LINKS, so it sees PyPI as a student's machine does.
def _resolve(tmp_path, platform: str, python: str, env=None) -> dict:
    import os
    import shutil
    import subprocess

    uv = shutil.which("uv") or shutil.which("uv", path=os.path.dirname(__import__("sys").executable))
    if uv is None:
        if os.environ.get("CI"):
            pytest.fail("uv is not installed: it comes with the dev extra (pip install -e '.[dev]')")
        pytest.skip("uv is not installed (pip install -e '.[dev]')")
    lock = tmp_path / f"{platform}.txt"
    done = subprocess.run([uv, "pip", "compile", str(REPO / "pyproject.toml"), "--python-platform", platform,
                           "--python-version", python, "--only-binary", ":all:", "--no-header", "--quiet",
                           "-o", str(lock)], env=dict(os.environ, **(env or {})),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(line.split("==", 1) for line in lock.read_text().splitlines() if "==" in line
                and not line.lstrip().startswith("#"))


@pytest.mark.slow
def test_the_course_resolves_on_macos_from_wheels_alone(tmp_path):
    pins = _resolve(tmp_path, "aarch64-apple-darwin", "3.12",
                    env={"MACOSX_DEPLOYMENT_TARGET": "14.0"})  # torch 2.13's arm64 wheel
    assert {"torch", "numba", "mpich", "mpi4py", "numpy", "pytest"} <= pins.keys(), sorted(pins)
    assert pins["torch"] == "2.13.0"
    assert not [p for p in pins if p.startswith(("nvidia-", "cuda-")) or p == "numba-cuda"], sorted(pins)


@pytest.mark.slow
def test_the_course_resolves_on_linux_beside_pypis_cuda_torch(tmp_path):
    """What a GPU machine installs: PyPI's torch 2.13.0 for Linux is its CUDA 13 build, which
    pins cuda-bindings 13 and CUDA 13.0's NVRTC; the compilers the course pins must be those
    (CUDA 12's made `pip install -e .` unresolvable there)."""
    pins = _resolve(tmp_path, "x86_64-manylinux_2_28", "3.11")
    assert pins["torch"] == "2.13.0" and pins["numba-cuda"] == "0.30.4", sorted(pins)
    assert "nvidia-nccl-cu13" in pins, "not the CUDA build of torch: " + ", ".join(sorted(pins))
    assert pins["cuda-bindings"].startswith("13."), pins["cuda-bindings"]
    for compiler in ("nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-nvrtc"):
        assert pins[compiler] == "13.0.88", (compiler, pins.get(compiler))
