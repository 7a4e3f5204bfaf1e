"""`course site`: the executed course as a book, opened in a real (headless) Chromium.

The book is built by the CLI from a build/ laid out as `course run` lays it out, and nothing of
the course is executed for it: the committed notebooks (their outputs are those of their last
recording) stand for the run's copies. Two copies are real runs of `course run`'s execute, so
the landing page has a real time and status to show: lecture 00 (a few seconds), and in lecture
07's place a notebook that fails at its second code cell. (The suite's own syllabus run lives in
test_course_run*.py, on other workers, a module each: this file cannot share it.)

Pages are served by a static server on 127.0.0.1; every request to any other host is aborted and
recorded. Chromium is Debian's, as in tests/notebooks/test_browser.py.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from course.grading import cells
from course.kernel import KERNELSPEC
from course.run import execute, output_path
from course.syllabus import REPO, Entry, load_syllabus

ENTRIES = load_syllabus()
LABS = [e for e in ENTRIES if e.kind == "lab"]
FAILED = "lectures/07_tools"  # where the failing notebook stands in the build
REPOSITORY, HUB = "https://github.com/example/multigpu-course", "https://hub.example.edu"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"]
ARGS += ["--disable-background-networking", "--disable-component-update", "--disable-sync"]


def docname(entry: Entry) -> str:
    return f"{entry.kind}s/{entry.path.stem}"


def failing_notebook(folder: Path) -> Path:
    nb = new_notebook(
        cells=[
            new_markdown_cell("# 07 · A notebook that fails\n\nIt divides by zero on purpose."),
            new_code_cell("x = 1"),
            new_code_cell("1/0"),
            new_code_cell("print(x)"),
        ],
        metadata={"kernelspec": KERNELSPEC},
    )
    path = folder / "07_tools.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """A build/ as `course run` leaves it, and its book made by `course site`."""
    out = tmp_path_factory.mktemp("build")
    for entry in ENTRIES:
        target = output_path(entry.path, out)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(entry.path, target)
    ran = execute(ENTRIES[0], "quick", out)  # lecture 00, for real
    broken = failing_notebook(tmp_path_factory.mktemp("broken"))
    failed = execute(Entry(broken, "fails", "lecture", 60), "quick", out / "lectures")
    assert ran.ok and not failed.ok, (ran.error, failed.error)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "course", "site", "--build", str(out)]
        + ["--repository", REPOSITORY, "--hub", HUB],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    took = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(f"\ncourse site: {took:.1f} s for {len(ENTRIES)} notebooks ({proc.stdout.strip()})")
    return out, failed


@pytest.fixture(scope="module")
def site(build):
    """The book on a static server at 127.0.0.1; yields its base URL."""
    root = build[0] / "site"
    handler = functools.partial(QuietHandler, directory=str(root))
    server = Server(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # a page left before its last image arrived: the browser closed the socket


@pytest.fixture(scope="module")
def browser(site):
    """A Chromium page that may reach only the book's server; ``outside`` lists what else it
    asked for (each such request is aborted)."""
    from playwright.sync_api import sync_playwright

    host = urlsplit(site).netloc
    outside: list[str] = []

    def guard(route):
        url = urlsplit(route.request.url)
        if url.scheme in ("file", "data", "blob") or url.netloc == host:
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = chromium.new_page(viewport={"width": 1280, "height": 900})
            page.route("**/*", guard)
            page.outside = outside
            yield page
        finally:
            chromium.close()


def test_the_landing_page_is_the_syllabus_with_this_runs_time_and_status(build, site, browser):
    out, failed = build
    browser.goto(f"{site}/index.html")
    rows = browser.locator("article table tbody tr")
    assert rows.count() == len(ENTRIES)
    for i, entry in enumerate(ENTRIES):
        cols = rows.nth(i).locator("td")
        assert cols.nth(0).locator("a").first.get_attribute("href") == f"{docname(entry)}.html"
        assert cols.nth(1).inner_text().strip() == f"{entry.budget_s:.0f} s"
    took = nbformat.read(out / "lectures" / "00_setup_check.ipynb", 4).metadata.papermill.duration
    first = rows.nth(0).locator("td")
    assert first.nth(2).inner_text().strip() == f"{took:.0f} s"
    assert first.nth(3).inner_text().strip() == "ok"
    assert "Run this notebook first" in first.nth(0).inner_text()  # what it is about
    broken = rows.nth([docname(e) for e in ENTRIES].index(FAILED)).locator("td")
    assert broken.nth(3).inner_text().strip() == f"failed: {failed.error}"
    assert rows.nth(1).locator("td").nth(3).inner_text().strip() == "no run record"


def test_every_notebook_is_a_page_reached_from_the_side_bar(site, browser):
    browser.goto(f"{site}/index.html")
    side = browser.locator("nav.bd-docs-nav a.reference.internal")
    hrefs = [side.nth(i).get_attribute("href") for i in range(side.count())]
    for entry in ENTRIES:
        assert f"{docname(entry)}.html" in hrefs, f"{docname(entry)} is not in the side bar"
    here = "."
    for entry in ENTRIES:  # each page's side bar leads to the next one
        href = os.path.relpath(f"{docname(entry)}.html", here)
        browser.locator(f'nav.bd-docs-nav a[href="{href}"]').click()
        here = os.path.dirname(docname(entry))
        browser.wait_for_url(f"**/{docname(entry)}.html", wait_until="domcontentloaded")
        assert browser.locator("article h1").first.inner_text().strip()


def test_search_finds_a_term_from_lecture_04(site, browser):
    browser.goto(f"{site}/search.html?q=Megatron")
    hit = browser.locator('#search-results a[href*="lectures/04_model_pipeline_tensor"]')
    hit.first.wait_for(timeout=30_000)
    assert "Four ways to split training" in hit.first.inner_text()


def test_every_image_on_a_lab_page_loads(site, browser):
    for entry in LABS:
        browser.goto(f"{site}/{docname(entry)}.html", wait_until="load")
        images = browser.locator("article img")
        assert images.count() > 0, f"{entry.path.name}: its page has no figure"
        sizes = images.evaluate_all("imgs => imgs.map(i => [i.src, i.complete, i.naturalWidth])")
        broken = [src for src, complete, width in sizes if not (complete and width > 0)]
        assert not broken, f"{entry.path.name}: images that did not load: {broken}"


def test_no_internal_link_is_broken(build):
    """Every link, image, script and style sheet of every page that points inside the book
    names a file that is there, and an anchor that its page has."""
    from bs4 import BeautifulSoup

    root = build[0] / "site"
    ids: dict[Path, set[str]] = {}

    def anchors(path: Path) -> set[str]:
        if path not in ids:
            soup = BeautifulSoup(path.read_text(encoding="utf-8"), "html.parser")
            ids[path] = {t.get("id") for t in soup.find_all(id=True)}
            ids[path] |= {t.get("name") for t in soup.find_all("a", attrs={"name": True})}
        return ids[path]

    checked, broken = 0, []
    for page in sorted(p for p in root.rglob("*.html") if "_static" not in p.parts):
        soup = BeautifulSoup(page.read_text(encoding="utf-8"), "html.parser")
        for tag, attr in (("a", "href"), ("img", "src"), ("script", "src"), ("link", "href")):
            for node in soup.find_all(tag, attrs={attr: True}):
                url = urlsplit(node[attr])
                if url.scheme or url.netloc or node[attr].startswith(("mailto:", "javascript:")):
                    continue
                target = (page.parent / unquote(url.path)).resolve() if url.path else page
                checked += 1
                if not target.is_file():
                    broken.append(f"{page.relative_to(root)}: {node[attr]}")
                elif url.fragment and target.suffix == ".html":
                    if unquote(url.fragment) not in anchors(target):
                        broken.append(f"{page.relative_to(root)}: {node[attr]} (no such anchor)")
    assert checked > 1000 and not broken, broken


def secrets_of(lab: Path) -> tuple[set[str], set[str]]:
    """The lines of the lab's solution regions and of its hidden tests that are not also in
    the released lab (a line such as `return out` is in both)."""
    released = "\n".join(c.source for c in nbformat.read(REPO / "labs" / lab.name, 4).cells)
    solution, hidden = set(), set()
    for i, cell in enumerate(nbformat.read(lab, 4).cells):
        lines = cell.source.splitlines()
        for kind, found in (("SOLUTION", solution), ("HIDDEN TESTS", hidden)):
            if cell.cell_type != "code":
                continue
            for begin, end in cells.regions(cell.source, kind, f"cell {i}"):
                for line in lines[begin + 1 : end]:
                    text = line.strip()
                    if len(text) >= 20 and text not in released:
                        found.add(text)
    return solution, hidden


def test_a_lab_page_shows_no_solution_and_no_hidden_test(build, site, browser):
    out = build[0]
    for entry in LABS:
        solution, hidden = secrets_of(entry.path)
        assert solution and hidden, f"{entry.path.name}: nothing to look for"
        browser.goto(f"{site}/{docname(entry)}.html")
        shown = browser.evaluate("document.body.textContent")  # collapsed cells included
        source = (out / "site" / "_sources" / f"{docname(entry)}.ipynb").read_text()  # download
        for text in (shown, source):
            for marker in ("BEGIN SOLUTION", "END SOLUTION", "HIDDEN TESTS"):
                assert marker not in text, f"{entry.path.name}: {marker!r} on its page"
            leaked = [line for line in solution | hidden if line in text]
            assert not leaked, f"{entry.path.name}: solution or hidden-test lines: {leaked[:5]}"
        assert "NotImplementedError" in shown  # the student's stubs are there instead


def test_a_failed_notebook_gets_a_page_that_says_it_failed_and_where(build, site, browser):
    _, failed = build
    browser.goto(f"{site}/{FAILED}.html")
    top = browser.locator("article .admonition.error").first
    assert "This notebook failed in this run" in top.inner_text()
    assert failed.error in top.inner_text()  # cell 2: ZeroDivisionError: division by zero
    top.locator("a", has_text="this cell").click()
    anchor = unquote(urlsplit(browser.url).fragment)
    marker = browser.locator(f'[id="{anchor}"]')
    assert "The run stopped at the next cell" in marker.inner_text()
    following = browser.locator(f'[id="{anchor}"] ~ div.cell').first
    assert following.locator(".cell_input").inner_text().strip() == "1/0"


def test_a_notebook_page_launches_on_the_hub_and_on_binder(build):
    page = (build[0] / "site" / "labs" / "lab01_ddp_scaling.html").read_text()
    hub = re.search(r'href="(https://hub\.example\.edu/[^"]*)"', page).group(1)
    assert "/hub/user-redirect/git-pull?repo=https%3A//github.com/example/multigpu-course" in hub
    assert "urlpath=lab/tree/multigpu-course/labs/lab01_ddp_scaling.ipynb" in hub
    assert (
        'href="https://mybinder.org/v2/gh/example/multigpu-course/main?urlpath=lab/tree/labs/'
        in page
    )


def test_no_page_asks_another_host_for_anything(build, site, browser):
    """Over the static server (the other tests' visits included) and from file://."""
    pages = ("index.html", "search.html?q=rank", "lectures/01_collectives.html")  # 01: widgets
    for path in (*pages, "lectures/08_transformers_at_scale.html"):
        browser.goto(f"{site}/{path}", wait_until="networkidle")
    # lecture 08's formulas, typeset by the book's own copy of MathJax
    browser.wait_for_function("document.querySelectorAll('span.MathJax').length > 10")
    browser.goto((build[0] / "site" / "labs" / "lab01_ddp_scaling.html").as_uri())
    browser.wait_for_load_state("networkidle")
    assert not browser.outside, f"requests to other hosts: {sorted(set(browser.outside))}"


def test_a_notebook_with_no_executed_copy_gets_a_page_that_says_so(tmp_path):
    from course.site import missing_page, read_page

    page = read_page(ENTRIES[3], tmp_path)
    assert page.executed is None and page.status == "not run in this build"
    assert "Not run in this build" in missing_page(page)


def test_course_site_without_a_build_says_what_to_do(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "course", "site", "--build", str(tmp_path / "none")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "run `course run` first" in proc.stderr
