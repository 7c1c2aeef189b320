"""How much of each reference answer a student already receives: token 5-gram overlap.

A solution region (the code between ``# BEGIN SOLUTION`` and ``# END SOLUTION``,
comments left out, and less what its lab's starter gives on purpose) is cut into tokens: names, numbers and operators, so that
spacing, line breaks and quoting do not matter. Its *share* in a text is the
fraction of its 5-token windows that also occur somewhere in that text. A
released file is read whole, strings, comments and a notebook's markdown
included, since a hint, a handout or a lecture's prose can spell code out as
well as a helper module can.

``k2c release`` reports the largest shares and refuses above ``MAX_SHARE``; the
project's tests hold the release to the same bound, and every hint to
``MAX_HINT_CHARS``: a hint gives a direction in one sentence, the docstring
carries the contract.
"""
from __future__ import annotations

import io
import json
import re
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path

from autograder.instructor.sync import BEGIN, END

N = 5
MAX_SHARE = 0.5
MAX_HINT_CHARS = 140
# A region of fewer 5-grams is a line or two (``j, i = cuda.grid(2)`` and its guard) whose
# windows are the idiom a lecture must teach; the release's exact-copy guard covers it.
MIN_GRAMS = 20
TOKEN = re.compile(r"[A-Za-z_]\w*|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\*\*=?|//=?|[-+*/%@&|^<>=!]=|->|<<|>>|[^\s\w]")


@dataclass(frozen=True)
class Region:
    where: str  # "solutions/08-data-parallel/ddp.py:79"
    hint: str
    grams: frozenset


@dataclass(frozen=True)
class Share:
    where: str
    released: float  # share of the region's 5-grams found anywhere in the released files
    top_file: str  # the released file that holds the most of them
    top_share: float
    hint: float  # share found in its own hint
    hint_chars: int
    size: int  # the region's distinct 5-grams


def tokens(text: str) -> list[str]:
    return TOKEN.findall(text)


def grams(words: list[str], n: int = N) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def _code_tokens(code: str, strings: bool = True) -> list[str]:
    """The code's tokens without its comments (and without its string literals, docstrings
    included, unless ``strings``); plain tokens when it does not tokenize."""
    dropped = {tokenize.COMMENT} | (set() if strings else {tokenize.STRING})
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(textwrap.dedent(code)).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return tokens(code)
    return tokens(" ".join(t.string for t in toks if t.type not in dropped))


def regions(solutions: Path) -> list[Region]:
    """Every solution region of ``solutions/`` with at least one 5-gram, less the 5-grams its
    lab's starters give as code on purpose (a baseline to start from, a provided helper, the
    signatures): those are the assignment, not its answer. Their docstrings and comments are
    not subtracted, so a docstring that spells out the body still counts against it."""
    found = []
    solutions = Path(solutions)
    for lab in sorted(p for p in solutions.iterdir() if p.is_dir()):
        paths = sorted(lab.rglob("*.py"))
        given = set().union(set(), *(grams(_code_tokens(_without_regions(p.read_text()), strings=False)) for p in paths))
        for path in paths:
            lines, start = path.read_text().splitlines(), None
            for i, line in enumerate(lines):
                m = BEGIN.match(line)
                if m:
                    start, hint = i, m["hint"] or ""
                elif END.match(line) and start is not None:
                    g = grams(_code_tokens("\n".join(lines[start + 1:i]))) - given
                    if g:
                        found.append(Region(f"{path.relative_to(solutions.parent)}:{start + 1}", hint, frozenset(g)))
                    start = None
    return found


def _without_regions(source: str) -> str:
    """A reference with every solution region and its marker lines cut out: what its starter gives."""
    kept, inside = [], False
    for line in source.splitlines():
        if BEGIN.match(line):
            inside = True
        elif END.match(line):
            inside = False
        elif not inside:
            kept.append(line)
    return "\n".join(kept)


def released_text(rel: str, data: bytes) -> str:
    """What a student reads in a released file: a notebook's cell sources and outputs, any other file as text."""
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return ""
    if rel.endswith(".ipynb"):
        cells = json.loads(text).get("cells", [])
        parts = ["".join(c.get("source", "")) for c in cells]
        for cell in cells:
            for output in cell.get("outputs", []):
                parts.append("".join(output.get("text", "")))
                parts += ["".join(v) if isinstance(v, list) else str(v) for v in output.get("data", {}).values()]
        text = "\n".join(parts)
    return text


def shares(solutions: Path, files: dict[str, tuple[bytes, bool]]) -> list[Share]:
    """Each region's share in the released ``files`` (relative path -> (bytes, executable)), worst first."""
    per_file = {rel: grams(tokens(released_text(rel, data))) for rel, (data, _) in files.items()}
    everything = set().union(*per_file.values()) if per_file else set()
    out = []
    for region in regions(solutions):
        size = len(region.grams)
        top = max(per_file, key=lambda rel: len(region.grams & per_file[rel]), default="")
        out.append(Share(region.where, len(region.grams & everything) / size, top,
                         len(region.grams & per_file[top]) / size if top else 0.0,
                         len(region.grams & grams(tokens(region.hint))) / size, len(region.hint), size))
    return sorted(out, key=lambda s: (-max(s.released, s.hint), s.where))


def problems(found: list[Share]) -> list[str]:
    """One line for each region (of ``MIN_GRAMS`` or more) over ``MAX_SHARE``, each hint over
    ``MAX_SHARE`` of its region, and each hint over ``MAX_HINT_CHARS``."""
    lines = [f"{s.where}: {s.released:.2f} of its 5-grams are in the release (most in {s.top_file}, {s.top_share:.2f})"
             for s in found if s.released > MAX_SHARE and s.size >= MIN_GRAMS]
    lines += [f"{s.where}: its hint holds {s.hint:.2f} of its 5-grams" for s in found if s.hint > MAX_SHARE]
    lines += [f"{s.where}: its hint is {s.hint_chars} characters (at most {MAX_HINT_CHARS})"
              for s in found if s.hint_chars > MAX_HINT_CHARS]
    return lines


def main(argv=None) -> int:
    """``python -m autograder.instructor.overlap [NN ...]``: the table for every region (or those of labs NN)."""
    import sys

    from autograder.instructor.release import ReleaseError, contents

    labs = (argv if argv is not None else sys.argv[1:])
    try:
        files = contents(Path("."))
    except ReleaseError as exc:
        print(f"overlap: {exc}", file=sys.stderr)
        return 2
    found = [s for s in shares(Path("solutions"), files)
             if not labs or any(s.where.startswith(f"solutions/{n}") for n in labs)]
    print(f"{'release':>7} {'1 file':>6} {'hint':>5} {'chars':>5}  region <- the file holding most of it")
    for s in found:
        print(f"{s.released:7.2f} {s.top_share:6.2f} {s.hint:5.2f} {s.hint_chars:5d}  {s.where} <- {s.top_file}")
    bad = problems(found)
    print("\n".join(bad) or "no region over the bound, no hint too long")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
