"""Checks for lab 08: data parallelism from scratch.

Every input is drawn here from the grading's secret seed and every answer is
computed here (``oracles.py``); each rank of a rank job (``harness.ddp_rank``)
receives only the model's architecture, its own initial parameters and its own
micro-batches, and sends back its parameters and what the recorder saw.

Results: single-process training of the same float64 model, from rank 0's
initial parameters, with torch's SGD (momentum), on each whole global batch —
what data parallelism must reproduce. Every parameter of every rank is compared
here after 3 steps (tolerance 1e-9: only the order of additions differs). Every
other rank starts from parameters of its own: a wrapper that does not broadcast
rank 0's trains different replicas.

Communication, counted from outside: the launcher notes the bytes that have
crossed between the ranks (the kernel's count of their TCP connections) at marks
the harness makes after each backward (once its own barrier has let everything
issued during backward finish) and after the wrapper's finish call. gloo sends a
fixed framing per message, measured in the same job before the student's code
loads, and its ring cuts a tensor into a known number of messages
(``oracles.all_reduce_wire_bytes``): so the bytes of a step say how many
all-reduces of which sizes crossed in it, and when. One all-reduce per bucket
(per parameter for ``NaiveDDP``, per trained parameter with a frozen layer and a
tied weight) and nothing else must cross in each step; every gradient's bytes
before backward has returned (the hooks start them); nothing inside
``no_sync()``. Whether the hooks wait: rank 0 runs a step ahead of the others,
which sleep before their backward; hooks that only start their all-reduces let
rank 0's backward return before any other rank has sent a byte. The recorder in
the ranks (each collective called, each ``wait()``, the end of backward) only
explains a failure; the bucket count is the lab's rule applied here, never the
student's ``bucket_indices``. Every communication check also needs the right
parameters (``with_the_work``).

A second model has a frozen first layer (broadcast, never synchronised) and a
weight tied between two layers (one Parameter under two names, synchronised
once); both wrappers train it, with one parameter per bucket. World sizes 2 and
4, each one rank job (gloo) for every case, once per grading. Both tiers grade
the same way, on gloo: this lab has no GPU part.
"""
import numpy as np
import pytest

from autograder.grading.checking import load_beside, with_the_work
from autograder.grading.rank_jobs import crossed_in_phases, per_rank_in_phase, run_cases
from autograder.grading.submission import failure_from, not_implemented_yet
from course.wire import gloo_bytes

oracles = load_beside(__file__, "oracles")

WORLDS = (2, 4)
STEPS = 3
TOLERANCE = 1e-9
BUCKET_CAPS = (2**-15, 0.002, 25.0)  # 32 bytes (the smallest parameter's size: reaching the cap closes a bucket)
FROZEN_TIED_CAP = 1e-5  # 10.5 bytes: one parameter per bucket
ACCUMULATION_CAP, ACCUMULATION_STEPS = 0.002, 3  # micro-batches per step, no_sync on all but the last
NAIVE = "naive"
BUCKETED = tuple(f"bucketed (bucket_cap_mb={cap:g})" for cap in BUCKET_CAPS)
ACCUMULATION = f"accumulation (bucket_cap_mb={ACCUMULATION_CAP:g})"
FROZEN_TIED = ("naive (frozen + tied)", f"bucketed (frozen + tied, bucket_cap_mb={FROZEN_TIED_CAP:g})")
AHEAD = f"bucketed, rank 0 ahead (bucket_cap_mb={BUCKET_CAPS[0]:g})"
# name: (wrapper, bucket cap, model, micro-batches per step, steps)
CASES = {NAIVE: ("naive", None, oracles.MLP, 1, STEPS),
         **{name: ("bucketed", cap, oracles.MLP, 1, STEPS) for name, cap in zip(BUCKETED, BUCKET_CAPS)},
         ACCUMULATION: ("bucketed", ACCUMULATION_CAP, oracles.MLP, ACCUMULATION_STEPS, STEPS),
         FROZEN_TIED[0]: ("naive", None, oracles.FROZEN_TIED, 1, STEPS),
         FROZEN_TIED[1]: ("bucketed", FROZEN_TIED_CAP, oracles.FROZEN_TIED, 1, STEPS),
         AHEAD: ("bucketed", BUCKET_CAPS[0], oracles.MLP, 1, 1)}
JOB_TIMEOUT_S = 40  # a correct job of 4 ranks takes a few seconds; a deadlock ends sooner, once the job idles
IDLE_TIMEOUT_S = 5


