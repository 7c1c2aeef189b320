"""course.plots.plot_pipeline: one bar per operation, coloured by kind, labelled by microbatch."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402

from course.plots import plot_pipeline  # noqa: E402


def gpipe_timeline(p, m):
    """GPipe with unit forward and backward times, written out by hand:
    F(mb) on device d runs in [mb + d, mb + d + 1); backwards start after the
    last forward, from the last device back."""
    ops = [(d, "F", mb, d, mb + d, mb + d + 1) for d in range(p) for mb in range(m)]
    first_b = m + p - 1
    ops += [(d, "B", mb, d, first_b + mb + (p - 1 - d), first_b + mb + (p - 1 - d) + 1)
            for d in range(p) for mb in range(m)]
    return ops


@pytest.fixture
def ax():
    fig, ax = plt.subplots()
    yield ax
    plt.close(fig)


def bars(ax):
    return [patch for patch in ax.patches if patch.get_width() > 0]


def test_one_bar_per_operation_at_its_place(ax):
    timeline = gpipe_timeline(3, 4)
    plot_pipeline(timeline, ax=ax, title="GPipe")
    drawn = sorted((round(b.get_y() + b.get_height() / 2), b.get_x(), b.get_x() + b.get_width()) for b in bars(ax))
    assert drawn == sorted((d, start, end) for d, _, _, _, start, end in timeline)
    assert ax.get_title() == "GPipe"
    assert ax.get_xlim() == (0, max(op[5] for op in timeline))


def test_forward_and_backward_have_their_own_colours(ax):
    timeline = gpipe_timeline(2, 3)
    plot_pipeline(timeline, ax=ax)
    colour_of = {}
    for bar in bars(ax):
        start = bar.get_x()
        device = round(bar.get_y() + bar.get_height() / 2)
        kind = next(k for d, k, _, _, s, _ in timeline if d == device and s == start)
        colour_of.setdefault(kind, set()).add(tuple(round(c, 4) for c in bar.get_facecolor()[:3]))
    assert colour_of["F"] == {tuple(round(c, 4) for c in to_rgb("C0"))}
    assert colour_of["B"] == {tuple(round(c, 4) for c in to_rgb("C1"))}


def test_microbatch_written_on_each_bar(ax):
    timeline = gpipe_timeline(2, 3)
    plot_pipeline(timeline, ax=ax)
    assert sorted(t.get_text() for t in ax.texts) == sorted(str(op[2]) for op in timeline)


def test_interleaved_chunks_get_different_shades_of_the_same_kind(ax):
    # p = 2 devices, v = 2 chunks: stages 0, 2 on device 0 and 1, 3 on device 1.
    timeline = [(0, "F", 0, 0, 0, 1), (1, "F", 0, 1, 1, 2), (0, "F", 0, 2, 2, 3), (1, "F", 0, 3, 3, 4),
                (1, "B", 0, 3, 4, 5), (0, "B", 0, 2, 5, 6), (1, "B", 0, 1, 6, 7), (0, "B", 0, 0, 7, 8)]
    plot_pipeline(timeline, ax=ax)
    by_start = {b.get_x(): tuple(b.get_facecolor()[:3]) for b in bars(ax)}
    assert len(by_start) == len(timeline)
    assert by_start[0] != by_start[2]          # chunk 0 and chunk 1 forwards differ
    assert by_start[4] != by_start[6]          # and their backwards (stage 3 vs stage 1)
    assert by_start[0] != by_start[7]          # forward and backward of chunk 0 differ
    assert by_start[0] == by_start[1]          # same chunk on the two devices: same shade


def test_rejects_an_empty_timeline():
    with pytest.raises(ValueError, match="empty"):
        plot_pipeline([])


def test_rejects_an_unknown_kind():
    with pytest.raises(ValueError, match="'F', 'B' or 'W'"):
        plot_pipeline([(0, "X", 0, 0, 0.0, 1.0)])


def test_a_split_backward_draws_its_weight_gradient_in_its_own_colour(ax):
    timeline = [(0, "F", 0, 0, 0.0, 1.0), (0, "B", 0, 0, 1.0, 2.0), (0, "W", 0, 0, 2.0, 3.0)]
    plot_pipeline(timeline, ax=ax)
    colours = [tuple(round(c, 4) for c in bar.get_facecolor()[:3]) for bar in sorted(bars(ax), key=lambda b: b.get_x())]
    assert colours == [tuple(round(c, 4) for c in to_rgb(k)) for k in ("C0", "C1", "C2")]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["forward", "backward", "weight gradient"]


def test_the_weight_gradient_joins_the_legend_only_when_drawn(ax):
    plot_pipeline(gpipe_timeline(2, 2), ax=ax)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["forward", "backward"]


def test_draws_on_a_new_figure_without_an_axes():
    drawn = plot_pipeline(gpipe_timeline(2, 2))
    try:
        assert len(bars(drawn)) == 8
        assert [t.get_text() for t in drawn.get_yticklabels()] == ["device 0", "device 1"]
    finally:
        plt.close(drawn.figure)
