"""Checks for lab 11: the executor, ``run_pipeline``, on 2 and 4 ranks.

Every input is drawn from the grading's secret seed, here in the grader: a
float64 MLP (8 Linear layers, Tanh between them, widths 5 -> 8 -> ... -> 8 ->
3), 4 microbatches of 3 rows and their targets, and for the "shuffled" case a
valid op order that is neither GPipe's nor 1F1B's. Each case runs as a rank job
(``harness.executor_rank``): rank r receives only what its stage needs (its
``8 / p`` layers' weights, its op list, the microbatch inputs on the first rank,
the targets on the last) and sends back its gradients, its loss and the
messages it posted. Here the grader runs one training step of the whole MLP in
one process, the mean loss over the whole batch (``oracles.train_whole_model``:
backpropagation by hand in NumPy, held to torch's autograd by the project's
tests), and compares:

- every gradient and the last rank's loss, to 1e-10;
- what crossed between the ranks, as the kernel counted it: one activation
  forward and one gradient back per microbatch and stage boundary;
- the order of the messages, from each rank's in-process record
  (``course.torch_audit.MessageLog``; each send named here by its data against
  the whole model's boundary tensors, ``oracles.carried``), credited only with
  the right gradients and bytes;
- 1F1B's bound on the microbatches in flight, from outside: one more job of 2
  ranks whose stages keep wide activations (``MEMORY``: 8 MiB per microbatch
  per stage, while the messages stay narrow), each rank's peak memory read by
  the launcher.
"""
import math
import random

import numpy as np
import pytest

from autograder.grading import seeds
from autograder.grading.checking import load_beside, with_the_work
from autograder.grading.rank_jobs import crossed_in_phases, held_at_peak, run_cases
from autograder.grading.submission import failure_from
from autograder.grading.traffic import expect_crossed

oracles = load_beside(__file__, "oracles")

WORLD_SIZES = (2, 4)
DIMS = (5, 8, 8, 8, 8, 8, 8, 8, 3)  # 8 Linear layers; every stage boundary carries width 8
ROWS = 3  # per microbatch
MICROBATCHES = 4
EXECUTOR_CASES = ("gpipe", "1f1b", "shuffled")
TOLERANCE = 1e-10
JOB_TIMEOUT_S = 30  # a correct job of 4 processes takes a few seconds; a deadlock ends sooner, when the job idles
IDLE_TIMEOUT_S = 5
# Wide inside a stage, narrow between stages: every microbatch in flight keeps two 512 x 1024 Tanh
# outputs (8 MiB) in each stage until its backward, while a message carries 512 x 4 (16 KiB).
MEMORY = {"dims": (4, 1024, 4, 1024, 4, 1024, 4, 1024, 4), "rows": 512, "microbatches": 8, "ranks": 2}
# The job runs two cases, a first of p microbatches (as many as 1F1B keeps in flight on rank 0)
# and then one of 8, and the check reads how much each rank's peak grew during the second: the
# process group, the harness's and torch's own first allocations and one microbatch's temporaries
# are all in the first peak already, whatever they come to on a machine (locally 40-50 MiB; 108 MiB
# on one CI machine, where a single peak above the inputs failed the reference). Measured here: the
# reference's peak grows by 0-2 MiB, an executor that runs all forwards first by 48 MiB (6 x 8).
MEMORY_TIMEOUT_S = 60


def _case(seed, name, p, dims=DIMS, rows=ROWS, m=MICROBATCHES):
    """A case on ``p`` ranks: the MLP's layers, the microbatches and targets, the op lists."""
    rng = seeds.rng(seed, "11", "executor", name, p)
    layers = oracles.draw_model(rng, dims)
    xs = [rng.standard_normal((rows, dims[0])) for _ in range(m)]
    ys = [rng.standard_normal((rows, dims[-1])) for _ in range(m)]
    schedule = (oracles.shuffled_schedule(random.Random(int(rng.integers(2**62))), p, m) if name == "shuffled"
                else oracles.executor_schedule(name.split()[0], p, m))
    per = len(layers) // p
    return {"name": name, "p": p, "layers": layers, "xs": xs, "ys": ys, "schedule": schedule,
            "activation_shape": (rows, dims[per])}


