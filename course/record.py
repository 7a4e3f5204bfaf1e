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
