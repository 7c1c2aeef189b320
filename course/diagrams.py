"""Pictures of the CUDA programming model, drawn with matplotlib.

Each function draws on the ``ax`` it is given (or on a new, small figure) and
returns that Axes, so a notebook cell can add a title or put several drawings
side by side.

- :func:`draw_launch_1d` -- which thread of which block touches which element
  of a 1-D array, and which threads the guard leaves idle;
- :func:`draw_launch_2d` -- a 2-D grid of blocks laid over a matrix, with the
  grid's *x* along the columns and *y* along the rows;
- :func:`draw_warps` -- how the threads of one block are cut into warps of 32;
- :func:`plot_roofline` -- attainable performance ``P = min(P_peak, I * B)``.
- :func:`plot_stream_timeline` -- which engine of a GPU ran which chunk when
  (a timeline from :mod:`course.streams`).
"""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

IDLE_COLOUR = "#d9d9d9"
MISSED_EDGE = "#c0392b"


# Light colours (ColorBrewer Set3 without its grey) so black labels stay legible.
BLOCK_COLOURS = ["#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462",
                 "#b3de69", "#fccde5", "#bc80bd", "#ccebc5", "#ffed6f"]


def _block_colour(k: int):
    return BLOCK_COLOURS[k % len(BLOCK_COLOURS)]


def _new_axes(ax, size):
    if ax is None:
        _, ax = plt.subplots(figsize=size, layout="constrained")
    return ax


def _cell(ax, x, y, face, hatch=None, edge="white", lw=1.0):
    ax.add_patch(Rectangle((x, y), 1, 1, facecolor=face, edgecolor=edge,
                           hatch=hatch, linewidth=lw))


def draw_launch_1d(n: int, threads_per_block: int, blocks: int | None = None,
                   ax=None, cells_per_row: int | None = None):
    """Draw a 1-D launch over an array of ``n`` elements.

    Each cell is one thread of the grid, coloured by its block and labelled
    ``b.t`` (``blockIdx.x`` and ``threadIdx.x``) above the element index it
    touches. Threads whose global index is ``>= n`` are grey and marked
    *idle*: the guard ``if i < n`` stops them. ``blocks`` defaults to the
    smallest count that covers the array; pass a smaller one to see elements
    that no thread touches (red outline, *missed*).

    Long launches wrap into rows of ``cells_per_row`` cells (by default one
    block per row once the grid has more than 24 threads).
    """
    if blocks is None:
        blocks = max(1, math.ceil(n / threads_per_block))
    launched = blocks * threads_per_block
    total = max(n, launched)
    if cells_per_row is None:
        cells_per_row = total if total <= 24 else threads_per_block
    rows = math.ceil(total / cells_per_row)
    ax = _new_axes(ax, (min(0.45 * cells_per_row + 1.0, 11), 0.55 * rows + 0.8))
    font = 8 if cells_per_row <= 16 else 6 if cells_per_row <= 32 else 4
    for g in range(total):
        x, y = g % cells_per_row, g // cells_per_row
        if g >= launched:  # an element that no thread reaches
            _cell(ax, x, y, "white", edge=MISSED_EDGE, lw=1.5)
            ax.text(x + 0.5, y + 0.5, f"{g}\nmissed", ha="center", va="center",
                    fontsize=font - 1, color=MISSED_EDGE)
            continue
        b, t = divmod(g, threads_per_block)
        if g >= n:  # a thread past the end of the data
            _cell(ax, x, y, IDLE_COLOUR, hatch="///")
            ax.text(x + 0.5, y + 0.5, f"{b}.{t}\nidle", ha="center", va="center",
                    fontsize=font - 1, color="#555555")
        else:
            _cell(ax, x, y, _block_colour(b))
            ax.text(x + 0.5, y + 0.5, f"{b}.{t}\n[{g}]", ha="center", va="center",
                    fontsize=font)
    ax.set_xlim(0, cells_per_row)
    ax.set_ylim(rows, 0)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    for side in ax.spines.values():
        side.set_visible(False)
    idle = max(0, launched - n)
    missed = max(0, n - launched)
    note = f", {missed} elements missed" if missed else f", {idle} idle"
    ax.set_title(f"n = {n}: {blocks} blocks × {threads_per_block} threads"
                 f" = {launched} threads{note}   (cell: block.thread / [element])",
                 fontsize=8)
    return ax


