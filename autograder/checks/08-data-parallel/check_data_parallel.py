"""Checks for lab 08: data parallelism from scratch.

Oracle for training: single-process training of the same float64 model, from
rank 0's initial weights, with torch's own SGD (momentum), on the whole global
batch (every rank's micro-batches concatenated) — what data parallelism must
reproduce. Every parameter on every rank is compared after 3 steps; float64
leaves only the order of additions as a difference (~1e-16), so the tolerance
is tight. Each rank builds its model from a seed of its own: a wrapper that
forgets to broadcast rank 0's weights trains different replicas.

Communication: the harness records every ``torch.distributed`` collective
each rank calls during a step, in order, with the end of backward marked by a
callback the autograd engine runs after its last node, and each handle's
``wait()``. The number of buckets is computed here from the parameter sizes
with the rule the lab states — not by the student's ``bucket_indices``. Any
other collective (``all_reduce_coalesced``, ``reduce_scatter``, ``all_gather``
…) is recorded under its own name and fails the count checks, which expect
exactly one ``all_reduce`` per bucket (per parameter for ``NaiveDDP``) and
nothing else; the message lists what was called.

A second model has a frozen first layer (broadcast, never synchronised) and a
weight tied between two layers (one Parameter under two names, synchronised
once); both wrappers train it, with one parameter per bucket.

World sizes 2 and 4, each one job of torch processes (gloo) for every case,
cached for the whole grading run. Both tiers grade the same way, on gloo:
this lab has no GPU part.
"""
import numpy as np
import pytest

from autograder.grading.checking import with_the_work
from autograder.grading.submission import failure_from, not_implemented_yet
from autograder.grading.traffic import expect_crossed
from course.wire import gloo_bytes, gloo_messages

WORLDS = (2, 4)
STEPS = 3
TOLERANCE = 1e-9
BUCKET_CAPS = (2**-15, 0.002, 25.0)  # 32 bytes (the smallest parameter's size: reaching the cap closes a bucket)
FROZEN_TIED_CAP = 1e-5
ACCUMULATION_CAP = 0.002
NAIVE = "naive"
BUCKETED = tuple(f"bucketed (bucket_cap_mb={cap:g})" for cap in BUCKET_CAPS)
ACCUMULATION = f"accumulation (bucket_cap_mb={ACCUMULATION_CAP:g})"
# A model with a frozen first layer and a weight tied between two layers; one parameter per bucket.
FROZEN_TIED = ("naive (frozen + tied)", f"bucketed (frozen + tied, bucket_cap_mb={FROZEN_TIED_CAP:g})")
CAP_OF = dict(zip(BUCKETED, BUCKET_CAPS), **{ACCUMULATION: ACCUMULATION_CAP, FROZEN_TIED[1]: FROZEN_TIED_CAP})


def _job(submission, world):
    """Every case's outcome on ``world`` processes, computed once per grading run."""
    return submission.harness_once(("ddp_job", world), "ddp_job", world)


def _cases(submission, names, need="steps"):
    """[(world, name, outcome)] for each world size and case; raises when a case
    has not measured ``need`` (a stub, a hang, an error)."""
    found = []
    for world in WORLDS:
        for name in names:
            outcome = _job(submission, world)[name]
            if not all(need in r for r in outcome.get("ranks", [{}])):
                raise failure_from(outcome, f"{name} on {world} processes")
            found.append((world, name, outcome))
    return found


def expected_buckets(param_bytes, cap_mb):
    """The lab's rule (torch's DDP's too): in reverse registration order, a
    bucket closes as soon as it holds at least the cap; the rest, if any, is
    one last partial bucket. So: the number of times the running total
    reaches the cap, plus one if something is left over."""
    cap, count, filled = cap_mb * 2**20, 0, 0
    for size in reversed(param_bytes):
        filled += size
        if filled >= cap:
            count, filled = count + 1, 0
    return count + (filled > 0)


def _collectives(events):
    return [e for e in events if ":" in e]


def _all_reduces(events):
    return [e for e in events if e.startswith("all_reduce:")]


# --- equal replicas ---------------------------------------------------------------------------

@pytest.mark.points(1)
def check_replicas_start_equal(submission):
    """After NaiveDDP(...) and BucketedDDP(...), every rank holds rank 0's parameters (broadcast)"""
    for world, name, outcome in _cases(submission, (NAIVE, BUCKETED[-1]), need="initial_errors"):
        for rank, record in enumerate(outcome["ranks"]):
            param, error = max(record["initial_errors"].items(), key=lambda kv: kv[1])
            assert error == 0, (
                f"{name} on {world} processes: right after the wrapper was built, rank {rank}'s {param} differs "
                f"from rank 0's initial value by up to {error:.3g}. Each rank starts from its own random "
                "weights: the constructor must broadcast rank 0's parameters (broadcast_parameters)")


