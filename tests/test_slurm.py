"""The course on SLURM: jobs submitted with ``sbatch --wait`` to the one-node
cluster of ``scripts/slurm-localhost.sh`` give what the same work gives
without SLURM.

- a 4-rank MPI job (module 06's ``allreduce_ring``), from lab 13's
  ``make_sbatch`` (srun, ``--mpi=pmi2``, overcommitted on 2 CPUs), against
  the same script under this environment's ``mpiexec``;
- the 4-process DP x TP torch job of lab 13 (``hybrid.run_plan``), one
  torchrun started by srun with a c10d rendezvous, against ``torchrun
  --standalone``;
- ``k2c grade-class 13 --slurm``: a class of three graded as a job array,
  each task running ``k2c grade`` inside its allocation (only the fast cluster
  checks, to keep this file's time down), against the reference's known full
  mark, the starter's zero and an empty submission's row.
- ``k2c grade 13 --slurm``: one submission in one job, whose report is the
  local one's and names the node and the job;
- the GPU tier on SLURM: the job asks for the cluster's (stand-in) GPU, is
  granted it, and the node, where CUDA finds no device, refuses to grade and
  says what it was granted: an infrastructure error, never the student's zero.

Each rank also records ``rank_from_env`` of its real environment. The
module's fixture starts the cluster (a no-op when it is up). Without SLURM
installed the tests skip ("no SLURM ..."), but with ``CI`` set they fail: CI
installs SLURM (.ci/run) and must run them. They share one xdist worker
(``--dist loadgroup``): they share the cluster's 2 CPUs, so they run in turn.
"""
import json
import os
import shutil
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import load_check_file

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "slurm-localhost.sh"
BIN = Path(sys.executable).parent
LAB13 = REPO / "solutions" / "13-hybrid-parallel"
COLLECTIVES = REPO / "solutions" / "06-collectives"
JOB_TIMEOUT_S = 150  # a job waits for the others of the test suite on 2 CPUs; each takes 5-30 s alone

pytestmark = pytest.mark.xdist_group("slurm")


def _reference_cluster():
    """Lab 13's reference ``cluster.py`` (make_sbatch, rank_from_env), under a name of its own."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lab13_reference_cluster", LAB13 / "cluster.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cluster = _reference_cluster()


def _unavailable(reason):
    """Skip, or under CI (which installs SLURM) fail: there the SLURM tests must run."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} — CI must run the SLURM tests (.ci/run installs slurm-wlm and munge)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm():
    """The localhost cluster, up."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    missing = [c for c in ("sbatch", "srun", "scontrol", "slurmctld", "slurmd", "munged")
               if not shutil.which(c, path=path)]
    if missing:
        _unavailable(f"no SLURM here: {', '.join(missing)} not installed "
                     f"(apt-get install slurm-wlm munge, or sudo scripts/slurm-localhost.sh start)")
    started = subprocess.run(["bash", str(SCRIPT), "start"], capture_output=True, text=True, timeout=120)
    if started.returncode != 0:
        _unavailable(f"no SLURM cluster: scripts/slurm-localhost.sh start failed: "
                     f"{(started.stderr or started.stdout).strip()[-600:]}")


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _submit(script_text, folder, name):
    """``sbatch --wait`` on the script, started (not waited for); its log is ``folder/name.log``."""
    path = folder / f"{name}.sbatch"
    path.write_text(script_text)
    log = folder / f"{name}.log"
    return subprocess.Popen(["sbatch", "--wait", "--chdir", str(folder), "--output", str(log), str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env()), log


def _finish(job, log, what, name):
    """Wait for ``sbatch --wait``; fail with the job's log unless the job (called ``name``) succeeded."""
    try:
        out, _ = job.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        job.kill()
        subprocess.run(["scancel", "--name", name], capture_output=True)
        pytest.fail(f"{what}: sbatch --wait still waiting after {JOB_TIMEOUT_S} s")
    text = log.read_text()[-3000:] if log.exists() else "(no log)"
    assert job.returncode == 0, f"{what}: sbatch --wait exited with {job.returncode}: {out}\n--- job log:\n{text}"
    return text


