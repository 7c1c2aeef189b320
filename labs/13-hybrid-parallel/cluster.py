"""Lab 13 — running the same code on a cluster (SLURM, torchrun, mpiexec).

On a cluster you do not start processes yourself: you describe a job to the
scheduler (SLURM) in a *batch script*, ``sbatch`` queues it, and when nodes
are free SLURM runs the script on the first of them. The script starts the
real work on every node with ``srun``, which starts *tasks*; a task may be a
launcher (``torchrun``, ``mpiexec``) that starts more processes itself. Every
process then has to find out who it is — its rank — from its environment.
You write:

1. ``rank_from_env(environ)`` — who am I: a process's global rank, its rank on
   its node, the world size, its node and the number of nodes, from the
   variables torchrun or srun set.
2. ``validate_job(job)`` — check a job described as a plain dict (helpful
   errors before anything is queued) and fill in its defaults.
3. ``make_sbatch(job)`` — the text of a batch script for that job: one
   ``torchrun`` per node (torch), or one MPI rank per task (mpi). ``sbatch``
   runs the same script on a laptop-sized one-node cluster
   (``scripts/slurm-localhost.sh``) and on a real one.

Two classic bugs this lab is about: ``SLURM_LOCALID`` is the rank *on the
node*, not in the job (on one node they agree, so the bug hides until the job
spans two); and hand-parsing ``SLURM_JOB_NODELIST`` (``gpu[07-08,12]``,
``a[1-2]-ib,b3``: a compressed host list) — ``scontrol show hostnames`` expands
it. Under torchrun, its variables win: srun's ``SLURM_PROCID`` then numbers the
torchrun launchers (one per node), not the training processes.

Data formats (plain data; the grader relies on them):

- ``rank_from_env`` returns ``{"rank": int, "local_rank": int, "world_size":
  int, "node": int, "nodes": int, "launcher": "torchrun" | "slurm"}``.
- a job is a dict, see ``make_sbatch``; ``make_sbatch`` returns the script as
  one string.

Grade with ``k2c grade 13`` from the repository root.
"""
import re
import shlex

# --- 1. Who am I ----------------------------------------------------------------------

def rank_from_env(environ):
    """Where this process stands in its job, from ``environ`` (a dict of
    environment variables, e.g. ``dict(os.environ)``): a dict

    ``{"rank", "local_rank", "world_size", "node", "nodes", "launcher"}``

    - torchrun's variables when ``RANK`` is set (``"launcher": "torchrun"``):
      rank ``RANK``, local_rank ``LOCAL_RANK``, world_size ``WORLD_SIZE``,
      node ``GROUP_RANK`` (the node's rank in torchrun's rendezvous), nodes
      ``GROUP_WORLD_SIZE``. They win over SLURM's, which under
      ``srun ... torchrun`` describe the launchers, not the processes.
    - else srun's when ``SLURM_PROCID`` is set (``"launcher": "slurm"``): rank
      ``SLURM_PROCID``, local_rank ``SLURM_LOCALID``, world_size
      ``SLURM_NTASKS``, node ``SLURM_NODEID``, nodes ``SLURM_NNODES``. Nodes
      may run different numbers of tasks (``--ntasks=5`` on 2 nodes: 3 and 2).
    - ``SLURM_JOB_NODELIST`` / ``SLURM_NODELIST`` are never read.

    Every value is an int. Raises ``ValueError`` saying what is wrong when
    neither ``RANK`` nor ``SLURM_PROCID`` is set, when a variable of the chosen
    launcher is missing or not a whole number, or when the numbers disagree
    (not ``0 <= local_rank <= rank < world_size`` or not ``0 <= node < nodes``).

    Example: the 4th task (``SLURM_PROCID=3``) of ``srun --ntasks=5`` on two
    nodes, the first task of node 1: ``{"rank": 3, "local_rank": 0,
    "world_size": 5, "node": 1, "nodes": 2, "launcher": "slurm"}``.
    """
    raise NotImplementedError('not implemented yet: rank_from_env: tell the launcher by which of its variables are set, then check its numbers agree')


# --- 2. The batch script ----------------------------------------------------------------

