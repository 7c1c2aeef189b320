"""Checks for lab 13's cluster module: ``rank_from_env`` and ``make_sbatch``.

Every query goes to the student's code in one sandboxed call
(``harness_cluster.cluster_answers``); every expected value is built here.

- ``rank_from_env`` on fake environments written here the way srun and
  torchrun set them: one node; two and three nodes, with as many and with
  different numbers of tasks per node (3 + 2: a ``SLURM_LOCALID`` read as the
  global rank gives two ranks 0); torchrun's processes under srun, whose
  ``SLURM_*`` variables describe the launcher (torchrun's must win, and its
  node is ``GROUP_RANK`` even where SLURM numbers that node differently);
  environments that must raise ``ValueError``.
- ``make_sbatch``: the script's ``#SBATCH`` lines, read by this file's parser
  as sbatch reads them (only before the first command; ``--opt=value``,
  ``--opt value``, ``-N2``); ``bash -n``; and a run of the script by bash with
  fake ``scontrol``, ``srun``, ``torchrun`` and ``mpiexec`` that record their
  arguments (see harness_cluster.py), from which the launch is read: srun's
  tasks, torchrun's rendezvous flags (the endpoint must be the first host
  ``scontrol show hostnames`` printed for the job's node list, the id the job
  id), the MPI task count, and the command's words as the job gave them.
  Jobs that must raise ``ValueError`` naming the bad key.
"""
import re
import shlex
from pathlib import Path

import pytest

from autograder.grading.submission import not_implemented_yet



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


def _answers(submission, name):
    """The harness's answers for ``name``, in query order; NotImplementedYet for a stub."""
    found = submission.harness_once("cluster", "cluster_answers", QUERIES)[name]
    if isinstance(found, dict) and "not_implemented" in found:
        raise not_implemented_yet(found["not_implemented"])
    return found


def _rank_answers(submission, cases):
    every = ONE_NODE + ACROSS_NODES + TORCHRUN
    answers = dict(zip((label for label, _, _ in every), _answers(submission, "rank_from_env")))
    return [(label, env, want, answers[label]) for label, env, want in cases]


def _check_ranks(submission, cases):
    wrong = []
    for label, env, want, got in _rank_answers(submission, cases):
        if "error" in got:
            wrong.append(f"{label}: rank_from_env raised {got['error']}")
            continue
        value = got["value"]
        if not isinstance(value, dict):
            wrong.append(f"{label}: rank_from_env returned {value!r}, not a dict")
            continue
        bad = [k for k in want if value.get(k) != want[k] or isinstance(value.get(k), bool)]
        if bad:
            hint = ""
            if "rank" in bad and value.get("rank") == int(env.get("SLURM_LOCALID", -1)):
                hint = " (SLURM_LOCALID is the rank on the node, SLURM_PROCID the rank in the job)"
            elif "rank" in bad and value.get("rank") == int(env.get("SLURM_PROCID", -1)) and "RANK" in env:
                hint = " (under torchrun, SLURM_PROCID numbers the torchrun launchers: RANK is the process's rank)"
            elif "node" in bad and "GROUP_RANK" in env and value.get("node") == int(env.get("SLURM_NODEID", -1)):
                hint = " (torchrun's rendezvous numbers the nodes itself: GROUP_RANK, not SLURM_NODEID)"
            wrong.append(f"{label}: " + ", ".join(f"{k}={value.get(k)!r} (want {want[k]!r})" for k in bad) + hint)
    assert not wrong, f"{len(wrong)} of {len(cases)} processes are wrong:\n" + "\n".join(wrong[:6])


@pytest.mark.points(1)
def check_rank_from_env_one_node(submission):
    """rank_from_env reads srun's variables on one node (4 tasks)"""
    _check_ranks(submission, ONE_NODE)


@pytest.mark.points(2)
def check_rank_from_env_across_nodes(submission):
    """rank_from_env on 2 and 3 nodes, with equal and unequal tasks per node (3 + 2; 1 + 2 + 1)"""
    _check_ranks(submission, ACROSS_NODES)