def draw_launch_2d(shape: tuple[int, int], block: tuple[int, int], ax=None,
                   label_threads: bool | None = None):
    """Draw a 2-D launch over a matrix of ``shape = (rows, cols)``.

    ``block = (bx, by)``: ``bx`` threads along *x*, which runs along the
    columns ``j``; ``by`` threads along *y*, which runs along the rows ``i``.
    The grid has ``ceil(cols / bx) × ceil(rows / by)`` blocks. Cells are
    coloured by block; hatched grey cells lie outside the matrix: threads the
    guard leaves idle. Small drawings label each cell with its
    ``threadIdx.x,threadIdx.y``; large ones label each block with its
    ``blockIdx.x,blockIdx.y``.
    """
    rows, cols = shape
    bx, by = block
    gx, gy = math.ceil(cols / bx), math.ceil(rows / by)
    width, height = gx * bx, gy * by
    if label_threads is None:
        label_threads = width * height <= 160
    scale = 0.42 if label_threads else 4.5 / max(width, height)
    ax = _new_axes(ax, (min(scale * width + 1.2, 8), min(scale * height + 1.0, 5.5)))
    for bid_y in range(gy):
        for bid_x in range(gx):
            x0, y0 = bid_x * bx, bid_y * by
            w_in, h_in = min(bx, cols - x0), min(by, rows - y0)
            ax.add_patch(Rectangle((x0, y0), bx, by, facecolor=IDLE_COLOUR,
                                   edgecolor="white", hatch="///", linewidth=0))
            if w_in > 0 and h_in > 0:
                ax.add_patch(Rectangle((x0, y0), w_in, h_in, linewidth=0,
                                       facecolor=_block_colour(bid_y * gx + bid_x)))
            if not label_threads and w_in > 0 and h_in > 0:
                ax.text(x0 + w_in / 2, y0 + h_in / 2, f"{bid_x},{bid_y}", ha="center",
                        va="center", fontsize=7)
            ax.add_patch(Rectangle((x0, y0), bx, by, fill=False, edgecolor="black",
                                   linewidth=1.2))
    if label_threads:
        font = 6 if width <= 12 else 5
        for i in range(height):
            for j in range(width):
                inside = i < rows and j < cols
                ax.add_patch(Rectangle((j, i), 1, 1, fill=False, edgecolor="white",
                                       linewidth=0.6))
                ax.text(j + 0.5, i + 0.5, f"{j % bx},{i % by}", ha="center",
                        va="center", fontsize=font,
                        color="black" if inside else "#666666")
    ax.add_patch(Rectangle((0, 0), cols, rows, fill=False, edgecolor="black",
                           linewidth=2.2, linestyle="--"))
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.set_aspect("equal")
    ax.xaxis.set_label_position("top")
    ax.xaxis.tick_top()
    if label_threads:
        ax.set_xticks([x + 0.5 for x in range(width)], [str(x) for x in range(width)])
        ax.set_yticks([y + 0.5 for y in range(height)], [str(y) for y in range(height)])
    else:
        ax.set_xticks([b * bx for b in range(gx + 1)])
        ax.set_yticks([b * by for b in range(gy + 1)])
    ax.tick_params(length=0, labelsize=6)
    ax.set_xlabel("j (column) = blockIdx.x·blockDim.x + threadIdx.x   →  grid x",
                  fontsize=7)
    ax.set_ylabel("i (row)  ↓  grid y", fontsize=7)
    what = "threadIdx.x,threadIdx.y" if label_threads else "blockIdx.x,blockIdx.y"
    ax.set_title(f"matrix {rows}×{cols} (dashed), block ({bx}, {by}), grid ({gx}, {gy})"
                 f"\ngrey = idle threads; labels: {what}", fontsize=7)
    return ax


def draw_warps(threads_per_block: int, warp_size: int = 32, ax=None):
    """Draw one block's threads cut into warps of ``warp_size`` lanes.

    A warp always occupies all of its lanes; when ``threads_per_block`` is not
    a multiple of the warp size, the last warp's spare lanes (grey) run
    nothing but still take a slot.
    """
    warps = math.ceil(threads_per_block / warp_size)
    ax = _new_axes(ax, (7, 0.28 * warps + 0.9))
    for w in range(warps):
        for lane in range(warp_size):
            t = w * warp_size + lane
            if t < threads_per_block:
                _cell(ax, lane, w, _block_colour(w), edge="white", lw=0.5)
            else:
                _cell(ax, lane, w, IDLE_COLOUR, hatch="///", edge="white", lw=0.5)
    ax.set_xlim(0, warp_size)
    ax.set_ylim(warps, 0)
    ax.set_yticks([w + 0.5 for w in range(warps)], [f"warp {w}" for w in range(warps)],
                  fontsize=7)
    ax.set_xticks([0.5, warp_size - 0.5], ["lane 0", f"lane {warp_size - 1}"], fontsize=7)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    spare = warps * warp_size - threads_per_block
    ax.set_title(f"{threads_per_block} threads per block → {warps} warps of {warp_size};"
                 f" {spare} lanes wasted", fontsize=8)
    return ax


