"""Lab 08's answers, in the grader: every rank's inputs, single-process training, the
buckets the lab's rule makes, and the bytes gloo sends for them. Nothing here reaches
the sandbox.

Inputs (``draw_case``): from the grading's secret seed, per case and world size, the
model's initial parameters (rank 0's: the model's), a different set for every other
rank (a wrapper that does not broadcast trains different replicas), and each step's
global batch. Rank r receives its own initial parameters and its own micro-batches,
nothing else (``part``).

Oracle (``train_single_process``): the same float64 model from rank 0's parameters,
torch's own SGD with momentum, one process, the whole global batch per step — what
data parallelism must reproduce.

Wire (``all_reduce_wire_bytes``): what gloo's ring all-reduce of a tensor sends, all
ranks together. Its payload is ``course.wire.gloo_bytes``; its framing is a fixed
number of bytes per message (``framing``, measured in the same job before the
student's code loads: ``harness.calibrate``), and its messages follow from how gloo
cuts the tensor: 2P segments (rounded to whole elements), each non-empty one sent
P - 1 times to reduce and P - 1 times to gather. Sizes here stay far below gloo's
largest segment, so the count of messages is 2(P - 1) per non-empty segment. So the
bytes of a phase say how many all-reduces of which sizes crossed in it: one flat
all-reduce of every gradient sends the same payload as one per bucket, with a
fraction of the messages.
"""
from __future__ import annotations

import threading

import numpy as np

from autograder.grading import seeds
from autograder.grading.checking import load_beside
from course.wire import gloo_bytes

harness = load_beside(__file__, "harness")  # the model's builder (an architecture, no answer)

MICRO_BATCH = 4  # samples per rank per backward
LR, MOMENTUM = 0.05, 0.9
# The graded MLP, and one with a frozen first layer and a weight tied between two layers (one
# Parameter under the names 2.weight and 4.weight, as tied embeddings are): Sequential indices.
MLP = {"layers": [[8, 16], [16, 16], [16, 4]], "frozen": [], "tied": []}
FROZEN_TIED = {"layers": [[8, 16], [16, 16], [16, 16], [16, 4]], "frozen": [0], "tied": [[4, 2]]}
CALIBRATION_ELEMENTS = harness.CALIBRATION_ELEMENTS


def _draw_parameters(rng, spec) -> dict:
    """{name: float64 array} of a model of ``spec``, uniform in ±1/sqrt(fan in) as torch's Linear."""
    out = {}
    for name, shape, fan_in in harness.parameter_shapes(spec):
        bound = 1 / np.sqrt(fan_in)
        out[name] = rng.uniform(-bound, bound, size=shape)
    return out


def draw_case(seed: int, name: str, world: int, spec: dict, steps: int, micro_batches: int) -> dict:
    """Every rank's initial parameters (rank 0's first) and every step's global batch,
    (x, y) of ``world * micro_batches * MICRO_BATCH`` samples, ordered rank by rank and
    micro-batch by micro-batch within a rank."""
    rng = seeds.rng(seed, "08", name, world)
    initial = [_draw_parameters(rng, spec) for _ in range(world)]
    samples = world * micro_batches * MICRO_BATCH
    inputs, outputs = spec["layers"][0][0], spec["layers"][-1][1]
    batches = [(rng.standard_normal((samples, inputs)), rng.standard_normal((samples, outputs))) for _ in range(steps)]
    return {"spec": spec, "initial": initial, "batches": batches, "micro_batches": micro_batches, "world": world}


def part(case: dict, rank: int) -> dict:
    """What rank ``rank`` receives: the architecture, its own initial parameters, and its own
    micro-batches of each step."""
    m, world = case["micro_batches"], case["world"]
    mine = []
    for x, y in case["batches"]:
        starts = [(rank * m + i) * MICRO_BATCH for i in range(m)]
        mine.append([[x[s:s + MICRO_BATCH], y[s:s + MICRO_BATCH]] for s in starts])
    return {"spec": case["spec"], "initial": case["initial"][rank], "batches": mine}


def train_single_process(case: dict) -> dict:
    """{name: float64 array}: the parameters after training the model from rank 0's initial
    parameters with torch's SGD (momentum) on each whole global batch. The functional form
    (``torch.optim.sgd.sgd``, which ``torch.optim.SGD.step`` calls): the class's constructor
    imports torch._dynamo, seconds of the grader's time on a small machine."""
    import torch
    from torch.optim.sgd import sgd

    model = harness.build_model(case["spec"], case["initial"][0])
    params = [p for p in model.parameters() if p.requires_grad]
    momenta = [None] * len(params)
    for x, y in case["batches"]:
        torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        with torch.no_grad():
            sgd(params, [p.grad for p in params], momenta, lr=LR, momentum=MOMENTUM, weight_decay=0, dampening=0,
                nesterov=False, maximize=False, foreach=False)
        for p in params:
            p.grad = None
    return {name: p.detach().numpy().copy() for name, p in model.named_parameters()}


