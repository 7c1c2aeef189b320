"""What checks use to compare a submission's answer with an oracle's, and to
prepare inputs that make mistakes visible."""
from __future__ import annotations

import inspect
import re

import numpy as np

POISON = np.nan  # float outputs start as NaN: an element nobody wrote stays NaN
INT_POISON = -(2**31) + 7


def poisoned(shape, dtype=np.float32) -> np.ndarray:
    """An output buffer filled with a value no correct kernel writes."""
    dtype = np.dtype(dtype)
    fill = POISON if dtype.kind == "f" else INT_POISON
    return np.full(shape, fill, dtype=dtype)


def by_tier(tier: str, cpu, gpu):
    """Size for this tier: small for the simulator, device-filling on a GPU."""
    return gpu if tier == "gpu" else cpu


def _index(flat: int, shape) -> str:
    idx = np.unravel_index(flat, shape)
    return "[" + ", ".join(str(int(i)) for i in idx) + "]"


def expect_array(got, want, what: str = "result", rtol: float = 1e-6, atol: float = 0.0,
                 exact: bool = False) -> None:
    """Assert ``got`` equals ``want``; the message says which element first differs and how."""
    want = np.asarray(want)
    if got is None:
        raise AssertionError(f"{what}: got None (did the function forget to return?)")
    got = np.asarray(got)
    if got.shape != want.shape:
        raise AssertionError(f"{what}: expected shape {want.shape}, got {got.shape}")
    if got.dtype.kind in "OUSV":
        raise AssertionError(f"{what}: expected numbers, got an array of {got.dtype}")
    if exact:
        bad = got != want
    else:
        bad = ~np.isclose(got, want, rtol=rtol, atol=atol, equal_nan=False)
    if not bad.any():
        return
    flat = bad.ravel()
    first = int(np.argmax(flat))
    g, w = got.ravel()[first], want.ravel()[first]
    unwritten = int(np.isnan(got).sum()) if got.dtype.kind == "f" else int((got == INT_POISON).sum())
    msg = (f"{what}{_index(first, want.shape)}: expected {w!r}, got {g!r}; "
           f"{int(flat.sum())} of {flat.size} elements differ")
    if unwritten:
        msg += f" ({unwritten} never written: the poison value is still there)"
    raise AssertionError(msg)


def expect_close(got, want, what: str, rel: float) -> None:
    """Assert a scalar is within a relative tolerance."""
    if got is None:
        raise AssertionError(f"{what}: got None (did the function forget to return?)")
    got = float(got)
    if not abs(got - want) <= rel * abs(want):
        raise AssertionError(f"{what}: expected {want:.6g} (±{rel:.0%}), got {got:.6g}")


def unstubbed(kernel):
    """Return a student's ``@cuda.jit`` kernel, or raise NotImplementedError if it is
    still the starter's stub. A kernel cannot raise on a real GPU, so the stub is
    found in its source before it is launched."""
    source = inspect.getsource(getattr(kernel, "py_func", None) or getattr(kernel, "fn", kernel))
    stub = re.search(r"raise NotImplementedError\((['\"])(.*?)\1\)", source)
    if stub:
        raise NotImplementedError(stub.group(2))
    return kernel
