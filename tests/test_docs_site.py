"""The documentation site: built as the Makefile builds it, then opened in a browser.

The slow tests build ``docs/`` with ``sphinx-build -W --keep-going -b html``
into a temporary folder (executing the lectures), serve it on 127.0.0.1 and
open the pages in one headless Chromium (``tests/devtools.py``), so what is checked is the page a reader
gets: its <title>, the navigation sidebar, and the figures the lectures drew
when they ran. The fast tests check how ``docs/conf.py`` finds and mirrors the
course's notebooks.
"""
from __future__ import annotations

import functools
import html
import http.server
import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import urllib.request
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urljoin, urlparse

import pytest

from devtools import Chromium

# One site build serves every test here: keep them in one xdist worker.
pytestmark = pytest.mark.xdist_group("docs-site")

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SITE_NAME = "Kernels to Clusters"
HOME_TITLE = f"{SITE_NAME}: parallel computing for deep learning"
SEP = " \u2014 "  # Sphinx's " &#8212; " between a page's title and the site's
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BUILD_TIMEOUT_S = 1800
BROWSER_TIMEOUT_S = 120

#: the pages written in docs/ and their titles
STATIC_PAGES = {
    "index.html": HOME_TITLE,
    "syllabus.html": "Syllabus",
    "lectures.html": "Lectures",
    "labs.html": "Labs",
    "student-guide.html": "Student guide",
    "instructor-guide.html": "Instructor guide",
    "k2c.html": "k2c command reference",
    "gpus.html": "The GPUs students have",
    "gpu-tier.html": "GPU tier: recorded results",
}

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
    # The site must work offline: no host but the local server resolves, so a
    # CDN script (MathJax) fails at once instead of waiting on the network.
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
]


def lecture_notebooks() -> list[Path]:
    return sorted(ROOT.glob("course/lectures/[0-9][0-9]-*.ipynb"))


def lab_handouts() -> list[Path]:
    return sorted(ROOT.glob("solutions/[0-9][0-9]-*/handout.ipynb"))


def lecture_page(nb: Path) -> str:
    return f"_generated/lectures/{nb.stem}.html"


def lab_page(handout: Path) -> str:
    return f"_generated/labs/{handout.parent.name}/handout.html"


def notebook_title(nb: Path) -> str:
    """The first '# ' heading of the notebook, as plain text (what Sphinx puts in <title>)."""
    data = json.loads(nb.read_text(encoding="utf-8"))
    for cell in data.get("cells", []):
        if cell.get("cell_type") != "markdown":
            continue
        source = cell.get("source", "")
        text = "".join(source) if isinstance(source, list) else source
        for line in text.splitlines():
            if line.startswith("# "):
                title = line[2:].strip().rstrip("#").strip()
                title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # [text](url) -> text
                title = re.sub(r"<[^>]+>", "", title)  # inline HTML
                title = re.sub(r"[`*]", "", title)  # code and emphasis markers
                return " ".join(title.split())
    raise AssertionError(f"{nb.relative_to(ROOT)} has no '# Title' heading")


# -- reading a DOM that Chromium dumped ------------------------------------------

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta",
        "param", "source", "track", "wbr"}


@dataclass
class Page:
    url: str
    title: str = ""
    nav_links: list[str] = field(default_factory=list)  # absolute URLs in the sidebar nav
    output_images: list[str] = field(default_factory=list)  # <img> inside a cell's output
    h1: str = ""


class _DomReader(HTMLParser):
    def __init__(self, page: Page):
        super().__init__(convert_charrefs=True)
        self.page = page
        self.stack: list[tuple[str, set[str]]] = []
        self.in_title = False
        self.h1_depth = 0
        self.h1_parts: list[str] = []

    def _inside(self, cls: str) -> bool:
        return any(cls in classes for _, classes in self.stack)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = set((attrs.get("class") or "").split())
        if tag == "title":
            self.in_title = True
        elif tag == "a" and self._inside("bd-docs-nav") and attrs.get("href"):
            self.page.nav_links.append(urljoin(self.page.url, attrs["href"]))
        elif tag == "img" and self._inside("cell_output") and attrs.get("src"):
            self.page.output_images.append(urljoin(self.page.url, attrs["src"]))
        elif tag == "h1" and not self.page.h1:
            self.h1_depth = 1
        if tag not in VOID:
            self.stack.append((tag, classes))

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in VOID and self.stack and self.stack[-1][0] == tag:
            self.stack.pop()

    def handle_endtag(self, tag):
        if tag == "title":
            self.in_title = False
        if tag == "h1" and self.h1_depth:
            self.h1_depth = 0
            self.page.h1 = " ".join("".join(self.h1_parts).split()).rstrip("#").strip()
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                del self.stack[i:]
                break

    def handle_data(self, data):
        if self.in_title:
            self.page.title += data
        if self.h1_depth:
            self.h1_parts.append(data)