def _records(folder, prefix, n):
    found = {}
    for path in sorted(folder.glob(f"{prefix}-rank*.json")):
        record = json.loads(path.read_text())
        found[record["rank"]] = record
    assert sorted(found) == list(range(n)), f"{prefix}: records of ranks {sorted(found)}, want 0..{n - 1}"
    return [found[r] for r in range(n)]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Every rank: its environment as rank_from_env reads it (None and the error without a launcher's variables).
WHO = textwrap.dedent(f"""
    import os, sys
    sys.path.insert(0, {str(LAB13)!r})
    import cluster
    try:
        who = cluster.rank_from_env(dict(os.environ))
    except ValueError as exc:
        who = {{"error": str(exc)}}
    sys.path.pop(0)
""")

ALLREDUCE = WHO + textwrap.dedent(f"""
    import json
    sys.path.insert(0, {str(COLLECTIVES)!r})
    import numpy as np
    from mpi4py import MPI
    import collectives
    comm = MPI.COMM_WORLD
    x = np.arange(12, dtype=np.float64) * (comm.rank + 1) + comm.rank
    total = collectives.allreduce_ring(comm, x)
    with open(f"{{sys.argv[1]}}-rank{{comm.rank}}.json", "w") as f:
        json.dump({{"rank": comm.rank, "size": comm.size, "total": total.tolist(), "who": who}}, f)
""")


def test_mpi_allreduce_under_sbatch_equals_mpiexec(slurm, tmp_path):
    (tmp_path / "allreduce.py").write_text(ALLREDUCE)
    job = {"name": "k2c-test-mpi", "nodes": 1, "kind": "mpi", "tasks_per_node": 4, "launcher": "srun",
           "srun_mpi": "pmi2", "overcommit": True, "time": "5",  # 4 ranks on a 2-CPU node
           "command": [sys.executable, str(tmp_path / "allreduce.py"), "slurm"]}
    submitted, log = _submit(cluster.make_sbatch(job), tmp_path, "mpi")
    outside = subprocess.run([str(BIN / "mpiexec"), "-launcher", "fork", "-n", "4", sys.executable,
                              str(tmp_path / "allreduce.py"), str(tmp_path / "plain")],
                             capture_output=True, text=True, timeout=JOB_TIMEOUT_S, env=_env(), cwd=tmp_path)
    assert outside.returncode == 0, outside.stdout + outside.stderr
    _finish(submitted, log, "the MPI job", job["name"])

    want = sum(np.arange(12, dtype=np.float64) * (r + 1) + r for r in range(4)).tolist()
    for where in ("slurm", "plain"):
        for r, record in enumerate(_records(tmp_path, where, 4)):
            assert record["size"] == 4, f"{where}: rank {r} is in a world of {record['size']}, not 4"
            assert record["total"] == want, f"{where}: rank {r} summed {record['total']}"
    for r, record in enumerate(_records(tmp_path, "slurm", 4)):
        assert record["who"] == {"rank": r, "local_rank": r, "world_size": 4, "node": 0, "nodes": 1,
                                 "launcher": "slurm"}, record["who"]
    assert all("error" in record["who"] for record in _records(tmp_path, "plain", 4))


TRAIN = WHO + textwrap.dedent(f"""
    import json
    import torch.distributed as dist
    dist.init_process_group("gloo")
    sys.path.insert(0, {str(LAB13)!r})
    import hybrid
    L = 2
    plan = {{"dp": 2, "tp": 2, "pp": 1, "microbatches": 1, "zero": 0, "schedule": "1f1b", "stages": [L],
             "recompute": ["none"] * L}}
    model = {{"layers": L, "hidden": 16, "heads": 4, "seq": 8, "batch": 8, "vocab": 32, "dropout": 0.0,
              "precision": "fp32", "optimizer": "sgd", "steps": 2, "seed": 0}}
    out = hybrid.run_plan(plan, model)
    record = {{"rank": dist.get_rank(), "size": dist.get_world_size(), "who": who}}
    if dist.get_rank() == 0:
        record["losses"] = [float(loss) for loss in out["losses"]]
    with open(f"{{sys.argv[1]}}-rank{{dist.get_rank()}}.json", "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()
""")


def test_dp_tp_torch_job_under_sbatch_equals_torchrun(slurm, tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    port = _free_port()
    job = {"name": "k2c-test-torch", "nodes": 1, "kind": "torch", "procs_per_node": 4, "port": port,
           "torchrun": str(BIN / "torchrun"), "time": "5", "command": [str(tmp_path / "train.py"), "slurm"]}
    submitted, log = _submit(cluster.make_sbatch(job), tmp_path, "torch")
    outside = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "4",
                              str(tmp_path / "train.py"), str(tmp_path / "plain")],
                             capture_output=True, text=True, timeout=JOB_TIMEOUT_S, env=_env(), cwd=tmp_path)
    assert outside.returncode == 0, (outside.stdout + outside.stderr)[-3000:]
    _finish(submitted, log, "the torch job", job["name"])

    slurm_records, plain_records = _records(tmp_path, "slurm", 4), _records(tmp_path, "plain", 4)
    losses = slurm_records[0]["losses"]
    assert len(losses) == 2 and all(np.isfinite(losses)), losses
    assert losses == plain_records[0]["losses"], (f"under SLURM {losses}, torchrun --standalone "
                                                  f"{plain_records[0]['losses']}")
    for r, record in enumerate(slurm_records):
        who = record["who"]
        assert who["launcher"] == "torchrun" and (who["rank"], who["local_rank"], who["world_size"], who["node"],
                                                  who["nodes"]) == (r, r, 4, 0, 1), who


