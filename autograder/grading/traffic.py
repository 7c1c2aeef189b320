"""Volume checks on what crossed between ranks, as the kernel counted it.

A harness runs its job with ``course.dist.run(..., count_wire=True)`` and calls
``course.dist.mark(f"{case}:{phase}")`` on every rank after each phase (and
``f"{case}:start"`` before it); the launcher, which runs none of the student's
code, notes the bytes that had crossed by each mark (``course.wire``). A check
compares one phase's bytes with the closed form of the pattern the lab asks for
(``course.wire.gloo_bytes``), so an op log switched off from inside, or data sent
around it, changes nothing. Where the in-process op log saw much less than
crossed, the instructor gets the flag ``unlogged`` (``autograder.sandbox.audit.Flag``).

The kernel counts the payload of every message, gloo's own bytes too: up to
``HEADER_BYTES`` per message of the pattern's algorithms
(``course.wire.gloo_messages``), which the tolerance allows for, with ``SLACK``.
"""
from __future__ import annotations

HEADER_BYTES = 300  # gloo's own bytes per message of its algorithms (notifications, headers): measured 72 to 288
MPI_HEADER_BYTES = 100  # MPICH's over TCP, a synchronous send's handshake included: measured 32 to 72
SLACK = 0.05  # and 5% of the payload
UNLOGGED_RATIO = 1.5  # crossed more than this times what the op log saw (plus headers): flagged


def crossed_in_phases(jobs, case: str, phases) -> dict:
    """``{phase: bytes}`` that crossed in each phase of ``case`` in the jobs that ran it
    (``job.wire["marks"]``), or ``{"unavailable": why}``; a phase some job never
    reached is left out."""
    for job in jobs:
        wire = job.wire or {}
        if "unavailable" in wire:
            return {"unavailable": wire["unavailable"]}
        marks = dict((name, count) for name, count in wire.get("marks", []))
        if f"{case}:start" in marks:
            found, before = {}, marks[f"{case}:start"]
            for phase in phases:
                if f"{case}:{phase}" not in marks:
                    break
                found[phase] = marks[f"{case}:{phase}"] - before
                before = marks[f"{case}:{phase}"]
            return found
    return {}


def expect_crossed(submission, wire: dict, phase: str, want: int, messages: int, what: str, pattern: str,
                   logged: int | None = None, most: int | None = None, header: int = HEADER_BYTES) -> int:
    """Assert that the bytes that crossed in ``phase`` are those of ``pattern``: at least
    ``want`` and at most ``want`` (or ``most``, where the pattern may vary; and ``SLACK``)
    plus ``messages`` headers of ``header`` bytes (gloo's; ``MPI_HEADER_BYTES`` for
    MPICH). With ``logged``, the bytes the in-process op log saw, a phase in which far more crossed is flagged for the
    instructor (the log was switched off or gone around), pass or fail. Skips, with
    the reason, where the kernel's counters cannot be read."""
    import pytest  # here, not at the top: MPI ranks import harnesses that import this module

    if "unavailable" in wire:
        pytest.skip(f"cannot count what crosses between ranks here: {wire['unavailable']}")
    if phase not in wire:
        raise AssertionError(f"{what}: no count of what crossed (the job ended before the {phase} did)")
    crossed, most = wire[phase], int((want if most is None else most) * (1 + SLACK)) + messages * header
    if logged is not None and crossed > UNLOGGED_RATIO * logged + messages * header:
        submission.flags.append(("unlogged", f"{what}: {crossed} bytes crossed between the ranks, the op log "
                                             f"saw {logged}"))
    if not want <= crossed <= most:
        raise AssertionError(
            f"{what}: {crossed} bytes crossed between the ranks (the kernel's count), expected {want} for {pattern}"
            + (f" (up to {most} with message headers)" if crossed > want else "")
            + ("; fewer means part of the data travelled some other way, or never" if crossed < want else ""))
    return crossed


def expect_sent_by_rank(sent: list | None, want: list, what: str, messages: int, slack: float = 0,
                        header: int = HEADER_BYTES) -> None:
    """Assert that the bytes each rank sent in a phase (the kernel's count of that rank's own
    sockets: ``autograder.grading.rank_jobs.per_rank_in_phase``), in some order, are the
    pattern's ``want`` (bytes per rank, in any order): each at least its share less
    ``slack``, at most its share plus ``SLACK`` and message headers (``messages`` in all
    the phase, at most). Where ranks share the grader's user (no per-rank count: ``sent``
    is None) nothing is asserted here: the total (``expect_crossed``) still is."""
    if sent is None:
        return
    got, need = sorted(sent), sorted(want)
    for rank_got, rank_want in zip(got, need):
        most = rank_want * (1 + SLACK) + slack + messages * header
        if not rank_want - slack <= rank_got <= most:
            shown = ", ".join(str(b) for b in sent)
            expected = ", ".join(f"{w:g}" for w in need)
            raise AssertionError(
                f"{what}: the ranks sent {shown} bytes each (the kernel's count of each rank's own sockets), "
                f"expected {expected} in some order: the pattern's share of each rank")
