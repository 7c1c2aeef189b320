"""Checks for lab 07: the memory of a training step, estimated before it runs, and a profiled step.

Every answer is computed here, in the grader's process (``oracles.py``), from
configurations drawn from the grading's secret seed; the sandbox only calls the
student's functions (``harness.py``). The oracles, none of them the reference:

- static terms: a TinyGPT built with the configuration on the meta device
  (``sum(p.numel())``), and one real training step with torch's own Adam or SGD,
  after which the bytes of the parameters, gradients and optimizer state (the
  float32 master copy included in mixed precision) are summed;
- published figures: 16 bytes per parameter for mixed-precision Adam
  (Rajbhandari et al., ZeRO, 2020: 2Ψ + 2Ψ + 12Ψ, so at least 24 GB for the
  1.5B-parameter GPT-2), and sbh(34 + 5as/h) bytes of activations per GPT layer
  with 2-byte activations and 1-byte dropout masks (Korthikanti et al., 2022,
  §4.1), 2sbh per layer with full recomputation. These shapes are fixed: they
  are the point of those checks;
- activations: the bytes autograd saves for backward in a traced forward pass,
  in float32 and bfloat16, with and without checkpointing, on four shapes drawn
  per grading. The estimate must be within 10%: it leaves out the token ids, the
  targets and the LayerNorm statistics, 0.3-6% of the total at these sizes (the
  most with checkpointing, where little else is kept), while in every grading each
  term the checks aim at is 15% or more of a shape's total (the s² attention terms
  16-76%, the checkpointed blocks' insides several times the rest, the loss's
  log-probabilities 22-26% with checkpointing);
- models too large to run (1-7B parameters): nothing can be measured, so the
  answer follows from the structure. What autograd saves is a sum of known
  monomials in (L, s, b, h, a, V) with whole coefficients, solved for exactly
  from small traced runs and evaluated at the large shape (``oracles.ActivationFit``);
- profile_step: the parameters after the student's step equal those after the
  same step replayed here with torch; the matrix multiplies the profiler counted
  equal what the model's structure implies (3 per matmul: one in forward, two in
  backward; checkpointing repeats the forward's); times add up.

An estimate or a run? A forward pass traced on the meta device gives the exact
bytes at any size and allocates nothing, so no value, and no memory reading, tells
it from a formula. Its cost does: a formula answers in microseconds, a traced run
in milliseconds per layer. In a job of one process (``harness.estimates_rank``)
the launcher counts its CPU seconds, from outside (the kernel's count), while it
builds four 32-40-layer models on the meta device, then runs their forward
passes there, then imports the student's module and makes its estimates.
The estimates may build the model (``count_parameters`` on the meta device is
allowed: its docstring defines the count that way) but not run it: they must cost
less than halfway between building the models and building and running them,
plus 0.1 s. A traced run does at least what the grader's run does, so it lands
half a forward pass above. Measured on the 2-core machine under load (8
gradings): the forward passes cost 2.2-2.8 times the building; the estimates of
a traced run (``tests/fixtures/shortcut_07.py``) 1.5-2.3 times the budget, those
that build the model to count it 0.35-0.39 times, the reference's 0.00 s. What
it cannot tell apart: a trace of one block, scaled by L, passes (0.17 s against a
1 s budget); an estimator that builds the model three times or more per estimate
is refused as if it ran it.

GPU tier: the estimated peak against ``torch.cuda.max_memory_allocated`` of a
real step, measured in the grader. Its tolerance is a guess from the model, not
yet validated on hardware. Its dry run (``k2c grade 07 --dry-run-gpu``, CPU
tier, awarding nothing) runs the same lines on a tiny model on the CPU, with
``oracles.CudaMemoryStandIn`` answering for ``torch.cuda``: the live bytes of a
CPU step's tensors. The reference's estimate is 0.88-0.99 of them on every tiny
shape the seed can draw (measured), so the same tolerance applies there, and an
estimate far off fails the dry run.
"""
import time

import numpy as np
import pytest

from autograder.grading import seeds
from autograder.grading.checking import load_beside, with_the_work
from autograder.grading.rank_jobs import cpu_in_phase
from autograder.grading.submission import SubmissionError, failure_from, not_implemented_yet
from autograder.sandbox import Outcome

cases = load_beside(__file__, "cases")
oracles = load_beside(__file__, "oracles")

