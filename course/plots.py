"""Plots that lectures and handouts share.

Every helper draws on the Axes it is given (or on a new ``(6, 4)`` figure when
``ax`` is None) and returns that Axes, so a notebook can put several of them
side by side and still adjust titles and limits afterwards. Nothing here calls
``plt.show()``; the notebook decides when a figure is shown.

The helpers only *draw*. Fitting a model to measurements is the lecture's (or
the student's) job: :func:`plot_speedup` takes an already fitted ``(f, t1)``.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.ticker import ScalarFormatter

__all__ = [
    "plot_speedup",
    "plot_efficiency",
    "plot_amdahl_family",
    "plot_gustafson_vs_amdahl",
    "plot_reduction_dag",
    "plot_gantt",
    "plot_pipeline",
    "plot_iteration_owners",
]

FIGSIZE = (6, 4)


def _axes(ax: Axes | None, figsize: tuple[float, float] = FIGSIZE) -> Axes:
    if ax is None:
        _, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax


def _seconds(times: Iterable) -> np.ndarray:
    """Accept plain numbers or ``course.timing.Timing`` objects (their median)."""
    return np.array([getattr(t, "median", t) for t in times], dtype=float)


def _amdahl(f: float, p: np.ndarray) -> np.ndarray:
    return 1.0 / (f + (1.0 - f) / p)


def _gustafson(f: float, p: np.ndarray) -> np.ndarray:
    return f + (1.0 - f) * p


def _speedups(p: Sequence, times: Iterable) -> tuple[np.ndarray, np.ndarray]:
    p = np.asarray(p, dtype=float)
    t = _seconds(times)
    if p.shape != t.shape:
        raise ValueError(f"p and times differ in length: {p.size} vs {t.size}")
    if not np.any(p == 1):
        raise ValueError("speedup is T1 / Tp: include at least one measurement at p = 1")
    t1 = float(np.median(t[p == 1]))
    return p, t1 / t


def _worker_ticks(ax: Axes, p_hi: float) -> None:
    if p_hi <= 16:
        ax.set_xticks(np.arange(1, int(p_hi) + 1))


def plot_speedup(p: Sequence, times: Iterable, fit: tuple[float, float] | None = None,
                 ax: Axes | None = None, extrapolate_to: float | None = None,
                 label: str = "measured") -> Axes:
    """Measured speedup ``T1 / Tp`` against the worker count ``p``.

    ``times`` are seconds (or ``Timing`` objects); ``p`` may repeat, one entry
    per run, and ``T1`` is the median of the runs at ``p = 1``. Draws the ideal
    line ``S = p`` and, when ``fit = (f, t1)`` is given, Amdahl's curve
    ``1 / (f + (1 - f) / p)``, dashed beyond the largest measured ``p`` up to
    ``extrapolate_to``.
    """
    ax = _axes(ax)
    p, s = _speedups(p, times)
    p_meas = p.max()
    p_hi = max(p_meas, extrapolate_to or p_meas)
    grid = np.linspace(1, p_hi, 200)
    ax.plot(grid, grid, color="0.6", ls=":", label="ideal $S = p$")
    if fit is not None:
        f = fit[0]
        inside = grid <= p_meas
        line, = ax.plot(grid[inside], _amdahl(f, grid[inside]), color="C1",
                        label=f"Amdahl fit, $f = {f:.3f}$")
        if p_hi > p_meas:
            ax.plot(grid[~inside], _amdahl(f, grid[~inside]), color=line.get_color(), ls="--",
                    label="fit, extrapolated")
    ax.plot(p, s, "o", color="C0", alpha=0.7, label=label)
    ax.set_xlabel("workers $p$")
    ax.set_ylabel("speedup $S_p = T_1 / T_p$")
    ax.set_xlim(0.8, p_hi * 1.05)
    ax.set_ylim(0, max(p_hi, s.max()) * 1.05)
    _worker_ticks(ax, p_hi)
    ax.grid(alpha=0.3)
    ax.legend()
    return ax


def plot_efficiency(p: Sequence, times: Iterable, fit: tuple[float, float] | None = None,
                    ax: Axes | None = None, label: str = "measured") -> Axes:
    """Parallel efficiency ``E_p = T1 / (p Tp)`` against ``p``; 1 is perfect.

    Same arguments as :func:`plot_speedup`; with ``fit = (f, t1)`` Amdahl's
    efficiency ``1 / (p f + 1 - f)`` is drawn too.
    """
    ax = _axes(ax)
    p, s = _speedups(p, times)
    grid = np.linspace(1, p.max(), 200)
    ax.axhline(1.0, color="0.6", ls=":", label="perfect")
    if fit is not None:
        f = fit[0]
        ax.plot(grid, _amdahl(f, grid) / grid, color="C1", label=f"Amdahl fit, $f = {f:.3f}$")
    ax.plot(p, s / p, "o", color="C0", alpha=0.7, label=label)
    ax.set_xlabel("workers $p$")
    ax.set_ylabel("efficiency $E_p = S_p / p$")
    ax.set_ylim(0, 1.15)
    _worker_ticks(ax, p.max())
    ax.grid(alpha=0.3)
    ax.legend()
    return ax


def plot_amdahl_family(fractions: Iterable[float], p_max: int, ax: Axes | None = None) -> Axes:
    """Amdahl speedup ``1 / (f + (1 - f) / p)`` for each serial fraction ``f``,
    for ``p`` from 1 to ``p_max`` on a log-2 axis, with each ceiling ``1 / f``
    dotted in the same colour."""
    ax = _axes(ax)
    p = np.logspace(0, np.log2(p_max), 200, base=2)
    ax.plot(p, p, color="0.6", ls=":", label="ideal $S = p$")
    for i, f in enumerate(fractions):
        color = f"C{i}"
        ax.plot(p, _amdahl(f, p), color=color, label=f"$f = {f:g}$")
        if f > 0 and 1 / f < p_max:
            ax.axhline(1 / f, color=color, ls=":", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(ScalarFormatter())
    ax.set_xlabel("workers $p$")
    ax.set_ylabel("speedup $S_p$")
    ax.set_title("Amdahl: fixed problem size")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    return ax


def plot_gustafson_vs_amdahl(fractions: Iterable[float], p_max: int, ax: Axes | None = None) -> Axes:
    """Amdahl (solid, fixed problem size) against Gustafson (dashed, problem
    grown with ``p``: ``f + (1 - f) p``) for each serial fraction ``f``, on
    linear axes from 1 to ``p_max`` workers."""
    ax = _axes(ax)
    p = np.linspace(1, p_max, 200)
    ax.plot(p, p, color="0.6", ls=":", label="ideal $S = p$")
    for i, f in enumerate(fractions):
        color = f"C{i}"
        ax.plot(p, _amdahl(f, p), color=color, label=f"Amdahl $f = {f:g}$")
        ax.plot(p, _gustafson(f, p), color=color, ls="--", label=f"Gustafson $f = {f:g}$")
    ax.set_xlabel("workers $p$")
    ax.set_ylabel("speedup $S_p$")
    ax.set_title("Fixed size (Amdahl) vs scaled size (Gustafson)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", ncol=2)
    return ax


def plot_reduction_dag(n: int, shape: str = "tree", ax: Axes | None = None) -> Axes:
    """The task graph of summing ``n`` numbers with two-input additions.

    ``shape="chain"`` adds them one after the other (``((x0 + x1) + x2) + ...``);
    ``shape="tree"`` adds neighbours pairwise, level by level. Squares are the
    inputs, circles the additions, arrows the dependencies; the title gives the
    work ``W`` (additions) and the span ``S`` (additions on the longest path).
    """
    if n < 2:
        raise ValueError("need at least two numbers to add")
    if shape not in ("tree", "chain"):
        raise ValueError(f"shape must be 'tree' or 'chain', not {shape!r}")
    ax = _axes(ax)
    # Each node: (x, level). Level 0 are the inputs.
    inputs = [(float(i), 0) for i in range(n)]
    adds: list[tuple[float, int]] = []
    edges: list[tuple[tuple[float, int], tuple[float, int]]] = []
    if shape == "chain":
        acc = inputs[0]
        for i in range(1, n):
            node = (i - 0.5, i)
            edges += [(acc, node), (inputs[i], node)]
            adds.append(node)
            acc = node
    else:
        level, frontier = 0, inputs
        while len(frontier) > 1:
            level += 1
            nxt = []
            for j in range(0, len(frontier) - 1, 2):
                a, b = frontier[j], frontier[j + 1]
                node = ((a[0] + b[0]) / 2, level)
                edges += [(a, node), (b, node)]
                adds.append(node)
                nxt.append(node)
            if len(frontier) % 2:  # an odd one out waits for the next level
                nxt.append(frontier[-1])
            frontier = nxt
    for a, b in edges:
        ax.annotate("", xy=b, xytext=a,
                    arrowprops=dict(arrowstyle="-|>", color="0.5", lw=0.8, shrinkA=6, shrinkB=7))
    ax.plot([x for x, _ in inputs], [y for _, y in inputs], "s", color="C0", ms=10, label="input")
    ax.plot([x for x, _ in adds], [y for _, y in adds], "o", color="C1", ms=11, label="addition")
    for x, y in adds:
        ax.text(x, y, "+", ha="center", va="center", fontsize=9, color="white")
    span = max(y for _, y in adds)
    ax.set_title(f"{shape}: work $W = {len(adds)}$, span $S = {span}$")
    ax.set_ylabel("step (level)")
    ax.set_xticks([])
    ax.set_yticks(range(span + 1))
    ax.invert_yaxis()
    ax.margins(0.08)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    return ax


def plot_gantt(tasks: Iterable[tuple[int, float, float, str]], ax: Axes | None = None,
               worker_label: str = "worker") -> Axes:
    """A schedule as a Gantt chart: one row per worker.

    ``tasks`` holds ``(worker, start, duration, label)`` tuples; the label is
    written on the bar, and bars with the same label share a colour. Worker 0 is
    drawn on top.
    """
    tasks = list(tasks)
    if not tasks:
        raise ValueError("no tasks to draw")
    ax = _axes(ax, figsize=(6, 1.0 + 0.5 * len({t[0] for t in tasks})))
    colors = {}  # one colour per distinct label, in order of appearance
    for worker, start, duration, label in tasks:
        color = colors.setdefault(label, f"C{(len(colors) + 1) % 10}")
        ax.barh(worker, duration, left=start, height=0.6, color=color, edgecolor="black", alpha=0.85)
        if label:
            ax.text(start + duration / 2, worker, label, ha="center", va="center", fontsize=8)
    workers = sorted({t[0] for t in tasks})
    end = max(t[1] + t[2] for t in tasks)
    ax.set_yticks(workers, [f"{worker_label} {w}" for w in workers])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel("time (steps)")
    ax.grid(axis="x", alpha=0.3)
    return ax


PIPELINE_COLORS = {"F": "C0", "B": "C1", "W": "C2"}  # forward blue, backward orange, weight gradient green


def _shade(color: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """``color`` for model chunk ``chunk`` of ``chunks``: the first chunk lightest,
    the last darkest (the plain colour in the middle); one chunk keeps it plain."""
    rgb = np.array(to_rgb(color))
    if chunks == 1:
        return tuple(rgb)
    mix = -0.45 + 0.9 * chunk / (chunks - 1)  # -0.45 (towards white) .. 0.45 (towards black)
    target = np.zeros(3) if mix > 0 else np.ones(3)
    return tuple(rgb + abs(mix) * (target - rgb))


def plot_pipeline(timeline: Iterable[tuple], ax: Axes | None = None, title: str | None = None) -> Axes:
    """A pipeline schedule's timeline as a Gantt chart: one row per device.

    ``timeline`` holds ``(device, kind, microbatch, stage, start, end)`` tuples:
    ``kind`` is ``"F"`` (forward, blue), ``"B"`` (backward, orange) or, when the
    backward is split, ``"W"`` (its weight-gradient half, green), ``stage``
    the model stage ``0 .. p*v - 1`` that ran (it lives on device ``stage % p``).
    With interleaving (``v > 1`` model chunks per device) chunk ``stage // p``
    picks a lighter (first chunk) or darker (last) shade of the kind's colour.
    The microbatch number is written on each bar; the bubbles are the gaps.
    Device 0 is drawn on top.
    """
    ops = list(timeline)
    if not ops:
        raise ValueError("no operations to draw: the timeline is empty")
    for op in ops:
        if len(op) != 6 or op[1] not in PIPELINE_COLORS:
            raise ValueError(f"expected (device, 'F', 'B' or 'W', microbatch, stage, start, end), got {op!r}")
    devices = sorted({op[0] for op in ops})
    p = max(devices) + 1
    chunks = max(op[3] for op in ops) // p + 1
    ax = _axes(ax, figsize=(8, 0.8 + 0.45 * len(devices)))
    end = max(op[5] for op in ops)
    for device, kind, microbatch, stage, start, stop in ops:
        ax.barh(device, stop - start, left=start, height=0.7, edgecolor="black", linewidth=0.5,
                color=_shade(PIPELINE_COLORS[kind], stage // p, chunks))
        ax.text((start + stop) / 2, device, str(microbatch), ha="center", va="center", fontsize=7,
                clip_on=True)
    handles = [plt.Rectangle((0, 0), 1, 1, color=PIPELINE_COLORS[k], label=name)
               for k, name in (("F", "forward"), ("B", "backward"), ("W", "weight gradient"))
               if k != "W" or any(op[1] == "W" for op in ops)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    ax.set_yticks(devices, [f"device {d}" for d in devices])
    ax.set_ylim(max(devices) + 0.6, min(devices) - 0.6)
    ax.set_xlim(0, end)
    ax.set_xlabel("time")
    ax.grid(axis="x", alpha=0.3)
    if title is not None:
        ax.set_title(title)
    return ax


def plot_iteration_owners(owner: Sequence[int], ax: Axes | None = None) -> Axes:
    """Which thread ran each loop iteration: a strip coloured by thread id.

    ``owner[i]`` is the id of the thread that executed iteration ``i`` (for
    example recorded with ``numba.get_thread_id()`` inside a ``prange`` loop).
    """
    ax = _axes(ax, figsize=(6, 1.8))
    owner = np.asarray(owner)
    ids = np.unique(owner)
    cmap = plt.get_cmap("tab10", max(len(ids), 1))
    codes = np.searchsorted(ids, owner)
    ax.imshow(codes[np.newaxis, :], aspect="auto", cmap=cmap, vmin=-0.5, vmax=len(ids) - 0.5,
              interpolation="nearest", extent=(0, owner.size, 0, 1))
    for tid in ids:
        where = np.flatnonzero(owner == tid)
        ax.text(where.mean() + 0.5, 0.5, f"thread {tid}", ha="center", va="center",
                color="white", fontsize=9, fontweight="bold")
    ax.set_yticks([])
    ax.set_xlabel("loop iteration $i$")
    return ax
