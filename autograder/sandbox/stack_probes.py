"""What ``k2c selftest`` runs inside the sandbox, as student code would run: two MPI
ranks and two gloo processes, started from a call, each summing its rank into all.
They return what the ranks returned and how long the job took; the self-test, in the
grader, decides whether that is right."""
from __future__ import annotations

JOB_TIMEOUT_S = 120  # a cold start of torch or MPI on a small machine takes seconds, not minutes


def _mpi_rank(comm):
    return comm.allreduce(comm.Get_rank() + 1)


def _gloo_rank():
    import torch
    import torch.distributed as dist

    x = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(x)
    return [float(x.item()), dist.get_backend()]


def mpi_job() -> dict:
    from course import mpi

    job = mpi.run("autograder.sandbox.stack_probes:_mpi_rank", 2, timeout=JOB_TIMEOUT_S)
    job.check()
    return {"results": list(job.results), "seconds": job.duration_s, "launcher": mpi.mpiexec()}


def gloo_job() -> dict:
    from course import dist

    job = dist.run("autograder.sandbox.stack_probes:_gloo_rank", 2, timeout=JOB_TIMEOUT_S, backend="gloo")
    job.check()
    return {"results": list(job.results), "seconds": job.duration_s}
