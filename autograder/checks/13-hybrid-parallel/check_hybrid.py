"""Checks for lab 13's ``hybrid.run_plan``: data × tensor parallel training of a GPT.

Correctness. Every case runs in one rank job of 4 gloo processes
(``autograder.sandbox.ranks``; harness_hybrid.hybrid_cases_rank), each rank
kept apart from the others but for the network. Each rank receives only what
run_plan takes, the plan and the model (its sizes, optimizer, steps and the
seed it makes its data and starting weights from, drawn for each case from the
grading's secret seed), calls ``run_plan(plan, model)`` and sends back what it
returned: its losses and its shard of every parameter. This file trains the
single-process oracle in the grader's own process, with none of the student's
code (``run_plan_oracles.py``): ``course.models.TinyGPT`` with the documented
starting weights (``torch.manual_seed(seed)``, built in float32, cast to
float64), the same ``torch.optim`` optimizer and steps, on the whole global
batch of the documented data, with the mean cross-entropy over every token.
Every step's loss and, after the last step, each rank's shard of every
parameter (cut by the documented layout from the rank's place in the row-major
dp × tp mesh) must equal the oracle's to ``TOL`` = 1e-9 (absolute; float64: a
correct run differs by about 1e-14 with SGD, 1e-13 with Adam, where each mistake
below moves the parameters by more than 1e-4). Cases: 2 × 2, 4 × 1 (data
parallel only), 1 × 4 (tensor parallel only), 2 × 2 with 2 micro-batches, 2 × 2
with layer 0 recomputed ("full") and Adam; the model has 2 layers, hidden 16, 4
heads, sequences of 8, a batch of 8, a vocabulary of 32, and trains 3 SGD steps
of learning rate 0.5 (0.01 for Adam), so that a wrong gradient shows in the
second and third losses and in every parameter. Plans with pp = 2 or zero = 1
must raise ``ValueError``. One more 2 × 2 case, of hidden 64 and one step, is
counted on the wire: the launcher's count of what crossed between the ranks
(the kernel's, ``course.wire``) must be the mesh's traffic
(``run_plan_oracles.mesh_traffic``), which a whole model on every rank exceeds
twofold.

Cost model. One rank job of 4 processes (harness_hybrid.hybrid_measure_rank)
measures this machine while all 4 run at once, before any of the student's
code is imported into them: a process's float32 matmul rate, and gloo's
all_reduce times, to which this file fits α and β of the ring formula
2(p−1)·α + 2(p−1)/p·n·β. Then each rank runs run_plan for each of ``RANKED`` (6
plans of 4 devices: DP, TP and 2 × 2 meshes over GPTs of hidden 64 to 256 and
batches 8 to 128, chosen so that neighbours' times differ by 1.5× or more here).
A plan's step time is taken from outside the ranks: a global ``torch.optim``
step hook makes a mark after every optimizer step, and the time is the shortest
gap between consecutive marks after the first, by the launcher's clock (what
stays in the student's process is the hook that makes the marks: a run_plan
that makes another number of steps fails the check; no code can make a step
look shorter than it took). The student's ``planner.cost_model`` then predicts
each plan's time on the cluster built from the measurement, and its ranking of
the plans must agree with the measured one: Spearman's ρ ≥ ``MIN_SPEARMAN`` =
0.8. With 6 plans that allows two swaps of neighbours (ρ = 0.89), which noise on
a shared machine can cause, but not a swap of two plans two places apart (ρ =
0.77); the same prediction for every plan has no ρ and fails. Below the
threshold but at or above ``RETIME_ABOVE`` = 0.4 (what noise can do: a plan
measured up to four places too slow gives ρ ≥ 0.43) the plans are timed once
more and each keeps its faster time (noise only slows a step), so a busy machine
costs time, not points; a ranking further off than that is the model's, and is
not measured again. Only the ranking is graded: the cost model leaves out what
a step spends in Python and in memory-bound updates, so predicted seconds are
not measured ones.
"""
import math
import statistics
import threading

import pytest

from autograder.grading import seeds
from autograder.grading.checking import load_beside, with_the_work
from autograder.grading.rank_jobs import crossed_in_phases, run_cases
from autograder.grading.submission import failure_from, not_implemented_yet
from autograder.grading.traffic import expect_crossed
from course.fits import ring_allreduce_fit, spearman

