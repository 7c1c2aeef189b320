"""One small stream API with two backends: CuPy on a GPU, a recording stand-in on the CPU.

Overlapping copies with compute is about *when* work is issued and *what waits
for what*. On a GPU that means streams, events and page-locked (pinned) host
buffers; on a laptop there is nothing to overlap. Code written against the few
operations below runs unchanged on both::

    gpu = streams.backend()                     # CupyStreams or RecordingStreams
    s = gpu.stream()
    staged = gpu.pinned_empty(shape, dtype)     # page-locked host buffer
    staged[...] = host_chunk
    d_x = gpu.to_device(staged, s)              # asynchronous H->D copy on s
    d_y = gpu.launch(f, d_x, stream=s)          # f(d_x) runs on s
    gpu.to_host(d_y, out, s)                    # asynchronous D->H copy into pinned `out`
    e = gpu.event_record(s)                     # marks "everything issued on s so far"
    gpu.wait_event(other, e)                    # work issued on `other` from now on waits for e
    gpu.synchronize(s)                          # the host waits for s (None: for everything)

:class:`RecordingStreams` runs every operation at once with NumPy, so results
are real, and writes it down, in issue order, as an :class:`Op`. It keeps CUDA's
rules: operations on one stream run in order; a copy to or from a pageable
(not pinned) host buffer blocks the host until it is done; the bytes of a D->H
copy are in the host buffer only once the host has waited for that copy. Its
device arrays are :class:`DeviceArray` objects, not NumPy arrays: ``f`` computes
on them with NumPy functions and operators, as it would with CuPy's, but the
host cannot read them, so a result reaches the host only by ``to_host``. It
records as a *hazard* a device array used on a stream that is not ordered
after the operation that produced it, a host array passed where a device
array belongs, and a pinned source buffer that the host overwrote before it
knew the H->D copy from it had finished.

:func:`timeline` replays a log on a model GPU -- one H->D copy engine, one D->H
copy engine (or one shared copy engine), one compute engine, each taking work
in issue order, and a cost per byte -- and returns when each operation ran.
Whatever the code looks like, a schedule that waits after every chunk or uses
one stream gets the serial makespan from it, and pageable buffers stall the
host in every copy.
"""
from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from course.arrays import array_module

ENGINE_OPS = ("h2d", "compute", "d2h")


def backend():
    """:class:`CupyStreams` when this tier's array module is CuPy, else a :class:`RecordingStreams`."""
    return CupyStreams() if array_module().__name__ == "cupy" else RecordingStreams()


# --- The real thing: CuPy ----------------------------------------------------

class CupyStreams:
    """The operations on a CUDA device, with CuPy (``pip install 'k2c[gpu]'``)."""

    def __init__(self, cp=None, cpx=None):
        """``cp``, ``cpx``: CuPy and cupyx, or their stand-ins (``course.gpu_stand_in``)."""
        if cp is None:
            import cupy as cp
        if cpx is None:
            import cupyx as cpx

        self._cp, self._cpx = cp, cpx

    def stream(self):
        # non_blocking: no implicit synchronization with the legacy default stream
        return self._cp.cuda.Stream(non_blocking=True)

    def pinned_empty(self, shape, dtype):
        return self._cpx.empty_pinned(shape, dtype)

    def to_device(self, host, stream):
        with stream:  # the memory pool hands out blocks per stream
            device = self._cp.empty(host.shape, host.dtype)
        device.set(host, stream=stream)  # asynchronous when `host` is pinned
        return device

    def launch(self, f, *device_args, stream):
        with stream:  # every kernel f launches goes to `stream`
            return f(*device_args)

    def to_host(self, device, out, stream):
        try:
            self._cp.asnumpy(device, stream=stream, out=out, blocking=False)
        except TypeError:  # CuPy before `blocking`: a copy given a stream is already asynchronous
            self._cp.asnumpy(device, stream=stream, out=out)
        return out

    def event_record(self, stream):
        event = self._cp.cuda.Event(disable_timing=True)
        event.record(stream)
        return event

    def wait_event(self, stream, event):
        stream.wait_event(event)

    def synchronize(self, stream=None):
        if stream is None:
            self._cp.cuda.Device().synchronize()
        else:
            stream.synchronize()


# --- The stand-in: record, execute with NumPy, replay on a model -------------

