"""Grader code that runs next to the student's ``cluster`` module in the sandbox.

``cluster_answers(queries)`` answers every query of ``check_cluster.py`` in one
call:

- ``rank_from_env`` / ``rank_from_env_errors``: the student's function on each
  fake environment (a dict of strings).
- ``make_sbatch`` / ``make_sbatch_errors``: the student's script for each job;
  for the good jobs also ``bash -n`` on it and a run of it by bash with fake
  ``scontrol``, ``srun``, ``torchrun`` and ``mpiexec`` first on ``PATH``
  (``FAKES``): each fake records its argument list and exits 0 (``srun``
  starts nothing); ``scontrol show hostnames LIST`` prints the query's hosts,
  one a line, when ``LIST`` is the query's node list (the real one expands
  any list; these fakes know one). The script runs in a scratch folder with
  the environment a batch job has (``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``,
  ...) and nothing of SLURM installed: only the fakes see it.

A job's ``torchrun`` or ``mpiexec`` value may start with ``@FAKES@``: in the
script's text, that stands for the fakes' folder (made for each run, after the
student's function returned), e.g. ``@FAKES@/mpich 4.1/bin/mpiexec``, a fake
the run can execute at a path with a space. Recorded programs name the folder
``@FAKES@`` again.

An answer is ``{"value": ...}`` (plain data) or ``{"error": "Type: message",
"type": "Type"}`` when the call raised; a function still a stub answers
``{"not_implemented": message}`` for all its queries.
"""
import json
import os
import subprocess
import sys
import tempfile

from autograder.grading.checking import plain

FAKES = ("scontrol", "srun", "torchrun", "mpiexec")
EXTRA_MPIEXEC = "mpich 4.1/bin"  # also a fake mpiexec here: a path with a space, which the script must quote
RUN_TIMEOUT_S = 10  # a script that runs only fakes ends in well under a second

FAKE = r'''#!{python} -IS
import json, os, sys

name = os.path.basename(sys.argv[0])
with open(os.environ["K2C_FAKE_LOG"], "a") as log:
    log.write(json.dumps({{"prog": sys.argv[0], "name": name, "argv": sys.argv[1:]}}) + "\n")
if name == "scontrol" and sys.argv[1:3] == ["show", "hostnames"]:
    wanted = sys.argv[3] if len(sys.argv) > 3 else os.environ.get("SLURM_JOB_NODELIST", "")
    if wanted != os.environ["K2C_FAKE_NODELIST"]:
        sys.exit("scontrol (the grader's fake): this job's node list is " + os.environ["K2C_FAKE_NODELIST"]
                 + ", asked to expand " + repr(wanted))
    print("\n".join(json.loads(os.environ["K2C_FAKE_HOSTS"])))
'''


def _call(function, *args):
    """{"value"} or {"error", "type"}; NotImplementedError goes through."""
    try:
        return {"value": plain(function(*args), tuples=False)}
    except NotImplementedError:
        raise
    except Exception as exc:  # the check says what the call raised
        return {"error": f"{type(exc).__name__}: {exc}"[:400], "type": type(exc).__name__}


def _all(function, queries, answer):
    try:
        return [answer(function, q) for q in queries]
    except NotImplementedError as exc:
        return {"not_implemented": str(exc) or f"{function.__name__} is not implemented yet"}


def _run_script(text, fake):
    """bash -n on ``text``, then a run of it among the fakes: {"syntax", "rc", "stderr", "calls"}."""
    with tempfile.TemporaryDirectory(prefix="k2c-sbatch-") as scratch:
        fakes = os.path.join(scratch, "fakes")
        work = os.path.join(scratch, "submit")
        os.makedirs(fakes)
        os.makedirs(work)
        os.makedirs(os.path.join(fakes, EXTRA_MPIEXEC))
        for name in FAKES + (os.path.join(EXTRA_MPIEXEC, "mpiexec"),):
            path = os.path.join(fakes, name)
            with open(path, "w") as f:
                f.write(FAKE.format(python=sys.executable))
            os.chmod(path, 0o755)
        script = os.path.join(scratch, "job.sh")
        with open(script, "w") as f:
            f.write(text.replace("@FAKES@", fakes))
        syntax = subprocess.run(["bash", "-n", script], capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        result = {"syntax": {"rc": syntax.returncode, "stderr": syntax.stderr[-600:]}}
        if syntax.returncode != 0:
            return result
        log = os.path.join(scratch, "calls.jsonl")
        nodes = len(fake["hosts"])
        env = {"PATH": f"{fakes}:/usr/local/bin:/usr/bin:/bin", "HOME": work, "LANG": "C.UTF-8",
               "SLURM_JOB_ID": fake["job_id"], "SLURM_JOBID": fake["job_id"], "SLURM_JOB_NAME": fake["name"],
               "SLURM_JOB_NODELIST": fake["nodelist"], "SLURM_NODELIST": fake["nodelist"],
               "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NNODES": str(nodes), "SLURM_SUBMIT_DIR": work,
               "SLURM_CLUSTER_NAME": "grader", "SLURMD_NODENAME": fake["hosts"][0],
               "K2C_FAKE_LOG": log, "K2C_FAKE_NODELIST": fake["nodelist"], "K2C_FAKE_HOSTS": json.dumps(fake["hosts"])}
        try:
            run = subprocess.run(["bash", script], cwd=work, env=env, capture_output=True, text=True,
                                 stdin=subprocess.DEVNULL, timeout=RUN_TIMEOUT_S)
            result.update(rc=run.returncode, stderr=run.stderr[-600:])
        except subprocess.TimeoutExpired:
            result.update(rc=None, stderr=f"the script ran longer than {RUN_TIMEOUT_S} s")
        calls = []
        if os.path.exists(log):
            with open(log) as f:
                calls = [json.loads(line) for line in f if line.strip()]
        for call in calls:  # the fakes' folder as the job named it
            call["prog"] = call["prog"].replace(fakes, "@FAKES@")
            call["argv"] = [word.replace(fakes, "@FAKES@") for word in call["argv"]]
        result["calls"] = calls
        return result


def _sbatch_answer(function, query):
    answer = _call(function, query["job"])
    if "value" in answer:
        text = answer["value"]
        if not isinstance(text, str):
            return {"error": f"make_sbatch returned {type(text).__name__}, not the script's text (a str)",
                    "type": "TypeError"}
        answer["run"] = _run_script(text, query["fake"])
    return answer


def cluster_answers(queries):
    """{"rank_from_env", "rank_from_env_errors", "make_sbatch", "make_sbatch_errors"}: the answers, in order."""
    import cluster

    return {
        "rank_from_env": _all(cluster.rank_from_env, queries["rank_from_env"], _call),
        "rank_from_env_errors": _all(cluster.rank_from_env, queries["rank_from_env_errors"], _call),
        "make_sbatch": _all(cluster.make_sbatch, queries["make_sbatch"], _sbatch_answer),
        "make_sbatch_errors": _all(cluster.make_sbatch, queries["make_sbatch_errors"], _call),
    }