def _flops(p: float) -> str:
    return f"{p / 1e12:.3g} TFLOP/s" if p >= 1e12 else f"{p / 1e9:.3g} GFLOP/s"


def plot_roofline(peak_flops: float, bandwidth: float, kernels: dict[str, float],
                  ax=None, label: str | None = None, color: str = "C0",
                  intensity_range: tuple[float, float] | None = None):
    """Plot the roofline ``P = min(peak_flops, I * bandwidth)`` on log-log axes.

    ``peak_flops`` in FLOP/s, ``bandwidth`` in bytes/s, ``kernels`` maps a
    name to its arithmetic intensity ``I`` in flop/byte. Each kernel is drawn
    on the roof at the best performance it can reach; the ridge point
    ``I* = peak_flops / bandwidth`` (left of it: memory bound, right of it:
    compute bound) is marked. Call again on the same ``ax`` to add a second
    roof, e.g. a measured bandwidth next to a datasheet one. The y axis is in
    GFLOP/s.
    """
    ax = _new_axes(ax, (6, 3.6))
    ridge = peak_flops / bandwidth
    roofs = [line for line in ax.get_lines() if line.get_gid() == "roof"]
    if intensity_range is None and roofs:  # share the first roof's x range
        intensity_range = (min(roofs[0].get_xdata()), max(roofs[0].get_xdata()))
    lo, hi = intensity_range or (
        min([ridge / 100] + [v / 3 for v in kernels.values()]),
        max([ridge * 30] + [v * 3 for v in kernels.values()]))
    points = [lo * (hi / lo) ** (k / 200) for k in range(201)]
    attain = [min(peak_flops, i * bandwidth) / 1e9 for i in points]
    ax.loglog(points, attain, color=color, linewidth=2, gid="roof",
              label=label or f"roof: {peak_flops / 1e12:g} TFLOP/s, "
                             f"{bandwidth / 1e12:g} TB/s")
    ax.axvline(ridge, color=color, linestyle=":", linewidth=1)
    ax.annotate(f"ridge I* = {ridge:.3g} flop/B", (ridge, 0.0),
                xycoords=("data", "axes fraction"), xytext=(4, 6 + 12 * len(roofs)),
                textcoords="offset points", fontsize=7, color=color)
    placed: list[float] = []
    for k, (name, intensity) in enumerate(kernels.items()):
        p = min(peak_flops, intensity * bandwidth)
        ax.plot([intensity], [p / 1e9], "o", color=f"C{(k + 1) % 10}", markersize=6,
                markeredgecolor="black", zorder=3)
        crowd = sum(1 for q in placed if max(q, intensity) / min(q, intensity) < 4)
        placed.append(intensity)
        right_of_ridge = intensity > ridge  # label below-left under the flat roof
        ax.annotate(f"{name}: I = {intensity:.3g} flop/B\nP ≤ {_flops(p)}",
                    (intensity, p / 1e9),
                    xytext=(-8 if right_of_ridge else 8, -22 - 24 * crowd),
                    ha="right" if right_of_ridge else "left",
                    textcoords="offset points", fontsize=7,
                    arrowprops=dict(arrowstyle="-", linewidth=0.5, color="grey"))
    if not roofs:  # room below for the labels, above for the flat roof
        bottom, top = ax.get_ylim()
        ax.set_ylim(bottom / 3, max(top, peak_flops / 1e9 * 3))
    ax.set_xlabel("arithmetic intensity I (flop / byte)")
    ax.set_ylabel("attainable P (GFLOP/s)")
    ax.grid(True, which="major", linewidth=0.3)
    ax.legend(fontsize=7, loc="upper left")
    return ax


ENGINE_NAMES = {"h2d": "H→D copy", "copy": "copy (both ways)", "compute": "compute", "d2h": "D→H copy"}


