"""`course run` (the README's main job) executes notebooks with the project kernel into build/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_course_run_executes_notebooks_under_papermill_into_an_index(tmp_path):
    """The README's main job, quick profile, on a lecture and a lab: papermill with the project
    kernel, the profile's parameters injected, HTML and an index. (Every syllabus notebook is
    executed once per suite by `course check`, test_check.py: not twice.)"""
    import nbformat

    from course.syllabus import load_syllabus

    out = tmp_path / "build"
    chosen = ["lectures/00_setup_check.ipynb", "solutions/lab01_ddp_scaling.ipynb"]
    proc = subprocess.run(
        [sys.executable, "-m", "course", "run", *chosen, "--profile", "quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 notebooks in" in proc.stdout and "0 failed" in proc.stdout
    index = (out / "index.html").read_text()
    for rel in map(Path, chosen):
        executed = nbformat.read(out / rel, as_version=4)
        assert executed["metadata"]["kernelspec"]["name"] == "multigpu-course"
        assert str(rel.with_suffix(".html")) in index and (out / rel.with_suffix(".html")).exists()
    setup = nbformat.read(out / "lectures" / "00_setup_check.ipynb", as_version=4)
    text = "".join(o.get("text", "") for c in setup.cells for o in c.get("outputs", []))
    assert "[rank 0] I am rank 0 of 2" in text and "[rank 1] I am rank 1 of 2" in text
    lab = nbformat.read(out / "solutions" / "lab01_ddp_scaling.ipynb", as_version=4)
    entries = load_syllabus()
    quick = next(e for e in entries if e.path.name == "lab01_ddp_scaling.ipynb").parameters("quick")
    assert lab.metadata["papermill"]["parameters"] == quick  # the quick profile was injected


def test_a_failing_notebook_is_reported_and_fails_the_run(tmp_path):
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    from course.kernel import KERNELSPEC
    from course.run import execute
    from course.syllabus import Entry

    nb = new_notebook(cells=[new_code_cell("1/0")], metadata={"kernelspec": KERNELSPEC})
    path = tmp_path / "broken.ipynb"
    nbformat.write(nb, path)
    result = execute(Entry(path, "broken", "lecture", 60), "quick", tmp_path / "build")
    assert not result.ok and "ZeroDivisionError" in result.error
    assert result.output.exists() and result.html.exists()


def test_a_notebook_outside_the_syllabus_is_refused():
    proc = subprocess.run(
        [sys.executable, "-m", "course", "run", "tests/nope.ipynb"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "not in syllabus.yml" in proc.stderr
