"""Write the docs' GPU tables: the support matrix (from course.gpu_compile.ARCHITECTURES and
the labs' lab.toml), the numba-cuda internals the course uses, and the compile matrix (the
reference solutions' kernels of labs 02-04, compiled for every architecture by the compile
checks themselves).

    .venv/bin/python scripts/compile_matrix.py        (about 30 s; no GPU needed)

It writes docs/gpu-results/support-matrix.md, numba-internals.md (from
course.numba_internals) and compile-matrix.md; commit them.
tests/test_gpu_matrix.py fails when the committed tables no longer match the code.
"""
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autograder import gpu_matrix  # noqa: E402
from autograder.grading.labs import all_labs  # noqa: E402


def main() -> None:
    out = ROOT / "docs" / "gpu-results"
    (out / "support-matrix.md").write_text(gpu_matrix.support_matrix())
    (out / "numba-internals.md").write_text(gpu_matrix.internals_table())
    labs = ",".join(gpu_matrix.compiling_labs(all_labs()))
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "compiles.json"
        done = subprocess.run([sys.executable, "-m", "autograder.cli", "grade", labs, "--submission",
                               str(ROOT / "solutions"), "--tier", "cpu", "-k", "compiles", "--format", "json",
                               "-o", str(report)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        if done.returncode != 0:
            sys.exit(f"grading the compile checks failed (exit {done.returncode})")
        compiled = json.loads(report.read_text())
    versions = ", ".join(f"{dist} {metadata.version(dist)}" for dist in
                         ("numba-cuda", "nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-nvrtc"))
    (out / "compile-matrix.md").write_text(
        f"The reference solutions' kernels, compiled by `k2c grade {labs} -k compiles` on "
        f"{datetime.now(timezone.utc):%Y-%m-%d} ({versions}). Each cell: registers per thread / "
        "shared memory per block (bytes) / bytes spilled to local memory, from `ptxas -v`. "
        "The CuPy kernel is compiled for float and for double.\n\n" + gpu_matrix.compile_matrix(compiled))
    print(f"wrote support-matrix.md, numba-internals.md and compile-matrix.md in {out}")


if __name__ == "__main__":
    main()