def _expect_single_process(submission, names, hint):
    for world, name, outcome in _cases(submission, names, need="final_errors"):
        for rank, record in enumerate(outcome["ranks"]):
            param, error = max(record["final_errors"].items(), key=lambda kv: kv[1])
            if error > TOLERANCE:
                started = max(record.get("initial_errors", {0: 0}).values())
                why = (" The replicas did not start equal: broadcast rank 0's parameters first." if started
                       else hint)
                raise AssertionError(
                    f"{name} on {world} processes: after {STEPS} SGD steps rank {rank}'s {param} differs from "
                    f"single-process training on the global batch by {error:.3g} (tolerance {TOLERANCE:g}).{why}")


@pytest.mark.points(2)
def check_naive_matches_single_process(submission):
    """NaiveDDP: parameters after 3 steps equal single-process training on the global batch (2 and 4 processes)"""
    _expect_single_process(submission, (NAIVE,),
                           " Is every gradient all-reduced (summed) and then divided by the world size?")


@pytest.mark.points(3)
def check_bucketed_matches_single_process(submission):
    """BucketedDDP: parameters after 3 steps equal single-process training (bucket caps 32 bytes, 0.002 MiB, 25 MiB)"""
    _expect_single_process(submission, BUCKETED,
                           " Does every bucket (the last, partial one too) get all-reduced, averaged over the "
                           "world size and copied back into each param.grad before the step?")


@pytest.mark.points(2)
def check_accumulation_matches_single_process(submission):
    """Gradient accumulation (3 micro-batches, no_sync on the first 2) equals single-process training"""
    _expect_single_process(submission, (ACCUMULATION,),
                           " Inside no_sync() gradients must keep accumulating in param.grad; the backward "
                           "after it all-reduces the accumulated sum once.")


@pytest.mark.points(2)
def check_frozen_and_tied_parameters(submission):
    """A frozen layer and a tied weight: both wrappers train as one process, one all-reduce per trained parameter"""
    _expect_single_process(submission, FROZEN_TIED, _FROZEN_TIED_HINT)
    for world, name, outcome in _cases(submission, FROZEN_TIED):
        trained = outcome["param_names"]
        want = len(trained) if name.startswith("naive") else expected_buckets(outcome["param_bytes"], CAP_OF[name])
        for rank, record in enumerate(outcome["ranks"]):
            for step, (events,) in enumerate(record["steps"]):
                calls = _collectives(events)
                assert len(_all_reduces(events)) == want and len(calls) == want, (
                    f"{name} on {world} processes, rank {rank}, step {step}: expected {want} all_reduce calls, "
                    f"one per trained parameter ({', '.join(trained)}); recorded {_summary(calls)}."
                    + _FROZEN_TIED_HINT)


_FROZEN_TIED_HINT = (" Layer 0 is frozen (requires_grad=False): broadcast it at construction, but it gets no "
                     "gradient, needs no hook and is never all-reduced. 4.weight is 2.weight (one Parameter under "
                     "two names, as tied embeddings are): module.parameters() yields it once; synchronise it once.")


# --- communication: what was called, and when --------------------------------------------------

@pytest.mark.points(1)
def check_naive_one_all_reduce_per_parameter(submission):
    """NaiveDDP.sync_gradients: one all-reduce per parameter per step, nothing else"""
    with_the_work("NaiveDDP's communication", lambda: _expect_single_process(submission, (NAIVE,), ""))
    for world, name, outcome in _cases(submission, (NAIVE,)):
        n_params = len(outcome["param_bytes"])
        for rank, record in enumerate(outcome["ranks"]):
            for step, (events,) in enumerate(record["steps"]):
                calls = _collectives(events)
                assert len(_all_reduces(events)) == n_params and len(calls) == n_params, (
                    f"{name} on {world} processes, rank {rank}, step {step}: expected {n_params} all_reduce calls "
                    f"(one per parameter), recorded {_summary(calls)}")
        _expect_gradient_traffic(submission, world, name, outcome, n_params)


@pytest.mark.points(2)
def check_bucketed_one_all_reduce_per_bucket(submission):
    """BucketedDDP: all-reduce calls per step = number of buckets from the lab's rule, nothing else"""
    with_the_work("BucketedDDP's communication", lambda: _expect_single_process(submission, BUCKETED, ""))
    for world, name, outcome in _cases(submission, BUCKETED):
        want = expected_buckets(outcome["param_bytes"], CAP_OF[name])
        for rank, record in enumerate(outcome["ranks"]):
            for step, (events,) in enumerate(record["steps"]):
                calls = _collectives(events)
                assert len(_all_reduces(events)) == want and len(calls) == want, (
                    f"{name} on {world} processes, rank {rank}, step {step}: parameters of "
                    f"{outcome['param_bytes']} bytes make {want} bucket(s) under the lab's rule, so {want} "
                    f"all_reduce call(s); recorded {_summary(calls)}")
        _expect_gradient_traffic(submission, world, name, outcome, want)


