"""Checks for lab 07: the memory of a training step, estimated before it runs, and a profiled step.

Oracles, none of them the reference solution:

- static terms: a ``course.models.TinyGPT`` built with the configuration
  (``sum(p.numel())``) and one real training step with torch's own Adam or SGD,
  after which the bytes of the parameters, gradients and optimizer state
  (the float32 master copy included in mixed precision) are summed;
- published figures: 16 bytes per parameter for mixed-precision Adam
  (Rajbhandari et al., ZeRO, 2020: 2Ψ + 2Ψ + 12Ψ, so at least 24 GB for the
  1.5B-parameter GPT-2), and sbh(34 + 5as/h) bytes of activations per GPT
  layer with 2-byte activations and 1-byte dropout masks (Korthikanti et al.,
  2022, §4.1), 2sbh per layer with full recomputation;
- activations: the bytes autograd saves for backward in a traced forward pass
  (``harness.saved_tensors_bytes``: distinct storages through
  ``torch.autograd.graph.saved_tensors_hooks``), in float32 and in bfloat16,
  with and without checkpointing. The estimate must be within 10%: it leaves out
  the token ids and the LayerNorm statistics, 1-4% of the total at these sizes,
  while each term the checks aim at (the s² attention terms, the checkpointed
  blocks, the loss's log-probabilities) is 15% or more;
- profile_step: the parameters after the student's step equal those after the
  same step replayed with torch; the matrix multiplies the profiler counted
  equal what the model's structure implies (3 per matmul: one in forward, two
  in backward; checkpointing repeats the forward's); times add up.

GPU tier: the estimated peak against ``torch.cuda.max_memory_allocated`` of a
real step (a larger model). That check cannot run on the CPU tier and is
skipped there; its tolerance is a guess from the model, not yet validated on
hardware.
"""
import pytest

from autograder.sandbox import Outcome
from autograder.grading.checking import with_the_work
from autograder.grading.submission import SubmissionError, not_implemented_yet

PRECISIONS = ("fp32", "mixed")
OPTIMIZERS = ("adam", "sgd", "sgd_momentum")
ACTIVATION_TOLERANCE = 0.10
GPU_PEAK_TOLERANCE = 0.20  # transients (scores before softmax, logits, their gradients) are not in the estimate

SHAPES = {
    "base": dict(layers=2, hidden=32, heads=4, seq=32, batch=2, vocab=64, dropout=0.1),
    "short sequences": dict(layers=3, hidden=48, heads=6, seq=16, batch=3, vocab=50, dropout=0.1),
    "long sequence": dict(layers=1, hidden=32, heads=8, seq=128, batch=1, vocab=40, dropout=0.1),
    "no dropout": dict(layers=2, hidden=32, heads=4, seq=64, batch=2, vocab=64, dropout=0.0),
}
CONFIGS = [dict(shape, precision=p, optimizer=o, checkpointing=c)
           for shape in SHAPES.values() for p in PRECISIONS for o in OPTIMIZERS for c in (False, True)]
# Korthikanti et al.'s shapes (s, b, h, a): GPT-3 175B, a 22B model, and a small one; 2-byte activations.
PUBLISHED_LAYERS = [(2048, 1, 12288, 96), (2048, 4, 6144, 64), (32, 2, 32, 4)]
PUBLISHED = [dict(layers=1, hidden=h, heads=a, seq=s, batch=b, vocab=64, dropout=0.1, precision="mixed",
                  optimizer="adam", checkpointing=c) for s, b, h, a in PUBLISHED_LAYERS for c in (False, True)]
GPT2_XL = dict(layers=48, hidden=1600, heads=25, seq=1024, batch=1, vocab=50257, dropout=0.1,
               precision="mixed", optimizer="adam", checkpointing=False)
GPU_SHAPE = dict(layers=4, hidden=512, heads=8, seq=512, batch=4, vocab=1024, dropout=0.1)
GPU_CONFIGS = [dict(GPU_SHAPE, precision=p, optimizer="adam", checkpointing=c) for p in PRECISIONS for c in (False, True)]
ASKED = CONFIGS + PUBLISHED + [GPT2_XL] + GPU_CONFIGS
STATIC = [c for c in CONFIGS if not c["checkpointing"]] + [GPT2_XL]  # what the static terms are measured on


def _describe(config):
    shape = ", ".join(f"{k}={config[k]}" for k in ("layers", "hidden", "heads", "seq", "batch", "vocab", "dropout"))
    return f"{config['precision']}, {config['optimizer']}, checkpointing={config['checkpointing']} ({shape})"