ACTIVATION_TOLERANCE = 0.10
GPU_PEAK_TOLERANCE = 0.20  # transients (scores before softmax, logits, their gradients) are not in the estimate
CPU_ALLOWANCE_S = 0.1  # an import and a few dicts; the kernel counts CPU time in 10 ms ticks
LARGE_TIMEOUT_S = 50


def _unwrap(attempt, what):
    """The value of one call, or the error a student can act on."""
    if attempt["status"] == "ok":
        return attempt["value"]
    message = attempt["message"]
    if attempt["status"] == "not_implemented":
        raise not_implemented_yet(message)
    raise SubmissionError(f"{what} raised {message}", Outcome("raised", message=message))


def _answers(submission, seed, config):
    """The student's answers for ``config``: the small models in one call, the large ones in another
    (a submission that runs them and runs out of memory loses only the checks of the large ones)."""
    for key, asked in (("small", cases.small_configs), ("large", cases.large_configs), ("gpu", cases.gpu_configs),
                       ("gpu dry run", lambda seed: cases.gpu_configs(seed, dry_run=True))):
        configs = asked(seed)
        if config in configs:
            return submission.harness_once(key, "student_answers", configs)["per_config"][configs.index(config)]
    raise KeyError(config)


def _answer(submission, seed, config, name, answers=None):
    found = (answers if answers is not None else _answers(submission, seed, config))[name]
    return _unwrap(found, f"{name}({cases.describe(config)})")


def _timed(submission, seed):
    """The rank job that counts the estimates' CPU seconds (``harness.estimates_rank``), once per grading."""
    def run():
        job = submission.rank_job("torch", "estimates_rank", [cases.timed_configs(seed)], timeout=LARGE_TIMEOUT_S)
        if job.status == "timeout" and "ran" not in job.cpu_s:  # the grader's own runs: the machine's fault
            submission.cannot_grade = (f"the grader's own meta-device runs of four 1-7B models did not finish within "
                                       f"{LARGE_TIMEOUT_S} s: the machine is too busy; grade again with fewer "
                                       "gradings at once")
            raise SubmissionError(submission.cannot_grade, Outcome("crashed", message=submission.cannot_grade))
        if job.status == "timeout":  # no collective here to deadlock: the time went on the estimates
            message = (f"your estimates for four 1-7B models did not finish within {LARGE_TIMEOUT_S} s of the job "
                       "(a formula takes microseconds)")
            raise failure_from({"status": "timeout", "message": message}, "the estimates' CPU time")
        if job.status != "ok":
            raise failure_from({"status": job.status, "message": job.explain()},
                               "the estimates for models of 1-7B parameters")
        return job
    return submission.once("timed", run)


def _estimate(submission, seed, config, answers=None):
    got = _answer(submission, seed, config, "estimate_train_memory", answers)
    keys = {"parameters", "gradients", "optimizer_state", "activations", "peak"}
    assert isinstance(got, dict) and keys <= set(got), (
        f"estimate_train_memory should return a dict with keys {sorted(keys)}, got {got!r:.200}")
    return got


def _fit(submission, config):
    try:
        return oracles.fit_for(config)
    except oracles.FitError as exc:  # the grader's model of the model is out of date: exit 2, never a zero
        submission.cannot_grade = str(exc)
        raise SubmissionError(f"this machine cannot grade this check: {exc}", Outcome("crashed", message=str(exc)))


# --- static terms ----------------------------------------------------------------------

@pytest.mark.points(2)
def check_parameter_count(submission, seed):
    """count_parameters equals the parameter count of a TinyGPT built with the config"""
    for shape_name, shape in cases.small_shapes(seed).items():
        config = dict(shape, precision="fp32", optimizer="adam", checkpointing=False)
        got = _answer(submission, seed, config, "count_parameters")
        want = oracles.parameter_count(config)
        tied = ". The LM head shares the embedding's weight: count it once" if got == want + shape["vocab"] * shape[
            "hidden"] else ""
        assert got == want, (f"count_parameters for the {shape_name} shape ({cases.describe(config)}): got {got}, "
                             f"a built TinyGPT has {want}{tied}")