def _part(case, rank):
    """What rank ``rank`` receives of a case: its op list and layers, the inputs on the first
    rank, the targets on the last, and nothing of the others'."""
    p, layers = case["p"], case["layers"]
    per = len(layers) // p
    part = {"ops": case["schedule"][rank], "m": len(case["xs"]), "activation_shape": case["activation_shape"],
            "weights": [{"weight": w, "bias": b, "last": i == len(layers) - 1}
                        for i, (w, b) in enumerate(layers) if i // per == rank]}
    if rank == 0:
        part["microbatches"] = case["xs"]
    if rank == p - 1:
        part["targets"] = case["ys"]
    return part


def _trained(submission, case):
    """The whole model trained in one process (the grader's oracle), once per case."""
    return submission.once(("trained", case["name"], case["p"]),
                           lambda: oracles.train_whole_model(case["layers"], case["xs"], case["ys"], case["p"]))


def _job(submission, seed, p):
    """{name: (case, outcome)} of every case on ``p`` ranks, once per grading. On 4 ranks only
    the cases that ran on 2 run (the checks stop at the first failure; a hang costs seconds)."""
    def run():
        names = EXECUTOR_CASES
        if p != WORLD_SIZES[0]:
            first = _job(submission, seed, WORLD_SIZES[0])
            names = [name for name, (_, outcome) in first.items() if outcome["status"] == "ok"]
        cases = {name: _case(seed, name, p) for name in EXECUTOR_CASES}
        found = run_cases(submission, "torch", "executor_rank", list(names), lambda name: p,
                          lambda name, rank: _part(cases[name], rank), timeout=JOB_TIMEOUT_S,
                          idle_timeout=IDLE_TIMEOUT_S, count_wire=True, after_hang=lambda hung, pending: list(pending))
        for name, outcome in found.items():
            stub = next((r for r in outcome.get("records", []) if r.get("status") != "ok"), None)
            if outcome["status"] == "ok" and stub:
                found[name] = {"status": stub["status"], "message": stub["message"]}
            elif outcome["status"] == "ok":
                outcome["wire"] = crossed_in_phases(outcome["job"], name, ("steps",))
        not_run = {"status": "crashed", "message": f"not run: it failed on {WORLD_SIZES[0]} ranks"}
        return {name: (cases[name], found.get(name, not_run)) for name in EXECUTOR_CASES}
    return submission.once(("executor", p), run)


def _outcomes(submission, seed, name):
    """[(case, outcome)] on every world size; a case that did not run fails the check."""
    found = []
    for p in WORLD_SIZES:
        case, outcome = _job(submission, seed, p)[name]
        if outcome["status"] != "ok":
            raise failure_from(outcome, f"run_pipeline with the {name} schedule on {p} ranks")
        found.append((case, outcome))
    return found


def _expect_trains_right(submission, case, records):
    """Every gradient of every rank and the last rank's loss equal single-process training."""
    trained, p = _trained(submission, case), case["p"]
    per = len(case["layers"]) // p
    what = (f"run_pipeline with the check's {case['name']} ops, {len(case['xs'])} microbatches of "
            f"{case['activation_shape'][0]} rows, on {p} ranks")
    for rank, record in enumerate(records):
        want = [g for layer in trained["grads"][rank * per:(rank + 1) * per] for g in layer]
        got = record["grads"]
        assert len(got) == len(want), f"{what}: rank {rank}'s stage has {len(got)} parameters, expected {len(want)}"
        for found, grad in zip(got, want):
            assert found["grad"] is not None, (f"{what}: rank {rank}'s {found['name']} has no gradient after "
                                               "run_pipeline (backward never reached it?)")
            error = float(np.abs(np.asarray(found["grad"]) - grad).max()) if np.shape(found["grad"]) == grad.shape \
                else math.inf
            assert error <= TOLERANCE, (
                f"{what}: rank {rank}'s {found['name']}.grad differs from single-process training on the whole "
                f"batch (mean loss) by {error:.3g}; expected at most {TOLERANCE:g}. Did the last rank divide each "
                "microbatch's loss by m, and did every B backpropagate the gradient received from rank+1?")
    loss = records[-1]["loss"]
    assert isinstance(loss, float) and math.isclose(loss, trained["loss"], rel_tol=TOLERANCE), (
        f"{what}: the last rank returned the loss {loss!r}, expected the mean loss {trained['loss']:.12g} "
        "(single process, whole batch)")


def _expect_single_process(submission, seed, name):
    for case, outcome in _outcomes(submission, seed, name):
        _expect_trains_right(submission, case, outcome["records"])


@pytest.mark.points(2)
def check_executor_gpipe_matches_single_process(submission, seed):
    """run_pipeline with GPipe ops: every gradient and the loss equal single-process training (2 and 4 ranks)"""
    _expect_single_process(submission, seed, "gpipe")


@pytest.mark.points(2)
def check_executor_1f1b_matches_single_process(submission, seed):
    """run_pipeline with 1F1B ops: every gradient and the loss equal single-process training (2 and 4 ranks)"""
    _expect_single_process(submission, seed, "1f1b")


def _named(submission, case, records):
    """Each rank's messages, each send named by what its data is (the grader's boundary tensors)."""
    trained = _trained(submission, case)
    return [[{**m, "carries": oracles.carried(m["data"], m["peer"], rank, trained) if m["kind"] == "send" else None}
             for m in record["messages"]] for rank, record in enumerate(records)]


@pytest.mark.points(1)
def check_executor_follows_the_schedule(submission, seed):
    """run_pipeline's sends and receives follow its ops (GPipe, 1F1B, shuffled): one microbatch each, in that order"""
    for name in EXECUTOR_CASES:
        for case, outcome in _outcomes(submission, seed, name):
            p, schedule, shape = case["p"], case["schedule"], case["activation_shape"]
            with_the_work("the order of its messages",
                          lambda: _expect_trains_right(submission, case, outcome["records"]))
            # What crossed, as the kernel counted it: each microbatch's activation forward and gradient
            # back over every stage boundary, and nothing else.
            messages = 2 * (p - 1) * len(case["xs"])
            expect_crossed(submission, outcome["wire"], "steps", messages * 8 * math.prod(shape), messages,
                           f"run_pipeline with the {name} ops on {p} ranks",
                           "one activation forward and one gradient back per microbatch and stage boundary")
            # The order: each rank's own record of what it posted (in-process), credited with the above.
            problem = oracles.message_problem(schedule, _named(submission, case, outcome["records"]), shape)
            assert problem is None, (
                f"run_pipeline with the check's {name} ops on {p} ranks: {problem}. Each op is one microbatch: "
                "F receives from rank - 1 and sends to rank + 1, B receives from rank + 1 and sends to rank - 1, "
                "in the order of ops")


# --- 1F1B's microbatches in flight, from outside ------------------------------------------------

def _memory_job(submission, seed):
    """(the two cases, the job) of 1F1B on the wide model (``MEMORY``): p microbatches, then
    ``MEMORY["microbatches"]``, each rank marking after each; once per grading."""
    def run():
        p = MEMORY["ranks"]
        cases = [_case(seed, f"1f1b memory {m}", p, MEMORY["dims"], MEMORY["rows"], m)
                 for m in (p, MEMORY["microbatches"])]
        parts = [[{"case": case["name"], **_part(case, rank)} for case in cases] for rank in range(p)]
        return cases, submission.rank_job("torch", "memory_rank", parts, timeout=MEMORY_TIMEOUT_S,
                                          idle_timeout=IDLE_TIMEOUT_S)
    return submission.once("memory", run)


def held_per_microbatch(dims, rows, p):
    """Bytes one microbatch in flight keeps in a stage until its backward: the outputs of
    the stage's Tanh layers that are wider than a message (autograd saves each for its
    backward), in float64."""
    per = (len(dims) - 1) // p
    return max(sum(rows * width * 8 for width in dims[s * per + 1:(s + 1) * per + 1] if width > dims[per])
               for s in range(p))


@pytest.mark.points(1)
def check_executor_1f1b_holds_p_microbatches(submission, seed, metrics):
    """run_pipeline with 1F1B ops: rank r's peak memory, read from outside, stays below m microbatches' activations"""
    # Not run for an executor that trains wrong or hangs on the small cases already: it could not count.
    with_the_work("holding few microbatches", lambda: _expect_single_process(submission, seed, "1f1b"))
    (first, case), job = _memory_job(submission, seed)
    p, m = case["p"], len(case["xs"])
    what = (f"run_pipeline with 1F1B ops on {p} ranks, {len(first['xs'])} and then {m} microbatches of "
            f"{MEMORY['rows']} rows through stages of widths {MEMORY['dims'][:len(MEMORY['dims']) // p + 1]}")
    if job.status != "ok":
        raise failure_from({"status": job.status, "message": job.explain()}, what)
    for index, each in enumerate((first, case)):
        records = [outputs[index] if len(outputs) > index else {"status": "crashed"} for outputs in job.outputs]
        stub = next((r for r in records if r.get("status") != "ok"), None)
        if stub:
            raise failure_from({"status": stub["status"], "message": stub.get("message", "")}, what)
        with_the_work("holding few microbatches", lambda: _expect_trains_right(submission, each, records))
    before, after = (held_at_peak(job, f"{c['name']}:done") for c in (first, case))
    if before is None or after is None or not all(before) or not all(after):
        pytest.skip("this machine gives the launcher no reading of a process's memory (/proc/PID/status)")
    unit = held_per_microbatch(MEMORY["dims"], MEMORY["rows"], p)
    grown = [b - a for a, b in zip(before, after)]
    metrics.update(peak_growth_mib=[round(g / 2**20, 1) for g in grown], per_microbatch_mib=unit / 2**20)
    for rank, bytes_grown in enumerate(grown):
        in_flight = min(m, p - rank)
        limit = (m - in_flight) / 2 * unit  # halfway between 1F1B's bound and all m microbatches in flight
        assert bytes_grown < limit, (
            f"{what}: rank {rank} held {bytes_grown / 2**20:.0f} MiB more at its peak in the second run than in "
            f"the first (the kernel's count of its memory). Each microbatch in flight keeps {unit / 2**20:.0f} MiB of "
            f"activations in its stage; 1F1B keeps at most {in_flight} in flight on rank {rank} in both runs, "
            f"so its peak hardly grows, while holding all {m} grows it by about "
            f"{(m - max(len(first['xs']), in_flight)) * unit / 2**20:.0f} MiB. Run the ops in the order given, and let a "
            "microbatch's activations go once its B has run")