def _unwrap(attempt, what):
    """The value of one call, or the error a student can act on."""
    if attempt["status"] == "ok":
        return attempt["value"]
    message = attempt["message"]
    if attempt["status"] == "not_implemented":
        raise not_implemented_yet(message)
    raise SubmissionError(f"{what} raised {message}", Outcome("raised", message=message))


def _answer(submission, config, name):
    answers = submission.harness_once("answers", "student_answers", ASKED)
    return _unwrap(answers["per_config"][ASKED.index(config)][name], f"{name}({_describe(config)})")


def _estimate(submission, config):
    got = _answer(submission, config, "estimate_train_memory")
    keys = {"parameters", "gradients", "optimizer_state", "activations", "peak"}
    assert isinstance(got, dict) and keys <= set(got), (
        f"estimate_train_memory should return a dict with keys {sorted(keys)}, got {got!r:.200}")
    return got


def _measured(submission):
    return submission.harness_once("states", "measured_states", STATIC)


TRACED = [c for c in CONFIGS if c["optimizer"] == "adam"]  # the optimizer does not change the activations


def _traced(submission, config):
    """Bytes a traced forward pass saves for backward; every traced run in one harness call."""
    return submission.harness_once("traced", "traced_activations", TRACED)[TRACED.index(config)]


# --- static terms ----------------------------------------------------------------------

@pytest.mark.points(2)
def check_parameter_count(submission):
    """count_parameters equals the parameter count of a TinyGPT built with the config"""
    _answer(submission, CONFIGS[0], "count_parameters")
    measured = _measured(submission)
    for shape_name, shape in SHAPES.items():
        config = dict(shape, precision="fp32", optimizer="adam", checkpointing=False)
        want = measured[STATIC.index(config)]["numel"]
        got = _answer(submission, config, "count_parameters")
        tied = ". The LM head shares the embedding's weight: count it once" if got == want + shape["vocab"] * shape[
            "hidden"] else ""
        assert got == want, (f"count_parameters for the {shape_name} shape ({_describe(config)}): got {got}, "
                             f"a built TinyGPT has {want}{tied}")


@pytest.mark.points(2)
@pytest.mark.parametrize("precision", PRECISIONS)
def check_static_terms(submission, precision):
    """parameters, gradients and optimizer_state equal the bytes torch holds after a real step (Adam, SGD, SGD+momentum)"""
    _estimate(submission, STATIC[0])  # a stub fails here, before the measured runs
    measured = _measured(submission)
    for k, config in enumerate(STATIC[:-1]):
        if config["precision"] != precision:
            continue
        got = _estimate(submission, config)
        want = measured[k]
        for key in ("parameters", "gradients", "optimizer_state"):
            assert got[key] == want[key], (
                f"{key} for {_describe(config)}: estimated {got[key]} bytes, torch holds {want[key]} "
                f"({want[key] / want['numel']:g} bytes per parameter for {want['numel']} parameters)"
                + (". Mixed precision keeps a float32 master copy in the optimizer's state"
                   if precision == "mixed" and key == "optimizer_state" else ""))
        twin = dict(config, checkpointing=True)  # the same static terms
        assert all(_estimate(submission, twin)[key] == want[key] for key in ("parameters", "gradients",
                                                                               "optimizer_state")), (
            f"the static terms for {_describe(twin)} differ from those without checkpointing")


@pytest.mark.points(2)
def check_zero_16_bytes_per_parameter(submission):
    """mixed-precision Adam takes 2 + 2 + 12 = 16 bytes per parameter (ZeRO): at least 24 GB for GPT-2 1.5B"""
    answers = submission.harness_once("answers", "student_answers", ASKED)["per_parameter"]
    split = _unwrap(answers["mixed/adam"], "state_bytes_per_parameter('mixed', 'adam')")
    want = {"parameters": 2, "gradients": 2, "optimizer_state": 12}
    assert split == want, f"state_bytes_per_parameter('mixed', 'adam') = {split}, ZeRO's split is {want}"
    psi = _measured(submission)[-1]["numel"]  # GPT-2 XL, built on the meta device
    got = _estimate(submission, GPT2_XL)
    states = got["parameters"] + got["gradients"] + got["optimizer_state"]
    assert states == 16 * psi, (f"GPT-2 XL ({psi / 1e9:.2f}B parameters), mixed precision with Adam: parameters + "
                                f"gradients + optimizer state = {states / 1e9:.2f} GB, expected 16 bytes per "
                                f"parameter = {16 * psi / 1e9:.2f} GB")
    assert states >= 24e9, f"ZeRO says the 1.5B GPT-2 needs at least 24 GB of model states, got {states / 1e9:.2f} GB"


