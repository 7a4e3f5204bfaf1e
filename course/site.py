"""`course site`: the executed course in build/ as a static book under build/site/.

Sphinx with myst-nb and sphinx-book-theme (docs/instructors.md, "The course as a book", says why
not Jupyter Book 2). The book is made from what `course run` left in build/, never executed again
(``nb_execution_mode = "off"``): the numbers on its pages are that run's. Its pages:

- the landing page: the syllabus, each notebook's budget, what it is about (its opening
  paragraph), and this run's time and status;
- a chapter of lectures and one of labs. A lab's page is the student version of its executed
  solution: ``course release``'s passes remove the solutions and hidden tests, and the outputs
  of solution and test cells go with them (a hidden test's output may spell its expected
  values), tracebacks shrink to their last line (a traceback quotes the code of the frames it
  passed through, solutions included);
- a failed or missing notebook still gets its page, saying that it failed and at which cell;
- the instructors' pages, docs/*.md.

Long locked harness cells are collapsed (myst-nb's ``hide-input``), widgets (which need a
kernel) are replaced by a note, and MathJax comes from the jupyter-server-mathjax package, so a
page loads nothing from another host: it works from ``file://`` or any static server.
Each notebook page has launch links (the theme's): JupyterHub through nbgitpuller, and Binder
(environment.yml), once a repository is given.

Trusts: build/ (written by `course run` from the instructor's notebooks) and docs/.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat

from course.run import output_path
from course.syllabus import REPO, Entry, load_syllabus

# --- settings ------------------------------------------------------------------------------
TITLE = "Multi-GPU training with PyTorch"
HARNESS_LINES = 15  # a locked, ungraded code cell longer than this starts collapsed
BINDER = "https://mybinder.org"
DOCS = REPO / "docs"
FIRST_DOC = "instructors"  # docs/instructors.md opens the instructors' chapter
PAPERMILL_BANNER = "papermill-error-cell-tag"  # papermill's "An Exception was encountered" cells
WIDGET = "application/vnd.jupyter.widget-view+json"
WIDGET_NOTE = "*An interactive widget: open this notebook in JupyterLab to use it.*"


@dataclass(frozen=True)
class Launch:
    """Where a page's launch links open its notebook. Empty ``repository``: no links."""

    hub: str = ""  # a JupyterHub with nbgitpuller installed, e.g. https://hub.example.edu
    repository: str = ""  # the course's public git repository (https)
    branch: str = "main"
    binder: str = BINDER


@dataclass
class Page:
    """One syllabus notebook as the run left it."""

    entry: Entry
    docname: str  # lectures/01_collectives, labs/lab01_ddp_scaling
    executed: Path | None  # the executed notebook in build/, None when there is none
    ok: bool | None = None  # None: no record of how its run ended
    error: str = ""
    seconds: float | None = None

    @property
    def status(self) -> str:
        if self.ok is False:
            return f"failed: {self.error}"
        if self.executed is None:
            return "not run in this build"
        if self.ok is None:
            return "no run record"
        if self.seconds is not None and self.seconds > self.entry.budget_s:
            return f"ok, over its {self.entry.budget_s:.0f} s budget"
        return "ok"


@dataclass
class Site:
    index: Path  # build/site/index.html
    seconds: float
    warnings: list[str]


def default_launch() -> Launch:
    """Launch settings from $COURSE_HUB_URL, $COURSE_REPOSITORY (default: git's origin, when it
    is an https URL) and $COURSE_BRANCH, so the main job needs no flags."""
    repository = os.environ.get("COURSE_REPOSITORY") or _origin()
    return Launch(
        hub=os.environ.get("COURSE_HUB_URL", ""),
        repository=repository,
        branch=os.environ.get("COURSE_BRANCH", "main"),
    )


def _origin() -> str:
    proc = subprocess.run(
        ["git", "-C", str(REPO), "remote", "get-url", "origin"], capture_output=True, text=True
    )
    url = proc.stdout.strip().removesuffix(".git")
    return url if proc.returncode == 0 and url.startswith("https://") else ""