@pytest.mark.points(2)
@pytest.mark.parametrize("precision", cases.PRECISIONS)
def check_static_terms(submission, seed, precision):
    """parameters, gradients and optimizer_state equal the bytes torch holds after a real step (Adam, SGD, SGD+momentum)"""
    configs = [c for c in cases.small_configs(seed) if c["precision"] == precision and not c["checkpointing"]]
    _estimate(submission, seed, configs[0])  # a stub fails here, before the measured runs
    for config in configs:
        got = _estimate(submission, seed, config)
        want = submission.once(("states", repr(config)), lambda: oracles.state_bytes(config))
        for key in ("parameters", "gradients", "optimizer_state"):
            assert got[key] == want[key], (
                f"{key} for {cases.describe(config)}: estimated {got[key]} bytes, torch holds {want[key]} "
                f"({want[key] / want['numel']:g} bytes per parameter for {want['numel']} parameters)"
                + (". Mixed precision keeps a float32 master copy in the optimizer's state"
                   if precision == "mixed" and key == "optimizer_state" else ""))
        twin = dict(config, checkpointing=True)  # the same static terms
        assert all(_estimate(submission, seed, twin)[key] == want[key] for key in ("parameters", "gradients",
                                                                                   "optimizer_state")), (
            f"the static terms for {cases.describe(twin)} differ from those without checkpointing")


@pytest.mark.points(2)
def check_zero_16_bytes_per_parameter(submission, seed):
    """mixed-precision Adam takes 2 + 2 + 12 = 16 bytes per parameter (ZeRO): at least 24 GB for GPT-2 1.5B"""
    split = _unwrap(submission.harness_once("large", "student_answers", cases.large_configs(seed))["per_parameter"][
        "mixed/adam"], "state_bytes_per_parameter('mixed', 'adam')")
    want = {"parameters": 2, "gradients": 2, "optimizer_state": 12}
    assert split == want, f"state_bytes_per_parameter('mixed', 'adam') = {split}, ZeRO's split is {want}"
    psi = oracles.parameter_count(cases.GPT2_XL)  # built on the meta device
    got = _estimate(submission, seed, cases.GPT2_XL)
    states = got["parameters"] + got["gradients"] + got["optimizer_state"]
    assert states == 16 * psi, (f"GPT-2 XL ({psi / 1e9:.2f}B parameters), mixed precision with Adam: parameters + "
                                f"gradients + optimizer state = {states / 1e9:.2f} GB, expected 16 bytes per "
                                f"parameter = {16 * psi / 1e9:.2f} GB")
    assert states >= 24e9, f"ZeRO says the 1.5B GPT-2 needs at least 24 GB of model states, got {states / 1e9:.2f} GB"


# --- activations -----------------------------------------------------------------------

@pytest.mark.points(2)
def check_published_activations_per_layer(submission, seed):
    """activation_bytes_per_layer reproduces sbh(34 + 5as/h) (Korthikanti et al. 2022) in mixed precision"""
    for (s, b, h, a), config in zip(cases.PUBLISHED_LAYERS, cases.PUBLISHED[::2]):
        want = s * b * h * 34 + 5 * a * s * s * b  # sbh(34 + 5as/h), exact in integers
        got = _answer(submission, seed, config, "activation_bytes_per_layer")
        hint = (". The attention scores, softmax output and dropout mask (5as²b bytes) are missing"
                if got == s * b * h * 34 else "")
        assert got == want, (f"activation_bytes_per_layer for s={s}, b={b}, h={h}, a={a} in mixed precision: got "
                             f"{got}, the paper gives sbh(34 + 5as/h) = {want} ({want / 2**20:.1f} MiB){hint}")


@pytest.mark.points(1)
def check_published_full_recomputation(submission, seed):
    """with checkpointing, each layer keeps only its input: 2sbh bytes per layer (Korthikanti et al., full recomputation)"""
    for (s, b, h, a), plain, checkpointed in zip(cases.PUBLISHED_LAYERS, cases.PUBLISHED[::2], cases.PUBLISHED[1::2]):
        full = _estimate(submission, seed, plain)["activations"]
        kept = _estimate(submission, seed, checkpointed)["activations"]
        want = s * b * h * 34 + 5 * a * s * s * b - 2 * s * b * h
        assert full - kept == want, (
            f"s={s}, b={b}, h={h}, a={a}, one layer: activations without checkpointing minus with should be "
            f"sbh(34 + 5as/h) - 2sbh = {want} bytes, got {full} - {kept} = {full - kept}")


