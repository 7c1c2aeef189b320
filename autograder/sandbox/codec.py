"""Plain data between the grader and a sandboxed child, never pickle.

Unpickling what an untrusted process wrote would let it run code in the grader.
Instead a message is a JSON header plus NumPy arrays saved with
``allow_pickle=False``: None, bool, int, float, str, list, tuple, dict with
str keys, and numeric arrays. Anything else is refused on the way out.
"""
from __future__ import annotations

import io
import json
import struct

import numpy as np

_HEADER = struct.Struct("<Q")


class CodecError(ValueError):
    pass


def _pack(obj, arrays: list):
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, np.generic):
        return _pack(obj.item(), arrays)
    if hasattr(obj, "copy_to_host"):  # a numba device array
        obj = obj.copy_to_host()
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise CodecError("arrays of Python objects cannot be sent back to the grader")
        arrays.append(obj)
        return {"__ndarray__": len(arrays) - 1}
    if isinstance(obj, tuple):
        return {"__tuple__": [_pack(v, arrays) for v in obj]}
    if isinstance(obj, list):
        return [_pack(v, arrays) for v in obj]
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise CodecError("only dicts with str keys can be sent back to the grader")
        return {"__dict__": {k: _pack(v, arrays) for k, v in obj.items()}}
    raise CodecError(f"a {type(obj).__name__} cannot be sent back to the grader "
                     "(return numbers, strings, lists, tuples, dicts or NumPy arrays)")


def _unpack(obj, arrays: list):
    if isinstance(obj, list):
        return [_unpack(v, arrays) for v in obj]
    if isinstance(obj, dict):
        if "__ndarray__" in obj:
            return arrays[obj["__ndarray__"]]
        if "__tuple__" in obj:
            return tuple(_unpack(v, arrays) for v in obj["__tuple__"])
        if "__dict__" in obj:
            return {k: _unpack(v, arrays) for k, v in obj["__dict__"].items()}
        raise CodecError("malformed message")
    return obj


def encode(obj) -> bytes:
    arrays: list = []
    header = json.dumps(_pack(obj, arrays)).encode()
    out = io.BytesIO()
    out.write(_HEADER.pack(len(header)))
    out.write(header)
    out.write(_HEADER.pack(len(arrays)))
    for a in arrays:
        np.save(out, np.require(a, requirements="C"), allow_pickle=False)  # a 0-d array stays 0-d
    return out.getvalue()


def decode(data: bytes):
    try:
        buf = io.BytesIO(data)
        (n,) = _HEADER.unpack(buf.read(_HEADER.size))
        header = json.loads(buf.read(n))
        (count,) = _HEADER.unpack(buf.read(_HEADER.size))
        arrays = [np.load(buf, allow_pickle=False) for _ in range(count)]
        return _unpack(header, arrays)
    except CodecError:
        raise
    except Exception as exc:  # truncated or forged bytes
        raise CodecError(f"unreadable message: {exc}") from None
