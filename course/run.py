"""`course run`: execute notebooks headless with papermill and index them as HTML in build/."""

from __future__ import annotations

import html
import os
import time
from dataclasses import dataclass
from pathlib import Path

from course.kernel import KERNEL_NAME, guard_missed_wakeups
from course.syllabus import REPO, Entry, load_syllabus


@dataclass
class RunResult:
    entry: Entry
    output: Path  # executed notebook
    html: Path | None
    seconds: float
    ok: bool
    error: str = ""  # first line of the error when not ok

    @property
    def over_budget(self) -> bool:
        return self.seconds > self.entry.budget_s


def select(entries: list[Entry], paths: list[str] | None) -> list[Entry]:
    """The syllabus entries named by ``paths`` (all when none); a path outside it is an error."""
    if not paths:
        return entries
    by_path = {e.path: e for e in entries}
    chosen = []
    for p in paths:
        nb = Path(p).resolve()
        if nb not in by_path:
            known = "\n  ".join(str(e.path.relative_to(REPO)) for e in entries)
            raise SystemExit(f"{p} is not in syllabus.yml; add it there first. Known:\n  {known}")
        chosen.append(by_path[nb])
    return chosen


def execute(entry: Entry, profile: str, out_dir: Path, kernel: str = KERNEL_NAME) -> RunResult:
    """Run one notebook with papermill; never raises for a notebook that fails, records it."""
    import papermill

    guard_missed_wakeups()
    output = output_path(entry.path, out_dir)
    output.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    load_before = os.getloadavg()[0]
    ok, error = True, ""
    try:
        papermill.execute_notebook(
            str(entry.path),
            str(output),
            parameters=entry.parameters(profile),
            kernel_name=kernel,
            cwd=str(entry.path.parent),
            progress_bar=False,
            # A cell may not take longer than the whole notebook's budget, with slack for slow CI.
            execution_timeout=int(entry.budget_s * 3),
        )
    except Exception as exc:  # papermill raises for a failing cell; the batch goes on
        ok = False
        if hasattr(exc, "ename") and only_expected_errors(output):
            ok = True  # every error came from a cell tagged raises-exception, and the run went on
        elif hasattr(exc, "ename"):  # PapermillExecutionError: the cell's exception
            error = f"cell {exc.exec_count}: {exc.ename}: {exc.evalue}".splitlines()[0]
        else:
            error = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    seconds = time.perf_counter() - start
    if output.exists():
        stamp(output, profile, ok, error, max(load_before, os.getloadavg()[0]))
    page = to_html(output) if output.exists() else None
    return RunResult(entry, output, page, seconds, ok, error)


def output_path(notebook: Path, out_dir: Path) -> Path:
    """Where `course run` writes the executed copy of ``notebook``: its place in the repository,
    under ``out_dir``."""
    rel = notebook.relative_to(REPO) if notebook.is_relative_to(REPO) else Path(notebook.name)
    return Path(out_dir) / rel


def stamp(output: Path, profile: str, ok: bool, error: str, load: float | None = None) -> None:
    """Record in the executed notebook how its run ended. papermill alone cannot tell: a cell cut
    at its time limit, or a kernel that died, is marked "completed" like any other cell.
    ``load``: the machine's load average around the run, beside the cores this process may use:
    a timing made where other work held the cores is not one made on free devices."""
    import nbformat

    nb = nbformat.read(output, as_version=4)
    nb.metadata["course_run"] = {"profile": profile, "ok": ok, "error": error}
    if load is not None:
        nb.metadata["course_run"].update(load=round(load, 2), cores=len(os.sched_getaffinity(0)))
    nbformat.write(nb, output)


def only_expected_errors(output: Path) -> bool:
    """True if every error in the executed notebook is in a cell tagged raises-exception.

    papermill runs on past such a cell but still raises at the end (and adds an error banner,
    removed here): a notebook that demonstrates an error on purpose is not a failed run.
    """
    import nbformat

    nb = nbformat.read(output, as_version=4)
    for cell in nb.cells:
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        if errors and "raises-exception" not in cell.metadata.get("tags", []):
            return False
    nb.cells = [c for c in nb.cells if "papermill-error-cell-tag" not in c.metadata.get("tags", [])]
    nb.metadata.get("papermill", {})["exception"] = None
    nbformat.write(nb, output)
    return True


def to_html(notebook: Path) -> Path:
    """Write ``notebook`` as a standalone HTML page beside it (plots embedded)."""
    import nbformat
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_notebook_node(nbformat.read(notebook, as_version=4))
    page = notebook.with_suffix(".html")
    page.write_text(body, encoding="utf-8")
    return page


def write_index(results: list[RunResult], out_dir: Path, profile: str) -> Path:
    """build/index.html: one row per notebook with its status, time and links."""
    rows = []
    for r in results:
        status = "ok" if r.ok else f"FAILED: {html.escape(r.error)}"
        if r.ok and r.over_budget:
            status = f"ok (over its {r.entry.budget_s:.0f} s budget)"
        link = (
            f'<a href="{r.html.relative_to(out_dir)}">{html.escape(r.entry.title)}</a>'
            if r.html
            else html.escape(r.entry.title)
        )
        rows.append(
            f"<tr><td>{link}</td><td>{r.entry.kind}</td><td>{r.seconds:.1f} s</td>"
            f'<td>{status}</td><td><a href="{r.output.relative_to(out_dir)}">ipynb</a></td></tr>'
        )
    page = out_dir / "index.html"
    page.write_text(
        "<!doctype html><meta charset='utf-8'><title>Multi-GPU course: executed notebooks</title>"
        f"<h1>Multi-GPU training with PyTorch</h1><p>Profile <b>{profile}</b>, "
        f"executed {time.strftime('%Y-%m-%d %H:%M')}.</p>"
        "<table border=1 cellpadding=4><tr><th>notebook</th><th>kind</th><th>time</th>"
        "<th>status</th><th>source</th></tr>" + "".join(rows) + "</table>",
        encoding="utf-8",
    )
    return page


def run_notebooks(
    paths: list[str] | None = None,
    profile: str = "quick",
    out_dir: Path | str = REPO / "build",
    progress: bool = True,
) -> list[RunResult]:
    """Execute the syllabus (or the named notebooks) and write build/index.html."""
    from tqdm.auto import tqdm

    out_dir = Path(out_dir).resolve()
    entries = select(load_syllabus(), paths)
    results = []
    bar = tqdm(entries, desc=f"course run ({profile})", unit="nb", disable=not progress)
    for entry in bar:
        bar.set_postfix_str(entry.path.name)
        results.append(execute(entry, profile, out_dir))
    write_index(results, out_dir, profile)
    return results


def summary(results: list[RunResult]) -> str:
    """A plain-text table of time and status per notebook."""
    width = max([len(r.entry.path.name) for r in results] + [8])
    lines = [f"{'notebook':<{width}}  {'seconds':>8}  status"]
    for r in results:
        status = "ok" if r.ok else "FAILED " + r.error
        if r.ok and r.over_budget:
            status += f" (over budget {r.entry.budget_s:.0f} s)"
        lines.append(f"{r.entry.path.name:<{width}}  {r.seconds:8.1f}  {status}")
    total = sum(r.seconds for r in results)
    failed = sum(not r.ok for r in results)
    lines.append(f"{len(results)} notebooks in {total:.1f} s, {failed} failed")
    return "\n".join(lines)
