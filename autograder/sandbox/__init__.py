"""Run calls into student code in child processes, isolated and under limits.

A ``Sandbox`` serves the calls into one submission; ``run_call`` is one call
in a sandbox of its own. The calls run in the strongest isolation layer this
machine offers (``autograder.sandbox.isolation``: bubblewrap's namespaces, else a
reaping supervisor; as ``nobody`` when the grader is root), each in a fresh
child of the sandbox's server (``autograder.sandbox.child``) with empty scratch
folders, on a read-only copy of the submission. It gets a wall-clock deadline, a CPU-time
limit, a file-size limit and (on the CPU tier) an address-space limit; a
watchdog also sums the resident memory of every process below it, which catches
what a per-process limit cannot (several processes, or a GPU run where an
address-space limit would break the CUDA driver). When a call ends, for
whatever reason, every process it started is gone before it returns.
"""
from __future__ import annotations

import fnmatch
import json
import os
import resource
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from autograder.sandbox import audit, codec, isolation
from autograder.sandbox.child import FLAGS_SO_FAR, READS_ENV, REPLY, REQUEST

PAGE = os.sysconf("SC_PAGE_SIZE")
MEMORY_SCAN_MAX_S = 0.25  # the longest wait between two sums of a call's resident memory
FILE_SIZE_LIMIT = 2**30
# A lab's grader code that runs beside the student's, in the call (``harness.py`` and the
# modules it loads beside itself): the only files of a checks folder a call can read.
HARNESS_FILES = "harness*.py"  # no file the call writes, its printed output included, grows past 1 GiB
_CLUTTER = shutil.ignore_patterns(".git", "__pycache__", ".ipynb_checkpoints", ".venv", "*.pyc")


def _not_copied(folder, names):
    """What a submission's copy leaves out: version control, caches, notebooks' checkpoints,
    and anything but files, folders and links (copying a FIFO would wait forever)."""
    def plain(name):
        mode = os.lstat(os.path.join(folder, name)).st_mode
        return stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)
    return set(_CLUTTER(folder, names)) | {name for name in names if not plain(name)}


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 60.0
    memory_mb: int | None = 4096  # per group; None: no limit
    address_space: bool = True  # also set RLIMIT_AS (not on a GPU: CUDA reserves huge ranges)
    devices: bool = False  # the host's /dev inside the sandbox (a GPU tier run needs /dev/nvidia*)


@dataclass
class Outcome:
    """What came back. ``status`` is one of: ok, not_implemented, raised, exit,
    memory, timeout, crashed, no_result."""
    status: str
    value: object = None
    message: str = ""
    where: list = field(default_factory=list)
    error_type: str = ""
    output: str = ""  # the tail of what the student's code printed
    duration_s: float = 0.0
    flags: list = field(default_factory=list)  # (kind, detail): what the code did that it had no reason to (audit)
    limit: str = ""  # "time" or "memory": the sandbox stopped the call at that limit


def _limit_child(limits: Limits):
    def apply():
        cpu = int(limits.timeout_s * max(os.cpu_count() or 1, 1)) + 5
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 5))
        if limits.memory_mb and limits.address_space:
            as_bytes = limits.memory_mb * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (as_bytes, as_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))
    return apply


