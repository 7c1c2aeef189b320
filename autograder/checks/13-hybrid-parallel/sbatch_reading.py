"""How sbatch and srun read their options (``check_cluster.py`` reads the student's scripts
with it): ``#SBATCH`` lines only before the first command; ``--opt=value``, ``--opt value``,
``-N2``; sbatch's time formats.
"""
import re
import shlex


SHORT = {"J": "job-name", "N": "nodes", "n": "ntasks", "t": "time", "p": "partition", "o": "output",
         "e": "error", "c": "cpus-per-task", "G": "gpus", "O": "overcommit", "A": "account", "q": "qos",
         "l": "label", "u": "unbuffered", "K": "kill-on-bad-exit", "v": "verbose", "Q": "quiet"}
FLAGS = {"overcommit", "exclusive", "label", "unbuffered", "kill-on-bad-exit", "verbose", "quiet", "requeue",
         "no-requeue", "wait", "standalone", "no-python", "module", "run-path", "contiguous", "spread-job"}


def parse_options(words):
    """{option: value} (``True`` for a flag) of words like ``--nodes=2 --time 10 -N2 -O``, long names,
    ``_`` read as ``-``; and the words that are not options."""
    options, other, i = {}, [], 0
    while i < len(words):
        word = words[i]
        if word.startswith("--") and len(word) > 2:
            name, eq, value = word[2:].partition("=")
            name = name.replace("_", "-")
            if eq:
                options[name] = value
            elif name in FLAGS or i + 1 == len(words):
                options[name] = True
            else:
                options[name] = words[i + 1]
                i += 1
        elif word.startswith("-") and len(word) > 1 and word[1] in SHORT:
            name = SHORT[word[1]]
            if name in FLAGS:
                options[name] = True
            elif len(word) > 2:
                options[name] = word[2:].lstrip("=")
            elif i + 1 < len(words):
                options[name] = words[i + 1]
                i += 1
        else:
            other.append(word)
        i += 1
    return options, other


def directives(text):
    """(#SBATCH options, problems): the options sbatch reads, i.e. the ``#SBATCH`` lines before the
    first command; problems name ``#SBATCH`` lines after it (sbatch ignores them) and a missing shebang."""
    problems, words, commands = [], [], False
    lines = text.splitlines()
    if not lines or not lines[0].startswith("#!") or "bash" not in lines[0]:
        problems.append(f"the first line should be a bash shebang (#!/bin/bash), not {lines[0] if lines else ''!r}")
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("#SBATCH"):
            if commands:
                problems.append(f"line {number} ({stripped!r}) comes after a command: sbatch ignores it")
                continue
            try:
                words += shlex.split(stripped[len("#SBATCH"):], comments=True)
            except ValueError as exc:
                problems.append(f"line {number} ({stripped!r}): {exc}")
        elif stripped and not stripped.startswith("#"):
            commands = True
    options, stray = parse_options(words)
    if stray:
        problems.append(f"#SBATCH words that are not options: {stray}")
    return options, problems


def seconds(limit):
    """sbatch's --time in seconds: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S; None when it is none of them."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", str(limit))
    if not m:
        return None
    days, *parts = m.groups()
    parts = [int(p) for p in parts if p is not None]
    if days is not None:  # D-H, D-H:M, D-H:M:S
        parts += [0] * (3 - len(parts))
        return int(days) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return parts[0] * 3600 + parts[1] * 60 + parts[2]


def whole(value):
    return int(value) if isinstance(value, str) and value.isdigit() else None