@dataclass(frozen=True)
class Op:
    """One operation as the host issued it."""
    index: int  # issue order, from 0
    kind: str  # h2d, compute, d2h, event, wait, sync
    stream: int | None  # None: a synchronize of the whole device
    chunk: int | None = None  # data lineage: the number of the H->D copy the data came from
    engine: str | None = None  # h2d, d2h or copy, compute; None for event, wait, sync
    seconds: float = 0.0  # time on its engine, from the cost model
    pinned: bool | None = None  # copies: was the host buffer page-locked?
    after: tuple[int, ...] = ()  # ops this one must follow on the device
    host_waits_for: tuple[int, ...] = ()  # ops the host first waited for here


@dataclass(frozen=True)
class Span:
    """When an engine ran one operation, in model seconds."""
    op: int
    kind: str
    engine: str
    stream: int
    chunk: int | None
    start: float
    end: float


@dataclass(frozen=True)
class RecordedStream:
    id: int


_UNREADABLE = ("the host cannot read a device array: copy it into a host buffer with gpu.to_host(d, out, stream) "
               "and wait for that copy (CuPy, too, refuses to turn a device array into a NumPy one implicitly)")


class DeviceArray(NDArrayOperatorsMixin):
    """An array in the model GPU's memory, as :class:`RecordingStreams` makes them.

    NumPy functions, ufuncs, operators, indexing and the usual reductions work
    on it and give device arrays, so ``f`` written with the array module of its
    argument runs unchanged. What would read its values on the host does not
    (``np.asarray``, ``float``, ``bool``, ``tolist``...): on a GPU that is a
    device-to-host copy, which the model must see, so it goes through
    ``to_host``. Mixing it with a host array raises too, as it does in CuPy.
    """

    __slots__ = ("_data", "__weakref__")
    _ATTRIBUTES = frozenset({"shape", "dtype", "ndim", "size", "nbytes", "itemsize", "strides"})
    _METHODS = frozenset({"sum", "prod", "mean", "std", "var", "max", "min", "argmax", "argmin", "cumsum",
                          "cumprod", "all", "any", "astype", "reshape", "ravel", "flatten", "transpose",
                          "swapaxes", "squeeze", "copy", "clip", "round", "conj", "dot", "fill", "view"})

    def __init__(self, data: np.ndarray):
        self._data = data

    def __getattr__(self, name):
        if name in DeviceArray._ATTRIBUTES:
            return getattr(self._data, name)
        if name in DeviceArray._METHODS:
            method = getattr(self._data, name)
            return lambda *args, **kwargs: _on_device(method(*_unwrap(args), **_unwrap(kwargs)))
        raise AttributeError(f"the recording stand-in's device arrays have no {name!r}" +
                             ("" if name.startswith("__") else f" (if it reads values: {_UNREADABLE})"))

    @property
    def T(self):
        return DeviceArray(self._data.T)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        result = getattr(ufunc, method)(*_unwrap(inputs), **_unwrap(kwargs))
        out = kwargs.get("out")  # NumPy hands it over as a tuple
        if out is None:
            return _on_device(result)
        return out[0] if len(out) == 1 else out  # written in place: the device arrays given

    def __array_function__(self, func, types, args, kwargs):
        return _on_device(func(*_unwrap(args), **_unwrap(kwargs)))

    def __array__(self, dtype=None, copy=None):
        raise TypeError(_UNREADABLE)

    def _refuse(self, *args):
        raise TypeError(_UNREADABLE)

    __bool__ = __float__ = __int__ = __complex__ = __index__ = _refuse

    def __getitem__(self, key):
        key = _unwrap(key)
        view = self._data[key]
        if not isinstance(view, np.ndarray):  # one element: a 0-d view, as CuPy gives, not a host scalar
            view = self._data[(*key, Ellipsis) if isinstance(key, tuple) else (key, Ellipsis)]
        return DeviceArray(view)

    def __setitem__(self, key, value):
        self._data[_unwrap(key)] = _unwrap(value)

    def __len__(self):
        return len(self._data)

    def __iter__(self):
        return (self[i] for i in range(len(self._data)))

    def __repr__(self):
        return f"DeviceArray(shape={self._data.shape}, dtype={self._data.dtype}) on the model GPU"


