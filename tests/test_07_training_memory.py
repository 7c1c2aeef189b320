"""Module 07's pieces: the models of ``course.models``, the grader's oracles (the tracer of
saved tensors, the structure fitted on small traced runs) and the configurations it draws."""
import copy
import importlib.util

import pytest
import torch

from conftest import REPO, load_check_file
from course.models import GPTBlock, GPTConfig, TinyGPT, TinyMLP

checks = load_check_file("07-training-memory", "check_training_memory")
cases, oracles = checks.cases, checks.oracles


@pytest.mark.parametrize("config", [GPTConfig(), GPTConfig(vocab=50, seq=16, hidden=48, heads=6, layers=3),
                                    GPTConfig(vocab=7, seq=5, hidden=8, heads=1, layers=1)])
def test_tiny_gpt_parameter_count(config):
    V, s, h, L = config.vocab, config.seq, config.hidden, config.layers
    want = V * h + s * h + L * (12 * h * h + 13 * h) + 2 * h  # the LM head shares the embedding's weight
    assert sum(p.numel() for p in TinyGPT(config).parameters()) == want


def test_checkpointing_gives_the_same_loss_and_gradients():
    config = GPTConfig(dropout=0.1)  # the checkpoint must replay the same dropout masks
    torch.manual_seed(0)
    plain = TinyGPT(config)
    checkpointed = copy.deepcopy(plain)
    checkpointed.checkpointing = True
    tokens = torch.randint(0, config.vocab, (2, config.seq))
    targets = torch.randint(0, config.vocab, (2, config.seq))
    losses = []
    for model in (plain, checkpointed):
        torch.manual_seed(1)
        loss = model(tokens, targets)
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_logits_shape_and_causality():
    config = GPTConfig(dropout=0.0)
    model = TinyGPT(config).eval()
    tokens = torch.randint(0, config.vocab, (2, 10))
    logits = model(tokens)
    assert logits.shape == (2, 10, config.vocab)
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % config.vocab
    torch.testing.assert_close(model(changed)[:, :7], logits[:, :7])  # the future does not leak back


def test_tiny_mlp_layers():
    model = TinyMLP([16, 32, 8, 4])
    kinds = [type(m).__name__ for m in model.net]
    assert kinds == ["Linear", "ReLU", "Linear", "ReLU", "Linear"]
    assert model(torch.randn(3, 16)).shape == (3, 4)


# --- the tracer ------------------------------------------------------------------

def test_tracer_counts_a_tensor_saved_twice_once():
    x = torch.randn(1000, requires_grad=True)
    y, nbytes = oracles.saved_tensors_bytes(torch.nn.Module(), lambda: x * x)  # MulBackward saves x twice
    assert nbytes == x.nbytes == 4000
    y.sum().backward()


def test_tracer_counts_views_by_their_storage_and_skips_parameters():
    layer = torch.nn.Linear(50, 10)
    x = torch.randn(4, 100, requires_grad=True)
    halves = x.view(8, 50)  # a view of x's storage, which the linear saves
    out, nbytes = oracles.saved_tensors_bytes(layer, lambda: layer(halves))
    assert nbytes == x.nbytes  # the weight it also saves is the model's, not an activation
    out.sum().backward()


def test_one_block_saves_what_course_models_documents():
    s, b, h, a = 16, 3, 24, 4
    block = GPTBlock(GPTConfig(seq=s, hidden=h, heads=a, dropout=0.1)).train()
    x = torch.randn(b, s, h, requires_grad=True)
    y, nbytes = oracles.saved_tensors_bytes(block, lambda: block(x))
    activations = 16 * s * b * h + 2 * a * s * s * b   # float32 elements
    masks = 2 * s * b * h + a * s * s * b              # bool
    layer_norm_statistics = 2 * 2 * s * b              # mean and 1/std of two LayerNorms, float32
    assert nbytes == 4 * activations + masks + 4 * layer_norm_statistics
    y.sum().backward()


def test_checkpointed_block_keeps_only_its_input():
    config = GPTConfig(seq=16, hidden=24, heads=4, layers=3, dropout=0.1)
    model = TinyGPT(config, checkpointing=True).train()
    tokens = torch.randint(0, config.vocab, (2, 16))
    _, plain_bytes = oracles.saved_tensors_bytes(model, lambda: model.blocks[0](model.tok(tokens)))
    block_input = 2 * 16 * 24 * 4
    for block in model.blocks:
        x = torch.randn(2, 16, 24, requires_grad=True)
        out, nbytes = oracles.saved_tensors_bytes(
            model, lambda: torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False))
        assert nbytes == block_input < plain_bytes
        out.sum().backward()