# --- reading the run -----------------------------------------------------------------------
def read_page(entry: Entry, build: Path) -> Page:
    """The page of ``entry`` from its executed copy in ``build`` (as `course run` lays it out)."""
    docname = f"{entry.kind}s/{entry.path.stem}"
    executed = output_path(entry.path, build)
    if not executed.is_file():
        return Page(entry, docname, None)
    try:
        meta = nbformat.read(executed, as_version=4).metadata
    except Exception as exc:  # a run cut short can leave a broken file: its page says so
        return Page(entry, docname, None, False, f"unreadable executed notebook: {exc}")
    run, papermill = meta.get("course_run") or {}, meta.get("papermill") or {}
    ok = run.get("ok") if run else (not papermill.get("exception") if papermill else None)
    return Page(entry, docname, executed, ok, run.get("error", ""), papermill.get("duration"))


def opening(nb) -> str:
    """The first paragraph under the notebook's title: what it is about, on one line."""
    for cell in nb.cells:
        if cell.cell_type != "markdown" or PAPERMILL_BANNER in cell.metadata.get("tags", []):
            continue
        paragraphs = [p for p in re.split(r"\n\s*\n", cell.source) if p.strip()]
        body = [p for p in paragraphs if not p.lstrip().startswith("#")]
        if body:
            return " ".join(body[0].split())
    return ""


# --- the notebook passes -------------------------------------------------------------------
def student_page(nb):
    """A lab's executed solution as students may see it (a new notebook)."""
    from course.grading import cells
    from course.release import clear_hidden_tests, clear_solution

    nb = nbformat.from_dict(nb)
    for index, cell in enumerate(nb.cells):
        info = cells.info(cell)
        hidden = cell.cell_type == "code" and "### BEGIN HIDDEN TESTS" in cell.source
        clear_solution(cell, index)
        clear_hidden_tests(cell, index)
        if cell.cell_type == "code" and (info.get("solution") or info.get("grade") or hidden):
            cell.outputs, cell.execution_count = [], None
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                out["traceback"] = [f"{out.get('ename', 'Error')}: {out.get('evalue', '')}"]
    return nb


def mark_failure(nb, page: Page) -> None:
    """Say at the top that the run failed, and mark the cell where it stopped."""
    nb.cells = [c for c in nb.cells if PAPERMILL_BANNER not in c.metadata.get("tags", [])]
    label = "failed-" + re.sub(r"[^a-z0-9]+", "-", page.docname.lower())
    at = next((i for i, c in enumerate(nb.cells) if _stopped_here(c)), None)
    where = f" It stopped at {{ref}}`this cell <{label}>`." if at is not None else ""
    error = page.error.replace("`", "'") or "no error recorded"
    top = _alarm("This notebook failed in this run", f"`{error}`.{where}")
    if at is not None:
        mark = f"({label})=\n" + _alarm("The run stopped at the next cell", f"`{error}`")
        nb.cells.insert(at, nbformat.v4.new_markdown_cell(mark))
    nb.cells.insert(_after_title(nb), nbformat.v4.new_markdown_cell(top))


def _alarm(title: str, body: str) -> str:
    """A red box titled ``title`` (MyST's admonition with the error class)."""
    return f":::{{admonition}} {title}\n:class: error\n\n{body}\n:::\n"


def _stopped_here(cell) -> bool:
    """papermill's mark of the cell that raised or was cut (a kernel death leaves "running")."""
    pm = cell.metadata.get("papermill", {})
    return bool(pm.get("exception")) or pm.get("status") in ("failed", "running")


def _after_title(nb) -> int:
    first = nb.cells[0] if nb.cells else None
    return 1 if first is not None and first.cell_type == "markdown" else 0


def collapse_harness(nb) -> None:
    """Long locked, ungraded code cells (the lab's machinery) start collapsed."""
    for cell in nb.cells:
        info = cell.metadata.get("nbgrader", {})
        long = len(cell.source.splitlines()) > HARNESS_LINES
        if cell.cell_type == "code" and info.get("locked") and not info.get("grade") and long:
            tags = cell.metadata.setdefault("tags", [])
            if "hide-input" not in tags:
                tags.append("hide-input")


