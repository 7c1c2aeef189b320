"""course.gpu_timing and autograder.grading.timed on the CPU tier: a stand-in clock and
card (course.gpu_stand_in) stand for the GPU, and the test's own "kernels" say how long
they took by advancing the clock."""
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from autograder.grading import timed
from course import gpu_devices, gpu_timing
from course.gpu_devices import CupyDevice, NumbaDevice, TorchDevice
from course.gpu_stand_in import CUPY_NAMES, STAND_IN_CARD, StandIn
from course.gpu_timing import bench, hashed, sample_positions

# What an H100 SXM's attributes say (132 SMs at 1980 MHz, HBM3 at 2619 MHz on 5120 bits):
# 3.35 TB/s and 67 TFLOP/s FP32.
H100 = dataclasses.replace(STAND_IN_CARD, name="NVIDIA H100 80GB HBM3", multiprocessors=132, l2_bytes=50 << 20,
                           sm_clock_max_khz=1_980_000, memory_clock_max_khz=2_619_000, memory_bus_bits=5120)


class SteppedClock:
    """A clock that moves only when a test's kernel says it ran for a while."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


@pytest.fixture
def clock():
    return SteppedClock()


def small_card(**changes):
    """An H100 with a 4 KiB L2, so that flushing it costs the test nothing."""
    return dataclasses.replace(H100, l2_bytes=4 << 10, **changes)


def doubling(dev, clock, seconds, wrong_on=None):
    """bench's arguments for a kernel that doubles a fresh array of 1000 floats in ``seconds``;
    on the call numbered ``wrong_on`` (counting the warm-up) it returns its last output again."""
    calls, last = [], []

    def run(x):
        calls.append(x.copy())
        clock.advance(seconds)
        out = last[-1] if last and len(calls) == wrong_on else x * 2
        last.append(out)
        return out

    def inputs(seed):
        return (dev.hashed(seed, 1000),)

    def keep(out, args, seed):
        return dev.take(out, sample_positions(seed, 1000))
    return run, inputs, keep, calls


def doubled(seed, kept):
    where = sample_positions(seed, 1000)
    return timed.sample_problem(kept, 2 * hashed(np, seed, None, positions=where), where, rtol=0)


def test_inputs_are_named_by_their_seed_the_same_in_numpy_and_the_numba_kernel():
    """The grader recomputes any input element from its seed: NumbaDevice's kernel (here in
    numba's simulator), CuPy's path (the stand-in's NumPy) and NumPy at chosen positions agree
    bit for bit, and another seed or stream gives other numbers."""
    kernel = NumbaDevice(StandIn(card=small_card()).numba_cuda()).hashed(2026, 1000, -4.0, 4.0).copy_to_host()
    arrays = CupyDevice(StandIn().cupy()).hashed(2026, 1000, -4.0, 4.0)
    where = np.array([0, 17, 999])
    assert np.array_equal(kernel, np.asarray(arrays)) and kernel.dtype == np.float32
    assert np.array_equal(hashed(np, 2026, None, -4.0, 4.0, positions=where), kernel[where])
    assert kernel.min() >= -4 and kernel.max() < 4 and np.unique(kernel).size > 990
    assert not np.array_equal(kernel, hashed(np, 2027, 1000, -4.0, 4.0))
    assert not np.array_equal(kernel, hashed(np, 2026, 1000, -4.0, 4.0, stream=1))


def test_torchs_device_names_inputs_as_numpy_does_and_times_on_its_stand_in(clock):
    """TorchDevice (lab 12's): its hashed tensors equal NumPy's bit for bit, whatever the seed,
    stream and dtype; its record reads the card's
    properties under torch's names as CuPy's does; its events time on the stand-in's clock,
    and bench flushes its L2 (a torch tensor) before every run."""
    dev = TorchDevice(StandIn(clock, small_card()).torch_cuda())
    for seed, shape, low, high, stream, dtype in ((2026, 1000, -4.0, 4.0, 0, np.float32),
                                                  (0xFFFFFFFF, (3, 5, 7), -2.0, 2.0, 2, np.float64)):
        made = dev.hashed(seed, shape, low, high, dtype, stream)
        want = hashed(np, seed, shape, low, high, dtype, stream)
        assert made.device.type == "cpu" and made.numpy().dtype == dtype and np.array_equal(made.numpy(), want)
    record, cupy_record = dev.record(), CupyDevice(StandIn(clock, small_card()).cupy()).record()
    fields = ("name", "compute_capability", "multiprocessors", "l2_bytes", "sm_clock_max_khz",
              "memory_clock_max_khz", "memory_bus_bits", "driver", "runtime", "stand_in", "peak_bandwidth")
    assert {k: record[k] for k in fields} == {k: cupy_record[k] for k in fields}
    result = bench(dev, lambda x: (clock.advance(3e-3), x * 2)[1], lambda seed: (dev.hashed(seed, 1000),),
                   lambda out, args, seed: dev.take(out, sample_positions(seed, 1000)), timed.draw_seeds(2))
    assert [r["seconds"] for r in result["runs"]] == pytest.approx([3e-3] * 2) and result["flushes"] == 2
    assert dev._flush.numel() * 4 == 2 * small_card().l2_bytes and int(dev._flush[0]) == dev.flushes
    assert timed.judge(result, "doubling", doubled, dry_run=True).runs == 2


def test_every_timed_run_gets_inputs_of_its_own(clock):
    dev = CupyDevice(StandIn(clock, small_card()).cupy())
    run, inputs, keep, calls = doubling(dev, clock, 1e-3)
    seeds = timed.draw_seeds(4)
    result = bench(dev, run, inputs, keep, seeds, warmup=1)
    assert len(calls) == 5  # one warm-up, four timed runs
    assert len({x.tobytes() for x in calls}) == 5, "two runs were given the same inputs"
    assert [r["seed"] for r in result["runs"]] == seeds


def test_the_l2_is_flushed_before_every_run_and_outside_the_timed_window(clock):
    """Before each timed run a buffer twice the card's L2 holds a value written since the last
    run; the flush's own time is not in any run's time."""
    card = small_card()
    dev = CupyDevice(StandIn(clock, card).cupy())
    write = dev._write
    dev._write = lambda buffer, value: (write(buffer, value), clock.advance(5.0))  # a slow flush
    seen = []

    def run(x):
        seen.append((dev.flushes, np.unique(np.asarray(dev._flush)).tolist() if dev._flush is not None else None))
        clock.advance(2e-3)
        return x * 2

    result = bench(dev, run, lambda seed: (dev.hashed(seed, 1000),), lambda out, args, seed: None,
                   timed.draw_seeds(3), warmup=1)
    assert seen == [(0, None), (1, [1]), (2, [2]), (3, [3])]  # the warm-up, then a fresh flush per run
    assert dev._flush.nbytes == dev.flush_bytes == 2 * card.l2_bytes
    assert result["flushes"] == 3 and result["record"]["l2_flush_bytes"] == 2 * card.l2_bytes
    assert [r["seconds"] for r in result["runs"]] == pytest.approx([2e-3] * 3)


def test_the_median_of_the_runs_and_the_floor_are_reported(clock):
    dev = CupyDevice(StandIn(clock, small_card()).cupy())
    times = iter([4e-3, 1e-3, 2e-3])
    result = bench(dev, lambda x: (clock.advance(next(times)), x * 2)[1], lambda seed: (dev.hashed(seed, 1000),),
                   lambda out, args, seed: dev.take(out, sample_positions(seed, 1000)), timed.draw_seeds(3), warmup=0)
    judged = timed.judge(result, "doubling", doubled, moved_bytes=1e9, dry_run=True)
    assert judged.median_s == pytest.approx(2e-3) and judged.runs == 3
    assert judged.floor_s == pytest.approx(1e9 / 3.3523e12, rel=1e-3)
    assert "median 2 ms of 3 timed runs" in judged.describe() and "floor 0.2983 ms: 1 GB" in judged.describe()


def test_a_kernel_faster_than_physics_is_refused_not_scored(clock):
    """Moving 1 GB in 10 µs would be 100 TB/s: over 30 times an H100's peak bandwidth."""
    dev = CupyDevice(StandIn(clock, small_card()).cupy())
    run, inputs, keep, _ = doubling(dev, clock, 1e-5)
    result = bench(dev, run, inputs, keep, timed.draw_seeds(3))
    with pytest.raises(AssertionError) as refused:
        timed.judge(result, "doubling", doubled, moved_bytes=1e9, dry_run=True)
    message = str(refused.value)
    assert message.startswith("refused, not scored: doubling took 0.01 ms in timed run 1 of 3, under the 0.2983 ms")
    assert "1 GB at the card's peak 3.35 TB/s (attributes)" in message and "NVIDIA H100" in message
    # The FLOP/s floor too: 1 TFLOP in 1 ms is 1000 TFLOP/s.
    with pytest.raises(AssertionError, match=r"1 TFLOP at the card's peak FP32 67 TFLOP/s"):
        timed.judge(result, "doubling", doubled, flops=1e12, dry_run=True)
    # A run that took no time at all is refused whatever the work.
    result["runs"][1]["seconds"] = 0.0
    with pytest.raises(AssertionError, match="timed run 2 of 3"):
        timed.judge(result, "doubling", doubled, dry_run=True)


def test_a_wrong_output_in_the_third_timed_run_is_caught(clock):
    """The warm-up and the first two timed runs are right; the third hands back the second's
    output (an answer kept instead of computed): the recheck of every run finds it."""
    dev = CupyDevice(StandIn(clock, small_card()).cupy())
    run, inputs, keep, _ = doubling(dev, clock, 1e-3, wrong_on=4)
    result = bench(dev, run, inputs, keep, timed.draw_seeds(5), warmup=1)
    with pytest.raises(AssertionError) as caught:
        timed.judge(result, "doubling", doubled, moved_bytes=8000, dry_run=True)
    assert "doubling: the output of timed run 3 of 5 is wrong: at flat position 0, expected" in str(caught.value)
    run, inputs, keep, _ = doubling(dev, clock, 1e-3)  # the same kernel, right every time, passes
    timed.judge(bench(dev, run, inputs, keep, timed.draw_seeds(5)), "doubling", doubled, dry_run=True)


def test_the_record_holds_the_device_its_versions_and_its_peaks(clock):
    result = bench(CupyDevice(StandIn(clock, small_card()).cupy()), lambda x: x, lambda seed: (np.zeros(1),),
                   lambda out, args, seed: None, [1])
    record = json.loads(json.dumps(result["record"]))  # plain data: it crosses the sandbox
    assert record["name"] == "NVIDIA H100 80GB HBM3" and record["compute_capability"] == [9, 0]
    assert record["driver"] == record["runtime"] == "stand-in" and record["stand_in"] is True
    assert record["multiprocessors"] == 132 and record["sm_clock_max_khz"] == 1_980_000
    assert record["clocks_now"] == {"unreadable": "a stand-in device has no clocks"}
    assert {"numpy", "numba", "numba-cuda", "torch"} <= set(record["libraries"])
    assert record["peak_bandwidth"] == pytest.approx(3.352e12, rel=1e-3)
    assert record["peak_fp32"] == 67e12 and record["peak_fp32_source"] == "data sheet of H100"
    line = timed.device_line(record)
    assert line.startswith("NVIDIA H100 80GB HBM3 (sm_90, driver stand-in, runtime stand-in; numpy ")
    # numba's device reads the same fields under numba's names.
    numba_record = NumbaDevice(StandIn(clock, small_card()).numba_cuda()).record()
    assert {k: numba_record[k] for k in ("name", "multiprocessors", "l2_bytes", "memory_bus_bits")} == \
        {k: record[k] for k in ("name", "multiprocessors", "l2_bytes", "memory_bus_bits")}


def test_peaks_come_from_attributes_or_the_data_sheet_whichever_is_higher():
    assert gpu_timing.peaks({"name": "Tesla T4"}) == {"bandwidth": 320e9, "bandwidth_source": "data sheet of T4",
                                                      "fp32": 8.1e12, "fp32_source": "data sheet of T4"}
    # Whole words of the name: an L40 (864 GB/s) is not held to the L4's 300 GB/s.
    assert gpu_timing.peaks({"name": "NVIDIA L40"})["bandwidth"] is None
    assert gpu_timing.peaks({"name": "NVIDIA A100-PCIE-40GB"})["bandwidth_source"] == "data sheet of A100"
    unknown = {"name": "a card nobody knows"}
    assert gpu_timing.floor_seconds(unknown, moved_bytes=1e9, flops=1e12) == (
        0.0, "no floor: the card's peak bandwidth and FP32 rate are unknown")
    # An unknown architecture: 256 lanes per SM, more than any card has (a low floor refuses no honest run).
    odd = {"name": "x", "compute_capability": [42, 0], "multiprocessors": 10, "sm_clock_max_khz": 1_000_000}
    assert gpu_timing.peaks(odd)["fp32"] == 2 * 256 * 10 * 1e9


def test_a_stand_ins_time_is_refused_on_the_gpu_tier_and_a_cards_in_a_dry_run(clock):
    dev = CupyDevice(StandIn(clock, small_card()).cupy())
    run, inputs, keep, _ = doubling(dev, clock, 1e-3)
    result = bench(dev, run, inputs, keep, timed.draw_seeds(2))
    with pytest.raises(RuntimeError, match="a stand-in device, on the GPU tier"):
        timed.judge(result, "doubling", doubled, dry_run=False)
    result["record"]["stand_in"] = False
    with pytest.raises(RuntimeError, match="a real device, in a dry run"):
        timed.judge(result, "doubling", doubled, dry_run=True)


def test_seeds_are_fresh_and_sampled_positions_cover_both_ends():
    seeds = timed.draw_seeds(20)
    assert len({gpu_timing.scale_of(s) for s in seeds}) == 20 and seeds != timed.draw_seeds(20)
    # From a grading's secret seed: K2C_GRADING_SEED draws the same runs again; another check, others.
    from_grading = timed.draw_seeds(20, 42, "saxpy_bandwidth")
    assert from_grading == timed.draw_seeds(20, 42, "saxpy_bandwidth") != timed.draw_seeds(20, 42, "reduce_speed")
    assert len({gpu_timing.scale_of(s) for s in from_grading}) == 20
    assert from_grading != timed.draw_seeds(20, 43, "saxpy_bandwidth")
    where = sample_positions(7, 10_000)
    assert where[0] == 0 and where[-1] == 9_999 and 200 < where.size <= 258
    assert np.array_equal(where, sample_positions(7, 10_000)) and not np.array_equal(where, sample_positions(8, 10_000))


def test_grader_side_oracles_of_reductions_and_products_match_the_arrays():
    """The grader sums a reduction's base in chunks; it equals the whole array's sum, a
    run's rotated histogram is np.roll of the base's counts, and a matmul's sampled outputs
    are those of the product of the whole hashed matrices (the harnesses' A and B)."""
    a, b = hashed(np, 9, (37, 37)), hashed(np, 9, (37, 37), stream=1)
    where = gpu_timing.sample_positions(9, 37 * 37)
    want = (a.astype(np.float64) @ b.astype(np.float64)).ravel()[where]
    np.testing.assert_allclose(gpu_timing.hashed_product_at(9, 37, where), want, rtol=1e-12)
    x = hashed(np, 5, 10_000)
    assert gpu_timing.hashed_total(5, 10_000, chunk=999) == pytest.approx(float(x.sum(dtype=np.float64)), rel=1e-12)
    values = gpu_timing.hashed_ints(np, 5, 10_000, 256)
    counts = gpu_timing.hashed_counts(5, 10_000, 256, chunk=999)
    assert np.array_equal(counts, np.bincount(values, minlength=256))
    shift = gpu_timing.shift_of(12345, 256)
    assert np.array_equal(np.bincount((values + shift) % 256, minlength=256), np.roll(counts, shift))


def test_the_stand_in_cupy_offers_only_what_cupy_has():
    """Every NumPy function the stand-in CuPy hands out exists in CuPy (held to a real CuPy
    where one imports; this machine's CI has none), and it offers nothing else of NumPy's."""
    cp = StandIn().cupy()
    assert not hasattr(cp, "linalg") and not hasattr(cp, "random") and not hasattr(cp, "frombuffer")
    a = cp.arange(4, dtype=cp.float32)
    assert a.data.ptr == a.__cuda_array_interface__["data"][0] == gpu_timing.pointer(a)
    assert np.array_equal(a.get(), [0, 1, 2, 3]) and cp.get_array_module(a) is cp and cp.get_array_module(a.get()) is np
    host = np.ones(3, np.float32)
    assert gpu_timing.pointer(cp.asarray(host)) != gpu_timing.pointer(host), "a host array given to CuPy is copied"
    cupy = pytest.importorskip("cupy")
    assert [n for n in CUPY_NAMES if not hasattr(cupy, n)] == []
    for path in ("cuda.Event", "cuda.Stream", "cuda.Device", "cuda.get_elapsed_time", "cuda.runtime.deviceGetAttribute",
                 "cuda.runtime.getDeviceProperties", "cuda.runtime.driverGetVersion", "asnumpy", "ElementwiseKernel"):
        obj = cupy
        for part in path.split("."):
            obj = getattr(obj, part)


def test_device_gives_the_stand_ins_on_the_cpu_tier(monkeypatch):
    """On the CPU tier (numba's simulator), device() gives the stand-ins, and its CuPy is what
    the student's `import cupy` finds for the rest of that (one-call) process."""
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setitem(sys.modules, "cupyx", None)
    dev = gpu_devices.device("cupy")
    assert dev.info.stand_in and sys.modules["cupy"] is dev.xp and dev.torch_device == "cpu"
    assert gpu_devices.device("numba").info.name == STAND_IN_CARD.name
    torch_dev = gpu_devices.device("torch")
    assert torch_dev.info.stand_in and torch_dev.torch_device == "cpu" and torch_dev.empty(3, np.float32).is_cpu


def test_the_numba_kernels_of_the_timing_helper_compile_for_the_gpu_targets():
    """The hashed-input and flush kernels run on a GPU only in a GPU-tier grading: they are
    compiled here for every GPU target (numba's simulator off, in a process of its own)."""
    code = ("import json\nfrom course import gpu_compile, _gpu_kernels as k\n"
            "why = gpu_compile.unavailable()\n"
            "print(json.dumps(why or [result for kernel, sig in ["
            "(k.hashed, 'void(float32[:], uint64, float64, float64)'), (k.fill, 'void(uint32[:], uint32)')]"
            " for result in gpu_compile.compile_for_targets(kernel, sig).values()]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, NUMBA_ENABLE_CUDASIM="0"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    if isinstance(results, str):
        pytest.skip(results)
    from course import gpu_compile

    assert len(results) == 2 * len(gpu_compile.TARGETS) and all(r["ok"] for r in results), results