# --- the structure, fitted on small traced runs, for models too large to run ------------

def _config(L, s, b, h, a, V, precision, dropout, checkpointing):
    return dict(layers=L, seq=s, batch=b, hidden=h, heads=a, vocab=V, dropout=dropout, precision=precision,
                optimizer="adam", checkpointing=checkpointing)


@pytest.mark.parametrize("precision, dropout, checkpointing", [("fp32", 0.1, False), ("mixed", 0.0, True)])
def test_the_fit_predicts_traced_runs_it_never_saw(precision, dropout, checkpointing):
    fit = oracles.activation_fit(precision, dropout > 0, checkpointing)
    for shape in [(3, 5, 1, 12, 1, 7), (1, 33, 2, 24, 6, 50), (2, 1, 4, 8, 4, 3)]:  # one head, one token, ...
        config = _config(*shape, precision, dropout, checkpointing)
        assert fit.bytes(config) == oracles.traced_activations(config), shape


def test_the_fitted_block_is_what_one_block_saves():
    s, b, h, a = 16, 3, 24, 4
    block = GPTBlock(GPTConfig(seq=s, hidden=h, heads=a, dropout=0.1)).train()
    x = torch.randn(b, s, h, requires_grad=True)
    y, nbytes = oracles.saved_tensors_bytes(block, lambda: block(x))
    y.sum().backward()
    fit = oracles.activation_fit("fp32", True, False)
    assert fit.per_block(_config(5, s, b, h, a, 64, "fp32", 0.1, False)) == nbytes


def test_the_fit_refuses_monomials_that_do_not_describe_the_model(monkeypatch):
    monkeypatch.setattr(oracles, "MONOMIALS", {k: f for k, f in oracles.MONOMIALS.items() if k != "L·as²b"})
    with pytest.raises(oracles.FitError, match="not a sum of"):
        oracles.ActivationFit("fp32", True, False)


# --- the configurations drawn from the grading's seed -----------------------------------

