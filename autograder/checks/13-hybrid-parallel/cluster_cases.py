"""Lab 13's cluster cases, drawn from the grading's secret seed (``draw``): fake
environments written the way srun and torchrun set them, with what ``rank_from_env``
must return for each, and the jobs ``make_sbatch`` is given, with the fake allocation
each script is run in (``check_cluster.py`` grades them).

The shapes are fixed, because each catches a mistake: one node; two nodes with unequal
and with equal tasks per node, three nodes of two host names (a ``SLURM_LOCALID`` read as
the global rank gives two ranks 0); torchrun under srun with the rendezvous numbering
the nodes the other way round; host lists SLURM compresses (``gpu[07-08]``). What fills
them is drawn: host names and numbers, task and GPU counts, job ids, ports, time limits,
partitions, commands. A table of the answers to one grading's cases answers no other.
"""
import re

from autograder.grading import seeds

BASE = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/home/student", "USER": "student"}
PREFIXES = ("gpu", "cn", "node", "nid", "a-ib", "hpc-g", "dgx")
TRICKY_WORDS = ["--note", "two words $HOME", "it's", "*"]  # one word each, as they are


def hostlist(hosts):
    """SLURM's compressed form of ``hosts``: ``gpu[07-08]``, ``a-ib[3-4],b1``."""
    groups = []  # [prefix, width, [numbers]], runs of one prefix and width in order
    for host in hosts:
        prefix, digits = re.fullmatch(r"(.*?)(\d+)", host).groups()
        if groups and groups[-1][:2] == [prefix, len(digits)]:
            groups[-1][2].append(int(digits))
        else:
            groups.append([prefix, len(digits), [int(digits)]])
    parts = []
    for prefix, width, numbers in groups:
        if len(numbers) == 1:
            parts.append(f"{prefix}{numbers[0]:0{width}d}")
            continue
        ranges, start = [], numbers[0]
        for previous, number in zip(numbers, numbers[1:] + [None]):
            if number != previous + 1:
                ranges.append(f"{start:0{width}d}" + (f"-{previous:0{width}d}" if previous != start else ""))
                start = number
        parts.append(f"{prefix}[{','.join(ranges)}]")
    return ",".join(parts)


def srun_env(hosts, counts, rank, job_id):
    """What srun sets for task ``rank`` of a step with ``counts[i]`` tasks on ``hosts[i]`` (block order)."""
    nodelist = hostlist(hosts)
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


def slurm_cases(label, hosts, counts, job_id):
    cases = []
    for rank in range(sum(counts)):
        env = srun_env(hosts, counts, rank, job_id)
        node = int(env["SLURM_NODEID"])
        cases.append((f"{label}, task {rank} (on {hosts[node]})", env,
                      expected(rank, int(env["SLURM_LOCALID"]), sum(counts), node, len(hosts), "slurm")))
    return cases


def torchrun_env(slurm_node, group_rank, local_rank, procs, nodes, hosts, job_id, port):
    """A process torchrun started under ``srun --ntasks-per-node=1`` (one launcher per node): SLURM's
    variables are the launcher task's; torchrun's rendezvous numbered this node ``group_rank``."""
    env = srun_env(hosts, [1] * nodes, slurm_node, job_id) if hosts else dict(BASE)
    rank = group_rank * procs + local_rank
    env.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(procs * nodes),
               LOCAL_WORLD_SIZE=str(procs), GROUP_RANK=str(group_rank), GROUP_WORLD_SIZE=str(nodes),
               ROLE_RANK=str(rank), ROLE_NAME="default", ROLE_WORLD_SIZE=str(procs * nodes),
               MASTER_ADDR=hosts[0] if hosts else "127.0.0.1", MASTER_PORT=str(port),
               TORCHELASTIC_RUN_ID=job_id, TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
               OMP_NUM_THREADS="1")
    return env, expected(rank, local_rank, procs * nodes, group_rank, nodes, "torchrun")


def _without(env, *names):
    return {k: v for k, v in env.items() if k not in names}


def fake(name, hosts, job_id):
    """The allocation a script runs in: its hosts (what the fake ``scontrol show hostnames`` prints)."""
    return {"name": name, "hosts": hosts, "nodelist": hostlist(hosts), "job_id": job_id}


class _Draw:
    """The values of one grading's cases, from ``seeds.rng(seed, "13", "cluster")``."""

    def __init__(self, seed):
        self.rng = seeds.rng(seed, "13", "cluster")

    def int(self, low, high):
        """An int in [low, high]."""
        return int(self.rng.integers(low, high + 1))

    def pick(self, options):
        return options[self.int(0, len(options) - 1)]

    def job_id(self):
        return str(self.int(10, 9_999_999))

    def hosts(self, count):
        """``count`` hosts numbered in a row (one compressed range), of a drawn name and width."""
        prefix = self.pick(PREFIXES)
        width = self.int(2, 4)
        start = self.int(1, 10**width - count - 1)
        return [f"{prefix}{n:0{width}d}" for n in range(start, start + count)]

    def mixed_hosts(self):
        """Three hosts under two names: two in a row, and one more (``a-ib[3-4],b1``)."""
        first = self.hosts(2)
        other = self.pick([p for p in PREFIXES if p != first[0].rstrip("0123456789")])
        return first + [f"{other}{self.int(1, 99)}"]


