"""Timing that a lecture can trust: warm-up runs, repeats, and the median. (The GPU tier's graded
times go through ``course.gpu_timing``: fresh inputs, an L2 flush, a floor at the card's peak.)"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Timing:
    median: float
    best: float
    runs: tuple[float, ...]

    def __str__(self) -> str:
        return f"{self.median * 1e3:.3f} ms (best {self.best * 1e3:.3f} ms, {len(self.runs)} runs)"


def measure(fn: Callable[[], object], repeat: int = 5, warmup: int = 1,
            sync: Callable[[], object] | None = None) -> Timing:
    """Run ``fn`` ``warmup`` times untimed (JIT compilation, caches), then ``repeat`` times.

    ``sync`` is called after each run before the clock stops; pass
    ``cuda.synchronize`` when ``fn`` launches asynchronous GPU work.
    """
    for _ in range(warmup):
        fn()
        if sync:
            sync()
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        if sync:
            sync()
        runs.append(time.perf_counter() - start)
    return Timing(statistics.median(runs), min(runs), tuple(runs))


def matmul_flops(n: int = 384, reps: int = 5) -> float:
    """Floating-point operations per second of a float32 ``n × n`` torch matrix product on this
    process (best of ``reps``): the C of a roofline."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best


def allreduce_seconds(nbytes: int = 2 ** 22, reps: int = 5) -> float:
    """Best time of ``reps`` all-reduces of a float32 vector of ``nbytes`` over the default
    process group, each started together after a barrier: the network's W, as these ranks see it."""
    import torch
    import torch.distributed as dist

    x = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x)
        best = min(best, time.perf_counter() - start)
    return best