def plot_stream_timeline(spans, ax=None, title: str | None = None):
    """A :func:`course.streams.timeline` as a Gantt chart: one row per engine,
    one colour per chunk, the chunk's number on each bar.

    ``spans`` are :class:`course.streams.Span` objects or the dicts of a
    ``RecordingStreams.report()``.
    """
    from course.plots import plot_gantt

    spans = [s if isinstance(s, dict) else vars(s) for s in spans]
    rows = [e for e in ENGINE_NAMES if any(s["engine"] == e for s in spans)]
    tasks = [(rows.index(s["engine"]), s["start"], s["end"] - s["start"], str(s["chunk"])) for s in spans]
    ax = plot_gantt(tasks, ax=ax)
    ax.set_yticks(range(len(rows)), [ENGINE_NAMES[e] for e in rows])
    ax.set_xlabel("time (s, model GPU)")
    if title:
        ax.set_title(title, fontsize=9)
    return ax


# --- tensor parallelism (module 10): who holds which block -------------------------------------------

WHOLE_COLOUR = "#eeeeee"  # a tensor every rank holds whole
_SUBSCRIPTS = str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉")


def _sub(r: int) -> str:
    return str(r).translate(_SUBSCRIPTS)


def _matrix(ax, x, y, w, h, t, split, name, note=""):
    """A matrix as a ``w``×``h`` box at (x, y), cut into ``t`` blocks along
    ``split`` ("cols", "rows", or None: whole on every rank), each block coloured
    by the rank that holds it and labelled ``name`` with the rank's subscript."""
    if split is None:
        ax.add_patch(Rectangle((x, y), w, h, facecolor=WHOLE_COLOUR, edgecolor="black", lw=1.2))
        ax.text(x + w / 2, y + h / 2, name, ha="center", va="center", fontsize=9)
    for r in range(t if split else 0):
        bx, by, bw, bh = ((x + r * w / t, y, w / t, h) if split == "cols" else
                          (x, y + h - (r + 1) * h / t, w, h / t))
        ax.add_patch(Rectangle((bx, by), bw, bh, facecolor=_block_colour(r), edgecolor="black", lw=0.8))
        ax.text(bx + bw / 2, by + bh / 2, f"{name}{_sub(r)}", ha="center", va="center", fontsize=8)
    if note:
        ax.text(x + w / 2, y - 0.15, note, ha="center", va="top", fontsize=7)


def _finish(ax, title):
    ax.set_aspect("equal")
    ax.autoscale_view()
    ax.axis("off")
    ax.set_title(title, fontsize=8)
    return ax


def draw_tp_linear(kind: str, t: int = 2, ax=None):
    """A linear layer Y = X·A split over ``t`` ranks, Megatron style (A is
    ``nn.Linear``'s weight transposed), each block coloured by its rank.

    ``kind="column"``: A is cut into column blocks; every rank holds the whole
    X (f copies it in) and computes its column block Y_r = X·A_r — no
    communication. ``kind="row"``: X and A are cut to match (X's columns,
    A's rows); rank r computes a full-size partial sum X_r·A_r and g
    all-reduces the partials into Y.
    """
    if kind not in ("column", "row"):
        raise ValueError(f"kind must be 'column' or 'row', got {kind!r}")
    ax = _new_axes(ax, (7, 2.4))
    if kind == "column":
        _matrix(ax, 0, 0, 1.5, 2, t, None, "X", "[sb, h]\nwhole on every rank")
        ax.text(1.85, 1, "·", fontsize=16, ha="center", va="center")
        _matrix(ax, 2.2, 0, 4, 2, t, "cols", "A", "[h, 4h]: column blocks")
        ax.text(6.6, 1, "=", fontsize=14, ha="center", va="center")
        _matrix(ax, 7, 0, 4, 2, t, "cols", "Y", "[sb, 4h]: rank r holds Y_r = X·A_r")
        return _finish(ax, f"column-parallel linear, t = {t}: no communication in forward "
                           "(f before it all-reduces ∂L/∂X in backward)")
    _matrix(ax, 0, 0, 4, 2, t, "cols", "X", "[sb, 4h]: column blocks")
    ax.text(4.35, 1, "·", fontsize=16, ha="center", va="center")
    _matrix(ax, 4.7, -1, 1.5, 4, t, "rows", "A", "[4h, h]: row blocks")
    ax.text(6.6, 1, "=", fontsize=14, ha="center", va="center")
    for r in reversed(range(t)):  # the partial sums, one full-size [sb, h] on each rank, fanned out
        ax.add_patch(Rectangle((7 + 0.18 * r, 0.18 * r), 1.5, 2, facecolor=_block_colour(r), edgecolor="black", lw=0.8))
    ax.text(7.75, 1, "X₀A₀" if t == 1 else "partial\nX_r·A_r", ha="center", va="center", fontsize=8)
    ax.text(7.75 + 0.09 * t, -0.15, "[sb, h] on each rank", ha="center", va="top", fontsize=7)
    ax.annotate("", (10.6, 1), (8.8 + 0.18 * t, 1), arrowprops=dict(arrowstyle="->", lw=1.2))
    ax.text(9.7 + 0.09 * t, 1.15, "g: all-reduce", ha="center", va="bottom", fontsize=8)
    _matrix(ax, 10.7, 0, 1.5, 2, t, None, "Y", "Σ_r X_r·A_r\nwhole on every rank")
    return _finish(ax, f"row-parallel linear, t = {t}: one all-reduce of [sb, h] in forward (g)")


