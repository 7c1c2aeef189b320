"""Checks for lab 13's cluster module: ``rank_from_env`` and ``make_sbatch``.

Every query goes to the student's code in one sandboxed call
(``harness_cluster.cluster_answers``); every expected value is built in the grader's
process, for cases whose hosts, counts, ids, ports and limits are drawn from the
grading's secret seed (``cluster_cases.draw``).

- ``rank_from_env`` on fake environments written the way srun and
  torchrun set them: one node; two and three nodes, with as many and with
  different numbers of tasks per node (e.g. 3 + 2: a ``SLURM_LOCALID`` read as the
  global rank gives two ranks 0); torchrun's processes under srun, whose
  ``SLURM_*`` variables describe the launcher (torchrun's must win, and its
  node is ``GROUP_RANK`` even where SLURM numbers that node differently);
  environments that must raise ``ValueError``.
- ``make_sbatch``: the script's ``#SBATCH`` lines, read as sbatch reads them
  (``sbatch_reading.py``: only before the first command; ``--opt=value``,
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

from autograder.grading.checking import load_beside
from autograder.grading.submission import not_implemented_yet

cluster_cases = load_beside(__file__, "cluster_cases")
sbatch = load_beside(__file__, "sbatch_reading")


def _drawn(submission, seed):
    """This grading's cases (``cluster_cases.draw``), drawn once."""
    return submission.once("cluster_cases", lambda: cluster_cases.draw(seed))


def _answers(submission, seed, name):
    """The harness's answers for ``name``, in query order; NotImplementedYet for a stub."""
    found = submission.harness_once("cluster", "cluster_answers", _drawn(submission, seed)["QUERIES"])[name]
    if isinstance(found, dict) and "not_implemented" in found:
        raise not_implemented_yet(found["not_implemented"])
    return found


def _rank_answers(submission, seed, cases):
    drawn = _drawn(submission, seed)
    every = drawn["ONE_NODE"] + drawn["ACROSS_NODES"] + drawn["TORCHRUN"]
    answers = dict(zip((label for label, _, _ in every), _answers(submission, seed, "rank_from_env")))
    return [(label, env, want, answers[label]) for label, env, want in cases]


def _check_ranks(submission, seed, kind):
    cases = _drawn(submission, seed)[kind]
    wrong = []
    for label, env, want, got in _rank_answers(submission, seed, cases):
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
def check_rank_from_env_one_node(submission, seed):
    """rank_from_env reads srun's variables on one node"""
    _check_ranks(submission, seed, "ONE_NODE")


@pytest.mark.points(2)
def check_rank_from_env_across_nodes(submission, seed):
    """rank_from_env on 2 and 3 nodes, with equal and unequal tasks per node"""
    _check_ranks(submission, seed, "ACROSS_NODES")


@pytest.mark.points(2)
def check_rank_from_env_prefers_torchrun(submission, seed):
    """rank_from_env: torchrun's variables win over srun's; its node is GROUP_RANK"""
    _check_ranks(submission, seed, "TORCHRUN")


@pytest.mark.points(1)
def check_rank_from_env_errors(submission, seed):
    """rank_from_env raises ValueError without a rank, with a variable missing, not a number, or out of range"""
    wrong = []
    for (label, env, word), got in zip(_drawn(submission, seed)["ENV_ERRORS"], _answers(submission, seed, "rank_from_env_errors")):
        if "value" in got:
            wrong.append(f"{label}: returned {got['value']!r} instead of raising ValueError")
        elif got["type"] != "ValueError":
            wrong.append(f"{label}: raised {got['error']}, not ValueError")
        elif word and word not in got["error"]:
            wrong.append(f"{label}: the message should name {word}: {got['error']}")
    assert not wrong, "\n".join(wrong)


