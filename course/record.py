"""`course record`: execute a notebook and store its outputs in it, ready to commit and check.

Lectures and solutions are committed with outputs so students can read them and nbval can
compare them. Recording normalises what would make a diff noisy or leak the machine: papermill's
metadata and injected cells go, execution counts run 1, 2, 3 ..., and the repository's absolute
path becomes relative.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import nbformat

from course.kernel import KERNEL_NAME, guard_missed_wakeups
from course.syllabus import REPO


def normalise(nb, root: Path = REPO):
    nb.metadata.pop("papermill", None)
    nb.cells = [c for c in nb.cells if "injected-parameters" not in c.metadata.get("tags", [])]
    count = 0
    for cell in nb.cells:
        cell.metadata.pop("papermill", None)
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        count += 1
        cell.execution_count = count if cell.outputs or cell.source.strip() else None
        for out in cell.outputs:
            if "execution_count" in out:
                out["execution_count"] = cell.execution_count
            for key in ("text",):
                if key in out:
                    out[key] = out[key].replace(str(root) + "/", "").replace(str(root), ".")
            if "data" in out and "text/plain" in out["data"]:
                out["data"]["text/plain"] = out["data"]["text/plain"].replace(str(root) + "/", "")
            if out.get("output_type") == "error":
                out["traceback"] = [t.replace(str(root) + "/", "") for t in out["traceback"]]
    return nb


def record(path: Path | str, parameters: dict | None = None, timeout: int = 600) -> Path:
    """Run ``path`` with papermill (project kernel) and write it back with normalised outputs."""
    import papermill

    from course.run import only_expected_errors

    guard_missed_wakeups()
    path = Path(path).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / path.name
        try:
            papermill.execute_notebook(
                str(path),
                str(out),
                parameters=parameters or {},
                kernel_name=KERNEL_NAME,
                cwd=str(path.parent),
                progress_bar=False,
                execution_timeout=timeout,
            )
        except papermill.PapermillExecutionError:
            if not only_expected_errors(out):  # a cell that was not meant to raise did
                raise
        nb = normalise(nbformat.read(out, as_version=4))
    path.write_text(nbformat.writes(nb) + "\n", encoding="utf-8")
    return path


def adopt(
    executed: Path | str, reference: Path | str, profile: str = "quick", to: Path | None = None
) -> Path:
    """Store `course run`'s executed copy of ``reference`` as its recording (in ``reference``, or
    ``to``), when it ran the same code, to the end, with ``profile``; the markdown is the
    notebook's own (prose edited since the build is kept: it changes no output).

    Why: one clean run of the main job on an idle machine is then both the timing the README gives
    and the recording the suite compares later builds against, instead of a second run that
    measures something else. Anything else is refused with what to do: a copy of other code
    would store outputs no cell of the notebook makes.
    """
    executed, reference = Path(executed), Path(reference).resolve()
    if not executed.exists():
        raise SystemExit(f"{executed} does not exist: run `course run --out BUILD` first")
    run = nbformat.read(executed, as_version=4)
    ran = run.metadata.get("course_run")
    source = run.metadata.get("papermill", {}).get("input_path")
    if ran is None or source is None:
        raise SystemExit(f"{executed} was not executed by `course run`: record {reference} instead")
    if not ran.get("ok"):
        raise SystemExit(f"{executed} failed ({ran.get('error')}): fix it and run it again")
    if ran.get("profile") != profile:
        raise SystemExit(f"{executed} ran the {ran.get('profile')!r} profile, not {profile!r}")
    rel = reference.relative_to(REPO)
    root = Path(source).parents[len(rel.parts) - 1]  # the checkout the build ran in
    run.metadata.pop("course_run", None)  # how the build's run ended: checked above
    nb = normalise(run, root)
    stored = nbformat.read(reference, as_version=4)
    differs = _first_difference(nb, stored)
    if differs is not None:
        raise SystemExit(
            f"{executed} ran other code than {rel} ({differs}): build again from this checkout, "
            f"or `course record {rel}`"
        )
    # prose runs nothing: the notebook's own text, edited since the build, is kept
    pairs = zip(nb.cells, stored.cells, strict=True)  # as many cells: checked above
    nb.cells = [y if y.cell_type == "markdown" else x for x, y in pairs]
    to = Path(to) if to is not None else reference
    to.write_text(nbformat.writes(nb) + "\n", encoding="utf-8")
    return to


def _first_difference(executed, reference) -> str | None:
    """Where two notebooks' cells differ in kind or code, or None when they run the same."""
    a = [(c.cell_type, c.source if c.cell_type == "code" else "") for c in executed.cells]
    b = [(c.cell_type, c.source if c.cell_type == "code" else "") for c in reference.cells]
    if len(a) != len(b):
        return f"{len(a)} cells against {len(b)}"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            return f"cell {i} differs"
    return None
