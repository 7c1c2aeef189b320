"""The grader's side of a rank job (``autograder.sandbox.ranks``): inputs out, outputs back.

A check that grades several processes draws every rank's inputs here, in the
grader (from the grading's secret seed: ``autograder.grading.seeds``), gives
each rank only its own part, and compares what the ranks return with its own
answer, here, after the job: nothing in the sandbox knows the answer.

``run_cases`` runs many cases in as few jobs as it can (starting ranks is the
slow part on a small machine): rank r's inputs are the list of its parts of
every case it takes part in, and the harness's rank function ``emit``-s one
record per case, ``{"case": key, ...}``. When a job ends early, the first case
that some rank did not finish is the one that hung or raised: it gets the job's
status, and the cases after it run again in a new job.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from autograder.sandbox import codec

_HANGS = {
    "mpi": "A blocking send or receive that no other rank matches waits forever",
    "torch": "A collective that not every rank calls (or calls in another order), or a send no one receives, "
             "waits forever",
}


@dataclass
class RankJob:
    """A finished rank job, decoded: what each rank emitted, and what the launcher measured."""
    kind: str
    n: int
    status: str  # ok, timeout, raised, not_implemented, crashed
    outputs: list = field(default_factory=list)  # per rank: the values it emitted, in order
    errors: list = field(default_factory=list)  # per rank: None, or {"status", "message", "type", "where"}
    finished: list = field(default_factory=list)
    marks: dict = field(default_factory=dict)  # name -> (bytes crossed by then, [bytes each rank had sent])
    # name -> per rank, [VmRSS at the mark, VmHWM since the last mark that started it afresh] (None: not in the mark)
    memory: dict = field(default_factory=dict)
    fresh_peaks: set = field(default_factory=set)  # the marks at which every rank's high-water mark started afresh
    cpu_s: dict = field(default_factory=dict)  # name -> [CPU seconds each rank had used by then; None: not its mark]
    mark_times: dict = field(default_factory=dict)  # name -> seconds since the job started (the launcher's clock)
    peak_bytes: list = field(default_factory=list)  # per rank: VmHWM (or the most VmRSS sampled) over the whole job
    baseline_bytes: list = field(default_factory=list)  # per rank: VmRSS once it had read its inputs
    wire: dict = field(default_factory=dict)  # {"bytes", "connections"} in all, or {"unavailable": why}
    kept_apart: str = ""  # "" where each rank had a user, /tmp and /dev/shm of its own; else what was shared
    own_users: bool = False  # each rank had a user of its own: its sockets' bytes are its own
    duration_s: float = 0.0
    timeout_s: float = 0.0
    idle_s: float = 0.0
    stopped: str = ""
    memory_tampered: list = field(default_factory=list)  # ranks whose VmHWM was below a sampled VmRSS
    flags: list = field(default_factory=list)  # (kind, detail): what the ranks' audit hooks recorded

    def explain(self) -> str:
        if self.status == "ok":
            return f"{self.n} ranks finished in {self.duration_s:.2f} s"
        if self.status == "timeout":
            waiting = [r for r in range(self.n) if r not in self.finished]
            stopped = (f"stopped after {self.duration_s:.0f} s, no rank having used the CPU for {self.idle_s:g} s"
                       if self.stopped == "idle" else f"timed out after {self.timeout_s:g} s")
            return (f"{stopped}: likely deadlock: rank(s) {waiting} never finished "
                    f"(finished: {self.finished or 'none'}); every rank was stopped. {_HANGS[self.kind]}")
        failed = [(r, e) for r, e in enumerate(self.errors) if e]
        if self.status == "infrastructure":
            return next(e["message"] for _, e in failed if e["status"] == "infrastructure")
        if failed:
            rank, error = next(((r, e) for r, e in failed if e["status"] == "not_implemented"), failed[0])
            if error["status"] == "not_implemented":
                return error["message"]
            where = f" (at {error['where'][-1].split(' in ')[0]})" if error.get("where") else ""
            return f"rank {rank} of {self.n} raised {error.get('type', 'an error')}: {error['message']}{where}"
        if self.stopped == "too much":
            return "the ranks sent back more than 1 GiB of results, and the job was stopped"
        return (f"the job ended before every rank was done (ranks that finished: {self.finished or 'none'}): "
                "a rank crashed or left")

    def crossed(self, name: str) -> int | None:
        """Bytes that had crossed between the ranks by the mark ``name`` (None: not counted)."""
        return self.marks.get(name, (None, None))[0]


def decode(kind: str, value: dict) -> RankJob:
    """A ``RankJob`` from what ``autograder.sandbox.ranks.launch`` returned (its values still
    codec bytes, decoded here: a value no honest rank could send is refused as such)."""
    outputs = []
    for rank in value["ranks"]:
        emitted = []
        for frame in rank["frames"]:
            try:
                emitted.append(codec.decode(bytes(frame)))
            except codec.CodecError as exc:
                emitted.append({"unreadable": str(exc)})
        outputs.append(emitted)
    return RankJob(
        kind=kind, n=len(value["ranks"]), status=value["status"], outputs=outputs,
        errors=[r["error"] for r in value["ranks"]], finished=list(value["finished"]),
        marks={m[0]: (m[1], m[2]) for m in value["marks"]},
        memory={m[0]: m[3] for m in value["marks"]}, fresh_peaks={m[0] for m in value["marks"] if m[4]},
        cpu_s={m[0]: m[5] for m in value["marks"]}, mark_times={m[0]: m[6] for m in value["marks"]},
        peak_bytes=[r["peak_bytes"] for r in value["ranks"]], baseline_bytes=[r["baseline_bytes"] for r in value["ranks"]],
        wire=value["wire"], kept_apart=value["kept_apart"], own_users=value["own_users"],
        duration_s=value["duration_s"],
        timeout_s=value["timeout_s"], idle_s=value["idle_s"], stopped=value["stopped"],
        memory_tampered=[r for r, rank in enumerate(value["ranks"]) if rank["hwm_below_sampled"]],
        flags=_flags(value))


def _flags(value: dict) -> list:
    """What each rank's audit hook recorded, its channel checked as a call's is."""
    from autograder.sandbox import audit

    found = []
    for rank, record in enumerate(value["ranks"]):
        done = rank in value["finished"]
        for kind, detail in audit.check_channel(bytes(record["audit"]), done):
            found.append((kind, f"rank {rank}: {detail}" if kind == audit.Flag.CHANNEL.value else detail))
    memory = [r for r, rank in enumerate(value["ranks"]) if rank["hwm_below_sampled"]]
    if memory:
        found.append((audit.Flag.MEMORY.value, f"ranks {memory}: the peak memory fell below what the launcher had "
                                               "seen them hold"))
    return found


def run_cases(submission, kind: str, target: str, cases: list, ranks_of, part_of, *, key=str, timeout: float,
              idle_timeout: float | None = None, count_wire: bool = False, after_hang=None, explain=None,
              env: dict | None = None, everyone: bool = False) -> dict:
    """``{key(case): outcome}`` for every case: ``{"status": "ok", "records": [rank 0's, ...],
    "job": RankJob}``, or ``{"status", "message"}`` for the case a job failed on.

    ``ranks_of(case)``: how many ranks take part (ranks 0 .. that - 1; a job has as many
    ranks as its largest case). ``part_of(case, rank)``: rank's inputs for that case (plain
    data), which it alone receives. ``target``: the harness's rank function, "name"
    (``harness.py`` of the lab) that takes rank r's list of ``{"case": key, **part}`` and
    emits ``{"case": key, ...}`` per case. ``after_hang(case, pending)``: the pending cases
    not worth running once ``case`` hung; they are reported as not run. ``everyone``: every
    rank of the job gets an entry for every case, ``part_of(case, rank)`` for a rank that takes
    no part too (an MPI job's ranks all call ``Split`` for each case's communicator)."""
    explain = explain or (lambda job: job.explain())
    outcomes, pending = {}, list(cases)
    while pending:
        n = max(ranks_of(case) for case in pending)
        inputs = [[{"case": key(case), **part_of(case, rank)} for case in pending
                   if everyone or rank < ranks_of(case)] for rank in range(n)]
        job = submission.rank_job(kind, target, inputs, timeout=timeout, idle_timeout=idle_timeout,
                                  count_wire=count_wire, env=env)
        records = [{record.get("case"): record for record in rank_outputs if isinstance(record, dict)}
                   for rank_outputs in job.outputs]
        rest = []
        for case in pending:
            mine = [records[rank].get(key(case)) for rank in range(ranks_of(case))]
            if all(record is not None for record in mine):
                outcomes[key(case)] = {"status": "ok", "records": mine, "job": job}
            else:
                rest.append(case)
        if not rest:
            break
        failed, pending = rest[0], rest[1:]
        status = job.status if job.status in ("timeout", "raised", "not_implemented") else "crashed"
        outcomes[key(failed)] = {"status": status, "message": explain(job), "job": job}
        if status == "timeout" and after_hang:
            skipped = after_hang(failed, pending)
            for case in skipped:
                outcomes[key(case)] = {"status": "timeout", "message": f"not run: {key(failed)} hung first"}
            pending = [case for case in pending if case not in skipped]
    return outcomes


def crossed_in_phases(job: RankJob, case: str, phases) -> dict:
    """``{phase: bytes}`` that crossed in each phase of ``case`` (marks ``f"{case}:start"``,
    then ``f"{case}:{phase}"``), or ``{"unavailable": why}``; a phase never reached is left out.
    ``job.marks`` also holds what each rank had sent by each mark (``per_rank_in_phase``)."""
    if "unavailable" in job.wire:
        return {"unavailable": job.wire["unavailable"]}
    found, before = {}, job.crossed(f"{case}:start")
    if before is None:
        return {}
    for phase in phases:
        now = job.crossed(f"{case}:{phase}")
        if now is None:
            break
        found[phase], before = now - before, now
    return found


def per_rank_in_phase(job: RankJob, case: str, phase: str, previous: str = "start") -> list | None:
    """What each rank sent between the marks ``f"{case}:{previous}"`` and ``f"{case}:{phase}"``,
    by the kernel's count of its own sockets; None where not counted."""
    before, after = job.marks.get(f"{case}:{previous}"), job.marks.get(f"{case}:{phase}")
    if not job.own_users or not before or not after or before[1] is None or after[1] is None:
        return None  # ranks that share the grader's user: their sockets cannot say whose they are
    return [b - a for a, b in zip(before[1], after[1])]


