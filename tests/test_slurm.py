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
    # The submitted script's settings, as it said (its scratch folder goes once the gradebook is written).
    assert "partition=k2c, account=cs-course, time=25, cpus-per-task=1, nice=10" in proc.stderr, proc.stderr


def test_doctor_reports_slurm_and_the_layer_a_node_grades_with(slurm, tmp_path):
    proc = subprocess.run([str(BIN / "k2c"), "doctor"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=_env())
    assert "SLURM: slurm-wlm" in proc.stdout or "SLURM: slurm" in proc.stdout, proc.stdout
    assert "✓ can submit to the default partition" in proc.stdout, proc.stdout
    assert re.search(r"✓ node \S+ grades with bubblewrap$", proc.stdout, re.M), proc.stdout
    (tmp_path / "k2c-slurm.toml").write_text('partition = "no-such-partition"\n')
    proc = subprocess.run([str(BIN / "k2c"), "doctor"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=_env())
    assert "✗ cannot submit to no-such-partition" in proc.stdout, proc.stdout


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
