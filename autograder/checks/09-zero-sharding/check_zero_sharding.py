"""Checks for lab 09: sharded data parallelism (ZeRO).

Every input is drawn here from the grading's secret seed, and every expected
value comes from ``oracles.py``, in the grader's process: the closed forms and
the ZeRO paper's printed numbers (Figure 1, Tables 1 and 2), NumPy's padded
concatenation, and the same MLP trained by torch's unsharded optimizer on the
whole batch. The sandbox only runs the student's code on the inputs
(``harness.py``).

Training runs as rank jobs on 2 and 4 ranks (``autograder.sandbox.ranks``): each
rank receives the seed of the model's initial weights and its own rows of every
step's batch, nothing else. After 3 steps every ZeRO-1 rank's parameters, and the
ZeRO-3 parameters rebuilt from every rank's shards, must equal unsharded
training to 1e-9 relative (1e-10 absolute). The small model (967 parameters, divisible by neither
2 nor 4, no layer's count by 4) exercises the padding.

What earns the other points is measured outside the student's processes, by the
launcher: the bytes that cross between the ranks in the steps (the kernel's TCP
counters), against the closed forms of a reduce-scatter and an all-gather; and
each rank's memory at the harness's marks (VmRSS, and VmHWM started afresh at a
mark: ``autograder.grading.rank_jobs``), on one step of a larger MLP whose
every measured tensor is 1 MiB or more, so that what a check is about dominates
against a MiB or two of noise:

- ZeRO-1 with Adam on 4 ranks, a 16 MiB model: what a rank holds after a step
  beyond its model's parameters: its shard, the shard's gradient and Adam's two
  moments of it (4Ψ/N, 16 MiB), not Adam's two moments of the whole model
  (2Ψ, 32 MiB); the limit lies halfway, 24 MiB;
- ZeRO-3 with SGD on 2 ranks, a 32 MiB model of 16 layers: what a rank holds
  once the wrapper is built (its shards, 16 MiB; at most 24), and the peak of
  the forward pass and of the backward pass above what it held when each
  began (half the model and two layers, 20 MiB, and in backward the shards'
  gradients on top; every layer at once is 32 MiB).

Both tiers grade the same way.
"""
import math

import numpy as np
import pytest

from autograder.grading import seeds
from autograder.grading.checking import expect_array, load_beside, with_the_work
from autograder.grading.rank_jobs import crossed_in_phases, held_at, peak_in_phase, run_cases
from autograder.grading.submission import failure_from, not_implemented_yet
from autograder.grading.traffic import expect_crossed
from course.wire import gloo_bytes, gloo_messages

oracles = load_beside(__file__, "oracles")
harness = load_beside(__file__, "harness")  # the initial weights, made from a seed alike on every rank and here

WORLD_SIZES = (2, 4)
GB, MIB = 1e9, 2**20
# Parameters agree to rounding: Adam divides each gradient by its own root mean square, so where a
# gradient is a near-cancelling sum its rounding moves the parameter by up to ~1e-11 (lr 0.05).
RTOL, ATOL = 1e-9, 1e-10
STEPS = 3
DIMS = (6, 22, 10, 22, 13, 3)  # Linear sizes 154, 230, 242, 299, 42 parameters: 967 in all
GLOBAL_BATCH = 24
SMALL_CASES = {"zero1_adam": "adam", "zero1_sgd": "sgd", "zero3_adam": "adam"}
# The memory cases: one step of an MLP of float64 layers large enough that every tensor the checks are
# about is 1 MiB or more (each such block comes from the kernel and goes back to it when freed: what the
# launcher reads is what was held). ZeRO-1 on 4 ranks, 4 layers of 724 x 724 (4 MiB each, 16 MiB in all),
# Adam; ZeRO-3 on 2 ranks, 16 layers of 512 x 512 (2 MiB each, 32 MiB in all), SGD, which keeps no state.
MEMORY_CASES = {"zero1_memory": (4, (724,) * 5, "adam"), "zero3_memory": (2, (512,) * 17, "plain_sgd")}
MEMORY_BATCH = 8
JOB_TIMEOUT_S, IDLE_TIMEOUT_S = 100, 10  # a correct job of 4 ranks takes 5-15 s on 2 busy cores


# --- zero_bytes and flatten_padded: one sandboxed call for all the queries -------------

def _queries(seed):
    return oracles.formula_queries(seeds.rng(seed, "09", "formulas"))


