"""The configurations lab 07's checks ask about, drawn in the grader from the grading's
secret seed (``autograder.grading.seeds``), and only these go to the sandbox.

A configuration is the plain dict of ``memory_budget``'s docstring. Every graded
shape is drawn, within ranges that keep each check's tolerance meaningful
(``tests/test_07_training_memory.py`` checks that over many seeds), except the
published shapes (GPT-3 175B's and a 22B model's layers, GPT-2 XL): reproducing
those figures is the point of the checks that ask about them.
"""
from autograder.grading import seeds

PRECISIONS = ("fp32", "mixed")
OPTIMIZERS = ("adam", "sgd", "sgd_momentum")

# Each small shape's choices (a tuple) and ranges (a range), one value drawn per grading; hidden = heads x head_dim.
SHAPES = {
    "base": dict(layers=(2, 3), heads=(4,), head_dim=(6, 8), seq=range(24, 41), batch=(2, 3), vocab=range(48, 81),
                 dropout=(0.1,)),
    "short sequences": dict(layers=(3, 4), heads=(4, 6), head_dim=(8,), seq=range(12, 21), batch=(3, 4),
                            vocab=range(40, 65), dropout=(0.1,)),
    "long sequence": dict(layers=(1,), heads=(8,), head_dim=(4,), seq=range(112, 145), batch=(1,),
                          vocab=range(32, 49), dropout=(0.1,)),
    "no dropout": dict(layers=(2,), heads=(4,), head_dim=(8,), seq=range(48, 81), batch=(2,), vocab=range(48, 81),
                       dropout=(0.0,)),
}
# Models of 1-7B parameters: (layers, hidden) pairs of that scale, sequences and vocabularies of today's models.
SCALE = dict(model=((16, 2048), (24, 2048), (24, 2560), (32, 2560), (32, 3072), (32, 4096), (40, 3072)),
             head_dim=(64, 128), seq=(1024, 2048, 4096), batch=range(1, 9), vocab=range(32000, 128257),
             dropout=(0.0, 0.1))
# Korthikanti et al.'s shapes (s, b, h, a): GPT-3 175B, a 22B model, and a small one; 2-byte activations.
PUBLISHED_LAYERS = [(2048, 1, 12288, 96), (2048, 4, 6144, 64), (32, 2, 32, 4)]
PUBLISHED = [dict(layers=1, hidden=h, heads=a, seq=s, batch=b, vocab=64, dropout=0.1, precision="mixed",
                  optimizer="adam", checkpointing=c) for s, b, h, a in PUBLISHED_LAYERS for c in (False, True)]
GPT2_XL = dict(layers=48, hidden=1600, heads=25, seq=1024, batch=1, vocab=50257, dropout=0.1,
               precision="mixed", optimizer="adam", checkpointing=False)


def pick(rng, values):
    """One of ``values`` (a tuple of choices or a range)."""
    return values[int(rng.integers(len(values)))]


def small_shapes(seed):
    """One shape of each kind in ``SHAPES``."""
    found = {}
    for name, ranges in SHAPES.items():
        rng = seeds.rng(seed, "07", "shape", name)
        heads, head_dim = pick(rng, ranges["heads"]), pick(rng, ranges["head_dim"])
        found[name] = dict(layers=pick(rng, ranges["layers"]), hidden=heads * head_dim, heads=heads,
                           seq=pick(rng, ranges["seq"]), batch=pick(rng, ranges["batch"]),
                           vocab=pick(rng, ranges["vocab"]), dropout=pick(rng, ranges["dropout"]))
    return found


def small_configs(seed):
    """Every small shape in each precision, with each optimizer, checkpointed and not."""
    return [dict(shape, precision=p, optimizer=o, checkpointing=c) for shape in small_shapes(seed).values()
            for p in PRECISIONS for o in OPTIMIZERS for c in (False, True)]


def scale_configs(seed):
    """Eight models of 1-7B parameters: two of each precision and checkpointing, every optimizer. The
    first four (``timed_configs``) have 32 or 40 layers: what a traced run of them costs stands well
    above the kernel's 10 ms ticks and the check's allowance."""
    found = []
    for k in range(8):
        rng = seeds.rng(seed, "07", "scale", k)
        layers, hidden = pick(rng, SCALE["model"][3:] if k < 4 else SCALE["model"])
        found.append(dict(layers=layers, hidden=hidden, heads=hidden // pick(rng, SCALE["head_dim"]),
                          seq=pick(rng, SCALE["seq"]), batch=pick(rng, SCALE["batch"]),
                          vocab=pick(rng, SCALE["vocab"]), dropout=pick(rng, SCALE["dropout"]),
                          precision=PRECISIONS[k % 2], optimizer=OPTIMIZERS[k % 3], checkpointing=k % 4 in (1, 2)))
    return found


def timed_configs(seed):
    """The 1-7B models whose estimates' CPU time is counted: one of each precision and checkpointing."""
    return scale_configs(seed)[:4]


def large_configs(seed):
    """The models too large to run: the 1-7B ones, then the published shapes."""
    return scale_configs(seed) + PUBLISHED + [GPT2_XL]


def describe(config):
    """``config`` in words, for a message."""
    shape = ", ".join(f"{k}={config[k]}" for k in ("layers", "hidden", "heads", "seq", "batch", "vocab", "dropout"))
    return f"{config['precision']}, {config['optimizer']}, checkpointing={config['checkpointing']} ({shape})"


def profile_config(seed):
    """The profiled TinyGPT: a few blocks, no dropout (the replay must match it bit for bit)."""
    rng = seeds.rng(seed, "07", "profile")
    heads = pick(rng, (2, 4))
    return dict(layers=pick(rng, (2, 3, 4)), hidden=8 * heads, heads=heads, seq=pick(rng, (16, 32)), batch=2,
                vocab=pick(rng, (32, 64)), dropout=0.0, precision="fp32", optimizer="adam")


def gpu_configs(seed, dry_run=False):
    """The GPU tier's model, its tensors well above the allocator's workspaces: both precisions, with and
    without checkpointing. ``dry_run`` (the CPU tier's dry run): a tiny model, a tenth of a second a step."""
    rng = seeds.rng(seed, "07", "gpu")
    if dry_run:
        shape = dict(layers=pick(rng, (2, 3)), hidden=pick(rng, (32, 48, 64)), heads=4, seq=pick(rng, (32, 48, 64)),
                     batch=2, vocab=pick(rng, (64, 96, 128)), dropout=0.1)
    else:
        shape = dict(layers=pick(rng, (3, 4, 5)), hidden=pick(rng, (384, 512, 640)), heads=8,
                     seq=pick(rng, (256, 512)), batch=pick(rng, (2, 4)), vocab=pick(rng, (1024, 2048)), dropout=0.1)
    return [dict(shape, precision=p, optimizer="adam", checkpointing=c) for p in PRECISIONS for c in (False, True)]
