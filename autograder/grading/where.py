"""Where a grading ran: the node, the card, and on SLURM the job, for every report
and gradebook row; and, where the GPU tier was asked for, why it cannot run here.

The card is the CUDA driver's name for each device this process may use
(``course.tier.cuda_devices``: ``CUDA_VISIBLE_DEVICES`` applies, so on SLURM it is
the GPUs the job was granted); on the CPU tier it is "no GPU", whatever the
machine has, since no check used one.
"""
from __future__ import annotations

import os
import socket
from collections import Counter

# SLURM's variables that say which GPUs a job or step was granted (sbatch(1), srun(1)).
GRANT_VARIABLES = ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_GPUS_ON_NODE")


def graded_on(tier: str, env=None) -> dict:
    """``{"node", "gpu", "slurm_job"}`` of this process: ``slurm_job`` is "" outside SLURM."""
    return {"node": node(env), "gpu": card(tier), "slurm_job": slurm_job(env)}


def node(env=None) -> str:
    """This machine's name: SLURM's name for the node in a job (what ``scontrol show node``
    and ``sinfo`` take), else the host's."""
    env = os.environ if env is None else env
    return env.get("SLURMD_NODENAME") or socket.gethostname()


def card(tier: str) -> str:
    """The GPU that graded, by name ("2 × NVIDIA H100 80GB HBM3" for two alike), or "no GPU"."""
    if tier != "gpu":
        return "no GPU"
    from course.tier import cuda_devices

    names, why = cuda_devices()
    if not names:
        return f"no usable GPU ({why})"
    return ", ".join(name if n == 1 else f"{n} × {name}" for name, n in Counter(names).items())


def slurm_job(env=None) -> str:
    """The SLURM job this process runs in, as squeue and sacct name it: ``JOB_TASK`` for an
    array task, ``JOB`` for a job; "" outside SLURM."""
    env = os.environ if env is None else env
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return env.get("SLURM_JOB_ID", "")


def gpu_grant(env=None) -> str:
    """What SLURM granted this job of GPUs, in its own variables ("" when nothing says)."""
    env = os.environ if env is None else env
    granted = [f"{name}={env[name]}" for name in GRANT_VARIABLES if env.get(name)]
    if granted and "CUDA_VISIBLE_DEVICES" in env:  # what SLURM set for CUDA from the grant
        granted.append(f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}")
    return " ".join(granted)


def no_usable_gpu(env=None) -> str:
    """Why the GPU tier cannot run here, with the remedy ("" when a CUDA device is usable)."""
    from course.tier import cuda_devices

    names, why = cuda_devices()
    if names:
        return ""
    env = os.environ if env is None else env
    where = f"node {node(env)}"
    if not slurm_job(env):
        return f"{where} has no usable CUDA GPU ({why}): see 'k2c doctor', or grade with --tier cpu"
    granted = gpu_grant(env)
    if granted:
        return (f"{where} has no usable CUDA GPU ({why}), though SLURM job {slurm_job(env)} was granted one "
                f"({granted}): the node declares a GPU that CUDA cannot use (run 'k2c doctor' on it), or grade "
                "with --tier cpu")
    return (f"{where} has no usable CUDA GPU ({why}), and SLURM job {slurm_job(env)} was granted none: ask for one "
            "(--gres gpu:1 or --gpus 1, or gres or gpus in k2c-slurm.toml's [gpu] table) on a partition that has "
            "GPUs, or grade with --tier cpu")