# --- activations -----------------------------------------------------------------------

@pytest.mark.points(2)
def check_published_activations_per_layer(submission):
    """activation_bytes_per_layer reproduces sbh(34 + 5as/h) (Korthikanti et al. 2022) in mixed precision"""
    for (s, b, h, a), config in zip(PUBLISHED_LAYERS, PUBLISHED[::2]):
        want = s * b * h * 34 + 5 * a * s * s * b  # sbh(34 + 5as/h), exact in integers
        got = _answer(submission, config, "activation_bytes_per_layer")
        assert got == want, (f"activation_bytes_per_layer for s={s}, b={b}, h={h}, a={a} in mixed precision: got "
                             f"{got}, the paper gives sbh(34 + 5as/h) = {want} ({want / 2**20:.1f} MiB)"
                             + _attention_hint(got, want, s, b, h, a))


def _attention_hint(got, want, s, b, h, a):
    if isinstance(got, int) and got == s * b * h * 34:
        return ". The attention scores, softmax output and dropout mask (5as²b bytes) are missing"
    return ""


@pytest.mark.points(1)
def check_published_full_recomputation(submission):
    """with checkpointing, each layer keeps only its input: 2sbh bytes per layer (Korthikanti et al., full recomputation)"""
    for (s, b, h, a), (plain, checkpointed) in zip(PUBLISHED_LAYERS, zip(PUBLISHED[::2], PUBLISHED[1::2])):
        full = _estimate(submission, plain)["activations"]
        kept = _estimate(submission, checkpointed)["activations"]
        want = s * b * h * 34 + 5 * a * s * s * b - 2 * s * b * h
        assert full - kept == want, (
            f"s={s}, b={b}, h={h}, a={a}, one layer: activations without checkpointing minus with should be "
            f"sbh(34 + 5as/h) - 2sbh = {want} bytes, got {full} - {kept} = {full - kept}")


def _expect_traced(submission, checkpointing):
    configs = [c for c in TRACED if c["checkpointing"] == checkpointing]
    _estimate(submission, configs[0])  # a stub fails here, before the traced runs
    ratios = []
    for config in configs:
        want = _traced(submission, config)
        got = _estimate(submission, config)["activations"]
        ratios.append((config, got, want, got / want))
    bad = [r for r in ratios if abs(r[3] - 1) > ACTIVATION_TOLERANCE]
    if bad:
        config, got, want, ratio = bad[0]
        by_seq = ", ".join(f"s={c['seq']} {c['precision']}: {r:.2f}x" for c, _, _, r in ratios)
        raise AssertionError(
            f"activations for {_describe(config)}: estimated {got} bytes, a traced forward pass saves {want} "
            f"for backward ({ratio:.2f}x; within ±{ACTIVATION_TOLERANCE:.0%} expected). Estimate / traced for every "
            f"shape: {by_seq}" + _activation_hint(config, ratio))


def _activation_hint(config, ratio):
    if config["checkpointing"] and ratio > 1.5:
        return ". With checkpointing only each block's input is kept until backward"
    if ratio < 1:
        return (". Too little: if the gap grows with s, the as²b attention terms are missing; else look outside "
                "the blocks (the final LayerNorm's and the LM head's inputs, float32 log-probabilities)")
    return ""


@pytest.mark.points(3)
def check_activations_match_traced_run(submission):
    """activations within 10% of what autograd saves in a traced forward pass (fp32 and bf16, four shapes)"""
    _expect_traced(submission, checkpointing=False)


@pytest.mark.points(2)
def check_checkpointed_activations_match_traced_run(submission):
    """with activation checkpointing, activations within 10% of a traced forward pass"""
    _expect_traced(submission, checkpointing=True)


@pytest.mark.points(1)
def check_peak_adds_up(submission):
    """peak = parameters + gradients + optimizer state + activations (+ one recomputed layer with checkpointing)"""
    for config in CONFIGS:
        got = _estimate(submission, config)
        total = got["parameters"] + got["gradients"] + got["optimizer_state"] + got["activations"]
        extra = _answer(submission, config, "activation_bytes_per_layer") if config["checkpointing"] else 0
        assert got["peak"] == total + extra, (
            f"peak for {_describe(config)}: got {got['peak']}, expected {total} (the four terms)"
            + (f" + {extra} (one block recomputed during backward)" if extra else ""))


# --- profile_step ------------------------------------------------------------------------

