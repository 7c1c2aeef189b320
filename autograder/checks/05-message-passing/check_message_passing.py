"""Checks for lab 05: block decomposition, halo exchange, the distributed heat
equation in 1D and 2D, ping-pong and the α–β fit.

Every MPI part runs at 1, 2, 3 and 4 ranks on grids that split unevenly, in
one rank job per part and rank count (see ``harness.py``): each rank has its own
user, /tmp and /dev/shm, and receives only its own block of the grid with a ghost
each side (the rest is NaN), so the network is the only way to its neighbours'
values. The communicator records each message and turns ``Send`` into ``Ssend``:
a send order that deadlocks is stopped at the launcher's timeout and reported as
such. Grids, steps and the α–β fit's data are drawn from the grading's secret
seed. The oracle is a serial loop over the points in plain Python floats, with
the operation order the lab prescribes, in the grader, so distributed results
must equal it bit for bit. What crossed in a halo exchange is the kernel's count,
in all and per rank.
"""
import numpy as np
import pytest

from autograder.grading import seeds
from autograder.grading.checking import expect_array, expect_close, with_the_work
from autograder.grading.rank_jobs import crossed_in_phases, per_rank_in_phase
from autograder.grading.submission import failure_from
from autograder.grading.traffic import MPI_HEADER_BYTES, expect_crossed, expect_sent_by_rank

RANKS = (1, 2, 3, 4)
# Interior points: on 3 and 4 ranks every one of these splits unevenly. The halo cases add 401, blocks
# of 100 or more, so that sending a block where a cell would do shows in the count of what crossed;
# the heat cases do not need it (their answers are compared value by value).
INTERIOR_1D = (4, 7, 10, 11)
INTERIOR_HALO_1D = INTERIOR_1D + (401,)
SHAPES_2D = ((7, 8), (9, 11), (6, 5))  # interior rows 5, 7, 4
STEPS, ALPHA_1D, ALPHA_2D = 25, 0.23, 0.2
LAUNCH_TIMEOUT_S = 15  # per job; lab.toml's timeout_s is larger, so the launcher's report comes back
COUNTED_RANKS = 4  # halo exchanges are counted on this many ranks (MPICH over TCP costs a little more per job)
COUNTED = ("halo_1d", "halo_1d_nonblocking", "halo_rows")


def _grid_1d(seed, interior, k):
    u = seeds.rng(seed, "05", "1d", interior, k).random(interior + 2)
    u[0], u[-1] = 1.0, -0.5  # fixed boundary values
    return u


def _grid_2d(seed, shape, k):
    u = seeds.rng(seed, "05", "2d", *shape, k).random(shape)
    u[0, :], u[-1, :], u[:, 0], u[:, -1] = 1.0, -1.0, 0.5, 0.25
    return u