@pytest.mark.points(2)
def check_rank_from_env_prefers_torchrun(submission):
    """rank_from_env: torchrun's variables win over srun's; its node is GROUP_RANK"""
    _check_ranks(submission, TORCHRUN)


@pytest.mark.points(1)
def check_rank_from_env_errors(submission):
    """rank_from_env raises ValueError without a rank, with a variable missing, not a number, or out of range"""
    wrong = []
    for (label, env, word), got in zip(ENV_ERRORS, _answers(submission, "rank_from_env_errors")):
        if "value" in got:
            wrong.append(f"{label}: returned {got['value']!r} instead of raising ValueError")
        elif got["type"] != "ValueError":
            wrong.append(f"{label}: raised {got['error']}, not ValueError")
        elif word and word not in got["error"]:
            wrong.append(f"{label}: the message should name {word}: {got['error']}")
    assert not wrong, "\n".join(wrong)


# --- reading a script as sbatch and srun do ----------------------------------------------------

SHORT = {"J": "job-name", "N": "nodes", "n": "ntasks", "t": "time", "p": "partition", "o": "output",
         "e": "error", "c": "cpus-per-task", "G": "gpus", "O": "overcommit", "A": "account", "q": "qos",
         "l": "label", "u": "unbuffered", "K": "kill-on-bad-exit", "v": "verbose", "Q": "quiet"}
FLAGS = {"overcommit", "exclusive", "label", "unbuffered", "kill-on-bad-exit", "verbose", "quiet", "requeue",
         "no-requeue", "wait", "standalone", "no-python", "module", "run-path", "contiguous", "spread-job"}


def parse_options(words):
    """{option: value} (``True`` for a flag) of words like ``--nodes=2 --time 10 -N2 -O``, long names,
    ``_`` read as ``-``; and the words that are not options."""
    options, other, i = {}, [], 0
    while i < len(words):
        word = words[i]
        if word.startswith("--") and len(word) > 2:
            name, eq, value = word[2:].partition("=")
            name = name.replace("_", "-")
            if eq:
                options[name] = value
            elif name in FLAGS or i + 1 == len(words):
                options[name] = True
            else:
                options[name] = words[i + 1]
                i += 1
        elif word.startswith("-") and len(word) > 1 and word[1] in SHORT:
            name = SHORT[word[1]]
            if name in FLAGS:
                options[name] = True
            elif len(word) > 2:
                options[name] = word[2:].lstrip("=")
            elif i + 1 < len(words):
                options[name] = words[i + 1]
                i += 1
        else:
            other.append(word)
        i += 1
    return options, other


def directives(text):
    """(#SBATCH options, problems): the options sbatch reads, i.e. the ``#SBATCH`` lines before the
    first command; problems name ``#SBATCH`` lines after it (sbatch ignores them) and a missing shebang."""
    problems, words, commands = [], [], False
    lines = text.splitlines()
    if not lines or not lines[0].startswith("#!") or "bash" not in lines[0]:
        problems.append(f"the first line should be a bash shebang (#!/bin/bash), not {lines[0] if lines else ''!r}")
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("#SBATCH"):
            if commands:
                problems.append(f"line {number} ({stripped!r}) comes after a command: sbatch ignores it")
                continue
            try:
                words += shlex.split(stripped[len("#SBATCH"):], comments=True)
            except ValueError as exc:
                problems.append(f"line {number} ({stripped!r}): {exc}")
        elif stripped and not stripped.startswith("#"):
            commands = True
    options, stray = parse_options(words)
    if stray:
        problems.append(f"#SBATCH words that are not options: {stray}")
    return options, problems