def _answers(submission, seed, name):
    """[(query, what the submission's ``name`` gave)] for every query of ``name``."""
    queries = submission.once("queries", lambda: _queries(seed))
    got = submission.harness_once("formulas", "formulas",
                                  {key: queries[key] for key in ("zero_bytes", "flatten_padded")})[name]
    if isinstance(got, dict):  # still a stub
        raise not_implemented_yet(got["not_implemented"])
    return list(zip(queries[name], got))


def _zero_bytes(submission, seed, psi, n, stage, k=12):
    return dict(_answers(submission, seed, "zero_bytes"))[(psi, n, stage, k)]


@pytest.mark.points(1)
def check_zero_bytes_closed_forms(submission, seed):
    """zero_bytes(psi, n, stage, k) equals (4+K)Ψ, 4Ψ + KΨ/N, 2Ψ + (2+K)Ψ/N, (4+K)Ψ/N (N = 1 and up; odd Ψ; fractional K)"""
    for psi, n, stage, k in submission.once("queries", lambda: _queries(seed))["closed"]:
        got, want = _zero_bytes(submission, seed, psi, n, stage, k), oracles.closed_form(psi, n, stage, k)
        assert got is not None and math.isclose(got, want, rel_tol=1e-9), (
            f"zero_bytes(psi={psi:g}, n={n}, stage={stage}, k={k}) = {got!r}, expected {want:.6g} bytes "
            f"({oracles.SHARDED[stage]})")


@pytest.mark.points(2)
def check_zero_bytes_paper_figure_1(submission, seed):
    """zero_bytes reproduces the ZeRO paper's Figure 1: 120, 31.4, 16.6, 1.9 GB (7.5B parameters, N = 64)"""
    for stage, paper_gb in oracles.FIGURE_1:
        got = _zero_bytes(submission, seed, 7.5e9, 64, stage)
        assert got is not None and round(got / GB, 1) == paper_gb, (
            f"zero_bytes(7.5e9, 64, {stage}) = {got!r} bytes; the paper's Figure 1 says {paper_gb} GB "
            "(1 GB = 1e9 bytes; 2 bytes of fp16 weights, 2 of gradients, 12 of Adam state per parameter)")


@pytest.mark.points(1)
def check_zero_bytes_paper_tables(submission, seed):
    """zero_bytes reproduces the paper's Table 1 (GB per device by DP degree) and Table 2 (largest model on 32 GB)"""
    for psi, rows in oracles.TABLE_1.items():
        for n, per_stage in rows.items():
            for stage, paper in zip((1, 2, 3), per_stage):
                got = _zero_bytes(submission, seed, psi, n, stage) / GB
                # The paper prints three significant figures, some truncated rather than rounded.
                assert abs(got - paper) <= max(0.006 * paper, 0.011), (
                    f"Table 1, {psi / 1e9:g}B parameters, DP degree {n}, stage {stage}: zero_bytes gives "
                    f"{got:.4g} GB, the paper prints {paper} GB")
    per_param = [_zero_bytes(submission, seed, 1, 64, stage) for stage in range(4)]
    for mp, paper_row in oracles.TABLE_2.items():
        for stage, paper in enumerate(paper_row):
            got = mp * 32 * GB / per_param[stage]
            # Printed to 0.1B, except 0.5T, 1T and 2T (one digit of trillions).
            assert abs(got - paper) <= (0.05 if paper >= 0.5e12 else 0.01) * paper, (
                f"Table 2, MP = {mp}, DP = 64, stage {stage}: 32 GB / zero_bytes(1, 64, {stage}) x MP = "
                f"{got / 1e9:.4g}B parameters, the paper prints {paper / 1e9:g}B")


@pytest.mark.points(1)
def check_flatten_padded(submission, seed):
    """flatten_padded(tensors, n) concatenates in order and zero-pads to n * ceil(numel / n)"""
    for (arrays, n), got in _answers(submission, seed, "flatten_padded"):
        call = f"flatten_padded(tensors of sizes {[a.size for a in arrays]}, n={n})"
        assert got is not None, f"{call} returned None or not a tensor"
        expect_array(np.asarray(got), oracles.padded(arrays, n), call, exact=True)


# --- training on 2 and 4 ranks ------------------------------------------------------------

def _cases(seed, n):
    """{name: case} of a world size: the model's seed, dimensions, optimizer and every step's
    whole batch, drawn from the grading's secret seed."""
    cases = {}
    sizes = [(name, DIMS, optimizer, GLOBAL_BATCH, STEPS) for name, optimizer in SMALL_CASES.items()]
    sizes += [(name, dims, optimizer, MEMORY_BATCH, 1) for name, (size, dims, optimizer) in MEMORY_CASES.items()
              if size == n]
    for name, dims, optimizer, batch, steps in sizes:
        rng = seeds.rng(seed, "09", name, n)
        cases[name] = {"model_seed": int(rng.integers(2**62)), "dims": list(dims), "optimizer": optimizer,
                       "x": rng.standard_normal((steps, batch, dims[0])),
                       "y": rng.standard_normal((steps, batch, dims[-1]))}
    return cases