def _expect_activations(submission, seed, configs, want_of, source, label, answers_of=lambda config: None):
    """Every estimate within the tolerance of ``want_of(config)`` (``source`` says what that is, ``label``
    in a word); the failure shows them all."""
    _estimate(submission, seed, configs[0], answers_of(configs[0]))  # a stub fails here, before the traced runs
    ratios = []
    for config in configs:
        got, want = _estimate(submission, seed, config, answers_of(config))["activations"], want_of(config)
        ratios.append((config, got, want, got / want))
    bad = [r for r in ratios if abs(r[3] - 1) > ACTIVATION_TOLERANCE]
    if bad:
        config, got, want, ratio = bad[0]
        by_seq = ", ".join(f"s={c['seq']} {c['precision']}: {r:.2f}x" for c, _, _, r in ratios)
        raise AssertionError(
            f"activations for {cases.describe(config)}: estimated {got} bytes, {source} {want} for backward "
            f"({ratio:.2f}x; within ±{ACTIVATION_TOLERANCE:.0%} expected). Estimate / {label} for every shape: "
            f"{by_seq}" + _activation_hint(config, ratio))


def _activation_hint(config, ratio):
    if config["checkpointing"] and ratio > 1.5:
        return ". With checkpointing only each block's input is kept until backward"
    if ratio < 1:
        return (". Too little: if the gap grows with s, the as²b attention terms are missing; else look outside "
                "the blocks (the final LayerNorm's and the LM head's inputs, float32 log-probabilities)")
    return ""


def _expect_traced(submission, seed, checkpointing):
    configs = [c for c in cases.small_configs(seed) if c["optimizer"] == "adam" and c["checkpointing"] == checkpointing]
    _expect_activations(submission, seed, configs, lambda config: submission.once(
        ("traced", repr(config)), lambda: oracles.traced_activations(config)), "a traced forward pass saves",
        "traced")


@pytest.mark.points(3)
def check_activations_match_traced_run(submission, seed):
    """activations within 10% of what autograd saves in a traced forward pass (fp32 and bf16, four shapes)"""
    _expect_traced(submission, seed, checkpointing=False)


@pytest.mark.points(2)
def check_checkpointed_activations_match_traced_run(submission, seed):
    """with activation checkpointing, activations within 10% of a traced forward pass"""
    _expect_traced(submission, seed, checkpointing=True)


@pytest.mark.points(1)
def check_peak_adds_up(submission, seed):
    """peak = parameters + gradients + optimizer state + activations (+ one recomputed layer with checkpointing)"""
    for config in cases.small_configs(seed):
        got = _estimate(submission, seed, config)
        total = got["parameters"] + got["gradients"] + got["optimizer_state"] + got["activations"]
        extra = _answer(submission, seed, config, "activation_bytes_per_layer") if config["checkpointing"] else 0
        assert got["peak"] == total + extra, (
            f"peak for {cases.describe(config)}: got {got['peak']}, expected {total} (the four terms)"
            + (f" + {extra} (one block recomputed during backward)" if extra else ""))


# --- models too large to run -----------------------------------------------------------------

def _expect_scale(submission, seed, configs, answers_of=lambda config: None):
    """The estimates for 1-7B models: static terms exact, activations within the tolerance."""
    for config in configs:
        got = _estimate(submission, seed, config, answers_of(config))
        numel = oracles.parameter_count(config)
        for key, per in oracles.bytes_per_parameter(config["precision"], config["optimizer"]).items():
            assert got[key] == numel * per, (
                f"{key} for {cases.describe(config)}: estimated {got[key]} bytes, {numel} parameters at {per} bytes "
                f"each (as torch holds them after a step) are {numel * per}")
    _expect_activations(submission, seed, configs, lambda config: _fit(submission, config).bytes(config),
                        "its structure (fitted exactly on small traced runs) saves", "structure", answers_of)
    for config in configs:
        got = _answer(submission, seed, config, "activation_bytes_per_layer", answers_of(config))
        want = _fit(submission, dict(config, checkpointing=False)).per_block(config)
        assert abs(got / want - 1) <= ACTIVATION_TOLERANCE, (
            f"activation_bytes_per_layer for {cases.describe(config)}: got {got}, a block saves {want} "
            f"({got / want:.2f}x)")


