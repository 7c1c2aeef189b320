"""Lab 12's hidden oracle: the zigzag layout, computed for any sequence and rank
count. It is what ``zigzag_indices`` returns, so only the hidden check
(``check_context_parallel_hidden.py``) uses it and ``k2c release`` leaves it out
(lab.toml's ``hidden``); the public checks use the table ``oracles.ZIGZAG``,
which tests/test_12_context_parallel.py holds to it.
"""


def zigzag(seq_len, P):
    """Rank r's positions: chunks r and 2P-1-r of 2P."""
    chunk = seq_len // (2 * P)
    return [list(range(r * chunk, (r + 1) * chunk)) + list(range((2 * P - 1 - r) * chunk, (2 * P - r) * chunk))
            for r in range(P)]
