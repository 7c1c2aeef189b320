"""Lab 12's hidden check: not in the student repository (lab.toml's ``hidden``),
graded wherever the instructor grades (``k2c grade``, ``grade-class``, Gradescope, CI).

The public checks hold ``zigzag_indices`` to a table of the layouts they use
(``oracles.ZIGZAG``); this one asks for other sequence lengths and rank counts and
compares with the layout computed for any size (``oracles_hidden.zigzag``), which
is what the lab's function returns and so is not released. One sandboxed call
(the harness's ``one_process``, with these queries only).
"""
import pytest

from autograder.grading import seeds
from autograder.grading.checking import load_beside
from autograder.grading.submission import not_implemented_yet

hidden = load_beside(__file__, "oracles_hidden")
public = load_beside(__file__, "oracles")

SIZES = [(32, 4), (12, 3), (40, 5), (6, 3), (64, 8), (20, 2), (30, 1)]  # (seq_len, P), none in the public table


def _sizes(seed):
    """SIZES and three more drawn from the grading's seed: P of 1 to 8, 1 to 8 pairs of chunks
    each, none in the public table."""
    rng, drawn = seeds.rng(seed, "12", "zigzag sizes"), []
    while len(drawn) < 3:
        P = int(rng.integers(1, 9))
        size = (2 * P * int(rng.integers(1, 9)), P)
        if size not in public.ZIGZAG and size not in SIZES + drawn:
            drawn.append(size)
    return SIZES + drawn


@pytest.mark.points(1)
def check_zigzag_layout_on_more_sizes(submission, seed):
    """zigzag_indices gives rank r chunks r and 2P-1-r of 2P for sequence lengths and P the public checks do not try"""
    queries = {"zigzag_indices": [{"seq_len": s, "P": P, "call": f"zigzag_indices({s}, {P})"} for s, P in _sizes(seed)]}
    found = submission.harness_once("one_process_hidden", "one_process", queries)["zigzag_indices"]
    if isinstance(found, dict) and "not_implemented" in found:
        raise not_implemented_yet(found["not_implemented"])
    for query, answer in zip(queries["zigzag_indices"], found):
        if "error" in answer:
            raise AssertionError(f"{query['call']} raised {answer['error']}")
        want = hidden.zigzag(query["seq_len"], query["P"])
        if answer["value"] != want:
            raise AssertionError(f"{query['call']} is {answer['value']}, expected {want}")