def _cases(seed) -> dict:
    """Every part's cases, drawn from the grading's secret seed."""
    cases_1d = [{"u": _grid_1d(seed, m, k), "steps": STEPS, "alpha": ALPHA_1D} for k, m in enumerate(INTERIOR_HALO_1D)]
    cases_2d = [{"u": _grid_2d(seed, shape, k), "steps": STEPS // 2, "alpha": ALPHA_2D}
                for k, shape in enumerate(SHAPES_2D)]
    heat_1d = cases_1d[:len(INTERIOR_1D)]
    return {"halo_1d": cases_1d, "halo_1d_nonblocking": cases_1d, "heat_1d": heat_1d, "heat_1d_nonblocking": heat_1d,
            "halo_rows": cases_2d, "heat_2d": cases_2d, "ping_pong": [{"sizes": [8, 1000, 65536], "repeats": 3}]}


def _own_part(part, case, n, rank):
    """What rank ``rank`` of ``n`` receives of a case: its block of the grid and a ghost each side.
    A halo exchange gets that block alone, its inner ghosts NaN (a neighbour must write them); a
    heat run gets it in place in a grid of the whole shape, NaN elsewhere."""
    if part == "ping_pong":
        return dict(case)
    u = case["u"]
    lo, hi = _split(len(u) - 2, n, rank)
    if part in COUNTED:
        local = np.array(u[lo:hi + 2], dtype=float)
        if rank > 0:
            local[0] = np.nan
        if rank < n - 1:
            local[-1] = np.nan
        return {"local": local, "counted": n == COUNTED_RANKS}
    mine = np.full_like(u, np.nan)
    mine[lo:hi + 2] = u[lo:hi + 2]
    return {"u": mine, "steps": case["steps"], "alpha": case["alpha"]}


def _on_ranks(submission, seed, part, n):
    """Every rank's ``{"results": [per case], "logs": [per case]}`` for one part on ``n`` ranks
    (one job per part and rank count, shared by the checks that read it); rank 0's also holds,
    for a counted halo exchange, the bytes that crossed in each case (``"wire"``) and what each
    rank sent (``"sent_by_rank"``)."""
    def run():
        cases = submission.once("cases", lambda: _cases(seed))[part]
        inputs = [{"part": part, "cases": [_own_part(part, case, n, rank) for case in cases]} for rank in range(n)]
        job = submission.rank_job("mpi", "part_rank", inputs, timeout=LAUNCH_TIMEOUT_S,
                                  count_wire=part in COUNTED and n == COUNTED_RANKS)
        if job.status != "ok":
            raise failure_from({"status": job.status, "message": job.explain()}, f"on {n} rank(s)")
        found = [{"results": [r["result"] for r in outputs], "logs": [r["log"] for r in outputs]}
                 for outputs in job.outputs]
        if part in COUNTED and n == COUNTED_RANKS:
            found[0]["wire"] = [crossed_in_phases(job, f"{part}:{k}", ("done",)) for k in range(len(cases))]
            found[0]["sent_by_rank"] = [per_rank_in_phase(job, f"{part}:{k}", "done") for k in range(len(cases))]
        return found
    return submission.once((part, n), run)


def _split(n, size, rank):
    # NumPy's own split of range(n) into size pieces, with the same convention (bigger pieces first).
    sizes = [len(piece) for piece in np.array_split(np.arange(n), size)]
    offset = sum(sizes[:rank])
    return offset, offset + sizes[rank]


def _serial_1d(u, steps, alpha):
    # Point by point in plain Python floats: the same IEEE operations, in the order the lab prescribes.
    values = [float(v) for v in u]
    for _ in range(steps):
        values = [values[0]] + [values[i] + alpha * (values[i - 1] - 2 * values[i] + values[i + 1])
                                for i in range(1, len(values) - 1)] + [values[-1]]
    return np.array(values)


def _serial_2d(u, steps, alpha):
    grid = [[float(v) for v in row] for row in u]
    rows, cols = len(grid), len(grid[0])
    for _ in range(steps):
        grid = [grid[i] if i in (0, rows - 1) else
                [grid[i][j] if j in (0, cols - 1) else
                 grid[i][j] + alpha * (grid[i - 1][j] + grid[i + 1][j] + grid[i][j - 1] + grid[i][j + 1]
                                       - 4 * grid[i][j])
                 for j in range(cols)]
                for i in range(rows)]
    return np.array(grid)


# --- 1. Block decomposition ------------------------------------------------------

@pytest.mark.points(2)
def check_split_rows(submission, seed):
    """split_rows covers every row once, in rank order, the first n % size ranks one row more"""
    rng = seeds.rng(seed, "05", "split")
    cases = [(10, 4), (12, 4), (7, 3), (5, 5), (3, 4), (1, 1), (100, 7), (11, 2)]
    cases += [(int(rng.integers(1, 1000)), int(rng.integers(2, 17))) for _ in range(4)]
    table = submission.harness("split_rows_table", cases)  # one sandboxed call for every answer
    for (n, size), answers in zip(cases, table):
        got = [tuple(answer) for answer in answers]
        want = [_split(n, size, rank) for rank in range(size)]
        assert got == want, (
            f"split_rows({n}, {size}, rank) for ranks 0..{size - 1} gave {got}, expected {want}: blocks "
            f"of {[b - a for a, b in want]} rows — the first {n % size} rank(s) get {n // size + 1}, the rest "
            f"{n // size}, and each block starts where the previous one stopped")


# --- 2. Halo exchange in 1D ------------------------------------------------------

def _check_halos(submission, seed, part, what):
    cases = submission.once("cases", lambda: _cases(seed))[part]
    for n in RANKS:
        job = _on_ranks(submission, seed, part, n)
        for k, case in enumerate(cases):
            u = case["u"]
            for rank in range(n):
                lo, hi = _split(len(u) - 2, n, rank)
                got = job[rank]["results"][k]
                assert got is not None and np.shape(got) == u[lo:hi + 2].shape, (
                    f"{what} on {n} rank(s): rank {rank}'s array changed shape")
                edge = ("domain's first ghost, which holds the boundary value (neighbour MPI.PROC_NULL)"
                        if rank == 0 else f"ghost from rank {rank - 1}")
                expect_array(got[:1], u[lo:lo + 1], f"{what} on {n} rank(s), case {k}: rank {rank}'s left/top "
                             f"{edge}", exact=True)
                edge = ("domain's last ghost, which holds the boundary value (neighbour MPI.PROC_NULL)"
                        if rank == n - 1 else f"ghost from rank {rank + 1}")
                expect_array(got[-1:], u[hi + 1:hi + 2], f"{what} on {n} rank(s), case {k}: rank {rank}'s "
                             f"right/bottom {edge}", exact=True)
                expect_array(got[1:-1], u[lo + 1:hi + 1], f"{what} on {n} rank(s), case {k}: rank {rank}'s "
                             "own block (it must not change)", exact=True)
            # What crossed, as the launcher counted it (on 4 ranks): one ghost cell (row) each way across
            # each of the n - 1 boundaries, and nothing else.
            if "wire" not in job[0]:
                continue
            cell = u[0].nbytes
            expect_crossed(submission, job[0]["wire"][k], "done", 2 * (n - 1) * cell, 2 * (n - 1),
                           f"{what} on {n} rank(s), case {k}", f"one ghost {'row' if u.ndim > 1 else 'cell'} "
                           f"of {cell} bytes each way across each of the {n - 1} boundaries", header=MPI_HEADER_BYTES)
            # and from each rank, one ghost to each neighbour it has: the edges' ranks one, the others two
            expect_sent_by_rank(job[0]["sent_by_rank"][k], [cell, cell] + [2 * cell] * (n - 2),
                                f"{what} on {n} rank(s), case {k}", 2 * (n - 1), header=MPI_HEADER_BYTES)


@pytest.mark.points(2)
def check_exchange_halos(submission, seed):
    """exchange_halos fills each ghost cell from its neighbour, sending only those, and leaves the domain's edges alone"""
    _check_halos(submission, seed, "halo_1d", "exchange_halos")


# --- 3. The heat equation in 1D --------------------------------------------------

def _check_heat(submission, seed, part, serial, what):
    cases = submission.once("cases", lambda: _cases(seed))[part]
    wants = [serial(case["u"], case["steps"], case["alpha"])[1:-1] for case in cases]
    for n in RANKS:
        job = _on_ranks(submission, seed, part, n)
        for k, case in enumerate(cases):
            blocks = [job[rank]["results"][k] for rank in range(n)]
            missing = [rank for rank, b in enumerate(blocks) if b is None]
            assert not missing, f"{what} on {n} rank(s): rank(s) {missing} returned None, not their block"
            want = wants[k]
            sizes = [len(b) for b in blocks]
            assert sum(sizes) == len(want), (
                f"{what} on {n} rank(s), {len(want)} interior rows: the ranks returned blocks of {sizes} rows "
                f"({sum(sizes)} in all), expected {[b - a for a, b in (_split(len(want), n, r) for r in range(n))]}")
            got = np.concatenate([np.asarray(b) for b in blocks])
            expect_array(got, want, f"{what} on {n} rank(s), {case['steps']} steps of a {case['u'].shape} grid, "
                         "the ranks' blocks in rank order vs the serial result", exact=True)


@pytest.mark.points(3)
def check_heat_1d_matches_serial(submission, seed):
    """run_heat_1d on 1-4 ranks equals the serial heat equation bit for bit (uneven splits)"""
    _check_heat(submission, seed, "heat_1d", _serial_1d, "run_heat_1d")


# --- 4. Non-blocking halo exchange --------------------------------------------------

@pytest.mark.points(2)
def check_exchange_halos_nonblocking(submission, seed):
    """exchange_halos_nonblocking fills the same ghost cells as exchange_halos"""
    _check_halos(submission, seed, "halo_1d_nonblocking", "exchange_halos_nonblocking")


@pytest.mark.points(2)
def check_nonblocking_posts_receives_before_waiting(submission, seed):
    """exchange_halos_nonblocking posts both Irecv before it waits, and uses no blocking call"""
    with_the_work("the non-blocking exchange's order",
                  lambda: _check_halos(submission, seed, "halo_1d_nonblocking", "exchange_halos_nonblocking"))
    for n in RANKS:
        job = _on_ranks(submission, seed, "halo_1d_nonblocking", n)
        for rank in range(n):
            log = job[rank]["logs"][0]
            ops = [e["op"] for e in log]
            blocking = sorted({op for op in ops if op in ("send", "recv", "sendrecv")})
            assert not blocking, (f"on {n} rank(s), rank {rank} called blocking {blocking}: this exchange is "
                                  "Irecv, Isend and Wait only")
            assert ops.count("irecv") == 2 and ops.count("isend") == 2, (
                f"on {n} rank(s), rank {rank} posted {ops.count('irecv')} Irecv and {ops.count('isend')} Isend: "
                "one of each per neighbour (MPI.PROC_NULL where there is none)")
            first_wait = ops.index("wait") if "wait" in ops else len(ops)
            late = [i for i, op in enumerate(ops) if op == "irecv" and i > first_wait]
            assert not late, (
                f"on {n} rank(s), rank {rank} waited before posting both receives (calls: {ops}): post every "
                "Irecv first, then the Isends, then wait — a receive posted late can leave the sender waiting")
            waited = {e["request"] for e in log if e["op"] == "wait"}
            posted = {e["request"] for e in log if e["op"] in ("irecv", "isend")}
            assert posted <= waited, (f"on {n} rank(s), rank {rank} never waited for {len(posted - waited)} of "
                                      "its requests: wait for every one before the buffers are used")


@pytest.mark.points(2)
def check_heat_1d_nonblocking_matches_serial(submission, seed):
    """run_heat_1d(..., nonblocking=True) on 1-4 ranks equals the serial heat equation bit for bit"""
    _check_heat(submission, seed, "heat_1d_nonblocking", _serial_1d, "run_heat_1d(nonblocking=True)")


# --- 5. The heat equation in 2D ------------------------------------------------------

@pytest.mark.points(2)
def check_exchange_halo_rows(submission, seed):
    """exchange_halo_rows fills the top ghost row from the rank above and the bottom one from the rank below, sending only those"""
    _check_halos(submission, seed, "halo_rows", "exchange_halo_rows")


@pytest.mark.points(3)
def check_heat_2d_matches_serial(submission, seed):
    """run_heat_2d on 1-4 ranks equals the serial 2D heat equation bit for bit (uneven row splits)"""
    _check_heat(submission, seed, "heat_2d", _serial_2d, "run_heat_2d")


# --- 6. Ping-pong and the α–β model ------------------------------------------------------

@pytest.mark.points(2)
def check_ping_pong(submission, seed):
    """ping_pong times each size between ranks 0 and 1 only, and returns one positive time per size"""
    case = submission.once("cases", lambda: _cases(seed))["ping_pong"][0]
    sizes, repeats = case["sizes"], case["repeats"]
    for n in (2, 3):
        job = _on_ranks(submission, seed, "ping_pong", n)
        times = job[0]["results"][0]
        assert isinstance(times, (list, tuple)) and len(times) == len(sizes), (
            f"on {n} ranks, rank 0 returned {times!r}: expected a list of {len(sizes)} times, one per size")
        bad = [t for t in times if not (isinstance(t, float) and 0 < t < 1)]
        assert not bad, f"one-way times should be seconds, a little above 0; got {times}"
        for rank in range(n):
            log = job[rank]["logs"][0]
            sends = [e for e in log if e["op"] in ("send", "isend", "sendrecv")]
            if rank > 1:
                assert not log, f"on {n} ranks, rank {rank} took part ({len(log)} calls): only ranks 0 and 1 do"
                continue
            peers = {e["peer"] for e in sends}
            assert peers == {1 - rank}, f"on {n} ranks, rank {rank} sent to {sorted(peers)}: only to rank {1 - rank}"
            for size in sizes:
                count = sum(1 for e in sends if e["nbytes"] == size)
                assert count >= repeats, (f"rank {rank} sent {count} message(s) of {size} bytes; {repeats} timed "
                                          "round trips need at least that many (buffers of np.uint8, size bytes)")


SIZES = np.unique(np.logspace(0, 7, 29).astype(np.int64))


def _alpha_beta(seed, name):
    """A latency of 1-10 µs and a bandwidth of 1-20 GB/s, drawn from the grading's secret seed."""
    rng = seeds.rng(seed, "05", "alpha-beta", name)
    return rng.uniform(1e-6, 1e-5), 1 / rng.uniform(1e9, 2e10)


@pytest.mark.points(1)
def check_fit_alpha_beta_exact(submission, seed):
    """fit_alpha_beta recovers alpha and beta from noise-free times t = alpha + beta * n (also two fractional sizes)"""
    # 29 sizes from 1 B to 10 MB; then the smallest fit, two points, at sizes that are not whole
    # numbers (KiB, say): the line through them, exactly.
    alpha, beta = _alpha_beta(seed, "exact")
    small = seeds.rng(seed, "05", "two points").uniform(0.1, 3.0, 2)
    for sizes, alpha, beta in [(SIZES.astype(float), alpha, beta), (np.array([0.5, 2.75]), *small)]:
        got = submission.call("heat_mpi.fit_alpha_beta", sizes, alpha + beta * sizes)
        assert isinstance(got, (tuple, list)) and len(got) == 2, f"expected (alpha, beta), got {got!r}"
        where = f" from {len(sizes)} sizes {sizes.min():g} to {sizes.max():g}"
        expect_close(got[0], alpha, "alpha (latency, s)" + where, rel=1e-6)
        expect_close(got[1], beta, "beta (s per byte)" + where, rel=1e-6)


@pytest.mark.points(1)
def check_fit_alpha_beta_noisy(submission, seed):
    """fit_alpha_beta is a least-squares fit: near the truth on noisy times, equal to lstsq"""
    ALPHA, BETA = _alpha_beta(seed, "noisy")
    rng = seeds.rng(seed, "05", "noise")
    sizes = np.repeat(np.linspace(0, 2e5, 21), 5)  # whole bytes
    times = ALPHA + BETA * sizes + rng.normal(0, 0.1 * ALPHA, sizes.size)
    got = submission.call("heat_mpi.fit_alpha_beta", sizes, times)
    assert isinstance(got, (tuple, list)) and len(got) == 2, f"expected (alpha, beta), got {got!r}"
    beta, alpha = np.polyfit(sizes, times, 1)
    expect_close(got[0], alpha, "alpha: the least-squares intercept", rel=1e-6)
    expect_close(got[1], beta, "beta: the least-squares slope", rel=1e-6)
    expect_close(got[0], ALPHA, "alpha vs the true latency", rel=0.1)
    expect_close(got[1], BETA, "beta vs the true inverse bandwidth", rel=0.05)
