"""scripts/run_plain.py, the GPU node's headless runner: cell tags, the ipywidgets stub, and
notebooks side by side on disjoint cores, each bounded by its time limit."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import nbformat
import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("run_plain", REPO / "scripts" / "run_plain.py")
run_plain = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(run_plain)


def notebook(path: Path, *cells: str | tuple[str, list[str]]) -> str:
    """A notebook of code cells: a source, or (source, tags)."""
    nb = nbformat.v4.new_notebook()
    for cell in cells:
        source, tags = cell if isinstance(cell, tuple) else (cell, [])
        nb.cells.append(nbformat.v4.new_code_cell(source, metadata={"tags": tags}))
    nbformat.write(nb, path)
    return str(path)


@pytest.mark.parametrize(
    "cores, workers, slices",
    [
        (range(16), 4, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]),
        ([9, 3, 5, 7, 11], 2, [[3, 5], [7, 9, 11]]),  # a node's affinity: any cores, any order
        ([0, 1], 4, [[0], [1]]),  # never two workers on one core
        ([0, 1, 2], 1, [[0, 1, 2]]),
    ],
)
def test_core_slices_are_disjoint_and_cover_the_cores(cores, workers, slices):
    assert run_plain.core_slices(list(cores), workers) == slices


@pytest.mark.parametrize("cores, workers", [(16, 4), (18, 4), (7, 1), (2, 1), (1, 1)])
def test_a_worker_per_four_cores_and_at_least_one(cores, workers):
    assert run_plain.default_workers(cores) == workers


def test_a_cell_tagged_raises_exception_shows_its_traceback_and_the_run_goes_on(tmp_path, capsys):
    path = notebook(
        tmp_path / "nb.ipynb",
        ("raise TimeoutError('the deadlock, caught')", ["raises-exception"]),
        "print('after the deadlock')",
    )
    assert run_plain.run(path)
    out = capsys.readouterr().out
    assert "TimeoutError: the deadlock, caught" in out
    assert "cell 1 raised, as tagged raises-exception" in out
    assert "after the deadlock" in out and f"=== {path}: ok" in out


def test_a_cell_tagged_raises_exception_that_raises_nothing_fails(tmp_path, capsys):
    path = notebook(tmp_path / "nb.ipynb", ("x = 1", ["raises-exception"]), "print('never')")
    assert not run_plain.run(path)
    out = capsys.readouterr().out
    assert "tagged raises-exception but raised nothing" in out
    assert f"=== {path}: FAILED at cell 1/2" in out and "never" not in out


def test_an_untagged_cell_that_raises_stops_the_notebook(tmp_path, capsys):
    path = notebook(tmp_path / "nb.ipynb", "raise ValueError('boom')", "print('never')")
    assert not run_plain.run(path)
    out = capsys.readouterr().out
    assert "ValueError: boom" in out and "FAILED at cell 1/2" in out and "never" not in out


def test_cells_tagged_needs_jupyter_are_skipped_and_only_they(tmp_path, capsys):
    path = notebook(
        tmp_path / "nb.ipynb",
        ("import papermill_is_not_here", ["needs-jupyter"]),
        ("print(results_of_the_sweep)", ["needs-jupyter"]),
        "print('the cell after the sweep runs')",
    )
    assert run_plain.run(path)
    out = capsys.readouterr().out
    assert "cell 1 skipped: tagged needs-jupyter" in out
    assert "cell 2 skipped: tagged needs-jupyter" in out
    assert (
        "the cell after the sweep runs" in out and "(2 cell(s) tagged needs-jupyter skipped)" in out
    )


def test_the_ipywidgets_stub_has_a_spec_for_find_spec(monkeypatch):
    """Lightning asks importlib.util.find_spec("ipywidgets") at import: ValueError on None."""
    monkeypatch.setitem(sys.modules, "ipywidgets", run_plain._widgets_stub())
    assert importlib.util.find_spec("ipywidgets").name == "ipywidgets"
    import ipywidgets

    ipywidgets.IntSlider(value=3).observe(print)  # builds, shows nothing


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no affinity API (macOS)")
def test_side_by_side_each_worker_runs_every_pth_notebook_on_cores_of_its_own(tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    show = "import os; print('cores', sorted(os.sched_getaffinity(0)))"
    paths = [notebook(tmp_path / f"nb{k}.ipynb", show) for k in range(3)]
    paths.append(notebook(tmp_path / "broken.ipynb", "raise ValueError('boom')"))
    logs = tmp_path / "logs"
    assert run_plain.run_side_by_side(paths, logs, timeout=60, workers=2) == 1
    seen = {}
    for k in range(3):
        text = (logs / f"nb{k}.log").read_text()
        assert f"=== {paths[k]}: ok" in text
        seen[k] = next(line for line in text.splitlines() if line.startswith("cores"))
    halves = run_plain.core_slices(cores, 2)
    assert seen[0] == seen[2] == f"cores {halves[0]}"  # worker 1: notebooks 1 and 3
    assert seen[1] == f"cores {halves[1]}"  # worker 2: notebooks 2 and 4
    assert "ValueError: boom" in (logs / "broken.log").read_text()


def test_a_hung_cell_and_what_it_forked_print_their_stacks_before_the_limit(tmp_path):
    """As Lightning's ddp_notebook forks the notebook: the parent's stack alone would show only
    its wait on the child."""
    path = notebook(
        tmp_path / "hang.ipynb",
        "import os, time\n"
        "def child_waits():\n    time.sleep(60)\n"
        "def parent_waits():\n    os.waitpid(pid, 0)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n    child_waits()\n    os._exit(0)\n"
        "parent_waits()",
    )
    log = tmp_path / "hang.log"
    t0 = time.monotonic()
    assert run_plain.run_one(path, log, timeout=8, cores=None) == 1  # its own alarm's exit
    assert time.monotonic() - t0 < 8  # before the kill
    text = log.read_text()
    assert "Timeout" in text and "in parent_waits" in text and f"{path}#cell1" in text
    assert "in child_waits" in text  # the fork's stack, asked for by the runner
    assert f"=== {path}: FAILED (exit status 1)" in text


def test_at_the_limit_the_notebook_and_what_it_started_are_killed(tmp_path):
    pid_file = tmp_path / "child.pid"
    path = notebook(
        tmp_path / "stuck.ipynb",
        # arms no alarm for the cells after it: only the kill can stop them
        "import faulthandler, subprocess, time\n"
        "faulthandler.dump_traceback_later = lambda *args, **kwargs: None",
        "child = subprocess.Popen(['sleep', '600'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(600)",
    )
    log = tmp_path / "stuck.log"
    assert run_plain.run_one(path, log, timeout=3, cores=None) == 124
    assert f"=== {path}: FAILED (killed at the 3 s notebook limit)" in log.read_text()
    pid, deadline = int(pid_file.read_text()), time.monotonic() + 5
    while time.monotonic() < deadline:  # killed; its parent gone, init reaps it
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the notebook's child {pid} outlived the kill")
