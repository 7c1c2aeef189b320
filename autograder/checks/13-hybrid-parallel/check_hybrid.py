"""Checks for lab 13's ``hybrid.run_plan``: data × tensor parallel training of a GPT.

Correctness. Every case runs in one ``course.dist`` job of 4 gloo processes
(harness_hybrid.hybrid_cases_job). Each rank calls the student's
``run_plan(plan, model)``, then trains the single-process oracle itself, with
none of the student's code: ``course.models.TinyGPT`` with the documented
starting weights (``torch.manual_seed(seed)``, built in float32, cast to
float64), the same ``torch.optim`` optimizer and steps, on the whole global
batch of the documented data, with the mean cross-entropy over every token.
Every step's loss and, after the last step, the rank's shard of every
parameter (cut by the documented layout from the rank's place in the row-major
dp × tp mesh) must equal the oracle's to ``TOL`` = 1e-9 (absolute; float64:
a correct run differs by about 1e-14 with SGD, 1e-13 with Adam, where each
mistake below moves the parameters by more than 1e-4). Cases: 2 × 2, 4 × 1
(data parallel only), 1 × 4 (tensor parallel only), 2 × 2 with 2 micro-batches,
2 × 2 with layer 0 recomputed ("full") and Adam; the model has 2 layers,
hidden 16, 4 heads, sequences of 8, a batch of 8, a vocabulary of 32, and
trains 3 SGD steps of learning rate 0.5 (0.01 for Adam), so that a wrong
gradient shows in the second and third losses and in every parameter. Plans
with pp = 2 or zero = 1 must raise ``ValueError``. One more 2 × 2 case, of
hidden 64 and one step, is counted on the wire: the launcher's count of what
crossed between the ranks (``course.wire``) must be the mesh's traffic
(``mesh_traffic``), which a whole model on every rank exceeds twofold.

Cost model. One job of 4 processes (harness_hybrid.hybrid_measure_job)
measures this machine while all 4 run at once: a process's float32 matmul
rate, an α–β fit of gloo's all_reduce to the ring formula
2(p−1)·α + 2(p−1)/p·n·β, and the step time of run_plan for each of
``RANKED`` (6 plans of 4 devices: DP, TP and 2 × 2 meshes over GPTs of
hidden 64 to 256 and batches 8 to 128, chosen so that neighbours' times
differ by 1.5× or more here). The step time is taken from outside run_plan:
the shortest gap between consecutive ``torch.optim`` steps after the first.
The student's ``planner.cost_model`` then predicts each plan's time on the
cluster built from the measurement, and its ranking of the plans must agree
with the measured one: Spearman's ρ ≥ ``MIN_SPEARMAN`` = 0.8. With 6 plans
that allows two swaps of neighbours (ρ = 0.89), which noise on a shared
machine can cause, but not a swap of two plans two places apart (ρ = 0.77);
the same prediction for every plan has no ρ and fails. Below the threshold
but at or above ``RETIME_ABOVE`` = 0.4 (what noise can do: a plan measured up
to four places too slow gives ρ ≥ 0.43) the plans are timed once more and each
keeps its faster time (noise only slows a step), so a busy machine costs time,
not points; a ranking further off than that is the model's, and is not
measured again. Only the
ranking is graded: the cost model leaves out what a step spends in Python
and in memory-bound updates, so predicted seconds are not measured ones.
"""
import math

import pytest

from autograder.grading.checking import with_the_work
from autograder.grading.submission import failure_from, not_implemented_yet
from autograder.grading.traffic import expect_crossed
from course.fits import spearman
from course.wire import gloo_bytes, gloo_messages

TOL = 1e-9
WORLD = 4
MIN_SPEARMAN = 0.8
RETIME_ABOVE = 0.4


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

def _case(submission, name):
    outcome = submission.harness_once("hybrid_cases", "hybrid_cases_job", CASES)[name]
    if outcome["status"] == "ok":
        return outcome["ranks"]
    if outcome["status"] == "bad_result":
        raise AssertionError(f"{name}: {outcome['message']}")
    raise failure_from(outcome, f"run_plan on {name}")


def _expect_single_process(submission, name, hint=""):
    """Every rank's losses and parameter shards equal single-process training's."""
    what = f"run_plan({_plan_text(CASES[name]['plan'])})"
    for rank, record in enumerate(_case(submission, name)):
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
def check_run_plan_2x2_matches_single_process(submission):
    """run_plan on a 2 x 2 DP x TP mesh: every loss and parameter shard equal single-process training's"""
    _expect_single_process(submission, "dp2_tp2")


@pytest.mark.points(2)
def check_run_plan_pure_dp_and_pure_tp_match_single_process(submission):
    """run_plan on 4 x 1 (data parallel only) and 1 x 4 (tensor parallel only) equals single-process training"""
    _expect_single_process(submission, "dp4_tp1")
    _expect_single_process(submission, "dp1_tp4")


@pytest.mark.points(2)
def check_run_plan_gradient_accumulation_matches_single_process(submission):
    """run_plan on 2 x 2 with 2 micro-batches per step equals single-process training on the whole batch"""
    _expect_single_process(submission, "dp2_tp2_microbatches2",
                           "; with micro-batches each backward adds to .grad: divide each micro-batch's loss by "
                           "their number, and communicate once, after the last (no_sync() for the others)")


