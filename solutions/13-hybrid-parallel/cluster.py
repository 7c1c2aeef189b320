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
    # BEGIN SOLUTION: tell the launcher by which of its variables are set, then check its numbers agree
    # (key in the answer, variable), in the order a missing one is reported
    torchrun_vars = (("rank", "RANK"), ("local_rank", "LOCAL_RANK"), ("world_size", "WORLD_SIZE"),
                     ("node", "GROUP_RANK"), ("nodes", "GROUP_WORLD_SIZE"))
    slurm_vars = (("rank", "SLURM_PROCID"), ("local_rank", "SLURM_LOCALID"), ("world_size", "SLURM_NTASKS"),
                  ("node", "SLURM_NODEID"), ("nodes", "SLURM_NNODES"))
    if "RANK" in environ:
        launcher, names = "torchrun", torchrun_vars
    elif "SLURM_PROCID" in environ:
        launcher, names = "slurm", slurm_vars
    else:
        raise ValueError("no rank in this environment: neither torchrun's RANK nor srun's SLURM_PROCID is set "
                         "(was this process started by torchrun or srun?)")
    missing = [var for _, var in names if var not in environ]
    if missing:
        raise ValueError(f"{launcher} environment without {', '.join(missing)}")
    found = {"launcher": launcher}
    for key, var in names:
        text = str(environ[var]).strip()
        if not re.fullmatch(r"[0-9]+", text):
            raise ValueError(f"{var}={environ[var]!r} is not a whole number")
        found[key] = int(text)
    if not 0 <= found["local_rank"] <= found["rank"] < found["world_size"]:
        raise ValueError(f"inconsistent {launcher} environment: need 0 <= local_rank <= rank < world_size, got "
                         f"local_rank={found['local_rank']}, rank={found['rank']}, world_size={found['world_size']}")
    if not 0 <= found["node"] < found["nodes"] <= found["world_size"]:
        raise ValueError(f"inconsistent {launcher} environment: need 0 <= node < nodes <= world_size, got "
                         f"node={found['node']}, nodes={found['nodes']}, world_size={found['world_size']}")
    return found
    # END SOLUTION


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
    # BEGIN SOLUTION: write the directives first, then the launch the docstring gives for the job's kind
    nodes, kind = spec["nodes"], spec["kind"]
    per_node = 1 if kind == "torch" else spec["tasks_per_node"]
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name={spec['name']}",
             f"#SBATCH --nodes={nodes}",
             # SLURM 22.05 refuses --ntasks-per-node above a node's CPUs even with
             # --overcommit; the total is accepted, and srun places the tasks.
             f"#SBATCH --ntasks={nodes * per_node}" if spec["overcommit"] else f"#SBATCH --ntasks-per-node={per_node}",
             f"#SBATCH --time={spec['time']}"]
    if "partition" in spec:
        lines.append(f"#SBATCH --partition={shlex.quote(spec['partition'])}")
    if "output" in spec:
        lines.append(f"#SBATCH --output={shlex.quote(spec['output'])}")
    if spec["gpus_per_node"]:
        lines.append(f"#SBATCH --gpus-per-node={spec['gpus_per_node']}")
    if spec["overcommit"]:
        lines.append("#SBATCH --overcommit")
    lines += ["", "set -euo pipefail", ""]
    command = " ".join(shlex.quote(word) for word in spec["command"])
    overcommit = " --overcommit" if spec["overcommit"] else ""
    if kind == "torch":
        lines += [
            "# The first host of the allocation holds torchrun's rendezvous (a c10d store).",
            "# scontrol expands SLURM's compressed host list (gpu[07-08]): never parse it by hand.",
            'hosts=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
            'head=${hosts[0]}',
            f"port={spec['port']}",
            "",
            f"# One torchrun per node; each starts {spec['procs_per_node']} processes and gives them",
            "# RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK (see rank_from_env).",
            f"srun --nodes={nodes} --ntasks={nodes} --ntasks-per-node=1{overcommit} \\",
            f"  {shlex.quote(spec['torchrun'])} --nnodes {nodes} --nproc-per-node {spec['procs_per_node']} \\",
            '  --rdzv-backend c10d --rdzv-endpoint "$head:$port" --rdzv-id "$SLURM_JOB_ID" \\',
            f"  {command}",
        ]
    elif spec["launcher"] == "srun":
        mpi = f" --mpi={shlex.quote(spec['srun_mpi'])}" if "srun_mpi" in spec else ""
        lines += [f"# One task per MPI rank: {nodes} node(s) x {per_node}.",
                  f"srun --nodes={nodes} --ntasks={nodes * per_node} --ntasks-per-node={per_node}{overcommit}{mpi} \\",
                  f"  {command}"]
    else:
        lines += [f"# mpiexec reads the allocation ({nodes} node(s) x {per_node}) from SLURM's environment.",
                  f"{shlex.quote(spec['mpiexec'])} -n {nodes * per_node} {command}"]
    return "\n".join(lines) + "\n"
    # END SOLUTION


