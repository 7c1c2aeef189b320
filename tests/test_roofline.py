"""One roofline (issue 45): lectures 08-13 and lab 13's planner take their compute/communication
thresholds from ``course.roofline``, and its functions give the numbers the lectures teach.

Cheap: the notebooks are read, not run (nbval runs them); the planner is imported once.
Lecture 11 has no such threshold (a pipeline pays with its bubble, not a hidden collective).
"""
import ast
import importlib.util
import json
from pathlib import Path

import pytest

from course import roofline

ROOT = Path(__file__).resolve().parents[1]
LECTURES = ROOT / "course" / "lectures"
H100, NVLINK, CARD = 989e12, 450e9, 50e9

# The cells that assert a threshold, found by a line of what they assert, and the course.roofline
# functions each must use itself (not a copy of the formula).
THRESHOLD_CELLS = {
    "08": {'round(thresholds["H100 SXM, across nodes, hierarchical (8 x 50 GB/s)"]) == 2472':
           {"dp_tokens", "flat_ring", "hierarchical"},
           "largest == {2: 1696, 4: 848}": {"dp_tokens", "hierarchical"}},
    "09": {"round(across) == 2472": {"zero3_tokens", "dp_tokens", "flat_ring", "hierarchical"},
           "abs(zero3_comm / dp_comm - 1.5)": {"zero3_tokens", "dp_tokens"}},
    "10": {'int(widest["mlp"]) == 14': {"tp_widest"},
           "t − 1 = F·W/C": {"tp_widest"}},
    "12": {"round(hiding_shard(1e15, 50e9)) == 20000": {"cp_ring_shard"}},
    "13": {"np.isclose(hierarchical, 1312.5)": {"dp_tokens", "zero3_tokens", "flat_ring", "hierarchical"},
           "assert (math_s >= comm_s) == (t <= widest[name][\"attention\"])": {"tp_widest"},
           "np.isclose(2 / 3 * needed[\"flat\"], 7500)": {"dp_tokens", "zero3_tokens", "ring_allreduce_s"},
           "round(zero3_hierarchical) == 2434": {"zero3_tokens", "flat_ring", "hierarchical",
                                                 "hierarchical_allreduce_s", "ring_allreduce_s", "tp_widest"}},
}
PUBLIC = {name for name, value in vars(roofline).items() if callable(value) and not name.startswith("_")}


def _lecture(number):
    return next(LECTURES.glob(f"{number}-*.ipynb"))


def _code_cells(number):
    cells = json.loads(_lecture(number).read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def _tree(source):
    """The cell as Python: IPython magics (``%%needs_lab``, ``%matplotlib``) left out."""
    return ast.parse("\n".join(line for line in source.splitlines() if not line.lstrip().startswith("%")))


def _roofline_uses(tree):
    """The names the cell takes from ``roofline.``: called, or passed on to be called."""
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "roofline"}


def _imports_roofline(tree):
    return any(isinstance(node, ast.ImportFrom) and node.module == "course" and "roofline" in {a.name for a in node.names}
               for node in ast.walk(tree))


@pytest.mark.parametrize("number", sorted(THRESHOLD_CELLS))
def test_a_lectures_threshold_cells_call_course_roofline(number):
    cells = _code_cells(number)
    assert any(_imports_roofline(_tree(c)) for c in cells), f"lecture {number} never imports course.roofline"
    for key, needed in THRESHOLD_CELLS[number].items():
        holding = [c for c in cells if key in c]
        assert len(holding) == 1, f"lecture {number}: {len(holding)} code cells assert {key!r}"
        missing = needed - _roofline_uses(_tree(holding[0]))
        assert not missing, f"lecture {number}: the cell asserting {key!r} does not use roofline.{missing}"
    for cell in cells:   # one derivation: no lecture keeps its own copy of a roofline function
        defined = {n.name for n in ast.walk(_tree(cell)) if isinstance(n, ast.FunctionDef)}
        assert not defined & PUBLIC, f"lecture {number} defines its own {defined & PUBLIC}"


def test_the_lecture_helpers_and_the_planner_use_the_one_module():
    for helper in LECTURES.glob("*_examples.py"):
        defined = {n.name for n in ast.walk(ast.parse(helper.read_text())) if isinstance(n, ast.FunctionDef)}
        assert not defined & PUBLIC, f"{helper.name} defines its own {defined & PUBLIC}"
    tp_examples = ast.parse((LECTURES / "tp_examples.py").read_text())
    assert any(isinstance(n, ast.ImportFrom) and n.module == "course.roofline" and
               "tp_widest" in {a.name for a in n.names} for n in tp_examples.body)
    path = ROOT / "solutions" / "13-hybrid-parallel" / "planner.py"
    spec = importlib.util.spec_from_file_location("lab13_planner_under_test_roofline", path)
    planner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(planner)
    assert planner.ring_allreduce_s is roofline.ring_allreduce_s


