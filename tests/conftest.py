"""Shared fixtures: a real Jupyter kernel of the project, and process-leak checks."""

from __future__ import annotations

import os
import queue
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


# The longest test files, longest first (measured with `--durations`: the syllabus's run in two
# halves, the grader's own tests, nbgrader's reading of the labs, then each lab's class grading
# and wrong-answer verdicts).
# scripts/test.sh runs three workers that each take whole files in collection order
# (--dist loadfile): started first, these long files run side by side and the short ones fill
# in after them, rather than one worker grading a lab alone at the end while the others idle.
LONGEST_FIRST = (
    "test_course_run_labs.py",
    "test_course_run.py",
    "test_class_grading.py",  # every lab's class, graded: one file of several minutes
    "test_grade.py",
    "test_hub.py",
    "test_nbgrader_interop.py",
    "test_lab01.py",
    "test_lab03.py",
    "test_grade_redteam.py",
    "test_lab02.py",
    "test_lab04.py",
    "test_lab07.py",
    "test_browser.py",
    "test_lab06.py",
    "test_lab05.py",
)


def pytest_collection_modifyitems(config, items):
    present = {p.name for p in (REPO / "tests").rglob("test_*.py")}
    missing = [name for name in LONGEST_FIRST if name not in present]
    if missing:  # a renamed file would silently lose its place
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FIRST names no file: {missing}")
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(
        key=lambda item: rank.get(item.path.name, len(rank))
    )  # stable: order within a file kept


def descendants(pid: int | None = None) -> list[psutil.Process]:
    """Every live process below ``pid`` (default: this one), zombies included."""
    try:
        return psutil.Process(pid or os.getpid()).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def workers() -> list[psutil.Process]:
    """Launcher ranks anywhere on the machine that belong to this test run's process tree."""
    return [p for p in descendants() if _is_worker(p)]


def _is_worker(p: psutil.Process) -> bool:
    try:
        return is_rank(p)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return True  # a zombie is exactly what we look for


def is_rank(p: psutil.Process) -> bool:
    """A launcher rank: a fork of the rank server, named helpers-rank<k> (helpers._rankserver)."""
    return p.name().startswith("helpers-rank")


def is_rank_server(p: psutil.Process) -> bool:
    return p.name() == "helpers-server"


class Kernel:
    """A running kernel of the project, driven as JupyterLab and papermill drive one."""

    def __init__(self, km, kc):
        self.km, self.kc = km, kc

    @property
    def pid(self) -> int:
        return self.km.provisioner.process.pid

    def execute(self, code: str, timeout: float = 120, on_output=None) -> dict:
        """Run ``code``; return {'status', 'streams': [(t, name, text)], 'error', 'data'}."""
        msg_id = self.kc.execute(code)
        streams, error, data, status = [], None, [], None
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(
                    f"kernel gave no output for {timeout} s running:\n{code}"
                ) from None
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                streams.append((time.monotonic(), content["name"], content["text"]))
                if on_output:
                    on_output(self, streams)
            elif kind == "error":
                error = content
            elif kind in ("execute_result", "display_data"):
                data.append(content["data"])
            elif kind == "status" and content["execution_state"] == "idle":
                break
        while True:  # this request's own reply: a late reply to an earlier one is not it
            reply = self.kc.get_shell_msg(timeout=60)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        status = reply["content"]["status"]
        return {"status": status, "streams": streams, "error": error, "data": data}


@pytest.fixture
def kernel():
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="multigpu-course", cwd=str(REPO))
    try:
        yield Kernel(km, kc)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.fixture
def no_leftovers():
    """Fail a test that leaves launcher ranks (or zombies) behind in this process."""
    import helpers

    yield
    helpers.shutdown()
    left = workers()
    assert not left, f"ranks left behind: {[(p.pid, p.status()) for p in left]}"