def seconds(limit):
    """sbatch's --time in seconds: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S; None when it is none of them."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", str(limit))
    if not m:
        return None
    days, *parts = m.groups()
    parts = [int(p) for p in parts if p is not None]
    if days is not None:  # D-H, D-H:M, D-H:M:S
        parts += [0] * (3 - len(parts))
        return int(days) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return parts[0] * 3600 + parts[1] * 60 + parts[2]


def whole(value):
    return int(value) if isinstance(value, str) and value.isdigit() else None


def _script(submission, label):
    """The answer for the job called ``label``: {"value": text, "run": {...}}; fails when it raised."""
    for (name, job, allocation), got in zip(SBATCH_CASES, _answers(submission, "make_sbatch")):
        if name == label:
            assert "error" not in got, f"{label}: make_sbatch raised {got['error']}"
            return job, allocation, got
    raise KeyError(label)


def _directive_problems(label, job, options, problems):
    nodes = job["nodes"]
    per_node = 1 if job["kind"] == "torch" else job["tasks_per_node"]
    wrong = [f"{label}: {p}" for p in problems]

    def want(option, expected, got=None):
        got = options.get(option) if got is None else got
        if got != expected:
            wrong.append(f"{label}: #SBATCH --{option} is {got!r}, want {expected!r}")

    want("job-name", job["name"])
    if options.get("nodes") not in (str(nodes), f"{nodes}-{nodes}"):
        wrong.append(f"{label}: #SBATCH --nodes is {options.get('nodes')!r}, want {nodes}")
    limit = job.get("time", "00:10:00")
    if seconds(options.get("time", "")) != seconds(limit):
        wrong.append(f"{label}: #SBATCH --time is {options.get('time')!r}, want {limit!r} "
                     f"({seconds(limit)} s)")
    for key in ("partition", "output"):
        if key in job:
            want(key, job[key])
    gpus = job.get("gpus_per_node", 0)
    if gpus and options.get("gpus-per-node") != str(gpus) and options.get("gres") != f"gpu:{gpus}":
        wrong.append(f"{label}: no #SBATCH --gpus-per-node={gpus} (or --gres=gpu:{gpus})")
    tasks, tasks_per_node = whole(options.get("ntasks")), whole(options.get("ntasks-per-node"))
    if "ntasks-per-node" in options and tasks_per_node != per_node:
        wrong.append(f"{label}: #SBATCH --ntasks-per-node is {options['ntasks-per-node']!r}, want {per_node}")
    if "ntasks" in options and tasks != nodes * per_node:
        wrong.append(f"{label}: #SBATCH --ntasks is {options['ntasks']!r}, want {nodes * per_node}")
    if "ntasks" not in options and "ntasks-per-node" not in options:
        wrong.append(f"{label}: neither #SBATCH --ntasks-per-node={per_node} nor --ntasks={nodes * per_node}")
    if job.get("overcommit"):
        if options.get("overcommit") is not True:
            wrong.append(f"{label}: overcommit asked, no #SBATCH --overcommit")
        if tasks_per_node and tasks_per_node > 1:
            wrong.append(f"{label}: with --overcommit, #SBATCH --ntasks-per-node={tasks_per_node} is refused by "
                         f"SLURM on a node with fewer CPUs ('Requested node configuration is not available'); "
                         f"ask --ntasks={nodes * per_node} and place the tasks with srun")
    elif "overcommit" in options:
        wrong.append(f"{label}: #SBATCH --overcommit, but the job did not ask to overcommit")
    return wrong


@pytest.mark.points(2)
def check_sbatch_directives(submission):
    """make_sbatch: #SBATCH name, nodes, tasks, time, partition, output, GPUs, overcommit; bash -n accepts it"""
    wrong = []
    for label, job, _ in SBATCH_CASES:
        _, _, got = _script(submission, label)
        options, problems = directives(got["value"])
        wrong += _directive_problems(label, job, options, problems)
        if got["run"]["syntax"]["rc"] != 0:
            wrong.append(f"{label}: bash -n rejects the script: {got['run']['syntax']['stderr'].strip()}")
    assert not wrong, f"{len(wrong)} problem(s):\n" + "\n".join(wrong[:8])


def _ran(label, got, wrong):
    """The fakes' calls of a script that bash ran to its end; None (and why, in ``wrong``) otherwise."""
    run = got["run"]
    if run["syntax"]["rc"] != 0:
        wrong.append(f"{label}: bash -n rejects the script: {run['syntax']['stderr'].strip()}")
        return None
    if run["rc"] != 0:
        wrong.append(f"{label}: the script, run with the grader's fake scontrol/srun/torchrun/mpiexec, exited with "
                     f"{run['rc']}: {run['stderr'].strip()[-300:]}")
        return None
    return run["calls"]