def draw(seed):
    """{name: cases} of one grading: ONE_NODE, ACROSS_NODES, TORCHRUN, ENV_ERRORS (rank_from_env),
    SBATCH_CASES, TORCH_CASES, MPI_CASES, JOB_ERRORS (make_sbatch) and QUERIES, what the harness
    is asked."""
    d = _Draw(seed)
    n = d.int(3, 6)
    one_node = slurm_cases(f"srun --ntasks={n} on 1 node", d.hosts(1), [n], d.job_id())
    more = d.int(2, 4)
    fewer = d.int(1, more - 1)
    each = d.int(2, 4)
    three = [d.int(1, 3) for _ in range(3)]
    while len(set(three)) == 1:
        three = [d.int(1, 3) for _ in range(3)]
    across = (slurm_cases(f"srun --ntasks={more + fewer} on 2 nodes ({more} + {fewer} tasks)", d.hosts(2),
                          [more, fewer], d.job_id())
              + slurm_cases(f"srun --ntasks-per-node={each} on 2 nodes", d.hosts(2), [each, each], d.job_id())
              + slurm_cases(f"srun --ntasks={sum(three)} on 3 nodes ({' + '.join(map(str, three))} tasks)",
                            d.mixed_hosts(), three, d.job_id()))

    torchrun = []
    hosts, job_id, port, procs = d.hosts(2), d.job_id(), d.int(20000, 40000), d.int(2, 3)
    for slurm_node in range(2):
        group_rank = 1 - slurm_node  # the rendezvous numbered the nodes the other way round
        for local in range(procs):
            env, want = torchrun_env(slurm_node, group_rank, local, procs, 2, hosts, job_id, port)
            torchrun.append((f"torchrun --nproc-per-node {procs} under srun on 2 nodes: SLURM node {slurm_node} "
                             f"(GROUP_RANK {group_rank}), LOCAL_RANK {local}", env, want))
    alone, alone_id = d.int(2, 4), d.job_id()
    for local in range(alone):
        env, want = torchrun_env(0, 0, local, alone, 1, None, alone_id, d.int(20000, 40000))
        torchrun.append((f"torchrun --standalone --nproc-per-node {alone}, no SLURM: LOCAL_RANK {local}", env, want))

    counts = [d.int(2, 4), d.int(1, 3)]
    task_hosts, task_id = d.hosts(2), d.job_id()
    task = srun_env(task_hosts, counts, sum(counts) - 1, task_id)
    process = torchrun_env(1, 1, 0, procs, 2, task_hosts, task_id, port)[0]
    total, rank = str(sum(counts)), f"{d.int(1, 3)}.5"
    env_errors = [  # (what it is, environment, a word the message must contain or None)
        ("an empty environment", {}, None),
        ("a shell inside an allocation, not a task (SLURM_JOB_ID, no SLURM_PROCID)",
         dict(BASE, SLURM_JOB_ID=task_id, SLURM_JOB_NODELIST=hostlist(task_hosts), SLURM_NNODES="2"), None),
        ("an srun task without SLURM_NTASKS", _without(task, "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_STEP_NUM_TASKS"),
         "SLURM_NTASKS"),
        ("an srun task without SLURM_NODEID", _without(task, "SLURM_NODEID"), "SLURM_NODEID"),
        ("a torchrun process without WORLD_SIZE", _without(process, "WORLD_SIZE"), "WORLD_SIZE"),
        ("SLURM_PROCID='x'", dict(task, SLURM_PROCID="x"), "SLURM_PROCID"),
        (f"RANK={rank!r}", dict(process, RANK=rank), "RANK"),
        (f"SLURM_PROCID={total} with SLURM_NTASKS={total}", dict(task, SLURM_PROCID=total), None),
    ]

    gpus = d.pick((2, 4, 8))
    name = d.pick(("gpt", "llama", "bert", "vit", "t5"))
    wide, port = d.int(2, 3), d.int(20000, 40000)
    small, heat, ring, coll = d.int(3, 4), d.int(3, 4), d.int(2, 4), d.int(2, 3)
    mpi = d.pick(("pmi2", "pmix"))
    sbatch_cases = [  # (what it is, job, the fake allocation)
        (f"torch on 2 nodes x {gpus} GPUs",
         {"name": f"{name}-2x{gpus}", "nodes": 2, "kind": "torch", "gpus_per_node": gpus, "procs_per_node": gpus,
          "time": f"{d.int(0, 23):02d}:{d.int(1, 59):02d}:00", "partition": d.pick(("gpu", "a100", "h100", "gpu-long")),
          "output": "logs/%x-%j.out", "command": ["train.py", "--steps", str(d.int(10, 5000))] + TRICKY_WORDS},
         fake(f"{name}-2x{gpus}", d.hosts(2), d.job_id())),
        (f"torch on 3 nodes x {wide} processes, port {port}, torchrun at a path",
         {"name": "tiny", "nodes": 3, "kind": "torch", "procs_per_node": wide, "port": port,
          "torchrun": d.pick(("/opt/venv/bin/torchrun", "/home/student/.venv/bin/torchrun")),
          "command": ["entry.py", "out.json"]},
         fake("tiny", d.mixed_hosts(), d.job_id())),
        (f"torch on 1 node x {small} processes, overcommitted, default time",
         {"name": "local", "nodes": 1, "kind": "torch", "procs_per_node": small, "overcommit": True,
          "command": ["entry.py"]},
         fake("local", d.hosts(1), d.job_id())),
        (f"mpi, srun, 1 node x {heat} ranks, overcommitted",
         {"name": "heat", "nodes": 1, "kind": "mpi", "tasks_per_node": heat, "overcommit": True,
          "time": str(d.int(1, 59)), "command": ["python", "heat.py"] + TRICKY_WORDS},
         fake("heat", d.hosts(1), d.job_id())),
        (f"mpi, srun --mpi={mpi}, 2 nodes x {ring} ranks",
         {"name": "ring", "nodes": 2, "kind": "mpi", "tasks_per_node": ring, "launcher": "srun", "srun_mpi": mpi,
          "partition": d.pick(("cpu", "short", "compute")), "time": f"{d.int(0, 2)}-{d.int(0, 23):02d}:20:00",
          "command": ["./ring", "--size", str(2 ** d.int(6, 20))]},
         fake("ring", d.hosts(2), d.job_id())),
        (f"mpi, mpiexec at a path with a space, 2 nodes x {coll} ranks",
         {"name": "coll", "nodes": 2, "kind": "mpi", "tasks_per_node": coll, "launcher": "mpiexec",
          "mpiexec": "@FAKES@/mpich 4.1/bin/mpiexec", "output": "coll.out", "command": ["python", "coll.py"]},
         fake("coll", d.hosts(2), d.job_id())),
    ]

    good_torch = {"name": d.pick(("t", "train", "job")), "nodes": d.int(2, 4), "kind": "torch",
                  "procs_per_node": d.int(2, 8), "command": ["train.py"]}
    good_mpi = {"name": d.pick(("m", "solve", "sweep")), "nodes": d.int(2, 4), "kind": "mpi",
                "tasks_per_node": d.int(2, 8), "command": ["python", "x.py"]}
    low_port = d.int(1, 1023)  # a privileged port
    job_errors = [  # (what it is, job, a word the message must contain)
        ("no 'command'", _without(good_torch, "command"), "command"),
        ("no 'nodes'", _without(good_mpi, "nodes"), "nodes"),
        ("nodes=0", dict(good_torch, nodes=0), "nodes"),
        (f"nodes='{good_mpi['nodes']}' (a str)", dict(good_mpi, nodes=str(good_mpi["nodes"])), "nodes"),
        ("kind='openmp'", dict(good_mpi, kind="openmp"), "kind"),
        ("an unknown key 'gpus'", dict(good_torch, gpus=good_torch["procs_per_node"]), "gpus"),
        ("a torch job without procs_per_node or gpus_per_node", _without(good_torch, "procs_per_node"),
         "procs_per_node"),
        ("an mpi job without tasks_per_node", _without(good_mpi, "tasks_per_node"), "tasks_per_node"),
        ("tasks_per_node on a torch job", dict(good_torch, tasks_per_node=good_torch["procs_per_node"]),
         "tasks_per_node"),
        ("command as one string", dict(good_mpi, command=" ".join(good_mpi["command"])), "command"),
        ("command=[]", dict(good_mpi, command=[]), "command"),
        ("launcher='mpirun'", dict(good_mpi, launcher="mpirun"), "launcher"),
        (f"port={low_port}", dict(good_torch, port=low_port), "port"),
        ("time='soon'", dict(good_torch, time="soon"), "time"),
        ("overcommit='yes'", dict(good_mpi, overcommit="yes"), "overcommit"),
        ("name='my job' (a space)", dict(good_mpi, name="my job"), "name"),
    ]

    return {
        "ONE_NODE": one_node, "ACROSS_NODES": across, "TORCHRUN": torchrun, "ENV_ERRORS": env_errors,
        "SBATCH_CASES": sbatch_cases, "JOB_ERRORS": job_errors,
        "TORCH_CASES": [case for case in sbatch_cases if case[1]["kind"] == "torch"],
        "MPI_CASES": [case for case in sbatch_cases if case[1]["kind"] == "mpi"],
        "QUERIES": {
            "rank_from_env": [env for _, env, _ in one_node + across + torchrun],
            "rank_from_env_errors": [env for _, env, _ in env_errors],
            "make_sbatch": [{"job": job, "fake": allocation} for _, job, allocation in sbatch_cases],
            "make_sbatch_errors": [job for _, job, _ in job_errors],
        },
    }