def trained_parameters(spec: dict) -> list[tuple[str, int]]:
    """(name, bytes) of each parameter that is synchronised, in registration order: each
    once (a tied one under its first name), frozen ones not at all."""
    frozen = {f"{index}.{kind}" for index in spec["frozen"] for kind in ("weight", "bias")}
    return [(name, 8 * int(np.prod(shape))) for name, shape, _ in harness.parameter_shapes(spec) if name not in frozen]


def buckets(param_bytes: list[int], cap_mb: float) -> list[int]:
    """The bytes of each bucket under the lab's rule (torch's DDP's too): in reverse
    registration order, a bucket closes as soon as it holds at least the cap; the rest, if
    any, is one last partial bucket."""
    cap, found, filled = cap_mb * 2**20, [], 0
    for size in reversed(param_bytes):
        filled += size
        if filled >= cap:
            found, filled = found + [filled], 0
    return found + ([filled] if filled else [])


def expected_buckets(param_bytes: list[int], cap_mb: float) -> int:
    return len(buckets(param_bytes, cap_mb))


def all_reduce_messages(nbytes: int, p: int, element_size: int = 8) -> int:
    """Messages of gloo's ring all-reduce of ``nbytes``, all ranks together: the tensor is
    cut into 2P segments of whole elements; each non-empty one travels P - 1 hops to be
    reduced and P - 1 to be gathered."""
    if p == 1 or nbytes == 0:
        return 0
    segments = 2 * p
    segment = _ceil(_ceil(nbytes, segments), element_size) * element_size  # rounded up to whole elements
    return 2 * (p - 1) * min(segments, _ceil(nbytes, segment))


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def all_reduce_wire_bytes(nbytes: int, p: int, framing: float) -> float:
    """Bytes one all-reduce of ``nbytes`` sends over the wire, all ranks together."""
    return gloo_bytes("all_reduce", nbytes, p) + framing * all_reduce_messages(nbytes, p)


def framing_of(calibration_bytes: int, p: int) -> float:
    """gloo's bytes per message, from the calibration all-reduce the harness made before the
    student's code loaded (``CALIBRATION_ELEMENTS`` float64)."""
    nbytes = 8 * CALIBRATION_ELEMENTS
    return (calibration_bytes - gloo_bytes("all_reduce", nbytes, p)) / all_reduce_messages(nbytes, p)


def split(crossed: float, payload: int, framing: float) -> str:
    """What ``crossed`` bytes are, read as gradients' all-reduces: "the gradients' 7744 bytes
    (2(P-1)/P of them from each rank, however they are grouped) and 8 messages of gloo's
    144-byte framing"."""
    messages = (crossed - payload) / framing
    count = f"{messages:.0f}" if abs(messages - round(messages)) < 0.05 else f"{messages:.2f}"
    return (f"the gradients' all-reduce payload, {payload} bytes however they are grouped, and "
            f"{count} messages of gloo's framing ({framing:.0f} bytes each)")


def meanwhile(compute):
    """Start ``compute()`` on a thread of its own; the function returned waits for its value.
    The oracles (torch's import, single-process training) then run while the grader waits
    for the sandbox, which starts its own torch and the ranks."""
    done = {}

    def run():
        try:
            done["value"] = compute()
        except BaseException as exc:  # noqa: BLE001 - raised again where the value is wanted
            done["error"] = exc
    thread = threading.Thread(target=run, name="lab 08 oracles", daemon=True)
    thread.start()

    def value():
        thread.join()
        if "error" in done:
            raise done["error"]
        return done["value"]
    return value


def compression_inputs(seed: int):
    """The compression part's inputs: three top-k cases (distinct magnitudes, mixed signs), and
    four steps of two gradients compressed in turn (residuals are kept per key)."""
    rng = seeds.rng(seed, "08", "compression")
    topk = []
    for shape, k in (((6, 7), 5), ((50,), 1), ((3, 4), 12)):
        x = rng.permutation(int(np.prod(shape))).astype(np.float64) + 1  # distinct magnitudes, mixed signs
        signs = rng.choice([-1.0, 1.0], x.size)
        signs[np.argmax(x)] = -1.0  # so ranking by value, not magnitude, is caught on every draw
        topk.append({"x": (x * signs).reshape(shape), "k": k})
    # two tensors compressed in turn, 4 steps: residuals are kept per key
    feedback = [[(key, rng.standard_normal(shape), 3) for key, shape in (("w", (5, 8)), ("b", (8,)))]
                for _ in range(4)]
    return topk, feedback


def feedback_by_key(feedback, found):
    """{key: [{"grad", "values", "indices", "residual"} per step]}."""
    steps = {}
    for inputs, outputs in zip(feedback, found):
        for (key, grad, _), out in zip(inputs, outputs):
            steps.setdefault(key, []).append({"grad": grad, **out})
    return steps