def _show(call):
    return " ".join(shlex.quote(w) for w in [call["name"]] + call["argv"])[:300]


def _ends_with(words, command):
    return len(words) >= len(command) and words[len(words) - len(command):] == command


def _tasks(label, srun_options, batch, nodes, per_node):
    """Problems with the tasks srun starts: ``per_node`` on each of ``nodes`` nodes. srun's own options
    win; what it does not say, it takes from the allocation (the #SBATCH lines)."""
    wrong = []
    step_nodes = srun_options.get("nodes", batch.get("nodes"))
    if step_nodes not in (str(nodes), f"{nodes}-{nodes}"):
        wrong.append(f"{label}: srun runs on {step_nodes!r} nodes, want {nodes}")
    if "ntasks-per-node" in srun_options:
        placed = whole(srun_options["ntasks-per-node"])
    elif "ntasks" in srun_options:
        placed = None if nodes > 1 else whole(srun_options["ntasks"])
    else:
        placed = whole(batch.get("ntasks-per-node", "")) or (
            whole(batch.get("ntasks", "")) if nodes == 1 else None)
    total = whole(srun_options["ntasks"]) if "ntasks" in srun_options else (
        placed * nodes if placed else whole(batch.get("ntasks", "")))
    if placed != per_node:
        wrong.append(f"{label}: srun should start {per_node} task(s) per node (--ntasks-per-node={per_node}), "
                     f"it starts {placed if placed else 'an unknown number'} per node")
    if total != nodes * per_node:
        wrong.append(f"{label}: srun should start {nodes * per_node} task(s) in all, it starts {total}")
    return wrong


@pytest.mark.points(3)
def check_torch_launch(submission):
    """make_sbatch, torch: srun starts a torchrun per node; rendezvous at scontrol's first host, the job id"""
    wrong = []
    for label, job, allocation in TORCH_CASES:
        _, _, got = _script(submission, label)
        calls = _ran(label, got, wrong)
        if calls is None:
            continue
        nodes, procs = job["nodes"], job["procs_per_node"]
        torchrun = job.get("torchrun", "torchrun")
        is_torchrun = lambda word: word == torchrun or Path(word).name == "torchrun"
        if not any(c["name"] == "scontrol" and c["argv"][:2] == ["show", "hostnames"] for c in calls):
            wrong.append(f"{label}: the script never runs scontrol show hostnames to find the head node")
        direct = [c for c in calls if c["name"] == "torchrun"]
        if direct:
            wrong.append(f"{label}: torchrun runs outside srun ({_show(direct[0])}): on the other nodes nothing starts")
        launches = [c for c in calls if c["name"] == "srun" and any(map(is_torchrun, c["argv"]))]
        if len(launches) != 1:
            wrong.append(f"{label}: want one srun that runs {torchrun}, found {len(launches)}: "
                         f"{[_show(c) for c in calls if c['name'] == 'srun'] or 'no srun at all'}")
            continue
        argv = launches[0]["argv"]
        at = next(i for i, word in enumerate(argv) if is_torchrun(word))
        srun_options, stray = parse_options(argv[:at])
        if stray:
            wrong.append(f"{label}: srun words before torchrun that are not options: {stray}")
        wrong += _tasks(label, srun_options, directives(got["value"])[0], nodes, 1)
        if argv[at] != torchrun:
            wrong.append(f"{label}: srun runs {argv[at]!r}, the job's torchrun is {torchrun!r}")
        rest = argv[at + 1:]
        if not _ends_with(rest, job["command"]):
            wrong.append(f"{label}: torchrun's command should end with the job's command {job['command']}, "
                         f"it is {rest}")
            continue
        options, stray = parse_options(rest[:len(rest) - len(job["command"])])
        if stray:
            wrong.append(f"{label}: torchrun words that are not options before the command: {stray}")
        head = f"{allocation['hosts'][0]}:{job.get('port', 29500)}"
        wanted = {"nnodes": (str(nodes), f"{nodes}:{nodes}"), "nproc-per-node": (str(procs),),
                  "rdzv-backend": ("c10d",), "rdzv-endpoint": (head,), "rdzv-id": (allocation["job_id"],)}
        for option, values in wanted.items():
            if options.get(option) not in values:
                wrong.append(f"{label}: torchrun --{option} is {options.get(option)!r}, want {values[0]!r}"
                             + (" (the first host of scontrol show hostnames \"$SLURM_JOB_NODELIST\", and the port)"
                                if option == "rdzv-endpoint" else "")
                             + (" ($SLURM_JOB_ID)" if option == "rdzv-id" else ""))
        if options.get("standalone"):
            wrong.append(f"{label}: torchrun --standalone makes every node a job of its own")
    assert not wrong, f"{len(wrong)} problem(s):\n" + "\n".join(wrong[:8])