@pytest.mark.points(2)
def check_bucketed_communication_starts_during_backward(submission):
    """BucketedDDP: the first all-reduce of each step is issued before backward has finished"""
    with_the_work("BucketedDDP's overlap", lambda: _expect_single_process(submission, BUCKETED, ""))
    for world, name, outcome in _cases(submission, BUCKETED):
        for rank, record in enumerate(outcome["ranks"]):
            for step, (events,) in enumerate(record["steps"]):
                reduces = [i for i, e in enumerate(events) if e.startswith("all_reduce:")]
                end = events.index("backward_end")
                assert reduces and reduces[0] < end, (
                    f"{name} on {world} processes, rank {rank}, step {step}: "
                    + ("no all_reduce at all" if not reduces else "the first all_reduce came after backward had "
                       "finished") + f" (recorded in order: {_timeline(events)}). A bucket's all-reduce must "
                    "start from the gradient hook, as soon as its last gradient is in")


@pytest.mark.points(1)
def check_bucketed_does_not_wait_during_backward(submission):
    """BucketedDDP: no all-reduce is waited on (or run synchronously) before backward has finished"""
    with_the_work("BucketedDDP's overlap", lambda: _expect_single_process(submission, BUCKETED, ""))
    for world, name, outcome in _cases(submission, BUCKETED):
        for rank, record in enumerate(outcome["ranks"]):
            for step, (events,) in enumerate(record["steps"]):
                during = events[:events.index("backward_end")]
                blocking = [e for e in during if e == "wait" or e.endswith(":sync")]
                assert not blocking, (
                    f"{name} on {world} processes, rank {rank}, step {step}: during backward the hooks "
                    f"blocked on communication ({_summary(blocking)}; recorded in order: {_timeline(events)}). "
                    "Start each bucket with async_op=True and wait in finish_gradient_synchronization, or "
                    "backward stalls until every bucket has travelled")


@pytest.mark.points(1)
def check_accumulation_communicates_once_per_step(submission):
    """Gradient accumulation: no collective inside no_sync; one all-reduce per bucket on the last micro-batch"""
    with_the_work("accumulation's communication",
                  lambda: _expect_single_process(submission, (ACCUMULATION,), ""))
    for world, name, outcome in _cases(submission, (ACCUMULATION,)):
        want = expected_buckets(outcome["param_bytes"], CAP_OF[name])
        for rank, record in enumerate(outcome["ranks"]):
            for step, micro in enumerate(record["steps"]):
                for m, events in enumerate(micro[:-1]):
                    assert not _collectives(events), (
                        f"{name} on {world} processes, rank {rank}, step {step}: micro-batch {m} ran inside "
                        f"no_sync() and still communicated: {_summary(_collectives(events))}")
                last = _collectives(micro[-1])
                assert len(_all_reduces(micro[-1])) == want and len(last) == want, (
                    f"{name} on {world} processes, rank {rank}, step {step}: the last micro-batch should "
                    f"all-reduce the accumulated gradients once per bucket ({want}); recorded {_summary(last)}")
        _expect_gradient_traffic(submission, world, name, outcome, want)


def _expect_gradient_traffic(submission, world, name, outcome, collectives_per_step):
    """What crossed in the steps (the kernel's count) is one ring all-reduce of every
    trained gradient per step: 2(P-1)/P of their bytes sent by each rank."""
    gradients = sum(outcome["param_bytes"])
    want = STEPS * gloo_bytes("all_reduce", gradients, world)
    # The recorder counts calls, not bytes: the share of the expected all-reduces it saw stands for its bytes.
    seen = sum(len(_all_reduces(events)) for record in outcome["ranks"] for micro in record["steps"]
               for events in micro)
    messages = STEPS * collectives_per_step * gloo_messages("all_reduce", world)
    expect_crossed(submission, outcome["wire"], "steps", want, messages,
                   f"{name} on {world} processes, {STEPS} steps",
                   f"an all-reduce of the {gradients} bytes of gradients per step",
                   logged=want * min(1.0, seen / (STEPS * collectives_per_step * world)))


def _summary(calls):
    if not calls:
        return "none"
    counts = {}
    for c in calls:
        counts[c] = counts.get(c, 0) + 1
    return ", ".join(f"{n} x {c}" for c, n in counts.items())


def _timeline(events, limit=12):
    shown = [e for e in events if e != "sync_call"]
    return " -> ".join(shown[:limit]) + (" -> ..." if len(shown) > limit else "")


# --- compression -----------------------------------------------------------------------------------

def _compression(submission, part):
    found = submission.harness_once("compression_case", "compression_case")[part]
    if isinstance(found, dict) and "not_implemented" in found:
        raise not_implemented_yet(found["not_implemented"])
    return found


@pytest.mark.points(1)
def check_topk_compress(submission):
    """topk_compress(t, k): the k largest-magnitude entries, with their signs and flat indices"""
    for case in _compression(submission, "topk"):
        x, k = case["x"], case["k"]
        flat = x.reshape(-1)
        values, indices = np.asarray(case["values"]).reshape(-1), np.asarray(case["indices"]).reshape(-1)
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
def check_error_feedback_conserves_gradient(submission):
    """ErrorFeedback: after every step, sum of what was sent + the residual = sum of the gradients (per tensor)"""
    for key, steps in _compression(submission, "feedback").items():
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
def check_error_feedback_sends_top_k_of_corrected_gradient(submission):
    """ErrorFeedback: each step sends the top-k of gradient + previous residual"""
    for key, steps in _compression(submission, "feedback").items():
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
