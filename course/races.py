"""See data races in a numba ``prange`` loop without relying on luck.

A race only shows up in a parallel run when two threads happen to overlap in
time, so running the compiled code and comparing answers catches it sometimes.
Instead, ``find_races`` runs the *Python* version of the function (numba keeps
it as ``fn.py_func``) one iteration at a time, with ``prange`` and NumPy's
array constructors swapped for recording versions, and writes down which
iteration of each parallel loop read or wrote which memory address. Two
different iterations writing the same element, or one writing what another
reads, is a race. Iterations are dealt to ``THREADS`` threads in contiguous
chunks, as numba's static schedule does, and ``numba.get_thread_id()`` answers
accordingly, so two iterations of the same thread never count as a race (a
per-thread scratch row indexed by the thread id is correct). Scalars
accumulated with ``+=`` are numba reductions and are not arrays, so they are
(rightly) not reported. Nested ``prange`` loops run serially inside the outer
one, as in numba.
"""
from __future__ import annotations

import sys
import types
from collections import defaultdict

import numba
import numpy as np

THREADS = 4  # what numba.get_num_threads() returns during the recorded run


class _Recorder:
    def __init__(self):
        self.loop = None  # (line of the prange loop, iteration, thread) while inside one
        self.writes = defaultdict(dict)  # (line, address) -> {thread: an iteration of it}
        self.reads = defaultdict(dict)
        self.described = {}  # (line, address) -> "element [i] of a (shape) dtype array"

    def note(self, array, key, table):
        if self.loop is None:
            return
        line, iteration, thread = self.loop
        plain = array.view(np.ndarray)
        for address, where in _addresses(plain, key):
            table[(line, address)].setdefault(thread, iteration)
            self.described.setdefault((line, address), f"element {where} of a {plain.shape} {plain.dtype} array")


_RECORDER: _Recorder | None = None


def _addresses(plain: np.ndarray, key):
    base = plain.__array_interface__["data"][0]
    index = key if isinstance(key, tuple) else (key,)
    if len(index) == plain.ndim and all(isinstance(i, (int, np.integer)) for i in index):
        idx = [int(i) + (n if int(i) < 0 else 0) for i, n in zip(index, plain.shape)]
        return [(base + sum(i * s for i, s in zip(idx, plain.strides)), list(idx))]
    grid = np.indices(plain.shape).reshape(plain.ndim, -1).T
    offsets = grid @ np.asarray(plain.strides) + base if plain.ndim else np.array([base])
    chosen = np.arange(plain.size).reshape(plain.shape)[key]
    return [(int(offsets[f]), grid[f].tolist()) for f in np.atleast_1d(chosen).ravel()]


class RecordingArray(np.ndarray):
    """An ndarray whose element reads and writes inside a prange loop are recorded."""

    def __getitem__(self, key):
        if _RECORDER is not None:
            _RECORDER.note(self, key, _RECORDER.reads)
        return super().__getitem__(key)

    def __setitem__(self, key, value):
        if _RECORDER is not None:
            _RECORDER.note(self, key, _RECORDER.writes)
        super().__setitem__(key, value)


def _recording_prange(*args):
    loop_range = range(*args)
    if _RECORDER is None or _RECORDER.loop is not None:
        return loop_range  # nested prange: serial inside the outer parallel loop
    caller = sys._getframe(1)
    line = f"{caller.f_code.co_filename.rsplit('/', 1)[-1]}:{caller.f_lineno}"

    def iterations():
        try:
            for k, i in enumerate(loop_range):
                _RECORDER.loop = (line, i, k * THREADS // len(loop_range))
                yield i
        finally:
            _RECORDER.loop = None
    return iterations()


def _recording(fn):
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        return out.view(RecordingArray) if isinstance(out, np.ndarray) else out
    return wrapped


_CONSTRUCTORS = ("zeros", "ones", "empty", "full", "zeros_like", "ones_like", "empty_like", "full_like",
                 "array", "asarray", "copy", "arange")


def _numpy_proxy() -> types.ModuleType:
    proxy = types.ModuleType("numpy")
    proxy.__dict__.update({k: v for k, v in vars(np).items() if not k.startswith("__")})
    for name in _CONSTRUCTORS:
        setattr(proxy, name, _recording(getattr(np, name)))
    return proxy


def _numba_proxy() -> types.ModuleType:
    proxy = types.ModuleType("numba")
    proxy.__dict__.update({k: v for k, v in vars(numba).items() if not k.startswith("__")})
    proxy.prange = _recording_prange
    proxy.get_num_threads = lambda: THREADS
    proxy.get_thread_id = _thread_id
    return proxy


def _thread_id() -> int:
    return _RECORDER.loop[2] if _RECORDER is not None and _RECORDER.loop is not None else 0


def find_races(fn, *args) -> list[str]:
    """Run ``fn`` (an ``@njit(parallel=True)`` function, or a plain one) in
    recording mode on ``args`` and describe every race found (empty: none).

    Use small inputs: every element access goes through Python.
    """
    global _RECORDER
    py_func = getattr(fn, "py_func", fn)
    replacements = {np: _numpy_proxy(), numba: _numba_proxy(), numba.prange: _recording_prange,
                    numba.get_num_threads: (lambda: THREADS), numba.get_thread_id: _thread_id}
    namespace = {k: replacements.get(v, v) if _hashable(v) else v for k, v in py_func.__globals__.items()}
    recorded = types.FunctionType(py_func.__code__, namespace, py_func.__name__, py_func.__defaults__,
                                  py_func.__closure__)
    args = [a.copy().view(RecordingArray) if isinstance(a, np.ndarray) else a for a in args]
    _RECORDER = recorder = _Recorder()
    try:
        recorded(*args)
    finally:
        _RECORDER = None
    races = []
    for key, writers in recorder.writes.items():
        line, what = key[0], recorder.described[key]
        readers = {t: i for t, i in recorder.reads.get(key, {}).items() if t not in writers}
        if len(writers) > 1:
            (t1, i1), (t2, i2) = sorted(writers.items())[:2]
            races.append(f"{line}: iterations {i1} and {i2} of the prange loop (threads {t1} and {t2}) "
                         f"both write {what}")
        elif readers:
            (tw, iw), (tr, ir) = next(iter(writers.items())), min(readers.items())
            races.append(f"{line}: iteration {iw} of the prange loop (thread {tw}) writes {what} "
                         f"that iteration {ir} (thread {tr}) reads")
    return races


def _hashable(value) -> bool:
    try:
        hash(value)
        return True
    except TypeError:
        return False
