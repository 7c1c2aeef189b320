"""Sphinx configuration for the Kernels to Clusters site.

Build (from the repository root, offline, warnings are errors)::

    .venv/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

The lectures and lab handouts live outside ``docs/`` (``course/lectures/`` and
``solutions/NN-slug/handout.ipynb``). Sphinx only reads files under its source
folder, so at the start of every build this file mirrors them into
``docs/_generated/`` (gitignored):

* ``course/lectures/NN-slug.ipynb``      -> ``_generated/lectures/NN-slug.ipynb``
  (plus any non-page files next to them: images, helper modules),
* ``solutions/NN-slug/handout.ipynb``   -> ``_generated/labs/NN-slug/handout.ipynb``
  (plus images next to it; never the solution code).

Modules are found by globbing, and the toctrees in ``lectures.md`` and
``labs.md`` glob ``_generated/...``, so a new module appears on the site
without editing anything here. Lectures are executed at every build (on
whichever tier this machine is), unless ``make test``'s nbval run has just
executed them from exactly these files (``course.executed``): then the site
shows that run's outputs instead of running them again. Handouts are rendered
as they are stored, never executed, because they call the student's code.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
GENERATED = DOCS / "_generated"

sys.path.insert(0, str(DOCS / "_ext"))

# -- Project ------------------------------------------------------------------

project = "Kernels to Clusters"
author = "The Kernels to Clusters authors"
copyright = "2025, the Kernels to Clusters authors"
release = version = "0.1"

extensions = [
    "myst_nb",
    "sphinx.ext.githubpages",  # writes .nojekyll: GitHub Pages must serve _static/, _generated/
    # MathJax 3 from the dev extra's package, copied into _static/mathjax/, so formulas render
    # offline (Sphinx's default loads it from a CDN): mathjax_path points there.
    "sphinx-mathjax-offline",
    "k2c_lesson",  # objectives / exercise / solution / keypoints admonitions
]

root_doc = "index"
exclude_patterns = [
    "_build",
    "gpu-results",  # included by gpu-tier.md, not pages of their own
    "benchmarks",  # tables written by benchmarks/*.py, included by benchmarks.md
    "_ext",
    "Thumbs.db",
    ".DS_Store",
    "**.ipynb_checkpoints",
    "**/__pycache__",
]

# -- MyST ---------------------------------------------------------------------

myst_enable_extensions = [
    "colon_fence",
    "deflist",
    "dollarmath",
    "amsmath",
    "fieldlist",
    "substitution",
    "attrs_inline",
    "attrs_block",
    "tasklist",
]
myst_heading_anchors = 3

# -- Notebooks (myst-nb) ------------------------------------------------------

nb_execution_mode = "force"  # lectures always run, so the site shows this build's numbers
nb_execution_timeout = 120  # seconds per cell
nb_execution_raise_on_error = True  # a failing lecture cell fails the build
nb_execution_show_tb = True  # ... and the log shows the traceback
nb_execution_allow_errors = False
nb_execution_excludepatterns = ["_generated/labs/*/*.ipynb"]  # handouts call student code
# Whatever kernel a notebook was saved with, run it with this environment's
# Python (jupyter_client maps the "python3" kernel to sys.executable).
nb_kernel_rgx_aliases = {".*": "python3"}
nb_merge_streams = True

# Keep the kernel quiet about the debugger and make tiers explicit in the log.
os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")

# -- HTML ---------------------------------------------------------------------

html_theme = "sphinx_book_theme"
html_title = "Kernels to Clusters"
html_short_title = "k2c"
templates_path = ["_templates"]
html_static_path = ["_static"]
html_css_files = ["k2c.css"]
html_last_updated_fmt = None
html_copy_source = True
html_show_sourcelink = False
html_theme_options = {
    "home_page_in_toc": True,
    "show_navbar_depth": 2,  # lectures and labs listed, expanded, in the sidebar
    "max_navbar_depth": 3,
    "collapse_navbar": False,
    "use_download_button": True,  # the executed .ipynb and the page source
    "use_fullscreen_button": True,
    "show_toc_level": 2,
    "navigation_with_keys": False,
}

# -- Mirroring the course's notebooks into the source folder ------------------

#: files that Sphinx would read as pages: never copied as "assets"
PAGE_SUFFIXES = {".ipynb", ".md", ".rst", ".myst", ".txt"}
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp"}
SKIP_DIRS = {"__pycache__", ".ipynb_checkpoints"}


def lecture_sources(root: Path = ROOT) -> dict[Path, Path]:
    """``course/lectures/NN-slug.ipynb`` and the lectures' asset files."""
    lectures = root / "course" / "lectures"
    wanted: dict[Path, Path] = {}
    for nb in sorted(lectures.glob("[0-9][0-9]-*.ipynb")):
        wanted[GENERATED / "lectures" / nb.name] = nb
    if not lectures.is_dir():
        return wanted
    for path in sorted(lectures.rglob("*")):
        rel = path.relative_to(lectures)
        if (path.is_file() and path.suffix.lower() not in PAGE_SUFFIXES
                and not SKIP_DIRS.intersection(rel.parts)):
            wanted[GENERATED / "lectures" / rel] = path
    return wanted