oracles = load_beside(__file__, "run_plan_oracles")

TOL = 1e-9
WORLD = 4
MIN_SPEARMAN = 0.8
RETIME_ABOVE = 0.4
CASES_TIMEOUT_S = 40  # a correct job of every case takes ~10 s on 2 cores; a deadlock ends sooner, when the job idles
IDLE_TIMEOUT_S = 5
MEASURE_TIMEOUT_S = 60  # a correct measurement takes ~15-20 s on 2 shared cores


def gpt(**changes):
    base = {"layers": 2, "hidden": 16, "heads": 4, "seq": 8, "batch": 8, "vocab": 32, "dropout": 0.0,
            "precision": "fp64", "optimizer": "sgd", "steps": 3, "lr": 0.5, "seed": 13}
    return dict(base, **changes)


def plan(dp, tp, layers=2, **changes):
    base = {"dp": dp, "tp": tp, "pp": 1, "microbatches": 1, "zero": 0, "schedule": "1f1b", "stages": [layers],
            "recompute": ["none"] * layers}
    return dict(base, **changes)


CASES = {
    "dp2_tp2": {"plan": plan(2, 2), "model": gpt()},
    "dp4_tp1": {"plan": plan(4, 1), "model": gpt()},
    "dp1_tp4": {"plan": plan(1, 4), "model": gpt()},
    "dp2_tp2_microbatches2": {"plan": plan(2, 2, microbatches=2), "model": gpt()},
    "dp2_tp2_recompute_adam": {"plan": plan(2, 2, recompute=["full", "none"]),
                               "model": gpt(optimizer="adam", lr=0.01)},
    # Wider, for the count of what crossed: its payload outweighs gloo's headers, so that a whole model
    # on every rank (data parallel over all 4) sends twice what the mesh does, NaiveDDP's many messages included.
    "dp2_tp2_wide": {"plan": plan(2, 2), "model": gpt(hidden=64, steps=1)},
    "refuse": {"refuse": [plan(2, 1, pp=2, stages=[1, 1]), plan(2, 2, zero=1)], "model": gpt()},
}
REFUSED = ("pp=2 (dp=2, tp=1, stages [1, 1])", "zero=1 (dp=2, tp=2)")



def _whole(name):
    """Whether every tp rank holds TinyGPT's parameter ``name`` whole (else it is split over the tp group)."""
    return name == "pos" or any(part in name for part in ("ln1.", "ln2.", "ln_f.", "proj.bias", "fc2.bias"))


def _measured_gpt(hidden, batch, seq=64, steps=3):
    return {"layers": 2, "hidden": hidden, "heads": 8, "seq": seq, "batch": batch, "vocab": 512, "dropout": 0.0,
            "precision": "fp32", "optimizer": "sgd", "lr": 0.1, "seed": 0, "steps": steps}


# Measured on 2 shared cores (4 processes): about 0.04, 0.07, 0.15, 0.25, 0.45 and 0.9 s per step; the
# quick ones run more steps, so that the shortest of their gaps is one the machine's other work spared.
RANKED = [
    {"plan": plan(4, 1), "model": _measured_gpt(64, 8, seq=32, steps=6)},
    {"plan": plan(4, 1), "model": _measured_gpt(128, 16, steps=6)},
    {"plan": plan(1, 4), "model": _measured_gpt(128, 16, steps=5)},  # the one before, plus TP all-reduces
    {"plan": plan(2, 2), "model": _measured_gpt(256, 32, steps=4)},
    {"plan": plan(2, 2), "model": _measured_gpt(256, 64)},
    {"plan": plan(2, 2), "model": _measured_gpt(256, 128)},
]


def _describe(entry):
    p, m = entry["plan"], entry["model"]
    return f"dp={p['dp']} tp={p['tp']}, hidden {m['hidden']}, batch {m['batch']}"


# --- correctness ------------------------------------------------------------------------------

def _drawn(seed):
    """CASES with each case's model seed drawn from the grading's secret seed."""
    def seed_of(name):
        return int(seeds.rng(seed, "13", "run_plan", name).integers(2**31))
    return {name: dict(case, model=dict(case["model"], seed=seed_of(name))) for name, case in CASES.items()}