def held_at(job: RankJob, mark: str) -> list | None:
    """What each rank held (resident memory, read by the launcher) at ``mark``; None where
    the job never reached it."""
    found = job.memory.get(mark)
    return None if found is None else [None if m is None else m[0] for m in found]


def held_at_peak(job: RankJob, mark: str) -> list | None:
    """Each rank's peak memory by ``mark`` (its high-water mark since the job started, or since
    a mark that started it afresh), read by the launcher; None where the job never reached it."""
    found = job.memory.get(mark)
    return None if found is None else [None if m is None else m[1] for m in found]


def peak_in_phase(job: RankJob, start: str, end: str) -> tuple[list, bool] | None:
    """(each rank's peak memory between the marks ``start`` and ``end`` above what it held at
    ``start``, whether that peak is the phase's own): own where the launcher started the
    high-water marks afresh at ``start`` (``ranks.mark(start, fresh_peak=True)``), else the
    peak since an earlier mark, which can only read higher. None where a mark is missing."""
    before, after = job.memory.get(start), job.memory.get(end)
    if before is None or after is None:
        return None
    return ([None if a is None or b is None else a[1] - b[0] for b, a in zip(before, after)],
            start in job.fresh_peaks)



def cpu_in_phase(job: RankJob, previous: str, phase: str) -> list:
    """The CPU seconds each rank used between its marks ``previous`` and ``phase`` (the
    kernel's count, read by the launcher from outside the rank); None for a rank that did
    not make both marks."""
    before, after = job.cpu_s.get(previous), job.cpu_s.get(phase)
    if before is None or after is None:
        return [None] * job.n
    return [None if a is None or b is None else b - a for a, b in zip(before, after)]