def _part(case, name, rank, n):
    """What rank ``rank`` receives of a case: the model's seed and its own rows of each batch."""
    rows = slice(rank * case["x"].shape[1] // n, (rank + 1) * case["x"].shape[1] // n)
    part = {"model_seed": case["model_seed"], "dims": case["dims"], "optimizer": case["optimizer"],
            "x": np.ascontiguousarray(case["x"][:, rows]), "y": np.ascontiguousarray(case["y"][:, rows])}
    if name in MEMORY_CASES:
        part["memory"] = True
        if name.startswith("zero1"):  # another rank's shard, which reaches this one by the all-gather
            numel = sum(oracles.layer_sizes(case["dims"]))
            size = math.ceil(numel / n)
            owner = (rank + 1) % n
            part["slice"] = [owner * size, min(numel, (owner + 1) * size)]
    return part


def _job(submission, seed, n):
    """(cases, {name: outcome}) of every case on n ranks, once per grading."""
    def run():
        cases = _cases(seed, n)
        found = run_cases(submission, "torch", "training_rank", list(cases), lambda name: n,
                          lambda name, rank: _part(cases[name], name, rank, n), timeout=JOB_TIMEOUT_S,
                          idle_timeout=IDLE_TIMEOUT_S, count_wire=True)
        for name, outcome in found.items():
            if outcome["status"] == "ok":
                stub = next((r for r in outcome["records"] if r["status"] != "ok"), None)
                if stub:
                    found[name] = {"status": stub["status"], "message": stub["message"]}
                else:
                    outcome["wire"] = crossed_in_phases(outcome["job"], name, ("steps",))
        return cases, found
    return submission.once(("training_job", n), run)


def _case(submission, seed, name, sizes=WORLD_SIZES):
    """{n: (case, outcome)} for the case on every world size it runs on."""
    found = {}
    for n in sizes:
        cases, outcomes = _job(submission, seed, n)
        if outcomes[name]["status"] != "ok":
            raise failure_from(outcomes[name], f"{name} on {n} ranks")
        found[n] = (cases[name], outcomes[name])
    return found


def _unsharded(submission, name, n, case):
    """The flat parameters unsharded training gives for the case (computed once)."""
    weights = lambda: harness.initial_weights(case["model_seed"], case["dims"])  # noqa: E731
    return submission.once(("unsharded", name, n), lambda: oracles.unsharded(
        weights(), case["x"], case["y"], harness.OPTIMIZERS[case["optimizer"]]))


def _expect_unsharded(what, case, got, want, offset=0, others=()):
    bad = ~np.isclose(got, want, rtol=RTOL, atol=ATOL)
    if bad.any():
        i = int(np.argmax(bad))
        hint = (f"; ranks differ from each other ({others}): were the updated shards all-gathered back into "
                "every rank?") if others else ""
        raise AssertionError(
            f"{what}, after {len(case['x'])} step(s): {oracles.where(case['dims'], offset + i)} is {got[i]:.10g}, "
            f"unsharded training on the whole batch gives {want[i]:.10g} ({int(bad.sum())} of {want.size} "
            f"parameters differ){hint}")


def _expect_results(submission, seed, name, what, sizes=WORLD_SIZES):
    for n, (case, outcome) in _case(submission, seed, name, sizes).items():
        want = _unsharded(submission, name, n, case)
        records = outcome["records"]
        if name.startswith("zero3"):
            full = oracles.rebuild([r["shards"] for r in records], oracles.layer_sizes(case["dims"]))
            if isinstance(full, str):
                raise AssertionError(f"{what} on {n} ranks: {full}")
            _expect_unsharded(f"{what} on {n} ranks (rebuilt from every rank's shards)", case, full, want)
            continue
        for rank, record in enumerate(records):
            got = np.asarray(record["params"])
            start, stop = _part(case, name, rank, n).get("slice", (0, want.size))
            if got.shape != (stop - start,):
                raise AssertionError(f"{what} on {n} ranks: rank {rank} has {got.size} parameters, expected "
                                     f"{stop - start}")
            others = [r for r, other in enumerate(records) if np.shape(other["params"]) == got.shape
                      and not np.array_equal(other["params"], got)] if name not in MEMORY_CASES else []
            _expect_unsharded(f"{what} on {n} ranks: rank {rank}'s parameters", case, got, want[start:stop],
                              start, others)


@pytest.mark.points(3)
def check_zero1_matches_unsharded_adam(submission, seed):
    """ShardedOptimizer(Adam): every rank's parameters equal unsharded Adam on the whole batch (2 and 4 ranks)"""
    _expect_results(submission, seed, "zero1_adam", "ShardedOptimizer(torch.optim.Adam, weight_decay=0.1)")


@pytest.mark.points(1)
def check_zero1_matches_unsharded_sgd_momentum(submission, seed):
    """ShardedOptimizer(SGD with momentum): parameters equal unsharded SGD (gradients averaged, not summed)"""
    _expect_results(submission, seed, "zero1_sgd", "ShardedOptimizer(torch.optim.SGD, momentum=0.9)")


def _memory(submission, seed, name, what, small_case, claim):
    """(the large case's outcome, its model's float64 bytes, one rank's padded shard of them), once
    the small case's and its own results are right (no property without the work)."""
    n, dims, _ = MEMORY_CASES[name]

    def the_work():
        _expect_results(submission, seed, small_case, what)
        _expect_results(submission, seed, name, f"{what} on the large model", (n,))
    with_the_work(claim, the_work)
    (_, outcome), = _case(submission, seed, name, (n,)).values()
    sizes = oracles.layer_sizes(dims)  # ZeRO-1 shards the model flattened whole, ZeRO-3 each layer
    shard = math.ceil(sum(sizes) / n) if name.startswith("zero1") else sum(math.ceil(s / n) for s in sizes)
    return outcome, 8 * sum(sizes), 8 * shard


def _grown(job, name, start, end):
    """What each rank held more at the mark ``{name}:{end}`` than at ``{name}:{start}``."""
    return [after - before for before, after in zip(held_at(job, f"{name}:{start}"), held_at(job, f"{name}:{end}"))]


@pytest.mark.points(2)
def check_zero1_optimizer_state_bytes(submission, seed, metrics):
    """ShardedOptimizer(Adam) keeps 1/N of Adam's state: a rank's memory after a step beyond its model, read from outside"""
    outcome, model, shard = _memory(submission, seed, "zero1_memory", "ShardedOptimizer(Adam)", "zero1_adam",
                                     "ZeRO-1's state bytes")
    n = MEMORY_CASES["zero1_memory"][0]
    sharded, whole = 4 * shard, 2 * model  # the shard, its gradient and Adam's two moments; Adam's whole state
    limit = sharded + whole / 4
    for rank, held in enumerate(_grown(outcome["job"], "zero1_memory", "start", "steps")):
        metrics[f"rank{rank}_kept_mib"] = round(held / MIB, 1)
        inner = outcome["records"][rank].get("inner_bytes")
        seen = (f" (self.optimizer holds {inner / MIB:.1f} MiB of it, by an in-process count: the rest is kept "
                "elsewhere)" if inner is not None and held - inner > whole / 4 else "")
        assert held <= limit, (
            f"on {n} ranks and a model of {model / MIB:.0f} MiB of float64 parameters, rank {rank} held "
            f"{held / MIB:.1f} MiB more after a step of ShardedOptimizer(Adam) than before it was made (the kernel's "
            f"count of its memory){seen}; a 1/{n} shard with its gradient and Adam's two moments is "
            f"{sharded / MIB:.0f} MiB, Adam's state of the whole model {whole / MIB:.0f} MiB. Keep the optimizer "
            "state of this rank's shard only, and nothing model-sized from one step to the next")


@pytest.mark.points(1)
def check_zero1_traffic(submission, seed):
    """ShardedOptimizer: per step, a reduce-scatter of the gradients and an all-gather of the parameters cross (the kernel's count)"""
    with_the_work("ZeRO-1's traffic", lambda: check_zero1_matches_unsharded_adam(submission, seed))
    for n, (case, outcome) in _case(submission, seed, "zero1_adam").items():
        numel = sum(oracles.layer_sizes(case["dims"]))
        padded = 8 * n * math.ceil(numel / n)  # float64
        # gloo runs a reduce-scatter as a whole all-reduce (course.wire.gloo_bytes)
        want = STEPS * (gloo_bytes("reduce_scatter", 8 * numel, n) + gloo_bytes("all_gather", padded // n, n))
        messages = STEPS * (gloo_messages("reduce_scatter", n) + gloo_messages("all_gather", n))
        expect_crossed(submission, outcome["wire"], "steps", want, messages,
                       f"ShardedOptimizer(Adam) on {n} ranks, {STEPS} steps",
                       f"a reduce-scatter of the {numel} gradients and an all-gather of the padded parameters per step")


@pytest.mark.points(3)
def check_zero3_matches_unsharded_adam(submission, seed):
    """Zero3Sequential + Adam on the shards: full parameters equal unsharded Adam (2 and 4 ranks)"""
    _expect_results(submission, seed, "zero3_adam", "Zero3Sequential with torch.optim.Adam on its shards")


@pytest.mark.points(1)
def check_zero3_stores_only_shards(submission, seed, metrics):
    """Zero3Sequential stores one ceil(numel/N) shard per layer: about 1/N of the model per rank, read from outside"""
    outcome, model, shard = _memory(submission, seed, "zero3_memory", "Zero3Sequential", "zero3_adam",
                                    "ZeRO-3's stored bytes")
    n = MEMORY_CASES["zero3_memory"][0]
    limit = shard + model / 4
    for rank, held in enumerate(_grown(outcome["job"], "zero3_memory", "start", "built")):
        metrics[f"rank{rank}_stored_mib"] = round(held / MIB, 1)
        wrapper = outcome["records"][rank].get("wrapper_bytes")
        seen = f" (the tensors reachable from the wrapper take {wrapper / MIB:.1f} MiB)" if wrapper else ""
        assert held <= limit, (
            f"on {n} ranks, rank {rank} held {held / MIB:.1f} MiB once Zero3Sequential was made from layers of "
            f"{model / MIB:.0f} MiB of parameters (the kernel's count of its memory){seen}; its shards are "
            f"{shard / MIB:.0f} MiB. Are full parameters kept somewhere (the layers themselves, a cache)?")


@pytest.mark.points(1)
def check_zero3_traffic(submission, seed):
    """Zero3Sequential: per step, each layer gathered in forward and in backward, its gradient reduce-scattered (the kernel's count)"""
    with_the_work("ZeRO-3's traffic", lambda: check_zero3_matches_unsharded_adam(submission, seed))
    for n, (case, outcome) in _case(submission, seed, "zero3_adam").items():
        padded = [8 * n * math.ceil(s / n) for s in oracles.layer_sizes(case["dims"])]
        per_step = sum(2 * gloo_bytes("all_gather", layer // n, n) + gloo_bytes("reduce_scatter", layer, n)
                       for layer in padded)
        messages = STEPS * len(padded) * (2 * gloo_messages("all_gather", n) + gloo_messages("reduce_scatter", n))
        expect_crossed(submission, outcome["wire"], "steps", STEPS * per_step, messages,
                       f"Zero3Sequential on {n} ranks, {STEPS} steps",
                       "every layer all-gathered twice and its gradient reduce-scattered once per step")


@pytest.mark.points(2)
def check_zero3_peak_gathered_bytes(submission, seed, metrics):
    """Zero3Sequential frees each layer's gathered parameters: each pass's peak memory, read from outside, far below the model"""
    outcome, model, shard = _memory(submission, seed, "zero3_memory", "Zero3Sequential", "zero3_adam",
                                    "ZeRO-3's peak")
    n, dims, _ = MEMORY_CASES["zero3_memory"]
    layer = model / (len(dims) - 1)
    # Half the model and two layers more: a layer in use, the next one prefetched, their temporaries, with
    # room to spare; in backward the shards' gradients (as large as the shards) come on top.
    phases = (("forward", "built", "forward", 0), ("backward and step", "forward", "steps", shard))
    for phase, start, end, gradients in phases:
        limit = gradients + model / 2 + 2 * layer
        peaks, own = peak_in_phase(outcome["job"], f"zero3_memory:{start}", f"zero3_memory:{end}")
        also = f", the shards' gradients {gradients / MIB:.0f} MiB" if gradients else ""
        for rank, peak in enumerate(peaks):
            metrics[f"rank{rank}_{end}_peak_mib"] = round(peak / MIB, 1)
            if peak > limit and not own:  # a peak that may be an earlier phase's: no verdict either way
                pytest.skip(f"the launcher could not start the ranks' peak memory afresh here (it may not write "
                            f"their /proc/PID/clear_refs), and rank {rank}'s peak in the {phase}, "
                            f"{peak / MIB:.1f} MiB, may be an earlier phase's")
            assert peak <= limit, (
                f"on {n} ranks, rank {rank}'s memory rose up to {peak / MIB:.1f} MiB in the {phase} of "
                f"Zero3Sequential above what it held when the {phase} began (the kernel's count); one "
                f"layer's full parameters are {layer / MIB:.0f} MiB, every layer's {model / MIB:.0f} MiB{also}. Free "
                "each layer's gathered parameters after use (save only the input and the shard for backward, and "
                "gather again there)")