@pytest.mark.points(2)
def check_mpi_launch(submission):
    """make_sbatch, mpi: srun (--mpi when asked) or mpiexec starts nodes x tasks_per_node ranks of the command"""
    wrong = []
    for label, job, allocation in MPI_CASES:
        _, _, got = _script(submission, label)
        calls = _ran(label, got, wrong)
        if calls is None:
            continue
        nodes, per_node, command = job["nodes"], job["tasks_per_node"], job["command"]
        batch = directives(got["value"])[0]
        launcher = job.get("launcher", "srun")
        launches = [c for c in calls if c["name"] in ("srun", "mpiexec") and _ends_with(c["argv"], command)]
        if len(launches) != 1:
            wrong.append(f"{label}: want one {launcher} that runs {command}, found {len(launches)}: "
                         f"{[_show(c) for c in calls if c['name'] in ('srun', 'mpiexec')] or 'no srun or mpiexec'}")
            continue
        call = launches[0]
        if call["name"] != launcher:
            wrong.append(f"{label}: the job asks for {launcher}, the script runs {call['name']}")
            continue
        before = call["argv"][:len(call["argv"]) - len(command)]
        if launcher == "srun":
            options, stray = parse_options(before)
            if stray:
                wrong.append(f"{label}: srun words that are not options before the command: {stray}")
            wrong += _tasks(label, options, batch, nodes, per_node)
            if "srun_mpi" in job and options.get("mpi") != job["srun_mpi"]:
                wrong.append(f"{label}: srun --mpi is {options.get('mpi')!r}, want {job['srun_mpi']!r} "
                             f"(without it the ranks do not find each other: each is a job of 1)")
        else:
            program = job.get("mpiexec", "mpiexec")
            if call["prog"] != program and not (program == "mpiexec" and Path(call["prog"]).name == "mpiexec"):
                wrong.append(f"{label}: the script runs {call['prog']!r}, the job's mpiexec is {program!r}")
            count = None
            for i, word in enumerate(before):
                found = re.fullmatch(r"--?np?=(\d+)", word)
                if found or (word in ("-n", "-np", "--np", "--n") and i + 1 < len(before)):
                    count = found.group(1) if found else before[i + 1]
                    break
            if count != str(nodes * per_node):
                wrong.append(f"{label}: mpiexec -n is {count!r}, want {nodes * per_node} "
                             f"(in {_show(call)})")
    assert not wrong, f"{len(wrong)} problem(s):\n" + "\n".join(wrong[:8])


@pytest.mark.points(1)
def check_job_validation(submission):
    """make_sbatch raises ValueError naming the key for missing, unknown or invalid keys"""
    wrong = []
    for (label, job, word), got in zip(JOB_ERRORS, _answers(submission, "make_sbatch_errors")):
        if "value" in got:
            wrong.append(f"{label}: returned a script instead of raising ValueError")
        elif got["type"] != "ValueError":
            wrong.append(f"{label}: raised {got['error']}, not ValueError")
        elif word not in got["error"]:
            wrong.append(f"{label}: the message should name {word!r}: {got['error']}")
    assert not wrong, f"{len(wrong)} of {len(JOB_ERRORS)} bad jobs:\n" + "\n".join(wrong[:8])