def _unwrap(value):
    """Device arrays as their data, in arguments and containers; host arrays refused."""
    if isinstance(value, DeviceArray):
        return value._data
    if isinstance(value, np.ndarray) and value.ndim > 0:
        raise TypeError("a host array (NumPy) used with a device array: copy it to the device first "
                        "(CuPy refuses to mix them too)")
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v) for v in value)
    if isinstance(value, dict):
        return {k: _unwrap(v) for k, v in value.items()}
    return value


def _on_device(value):
    """What a computation on device arrays gives: arrays and numbers stay on the device
    (Python ints, which are mostly shapes and sizes, and everything else pass through)."""
    if isinstance(value, np.ndarray):
        return DeviceArray(value)
    if isinstance(value, (np.generic, bool, float, complex)):
        return DeviceArray(np.asarray(value))
    if isinstance(value, (list, tuple)):
        return type(value)(_on_device(v) for v in value)
    return value


class RecordingStreams:
    """Executes eagerly with NumPy and records the schedule; see the module docstring.

    Costs are seconds per byte: a copy costs its bytes, a launch the bytes of its
    device arguments. ``copy_engines=1`` makes H->D and D->H copies share one
    engine, as on GPUs with a single copy engine. The defaults (25 GB/s
    for everything) are round numbers for pictures, not measurements.
    """

    def __init__(self, h2d_s_per_byte=1 / 25e9, d2h_s_per_byte=1 / 25e9,
                 compute_s_per_byte=1 / 25e9, copy_engines=2):
        self.cost = {"h2d": h2d_s_per_byte, "d2h": d2h_s_per_byte, "compute": compute_s_per_byte}
        self.copy_engines = copy_engines
        self.log: list[Op] = []
        self.hazards: list[str] = []
        self._streams = 0
        self._tail: dict[int, int] = {}  # stream -> its last device-side op
        self._waited: set[int] = set()  # ops the host has waited for
        self._pinned: dict[int, weakref.ref] = {}  # id -> page-locked buffer (not kept alive)
        self._made_by: dict[int, tuple[int, np.ndarray]] = {}  # id(device array) -> (op, array)
        self._landing: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # D->H op -> (out, bytes)
        self._sources: dict[int, tuple] = {}  # H->D op -> (pinned buffer, view of it, snapshot)
        self._copies_in = 0

    # The stream API.
    def stream(self):
        self._streams += 1
        return RecordedStream(self._streams)

    def pinned_empty(self, shape, dtype):
        buf = np.empty(shape, dtype)
        if buf.dtype.kind in "fc":
            buf.fill(np.nan)  # what arrives from the device is real; what did not stays NaN
        else:
            buf.view(np.uint8).fill(0xAB)
        self._pinned[id(buf)] = weakref.ref(buf)
        return buf

    def to_device(self, host, stream):
        host = self._host_array(host, "to_device")
        root = self._pinned_root(host)
        op = self._issue("h2d", stream, chunk=self._copies_in, nbytes=host.nbytes, pinned=root is not None)
        self._copies_in += 1
        if root is not None:  # watch the buffer until the host knows the copy is done
            view = (host.ctypes.data - root.ctypes.data, host.shape, host.strides, host.dtype)
            self._sources[op.index] = (weakref.ref(root), view, host.copy())
        return self._produced(op, DeviceArray(host.copy()))

    def launch(self, f, *device_args, stream):
        chunks = [self._consume(a, stream, "compute") for a in device_args]
        op = self._issue("compute", stream, chunk=next((c for c in chunks if c is not None), None),
                         nbytes=sum(a.nbytes for a in device_args if isinstance(a, (np.ndarray, DeviceArray))))
        result = f(*device_args)
        # What f returns lives on the device, even an array it made with plain NumPy.
        made = tuple(self._produced(op, DeviceArray(r) if isinstance(r, np.ndarray) else r)
                     for r in (result if isinstance(result, tuple) else (result,)))
        return made if isinstance(result, tuple) else made[0]

    def to_host(self, device, out, stream):
        out = self._host_array(out, "to_host")
        if not isinstance(device, (DeviceArray, np.ndarray)):
            raise TypeError(f"to_host takes a device array, got {type(device).__name__}")
        if out.shape != device.shape or out.dtype != device.dtype:
            raise ValueError(f"to_host: out has shape {out.shape} and dtype {out.dtype}, "
                             f"the device array {device.shape} and {device.dtype}")
        chunk = self._consume(device, stream, "d2h")
        pinned = self._pinned_root(out) is not None
        op = self._issue("d2h", stream, chunk=chunk, nbytes=device.nbytes, pinned=pinned)
        data = device._data if isinstance(device, DeviceArray) else device
        self._landing[op.index] = (out, data.copy())
        self._land(op.host_waits_for)  # a pageable copy has already finished
        return out

    def event_record(self, stream):
        return self._issue("event", stream).index

    def wait_event(self, stream, event):
        if not (isinstance(event, int) and 0 <= event < len(self.log) and self.log[event].kind == "event"):
            raise TypeError(f"expected an event from event_record(), got {event!r}")
        self._issue("wait", stream, also_after=(event,))

    def synchronize(self, stream=None):
        if stream is not None:
            self._stream_id(stream)
        targets = list(self._tail.values()) if stream is None else [self._tail.get(stream.id)]
        op = Op(len(self.log), "sync", None if stream is None else stream.id,
                host_waits_for=self._wait_for([t for t in targets if t is not None]))
        self.log.append(op)
        self._land(op.host_waits_for)

    # What the record says.
    def unwaited(self) -> list[Op]:
        """Device-side operations the host never waited for (their results may not exist yet)."""
        return [op for op in self.log if op.kind in ENGINE_OPS and op.index not in self._waited]

    def report(self) -> dict:
        """Everything recorded, as plain data: ops, spans, makespan, hazards."""
        spans = timeline(self.log)
        late = [f"{op.kind} of chunk {op.chunk} on stream {op.stream} was never waited for by the host "
                "(call synchronize before using results)" for op in self.unwaited()]
        return {"ops": [asdict(op) for op in self.log], "spans": [asdict(s) for s in spans],
                "makespan": makespan(spans), "hazards": self.hazards + late,
                "copy_issued_before_wait": copy_issued_before_wait(self.log),
                "streams_used": len({op.stream for op in self.log if op.kind in ENGINE_OPS}),
                "pageable_copies": sum(1 for op in self.log if op.pinned is False)}

    # Bookkeeping.
    def _stream_id(self, stream) -> int:
        if not isinstance(stream, RecordedStream):
            raise TypeError(f"expected a stream from stream(), got {stream!r}")
        return stream.id

    def _issue(self, kind, stream, chunk=None, nbytes=0, pinned=None, also_after=()):
        sid = self._stream_id(stream)
        index = len(self.log)
        engine = None
        if kind in ENGINE_OPS:
            engine = "copy" if kind != "compute" and self.copy_engines == 1 else kind
        previous = (self._tail[sid],) if sid in self._tail else ()
        # A copy to or from pageable memory returns only once it is done: the host waits.
        blocking = self._wait_for([index], issuing=previous + tuple(also_after)) if pinned is False else ()
        op = Op(index, kind, sid, chunk, engine, nbytes * self.cost.get(kind, 0.0), pinned,
                previous + tuple(also_after), blocking)
        self.log.append(op)
        self._tail[sid] = index
        self._land(blocking)
        return op

    def _wait_for(self, targets, issuing=()) -> tuple[int, ...]:
        """The host waits for ``targets`` and all they follow; return the ops newly waited for.
        ``issuing`` holds what an op not yet in the log will follow."""
        todo = [t for t in targets if t < len(self.log)] + list(issuing)
        new = set(t for t in targets if t >= len(self.log))
        while todo:
            i = todo.pop()
            if i in self._waited or i in new:
                continue
            new.add(i)
            todo.extend(self.log[i].after)
        self._waited |= new
        self._check_sources(new)
        return tuple(sorted(new))

    def _follows(self, stream_id, producer) -> bool:
        """Is work issued now on ``stream_id`` ordered after op ``producer``?"""
        if producer in self._waited:
            return True
        todo, seen = [self._tail[stream_id]] if stream_id in self._tail else [], set()
        while todo:
            i = todo.pop()
            if i == producer:
                return True
            if i not in seen:
                seen.add(i)
                todo.extend(self.log[i].after)
        return False

    def _produced(self, op, array):
        if isinstance(array, DeviceArray):
            self._made_by[id(array._data)] = (op.index, array._data)
        return array

    def _consume(self, array, stream, what):
        if not isinstance(array, (np.ndarray, DeviceArray)):
            return None  # a scalar argument
        producer = self._producer(array)
        if producer is None:
            self.hazards.append(
                f"{what} on stream {stream.id} was given a host array, not a device array from to_device or launch"
                if isinstance(array, np.ndarray) else
                f"{what} on stream {stream.id} was given a device array that no recorded operation made "
                "(device work outside gpu.launch runs on no stream the model sees: do it inside f)")
            return None
        if not self._follows(self._stream_id(stream), producer.index):
            self.hazards.append(
                f"{what} on stream {stream.id} reads the result of {producer.kind} of chunk {producer.chunk} "
                f"on stream {producer.stream} without being ordered after it (same stream, or wait_event "
                "on an event recorded after it)")
        return producer.chunk

    def _producer(self, array):
        """The op that made this device array (or the array it is a view of), or None.
        A host array has none."""
        if not isinstance(array, DeviceArray):
            return None
        array = array._data
        while isinstance(array, np.ndarray):
            found = self._made_by.get(id(array))
            if found is not None and found[1] is array:
                return self.log[found[0]]
            array = array.base
        return None

    def _land(self, ops):
        for i in ops:
            if i in self._landing:
                out, data = self._landing.pop(i)
                out[...] = data

    def _check_sources(self, ops):
        for i in sorted(ops):
            if i not in self._sources:
                continue
            root, (offset, shape, strides, dtype), snapshot = self._sources.pop(i)
            root = root()
            what = f"the pinned buffer that h2d of chunk {self.log[i].chunk} copies from was"
            if root is None:
                self.hazards.append(f"{what} released before the host knew that copy had finished "
                                    "(keep a reference to it until you have waited)")
                continue
            host = np.ndarray(shape, dtype, buffer=root, offset=offset, strides=strides)
            if not np.array_equal(host, snapshot, equal_nan=dtype.kind in "fc"):
                self.hazards.append(f"{what} overwritten before the host knew that copy had finished")

    def _host_array(self, a, what):
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{what} takes a NumPy host array, got {type(a).__name__}")
        return a

    def _pinned_root(self, a):
        """The page-locked buffer that ``a`` is, or is a view of; None for pageable memory."""
        while isinstance(a, np.ndarray):
            ref = self._pinned.get(id(a))
            if ref is not None and ref() is a:
                return a
            a = a.base
        return None