def parse_page(url: str, dom: str) -> Page:
    page = Page(url)
    reader = _DomReader(page)
    reader.feed(dom)
    reader.close()
    page.title = " ".join(html.unescape(page.title).split())
    return page


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_SIGNATURE, "not a PNG file"
    assert data[12:16] == b"IHDR", "PNG without an IHDR chunk"
    return struct.unpack(">II", data[16:24])


# -- the built and served site ----------------------------------------------------

@dataclass(eq=False)  # hashable by identity, for functools.cache on open()
class Site:
    html_dir: Path
    base_url: str
    chromium: str
    scratch: Path
    browser: Chromium

    def url(self, page: str) -> str:
        return urljoin(self.base_url, page)

    def _browser(self, *args: str) -> subprocess.CompletedProcess:
        profile = tempfile.mkdtemp(prefix="chromium-", dir=self.scratch)
        try:
            return subprocess.run([self.chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                                  capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S,
                                  stdin=subprocess.DEVNULL)
        finally:
            shutil.rmtree(profile, ignore_errors=True)

    @functools.cache
    def open(self, page: str) -> Page:
        """The page as Chromium rendered it, in the one browser every page shares (tests/devtools.py)."""
        url = self.url(page)
        dom = self.browser.dom(url)
        assert "<html" in dom, f"chromium rendered no HTML for {url}: {dom[:300]!r}"
        return parse_page(url, dom)

    def screenshot(self, page: str, out: Path, width: int = 1280, height: int = 1600) -> bytes:
        proc = self._browser(f"--screenshot={out}", f"--window-size={width},{height}",
                             "--hide-scrollbars", self.url(page))
        assert proc.returncode == 0 and out.is_file(), (
            f"chromium wrote no screenshot of {page} (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        return out.read_bytes()

    def fetch(self, url: str) -> bytes:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.read()


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def sphinx_build_command(out: Path) -> list[str]:
    """The Makefile's command: .venv/bin/sphinx-build -W --keep-going -b html docs OUT."""
    script = Path(sys.executable).with_name("sphinx-build")
    head = [str(script)] if script.exists() else [sys.executable, "-m", "sphinx"]
    return [*head, "-W", "--keep-going", "-b", "html", "docs", str(out)]


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass


def test_this_module_runs_in_one_worker(request):
    """Under `pytest -n --dist loadgroup` (make test) the site is built once, in one
    worker; a pytest-xdist that ignores xdist_group (pytest-xdist#1386, with pytest
    9.2) would silently build it once per worker, minutes each."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not a pytest-xdist worker under --dist loadgroup")
    assert request.node.nodeid.endswith("@docs-site"), (
        f"{request.node.nodeid}: pytest-xdist did not apply xdist_group; see the pytest pin in pyproject.toml")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium); "
                    "the site tests open the built pages in headless chromium")
    for module in ("sphinx", "myst_nb", "sphinx_book_theme"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed: pip install -e '.[dev]' to build the docs")

    scratch = tmp_path_factory.mktemp("docs-site")
    html_dir = scratch / "html"
    proc = subprocess.run(sphinx_build_command(html_dir), cwd=ROOT, capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT_S, stdin=subprocess.DEVNULL)
    log = proc.stdout + proc.stderr
    warnings = [line for line in log.splitlines() if "WARNING" in line or "ERROR" in line]
    assert proc.returncode == 0, ("sphinx-build -W failed:\n" + "\n".join(warnings[-40:])
                                  + "\n--- end of the log ---\n" + log[-4000:])

    handler = functools.partial(_QuietHandler, directory=str(html_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, name="docs-http", daemon=True)
    thread.start()
    browser = Chromium(chromium, CHROMIUM_FLAGS, tempfile.mkdtemp(prefix="chromium-", dir=scratch),
                       BROWSER_TIMEOUT_S)
    try:
        yield Site(html_dir, f"http://127.0.0.1:{port}/", chromium, scratch, browser)
    finally:
        browser.close()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


# -- the slow tests: the built site in a browser ------------------------------------

@pytest.mark.slow
def test_every_page_has_its_title(site):
    lectures, handouts = lecture_notebooks(), lab_handouts()
    assert lectures, "no lecture notebooks in course/lectures/"
    expected = {page: (title if page == "index.html" else title + SEP + SITE_NAME)
                for page, title in STATIC_PAGES.items()}
    for nb in lectures:
        expected[lecture_page(nb)] = notebook_title(nb) + SEP + SITE_NAME
    for handout in handouts:
        expected[lab_page(handout)] = notebook_title(handout) + SEP + SITE_NAME
    for page, title in expected.items():
        assert (site.html_dir / page).is_file(), f"the build wrote no {page}"
        got = site.open(page)
        assert got.title == title, f"{page}: <title> is {got.title!r}, expected {title!r}"


@pytest.mark.slow
def test_sidebar_links_to_every_lecture_and_lab(site):
    lectures = lecture_notebooks()
    assert lectures, "no lecture notebooks in course/lectures/"
    wanted = {site.url(lecture_page(nb)) for nb in lectures}
    wanted |= {site.url(lab_page(h)) for h in lab_handouts()}
    for page in ["index.html", "lectures.html", *(lecture_page(nb) for nb in lectures)]:
        links = {link.split("#")[0] for link in site.open(page).nav_links}
        assert links, f"{page}: no navigation sidebar (nav.bd-docs-nav) in the rendered page"
        missing = sorted(urlparse(u).path for u in wanted - links)
        assert not missing, f"{page}: the sidebar does not link to {missing}"


@pytest.mark.slow
def test_every_lecture_shows_a_figure_it_drew_when_executed(site):
    lectures = lecture_notebooks()
    assert lectures, "no lecture notebooks in course/lectures/"
    for nb in lectures:
        page = site.open(lecture_page(nb))
        pngs = [src for src in page.output_images if urlparse(src).path.endswith(".png")]
        assert pngs, (f"{lecture_page(nb)}: no PNG figure in any cell output; the lecture must draw at "
                      f"least one figure when executed (matplotlib inline), and it must survive rendering")
        sizes = {}
        for src in pngs:
            width, height = sizes[src] = png_size(site.fetch(src))
            assert width > 0 and height > 0, f"{src}: an empty ({width}x{height}) image"
        assert max(w * h for w, h in sizes.values()) >= 10_000, (
            f"{lecture_page(nb)}: every output image is tiny ({sorted(sizes.values())}); none is a figure")


@pytest.mark.slow
def test_a_lecture_page_renders_to_a_real_screenshot(site, tmp_path):
    lectures = lecture_notebooks()
    assert lectures, "no lecture notebooks in course/lectures/"
    data = site.screenshot(lecture_page(lectures[0]), tmp_path / "lecture.png", 1280, 1600)
    assert png_size(data) == (1280, 1600)
    assert len(data) > 20_000, f"a {len(data)}-byte screenshot is suspiciously small (a blank page?)"
    from PIL import Image  # a dependency of matplotlib

    with Image.open(tmp_path / "lecture.png") as image:
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20) or []
    assert len(colours) > 64, f"the screenshot has only {len(colours)} colours: is the page blank?"


MATHJAX_TYPESET = "(window.MathJax && MathJax.startup && MathJax.startup.promise) || Promise.resolve()"


@pytest.mark.slow
def test_formulas_render_with_no_request_leaving_the_machine(site):
    """MathJax comes with the site (_static/mathjax/), not from a CDN: a page's formulas are
    typeset while every host but the local server fails to resolve (CHROMIUM_FLAGS)."""
    pages = sorted(site.html_dir.rglob("*.html"))
    external = {str(page.relative_to(site.html_dir)): found for page in pages
                if (found := re.findall(r"<(?:script|link)\b[^>]*(?:src|href)=\"(?:https?:)?//[^\"]*\"",
                                        page.read_text(encoding="utf-8")))}
    assert not external, f"pages load scripts or styles from other hosts: {external}"
    with_math = [page for page in pages if 'class="math notranslate' in page.read_text(encoding="utf-8")]
    assert len(with_math) > 3, "hardly any page has a formula: is myst's dollarmath still on?"
    page = next(p for p in with_math if "lectures" in p.parts)
    url = site.url(page.relative_to(site.html_dir).as_posix())
    dom = site.browser.dom(url, settled=MATHJAX_TYPESET)
    left = [u for u in site.browser.requested if not u.startswith(site.base_url) and not u.startswith("data:")]
    assert not left, f"{url} asked for {left}"
    formulas, typeset = dom.count('class="math notranslate'), dom.count("<mjx-container")
    assert typeset >= formulas > 0 and "<mjx-merror" not in dom, (
        f"{url}: {typeset} of its {formulas} formulas typeset by MathJax")


@pytest.mark.slow
def test_handouts_are_shown_as_stored_not_executed(site):
    """A handout calls the student's code: the build must not have run it."""
    for handout in lab_handouts():
        stored = json.loads(handout.read_text(encoding="utf-8"))
        stored_outputs = sum(len(c.get("outputs", [])) for c in stored["cells"] if c["cell_type"] == "code")
        if stored_outputs == 0:
            page = site.open(lab_page(handout))
            assert not page.output_images, f"{lab_page(handout)}: outputs appeared, so it was executed"
            text = (site.html_dir / lab_page(handout)).read_text(encoding="utf-8")
            assert "cell_output" not in text, f"{lab_page(handout)}: outputs appeared, so it was executed"


# -- the fast tests: how conf.py finds the course's notebooks --------------------------

def _load_conf():
    spec = importlib.util.spec_from_file_location("k2c_docs_conf", DOCS / "conf.py")
    module = importlib.util.module_from_spec(spec)
    saved_path = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved_path
    return module


def _notebook(path: Path, title: str, metadata: dict | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    nb = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": [f"# {title}\n"]}],
          "metadata": metadata or {}, "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb), encoding="utf-8")


def test_every_handout_is_titled_after_one_pattern():
    """The sidebar lists the handouts by title: "Lab NN — Subject: handout", each with its own number."""
    handouts = lab_handouts()
    assert handouts, "no lab handouts in solutions/"
    for handout in handouts:
        title = notebook_title(handout)
        assert re.fullmatch(rf"Lab {handout.parent.name[:2]} — [A-Z].+: handout", title), (
            f"{handout.relative_to(ROOT)} is titled {title!r}: name it as the others are, "
            f"'# Lab {handout.parent.name[:2]} — Subject: handout'")


def test_conf_discovers_new_modules_by_globbing(tmp_path):
    conf = _load_conf()
    for slug in ("01-parallel-thinking", "02-cuda-model", "03-shared-memory"):
        _notebook(tmp_path / "course" / "lectures" / f"{slug}.ipynb", slug)
        _notebook(tmp_path / "solutions" / slug / "handout.ipynb", f"Lab {slug}")
        (tmp_path / "solutions" / slug / "solution.py").write_text("ANSWER = 42\n")
    (tmp_path / "solutions" / "03-shared-memory" / "tiles.png").write_bytes(PNG_SIGNATURE)
    (tmp_path / "course" / "lectures" / "README.md").write_text("# not a page of the site\n")
    (tmp_path / "course" / "lectures" / "workers.py").write_text("")

    lectures = conf.lecture_sources(tmp_path)
    handouts = conf.handout_sources(tmp_path)
    gen = conf.GENERATED
    assert {p.relative_to(gen).as_posix() for p in lectures} == {
        "lectures/01-parallel-thinking.ipynb", "lectures/02-cuda-model.ipynb",
        "lectures/03-shared-memory.ipynb", "lectures/workers.py"}
    assert {p.relative_to(gen).as_posix() for p in handouts} == {
        "labs/01-parallel-thinking/handout.ipynb", "labs/02-cuda-model/handout.ipynb",
        "labs/03-shared-memory/handout.ipynb", "labs/03-shared-memory/tiles.png"}
    # the reference solutions are never published
    assert not any(p.suffix == ".py" for p in handouts)


def test_conf_mirror_copies_updates_and_prunes(tmp_path):
    conf = _load_conf()
    src, out = tmp_path / "src", tmp_path / "out"
    _notebook(src / "01-a.ipynb", "A", {"kernelspec": {"name": "k2c-venv", "language": "python"}})
    _notebook(src / "02-b.ipynb", "B")
    (src / "fig.png").write_bytes(PNG_SIGNATURE)
    wanted = {out / "01-a.ipynb": src / "01-a.ipynb", out / "02-b.ipynb": src / "02-b.ipynb",
              out / "img" / "fig.png": src / "fig.png"}
    (out / "stale").mkdir(parents=True)
    (out / "stale" / "old.ipynb").write_text("{}")
    (out / "left-by-a-run.txt").write_text("x")

    conf.mirror(wanted, out)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "01-a.ipynb", "02-b.ipynb", "img/fig.png"]
    # a notebook saved without metadata gets what rendering and execution need
    meta = json.loads((out / "02-b.ipynb").read_text())["metadata"]
    assert meta["kernelspec"]["name"] == "python3" and meta["language_info"]["name"] == "python"
    # one that has a kernelspec keeps it (conf.nb_kernel_rgx_aliases maps it to python3)
    meta = json.loads((out / "01-a.ipynb").read_text())["metadata"]
    assert meta["kernelspec"]["name"] == "k2c-venv"
    # copies keep the source's mtime, so an incremental build re-reads only what changed
    for dst, s in wanted.items():
        assert int(dst.stat().st_mtime) == int(s.stat().st_mtime)

    _notebook(src / "02-b.ipynb", "B, revised")
    os.utime(src / "02-b.ipynb", (2_000_000_000, 2_000_000_000))
    conf.mirror(wanted, out)
    assert "B, revised" in (out / "02-b.ipynb").read_text()


def test_conf_shows_a_lecture_as_nbval_ran_it_only_while_it_is_current(tmp_path, monkeypatch):
    from course import executed

    conf = _load_conf()
    monkeypatch.setattr(executed, "FOLDER", tmp_path)
    lecture = ROOT / "course" / "lectures" / "01-parallel-thinking.ipynb"
    assert conf.executed_copy(lecture) is None  # nbval has not run it
    ran = json.loads(lecture.read_text())
    code = next(c for c in ran["cells"] if c["cell_type"] == "code")
    code["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "printed under nbval\n"}]
    executed.save(ran, lecture)
    shown = json.loads(conf.notebook_bytes(lecture))
    assert shown["metadata"]["mystnb"] == {"execution_mode": "off"}  # not run a second time
    assert "printed under nbval" in json.dumps(shown["cells"])
    # a change to the lecture, the toolkit or a helper changes the digest: the build runs it itself
    monkeypatch.setattr(executed, "digest", lambda path: "run from other files")
    assert conf.executed_copy(lecture) is None
    assert "mystnb" not in json.loads(conf.notebook_bytes(lecture))["metadata"]
    handout = ROOT / "solutions" / "01-parallel-thinking" / "handout.ipynb"
    assert conf.executed_copy(handout) is None  # handouts are never executed


def test_conf_execution_settings():
    conf = _load_conf()
    assert conf.nb_execution_mode == "force"
    assert conf.nb_execution_raise_on_error is True
    assert 0 < conf.nb_execution_timeout <= 300
    assert "_build" in conf.exclude_patterns
    from pathlib import PurePosixPath

    handout = PurePosixPath("/repo/docs/_generated/labs/02-cuda-model/handout.ipynb")
    lecture = PurePosixPath("/repo/docs/_generated/lectures/02-cuda-model.ipynb")
    assert any(handout.match(p) for p in conf.nb_execution_excludepatterns)
    assert not any(lecture.match(p) for p in conf.nb_execution_excludepatterns)