def validate_job(job):
    """``job`` (see ``make_sbatch``) with its defaults filled in: a new dict with
    every key that applies to its kind. Raises ``ValueError`` naming the first
    bad key: unknown, missing, of the wrong type or out of range."""
    # BEGIN SOLUTION: check the keys before the values, filling in each default the docstring gives
    if not isinstance(job, dict):
        raise ValueError(f"a job is a dict, got {type(job).__name__}")
    missing = [key for key in REQUIRED if key not in job]
    if missing:
        raise ValueError(f"the job has no {', '.join(repr(k) for k in missing)} (required: {', '.join(REQUIRED)})")
    kind = job["kind"]
    if kind not in ("torch", "mpi"):
        raise ValueError(f"job['kind'] must be 'torch' or 'mpi', got {kind!r}")
    known = REQUIRED + OPTIONAL["common"] + OPTIONAL[kind]
    unknown = sorted(set(job) - set(known))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))} for a {kind} job; the keys are "
                         f"{', '.join(known)}")

    def whole(key, low, high=None, default=None):
        value = job.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
            bounds = f"{low}..{high}" if high else f">= {low}"
            raise ValueError(f"job[{key!r}] must be a whole number {bounds}, got {value!r}")
        return value

    def text(key, default=None, pattern=None, what="a non-empty string"):
        value = job.get(key, default)
        if not isinstance(value, str) or not value or (pattern and not re.fullmatch(pattern, value)):
            raise ValueError(f"job[{key!r}] must be {what}, got {value!r}")
        return value

    spec = {"kind": kind,
            "name": text("name", pattern=r"[A-Za-z0-9_.-]+", what="a name of letters, digits, '_', '.' and '-'"),
            "nodes": whole("nodes", 1),
            "time": text("time", DEFAULT_TIME, TIME_FORMAT.pattern,
                         "a time limit like '30', '01:30:00' or '1-00:00:00'"),
            "gpus_per_node": whole("gpus_per_node", 0, default=0)}
    for key in ("partition", "output"):
        if key in job:
            spec[key] = text(key)
    overcommit = job.get("overcommit", False)
    if not isinstance(overcommit, bool):
        raise ValueError(f"job['overcommit'] must be True or False, got {overcommit!r}")
    spec["overcommit"] = overcommit
    command = job["command"]
    if not isinstance(command, (list, tuple)) or not command or not all(isinstance(w, str) for w in command):
        raise ValueError(f"job['command'] must be a non-empty list of strings (one per word), got {command!r}")
    spec["command"] = list(command)
    if kind == "torch":
        if "procs_per_node" not in job and not spec["gpus_per_node"]:
            raise ValueError("a torch job needs 'procs_per_node' (or 'gpus_per_node' > 0): the processes per node")
        spec["procs_per_node"] = whole("procs_per_node", 1, default=spec["gpus_per_node"])
        spec["port"] = whole("port", 1024, 65535, default=DEFAULT_PORT)
        spec["torchrun"] = text("torchrun", "torchrun")
    else:
        if "tasks_per_node" not in job:
            raise ValueError("an mpi job needs 'tasks_per_node': the ranks per node")
        spec["tasks_per_node"] = whole("tasks_per_node", 1)
        spec["launcher"] = job.get("launcher", "srun")
        if spec["launcher"] not in ("srun", "mpiexec"):
            raise ValueError(f"job['launcher'] must be 'srun' or 'mpiexec', got {spec['launcher']!r}")
        spec["mpiexec"] = text("mpiexec", "mpiexec")
        if "srun_mpi" in job:
            spec["srun_mpi"] = text("srun_mpi")
    return spec
    # END SOLUTION
