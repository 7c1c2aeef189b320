"""Lab 13's cluster cases: fake environments written the way srun and torchrun set them,
with what ``rank_from_env`` must return for each, and the jobs ``make_sbatch`` is given,
with the fake allocation each script is run in (``check_cluster.py`` grades them).
"""


# --- fake environments ---------------------------------------------------------------------------

BASE = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/home/student", "USER": "student"}


def srun_env(hosts, counts, rank, nodelist, job_id="7001"):
    """What srun sets for task ``rank`` of a step with ``counts[i]`` tasks on ``hosts[i]`` (block order)."""
    firsts = [sum(counts[:i]) for i in range(len(counts))]
    node = max(i for i, first in enumerate(firsts) if first <= rank)
    total = sum(counts)
    tasks_per_node = ",".join(str(c) for c in counts)
    return dict(BASE, SLURM_JOB_ID=job_id, SLURM_JOBID=job_id, SLURM_STEP_ID="0",
                SLURM_JOB_NODELIST=nodelist, SLURM_NODELIST=nodelist, SLURM_STEP_NODELIST=nodelist,
                SLURM_JOB_NUM_NODES=str(len(hosts)), SLURM_NNODES=str(len(hosts)),
                SLURM_STEP_NUM_NODES=str(len(hosts)), SLURM_NTASKS=str(total), SLURM_NPROCS=str(total),
                SLURM_STEP_NUM_TASKS=str(total), SLURM_TASKS_PER_NODE=tasks_per_node,
                SLURM_STEP_TASKS_PER_NODE=tasks_per_node, SLURMD_NODENAME=hosts[node],
                SLURM_TOPOLOGY_ADDR=hosts[node], SLURM_CPUS_ON_NODE="8",
                SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank - firsts[node]), SLURM_NODEID=str(node),
                SLURM_GTIDS=",".join(str(firsts[node] + i) for i in range(counts[node])))


def expected(rank, local_rank, world_size, node, nodes, launcher):
    return {"rank": rank, "local_rank": local_rank, "world_size": world_size, "node": node, "nodes": nodes,
            "launcher": launcher}


def slurm_cases(label, hosts, counts, nodelist):
    cases = []
    for rank in range(sum(counts)):
        env = srun_env(hosts, counts, rank, nodelist)
        node = int(env["SLURM_NODEID"])
        cases.append((f"{label}, task {rank} (on {hosts[node]})", env,
                      expected(rank, int(env["SLURM_LOCALID"]), sum(counts), node, len(hosts), "slurm")))
    return cases


ONE_NODE = slurm_cases("srun --ntasks=4 on 1 node", ["cn017"], [4], "cn017")
ACROSS_NODES = (slurm_cases("srun --ntasks=5 on 2 nodes (3 + 2 tasks)", ["gpu07", "gpu08"], [3, 2], "gpu[07-08]")
                + slurm_cases("srun --ntasks-per-node=4 on 2 nodes", ["gpu07", "gpu08"], [4, 4], "gpu[07-08]")
                + slurm_cases("srun --ntasks=4 on 3 nodes (1 + 2 + 1 tasks)", ["a-ib3", "a-ib4", "b1"], [1, 2, 1],
                              "a-ib[3-4],b1"))


def torchrun_env(slurm_node, group_rank, local_rank, procs, nodes, hosts, nodelist):
    """A process torchrun started under ``srun --ntasks-per-node=1`` (one launcher per node): SLURM's
    variables are the launcher task's; torchrun's rendezvous numbered this node ``group_rank``."""
    env = srun_env(hosts, [1] * nodes, slurm_node, nodelist) if hosts else dict(BASE)
    rank = group_rank * procs + local_rank
    env.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(procs * nodes),
               LOCAL_WORLD_SIZE=str(procs), GROUP_RANK=str(group_rank), GROUP_WORLD_SIZE=str(nodes),
               ROLE_RANK=str(rank), ROLE_NAME="default", ROLE_WORLD_SIZE=str(procs * nodes),
               MASTER_ADDR=hosts[0] if hosts else "127.0.0.1", MASTER_PORT="29500",
               TORCHELASTIC_RUN_ID="7001", TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
               OMP_NUM_THREADS="1")
    return env, expected(rank, local_rank, procs * nodes, group_rank, nodes, "torchrun")