@pytest.mark.points(2)
def check_run_plan_recompute_and_adam_match_single_process(submission):
    """run_plan on 2 x 2 with layer 0 recomputed ("full") and Adam equals single-process training"""
    _expect_single_process(submission, "dp2_tp2_recompute_adam")


@pytest.mark.points(1)
def check_run_plan_rejects_unsupported_plans(submission):
    """run_plan raises ValueError for a plan with pp=2 and for one with zero=1"""
    for rank, record in enumerate(_case(submission, "refuse")):
        for what, refused in zip(REFUSED, record["refusals"]):
            assert refused["raised"], (f"run_plan with {what} returned on rank {rank} without raising; it runs "
                                       "pp == 1 and zero == 0 only and must raise ValueError otherwise")


def _shard_elements(model, tp):
    """Elements of one tp rank's shard of TinyGPT (``tp_shards``' layout): what DP all-reduces."""
    h, L, V, s = model["hidden"], model["layers"], model["vocab"], model["seq"]
    split = V * h + L * (3 * h * h + 3 * h + h * h + 4 * h * h + 4 * h + 4 * h * h)  # column and row halves
    whole = s * h + L * (2 * h + h + 2 * h + h) + 2 * h  # position table, LayerNorms, row layers' biases
    return split // tp + whole


def mesh_traffic(plan, model):
    """(least, most, messages): the bytes a dp x tp run_plan must send (float64), all ranks
    together. Each step and micro-batch, every tp group all-reduces the [s, b, h]
    activations 2L + 1 times forward (embedding, attention, MLP) and 2L + 1 backward (f
    before q/k/v and fc1, and before the tied head), twice more per recomputed layer, and
    at least 2 per-token values for the loss (at most 3, each way); each dp group
    all-reduces its shard's gradients once a step. ``most`` adds DDP's broadcast of the
    shards, the loss's third value, the step's loss and barriers, and gloo's headers for
    all of those messages (NaiveDDP's one all-reduce per parameter included)."""
    dp, tp, m = plan["dp"], plan["tp"], plan["microbatches"]
    L, steps = model["layers"], model["steps"]
    tokens = model["seq"] * model["batch"] // dp // m
    activation, shard = 8 * tokens * model["hidden"], 8 * _shard_elements(model, tp)
    per_micro = (4 * L + 2 + 2 * plan["recompute"].count("full")) * gloo_bytes("all_reduce", activation, tp)
    loss = gloo_bytes("all_reduce", 8 * tokens, tp)
    least = steps * (dp * m * (per_micro + 2 * loss) + tp * gloo_bytes("all_reduce", shard, dp))
    per_micro_reduces = 4 * L + 2 + 2 * plan["recompute"].count("full") + 6  # + the loss's, both ways
    parameters = 2 + 12 * L + 2  # TinyGPT's tensors: NaiveDDP all-reduces each on its own
    messages = steps * (dp * m * per_micro_reduces * gloo_messages("all_reduce", tp)
                        + tp * (parameters + 3) * gloo_messages("all_reduce", dp))  # + the loss, two barriers
    most = least + steps * dp * m * 4 * loss + tp * gloo_bytes("broadcast", shard, dp)
    return least, most, messages


@pytest.mark.points(1)
def check_run_plan_2x2_traffic(submission):
    """run_plan on 2 x 2 sends what the mesh needs: each tp group's activation all-reduces, each dp group's shard gradients (the kernel's count)"""
    with_the_work("the mesh's traffic", lambda: _expect_single_process(submission, "dp2_tp2_wide"))
    least, most, messages = mesh_traffic(CASES["dp2_tp2_wide"]["plan"], CASES["dp2_tp2_wide"]["model"])
    outcome = submission.harness_once("hybrid_cases", "hybrid_cases_job", CASES)["dp2_tp2_wide"]
    expect_crossed(submission, outcome["wire"], "run", least, messages,
                   f"run_plan({_plan_text(plan(2, 2))}) of a GPT of hidden 64, one step",
                   "TP's all-reduces of the activations within each tp group and DP's all-reduce of the shards' "
                   "gradients within each dp group (a whole model per rank sends more)", most=most)


# --- the cost model against measured step times ------------------------------------------------------

def measured_cluster(measured):
    """The cluster description of this machine from ``hybrid_measure_job``'s answer."""
    link = {"alpha": measured["alpha"], "beta": measured["beta"]}
    return {"nodes": [{"devices": WORLD, "flops": measured["flops"], "memory": 1e12}], "intra": link,
            "inter": dict(link)}


@pytest.mark.points(3)
def check_run_plan_times_ranked_by_cost_model(submission, metrics):
    """cost_model ranks 6 plans as run_plan's measured step times do (Spearman's rho >= 0.8)"""
    measured = submission.harness_once("hybrid_measure", "hybrid_measure_job", RANKED)
    if measured["status"] != "ok":
        raise failure_from(measured, "this check times run_plan on 6 plans, and run_plan failed")
    times = [entry["step_time_s"] for entry in measured["entries"]]
    for entry, seconds in zip(RANKED, times):
        if seconds is None:
            steps = entry["model"]["steps"]
            raise AssertionError(f"run_plan({_describe(entry)}) with steps={steps} did not make {steps} "
                                 "torch.optim optimizer steps, by which the grader times it: one "
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
        again = submission.harness("hybrid_measure_job", RANKED)
        if again["status"] == "ok" and all(e["step_time_s"] is not None for e in again["entries"]):
            times = [min(a, e["step_time_s"]) for a, e in zip(times, again["entries"])]
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