def timeline(log: list[Op]) -> list[Span]:
    """Replay a log on the model GPU: when each engine ran each operation.

    An operation starts when the host has issued it, everything it follows on
    the device has finished, and its engine is free; engines take work in
    issue order. The host stops issuing at each wait until what it waits for
    has finished.
    """
    host, done, engine_free, spans = 0.0, {}, {}, []
    for op in log:
        ready = max([host] + [done[i] for i in op.after])
        if op.engine is not None:
            start = max(ready, engine_free.get(op.engine, 0.0))
            done[op.index] = engine_free[op.engine] = start + op.seconds
            spans.append(Span(op.index, op.kind, op.engine, op.stream, op.chunk, start, start + op.seconds))
        elif op.kind in ("event", "wait"):
            done[op.index] = ready
        if op.host_waits_for:
            host = max([host] + [done[i] for i in op.host_waits_for])
    return spans


def makespan(spans: list[Span]) -> float:
    """From the first operation's start to the last one's end."""
    return max((s.end for s in spans), default=0.0)


def copy_issued_before_wait(log: list[Op]) -> list[bool]:
    """For each chunk i but the last: was the H->D copy of chunk i+1 issued before
    the host first waited for the compute of chunk i? All True is what a pipeline does."""
    h2d = {op.chunk: op.index for op in log if op.kind == "h2d"}
    compute = {op.chunk: op.index for op in log if op.kind == "compute"}
    first_wait = {}
    for op in log:
        for i in op.host_waits_for:
            first_wait.setdefault(i, op.index)
    answers = []
    for chunk in range(len(h2d) - 1):
        waited_at = first_wait.get(compute.get(chunk), len(log))
        answers.append(h2d.get(chunk + 1, len(log)) < waited_at)
    return answers