def _job(submission, seed):
    """{case name: outcome} of every case, in as few rank jobs as it takes, once per grading;
    a training case's outcome holds each rank's comparison with single-process training
    ("ranks") and what crossed in its run ("wire")."""
    def run():
        cases = _drawn(seed)

        def after_hang(name, pending):  # every training case runs the same code: each would hang as long
            return [n for n in pending if "refuse" not in cases[n]]

        # The oracle trains while the ranks do (torch's first use costs seconds here), not after them.
        oracle = threading.Thread(target=lambda: [oracles.single_process(c["model"]) for c in cases.values()
                                                  if "plan" in c], daemon=True)
        oracle.start()
        found = run_cases(submission, "torch", "hybrid_cases_rank", list(cases), lambda name: WORLD,
                          lambda name, rank: cases[name], timeout=CASES_TIMEOUT_S, idle_timeout=IDLE_TIMEOUT_S,
                          count_wire=True, after_hang=after_hang)
        oracle.join()
        for name, outcome in found.items():
            if outcome["status"] != "ok":
                continue
            stub = next((r for r in outcome["records"] if r["status"] != "ok"), None)
            if stub:
                found[name] = {"status": stub["status"], "message": stub["message"]}
            elif "refuse" not in cases[name]:
                ranks_ = [oracles.compare(r, cases[name]["plan"], cases[name]["model"], rank)
                          for rank, r in enumerate(outcome["records"])]
                bad = next((r for r in ranks_ if r["status"] != "ok"), None)
                found[name] = bad or {"status": "ok", "ranks": ranks_,
                                      "wire": crossed_in_phases(outcome["job"], name, ("run",))}
        return found
    return submission.once(("hybrid cases", seed), run)


def _case(submission, seed, name):
    outcome = _job(submission, seed)[name]
    if outcome["status"] == "ok":
        return outcome.get("ranks") or outcome["records"]
    if outcome["status"] == "bad_result":
        raise AssertionError(f"{name}: {outcome['message']}")
    raise failure_from(outcome, f"run_plan on {name}")


def _expect_single_process(submission, seed, name, hint=""):
    """Every rank's losses and parameter shards equal single-process training's."""
    what = f"run_plan({_plan_text(CASES[name]['plan'])})"
    for rank, record in enumerate(_case(submission, seed, name)):
        where = f"{what}, rank {rank} (dp rank {record['dp_rank']}, tp rank {record['tp_rank']})"
        got, want = record["losses"]
        if len(got) != len(want):
            raise AssertionError(f"{where}: {len(got)} losses for {len(want)} steps; return one per step")
        for step, (g, w) in enumerate(zip(got, want)):
            if not abs(g - w) <= TOL:
                ratio = g / w if w else 0.0
                if step and abs(got[0] - want[0]) <= TOL:
                    first = "; the first loss is right, so the forward is: the update (the gradients) is wrong"
                elif _whole_multiple(ratio):
                    first = (f"; it is {ratio:.4g} times the right loss: a sum where the mean is wanted (or the "
                             "reverse), over micro-batches or dp ranks?")
                else:
                    first = ("; the first loss already differs: the weights it starts from (dense_model's, cut by "
                             "tp_shards, and what DDP's broadcast from rank 0 of its group leaves: a group of "
                             "several tp ranks overwrites their shards), the data (make_batches) or the forward "
                             "differ from TinyGPT's")
                raise AssertionError(f"{where}: the loss of step {step} is {g!r}, single-process training gives "
                                     f"{w!r} (the mean over the whole global batch){first}{hint}")
        if record["missing"]:
            raise AssertionError(f"{where}: 'parameters' has no {record['missing'][:4]}; key the shards by "
                                 "TinyGPT's parameter names")
        if record["shapes"]:
            name_, (got_shape, want_shape) = next(iter(record["shapes"].items()))
            raise AssertionError(f"{where}: parameter {name_} has shape {tuple(got_shape)}; this rank's shard is "
                                 f"{tuple(want_shape)} (see tp_shards)")
        wrong = {n: d for n, (d, _) in record["params"].items() if not d <= TOL}
        if wrong:
            worst = max(wrong, key=wrong.get)
            extra = ""
            if not any(_whole(n) for n in wrong):
                extra = ("; only parameters split over the tp group differ, those every tp rank holds whole are "
                         "right: a sum over ranks that hold different shards (gradients averaged over the whole "
                         "world rather than the dp group?)")
            raise AssertionError(f"{where}: after {len(want)} steps {len(wrong)} of {len(record['params'])} "
                                 f"parameters differ from single-process training; the largest difference is "
                                 f"{wrong[worst]:.3g} in {worst}{extra}{hint}")


