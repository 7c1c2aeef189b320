"""Lab 09's grading pieces: the byte counts the harness measures, and the
paper's numbers the checks hold, are right on their own before they judge
anyone's code."""
import math
import weakref

import pytest

from conftest import load_check_file

torch = pytest.importorskip("torch")

LAB = "09-zero-sharding"
harness, checks = load_check_file(LAB, "harness"), load_check_file(LAB, "check_zero_sharding")


def test_storage_bytes_counts_each_storage_once_and_a_view_as_its_whole_buffer():
    big = torch.zeros(100, dtype=torch.float64)
    small = torch.zeros(10, dtype=torch.float32)
    small.grad = torch.zeros(10)  # gradients are not optimizer state: not followed
    assert harness.storage_bytes({"a": [small, small], "b": (small[2:5],)}) == 40
    assert harness.storage_bytes([big[:3]]) == 800  # the view keeps all of big alive
    assert harness.storage_bytes([small, big, {"again": big.view(10, 10)}]) == 840


def test_storage_bytes_walks_modules_and_the_student_objects_but_not_other_objects():
    class Holder:  # defined here, so "not the student's module" unless asked
        def __init__(self):
            self.kept = torch.zeros(8, dtype=torch.float64)

    layer = torch.nn.Linear(3, 2)  # 6 + 2 float32
    assert harness.storage_bytes(layer) == 32
    assert harness.storage_bytes([Holder()]) == 0
    assert harness.storage_bytes([Holder()], student_module=__name__) == 64


def test_storage_bytes_of_unsharded_adam_is_parameters_and_two_moments():
    model = torch.nn.Linear(4, 3, dtype=torch.float64)  # 15 parameters
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
    opt.step()
    steps = sum(s["step"].untyped_storage().nbytes() for s in opt.state.values())
    assert harness.storage_bytes([opt.state, opt.param_groups]) == 3 * 15 * 8 + steps


@pytest.mark.parametrize("name", ["all_gather_single", "all_gather_into_tensor"])  # the new name and the old
def test_gather_watch_sees_live_and_peak_bytes_until_every_view_is_freed(monkeypatch, name):
    def fake_gather(out, inp, *args, **kwargs):  # one process: every "rank" sends the same
        out.copy_(inp.repeat(out.numel() // inp.numel()))
    monkeypatch.setattr(torch.distributed, name, fake_gather)
    gather = lambda out, inp: getattr(torch.distributed, name)(out, inp)
    with harness.GatherWatch() as watch:
        first = torch.empty(8, dtype=torch.float64)
        gather(first, torch.ones(4, dtype=torch.float64))
        view = first[:3]
        del first
        assert watch.live == 64  # the view keeps the gathered buffer alive
        second = torch.empty(4)
        gather(second, torch.ones(2))
        gather(second, torch.ones(2))  # the same buffer again: once
        assert (watch.live, watch.peak, watch.calls, watch.total) == (80, 80, 3, 96)
        del view, second
        assert watch.live == 0 and watch.peak == 80
    assert getattr(torch.distributed, name) is fake_gather  # put back as it was


def test_the_graded_model_needs_padding_on_2_and_4_ranks():
    sizes = [b * (a + 1) for a, b in zip(harness.DIMS[:-1], harness.DIMS[1:])]
    total = sum(sizes)
    assert total == 967 and total % 2 and total % 3 and total % 4
    assert all(s % 4 for s in sizes)
    assert 2 * max(sizes) < total  # the peak check's bound (two layers) is below the whole model
    assert harness.GLOBAL_BATCH % 4 == 0 and harness.GLOBAL_BATCH % 2 == 0


def test_the_papers_numbers_in_the_checks_follow_the_closed_forms():
    for stage, gb in checks.FIGURE_1:
        assert round(checks.closed_form(7.5e9, 64, stage, 12) / 1e9, 1) == gb
    for psi, rows in checks.TABLE_1.items():
        for n, per_stage in rows.items():
            for stage, paper in zip((1, 2, 3), per_stage):
                assert abs(checks.closed_form(psi, n, stage, 12) / 1e9 - paper) <= max(0.006 * paper, 0.011)
    for mp, row in checks.TABLE_2.items():
        for stage, paper in enumerate(row):
            fits = mp * 32e9 / checks.closed_form(1, 64, stage, 12)
            assert abs(fits - paper) <= (0.05 if paper >= 0.5e12 else 0.01) * paper
    # the tolerances are tight enough to see stage 2 computed as stage 1, and N ignored
    assert abs(checks.closed_form(7.5e9, 64, 1, 12) / 1e9 - 16.6) > 1
    assert math.isclose(checks.closed_form(1, 1, 3, 12), 16)


def test_weakref_finalize_on_a_tensor_waits_for_its_views():
    # What GatherWatch relies on: torch keeps a tensor's Python object alive while a view lives.
    freed = []
    base = torch.empty(10)
    weakref.finalize(base, freed.append, True)
    view = base[2:5]
    del base
    assert not freed
    del view
    assert freed == [True]