def _job(submission, seed, world):
    """{case name: (inputs, outcome)} for every case on ``world`` ranks, once per grading; the
    inputs hold the oracle's parameters after training ("want")."""
    def run():
        drawn = {name: oracles.draw_case(seed, name, world, spec, steps, micro)
                 for name, (_, _, spec, micro, steps) in CASES.items()}
        trained = oracles.meanwhile(lambda: {name: oracles.train_single_process(case) for name, case in drawn.items()})

        def part(name, rank):
            kind, cap = CASES[name][:2]
            return {**oracles.part(drawn[name], rank), "kind": kind, "cap": cap, "ahead": name == AHEAD,
                    "lr": oracles.LR, "momentum": oracles.MOMENTUM}

        def after_hang(name, pending):  # the same wrapper class would most likely hang as long
            return [n for n in pending if CASES[n][0] == CASES[name][0]]
        found = run_cases(submission, "torch", "ddp_rank", list(CASES), lambda name: world, part,
                          timeout=JOB_TIMEOUT_S, idle_timeout=IDLE_TIMEOUT_S, count_wire=True, after_hang=after_hang)
        want = trained()
        return {name: ({**drawn[name], "want": want[name]}, outcome) for name, outcome in found.items()}
    return submission.once(("ddp_job", world), run)


def _cases(submission, seed, names, need="final"):
    """[(world, name, inputs, outcome)] for each world size and case; raises where a case has
    not measured ``need`` on every rank (a stub, a hang, an error)."""
    found = []
    for world in WORLDS:
        for name in names:
            case, outcome = _job(submission, seed, world)[name]
            if outcome["status"] != "ok":
                raise failure_from(outcome, f"{name} on {world} processes")
            lacking = next((r for r in outcome["records"] if need not in r), None)
            if lacking is not None:
                raise failure_from(lacking, f"{name} on {world} processes")
            found.append((world, name, case, outcome))
    return found


# --- the parameters ---------------------------------------------------------------------------

def _largest_difference(got, want):
    name = max(want, key=lambda n: float(np.abs(np.asarray(got.get(n, np.nan)) - want[n]).max()))
    return name, float(np.abs(np.asarray(got.get(name, np.nan)) - want[name]).max())


@pytest.mark.points(1)
def check_replicas_start_equal(submission, seed):
    """After NaiveDDP(...) and BucketedDDP(...), every rank holds rank 0's parameters (broadcast)"""
    for world, name, case, outcome in _cases(submission, seed, (NAIVE, BUCKETED[-1]), need="initial"):
        for rank, record in enumerate(outcome["records"]):
            param, error = _largest_difference(record["initial"], case["initial"][0])
            assert error == 0, (
                f"{name} on {world} processes: right after the wrapper was built, rank {rank}'s {param} differs "
                f"from rank 0's by up to {error:.3g}. Each rank starts from weights of its own: the constructor "
                "must broadcast rank 0's parameters (broadcast_parameters)")


def _expect_single_process(submission, seed, names, hint):
    for world, name, case, outcome in _cases(submission, seed, names):
        for rank, record in enumerate(outcome["records"]):
            param, error = _largest_difference(record["final"], case["want"])
            if not error <= TOLERANCE:
                started = _largest_difference(record.get("initial", {}), case["initial"][0])[1]
                why = " The replicas did not start equal: broadcast rank 0's parameters first." if started else hint
                raise AssertionError(
                    f"{name} on {world} processes: after {len(case['batches'])} SGD step(s) rank {rank}'s {param} "
                    f"differs from single-process training on the global batch by {error:.3g} (tolerance "
                    f"{TOLERANCE:g}).{why}")


@pytest.mark.points(2)
def check_naive_matches_single_process(submission, seed):
    """NaiveDDP: parameters after 3 steps equal single-process training on the global batch (2 and 4 processes)"""
    _expect_single_process(submission, seed, (NAIVE,),
                           " Is every gradient all-reduced (summed) and then divided by the world size?")


@pytest.mark.points(3)
def check_bucketed_matches_single_process(submission, seed):
    """BucketedDDP: parameters after 3 steps equal single-process training (bucket caps 32 bytes, 0.002 MiB, 25 MiB)"""
    _expect_single_process(submission, seed, BUCKETED,
                           " Does every bucket (the last, partial one too) get all-reduced, averaged over the "
                           "world size and copied back into each param.grad before the step?")


@pytest.mark.points(2)
def check_accumulation_matches_single_process(submission, seed):
    """Gradient accumulation (3 micro-batches, no_sync on the first 2) equals single-process training"""
    _expect_single_process(submission, seed, (ACCUMULATION,),
                           " Inside no_sync() gradients must keep accumulating in param.grad; the backward "
                           "after it all-reduces the accumulated sum once.")