def test_the_collectives():
    alpha, beta = 1e-5, 1 / 25e9
    assert roofline.ring_allreduce_s(8e6, 1, alpha, beta) == 0.0
    assert roofline.ring_allreduce_s(8e6, 4, alpha, beta) == pytest.approx(6 * (alpha + beta * 2e6))
    assert roofline.reduce_scatter_s(8e6, 4, alpha, beta) + roofline.all_gather_s(8e6, 4, alpha, beta) == \
        pytest.approx(roofline.ring_allreduce_s(8e6, 4, alpha, beta))
    inside, across = (5e-6, 1 / 450e9), (1e-5, 1 / 50e9)
    phases = (roofline.reduce_scatter_s(1e9, 8, *inside) + roofline.all_gather_s(1e9, 8, *inside),
              roofline.ring_allreduce_s(1e9 / 8, 64, *across))
    assert roofline.hierarchical_allreduce_s(1e9, 8, 64, inside, across) == pytest.approx(sum(phases))
    assert roofline.hierarchical_allreduce_s(1e9, 8, 64, inside, across, streamed=True) == pytest.approx(max(phases))
    assert roofline.flat_ring(50e9, devices=512) == pytest.approx(2 * 511 / 512 / 50e9)
    assert roofline.hierarchical(NVLINK, CARD, per_node=8, nodes=10**6) == pytest.approx(
        roofline.hierarchical(NVLINK, CARD, per_node=8), rel=1e-5)


def test_the_lectures_numbers():
    # lecture 08: C/W, inside a node, hierarchical and flat across nodes; float32 gradients double it
    assert round(roofline.dp_tokens(H100, roofline.flat_ring(NVLINK))) == 2198
    assert round(roofline.dp_tokens(H100, roofline.hierarchical(NVLINK, CARD, per_node=8))) == 2472
    assert round(roofline.dp_tokens(H100, roofline.flat_ring(CARD))) == 19780
    assert roofline.dp_tokens(H100, roofline.flat_ring(CARD), bytes_per_number=4) == \
        2 * roofline.dp_tokens(H100, roofline.flat_ring(CARD))
    # the threshold is where backward's arithmetic lasts as long as the ring all-reduce of the gradients
    psi, d = 7e9, 16
    t = roofline.dp_tokens(H100, roofline.flat_ring(CARD, devices=d))
    assert 4 * psi * t / H100 == pytest.approx(roofline.ring_allreduce_s(2 * psi, d, 0.0, 1 / CARD))
    # lecture 09: ZeRO-3 needs no more tokens than data parallelism, per microbatch, on any collective
    for per_byte in (roofline.flat_ring(NVLINK), roofline.flat_ring(CARD, devices=512),
                     roofline.hierarchical(NVLINK, CARD, per_node=8, nodes=64), roofline.hierarchical(2e11, 25e9, 8, 2)):
        assert roofline.zero3_tokens(H100, per_byte) == pytest.approx(roofline.dp_tokens(H100, per_byte))
    # lecture 10: LLaMA-3-70B on NVLink: attention t <= 8.5, MLP t <= 14; the 7B GPT at 200 GB/s: t <= 6.5
    widest = roofline.tp_widest(8192, 28672, H100, NVLINK)
    assert round(widest["attention"], 1) == 8.5 and int(widest["mlp"]) == 14
    assert round(roofline.tp_widest(4096, 4 * 4096, 3e14, 2e11)["attention"], 1) == 6.5
    # lecture 12: ring attention hides from C/W tokens a shard; causal backward at half the peak: 16,000
    assert round(roofline.cp_ring_shard(1e15, 50e9)) == 20000 and round(roofline.cp_ring_shard(1e15, 450e9)) == 2222
    assert roofline.cp_ring_shard(0.5e15, 50e9, work=0.5 * 2.5, sent=2) == pytest.approx(16000)
    # lecture 13: dp = 16 over two nodes (300 Tflop/s; 200 GB/s inside, 25 GB/s across); 70B FSDP on 512 H100s
    assert roofline.dp_tokens(3e14, roofline.flat_ring(25e9, devices=16)) == pytest.approx(11250)
    assert roofline.dp_tokens(3e14, roofline.hierarchical(2e11, 25e9, per_node=8, nodes=2)) == pytest.approx(1312.5)
    assert roofline.zero3_tokens(H100, roofline.hierarchical(NVLINK, CARD, 8, 64)) < 8192 < \
        roofline.zero3_tokens(H100, roofline.flat_ring(CARD, devices=512))


def test_the_module_stays_pure_arithmetic():
    tree = ast.parse(Path(roofline.__file__).read_text())
    assert not [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
