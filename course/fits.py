"""Numbers a measurement is reduced to, shared by lectures and checks.

``ring_allreduce_fit`` fits the α–β model of a ring all-reduce,
``2(p − 1)(α + β n / p)`` seconds for ``n`` bytes over ``p`` processes (module
06), to measured times; ``spearman`` says how well two lists agree in order
(lab 13's check of a cost model against measured step times, and lecture 13).
"""
import math


def ring_allreduce_fit(samples):
    """``(α, β)`` fitted to ``[(p, nbytes, seconds), ...]`` by least squares on the
    relative error (every time weighted by its inverse, so small messages count as
    much as large ones). When noise drives one below zero the other is fitted
    alone; α is at least 1 ns and β at least 1e-12 s per byte."""
    import numpy as np

    a = np.array([[2 * (p - 1), 2 * (p - 1) / p * n] for p, n, _ in samples], dtype=float)
    t = np.array([s for _, _, s in samples], dtype=float)
    scaled, ones = a / t[:, None], np.ones_like(t)
    alpha, beta = np.linalg.lstsq(scaled, ones, rcond=None)[0]
    if beta <= 0:  # noise hid the bandwidth term: latency alone
        alpha, beta = np.linalg.lstsq(scaled[:, :1], ones, rcond=None)[0][0], 0.0
    elif alpha <= 0:  # or the latency term: bandwidth alone
        alpha, beta = 0.0, np.linalg.lstsq(scaled[:, 1:], ones, rcond=None)[0][0]
    return max(float(alpha), 1e-9), max(float(beta), 1e-12)


def ranks(values):
    """Ranks 1..n of ``values``, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    found = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            found[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return found


def spearman(x, y):
    """Spearman's rank correlation (Pearson's correlation of the ranks); nan when either is constant."""
    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx and syy else float("nan")
