"""A page of the docs site, written in MyST, as plain Markdown that GitHub renders:
the release ships the student guide so (``k2c release``: ``STUDENT-GUIDE.md``).

MyST's extensions that GitHub does not know become what it does:

* a colon-fence directive (``:::{admonition} Title``, ``:::{keypoints}``, with
  ``:class:`` lines) becomes a quoted block under its title in bold (the
  directive's name when it has no title: "Keypoints");
* a definition list (a term, then ``: its definition``) becomes a bulleted list
  of ``term: definition``;
* a role (``{doc}`text <target>```) becomes its text;
* a link to another page of the site becomes its text, since only the page
  travels; links within the page (``#anchor``) and to the web stay.
"""
from __future__ import annotations

import re

_OPEN = re.compile(r"^:::\{([\w-]+)\}\s*(.*)$")
_OPTION = re.compile(r"^:[\w-]+:")
_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")
_ROLE = re.compile(r"\{[\w:-]+\}`([^`<]*?)\s*(?:<[^>]*>)?`")


def from_myst(text: str, keeps_link=lambda target: False) -> str:
    """``text`` (a MyST page) as GitHub-flavoured Markdown. ``keeps_link(target)``: whether a
    relative link's target travels with the page (then the link stays)."""
    lines = _directives(text.splitlines())
    lines = _definitions(lines)
    out = "\n".join(lines) + "\n"
    out = _ROLE.sub(lambda m: f"`{m[1]}`" if m[0].startswith(("{code}", "{command}", "{file}")) else m[1], out)
    return _LINK.sub(lambda m: m[0] if _travels(m[2], keeps_link) else m[1], out)


def _travels(target: str, keeps_link) -> bool:
    return target.startswith(("#", "http://", "https://", "mailto:")) or keeps_link(target.split("#")[0])


def _directives(lines: list[str]) -> list[str]:
    out: list[str] = []
    i, fenced = 0, False
    while i < len(lines):
        fenced ^= lines[i].lstrip().startswith("```")
        opened = None if fenced else _OPEN.match(lines[i])
        if not opened:
            out.append(lines[i])
            i += 1
            continue
        name, title = opened[1], opened[2].strip()
        body, i = [], i + 1
        while i < len(lines) and lines[i].strip() != ":::":
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"':::{{{name}}}' is never closed with ':::'")
        i += 1  # the closing :::
        while body and _OPTION.match(body[0]):
            body.pop(0)
        heading = name.replace("-", " ").capitalize()
        if name == "admonition":
            heading = title or "Note"
        elif title:
            heading += f": {title}"
        quoted = [f"> **{heading}**", ">"] + [f"> {line}".rstrip() for line in _strip_blank(body)]
        out.extend(quoted)
    return out


def _strip_blank(lines: list[str]) -> list[str]:
    while lines and not lines[0].strip():
        lines = lines[1:]
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return lines


def _definitions(lines: list[str]) -> list[str]:
    """``term`` then ``: definition`` (MyST's deflist) as ``- term: definition``."""
    out: list[str] = []
    fenced = False
    for line in lines:
        fenced ^= line.lstrip().lstrip("> ").startswith("```")
        if not fenced and line.startswith(": ") and out and out[-1].strip() \
                and not out[-1].startswith(("- ", "> ", "#", " ")):
            out[-1] = f"- {out[-1].strip()}: {line[2:]}"
        else:
            out.append(line)
    return out