def drop_widgets(nb) -> None:
    """A widget needs a kernel (and its JavaScript from a CDN): a note takes its place."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if WIDGET in out.get("data", {}):
                out["data"] = {"text/markdown": WIDGET_NOTE}


def page_notebook(page: Page):
    """The notebook a page renders: the executed copy through the passes above."""
    nb = nbformat.read(page.executed, as_version=4)
    if page.entry.kind == "lab":
        nb = student_page(nb)
    if page.ok is False:
        mark_failure(nb, page)
    collapse_harness(nb)
    drop_widgets(nb)
    return nb


def missing_page(page: Page) -> str:
    """The page of a notebook with no executed copy: it failed before one was written (its
    error says why), or this build did not run it."""
    if page.error:
        box = _alarm("This notebook failed in this run", f"`{page.error.replace('`', chr(39))}`")
    else:
        box = _alarm("Not run in this build", "`course run` left no executed notebook for it.")
    return f"# {page.entry.title}\n\n{box}"


# --- the book's sources --------------------------------------------------------------------
def landing(pages: list[Page], launch: Launch) -> str:
    """index.md: the syllabus as a table, then the chapters for the side bar."""
    rows = []
    for p in pages:
        about = opening(nbformat.read(p.executed, as_version=4)) if p.executed else ""
        took = f"{p.seconds:.0f} s" if p.seconds is not None else "–"
        rows.append(
            f"* - {{doc}}`{p.entry.title} <{p.docname}>`\n\n    {about}\n"
            f"  - {p.entry.budget_s:.0f} s\n  - {took}\n  - {p.status.replace('`', chr(39))}"
        )
    launch_note = (
        "Each notebook's page opens it on JupyterHub or Binder from the rocket button at its top."
        if launch.repository
        else "No repository is set, so pages have no launch links: "
        "`course site --repository URL` (and `--hub URL`) adds them."
    )
    chapters = "".join(
        _toctree(caption, [p.docname for p in pages if p.entry.kind == kind])
        for caption, kind in (("Lectures", "lecture"), ("Labs", "lab"))
    )
    docs = sorted(DOCS.glob("*.md"), key=lambda d: (d.stem != FIRST_DOC, d.stem))
    chapters += _toctree("For instructors", [f"instructors/{d.stem}" for d in docs])
    table = "\n".join(rows)
    return (
        f"# {TITLE}\n\nThe course as its last run left it: every lecture and lab executed "
        "headless on a CPU (`course run`), never again here. Budgets are for a 2-core "
        f"machine (syllabus.yml). {launch_note}\n\n"
        ":::{list-table}\n:header-rows: 1\n:widths: 64 9 9 18\n\n"
        f"* - Notebook\n  - Budget\n  - This run\n  - Status\n{table}\n:::\n{chapters}"
    )


def _toctree(caption: str, docnames: list[str]) -> str:
    return f"\n```{{toctree}}\n:hidden:\n:caption: {caption}\n\n" + "\n".join(docnames) + "\n```\n"


def instructor_page(doc: Path, launch: Launch) -> str:
    """docs/NAME.md for the book: a link to a repository file outside docs/ points into the
    repository when one is set, and is plain text otherwise (the book does not hold it)."""

    def relink(m: re.Match) -> str:
        text, target = m.group(1), m.group(2)
        if re.match(r"[a-z]+:|#", target):
            return m.group(0)
        path = (doc.parent / target.split("#")[0]).resolve()
        if path.parent == DOCS and path.suffix == ".md":
            return m.group(0)
        if launch.repository and path.is_relative_to(REPO):
            rel = path.relative_to(REPO)
            return f"[{text}]({launch.repository}/blob/{launch.branch}/{rel})"
        return text

    return re.sub(r"\[([^\]]*)\]\(([^)\s]+)\)", relink, doc.read_text(encoding="utf-8"))


def conf(launch: Launch) -> str:
    """conf.py of the book: a Sphinx configuration, every value a literal."""
    settings = {
        "project": TITLE,
        "html_title": TITLE,
        "extensions": ["myst_nb"],
        "exclude_patterns": ["**.ipynb_checkpoints"],
        "nb_execution_mode": "off",  # build/ holds the run: never execute again
        "nb_ipywidgets_js": {},  # no require.js nor widget manager from a CDN
        "nb_merge_streams": True,
        "myst_enable_extensions": ["colon_fence", "dollarmath"],
        "myst_update_mathjax": False,  # MathJax 2 below, configured here
        "mathjax_path": "mathjax/MathJax.js",  # jupyter-server-mathjax's copy, in _static
        "mathjax2_config": {
            # the package's one combined configuration (its jax and extensions) and font
            "config": ["TeX-AMS-MML_HTMLorMML-full.js"],
            "tex2jax": {
                "inlineMath": [["\\(", "\\)"]],
                "displayMath": [["\\[", "\\]"]],
                "processEscapes": True,
                "ignoreClass": "document",
                "processClass": "math|output_area",
            },
            "HTML-CSS": {"availableFonts": [], "webFont": "STIX-Web", "imageFont": None},
        },
        "html_theme": "sphinx_book_theme",
        "html_static_path": ["_static"],
        "html_show_sourcelink": False,
        "html_theme_options": {
            "repository_url": launch.repository,
            "repository_branch": launch.branch,
            "path_to_docs": "",  # lectures/ and labs/ of the book are those of the repository
            "use_download_button": True,
            "home_page_in_toc": True,
            "footer_content_items": [],  # no author or copyright line: none is set
            "launch_buttons": {
                "jupyterhub_url": launch.hub if launch.repository else "",
                "binderhub_url": launch.binder if launch.repository else "",
                "notebook_interface": "jupyterlab",
            },
        },
    }
    return "".join(f"{key} = {value!r}\n" for key, value in settings.items())


def write_if_changed(path: Path, text: str) -> None:
    """Sphinx rebuilds what is newer than its last build: an unchanged page keeps its time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


