"""The lab's reference ring allreduce against MPICH's own ``Allreduce``.

    .venv/bin/python benchmarks/allreduce_vs_mpich.py [--ranks 4] [--max-mib 64]

Launches the ranks itself (``course.mpi``); both algorithms run in the same
job on the same float32 buffers, alternating, each call between two barriers,
and the time of a call is the slowest rank's. Prints a table and writes it to
``docs/benchmarks/allreduce.md`` (a fragment a docs page can pull in with
MyST's ``{include}``). Throughput is algorithm bandwidth, message
bytes / time (what nccl-tests calls algbw), from the median call; the ratio
is ring / MPICH throughput, so above 1 the ring is faster. The last column is
the same ratio from each algorithm's fastest call: with more ranks than cores
(and other work on the machine) the medians are noisy, and interference only
ever adds time.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "solutions" / "06-collectives"


def _repeats(nbytes):
    return 50 if nbytes <= 256 * 2**10 else 20 if nbytes <= 4 * 2**20 else 10


def measure(comm, sizes):
    """Every rank: median seconds per call of the ring and of MPICH, for each size in bytes."""
    from mpi4py import MPI

    sys.path.insert(0, str(REFERENCE))
    from collectives import allreduce_ring

    rows = []
    for nbytes in sizes:
        x = np.random.default_rng(comm.rank).random(nbytes // 4, dtype=np.float32)
        out = np.empty_like(x)
        ring_result = allreduce_ring(comm, x)  # warm-up, and a check that both agree
        comm.Allreduce(x, out)
        assert np.allclose(ring_result, out, rtol=1e-5), "the ring and MPICH disagree"
        times = {"ring": [], "mpich": []}
        for _ in range(_repeats(nbytes)):
            for name, call in (("ring", lambda: allreduce_ring(comm, x)), ("mpich", lambda: comm.Allreduce(x, out))):
                comm.Barrier()
                start = MPI.Wtime()
                call()
                elapsed = MPI.Wtime() - start
                times[name].append(comm.allreduce(elapsed, op=MPI.MAX))  # the slowest rank's time
        rows.append((nbytes, float(np.median(times["ring"])), float(np.median(times["mpich"])),
                     float(np.min(times["ring"])), float(np.min(times["mpich"]))))
    return rows


def _size(nbytes):
    return f"{nbytes // 2**20} MiB" if nbytes >= 2**20 else f"{nbytes // 2**10} KiB"


def table(rows):
    lines = ["| size | ring (GB/s) | MPICH Allreduce (GB/s) | ring / MPICH | ring / MPICH, fastest calls |",
             "|---:|---:|---:|---:|---:|"]
    for nbytes, ring_s, mpich_s, ring_best, mpich_best in rows:
        lines.append(f"| {_size(nbytes)} | {nbytes / ring_s / 1e9:.3f} | {nbytes / mpich_s / 1e9:.3f} "
                     f"| {mpich_s / ring_s:.2f} | {mpich_best / ring_best:.2f} |")
    return "\n".join(lines)


def main():
    import report  # benchmarks/report.py, beside this script
    from course import mpi

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--max-mib", type=int, default=64)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = parser.parse_args()
    sizes = [2**k for k in range(10, 21 + int(np.log2(args.max_mib)) + 1, 2)]  # 1 KiB, 4 KiB, ... max
    job = mpi.run(f"{__file__}:measure", args.ranks, sizes, timeout=900)
    job.check()
    rows = job.results[0]
    import mpi4py

    where = (f"{report.machine(args.ranks)}, mpi4py {mpi4py.__version__}, "
             f"MPI: {_mpi_library()}; float32 sum; median of 10-50 calls, slowest rank per call; "
             "ring and MPICH alternate call by call in one job")
    text = table(rows)
    report.publish(__file__, "allreduce.md", "Reference ring allreduce (lab 06) against MPICH's `Allreduce`",
                   where, text, write=not args.no_write)


def _mpi_library():
    from mpi4py import MPI

    return " ".join(MPI.Get_library_version().splitlines()[0].split())


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