_FROZEN_TIED_HINT = (" Layer 0 is frozen (requires_grad=False): broadcast it at construction, but it gets no "
                     "gradient, needs no hook and is never all-reduced. 4.weight is 2.weight (one Parameter under "
                     "two names, as tied embeddings are): module.parameters() yields it once; synchronise it once.")


@pytest.mark.points(2)
def check_frozen_and_tied_parameters(submission, seed, metrics):
    """A frozen layer and a tied weight: both wrappers train as one process, one all-reduce per trained parameter"""
    _expect_single_process(submission, seed, FROZEN_TIED, _FROZEN_TIED_HINT)
    for world, name, case, outcome in _cases(submission, seed, FROZEN_TIED):
        trained = oracles.trained_parameters(case["spec"])
        _expect_step_traffic(world, name, case, outcome, [size for _, size in trained],
                             f"one all_reduce per trained parameter ({', '.join(n for n, _ in trained)})",
                             _FROZEN_TIED_HINT, metrics)


# --- communication, counted from outside ---------------------------------------------------------

def _wire(outcome, case):
    """({phase: bytes} of every micro-batch of every step, gloo's framing per message, the
    harness's barrier): the launcher's count at the harness's marks, framing and barrier
    measured in the same job before the student's code loaded. Skips where the kernel's
    counters cannot be read."""
    job = outcome["job"]
    calibration = crossed_in_phases(job, "calibration", ("all_reduce", "barrier"))
    if "unavailable" in calibration:
        pytest.skip(f"cannot count what crosses between the ranks here: {calibration['unavailable']}")
    micro = case["micro_batches"]
    phases = [f"s{t}.m{m}.{what}" for t in range(len(case["batches"])) for m in range(micro)
              for what in ("backward", "finish")[:1 + (m == micro - 1)]]
    found = crossed_in_phases(job, outcome["records"][0]["case"], phases)
    return found, oracles.framing_of(calibration["all_reduce"], case["world"]), calibration["barrier"]


def _recorded(outcome, t, m=-1):
    """What the recorder in rank 0 saw in step t, micro-batch m: feedback only."""
    events = outcome["records"][0].get("steps", [])
    events = events[t][m] if t < len(events) else []
    shown = [e for e in events if e != "sync_call"]
    return " -> ".join(shown[:14]) + (" -> ..." if len(shown) > 14 else "") if shown else "nothing"


def _expect_step_traffic(world, name, case, outcome, sizes, pattern, hint="", metrics=None):
    """Each step's bytes (its last backward and the finish call, less the harness's barrier) are
    exactly one all-reduce of each of ``sizes`` bytes; each earlier micro-batch's, nothing.
    ``metrics`` gets the largest gap between a step's bytes and that, and gloo's framing."""
    crossed, framing, barrier = _wire(outcome, case)
    want = sum(oracles.all_reduce_wire_bytes(n, world, framing) for n in sizes)
    last = case["micro_batches"] - 1
    if metrics is not None:
        metrics[f"framing_bytes_p{world}"] = framing
    for t in range(len(case["batches"])):
        for m in range(last):
            got = crossed.get(f"s{t}.m{m}.backward")
            assert got is not None and abs(got - barrier) < framing / 2, (
                f"{name} on {world} processes, step {t}: micro-batch {m} ran inside no_sync() and "
                f"{got - barrier if got is not None else 'an unknown number of'} bytes crossed between the ranks "
                f"(the kernel's count); nothing should. The recorder in rank 0 saw: {_recorded(outcome, t, m)}")
        got = [crossed.get(f"s{t}.m{last}.{what}") for what in ("backward", "finish")]
        if None in got:
            raise AssertionError(f"{name} on {world} processes, step {t}: no count of what crossed (the job ended "
                                 "before the step did)")
        step = sum(got) - barrier
        if metrics is not None:
            metrics["largest_gap_bytes"] = max(metrics.get("largest_gap_bytes", 0), abs(step - want))
        if abs(step - want) >= framing / 2:
            payload = gloo_bytes("all_reduce", sum(sizes), world)
            messages = sum(oracles.all_reduce_messages(n, world) for n in sizes)
            raise AssertionError(
                f"{name} on {world} processes, step {t}: {step:.0f} bytes crossed between the ranks (the kernel's "
                f"count): {oracles.split(step, payload, framing)}. {pattern[0].upper()}{pattern[1:]}, "
                f"{len(sizes)} of {', '.join(map(str, sizes))} bytes, sends {want:.0f}: the "
                f"{payload} bytes and {messages} messages. The recorder in rank 0 saw: {_recorded(outcome, t)}.{hint}")


