"""Labs 08-11 refuse torch's own implementation of what they ask students to build,
by whatever path it is reached (course.refuse, listed in each lab.toml)."""
import json
import os
import subprocess
import sys

from autograder.grading.labs import all_labs
from conftest import REPO

# The public names each refused object is usually reached by, besides the module defining it.
ALSO_REACHED_AS = {
    "torch.nn.parallel.distributed:DistributedDataParallel": ["torch.nn.parallel.DistributedDataParallel"],
    "torch.nn.parallel.data_parallel:DataParallel": ["torch.nn.DataParallel", "torch.nn.parallel.DataParallel"],
    "torch.distributed.optim.zero_redundancy_optimizer:ZeroRedundancyOptimizer":
        ["torch.distributed.optim.ZeroRedundancyOptimizer"],
    "torch.distributed.fsdp.fully_sharded_data_parallel:FullyShardedDataParallel":
        ["torch.distributed.fsdp.FullyShardedDataParallel"],
    "torch.distributed.tensor.parallel.api:parallelize_module": ["torch.distributed.tensor.parallel.parallelize_module"],
    "torch.distributed.tensor.parallel.style:ColwiseParallel": ["torch.distributed.tensor.parallel.ColwiseParallel"],
    "torch.distributed.fsdp._fully_shard._fully_shard:fully_shard":
        ["torch.distributed.fsdp.fully_shard"],
}

PROBE = r'''
import importlib, json, sys
from course import refuse

def resolve(dotted):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)

def outcome(action):
    try:
        action()
        return "allowed"
    except refuse.LibraryRefused as exc:
        return "refused: " + str(exc)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"

labs, paths = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for names, why in labs:
    refuse.install(names, why)
import torch, torch.nn as nn, torch.distributed
seen = {}
for names, _ in labs:
    for name in names:
        module, _, attr = name.partition(":")
        if not attr:
            seen[f"import {module}"] = outcome(lambda: importlib.import_module(module))
            seen[f"from {module} import x"] = outcome(lambda: exec(f"from {module} import something"))
            continue
        for path in [f"{module}.{attr}", *paths.get(name, [])]:
            seen[f"call {path}"] = outcome(lambda: resolve(path)())
        cls = resolve(f"{module}.{attr}")
        if isinstance(cls, type):
            seen[f"subclass {attr}"] = outcome(lambda: type("Mine", (cls,), {})())
            seen[f"isinstance {attr}"] = str(isinstance(nn.Linear(2, 2), cls))
seen["torch still works"] = str(tuple(nn.Linear(2, 3)(torch.ones(2)).shape) == (3,))
print(json.dumps(seen))
'''


def test_each_lab_refuses_what_it_asks_students_to_build():
    labs = [lab for lab in all_labs() if lab.refuse]
    assert {lab.number for lab in labs} >= {"08", "09", "10", "11", "12", "13"}
    spec = [(list(lab.refuse), lab.refuse_why) for lab in labs]
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(spec), json.dumps(ALSO_REACHED_AS)],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.splitlines()[-1])
    isinstance_checks = {k: v for k, v in seen.items() if k.startswith("isinstance")}
    attempts = {k: v for k, v in seen.items() if k.split()[0] in ("import", "from", "call", "subclass")}
    assert len(attempts) >= 20
    not_refused = {k: v for k, v in attempts.items() if not v.startswith("refused: ")}
    assert not not_refused, not_refused
    assert all(v == "False" for v in isinstance_checks.values()), isinstance_checks  # torch's own checks still run
    assert "this lab builds ZeRO sharding itself" in seen["call torch.distributed.optim.ZeroRedundancyOptimizer"]
    assert seen["torch still works"] == "True"