def _whole_multiple(ratio):
    """Whether ``ratio`` (or its inverse) is a whole number other than 1, to 1e-6."""
    if not math.isfinite(ratio) or ratio <= 0 or abs(ratio - 1) < 1e-6:
        return False
    return any(abs(r - round(r)) < 1e-6 for r in (ratio, 1 / ratio))


def _plan_text(p):
    text = f"dp={p['dp']}, tp={p['tp']}"
    if p["microbatches"] != 1:
        text += f", microbatches={p['microbatches']}"
    if any(r != "none" for r in p["recompute"]):
        text += f", recompute={p['recompute']}"
    return text


@pytest.mark.points(3)
def check_run_plan_2x2_matches_single_process(submission, seed):
    """run_plan on a 2 x 2 DP x TP mesh: every loss and parameter shard equal single-process training's"""
    _expect_single_process(submission, seed, "dp2_tp2")


@pytest.mark.points(2)
def check_run_plan_pure_dp_and_pure_tp_match_single_process(submission, seed):
    """run_plan on 4 x 1 (data parallel only) and 1 x 4 (tensor parallel only) equals single-process training"""
    _expect_single_process(submission, seed, "dp4_tp1")
    _expect_single_process(submission, seed, "dp1_tp4")


@pytest.mark.points(2)
def check_run_plan_gradient_accumulation_matches_single_process(submission, seed):
    """run_plan on 2 x 2 with 2 micro-batches per step equals single-process training on the whole batch"""
    _expect_single_process(submission, seed, "dp2_tp2_microbatches2",
                           "; with micro-batches each backward adds to .grad: divide each micro-batch's loss by "
                           "their number, and communicate once, after the last (no_sync() for the others)")


@pytest.mark.points(2)
def check_run_plan_recompute_and_adam_match_single_process(submission, seed):
    """run_plan on 2 x 2 with layer 0 recomputed ("full") and Adam equals single-process training"""
    _expect_single_process(submission, seed, "dp2_tp2_recompute_adam")


@pytest.mark.points(1)
def check_run_plan_rejects_unsupported_plans(submission, seed):
    """run_plan raises ValueError for a plan with pp=2 and for one with zero=1"""
    for rank, record in enumerate(_case(submission, seed, "refuse")):
        for what, refused in zip(REFUSED, record["refusals"]):
            assert refused["raised"], (f"run_plan with {what} returned on rank {rank} without raising; it runs "
                                       "pp == 1 and zero == 0 only and must raise ValueError otherwise")


@pytest.mark.points(1)
def check_run_plan_2x2_traffic(submission, seed):
    """run_plan on 2 x 2 sends what the mesh needs: each tp group's activation all-reduces, each dp group's shard gradients (the kernel's count)"""
    with_the_work("the mesh's traffic", lambda: _expect_single_process(submission, seed, "dp2_tp2_wide"))
    least, most, messages = oracles.mesh_traffic(CASES["dp2_tp2_wide"]["plan"], CASES["dp2_tp2_wide"]["model"])
    outcome = _job(submission, seed)["dp2_tp2_wide"]
    expect_crossed(submission, outcome["wire"], "run", least, messages,
                   f"run_plan({_plan_text(plan(2, 2))}) of a GPT of hidden 64, one step",
                   "TP's all-reduces of the activations within each tp group and DP's all-reduce of the shards' "
                   "gradients within each dp group (a whole model per rank sends more)", most=most)


# --- the cost model against measured step times ------------------------------------------------------