def _script(submission, seed, label):
    """The answer for the job called ``label``: {"value": text, "run": {...}}; fails when it raised."""
    for (name, job, allocation), got in zip(_drawn(submission, seed)["SBATCH_CASES"],
                                            _answers(submission, seed, "make_sbatch")):
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
    if sbatch.seconds(options.get("time", "")) != sbatch.seconds(limit):
        wrong.append(f"{label}: #SBATCH --time is {options.get('time')!r}, want {limit!r} "
                     f"({sbatch.seconds(limit)} s)")
    for key in ("partition", "output"):
        if key in job:
            want(key, job[key])
    gpus = job.get("gpus_per_node", 0)
    if gpus and options.get("gpus-per-node") != str(gpus) and options.get("gres") != f"gpu:{gpus}":
        wrong.append(f"{label}: no #SBATCH --gpus-per-node={gpus} (or --gres=gpu:{gpus})")
    tasks, tasks_per_node = sbatch.whole(options.get("ntasks")), sbatch.whole(options.get("ntasks-per-node"))
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
def check_sbatch_directives(submission, seed):
    """make_sbatch: #SBATCH name, nodes, tasks, time, partition, output, GPUs, overcommit; bash -n accepts it"""
    wrong = []
    for label, job, _ in _drawn(submission, seed)["SBATCH_CASES"]:
        _, _, got = _script(submission, seed, label)
        options, problems = sbatch.directives(got["value"])
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
        placed = sbatch.whole(srun_options["ntasks-per-node"])
    elif "ntasks" in srun_options:
        placed = None if nodes > 1 else sbatch.whole(srun_options["ntasks"])
    else:
        placed = sbatch.whole(batch.get("ntasks-per-node", "")) or (
            sbatch.whole(batch.get("ntasks", "")) if nodes == 1 else None)
    total = sbatch.whole(srun_options["ntasks"]) if "ntasks" in srun_options else (
        placed * nodes if placed else sbatch.whole(batch.get("ntasks", "")))
    if placed != per_node:
        wrong.append(f"{label}: srun should start {per_node} task(s) per node (--ntasks-per-node={per_node}), "
                     f"it starts {placed if placed else 'an unknown number'} per node")
    if total != nodes * per_node:
        wrong.append(f"{label}: srun should start {nodes * per_node} task(s) in all, it starts {total}")
    return wrong


@pytest.mark.points(3)
def check_torch_launch(submission, seed):
    """make_sbatch, torch: srun starts a torchrun per node; rendezvous at scontrol's first host, the job id"""
    wrong = []
    for label, job, allocation in _drawn(submission, seed)["TORCH_CASES"]:
        _, _, got = _script(submission, seed, label)
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
        srun_options, stray = sbatch.parse_options(argv[:at])
        if stray:
            wrong.append(f"{label}: srun words before torchrun that are not options: {stray}")
        wrong += _tasks(label, srun_options, sbatch.directives(got["value"])[0], nodes, 1)
        if argv[at] != torchrun:
            wrong.append(f"{label}: srun runs {argv[at]!r}, the job's torchrun is {torchrun!r}")
        rest = argv[at + 1:]
        if not _ends_with(rest, job["command"]):
            wrong.append(f"{label}: torchrun's command should end with the job's command {job['command']}, "
                         f"it is {rest}")
            continue
        options, stray = sbatch.parse_options(rest[:len(rest) - len(job["command"])])
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
def check_mpi_launch(submission, seed):
    """make_sbatch, mpi: srun (--mpi when asked) or mpiexec starts nodes x tasks_per_node ranks of the command"""
    wrong = []
    for label, job, allocation in _drawn(submission, seed)["MPI_CASES"]:
        _, _, got = _script(submission, seed, label)
        calls = _ran(label, got, wrong)
        if calls is None:
            continue
        nodes, per_node, command = job["nodes"], job["tasks_per_node"], job["command"]
        batch = sbatch.directives(got["value"])[0]
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
            options, stray = sbatch.parse_options(before)
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
def check_job_validation(submission, seed):
    """make_sbatch raises ValueError naming the key for missing, unknown or invalid keys"""
    wrong, errors = [], _drawn(submission, seed)["JOB_ERRORS"]
    for (label, job, word), got in zip(errors, _answers(submission, seed, "make_sbatch_errors")):
        if "value" in got:
            wrong.append(f"{label}: returned a script instead of raising ValueError")
        elif got["type"] != "ValueError":
            wrong.append(f"{label}: raised {got['error']}, not ValueError")
        elif word not in got["error"]:
            wrong.append(f"{label}: the message should name {word!r}: {got['error']}")
    assert not wrong, f"{len(wrong)} of {len(errors)} bad jobs:\n" + "\n".join(wrong[:8])