def torchrun_cases():
    cases = []
    hosts, nodelist = ["gpu07", "gpu08"], "gpu[07-08]"
    for slurm_node in range(2):
        group_rank = 1 - slurm_node  # the rendezvous numbered the nodes the other way round
        for local in range(2):
            env, want = torchrun_env(slurm_node, group_rank, local, 2, 2, hosts, nodelist)
            cases.append((f"torchrun --nproc-per-node 2 under srun on 2 nodes: SLURM node {slurm_node} "
                          f"(GROUP_RANK {group_rank}), LOCAL_RANK {local}", env, want))
    for local in range(3):
        env, want = torchrun_env(0, 0, local, 3, 1, None, None)
        cases.append((f"torchrun --standalone --nproc-per-node 3, no SLURM: LOCAL_RANK {local}", env, want))
    return cases


TORCHRUN = torchrun_cases()


def _without(env, *names):
    return {k: v for k, v in env.items() if k not in names}


TASK = srun_env(["gpu07", "gpu08"], [3, 2], 4, "gpu[07-08]")
PROCESS = torchrun_env(1, 1, 0, 2, 2, ["gpu07", "gpu08"], "gpu[07-08]")[0]
ENV_ERRORS = [  # (what it is, environment, a word the message must contain or None)
    ("an empty environment", {}, None),
    ("a shell inside an allocation, not a task (SLURM_JOB_ID, no SLURM_PROCID)",
     dict(BASE, SLURM_JOB_ID="7001", SLURM_JOB_NODELIST="gpu[07-08]", SLURM_NNODES="2"), None),
    ("an srun task without SLURM_NTASKS", _without(TASK, "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_STEP_NUM_TASKS"),
     "SLURM_NTASKS"),
    ("an srun task without SLURM_NODEID", _without(TASK, "SLURM_NODEID"), "SLURM_NODEID"),
    ("a torchrun process without WORLD_SIZE", _without(PROCESS, "WORLD_SIZE"), "WORLD_SIZE"),
    ("SLURM_PROCID='x'", dict(TASK, SLURM_PROCID="x"), "SLURM_PROCID"),
    ("RANK='1.5'", dict(PROCESS, RANK="1.5"), "RANK"),
    ("SLURM_PROCID=5 with SLURM_NTASKS=5", dict(TASK, SLURM_PROCID="5"), None),
]


# --- jobs -------------------------------------------------------------------------------------------

def fake(name, hosts, nodelist, job_id):
    return {"name": name, "hosts": hosts, "nodelist": nodelist, "job_id": job_id}