def _bucket_sizes(case, cap):
    return oracles.buckets([size for _, size in oracles.trained_parameters(case["spec"])], cap)


@pytest.mark.points(1)
def check_naive_one_all_reduce_per_parameter(submission, seed, metrics):
    """NaiveDDP.sync_gradients: one all-reduce per parameter per step, nothing else"""
    with_the_work("NaiveDDP's communication", lambda: check_naive_matches_single_process(submission, seed))
    for world, name, case, outcome in _cases(submission, seed, (NAIVE,)):
        sizes = [size for _, size in oracles.trained_parameters(case["spec"])]
        _expect_step_traffic(world, name, case, outcome, sizes, "one all_reduce per parameter", metrics=metrics)


@pytest.mark.points(2)
def check_bucketed_one_all_reduce_per_bucket(submission, seed, metrics):
    """BucketedDDP: all-reduce calls per step = number of buckets from the lab's rule, nothing else"""
    with_the_work("BucketedDDP's communication", lambda: check_bucketed_matches_single_process(submission, seed))
    for world, name, case, outcome in _cases(submission, seed, BUCKETED):
        sizes = _bucket_sizes(case, CASES[name][1])
        _expect_step_traffic(world, name, case, outcome, sizes, "one all_reduce per bucket of the lab's rule",
                             metrics=metrics)


@pytest.mark.points(2)
def check_bucketed_communication_starts_during_backward(submission, seed, metrics):
    """BucketedDDP: every gradient's all-reduce has crossed between the ranks by the time backward returns"""
    with_the_work("BucketedDDP's overlap", lambda: check_bucketed_matches_single_process(submission, seed))
    for world, name, case, outcome in _cases(submission, seed, BUCKETED):
        crossed, framing, barrier = _wire(outcome, case)
        gradients = sum(size for _, size in oracles.trained_parameters(case["spec"]))
        payload = gloo_bytes("all_reduce", gradients, world)
        for t in range(len(case["batches"])):
            during, after = crossed.get(f"s{t}.m0.backward"), crossed.get(f"s{t}.m0.finish")
            if during is not None and after is not None:  # the smallest share of a step's bytes before it returned
                share = (during - barrier) / max(during - barrier + after, 1)
                metrics["share_during_backward"] = min(metrics.get("share_during_backward", 1.0), round(share, 4))
            assert during is not None and during - barrier >= payload, (
                f"{name} on {world} processes, step {t}: by the time backward returned, "
                f"{during - barrier if during is not None else 'an unknown number of'} bytes had crossed between "
                f"the ranks (the kernel's count, once every all-reduce started by then had finished), "
                f"{after} more in finish_gradient_synchronization; an all-reduce of the {gradients} bytes of "
                f"gradients alone sends {payload}. A bucket's all-reduce must start from the gradient hook, as soon "
                f"as its last gradient is in (the recorder in rank 0 saw: {_recorded(outcome, t)})")


def _bucketed_results_right(submission, seed):
    check_bucketed_matches_single_process(submission, seed)
    _expect_single_process(submission, seed, (AHEAD,), "")


@pytest.mark.points(1)
def check_bucketed_does_not_wait_during_backward(submission, seed, metrics):
    """BucketedDDP: rank 0's backward returns before the other ranks have started theirs (its hooks do not wait)"""
    with_the_work("not waiting", lambda: _bucketed_results_right(submission, seed))
    for world, name, case, outcome in _cases(submission, seed, (AHEAD,)):
        _, framing, _ = _wire(outcome, case)  # skips where nothing can be counted
        sent = per_rank_in_phase(outcome["job"], name, "s0.m0.rank0")
        if sent is not None:  # each rank's own sockets: what the others had sent
            seen, limit, whose = sum(sent[1:]), 0, "the other ranks had sent"
        else:  # ranks that share a user: rank 0 alone sends at most a few segments before the others start
            seen = crossed_in_phases(outcome["job"], name, ("s0.m0.rank0",)).get("s0.m0.rank0")
            limit = min(oracles.all_reduce_wire_bytes(n, world, framing) for n in _bucket_sizes(case, CASES[name][1]))
            whose, seen = "the ranks had sent", seen if seen is not None else float("inf")
        metrics[f"sent_before_rank0_returned_p{world}"] = sent if sent is not None else seen
        assert seen <= limit, (
            f"{name} on {world} processes: the other ranks slept {oracles.harness.AHEAD_S:g} s before their "
            f"backward, and by the time rank 0's backward returned {whose} {seen} bytes (the kernel's count): "
            f"rank 0's hooks waited for all-reduces the others had not started (the recorder in rank 0 saw: "
            f"{_recorded(outcome, 0)}). Start each bucket with async_op=True and wait in "
            "finish_gradient_synchronization, or backward stalls until every bucket has travelled")