def group_members(pgid: int) -> list[int]:
    """Processes in the group, and every descendant of its leader (in case one
    of them started a session of its own)."""
    members, parent_of = [], {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, ppid, group = int(entry), int(stat[1]), int(stat[2])
        parent_of[pid] = ppid
        if group == pgid:
            members.append(pid)
    for pid in parent_of:
        p = parent_of.get(pid)
        while p and p != pgid and p in parent_of:
            p = parent_of[p]
        if p == pgid and pid not in members:
            members.append(pid)
    return members


def _group_rss_mb(pgid: int, leave_out: set[int] = frozenset()) -> float:
    total = 0
    for pid in set(group_members(pgid)) - leave_out:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * PAGE
        except OSError:
            pass
    return total / 2**20


def kill_group(pgid: int) -> None:
    """Stop every process of the call, until no new one appears (a stopped process
    cannot fork), then kill them all: none escapes by forking while we look."""
    stopped: set[int] = set()
    while True:
        fresh = [pid for pid in group_members(pgid) if pid not in stopped]
        if not fresh:
            break
        for pid in fresh:
            try:
                os.kill(pid, signal.SIGSTOP)
            except OSError:
                pass
        stopped.update(fresh)
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def _sweep(marker: str, patience_s: float = 2.0) -> None:
    """Kill what is left of a call and wait until it is gone. When bubblewrap's
    namespace ends, the kernel kills what is inside, but the outer bwrap can
    exit first: the call's processes, found by their marker, must be dead
    before the call returns."""
    needle = f"K2C_CALL={marker}".encode()
    deadline = time.monotonic() + patience_s
    while True:
        alive = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        continue
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        alive.append(int(entry))
            except OSError:
                continue
        if not alive or time.monotonic() > deadline:
            return
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.02)


def _stage(submission: str, copy: str) -> str:
    """A copy of the submission, at ``copy``, that the call's user can read and not change.
    Links are copied as links, never followed: a link cannot make the grader
    copy a file the student could not read."""
    shutil.copytree(submission, copy, symlinks=True, ignore=_not_copied)
    for root, _, files in os.walk(copy):
        os.chmod(root, 0o755)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o755 if os.access(path, os.X_OK) else 0o644)
    return copy