REQUIRED = ("name", "nodes", "kind", "command")
OPTIONAL = {
    "common": ("time", "partition", "output", "gpus_per_node", "overcommit"),
    "torch": ("procs_per_node", "port", "torchrun"),
    "mpi": ("tasks_per_node", "launcher", "mpiexec", "srun_mpi"),
}
DEFAULT_TIME = "00:10:00"
DEFAULT_PORT = 29500
TIME_FORMAT = re.compile(r"(\d+-)?\d+(:\d+){0,2}")  # sbatch --time: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S


def make_sbatch(job):
    """The text of a SLURM batch script (``sbatch script.sh``) that runs ``job``.

    ``job`` is a dict:

    - ``"name"`` (str): the job's name: letters, digits, ``_``, ``.`` and ``-``.
    - ``"nodes"`` (int >= 1): how many nodes.
    - ``"kind"``: ``"torch"`` or ``"mpi"``.
    - ``"command"`` (a non-empty list of str, not one string): torch: the
      script torchrun runs and its arguments (``["train.py", "--steps", "2"]``);
      mpi: the program every rank runs (``["python", "heat.py"]``). Each word
      reaches the program as it is: spaces, ``$`` and quotes included.
    - ``"time"`` (str, default ``"00:10:00"``): the time limit, as sbatch's
      ``--time`` takes it (``"30"``, ``"01:30:00"``, ``"1-00:00:00"``).
    - ``"partition"`` (str), ``"output"`` (str: the log file, e.g.
      ``"%x-%j.out"``): optional; no directive when absent.
    - ``"gpus_per_node"`` (int >= 0, default 0): when > 0, ``--gpus-per-node``.
    - ``"overcommit"`` (bool, default False): when True, ``--overcommit``
      (``-O``): run more tasks on a node than it has CPUs (a 2-CPU laptop).
    - torch only: ``"procs_per_node"`` (int >= 1; default: ``gpus_per_node``
      when that is > 0, else required): the processes torchrun starts on each
      node; ``"port"`` (int 1024..65535, default 29500): the rendezvous port;
      ``"torchrun"`` (str, default ``"torchrun"``): the torchrun to run.
    - mpi only: ``"tasks_per_node"`` (int >= 1, required): ranks per node;
      ``"launcher"``: ``"srun"`` (default) or ``"mpiexec"``; ``"mpiexec"``
      (str, default ``"mpiexec"``): the mpiexec to run; ``"srun_mpi"`` (str,
      optional): srun's ``--mpi`` plugin, e.g. ``"pmi2"`` (what the
      course's MPICH needs: without it each rank is an MPI job of one).

    Any other key, a missing required key or a value of the wrong type or
    range raises ``ValueError`` naming the key.

    The script starts with ``#!/bin/bash`` and its ``#SBATCH`` lines
    (``--job-name``, ``--nodes``, ``--ntasks-per-node`` or, with overcommit,
    ``--ntasks`` (SLURM refuses more tasks per node than CPUs even then),
    ``--time`` and the optional ones), before any command. Then:

    - torch: one task per node; the head node is the first host of
      ``scontrol show hostnames "$SLURM_JOB_NODELIST"``; then ``srun`` starts
      one task per node, ``torchrun --nnodes N --nproc-per-node P
      --rdzv-backend c10d --rdzv-endpoint <head>:<port> --rdzv-id <job id>
      <command>`` (``srun <srun options> torchrun ...``: srun runs torchrun
      itself). Every torchrun meets the others at the head node's port; the
      job id (``$SLURM_JOB_ID``) names the rendezvous.
    - mpi: ``T = tasks_per_node`` tasks per node; then ``srun --ntasks=N*T
      --ntasks-per-node=T <command>`` (one task per rank; with
      ``--mpi=<srun_mpi>`` when given), or ``mpiexec -n N*T <command>``, which
      finds the nodes in SLURM's environment itself.
    """
    spec = validate_job(job)
    raise NotImplementedError("not implemented yet: make_sbatch: write the directives first, then the launch the docstring gives for the job's kind")


def validate_job(job):
    """``job`` (see ``make_sbatch``) with its defaults filled in: a new dict with
    every key that applies to its kind. Raises ``ValueError`` naming the first
    bad key: unknown, missing, of the wrong type or out of range."""
    raise NotImplementedError('not implemented yet: validate_job: check the keys before the values, filling in each default the docstring gives')