def test_a_class_graded_as_a_job_array_gets_every_row(slurm, tmp_path):
    """``k2c grade-class --slurm``: each array task runs ``k2c grade`` inside its
    allocation. Only the cluster checks of lab 13 (a few seconds each): the other
    checks are graded by the other tests."""
    import csv
    import shutil

    from autograder.grading.labs import find_lab

    lab = "13-hybrid-parallel"
    clazz = tmp_path / "class"
    # Each student's labs/ folder: lab 13 and the earlier labs' files it uses.
    for student, source in (("ada", REPO / "solutions"), ("ben", REPO / "labs")):
        for folder in (lab, *{Path(u).parent.name for u in find_lab(lab).uses}):
            shutil.copytree(source / folder, clazz / student / folder, ignore=shutil.ignore_patterns("*.ipynb"))
    (clazz / "cy").mkdir()
    gradebook = tmp_path / "gradebook.csv"
    # The site's settings: a config file, and an option over it; the batch script shows them.
    config = tmp_path / "site.toml"
    config.write_text('partition = "k2c"\naccount = "cs-course"\ntime = "0:20:00"\noptions = ["--nice=10"]\n')
    proc = subprocess.run([str(BIN / "k2c"), "grade-class", "13", str(clazz), "-o", str(gradebook), "--slurm",
                           "--slurm-config", str(config), "--time", "25", "--cpus-per-task", "1",
                           "--jobs", "2", "-k", "check_cluster"], cwd=REPO, capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S, env=_env())
    assert proc.returncode == 0, f"{proc.stdout}{proc.stderr}"
    assert "as a SLURM job array" in proc.stderr
    assert f"from {config} and the command line" in proc.stderr, proc.stderr
    with open(gradebook, newline="") as f:
        rows = {row["student"]: row for row in csv.DictReader(f)}
    assert {name: row["status"] for name, row in rows.items()} == {"ada": "graded", "ben": "graded", "cy": "empty"}
    checks = load_check_file(lab, "check_cluster")
    names = {name[len("check_"):] for name in dir(checks) if name.startswith("check_")}
    report = {r["student"]: r["report"] for r in json.loads(gradebook.with_suffix(".json").read_text())["rows"]}
    assert {t["name"] for t in report["ada"]["tests"]} == names
    assert [t for t in report["ada"]["tests"] if t["status"] != "passed"] == []
    assert float(rows["ada"]["score"]) == float(rows["ada"]["max"]) > 0
    assert float(rows["ben"]["score"]) == 0
    assert all("not implemented yet" in t["feedback"] for t in report["ben"]["tests"])
    # Which node graded each row, with which card, in which array task.
    assert {rows[n]["node"] for n in ("ada", "ben")} == {"localhost"}, rows
    assert {rows[n]["gpu"] for n in ("ada", "ben")} == {"no GPU"}
    assert all(re.fullmatch(r"\d+_[01]", rows[n]["slurm_job"]) for n in ("ada", "ben")), rows
    # The submitted script's settings, as it said (its scratch folder goes once the gradebook is written).
    assert "partition=k2c, account=cs-course, time=25, cpus-per-task=1, nice=10" in proc.stderr, proc.stderr


