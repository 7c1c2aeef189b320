"""The grader's side of a GPU-tier time: seeds out, runs back, each run judged.

``course.gpu_timing.bench`` times a kernel in the sandbox, beside the student's
code, and sends back for every timed run its seed, its time and a sample of
its output. Here, in the grader's process, :func:`judge`

1. refuses a stand-in's times on the GPU tier (and a real card's in a dry run):
   the record says which ran;
2. rechecks every timed run's output with the check's ``recheck(seed, kept)``,
   which computes its oracle from the same seed (``course.gpu_timing.hashed``
   names every input element), and fails the check at the first wrong run;
3. refuses, unscored, any run faster than the physical limit of the card in the
   record (``course.gpu_timing.floor_seconds``);
4. takes the median of the runs.

:func:`draw_seeds` draws the runs' seeds from the grading's secret seed, fresh for every
grading, so no run's inputs can be known before the call that times it.
"""
from __future__ import annotations

import secrets
import statistics
from dataclasses import dataclass

import numpy as np

from autograder.grading import seeds
from course.gpu_timing import floor_seconds, scale_of


@dataclass(frozen=True)
class Timed:
    """One judged measurement: every run right, none under the floor."""
    what: str
    median_s: float
    floor_s: float
    floor_why: str
    runs: int
    warmup: int
    timer: str
    stand_in: bool = False

    def describe(self) -> str:
        if self.timer == "events":
            clock = "a stand-in's events, on the host clock" if self.stand_in else "CUDA events"
        else:
            clock = f"the host clock between {'a stand-in' if self.stand_in else 'device'} synchronizations"
        floor = (f"floor {self.floor_s * 1e3:.4g} ms: {self.floor_why}" if self.floor_s
                 else self.floor_why)
        return (f"{self.what}: median {self.median_s * 1e3:.4g} ms of {self.runs} timed runs after "
                f"{self.warmup} warm-up (new inputs, L2 flushed and output checked every run; {clock}); {floor}")


def draw_seeds(count: int, grading_seed: int | None = None, *names) -> list[int]:
    """``count`` 32-bit seeds, one per timed run: drawn from the grading's secret seed and
    the measurement's ``names`` (``autograder.grading.seeds``: ``K2C_GRADING_SEED`` draws
    them again), or, without one, from ``secrets``. Their ``scale_of`` (their residues mod
    1024) all differ, so no two runs of a reduction share their inputs."""
    rng = seeds.rng(grading_seed, "timed runs", *names) if grading_seed is not None else None
    found, scales = [], set()
    while len(found) < count:
        seed = int(rng.integers(0, 2**32)) if rng is not None else secrets.randbits(32)
        if scale_of(seed) not in scales:
            found.append(seed)
            scales.add(scale_of(seed))
    return found


def sample_problem(got, want, positions, rtol: float, atol: float = 0.0) -> str | None:
    """Where the sampled output ``got`` first differs from ``want`` (None: nowhere)."""
    got, want = np.asarray(got, np.float64).ravel(), np.asarray(want, np.float64).ravel()
    if got.shape != want.shape:
        return f"{got.size} values came back for {want.size} sampled positions"
    bad = ~np.isclose(got, want, rtol=rtol, atol=atol)
    if not bad.any():
        return None
    first = int(np.argmax(bad))
    return (f"at flat position {int(np.asarray(positions).ravel()[first])}, expected {want[first]:.7g}, got "
            f"{got[first]:.7g} ({int(bad.sum())} of {bad.size} sampled positions differ)")


def judge(measured: dict, what: str, recheck, *, moved_bytes: float = 0, flops: float = 0,
          dry_run: bool = False) -> Timed:
    """Judge one ``course.gpu_timing.bench`` result (see the module's docstring).
    ``recheck(seed, kept)`` returns None for a right run, else what is wrong with it.
    ``moved_bytes`` and ``flops``: the least DRAM traffic and arithmetic the work needs."""
    record, runs = measured["record"], measured["runs"]
    if bool(record.get("stand_in")) != dry_run:
        raise RuntimeError(
            f"{what} was timed on {record.get('name')!r}, " + (
                "a stand-in device, on the GPU tier: the harness did not find the GPU (is numba's simulator on, "
                "NUMBA_ENABLE_CUDASIM=1?); nothing measured there is a GPU's time" if not dry_run else
                "a real device, in a dry run: a dry run must run on the stand-ins (course.gpu_stand_in)"))
    if not runs:
        raise RuntimeError(f"{what}: no timed run came back")
    if measured.get("flushes", 0) < len(runs):
        raise RuntimeError(f"{what}: the L2 was flushed {measured.get('flushes', 0)} times for {len(runs)} runs")
    for k, run in enumerate(runs, 1):
        problem = recheck(run["seed"], run["kept"])
        if problem:
            raise AssertionError(
                f"{what}: the output of timed run {k} of {len(runs)} is wrong: {problem}. Every timed run gets "
                "new inputs and its output is checked, not only the first: each run must compute its answer "
                "anew, inside the timed window")
    floor, why = floor_seconds(record, moved_bytes, flops)
    for k, run in enumerate(runs, 1):
        if run["seconds"] <= 0 or run["seconds"] < floor:
            raise AssertionError(
                f"refused, not scored: {what} took {run['seconds'] * 1e3:.4g} ms in timed run {k} of {len(runs)}, "
                f"under the {floor * 1e3:.4g} ms that {why} takes on {record.get('name')}. No run can beat the "
                "card's peak: part of the work was not done while the clock ran (skipped, done before the clock "
                "started, or still running when it stopped)")
    return Timed(what, statistics.median(run["seconds"] for run in runs), floor, why, len(runs),
                 measured.get("warmup", 0), measured.get("timer", "events"), bool(record.get("stand_in")))


def expect(passes: bool, dry_run: bool, message: str) -> None:
    """A performance check's pass mark. In a dry run the times are a stand-in's, so the mark
    is not applied; the message is still written, so that writing it is tried too."""
    if not dry_run:
        assert passes, message


def device_line(record: dict) -> str:
    """The record in one line: the card, its compute capability, driver, runtime, libraries."""
    cc = "sm_" + "".join(map(str, record["compute_capability"])) if record.get("compute_capability") else "sm_?"
    libraries = ", ".join(f"{k} {v}" for k, v in record.get("libraries", {}).items())
    return (f"{record.get('name')} ({cc}, driver {record.get('driver')}, runtime {record.get('runtime')}; "
            f"{libraries})")


def metrics(record: dict, **timed: Timed) -> dict:
    """What a performance check reports besides its ratio: each measurement's median and
    floor (ms) and how it was measured, the device in one line, and the whole record."""
    found = {}
    for name, t in timed.items():
        found[f"{name}_ms"] = round(t.median_s * 1e3, 4)
        found[f"{name}_floor_ms"] = round(t.floor_s * 1e3, 4)
    found["measured"] = "; ".join(t.describe() for t in timed.values())
    found["device"] = device_line(record)
    found["record"] = record
    return found
