"""Module 07's pieces: the models of ``course.models`` and the grader's tracer of saved tensors."""
import copy

import pytest
import torch

from conftest import load_check_file
from course.models import GPTBlock, GPTConfig, TinyGPT, TinyMLP

harness = load_check_file("07-training-memory", "harness")


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
    y, nbytes = harness.saved_tensors_bytes(torch.nn.Module(), lambda: x * x)  # MulBackward saves x twice
    assert nbytes == x.nbytes == 4000
    y.sum().backward()


def test_tracer_counts_views_by_their_storage_and_skips_parameters():
    layer = torch.nn.Linear(50, 10)
    x = torch.randn(4, 100, requires_grad=True)
    halves = x.view(8, 50)  # a view of x's storage, which the linear saves
    out, nbytes = harness.saved_tensors_bytes(layer, lambda: layer(halves))
    assert nbytes == x.nbytes  # the weight it also saves is the model's, not an activation
    out.sum().backward()


def test_one_block_saves_what_course_models_documents():
    s, b, h, a = 16, 3, 24, 4
    block = GPTBlock(GPTConfig(seq=s, hidden=h, heads=a, dropout=0.1)).train()
    x = torch.randn(b, s, h, requires_grad=True)
    y, nbytes = harness.saved_tensors_bytes(block, lambda: block(x))
    activations = 16 * s * b * h + 2 * a * s * s * b   # float32 elements
    masks = 2 * s * b * h + a * s * s * b              # bool
    layer_norm_statistics = 2 * 2 * s * b              # mean and 1/std of two LayerNorms, float32
    assert nbytes == 4 * activations + masks + 4 * layer_norm_statistics
    y.sum().backward()


def test_checkpointed_block_keeps_only_its_input():
    config = GPTConfig(seq=16, hidden=24, heads=4, layers=3, dropout=0.1)
    model = TinyGPT(config, checkpointing=True).train()
    tokens = torch.randint(0, config.vocab, (2, 16))
    _, plain_bytes = harness.saved_tensors_bytes(model, lambda: model.blocks[0](model.tok(tokens)))
    block_input = 2 * 16 * 24 * 4
    for block in model.blocks:
        x = torch.randn(2, 16, 24, requires_grad=True)
        out, nbytes = harness.saved_tensors_bytes(
            model, lambda: torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False))
        assert nbytes == block_input < plain_bytes
        out.sum().backward()
