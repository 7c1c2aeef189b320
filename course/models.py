"""Small models in plain torch that labs and lectures from module 07 on train.

``TinyGPT`` is a GPT (pre-LayerNorm blocks, learned positions, LM head tied to
the token embedding) written so that what autograd saves for backward follows
the activation accounting of Korthikanti et al. (2022), "Reducing activation
recomputation in large transformer models", §4.1. Per block, with s tokens per
sequence, b sequences, hidden size h and a heads:

==========================  =================================  ===========
op                          saves for backward                 elements
==========================  =================================  ===========
LayerNorm 1                 its input                          sbh
QKV linear                  its input (LayerNorm 1's output)   sbh
Q Kᵀ, then probs · V        Q, K and V (contiguous copies)     3sbh
softmax                     its output                         as²b
dropout on the probs        a bool mask (1 byte each)          as²b
probs · V                   the dropped-out probs              as²b
output linear               its input                          sbh
dropout                     a bool mask                        sbh
LayerNorm 2                 its input                          sbh
Linear h → 4h               its input (LayerNorm 2's output)   sbh
GELU                        its input                          4sbh
Linear 4h → h               its input (GELU's output)          4sbh
dropout                     a bool mask                        sbh
==========================  =================================  ===========

That is 16sbh + 2as²b activations and 2sbh + as²b mask bytes: with 2-byte
activations, sbh(34 + 5as/h) bytes, the paper's figure. LayerNorm also keeps
a mean and 1/std per token (2sb numbers), which the paper leaves out. Dropout uses
``torch.native_dropout``, whose mask is a bool tensor on every device (the
CPU path of ``F.dropout`` keeps a float mask instead). With ``dropout=0`` the
masks are gone and the softmax output is what probs · V saves: 16sbh + as²b.
Residual additions, the scale 1/√d and the additive causal mask (a buffer)
save nothing. Outside the blocks: the token ids (embedding), the final
LayerNorm's input, the LM head's input, and the float32 log-probabilities of
the loss (sbV), whatever the model's dtype.

Parameters: the token embedding (V × h, also the LM head's weight), the
position table (s × h), the blocks' linears (with biases) and LayerNorms (a
weight and a bias each), and the final LayerNorm.

``TinyGPT(config, checkpointing=True)`` wraps every block in
``torch.utils.checkpoint`` (non-reentrant): the forward pass keeps only each
block's input and recomputes the block during backward.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    seq: int = 32       # the longest sequence (the size of the position table)
    hidden: int = 32
    heads: int = 4
    layers: int = 2
    dropout: float = 0.1


def _dropout(x, p, training):
    """Dropout that saves a 1-byte bool mask for backward (see the module docstring)."""
    if not training or p == 0:
        return x
    return torch.native_dropout(x, p, True)[0]


class GPTBlock(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        h = config.hidden
        assert h % config.heads == 0, "hidden must be a multiple of heads"
        self.heads, self.p = config.heads, config.dropout
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        # -inf above the diagonal, added to the scores: an addition saves nothing for backward
        causal = torch.full((config.seq, config.seq), float("-inf")).triu(1)
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, x):
        b, s, h = x.shape
        a, d = self.heads, h // self.heads
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, a, d).permute(2, 0, 3, 1, 4)  # each (b, a, s, d)
        scores = (q @ k.transpose(-2, -1)) * d**-0.5 + self.causal[:s, :s].to(x.dtype)
        probs = _dropout(scores.softmax(dim=-1), self.p, self.training)
        y = (probs @ v).transpose(1, 2).reshape(b, s, h)
        x = x + _dropout(self.proj(y), self.p, self.training)
        return x + _dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.p, self.training)


class TinyGPT(nn.Module):
    def __init__(self, config: GPTConfig, checkpointing: bool = False):
        super().__init__()
        self.config, self.checkpointing = config, checkpointing
        self.tok = nn.Embedding(config.vocab, config.hidden)
        self.pos = nn.Parameter(torch.zeros(config.seq, config.hidden))
        self.blocks = nn.ModuleList(GPTBlock(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.hidden)
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2 or name == "pos":
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias") and "ln" not in name:
                nn.init.zeros_(p)

    def forward(self, tokens, targets=None):
        """Logits (b, s, V) for int64 ``tokens`` (b, s), or the mean cross-entropy against ``targets``."""
        x = self.tok(tokens) + self.pos[:tokens.shape[1]]
        for block in self.blocks:
            if self.checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = F.linear(self.ln_f(x), self.tok.weight)  # the LM head shares the embedding's weight
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())  # the loss in float32


class TinyMLP(nn.Module):
    """Linear + ReLU layers of the given widths, e.g. ``TinyMLP([16, 32, 32, 4])``; no ReLU after the last."""

    def __init__(self, sizes=(16, 32, 32, 4)):
        super().__init__()
        layers = []
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(n_in, n_out))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)