TRICKY_WORDS = ["--note", "two words $HOME", "it's", "*"]  # one word each, as they are
SBATCH_CASES = [  # (what it is, job, the fake allocation)
    ("torch on 2 nodes x 4 GPUs",
     {"name": "gpt-2x4", "nodes": 2, "kind": "torch", "gpus_per_node": 4, "procs_per_node": 4,
      "time": "01:30:00", "partition": "gpu", "output": "logs/%x-%j.out",
      "command": ["train.py", "--steps", "100"] + TRICKY_WORDS},
     fake("gpt-2x4", ["gpu07", "gpu08"], "gpu[07-08]", "4242")),
    ("torch on 3 nodes x 2 processes, port 29611, torchrun at a path",
     {"name": "tiny", "nodes": 3, "kind": "torch", "procs_per_node": 2, "port": 29611,
      "torchrun": "/opt/venv/bin/torchrun", "command": ["entry.py", "out.json"]},
     fake("tiny", ["a-ib3", "a-ib4", "b1"], "a-ib[3-4],b1", "99")),
    ("torch on 1 node x 4 processes, overcommitted, default time",
     {"name": "local", "nodes": 1, "kind": "torch", "procs_per_node": 4, "overcommit": True,
      "command": ["entry.py"]},
     fake("local", ["localhost"], "localhost", "17")),
    ("mpi, srun, 1 node x 4 ranks, overcommitted",
     {"name": "heat", "nodes": 1, "kind": "mpi", "tasks_per_node": 4, "overcommit": True, "time": "5",
      "command": ["python", "heat.py"] + TRICKY_WORDS},
     fake("heat", ["localhost"], "localhost", "18")),
    ("mpi, srun --mpi=pmi2, 2 nodes x 3 ranks",
     {"name": "ring", "nodes": 2, "kind": "mpi", "tasks_per_node": 3, "launcher": "srun", "srun_mpi": "pmi2",
      "partition": "cpu", "time": "0-00:20:00", "command": ["./ring", "--size", "1024"]},
     fake("ring", ["cn1", "cn2"], "cn[1-2]", "5")),
    ("mpi, mpiexec at a path with a space, 2 nodes x 2 ranks",
     {"name": "coll", "nodes": 2, "kind": "mpi", "tasks_per_node": 2, "launcher": "mpiexec",
      "mpiexec": "@FAKES@/mpich 4.1/bin/mpiexec", "output": "coll.out", "command": ["python", "coll.py"]},
     fake("coll", ["cn1", "cn2"], "cn[1-2]", "6")),
]
TORCH_CASES = [case for case in SBATCH_CASES if case[1]["kind"] == "torch"]
MPI_CASES = [case for case in SBATCH_CASES if case[1]["kind"] == "mpi"]

GOOD_TORCH = {"name": "t", "nodes": 2, "kind": "torch", "procs_per_node": 4, "command": ["train.py"]}
GOOD_MPI = {"name": "m", "nodes": 2, "kind": "mpi", "tasks_per_node": 2, "command": ["python", "x.py"]}
JOB_ERRORS = [  # (what it is, job, a word the message must contain)
    ("no 'command'", _without(GOOD_TORCH, "command"), "command"),
    ("no 'nodes'", _without(GOOD_MPI, "nodes"), "nodes"),
    ("nodes=0", dict(GOOD_TORCH, nodes=0), "nodes"),
    ("nodes='2' (a str)", dict(GOOD_MPI, nodes="2"), "nodes"),
    ("kind='openmp'", dict(GOOD_MPI, kind="openmp"), "kind"),
    ("an unknown key 'gpus'", dict(GOOD_TORCH, gpus=4), "gpus"),
    ("a torch job without procs_per_node or gpus_per_node", _without(GOOD_TORCH, "procs_per_node"),
     "procs_per_node"),
    ("an mpi job without tasks_per_node", _without(GOOD_MPI, "tasks_per_node"), "tasks_per_node"),
    ("tasks_per_node on a torch job", dict(GOOD_TORCH, tasks_per_node=4), "tasks_per_node"),
    ("command as one string", dict(GOOD_MPI, command="python x.py"), "command"),
    ("command=[]", dict(GOOD_MPI, command=[]), "command"),
    ("launcher='mpirun'", dict(GOOD_MPI, launcher="mpirun"), "launcher"),
    ("port=80", dict(GOOD_TORCH, port=80), "port"),
    ("time='soon'", dict(GOOD_TORCH, time="soon"), "time"),
    ("overcommit='yes'", dict(GOOD_MPI, overcommit="yes"), "overcommit"),
    ("name='my job' (a space)", dict(GOOD_MPI, name="my job"), "name"),
]

QUERIES = {
    "rank_from_env": [env for _, env, _ in ONE_NODE + ACROSS_NODES + TORCHRUN],
    "rank_from_env_errors": [env for _, env, _ in ENV_ERRORS],
    "make_sbatch": [{"job": job, "fake": allocation} for _, job, allocation in SBATCH_CASES],
    "make_sbatch_errors": [job for _, job, _ in JOB_ERRORS],
}