@pytest.mark.points(2)
def check_estimates_at_scale(submission, seed):
    """models of 1-7B parameters: exact static terms, activations within 10% of what their structure saves"""
    _expect_scale(submission, seed, cases.scale_configs(seed))


@pytest.mark.points(2)
def check_estimates_are_computed_not_run(submission, seed, metrics):
    """the estimates for models of 1-7B parameters take less CPU than running the models would (counted from outside)"""
    claim = "an estimate computed, not run"
    timed = cases.timed_configs(seed)
    with_the_work(claim, lambda: _expect_scale(submission, seed, timed))  # a stub or a wrong estimate stops here
    job = _timed(submission, seed)
    answers = job.outputs[0][0]["per_config"]
    with_the_work(claim, lambda: _expect_scale(submission, seed, timed, lambda config: answers[timed.index(config)]))
    [built], [ran], [estimated] = (cpu_in_phase(job, *phase) for phase in (("start", "built"), ("built", "ran"),
                                                                          ("ran", "estimated")))
    budget = built + ran / 2 + CPU_ALLOWANCE_S  # halfway between building the models and building and running them
    metrics.update(build_s=round(built, 2), run_s=round(ran, 2), estimate_s=round(estimated, 2),
                   budget_s=round(budget, 2))
    assert estimated <= budget, (
        f"estimate_train_memory and activation_bytes_per_layer on {len(answers)} models too large to run "
        f"took {estimated:.2f} s of CPU, memory_budget's import included (the kernel's count, read from outside "
        "the process). Building the same models "
        f"on the meta device took {built:.2f} s, running their forward passes there {ran:.2f} s more: an "
        f"estimate may build the model, to count its parameters, but must not run it (at most {budget:.2f} s here). "
        "Work the bytes out from the shape: course.models' docstring lists what every op saves")


# --- profile_step ------------------------------------------------------------------------

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")


def _profile_runs(submission, seed):
    """What profile_step returned, the grader's replay of the same step, and the call's time from outside."""
    def run():
        config = cases.profile_config(seed)
        weights, tokens, targets = oracles.profile_model(config, int(seeds.rng(seed, "07", "weights").integers(2**31)))
        runs = {name: dict(config=dict(config, checkpointing=ckpt), weights=weights, tokens=tokens, targets=targets)
                for name, ckpt in (("plain", False), ("checkpointed", True))}
        started = time.monotonic()
        got = submission.harness("profile_runs", runs)
        outer_s = time.monotonic() - started
        for name, found in got.items():
            loss, params = oracles.replay_step(**runs[name])
            moved = max(float(np.abs(np.asarray(found["parameters"][k]) - p).max()) for k, p in params.items())
            found.update(config=runs[name]["config"], loss=loss, max_param_difference=moved, outer_s=outer_s)
        return got
    return submission.once("profile", run)


def _profile(submission, seed, checkpointing):
    run = _profile_runs(submission, seed)["checkpointed" if checkpointing else "plain"]
    result = run["result"]
    assert isinstance(result, dict) and {"wall_s", "loss", "ops"} <= set(result), (
        f"profile_step should return a dict with keys wall_s, loss and ops, got {result!r:.200}")
    ops = result["ops"]
    assert isinstance(ops, list) and all(isinstance(op, dict) and {"name", "calls", "self_cpu_s"} <= set(op)
                                         for op in ops), (
        "profile_step's ops should be a list of dicts with keys name, calls and self_cpu_s")
    return run, result, ops


@pytest.mark.points(2)
def check_profile_step_trains(submission, seed):
    """profile_step runs one whole training step: the loss and the parameters match the same step in torch"""
    run, result, _ = _profile(submission, seed, checkpointing=False)
    assert abs(result["loss"] - run["loss"]) <= 1e-5 * abs(run["loss"]), (
        f"profile_step's loss is {result['loss']}, the same model and batch give {run['loss']}")
    assert run["max_param_difference"] <= 1e-5, (
        f"after profile_step the parameters differ from one zero_grad/forward/backward/step in torch by up to "
        f"{run['max_param_difference']:.3g}: did the step call backward() and optimizer.step() once each?")