@pytest.mark.points(1)
def check_accumulation_communicates_once_per_step(submission, seed, metrics):
    """Gradient accumulation: nothing crosses inside no_sync; one all-reduce per bucket on the last micro-batch"""
    with_the_work("accumulation's communication",
                  lambda: check_accumulation_matches_single_process(submission, seed))
    for world, name, case, outcome in _cases(submission, seed, (ACCUMULATION,)):
        sizes = _bucket_sizes(case, ACCUMULATION_CAP)
        _expect_step_traffic(world, name, case, outcome, sizes,
                             "one all_reduce per bucket of the lab's rule, once no_sync is over", metrics=metrics)


# --- compression -----------------------------------------------------------------------------------

def _compression(submission, seed, part):
    topk, feedback = submission.once("compression inputs", lambda: oracles.compression_inputs(seed))
    found = submission.harness_once("compression_case", "compression_case", topk, feedback)[part]
    if isinstance(found, dict) and "not_implemented" in found:
        raise not_implemented_yet(found["not_implemented"])
    return zip(topk, found) if part == "topk" else oracles.feedback_by_key(feedback, found)


@pytest.mark.points(1)
def check_topk_compress(submission, seed):
    """topk_compress(t, k): the k largest-magnitude entries, with their signs and flat indices"""
    for case, got in _compression(submission, seed, "topk"):
        x, k = case["x"], case["k"]
        flat = x.reshape(-1)
        values, indices = np.asarray(got["values"]).reshape(-1), np.asarray(got["indices"]).reshape(-1)
        what = f"topk_compress(tensor of shape {x.shape}, k={k})"
        assert indices.size == k and values.size == k, (
            f"{what}: returned {values.size} values and {indices.size} indices, expected {k} of each")
        want = set(np.argsort(-np.abs(flat), kind="stable")[:k].tolist())
        assert set(indices.tolist()) == want, (
            f"{what}: indices {sorted(indices.tolist())}, expected the {k} largest |x| at {sorted(want)} "
            "(indices into tensor.reshape(-1))")
        assert np.array_equal(values, flat[indices]), (
            f"{what}: values {values.tolist()} are not the entries at the returned indices "
            f"({flat[indices].tolist()}); keep their signs")


def _sent_dense(step, shape):
    dense = np.zeros(int(np.prod(shape)))
    dense[np.asarray(step["indices"]).reshape(-1)] = np.asarray(step["values"]).reshape(-1)
    return dense.reshape(shape)


@pytest.mark.points(2)
def check_error_feedback_conserves_gradient(submission, seed):
    """ErrorFeedback: after every step, sum of what was sent + the residual = sum of the gradients (per tensor)"""
    for key, steps in _compression(submission, seed, "feedback").items():
        sent, total = 0, 0
        for t, step in enumerate(steps):
            shape = step["grad"].shape
            total = total + step["grad"]
            sent = sent + _sent_dense(step, shape)
            assert step["residual"] is not None, f"ErrorFeedback.residual({key!r}) is None after compress"
            residual = np.asarray(step["residual"]).reshape(shape)
            gap = np.abs(sent + residual - total).max()
            assert gap <= 1e-12, (
                f"ErrorFeedback, tensor {key!r} (two tensors compressed in turn), after step {t}: "
                f"sum of sent values + residual differs from the sum of the gradients by {gap:.3g}. "
                "The residual is grad + previous residual minus what was sent, kept per key")


@pytest.mark.points(1)
def check_error_feedback_sends_top_k_of_corrected_gradient(submission, seed):
    """ErrorFeedback: each step sends the top-k of gradient + previous residual"""
    for key, steps in _compression(submission, seed, "feedback").items():
        residual = 0  # the oracle's own residual, step by step
        for t, step in enumerate(steps):
            corrected = (step["grad"] + residual).reshape(-1)
            top = np.argsort(-np.abs(corrected), kind="stable")[:3]
            got = np.asarray(step["indices"]).reshape(-1)
            assert set(got.tolist()) == set(top.tolist()), (
                f"ErrorFeedback, tensor {key!r} (two tensors compressed in turn), step {t}: sent entries at "
                f"{sorted(got.tolist())}; expected the 3 largest |grad + residual| at {sorted(top.tolist())}"
                + ("" if t else " (the first step has no residual yet)"))
            residual = corrected.copy()
            residual[top] = 0
            residual = residual.reshape(step["grad"].shape)