def _draw_lanes(ax, t, stages, title):
    """One lane per rank, left to right through ``stages``: ("whole", label) — a box
    every rank holds whole; ("shard", label) — a box whose content is rank r's own
    (``{r}`` in the label becomes the rank's subscript, ``{heads}`` its heads);
    ("op", name, forward, backward) — a communication operator across all lanes."""
    x, lane_h, gap = 0.0, 1.0, 0.35
    top = t * (lane_h + gap) - gap
    for stage in stages:
        if stage[0] == "op":
            _, name, fwd, bwd = stage
            ax.add_patch(Rectangle((x, -0.1), 0.55, top + 0.2, facecolor="#555555", edgecolor="black"))
            ax.text(x + 0.275, top / 2, name, ha="center", va="center", fontsize=12, color="white",
                    fontweight="bold")
            ax.text(x + 0.275, -0.25, f"fwd: {fwd}\nbwd: {bwd}", ha="center", va="top", fontsize=6.5)
            x += 0.85
            continue
        kind, label = stage
        for r in range(t):
            y = (t - 1 - r) * (lane_h + gap)
            face = WHOLE_COLOUR if kind == "whole" else _block_colour(r)
            ax.add_patch(Rectangle((x, y), 2.1, lane_h, facecolor=face, edgecolor="black", lw=0.8))
            ax.text(x + 1.05, y + lane_h / 2, label(r) if callable(label) else label,
                    ha="center", va="center", fontsize=7)
        x += 2.4
    for r in range(t):
        ax.text(-0.2, (t - 1 - r) * (lane_h + gap) + lane_h / 2, f"rank {r}", ha="right", va="center", fontsize=8)
    return _finish(ax, title)



def draw_tp_mlp(t: int = 2, ax=None):
    """The Megatron MLP on ``t`` ranks: column-parallel A (rank r: Y_r = GeLU(X·A_r),
    a block of the hidden 4h), then row-parallel B (a partial sum Y_r·B_r of the
    whole output), so the only communication is f before and g after."""
    ax = _new_axes(ax, (9, 0.9 * t + 1.2))
    stages = [("whole", "X  [sb, h]"), ("op", "f", "identity", "all-reduce"),
              ("shard", lambda r: f"Y{_sub(r)} = GeLU(X·A{_sub(r)})\n[sb, 4h/t]"),
              ("shard", lambda r: f"Z{_sub(r)} = Y{_sub(r)}·B{_sub(r)}\npartial, [sb, h]"),
              ("op", "g", "all-reduce", "identity"), ("whole", "Z = Σ_r Z_r  [sb, h]")]
    return _draw_lanes(ax, t, stages, f"parallel MLP, t = {t}: column-parallel A, then row-parallel B "
                                      "— nothing to communicate between them")


def draw_tp_attention(t: int = 2, heads: int = 4, ax=None):
    """Self-attention on ``t`` ranks with the ``heads`` split: rank r computes Q, K
    and V of its heads (column-parallel), attends within them (heads never look at
    each other), and multiplies by its rows of the output projection (row-parallel)."""
    if heads % t:
        raise ValueError(f"{heads} heads do not split over {t} ranks")
    ax = _new_axes(ax, (9, 0.9 * t + 1.2))
    per = heads // t

    def own(r):
        first = r * per
        return f"heads {first}" if per == 1 else f"heads {first}–{first + per - 1}"

    stages = [("whole", "X  [sb, h]"), ("op", "f", "identity", "all-reduce"),
              ("shard", lambda r: f"Q, K, V of {own(r)}\n[sb, 3h/t]"),
              ("shard", lambda r: f"softmax(QKᵀ/√d)·V\n{own(r)}: [sb, h/t]"),
              ("shard", lambda r: f"·B{_sub(r)} (rows of W_O)\npartial, [sb, h]"),
              ("op", "g", "all-reduce", "identity"), ("whole", "out = Σ_r  [sb, h]")]
    return _draw_lanes(ax, t, stages, f"parallel self-attention, t = {t}, {heads} heads: "
                                      f"{per} head{'s' if per > 1 else ''} per rank")