PROFILE = dict(layers=3, hidden=32, heads=4, seq=32, batch=2, vocab=64, dropout=0.0, precision="fp32",
               optimizer="adam")
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")


def _profile(submission, checkpointing):
    runs = submission.harness_once("profile", "profile_runs", PROFILE)
    run = runs["checkpointed" if checkpointing else "plain"]
    result = run["result"]
    assert isinstance(result, dict) and {"wall_s", "loss", "ops"} <= set(result), (
        f"profile_step should return a dict with keys wall_s, loss and ops, got {result!r:.200}")
    ops = result["ops"]
    assert isinstance(ops, list) and all(isinstance(op, dict) and {"name", "calls", "self_cpu_s"} <= set(op)
                                         for op in ops), (
        "profile_step's ops should be a list of dicts with keys name, calls and self_cpu_s")
    return run, result, ops


@pytest.mark.points(2)
def check_profile_step_trains(submission):
    """profile_step runs one whole training step: the loss and the parameters match the same step in torch"""
    run, result, _ = _profile(submission, checkpointing=False)
    assert abs(result["loss"] - run["loss"]) <= 1e-5 * abs(run["loss"]), (
        f"profile_step's loss is {result['loss']}, the same model and batch give {run['loss']}")
    assert run["max_param_difference"] <= 1e-5, (
        f"after profile_step the parameters differ from one zero_grad/forward/backward/step in torch by up to "
        f"{run['max_param_difference']:.3g}: did the step call backward() and optimizer.step() once each?")


@pytest.mark.points(2)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def check_profile_step_counts_matmuls(submission, checkpointing):
    """the profiled matrix multiplies (aten::mm, addmm, bmm) are the ones the model must run"""
    _, _, ops = _profile(submission, checkpointing)
    calls = {name: sum(op["calls"] for op in ops if op["name"] == name) for name in MATMULS}
    layers = PROFILE["layers"]
    # per block 4 linears + 2 attention matmuls; + the LM head. Forward 1, backward 2 each; checkpointing redoes forward
    want = 3 * (6 * layers + 1) + (6 * layers if checkpointing else 0)
    assert sum(calls.values()) == want, (
        f"profile_step counted {sum(calls.values())} matrix multiplies {calls}; one training step of a "
        f"{layers}-block TinyGPT{' with checkpointing' if checkpointing else ''} runs {want}. Give one entry per "
        "operator name with the profiler's call count (prof.key_averages())")


@pytest.mark.points(1)
def check_profile_step_times(submission):
    """times are in seconds, self times are positive and add up to at most the step's wall time"""
    with_the_work("the profile's times", lambda: check_profile_step_trains(submission))
    run, result, ops = _profile(submission, checkpointing=False)
    wall = result["wall_s"]
    assert 0 < wall <= run["outer_s"], (
        f"wall_s = {wall}, but the call to profile_step took {run['outer_s']:.4f} s in all: seconds, measured "
        "around the step?")
    self_times = [op["self_cpu_s"] for op in ops]
    assert all(t >= 0 for t in self_times) and sum(self_times) > 0, "self_cpu_s should be positive seconds"
    assert sum(self_times) <= 1.05 * wall + 1e-3, (
        f"the self CPU times add up to {sum(self_times):.4f} s, more than the step's wall time {wall:.4f} s: "
        "self time excludes the ops an op calls (self_cpu_time_total, in microseconds)")
    assert self_times == sorted(self_times, reverse=True), "ops should be sorted by self CPU time, largest first"


# --- GPU tier --------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.points(3)
def check_peak_matches_cuda_max_memory_allocated(submission, metrics):
    """the estimated peak within 20% of torch.cuda.max_memory_allocated of a real step (fp32 and bf16, with and without checkpointing)"""
    measured = submission.harness_once("cuda_peaks", "cuda_peaks", GPU_CONFIGS)
    for config, found in zip(GPU_CONFIGS, measured):
        got = _estimate(submission, config)
        ratio = got["peak"] / found["peak"]
        metrics[f"{config['precision']}_ckpt{int(config['checkpointing'])}_estimate_over_measured"] = ratio
        for key in ("parameters", "gradients", "optimizer_state"):
            assert got[key] == found[key], (
                f"{key} for {_describe(config)}: estimated {got[key]}, the GPU holds {found[key]}")
        assert abs(ratio - 1) <= GPU_PEAK_TOLERANCE, (
            f"peak for {_describe(config)}: estimated {got['peak'] / 2**20:.1f} MiB, "
            f"torch.cuda.max_memory_allocated saw {found['peak'] / 2**20:.1f} MiB ({ratio:.2f}x)")
