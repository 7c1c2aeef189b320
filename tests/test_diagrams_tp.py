"""The tensor-parallel pictures of lecture 10 (course.diagrams): each rank's blocks are drawn
in its own colour, whole tensors in the 'whole' colour, and f/g where the communication is."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

from course import diagrams  # noqa: E402


def faces(ax):
    return [to_hex(p.get_facecolor()) for p in ax.patches]


def texts(ax):
    return [t.get_text() for t in ax.texts]


@pytest.fixture
def ax():
    fig, ax = plt.subplots()
    yield ax
    plt.close(fig)


@pytest.mark.parametrize("t", [2, 4])
def test_column_parallel_splits_weight_and_output_by_rank(ax, t):
    diagrams.draw_tp_linear("column", t, ax)
    colours = faces(ax)
    for r in range(t):  # one block of A and one of Y per rank
        assert colours.count(to_hex(diagrams._block_colour(r))) == 2
        assert f"A{diagrams._sub(r)}" in texts(ax) and f"Y{diagrams._sub(r)}" in texts(ax)
    assert colours.count(diagrams.WHOLE_COLOUR) == 1  # X, whole on every rank


@pytest.mark.parametrize("t", [2, 4])
def test_row_parallel_has_partial_sums_and_an_all_reduce(ax, t):
    diagrams.draw_tp_linear("row", t, ax)
    colours = faces(ax)
    for r in range(t):  # a block of X, a block of A and a full-size partial sum per rank
        assert colours.count(to_hex(diagrams._block_colour(r))) == 3
    assert "g: all-reduce" in texts(ax)
    assert colours.count(diagrams.WHOLE_COLOUR) == 1  # Y after the all-reduce


def test_linear_kind_is_checked(ax):
    with pytest.raises(ValueError, match="column"):
        diagrams.draw_tp_linear("diagonal", 2, ax)


@pytest.mark.parametrize("t", [1, 2, 4])
def test_mlp_lanes_have_f_before_and_g_after(ax, t):
    diagrams.draw_tp_mlp(t, ax)
    labels = texts(ax)
    assert labels.count("f") == 1 and labels.count("g") == 1
    assert labels.index("f") < labels.index("g")
    assert [f"rank {r}" for r in range(t)] == [x for x in labels if x.startswith("rank ")]
    for r in range(t):  # Y_r and Z_r in rank r's colour
        assert faces(ax).count(to_hex(diagrams._block_colour(r))) == 2


def test_attention_gives_each_rank_its_heads(ax):
    diagrams.draw_tp_attention(2, heads=4, ax=ax)
    labels = "\n".join(texts(ax))
    assert "Q, K, V of heads 0–1" in labels and "Q, K, V of heads 2–3" in labels
    assert "2 heads per rank" in ax.get_title()
    with pytest.raises(ValueError, match="do not split"):
        diagrams.draw_tp_attention(3, heads=4, ax=ax)