@pytest.mark.points(2)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def check_profile_step_counts_matmuls(submission, seed, checkpointing):
    """the profiled matrix multiplies (aten::mm, addmm, bmm) are the ones the model must run"""
    run, _, ops = _profile(submission, seed, checkpointing)
    calls = {name: sum(op["calls"] for op in ops if op["name"] == name) for name in MATMULS}
    layers = run["config"]["layers"]
    # per block 4 linears + 2 attention matmuls; + the LM head. Forward 1, backward 2 each; checkpointing redoes forward
    want = 3 * (6 * layers + 1) + (6 * layers if checkpointing else 0)
    assert sum(calls.values()) == want, (
        f"profile_step counted {sum(calls.values())} matrix multiplies {calls}; one training step of a "
        f"{layers}-block TinyGPT{' with checkpointing' if checkpointing else ''} runs {want}. Give one entry per "
        "operator name with the profiler's call count (prof.key_averages())")


@pytest.mark.points(1)
def check_profile_step_times(submission, seed):
    """times are in seconds, self times are positive and add up to at most the step's wall time"""
    with_the_work("the profile's times", lambda: check_profile_step_trains(submission, seed))
    run, result, ops = _profile(submission, seed, checkpointing=False)
    wall = result["wall_s"]
    assert 0 < wall <= run["outer_s"], (
        f"wall_s = {wall}, but the call to profile_step (two steps, with the model's set-up) took {run['outer_s']:.2f} "
        "s in all, timed by the grader: seconds, measured around the step?")
    self_times = [op["self_cpu_s"] for op in ops]
    assert all(t >= 0 for t in self_times) and sum(self_times) > 0, "self_cpu_s should be positive seconds"
    assert sum(self_times) <= 1.05 * wall + 1e-3, (
        f"the self CPU times add up to {sum(self_times):.4f} s, more than the step's wall time {wall:.4f} s: "
        "self time excludes the ops an op calls (self_cpu_time_total, in microseconds)")
    assert self_times == sorted(self_times, reverse=True), "ops should be sorted by self CPU time, largest first"
    # The sum above rarely tells inclusive from self time on these small models (the inclusive times of a
    # step add up to about 0.8 of its wall time here). A wrapper does: aten::linear only dispatches to
    # aten::addmm, so its self time is a small part of addmm's (55 and 470 us measured), while its
    # inclusive time holds every addmm it called.
    by_name = {op["name"]: op["self_cpu_s"] for op in ops}
    if "aten::linear" in by_name and "aten::addmm" in by_name:
        assert by_name["aten::linear"] < by_name["aten::addmm"], (
            f"aten::linear's self CPU time ({by_name['aten::linear']:.6f} s) is not below that of aten::addmm "
            f"({by_name['aten::addmm']:.6f} s), which linear calls: self time excludes the ops an op calls "
            "(self_cpu_time_total, not cpu_time_total)")


# --- GPU tier --------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.points(3)
def check_peak_matches_cuda_max_memory_allocated(submission, seed, metrics, gpu_dry_run):
    """the estimated peak within 20% of torch.cuda.max_memory_allocated of a real step (fp32 and bf16, with and without checkpointing)"""
    configs = cases.gpu_configs(seed, dry_run=gpu_dry_run)
    got_all = [_estimate(submission, seed, config) for config in configs]
    # In the grader, on its GPU; in a dry run on the CPU, a stand-in counting live tensor bytes for torch.cuda
    measured = submission.once("cuda peaks", lambda: oracles.cuda_peaks(configs, dry_run=gpu_dry_run))
    metrics["device"] = measured[0]["device"]
    holder, peaked = (("the stand-in's CPU step holds", "the stand-in's live CPU tensor bytes peaked at") if gpu_dry_run
                      else ("the GPU holds", "torch.cuda.max_memory_allocated saw"))
    for config, got, found in zip(configs, got_all, measured):
        ratio = got["peak"] / found["peak"]
        metrics[f"{config['precision']}_ckpt{int(config['checkpointing'])}_estimate_over_measured"] = ratio
        for key in ("parameters", "gradients", "optimizer_state"):
            assert got[key] == found[key], (
                f"{key} for {cases.describe(config)}: estimated {got[key]}, {holder} {found[key]}")
        assert abs(ratio - 1) <= GPU_PEAK_TOLERANCE, (
            f"peak for {cases.describe(config)}: estimated {got['peak'] / 2**20:.1f} MiB, "
            f"{peaked} {found['peak'] / 2**20:.1f} MiB ({ratio:.2f}x)")