def write_sources(pages: list[Page], src: Path, launch: Launch) -> bool:
    """The book's source folder: conf.py, index.md, a page per notebook, the docs, MathJax.
    True if a page of an earlier build has gone (Sphinx would keep its output)."""
    import jupyter_server_mathjax

    wanted = {src / "conf.py", src / "index.md"}
    write_if_changed(src / "conf.py", conf(launch))
    write_if_changed(src / "index.md", landing(pages, launch))
    for p in pages:
        if p.executed is not None:
            path = src / f"{p.docname}.ipynb"
            write_if_changed(path, nbformat.writes(page_notebook(p)) + "\n")
        else:
            path = src / f"{p.docname}.md"
            write_if_changed(path, missing_page(p))
        wanted.add(path)
    for doc in DOCS.glob("*.md"):
        path = src / "instructors" / doc.name
        write_if_changed(path, instructor_page(doc, launch))
        wanted.add(path)
    gone = [old for old in [*src.glob("*/*.ipynb"), *src.glob("*/*.md")] if old not in wanted]
    for old in gone:
        old.unlink()
    mathjax = src / "_static" / "mathjax"
    if not (mathjax / "MathJax.js").is_file():
        origin = Path(jupyter_server_mathjax.__file__).parent / "static"
        shutil.copytree(origin, mathjax, ignore=shutil.ignore_patterns("a11y", "localization"))
    return bool(gone)


# --- the build -----------------------------------------------------------------------------
def build_site(
    build: Path | str = REPO / "build",
    launch: Launch | None = None,
    entries: list[Entry] | None = None,
) -> Site:
    """Make ``build``/site/ from the executed notebooks in ``build``; execute nothing.

    Sources and Sphinx's cache live in ``build``/.site/, so a second build re-renders only the
    pages whose notebook changed. Raises RuntimeError with Sphinx's output if Sphinx fails.
    """
    build = Path(build).resolve()
    if not build.is_dir():
        raise FileNotFoundError(f"{build} does not exist: run `course run` first (or --build)")
    launch = launch or default_launch()
    start = time.perf_counter()
    pages = [read_page(e, build) for e in (entries or load_syllabus())]
    work = build / ".site"
    if write_sources(pages, work / "src", launch):  # start afresh: no output of a gone page
        shutil.rmtree(work / "html", ignore_errors=True)
        shutil.rmtree(work / "doctrees", ignore_errors=True)
    warnings = work / "warnings.txt"
    # Sphinx writes into .site/html, not site/: myst-nb keeps its images in a folder beside
    # the output folder (jupyter_execute/), which would otherwise land in build/ itself.
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-d", str(work / "doctrees")]
        + ["-w", str(warnings), str(work / "src"), str(work / "html")],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"sphinx failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    mirror(work / "html", build / "site")
    found = [w for w in warnings.read_text().splitlines() if w.strip()] if warnings.exists() else []
    return Site(build / "site" / "index.html", time.perf_counter() - start, found)


def mirror(src: Path, dst: Path) -> None:
    """Make ``dst`` a copy of ``src``: copy what is new or changed, remove what is gone."""
    for path in sorted(src.rglob("*")):
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif not target.is_file() or _differs(path, target):
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
    for path in sorted(dst.rglob("*"), reverse=True):  # children before their folders
        if not (src / path.relative_to(dst)).exists():
            path.unlink() if not path.is_dir() or path.is_symlink() else shutil.rmtree(path)


def _differs(a: Path, b: Path) -> bool:
    sa, sb = a.stat(), b.stat()
    return sa.st_size != sb.st_size or int(sa.st_mtime) != int(sb.st_mtime)
