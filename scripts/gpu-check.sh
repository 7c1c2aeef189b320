#!/usr/bin/env bash
# The GPU tier on the references, as one table. Run it on a CUDA machine:
#
#   bash scripts/gpu-check.sh [OUTPUT_DIR [LABS]]   (default: docs/gpu-results, and the labs whose
#                                                   GPU tier runs on the device: 02,03,04,07,12)
#
# LABS=all grades every lab on the GPU tier (the others grade there as on the CPU tier, and need
# MPI from the pinned mpich wheel): the check before a term on a new machine.
# It needs numba + numba-cuda (and, for later modules, cupy, mpi4py, torch); no
# install step, no network: the grader runs from this checkout. It stops itself
# after 8 minutes. Commit OUTPUT_DIR/latest.md and gpu-check.json afterwards: the docs
# show the table. Without a GPU, `k2c grade 02,03,04 --dry-run-gpu --format json -o F`
# runs the same checks on stand-ins (they award nothing), and scripts/gpu_table.py F
# makes the same table from it, saying it is a dry run.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/gpu-results}
labs=${2:-}
mkdir -p "$out"
py=.venv/bin/python
[ -x "$py" ] || py=$(command -v python3)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

"$py" -c 'from course.tier import gpu_available, describe_gpu; import sys
print(describe_gpu()); sys.exit(0 if gpu_available() else 3)' || { echo "no CUDA GPU here: nothing to check"; exit 3; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true

if [ -z "$labs" ]; then
  labs=$("$py" -c 'from autograder.gpu_matrix import device_labs; from autograder.grading.labs import all_labs
print(",".join(device_labs(all_labs())))')
fi
echo "grading $labs on the GPU tier"
status=0
timeout 480 "$py" -m autograder.cli grade "$labs" --submission solutions --tier gpu \
  --format json -o "$out/gpu-check.json" --require-full || status=$?
if [ -f "$out/gpu-check.json" ]; then
  "$py" scripts/gpu_table.py "$out/gpu-check.json" | tee "$out/latest.md"
fi
exit $status