def handout_sources(root: Path = ROOT) -> dict[Path, Path]:
    """``solutions/NN-slug/handout.ipynb`` and the images next to it (no code)."""
    wanted: dict[Path, Path] = {}
    for handout in sorted(root.glob("solutions/[0-9][0-9]-*/handout.ipynb")):
        lab = handout.parent
        dest = GENERATED / "labs" / lab.name
        wanted[dest / "handout.ipynb"] = handout
        for path in sorted(lab.rglob("*")):
            rel = path.relative_to(lab)
            if (path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES
                    and not SKIP_DIRS.intersection(rel.parts)):
                wanted[dest / rel] = path
    return wanted


def _same(src: Path, dst: Path) -> bool:
    try:
        a, b = src.stat(), dst.stat()
    except OSError:
        return False
    return a.st_size == b.st_size and int(a.st_mtime) == int(b.st_mtime)


def notebook_bytes(src: Path) -> bytes:
    """The notebook as it goes into the site: the source, plus the metadata that
    rendering and execution need when the author's Jupyter did not save it (a
    notebook written by a script has neither): a Python kernelspec, so the
    lecture runs in this environment, and ``language_info``, so code cells are
    highlighted as Python (myst-nb warns, and ``-W`` fails, without one)."""
    raw = src.read_bytes()
    try:
        nb = json.loads(raw)
    except ValueError:
        return raw  # let myst-nb report the broken notebook with its own message
    ran = executed_copy(src)
    if ran is not None:
        nb, raw = ran, b""
    meta = nb.setdefault("metadata", {})
    changed = ran is not None
    if not meta.get("kernelspec", {}).get("name"):
        meta["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        changed = True
    if not meta.get("language_info", {}).get("name"):
        meta["language_info"] = {"name": "python"}
        changed = True
    if not changed:
        return raw
    return (json.dumps(nb, indent=1, ensure_ascii=False) + "\n").encode("utf-8")


def executed_copy(src: Path) -> dict | None:
    """The lecture as nbval executed it in this test run (``course.executed``), marked
    not to be run again; None for a handout, or when there is no current copy."""
    if src.parent != ROOT / "course" / "lectures":
        return None
    try:
        from course import executed
    except ImportError:
        return None
    nb = executed.current(src)
    if nb is not None:
        nb["metadata"]["mystnb"] = {"execution_mode": "off"}
    return nb


def _copy(src: Path, dst: Path) -> None:
    """Copy, keeping the source's modification time, and only when needed."""
    if src.suffix == ".ipynb":
        data = notebook_bytes(src)
        try:
            current = dst.read_bytes()
        except OSError:
            current = None
        if current != data:
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)
        st = src.stat()
        if int(dst.stat().st_mtime) != int(st.st_mtime):
            os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif not _same(src, dst):
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)


def mirror(wanted: dict[Path, Path], folder: Path) -> None:
    """Make ``folder`` hold exactly ``wanted`` (destination -> source).

    Copies keep the source's modification time, so an unchanged notebook is not
    re-read (nor re-executed) by an incremental build; files that are no longer
    wanted, including what an earlier execution left behind, are removed.
    """
    folder.mkdir(parents=True, exist_ok=True)
    for dst, src in wanted.items():
        _copy(src, dst)
    for path in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_dir():
            if not any(path.iterdir()):
                path.rmdir()
        elif path not in wanted:
            path.unlink()


def _has_title(nb_path: Path) -> bool:
    try:
        nb = json.loads(nb_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "markdown":
            continue
        source = cell.get("source", "")
        text = "".join(source) if isinstance(source, list) else source
        if any(line.startswith("# ") for line in text.splitlines()):
            return True
    return False


def sync_notebooks(app, config) -> None:
    from sphinx.util import logging

    logger = logging.getLogger("k2c.docs")
    lectures, handouts = lecture_sources(), handout_sources()
    mirror(lectures, GENERATED / "lectures")
    mirror(handouts, GENERATED / "labs")
    n_lectures = sum(1 for d in lectures if d.suffix == ".ipynb")
    n_labs = sum(1 for d in handouts if d.name == "handout.ipynb")
    logger.info(f"[k2c] mirrored {n_lectures} lecture(s) and {n_labs} lab handout(s) "
                f"into {GENERATED.relative_to(ROOT)}/")
    if not n_lectures:
        logger.warning(f"[k2c] no lecture notebooks found: expected {ROOT / 'course' / 'lectures'}/NN-slug.ipynb")
    if not n_labs:
        logger.warning(f"[k2c] no lab handouts found: expected {ROOT / 'solutions'}/NN-slug/handout.ipynb")
    for dst, src in list(lectures.items()) + list(handouts.items()):
        if dst.suffix == ".ipynb" and not _has_title(dst):
            logger.warning(f"[k2c] {src.relative_to(ROOT)} has no '# Title' heading in a markdown cell; "
                           "the site needs one for the page title and the navigation")


def setup(app):
    app.connect("config-inited", sync_notebooks)
