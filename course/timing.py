"""Timing that a lecture can trust: warm-up runs, repeats, and the median."""
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