def test_doctor_reports_slurm_and_the_layer_a_node_grades_with(slurm, tmp_path):
    proc = subprocess.run([str(BIN / "k2c"), "doctor"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=_env())
    assert "SLURM: slurm-wlm" in proc.stdout or "SLURM: slurm" in proc.stdout, proc.stdout
    assert "✓ can submit to the default partition" in proc.stdout, proc.stdout
    assert re.search(r"✓ node \S+ grades with bubblewrap$", proc.stdout, re.M), proc.stdout
    assert "✓ GPU tier (--gres=gpu:1): Job" in proc.stdout, proc.stdout
    (tmp_path / "k2c-slurm.toml").write_text('partition = "no-such-partition"\n[gpu]\npartition = "gpu"\n')
    proc = subprocess.run([str(BIN / "k2c"), "doctor"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=_env())
    assert "✗ cannot submit to no-such-partition" in proc.stdout, proc.stdout
    assert "✓ GPU tier (--partition=gpu --gres=gpu:1): Job" in proc.stdout, proc.stdout


def _lab13_submission(folder, source=REPO / "solutions"):
    """A student's ``labs/``-like folder: lab 13 and the earlier labs' files it uses."""
    from autograder.grading.labs import find_lab

    lab = "13-hybrid-parallel"
    for name in (lab, *{Path(u).parent.name for u in find_lab(lab).uses}):
        shutil.copytree(source / name, folder / name, ignore=shutil.ignore_patterns("*.ipynb"))
    return folder


def test_one_submission_graded_in_a_slurm_job_reports_as_k2c_grade_does(slurm, tmp_path):
    """``k2c grade 13 --slurm``: one job, not an array; the same report and exit status
    as ``k2c grade`` here, naming the submission (not the job's copy of it), the node,
    "no GPU" and the job; nothing left in the folder it ran from."""
    submission = _lab13_submission(tmp_path / "ada")
    work = tmp_path / "work"
    work.mkdir()
    common = ["13", "--submission", str(submission), "-k", "check_cluster", "--format", "json", "--require-full"]
    job = subprocess.Popen([str(BIN / "k2c"), "grade", *common, "--slurm", "-o", str(tmp_path / "slurm.json")],
                           cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    here = subprocess.run([str(BIN / "k2c"), "grade", *common, "-o", str(tmp_path / "here.json")],
                          cwd=work, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, env=_env())
    out, err = job.communicate(timeout=JOB_TIMEOUT_S)
    assert (job.returncode, here.returncode) == (0, 0), f"{err}\n{here.stderr}"
    job_id = re.search(r"SLURM job (\d+): waiting", err).group(1)
    assert "--array" not in err and "(CPU tier; time=65; from the site's defaults" in err, err
    slurm_report, local = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("slurm", "here"))
    assert slurm_report["graded_on"] == {"node": "localhost", "gpu": "no GPU", "slurm_job": job_id}
    assert local["graded_on"]["slurm_job"] == "" and local["graded_on"]["gpu"] == "no GPU"
    assert slurm_report["submission"] == local["submission"] == str(submission / "13-hybrid-parallel")
    assert [(t["name"], t["status"], t["points"]) for t in slurm_report["tests"]] == \
        [(t["name"], t["status"], t["points"]) for t in local["tests"]]
    assert slurm_report["score"] == slurm_report["max_score"] > 0
    # The text table on stdout, as k2c grade -o prints it beside a JSON report.
    assert f"graded on localhost · no GPU · SLURM job {job_id}\n" in out, out
    assert f"Score: {slurm_report['score']:g}/{slurm_report['max_score']:g}" in out, out
    assert list(work.iterdir()) == [], "the job's scratch folder was left behind"
    # A job sbatch refuses: exit 2 saying why, the report file says it too, and nothing is left behind.
    refused = subprocess.run([str(BIN / "k2c"), "grade", *common, "--slurm", "--partition", "no-such-partition",
                              "-o", str(tmp_path / "refused.json")], cwd=work, capture_output=True, text=True,
                             timeout=60, env=_env())
    assert refused.returncode == 2 and "k2c: sbatch refused the job (exit 1)" in refused.stderr, refused.stderr
    assert "invalid partition" in json.loads((tmp_path / "refused.json").read_text())["error"].lower()
    assert list(work.iterdir()) == []


def test_the_gpu_tier_on_slurm_asks_for_a_gpu_and_a_node_without_cuda_says_so(slurm, tmp_path):
    """``--tier gpu`` sends the grading to the GPU partition with a GPU (the [gpu] table
    over the file's top level: the #SBATCH lines show it). The one-node cluster's GPU is a
    stand-in: the job is granted it (SLURM_JOB_GPUS=0) and CUDA finds no device, so the
    node refuses the GPU tier, saying what it was granted: a crashed row naming the node
    and the task, and for one submission exit 2; never a graded zero."""
    import csv

    clazz = tmp_path / "class"
    _lab13_submission(clazz / "ada")
    (tmp_path / "k2c-slurm.toml").write_text('partition = "k2c"\n[gpu]\npartition = "gpu"\ngres = "gpu:1"\n')
    gradebook = tmp_path / "book" / "gradebook.csv"
    one = subprocess.Popen([str(BIN / "k2c"), "grade", "13", "--submission", str(clazz / "ada"), "--slurm",
                            "--tier", "gpu", "-k", "check_cluster", "--format", "json",
                            "-o", str(tmp_path / "one.json")],
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    proc = subprocess.run([str(BIN / "k2c"), "grade-class", "13", str(clazz), "-o", str(gradebook), "--slurm",
                           "--tier", "gpu", "-k", "check_cluster"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S, env=_env())
    _, one_err = one.communicate(timeout=JOB_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert "GPU tier; partition=gpu, time=65, gres=gpu:1; from k2c-slurm.toml)" in proc.stderr, proc.stderr
    script = next(gradebook.parent.glob(".gradebook-work-*/grade-class.sbatch")).read_text()  # kept: a crashed row
    assert [line for line in script.splitlines() if line.startswith("#SBATCH")][3:-1] == [
        "#SBATCH --partition=gpu", "#SBATCH --time=65", "#SBATCH --gres=gpu:1"], script
    with open(gradebook, newline="") as f:
        row = next(csv.DictReader(f))
    assert (row["student"], row["status"], row["tier"], row["node"]) == ("ada", "crashed", "gpu", "localhost"), row
    assert re.fullmatch(r"\d+_0", row["slurm_job"]), row
    assert "the GPU tier cannot run here: node localhost has no usable CUDA GPU" in row["message"], row
    assert "SLURM_JOB_GPUS=0" in row["message"] and "CUDA_VISIBLE_DEVICES=0" in row["message"], row
    # One submission: the job's k2c grade stops (exit 2) and says so; its report is the error.
    assert one.returncode == 2, one_err
    assert "--tier gpu asked for, but node localhost has no usable CUDA GPU" in one_err, one_err
    assert "SLURM_JOB_GPUS=0" in one_err and "partition=gpu" in one_err, one_err
    assert "SLURM_JOB_GPUS=0" in json.loads((tmp_path / "one.json").read_text())["error"]


# Without the cluster: the site's settings, the node's refusal, and the local script's advice.

def test_the_site_settings_come_from_a_file_and_options_and_the_script_shows_them(tmp_path, monkeypatch):
    from autograder.grading.labs import UsageError
    from autograder.instructor.gradebook_slurm import SlurmSite, batch_script

    monkeypatch.chdir(tmp_path)
    assert SlurmSite.resolve(None) == (SlurmSite(), "the site's defaults (no k2c-slurm.toml, no options)")
    (tmp_path / "k2c-slurm.toml").write_text('partition = "gpu-teach"\naccount = "cs4xx"\ntime = "1:30:00"\n'
                                             'cpus-per-task = 4\nmem = "8G"\noptions = ["--qos=short"]\n')
    site, origin = SlurmSite.resolve(None, time="45", mem=None)
    assert origin == "k2c-slurm.toml and the command line"
    assert site == SlurmSite("gpu-teach", "cs4xx", "45", 4, "8G", ("--qos=short",))
    script = batch_script(tmp_path / "manifest.json", 3, 2, 65, site, origin)
    lines = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert lines == ["#SBATCH --job-name=k2c-grade", "#SBATCH --array=0-2%2", "#SBATCH --ntasks=1",
                     "#SBATCH --partition=gpu-teach", "#SBATCH --account=cs4xx", "#SBATCH --time=45",
                     "#SBATCH --cpus-per-task=4", "#SBATCH --mem=8G", "#SBATCH --qos=short",
                     f"#SBATCH --output={tmp_path}/task-%a.log"]
    assert "from k2c-slurm.toml and the command line" in script
    # Without a time, the grading's own limit sets it; without the rest, the site's defaults.
    assert [line for line in batch_script(tmp_path / "m.json", 1, None, 65).splitlines()
            if line.startswith("#SBATCH --")][3:-1] == ["#SBATCH --time=65"]
    for text, says in (('time = "an hour"\n', "write minutes"), ('mem = "lots"\n', "4G"),
                       ('cpus-per-task = 0\n', "1 or more"), ('qos = "short"\n', "unknown SLURM settings ['qos']"),
                       ('options = ["qos=short"]\n', "as on its command line"), ("partition = \n", "not TOML")):
        (tmp_path / "bad.toml").write_text(text)
        with pytest.raises(UsageError, match=re.escape(says)):
            SlurmSite.resolve(str(tmp_path / "bad.toml"))
    proc = subprocess.run([str(BIN / "k2c"), "grade-class", "06", str(tmp_path), "--partition", "x"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "give them with --slurm" in proc.stderr, proc.stderr


def test_a_node_without_bubblewrap_grades_nothing(tmp_path, monkeypatch, capsys):
    """A task on a node that gives only the subreaper layer writes a crashed row saying
    why for each of its submissions, and never runs their code (unless allowed)."""
    from autograder.instructor import gradebook_slurm
    from autograder.sandbox import isolation

    weak = isolation.Isolation(isolation.Layer.SUBREAPER, None, None)
    monkeypatch.setattr(isolation, "detect", lambda: weak)
    monkeypatch.setattr(gradebook_slurm, "grade_one", lambda *a: pytest.fail("graded on a weak node"))
    (tmp_path / "rows").mkdir()
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"settings": {"lab": "06-collectives", "tier": "cpu"}, "chunks": [
        [{"student": "ada", "folder": str(tmp_path), "digest": "ab" * 32}]]}))
    assert gradebook_slurm.run_task(manifest, 0) == 1
    row = json.loads((tmp_path / "rows" / "ada.json").read_text())
    assert row["status"] == "crashed" and "subreaper layer" in row["message"] and "install bubblewrap" in row["message"]


def test_the_local_cluster_script_says_exactly_what_to_install_without_apt(tmp_path):
    """Where SLURM is missing and there is no apt-get, `start` names the packages to
    install (SLURM's daemons and commands, munge, bubblewrap) and fails; it never half-starts."""
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in ("id", "cat", "grep", "nproc"):
        (bare / tool).symlink_to(shutil.which(tool))
    proc = subprocess.run(["/bin/bash", str(SCRIPT), "start"], capture_output=True, text=True, timeout=60,
                          env={"PATH": str(bare), "HOME": str(tmp_path)})
    if os.geteuid() != 0:
        assert proc.returncode == 1 and "run this as root: sudo" in proc.stderr, proc.stderr
        return
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "no apt-get here: install SLURM" in proc.stderr and "bubblewrap (bwrap)" in proc.stderr, proc.stderr


def test_the_gpu_tier_takes_the_gpu_table_and_the_cpu_tier_asks_for_no_gpu(tmp_path, monkeypatch):
    from autograder.grading.labs import UsageError
    from autograder.instructor.gradebook_slurm import SlurmSite, slurm_tier

    monkeypatch.chdir(tmp_path)
    # No settings at all: the GPU tier still asks for one GPU, and says that it did.
    site, origin = SlurmSite.resolve(None, "gpu")
    assert site == SlurmSite(gres="gpu:1") and origin.endswith("--gres=gpu:1, the GPU tier's default"), origin
    (tmp_path / "k2c-slurm.toml").write_text('partition = "teach"\nmem = "8G"\n[gpu]\npartition = "gpu-teach"\n'
                                             'gres = "gpu:a100:1"\nmem = "32G"\n')
    cpu, _ = SlurmSite.resolve(None, "cpu")
    assert cpu == SlurmSite("teach", mem="8G") and not any("gpu" in line for line in cpu.sbatch_lines(65))
    gpu, origin = SlurmSite.resolve(None, "gpu")
    assert origin == "k2c-slurm.toml"
    assert gpu.sbatch_lines(65) == ["#SBATCH --partition=gpu-teach", "#SBATCH --time=65", "#SBATCH --mem=32G",
                                    "#SBATCH --gres=gpu:a100:1"]
    # The command line's GPUs replace the file's (not both); --gpu-partition is the GPU tier's partition.
    assert SlurmSite.resolve(None, "gpu", gpus="2", gpu_partition="big")[0] == \
        SlurmSite("big", mem="32G", gpus="2")
    assert [slurm_tier(t, asked) for t, asked in (("auto", False), ("auto", True), ("gpu", False), ("cpu", False))] \
        == ["cpu", "gpu", "gpu", "cpu"]
    with pytest.raises(UsageError, match="--gres asks for a GPU, but the CPU tier grades without one"):
        SlurmSite.resolve(None, "cpu", gres="gpu:1")
    for text, says in (('[gpu]\ngres = "mps:100"\n', "gpu:COUNT or gpu:TYPE:COUNT"),
                       ('[gpu]\ngpus = "lots"\n', "a count (1) or type:count"),
                       ('[gpu]\ngpus = 1\ngres = "gpu:1"\n', "one way, not both"),
                       ('gres = "gpu:1"\n', "go in its [gpu] table"),
                       ('[gpu]\nqos = "x"\n', "unknown SLURM settings [gpu] ['qos']"),
                       ('gpu = 1\n', "gpu is a table")):
        (tmp_path / "bad.toml").write_text(text)
        with pytest.raises(UsageError, match=re.escape(says)):
            SlurmSite.resolve(str(tmp_path / "bad.toml"), "gpu")
    for command, says in ((["grade", "13", "--gres", "gpu:1"], "give them with --slurm"),
                          (["grade-class", "13", str(tmp_path), "--slurm", "--tier", "cpu", "--gpus", "1"],
                           "--gpus asks for a GPU, but the CPU tier")):
        proc = subprocess.run([str(BIN / "k2c"), *command], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr


def test_a_job_copies_the_submission_without_clutter_or_its_own_scratch(tmp_path):
    from autograder.instructor.slurm_job import _copy

    root = tmp_path / "repo"
    (root / "labs" / "13-hybrid-parallel").mkdir(parents=True)
    (root / "labs" / "13-hybrid-parallel" / "cluster.py").write_text("x = 1\n")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref\n")
    scratch = root / ".k2c-grade-abc"
    scratch.mkdir()
    copy = _copy(root, scratch / "submission", scratch)
    assert copy == scratch / "submission" / "repo"
    assert sorted(p.relative_to(copy).as_posix() for p in copy.rglob("*")) == [
        "labs", "labs/13-hybrid-parallel", "labs/13-hybrid-parallel/cluster.py"]
    (tmp_path / "ada.zip").write_bytes(b"PK\x05\x06" + bytes(18))
    (tmp_path / "s2").mkdir()
    assert _copy(tmp_path / "ada.zip", tmp_path / "s2" / "submission", tmp_path / "s2").read_bytes() == \
        (tmp_path / "ada.zip").read_bytes()


def _fake_slurm(folder, sbatch_version, sinfo="PARTITION\n", sinfo_exit=0):
    """sbatch, srun and sinfo that print what they are given, exit as told, and note each call."""
    folder.mkdir()
    for name, text, code in (("sbatch", sbatch_version, 0 if sbatch_version.startswith("slurm") else 1),
                             ("srun", "", 0), ("sinfo", sinfo, sinfo_exit)):
        tool = folder / name
        tool.write_text(f"#!/bin/sh\necho {name} >> {folder / 'calls'}\nprintf '%s' '{text}' >&2\nexit {code}\n")
        tool.chmod(0o755)
    return folder


def test_doctor_says_in_one_line_when_slurm_is_installed_but_no_cluster_is(tmp_path, monkeypatch):
    """sbatch without a slurm.conf prints four lines of DNS errors in place of its version;
    SLURM_CONF naming no file makes it retry for a minute; slurmctld down makes sinfo fail.
    Each is one line of the doctor's, saying so."""
    from autograder.doctor import _slurm

    no_conf = ("sbatch: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host\n"
               "sbatch: error: fetch_config: DNS SRV lookup failed\n"
               "sbatch: error: _establish_config_source: failed to fetch config\n"
               "sbatch: fatal: Could not establish a configuration source\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_CONF", raising=False)
    monkeypatch.setenv("PATH", str(_fake_slurm(tmp_path / "dns", no_conf)))
    said = _slurm()
    assert said == ("SLURM: - client installed (" + str(tmp_path / "dns" / "sbatch") + "), no cluster configured "
                    "(no slurm.conf, and no DNS SRV record of a configless cluster): only --slurm gradings and lab "
                    "13's cluster jobs need one (the site's slurm.conf; on one machine, sudo "
                    "scripts/slurm-localhost.sh start)"), said
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "missing.conf"))
    said = _slurm()
    assert "\n" not in said and f"no cluster configured (SLURM_CONF={tmp_path / 'missing.conf'} is not a file)" in said
    assert (tmp_path / "dns" / "calls").read_text() == "sbatch\n", "sbatch asked with SLURM_CONF naming no file"
    monkeypatch.delenv("SLURM_CONF")
    monkeypatch.setenv("PATH", str(_fake_slurm(tmp_path / "down", "slurm-wlm 22.05.8", sinfo_exit=1, sinfo=(
        "slurm_load_partitions: Unable to contact slurm controller (connect failure)\n"))))
    said = _slurm()
    assert said == (f"SLURM: ✗ slurm-wlm 22.05.8 client installed ({tmp_path / 'down' / 'sbatch'}), no cluster "
                    "reachable (slurm_load_partitions: Unable to contact slurm controller (connect failure)): is "
                    "slurmctld up?"), said


def test_the_card_is_the_drivers_name_and_a_missing_gpu_says_what_slurm_granted(monkeypatch):
    """course.tier.cuda_devices asks the CUDA driver (a stand-in here) for each visible
    device's name; where.card counts alike cards; where.no_usable_gpu names the node, the
    job and SLURM's grant, or the missing request."""
    from autograder.grading import where
    from course import tier

    class Driver:  # libcuda's calls, as ctypes makes them
        def __init__(self, names, init=0):
            self.names, self.init = names, init

        def cuInit(self, flags):
            return self.init

        def cuGetErrorString(self, status, text):
            text._obj.value = b"no CUDA-capable device is detected"
            return 0

        def cuDeviceGetCount(self, count):
            count._obj.value = len(self.names)
            return 0

        def cuDeviceGet(self, device, ordinal):
            device._obj.value = ordinal
            return 0

        def cuDeviceGetName(self, text, size, device):
            text.value = self.names[device.value].encode()
            return 0

    monkeypatch.delenv(tier.SIMULATOR_VAR, raising=False)  # an earlier test in this worker may have turned it on
    monkeypatch.setattr(tier.ctypes, "CDLL", lambda name: Driver(["NVIDIA H100 80GB HBM3"] * 2 + ["NVIDIA L4"]))
    assert tier.cuda_devices() == (["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3", "NVIDIA L4"], "")
    assert where.card("gpu") == "2 × NVIDIA H100 80GB HBM3, NVIDIA L4" and where.card("cpu") == "no GPU"
    assert where.no_usable_gpu() == ""
    monkeypatch.setattr(tier.ctypes, "CDLL", lambda name: Driver([], init=100))
    assert tier.cuda_devices() == ([], "the CUDA driver did not start: no CUDA-capable device is detected (error 100)")
    granted = {"SLURM_JOB_ID": "7", "SLURM_ARRAY_JOB_ID": "6", "SLURM_ARRAY_TASK_ID": "1", "SLURMD_NODENAME": "g01",
               "SLURM_JOB_GPUS": "0", "CUDA_VISIBLE_DEVICES": "0"}
    assert where.slurm_job(granted) == "6_1" and where.slurm_job({"SLURM_JOB_ID": "7"}) == "7"
    said = where.no_usable_gpu(granted)
    assert said.startswith("node g01 has no usable CUDA GPU (the CUDA driver did not start") and \
        "SLURM job 6_1 was granted one (SLURM_JOB_GPUS=0 CUDA_VISIBLE_DEVICES=0)" in said, said
    said = where.no_usable_gpu({"SLURM_JOB_ID": "7", "SLURMD_NODENAME": "c01"})
    assert "SLURM job 7 was granted none: ask for one (--gres gpu:1" in said, said

    def no_driver(name):
        raise OSError(name)

    monkeypatch.setattr(tier.ctypes, "CDLL", no_driver)
    assert tier.cuda_devices() == ([], "no CUDA driver: libcuda.so.1 is not installed")
    assert where.card("gpu") == "no usable GPU (no CUDA driver: libcuda.so.1 is not installed)"


def test_one_submission_is_one_job_and_a_job_that_ends_too_soon_is_an_infrastructure_error(tmp_path):
    """``k2c grade --slurm``'s batch script (one job: no array), read from an sbatch that
    takes the job and runs nothing, as when a job is cancelled or its node is lost: exit 2
    naming the job and its log, which is kept; never a report."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text("#!/bin/sh\necho 99\nexit 1\n")
    (fake / "sbatch").chmod(0o755)
    (tmp_path / "ada").mkdir()
    proc = subprocess.run([str(BIN / "k2c"), "grade", "13", "--submission", str(tmp_path / "ada"), "--slurm",
                           "--gres", "gpu:a100:2", "--partition", "gpu", "-k", "check_cluster", "--format", "json",
                           "-o", str(tmp_path / "out.json")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}"))
    assert proc.returncode == 2, proc.stderr
    assert "SLURM job 99 ended before k2c grade did (sbatch --wait exit 1)" in proc.stderr, proc.stderr
    assert "ended before k2c grade did" in json.loads((tmp_path / "out.json").read_text())["error"]
    kept = next(tmp_path.glob(".k2c-grade-*"))
    script = (kept / "grade.sbatch").read_text()
    assert [line for line in script.splitlines() if line.startswith("#SBATCH")] == [
        "#SBATCH --job-name=k2c-grade-13", "#SBATCH --ntasks=1", "#SBATCH --partition=gpu", "#SBATCH --time=65",
        "#SBATCH --gres=gpu:a100:2", f"#SBATCH --output={kept}/job.log"], script
    assert f"--submission {kept}/submission/ada --shown-as {tmp_path / 'ada'} --tier gpu" in script, script


def test_a_slurm_job_grades_with_the_limits_asked_for():
    """``k2c grade --slurm``'s job runs ``k2c grade`` with the call limit and the grading's budget given."""
    from autograder.cli import parser
    from autograder.grading.labs import find_lab
    from autograder.instructor.gradebook_slurm import SlurmSite
    from autograder.instructor.slurm_job import job_script

    args = parser().parse_args(["grade", "04", "--slurm", "--timeout", "30", "--budget", "120"])
    script = job_script(args, [find_lab("04")], "cpu", Path("/copy"), Path("/source"), Path("/scratch"), 65,
                        SlurmSite(), "the site's defaults")
    assert " --timeout 30.0 " in script and " --budget 120.0 " in script, script