def _tail(path: str, limit: int = 1500, offset: int = 0) -> str:
    """The last ``limit`` bytes of the file after ``offset``, as text."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END) - offset
        f.seek(offset + max(0, size - limit))
        text = f.read().decode(errors="replace")
    return ("…" + text) if size > limit else text


def _signal_of(code: int) -> signal.Signals | None:
    """The signal that ended the call: bubblewrap and the supervisor report a signal N as 128 + N."""
    try:
        return signal.Signals(-code) if code < 0 else signal.Signals(code - 128) if code > 128 else None
    except ValueError:
        return None


class Sandbox:
    """Calls into one submission, each in a fresh child of one isolated server
    (``autograder.sandbox.child``), which imports what they need (``K2C_PRELOAD`` in
    ``env``) once: a grading pays for starting Python and importing torch or
    numba once per sandbox, not once per call. The server kills every process
    of a call and empties the scratch space before the call returns, so the next
    call finds nothing of the last. A call that runs out of time or memory, or
    whose server dies, ends the sandbox; the next call starts a new one."""

    START_TIMEOUT_S = 300.0  # starting Python and importing torch, on a machine that may be very busy

    def __init__(self, submission: str, limits: Limits, env: dict[str, str] | None = None,
                 layer: isolation.Isolation | None = None):
        self.submission, self.limits, self.env = submission, limits, dict(env or {})
        self.layer = layer or isolation.detect()
        self._proc = None

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        self._tmp = tempfile.mkdtemp(prefix="k2c-sandbox-")
        os.chmod(self._tmp, 0o711)  # the call's user passes through to its scratch folder, and sees nothing else here
        scratch = os.path.join(self._tmp, "scratch")
        os.mkdir(scratch, 0o711)
        if self.layer.uid is not None:
            os.chown(scratch, self.layer.uid, self.layer.gid)
        # The submissions' read-only copies, made as the first call into each arrives (see call()).
        self._staging = os.path.join(self._tmp, "submissions")
        os.mkdir(self._staging, 0o755)
        self._staged: dict[str, str] = {}
        # Copies of the labs' harness modules (``HARNESS_FILES`` of a checks folder): the calls
        # read these, never the checks folder, which holds the checks and their oracles.
        self._harnesses = os.path.join(self._tmp, "harness")
        os.mkdir(self._harnesses, 0o755)
        self._harness_copies: dict[str, str] = {}
        self._copies = 0
        # Each rank job's inputs, a file per rank that only that rank's user may read (stage_rank_inputs).
        self._jobs = os.path.join(self._tmp, "jobs")
        os.mkdir(self._jobs, 0o711)
        read_end, write_end = os.pipe()
        child_env = dict(os.environ)
        child_env.pop("K2C_GRADING_SEED", None)  # an instructor's regrade: the seed never reaches student code
        child_env.update(self.env)
        child_env.update(self.layer.child_env(scratch))
        # torch._dynamo makes its cache folder as it loads, in the server, which cannot write
        # the scratch folder: it is made here. (The grader's own TORCHINDUCTOR_CACHE_DIR, which
        # torch sets as it loads, would be a folder the sandbox cannot write at all.)
        os.mkdir(os.path.join(scratch, "torchinductor"), 0o755)
        if self.layer.uid is not None:
            os.chown(os.path.join(scratch, "torchinductor"), self.layer.uid, self.layer.gid)
        child_env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(child_env["HOME"], "torchinductor")
        child_env["K2C_RESULT_FD"] = child_env["K2C_PASS_FDS"] = str(write_end)
        child_env["PYTHONDONTWRITEBYTECODE"] = "1"
        # Marks every process of this sandbox, for the last sweep in close().
        child_env["K2C_CALL"] = self._marker = secrets.token_hex(8)
        child_env[READS_ENV] = json.dumps([isolation.needed_paths(), isolation.hidden_paths()])
        # The server must import the grader's own packages even when they are not installed.
        child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [isolation.PACKAGE_ROOT, child_env.get("PYTHONPATH")]))
        # -P: no folder the student can write (the scratch folder it starts in) on its sys.path; -s: nor theirs.
        command = self.layer.command([sys.executable, "-P", "-s", "-m", "autograder.sandbox.child"], scratch,
                                     [self._staging, self._harnesses, self._jobs], self.limits.devices)
        self._log_path = os.path.join(self._tmp, "output.txt")
        with open(self._log_path, "wb") as out:
            self._proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                pass_fds=(write_end,), env=child_env, cwd=scratch,
                start_new_session=True, preexec_fn=_limit_child(self.limits),
            )
        os.close(write_end)
        self._replies = read_end
        self._inbox = bytearray()  # grows in place: a reply can be tens of MB
        self._flags = bytearray()  # the running call's flag records so far
        self._server: set[int] = set()
        if not isinstance(self._wait_for(time.monotonic() + self.START_TIMEOUT_S, watch_memory=False), tuple):
            output = _tail(self._log_path)
            self.close()
            raise RuntimeError(f"the sandbox did not start: {output or 'no output'}")
        # The server's own processes, before any call: its memory is not the student's.
        self._server = set(group_members(self._proc.pid))

    def _wait_for(self, deadline: float, watch_memory: bool = True):
        """Wait for the server's next reply: (code, reply, flag records), or None if the server
        died; "timeout" or "memory" when the call must be stopped for it. The call's flag
        records, which come as it runs, gather in ``self._flags`` until then."""
        next_scan, interval = time.monotonic(), 0.05
        while True:
            while len(self._inbox) >= REPLY.size:
                code, length, flags_length = REPLY.unpack_from(self._inbox)
                end = REPLY.size + length + flags_length
                if len(self._inbox) < end:
                    break
                reply = bytes(self._inbox[REPLY.size:REPLY.size + length])
                self._flags += self._inbox[REPLY.size + length:end]
                del self._inbox[:end]
                if code != FLAGS_SO_FAR:
                    flags, self._flags = bytes(self._flags), bytearray()
                    return code, reply, flags
            now = time.monotonic()
            if now > deadline:
                return "timeout"
            if watch_memory and self.limits.memory_mb and now >= next_scan:
                if self._rss_mb() > self.limits.memory_mb:
                    return "memory"
                # A memory scan reads all of /proc (tens of ms on a busy machine): often at
                # first, then every MEMORY_SCAN_MAX_S, so that waiting on a long call costs
                # the grader little CPU. The reply is still seen as soon as it comes.
                interval = min(interval * 1.5, MEMORY_SCAN_MAX_S)
                next_scan = now + interval
            if select.select([self._replies], [], [], 0.05)[0]:
                data = os.read(self._replies, 1 << 20)
                if not data:  # the server is gone
                    return None
                self._inbox += data

    def _rss_mb(self) -> float:
        return _group_rss_mb(self._proc.pid, leave_out=self._server)

    def call(self, request: dict) -> Outcome:
        """Run ``request`` (see ``autograder.sandbox.child``) on the copy of its submission (default: this sandbox's)."""
        if self._proc is None:
            try:
                self._start()
            except RuntimeError as exc:
                return Outcome("crashed", message=str(exc))
        request = dict(request, submission=self._copy_of(request.get("submission") or self.submission))
        target = request.get("target", {})
        if target.get("kind") == "harness":
            request["target"] = dict(target, path=self._harness_copy(target["path"]))
        elif target.get("kind") == "ranks":  # the rank function is a harness's, as "path.py:function"
            path, _, func = target["job"]["target"].rpartition(":")
            request["target"] = dict(target, job=dict(target["job"], target=f"{self._harness_copy(path)}:{func}"))
        with open(self._log_path, "rb") as log:
            offset = log.seek(0, os.SEEK_END)
        start = time.monotonic()
        payload = codec.encode(request)
        try:
            self._proc.stdin.write(REQUEST.pack(len(payload)) + payload)
            self._proc.stdin.flush()
        except OSError:
            pass  # the server is gone: seen below
        self._flags = bytearray()
        got = self._wait_for(start + self.limits.timeout_s)
        duration = time.monotonic() - start
        if isinstance(got, tuple):
            outcome = _outcome(*got, _tail(self._log_path, offset=offset), duration)
        else:
            outcome = self._stopped(got, offset, duration)
        if target.get("kind") == "ranks":  # the launcher runs no student code: the ranks report their own flags
            outcome.flags = [f for f in outcome.flags if f[0] != "channel"]
        return outcome

    def _stopped(self, why, offset: int, duration: float) -> Outcome:
        """The outcome of a call that never answered: stopped for time or memory (``why``:
        "timeout", "memory"), or whose server died (None). Every process of the sandbox is
        gone when this returns; the next call starts a new one."""
        self._stop()  # kills the call, and everything it started, with the server
        output = _tail(self._log_path, offset=offset)
        # What the call did before it was stopped still reaches the instructor: the records
        # that came, up to the last whole line (the one being written may be cut).
        flags = audit.check_channel(bytes(self._flags[:self._flags.rfind(b"\n") + 1]), False)
        self.close()
        if why == "timeout":
            return Outcome("timeout", message=f"did not finish within {self.limits.timeout_s:g} s "
                           "(an infinite loop? a deadlock?) and was stopped", output=output, duration_s=duration,
                           flags=flags, limit="time")
        if why == "memory":
            return Outcome("memory", message=f"used more than {self.limits.memory_mb} MiB of memory and was stopped",
                           output=output, duration_s=duration, flags=flags, limit="memory")
        return Outcome("crashed", message="the sandbox's process ended during the call", output=output,
                       duration_s=duration, flags=flags)

    def _copy_of(self, submission: str) -> str:
        """The read-only copy of ``submission`` that the calls see, made on its first call.
        A sandbox serves its own submission; a grader that grades many trusted ones in a
        row (tests/grade_batch.py) may send several through one server, which never runs
        their code itself: each call still runs in a fresh child, on a copy of its own."""
        if submission not in self._staged:
            self._copies += 1
            self._staged[submission] = _stage(submission, os.path.join(self._staging, str(self._copies)))
        return self._staged[submission]

    def _harness_copy(self, path: str) -> str:
        """Where the calls find the harness module ``path``: a copy, beside copies of the
        other harness modules of its folder (``HARNESS_FILES``), readable by the call's user."""
        folder = os.path.dirname(os.path.abspath(path))
        if folder not in self._harness_copies:
            copy = os.path.join(self._harnesses, str(len(self._harness_copies) + 1))
            os.mkdir(copy, 0o755)
            for name in sorted(os.listdir(folder)):
                if fnmatch.fnmatch(name, HARNESS_FILES):
                    shutil.copyfile(os.path.join(folder, name), os.path.join(copy, name))
                    os.chmod(os.path.join(copy, name), 0o644)
            self._harness_copies[folder] = copy
        return os.path.join(self._harness_copies[folder], os.path.basename(path))

    def stage_rank_inputs(self, payloads: list[bytes]) -> list[str]:
        """Write each rank's inputs (codec bytes) to a file of the sandbox that only that
        rank may read (``autograder.sandbox.rank_isolation.uid_of``, where the ranks get
        users of their own); their paths, as the ranks see them. Starts the sandbox."""
        from autograder.sandbox import rank_isolation

        if self._proc is None:
            self._start()
        folder = tempfile.mkdtemp(prefix="job-", dir=self._jobs)
        os.chmod(folder, 0o711)
        paths = []
        for rank, payload in enumerate(payloads):
            path = os.path.join(folder, f"rank-{rank}.k2c")
            with open(path, "wb") as f:
                f.write(payload)
            if self.layer.ranks_apart:
                uid = rank_isolation.uid_of(rank)
                os.chown(path, uid, uid)
                os.chmod(path, 0o400)
            else:
                os.chmod(path, 0o600)  # the ranks run as the grader's own user
            paths.append(path)
        return paths

    def forget(self, submission: str) -> None:
        """Remove the copy of ``submission``: a later call into it gets a fresh one."""
        copy = self._staged.pop(submission, None) if self._proc is not None else None
        if copy:
            shutil.rmtree(copy, ignore_errors=True)

    def _stop(self) -> None:
        """Kill the server and everything in the sandbox, and wait until it is all gone."""
        if self._proc is None or self._replies is None:  # never started, or stopped already
            return
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        kill_group(self._proc.pid)
        self._proc.wait()
        _sweep(self._marker)
        os.close(self._replies)
        self._replies = None

    def close(self) -> None:
        """End the server and everything in the sandbox; remove its folder."""
        if self._proc is None:
            return
        self._stop()
        self._proc = None
        shutil.rmtree(self._tmp, ignore_errors=True)


def _outcome(code: int, data: bytes, flag_records: bytes, output: str, duration: float) -> Outcome:
    """What a call's exit code, reply and flag records (as the server passed them on) mean."""
    outcome = _outcome_of(code, data, output, duration)
    # A reply came back: the child's own code ran past the student's function, and wrote the last record.
    outcome.flags = audit.check_channel(flag_records, outcome.status != "crashed" and bool(data))
    return outcome


def _outcome_of(code: int, data: bytes, output: str, duration: float) -> Outcome:
    if data:
        try:
            reply = codec.decode(data)
            if not isinstance(reply, dict) or "status" not in reply:
                raise codec.CodecError("malformed reply")
        except codec.CodecError as exc:
            return Outcome("crashed", message=f"the reply from the submission's process was unreadable ({exc})",
                           output=output, duration_s=duration)
        return Outcome(reply["status"], value=reply.get("value"), message=reply.get("message", ""),
                       where=reply.get("where", []), error_type=reply.get("type", ""),
                       output=output, duration_s=duration)
    sig = _signal_of(code)
    if sig:
        if sig == signal.SIGXCPU:
            why = "used up its CPU-time limit and was stopped"
        elif sig == signal.SIGXFSZ:
            why = f"wrote a file (or printed) more than {FILE_SIZE_LIMIT // 2**20} MiB and was stopped"
        else:
            why = f"crashed with {sig.name}" + (" (a segmentation fault)" if sig == signal.SIGSEGV else "")
        return Outcome("crashed", message=why, output=output, duration_s=duration)
    return Outcome("no_result", message=f"the process exited with status {code} before returning a result "
                   "(does the code call os._exit or exit the interpreter?)", output=output, duration_s=duration)


def run_call(request: dict, limits: Limits, env: dict[str, str] | None = None,
             layer: isolation.Isolation | None = None) -> Outcome:
    """Run ``request`` (see ``autograder.sandbox.child``) in a sandbox of its own, in
    ``layer`` (default: the strongest this machine offers)."""
    with Sandbox(request["submission"], limits, env, layer) as sandbox:
        return sandbox.call(request)
