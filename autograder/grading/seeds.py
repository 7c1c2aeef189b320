"""The inputs that award points are drawn per grading, from a seed student code never sees.

``draw()`` gives each grading a fresh secret (``K2C_GRADING_SEED`` sets it, for an
instructor who regrades to reproduce a grading: every report records its seed).
Checks derive each graded case's values from it and the case's name with
``rng(seed, *names)``, in the grader: what reaches the sandbox is one rank's part
of one case at a time, never the seed. Fixed public cases, for feedback and for
reproducing a failure by hand, keep their documented seeds.
"""
from __future__ import annotations

import hashlib
import os
import secrets

import numpy as np

ENV = "K2C_GRADING_SEED"


def draw() -> int:
    """This grading's secret seed (``K2C_GRADING_SEED``, when set, reproduces an earlier one)."""
    given = os.environ.get(ENV, "").strip()
    if given:
        try:
            return int(given)
        except ValueError:
            raise ValueError(f"{ENV}={given!r}: a grading's seed is a whole number (a report's 'seed')") from None
    return secrets.randbits(63)


def _word(name) -> int:
    if isinstance(name, (int, np.integer)) and name >= 0:
        return int(name)
    return int.from_bytes(hashlib.sha256(repr(name).encode()).digest()[:8], "little")


def rng(seed: int, *names) -> np.random.Generator:
    """The generator of one graded case: ``seed`` with the case's names (strings, numbers),
    so that two cases never share values and one case's values do not depend on which
    other checks a grading runs."""
    return np.random.default_rng([seed, *(_word(n) for n in names)])