def _reference():
    path = REPO / "solutions" / "07-training-memory" / "memory_budget.py"
    spec = importlib.util.spec_from_file_location("reference_07", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configurations_come_from_the_seed():
    assert cases.small_configs(1) == cases.small_configs(1) != cases.small_configs(2)
    assert cases.scale_configs(1) == cases.scale_configs(1) != cases.scale_configs(2)
    assert cases.large_configs(1)[-7:] == cases.PUBLISHED + [cases.GPT2_XL]  # the published shapes stay


def test_every_draw_keeps_the_tolerance_meaningful():
    """Over many gradings: the reference within 6% of the traced bytes (it leaves out token ids,
    targets and LayerNorm statistics; the 10% tolerance has room), and the bugs the checks aim
    at beyond it in every grading (the as²b terms left out, checkpointed blocks counted whole);
    the large models of 1-7B parameters."""
    reference, tolerance = _reference(), checks.ACTIVATION_TOLERANCE
    for seed in range(150):
        missing_scores = []
        for config in cases.small_configs(seed) + cases.scale_configs(seed):
            if config["optimizer"] != "adam" and config in cases.small_configs(seed):
                continue
            traced = oracles.fit_for(config).bytes(config)
            estimate = reference.estimate_train_memory(config)["activations"]
            assert abs(estimate / traced - 1) < 0.06, (seed, config, estimate / traced)
            s, b, h, a, L = (config[k] for k in ("seq", "batch", "hidden", "heads", "layers"))
            size = 4 if config["precision"] == "fp32" else 2
            scores = L * (a * s * s * b) * ((2 * size + 1) if config["dropout"] else size)
            if config["checkpointing"]:
                kept = L * reference.activation_bytes_per_layer(config) - L * s * b * h * size
                assert (estimate + kept) / traced > 1 + tolerance, (seed, config)  # every block counted whole
            elif config in cases.small_configs(seed):
                missing_scores.append((estimate - scores) / traced)
        assert min(missing_scores) < 1 - tolerance, (seed, missing_scores)
        for config in cases.scale_configs(seed):
            assert 0.8e9 <= reference.count_parameters(config) <= 7.5e9, (seed, config)


# --- the CPU-time job's failures: the machine's, or the estimates' -------------------------

class _Submission:
    """Just enough of ``autograder.grading.submission.Submission`` for ``_timed``."""

    def __init__(self, job):
        self.job, self.cannot_grade = job, ""

    def once(self, key, compute):
        return compute()

    def rank_job(self, *args, **kwargs):
        return self.job


def _timed_out(marks):
    from autograder.grading.rank_jobs import RankJob

    return RankJob(kind="torch", n=1, status="timeout", cpu_s={name: [1.0] for name in marks}, duration_s=50)


def test_a_timeout_in_the_graders_own_runs_is_the_machines_fault():
    from autograder.grading.submission import SubmissionError

    submission = _Submission(_timed_out(["start", "built"]))
    with pytest.raises(SubmissionError, match="machine is too busy"):
        checks._timed(submission, 1)
    assert "too busy" in submission.cannot_grade  # the grading ends with exit 2, not a zero


def test_a_timeout_in_the_estimates_is_the_submissions():
    from autograder.grading.submission import SubmissionTimeout

    submission = _Submission(_timed_out(["start", "built", "ran"]))
    with pytest.raises(SubmissionTimeout, match="your estimates for four 1-7B models did not finish"):
        checks._timed(submission, 1)
    assert submission.cannot_grade == ""


# --- the GPU check's dry run: a stand-in for torch.cuda's memory calls ------------------

def test_the_stand_in_counts_live_tensor_bytes_and_their_peak():
    """Storages count once (a view adds nothing, nor does an op in place), from the op that returned
    them until Python frees them; the peak is the most counted after any op, reset to what is live."""
    stand_in = oracles.CudaMemoryStandIn()
    before = torch.ones(1000)  # made before the stand-in was entered: not counted
    with stand_in:
        a = torch.empty(1000)  # 4000 bytes
        assert stand_in.memory_allocated() == 4000
        view = a[10:]
        b = a + 1  # 4000 more
        b.add_(before)
        assert stand_in.memory_allocated() == stand_in.max_memory_allocated() == 8000
        del a, view
        assert stand_in.memory_allocated() == 4000 and stand_in.max_memory_allocated() == 8000
        stand_in.reset_peak_memory_stats()
        c = b.double()  # 8000 more
        del b, c
        assert (stand_in.memory_allocated(), stand_in.max_memory_allocated()) == (0, 12000)
    assert "CPU tier dry run" in stand_in.get_device_name()


class _Estimates:
    """Just enough of a Submission for the GPU check: the reference's estimates, ``peak`` changed by ``wrong``;
    the grader's measurement shared by every instance (one stand-in run)."""
    measured = {}

    def __init__(self, wrong=lambda peak: peak):
        self.reference, self.wrong = _reference(), wrong

    def _estimate(self, config):
        found = self.reference.estimate_train_memory(config)
        return {"status": "ok", "value": dict(found, peak=self.wrong(found["peak"]))}

    def harness_once(self, key, name, configs):
        assert name == "student_answers"
        return {"per_config": [{"estimate_train_memory": self._estimate(c)} for c in configs]}

    def once(self, key, compute):
        if key not in self.measured:
            self.measured[key] = compute()
        return self.measured[key]


def test_the_gpu_checks_dry_run_measures_a_cpu_step_and_fails_an_estimate_far_off():
    """The reference's estimates pass the dry run (the whole grading's is in test_gpu_dry_run.py); a peak
    that leaves out the activations, half again too large, fails it, naming the stand-in's bytes."""
    check, seed = checks.check_peak_matches_cuda_max_memory_allocated, 3
    metrics = {}
    check(_Estimates(), seed, metrics, gpu_dry_run=True)
    assert "CPU tier dry run" in metrics["device"]
    ratios = [v for k, v in metrics.items() if k.endswith("_estimate_over_measured")]
    assert len(ratios) == 4 and all(0.85 < r < 1.0 for r in ratios), metrics
    for wrong in (lambda peak: int(peak * 1.5), lambda peak: peak // 2):
        with pytest.raises(AssertionError, match=r"peak for fp32, adam, checkpointing=False .* the stand-in's "
                                                 r"live CPU tensor bytes peaked at"):
            check(_Estimates(wrong), seed, {}, gpu_dry_run=True)