def measure(submission):
    """One timing of this machine and of run_plan on every ``RANKED`` plan (a rank job; see the
    docstring): {"status": "ok", "flops", "alpha", "beta", "step_time_s": [per plan, None where
    run_plan made another number of optimizer steps], "reported_s": [run_plan's own]}, or
    {"status", "message"}."""
    entries = [dict(entry, case=f"plan {i}") for i, entry in enumerate(RANKED)]
    # timed, not weighed: the ranks' allocator as outside the grader (exact peak memory makes every
    # large temporary fresh from the kernel, which slowed the larger plans' steps twofold here)
    job = submission.rank_job("torch", "hybrid_measure_rank", [entries] * WORLD, timeout=MEASURE_TIMEOUT_S,
                              exact_peaks=False)
    if job.status != "ok":
        return {"status": job.status, "message": job.explain()}
    records = [{r.get("case"): r for r in outputs if isinstance(r, dict)} for outputs in job.outputs]
    alpha, beta = ring_allreduce_fit(records[0]["machine"]["allreduce"])
    times = []
    for entry in entries:
        steps, name = entry["model"]["steps"], entry["case"]
        stamps = [job.mark_times.get(f"{name}:step {k}") for k in range(1, steps + 1)]
        made = {r[name]["steps"] for r in records}
        times.append(None if made != {steps} or None in stamps else min(b - a for a, b in zip(stamps, stamps[1:])))
    return {"status": "ok", "flops": statistics.median(r["machine"]["flops"] for r in records), "alpha": alpha,
            "beta": beta, "step_time_s": times, "reported_s": [records[0][e["case"]]["reported_s"] for e in entries]}


def measured_cluster(measured):
    """The cluster description of this machine from ``measure``'s answer."""
    link = {"alpha": measured["alpha"], "beta": measured["beta"]}
    return {"nodes": [{"devices": WORLD, "flops": measured["flops"], "memory": 1e12}], "intra": link,
            "inter": dict(link)}


@pytest.mark.points(3)
def check_run_plan_times_ranked_by_cost_model(submission, metrics):
    """cost_model ranks 6 plans as run_plan's measured step times do (Spearman's rho >= 0.8)"""
    measured = submission.once("hybrid measure", lambda: measure(submission))
    if measured["status"] != "ok":
        raise failure_from(measured, "this check times run_plan on 6 plans, and run_plan failed")
    times = measured["step_time_s"]
    for entry, seconds in zip(RANKED, times):
        if seconds is None:
            steps = entry["model"]["steps"]
            raise AssertionError(f"run_plan({_describe(entry)}) with steps={steps} did not make {steps} "
                                 "torch.optim optimizer steps on every rank, by which the grader times it: one "
                                 "optimizer.step() per step")
    cluster = measured_cluster(measured)
    predicted = submission.harness("cost_model_times", RANKED, cluster)
    if isinstance(predicted, dict) and "not_implemented" in predicted:
        raise not_implemented_yet(predicted["not_implemented"])
    for entry, answer in zip(RANKED, predicted):
        if "error" in answer:
            raise AssertionError(f"cost_model({_describe(entry)}) raised {answer['error']}")
    predicted_s = [answer["time"] for answer in predicted]
    for entry, seconds in zip(RANKED, predicted_s):
        if not (math.isfinite(seconds) and seconds > 0):
            raise AssertionError(f"cost_model({_describe(entry)}) predicts a step time of {seconds!r} s; a time "
                                 "is a positive number of seconds")
    rho = spearman(predicted_s, times)
    if RETIME_ABOVE <= rho < MIN_SPEARMAN:
        # Other work on the machine can slow one plan's steps: time the plans once more and keep
        # each plan's faster measurement (a step time's noise only ever adds).
        again = measure(submission)
        if again["status"] == "ok" and None not in again["step_time_s"]:
            times = [min(a, b) for a, b in zip(times, again["step_time_s"])]
            rho = spearman(predicted_s, times)
    metrics.update({"spearman": None if math.isnan(rho) else rho, "flops": cluster["nodes"][0]["flops"],
                    "alpha": measured["alpha"], "beta": measured["beta"], "measured_s": times,
                    "predicted_s": predicted_s})
    if math.isnan(rho):
        raise AssertionError(f"cost_model predicts the same time, {predicted_s[0]:.3g} s, for all 6 plans; they "
                             "differ in batch, hidden size and mesh")
    table = "; ".join(f"{_describe(e)}: measured {m * 1e3:.0f} ms, predicted {p * 1e3:.3g} ms"
                      for e, m, p in zip(RANKED, times, predicted_s))
    assert rho >= MIN_SPEARMAN, (
        f"cost_model orders the plans unlike their measured step times: Spearman's rho = {rho:.2f}, at least "
        f"{MIN_SPEARMAN} needed. Cluster measured here: {cluster['nodes'][0]['flops']:.3g} flop/s per device, "
        f"alpha {measured['alpha'] * 1e6:.0f} us, beta {measured['beta']:.3g} s/byte. {table}")
