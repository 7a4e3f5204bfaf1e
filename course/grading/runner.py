"""One submission end to end: read, assemble, run in the sandbox, watch, check, score.

``grade_one`` takes a submission's ``Job`` to its Result: the notebook assembled
(course.grading.assemble) is written as a job into a folder only the grader can enter, and run by
``python -m course.grading.sandbox`` (in private namespaces, its kernel in bubblewrap as the
slot's uid); the grader watches it against the wall-clock budget and the memory and process
limits, reads the probes' data from its result pipe (``_Reader``), kills everything the
submission started, and only then runs each test's check on that data in an interpreter of its
own (course.grading.verdict) and scores it. The executed notebook, as the student will read it
in the feedback, is written last.
Trusts: the solution notebook, the grader's own interpreter and the sandbox runner's process
(started here, root where the grader is root; it runs no student code). Does not trust:
anything on the result pipe (the kernel may have forged it: a line too long is dropped, a probe
for a test that does not exist is ignored, the data is checked only as plain data), nor the
submission's processes (stopped at the first limit they pass, killed whatever they did).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import nbformat

from course.grading import cells, seeds
from course.grading.assemble import assemble, split_tests
from course.grading.isolation import (
    UNSAFE,
    UNSAFE_NOTE,
    Group,
    Isolation,
    alive,
    grader_devices,
    usage,
)
from course.grading.manual import answers_of
from course.grading.results import Limits, Question, Result, blank_scores
from course.grading.sandbox import bwrap_argv
from course.grading.submission import load_submission, student_name
from course.grading.verdict import Checker

CHECK_GRACE_S = 30.0  # s: the checks of a run that used its whole budget (a few s normally)


def launch_cap(cell_timeout: float) -> float:
    """The longest a launch may run inside a graded cell: time left for its diagnosis."""
    return cell_timeout - min(20.0, 0.2 * cell_timeout)


@dataclass
class Job:
    """One submission to grade, and what its run needs (course.grade makes one per submission)."""

    path: Path  # the submission: a notebook, or a folder holding one
    source: object  # the solution notebook it is graded against
    questions: list[Question]
    work: Path  # the job's private folder: its logs and executed notebook stay there
    limits: Limits
    iso: Isolation
    parameters: dict  # the lab's papermill parameters for this grading
    stop: threading.Event  # set: the run ends at once, as "interrupted"
    uid: int | None = None  # the slot's uid (None: the grader's own, unsafe)
    cpus: list[int] | None = None  # the slot's cores (None: every core)
    hidden_seed: int = 0  # COURSE_HIDDEN_SEED in the kernel and the checker (seeds)


def grade_one(job: Job) -> Result:
    """The Result of the submission at ``job.path``, graded against ``job.source`` as
    ``job.uid`` on ``job.cpus``; its logs and executed notebook stay in ``job.work``."""
    path, qs, limits, iso, uid = job.path, job.questions, job.limits, job.iso, job.uid
    student = student_name(path)
    start = time.monotonic()
    nb, reason = load_submission(path)
    if nb is None:
        return Result(student, "invalid", reason, blank_scores(qs))
    graded_nb, flags = assemble(job.source, nb, job.parameters)
    tests = split_tests(graded_nb)
    marker = uuid.uuid4().hex
    private = Path(tempfile.mkdtemp(prefix="job-", dir=job.work))
    workdir = Path(tempfile.mkdtemp(prefix=f"grade-{student[:20]}-"))
    if uid is not None:
        os.chown(workdir, uid, uid)
    told = _sandbox_job(job, graded_nb, workdir, marker)
    group = Group(iso, marker, uid, limits, job.cpus)
    runner, read_fd = _start_runner(private, told, group, iso, marker, job.cpus)
    result = Result(student, "graded", flags=flags, hidden_seed=job.hidden_seed)
    result.answers = answers_of(graded_nb, qs)  # for the written questions' sheets
    lines = _Reader(read_fd)
    try:
        status, reason, notebook, probes = _watch(
            runner, lines, group, limits, job.stop, start + limits.budget, tests, result
        )
        if status == "graded" and group.oom_killed():  # before the group is removed below
            status = "memory"
            reason = (
                f"over the {limits.memory / 2**30:.1f} GiB limit (the kernel was killed for it)"
            )
    finally:
        group.kill(alive([runner.pid]) if runner.poll() is None else [])
        runner.wait()
        lines.close()
        shutil.rmtree(workdir, ignore_errors=True)
    if notebook is None and status == "graded":
        status, reason = "error", reason or "the run ended without a result (see runner.log)"
    if lines.dropped:
        reason = "; ".join(filter(None, [reason, f"{lines.dropped} result(s) over the size cap"]))
    # the checks run on what the submission's code made, so they count against its budget;
    # a run that used all of it still gets CHECK_GRACE_S for what finished before the limit
    checks_until = max(start + limits.budget, time.monotonic() + CHECK_GRACE_S)
    outputs = _score(job, tests, probes, private, result, checks_until)
    result.scores = {**blank_scores(qs), **result.scores}
    result.status, result.reason, result.seconds = status, reason, time.monotonic() - start
    if iso.mode == UNSAFE:  # said wherever a grade is read: the gradebook and the feedback
        result.reason = "; ".join(filter(None, [reason, "UNSAFE: graded without isolation"]))
        result.flags.append(UNSAFE_NOTE)
    executed = _write_executed(notebook, tests, outputs, private)
    result.executed = str(executed) if executed else None
    return result


def _sandbox_job(job: Job, graded_nb, workdir: Path, marker: str) -> dict:
    """What the sandbox runner is told of ``job``: the notebook, its timeouts and its limits, and
    the kernel's whole environment (under bwrap it starts empty: nothing of the grader's)."""
    limits, iso, uid = job.limits, job.iso, job.uid
    rlimits = {"RLIMIT_CPU": int(limits.budget) + 5, "RLIMIT_FSIZE": limits.file_size}
    if uid is not None:
        rlimits["RLIMIT_NPROC"] = limits.processes
    env = {
        "PATH": f"{sys.prefix}/bin:/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": str(workdir),
        "TMPDIR": str(workdir),  # caches (torch's inductor, matplotlib) go where rmtree goes
        # fontconfig's cache: without a writable one it prints "Fontconfig error" into the
        # student's feedback on the first plot
        "XDG_CACHE_HOME": str(workdir),
        "USER": "student",
        "LOGNAME": "student",
        # no MPLBACKEND: ipykernel then sets matplotlib's inline backend, so plt.show() leaves
        # a PNG in the notebook and the student's figures reach the feedback (the launcher's
        # ranks draw with Agg whatever this says)
        # every launch ends (with its diagnosis of where each rank waits) before its cell's time
        # limit interrupts it: the diagnosis needs up to ~15 s to gather every rank's state
        "HELPERS_LAUNCH_TIMEOUT": str(launch_cap(limits.cell_timeout)),
        "HELPERS_LAUNCH_TIMEOUT_CAP": str(launch_cap(limits.cell_timeout)),
        "COURSE_GRADE_JOB": marker,
        seeds.ENV: str(job.hidden_seed),  # the hidden cases of this run (course.grading.seeds)
    }
    return {
        "notebook": graded_nb,
        "cell_timeout": limits.cell_timeout,
        "workdir": str(workdir),
        "limits": {"uid": uid, "rlimits": rlimits, "env": env, "cpus": job.cpus},
        "netns": iso.namespaces,
        "bwrap": iso.strong,
        "work_size": limits.work_size,
        "isolation": iso.describe(),
    }


def _start_runner(private: Path, job: dict, group: Group, iso: Isolation, marker: str, cpus):
    """Write the job into ``private`` (the grader's alone) and start the sandbox runner on it,
    in private namespaces and in the submission's cgroup. Returns (runner, result pipe fd)."""
    if cpus:
        how = "a cpuset" if group.cpuset else "affinity only: the submission could widen it"
        count = f"{len(cpus)} core{'s' if len(cpus) > 1 else ''}"
        job["isolation"].append(f"{count}: cpu {', '.join(map(str, cpus))} ({how})")
    else:  # one slot: the timings a student's run and this one took are on whole machines
        cores = grader_devices()
        job["isolation"].append(
            f"{cores} core{'s' if cores > 1 else ''}: every core of this machine"
        )
    job["cgroups"] = [str(d) for d in group.dirs]
    (private / "job.json").write_text(json.dumps(job))
    os.chmod(private, 0o700)
    read_fd, write_fd = os.pipe()
    prefix = ["unshare", "--net", "--mount", "--fork", "--"] if iso.namespaces else []
    command = [sys.executable, "-m", "course.grading.sandbox", str(private / "job.json")]
    with open(private / "runner.log", "wb") as log:  # the child keeps its own copy of the fd
        runner = subprocess.Popen(
            prefix + command + [str(write_fd)],
            pass_fds=(write_fd,),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
            env={**os.environ, "COURSE_GRADE_JOB": marker},
        )
    os.close(write_fd)
    group.add(runner.pid)
    return runner, read_fd


def _watch(runner, lines, group: Group, limits: Limits, stop, deadline: float, tests, result):
    """Read the runner's messages until it ends or the submission passes a limit.

    Returns (status, reason, the executed notebook or None, {grade_id: probe message}); the
    isolation the runner reports goes into ``result``. A probe for no test of ours is ignored."""
    status, reason, notebook, probes = "graded", "", None, {}
    while True:
        msg = lines.next(timeout=0.25)
        if msg is not None:
            if "isolation" in msg:
                result.isolation = msg["isolation"]
            elif "grade_id" in msg:
                if msg["grade_id"] in tests:
                    probes[msg["grade_id"]] = msg
            elif "notebook" in msg:
                notebook = msg["notebook"]
                if msg.get("dead"):
                    reason = msg["dead"]
            elif "fatal" in msg:
                status, reason = "error", msg["fatal"]
            continue
        if lines.eof and runner.poll() is not None:
            break
        stopped = _past_a_limit(runner, group, limits, stop, deadline)
        if stopped:
            status, reason = stopped
            break
    return status, reason, notebook, probes


def _past_a_limit(runner, group: Group, limits: Limits, stop, deadline: float):
    """(status, reason) if the run must stop now (interrupted, budget, memory, processes)."""
    if stop.is_set():
        return "interrupted", "grading was interrupted"
    if time.monotonic() > deadline:
        return "timeout", f"over the {limits.budget:g} s budget: stopped, later tests score 0"
    procs = group.members() or alive([runner.pid])
    rss, count = usage(procs)
    measured = group.memory()
    rss = measured if measured is not None else rss  # summed RSS counts shared pages twice
    if rss > limits.memory:
        return (
            "memory",
            f"used {rss / 2**30:.1f} GiB, over the {limits.memory / 2**30:.1f} GiB limit",
        )
    if count > limits.processes:
        return "processes", f"started {count} processes, over the limit of {limits.processes}"
    return None


def _score(job: Job, tests: dict, probes: dict, private: Path, result, deadline=None):
    """The verdicts, now that nothing of the submission runs any more: each check on its data,
    in a checker of the grader's. Scores and errors go into ``result``; returns each test's
    check outputs, for the executed notebook."""
    limits, iso, uid = job.limits, job.iso, job.uid
    outputs = {}
    sandbox, checkdir = None, None
    if iso is not None and iso.strong and uid is not None:
        checkdir = Path(tempfile.mkdtemp(prefix="check-"))
        os.chown(checkdir, uid, uid)
        sandbox = (bwrap_argv(str(checkdir), limits.work_size), uid)
        result.isolation.append(f"checks: as uid {uid} in bubblewrap, no network")
    with open(private / "checker.log", "wb") as log:
        checker = Checker(
            str(private),
            limits.cell_timeout,
            log,
            {seeds.ENV: str(job.hidden_seed)},
            # the submission's own memory and file limits and its slot's cores
            {"memory": limits.memory, "file_size": limits.file_size, "cpus": job.cpus},
            deadline,
            sandbox,
        )
        try:
            for q in job.questions:
                probe = probes.get(q.grade_id)
                if probe is None:
                    continue
                if probe.get("probe_error"):
                    verdict = {"passed": False, "error": str(probe["probe_error"]), "outputs": []}
                else:
                    test = tests[q.grade_id]
                    verdict = checker.check(
                        test["check"], probe.get("data"), q.grade_id, test["names"]
                    )
                result.scores[q.grade_id] = _points(q, verdict)
                if verdict["error"]:
                    result.errors[q.grade_id] = verdict["error"]
                outputs[q.grade_id] = verdict["outputs"]
        finally:
            checker.close()
            if checkdir is not None:
                shutil.rmtree(checkdir, ignore_errors=True)
    return outputs


def _points(q: Question, verdict: dict) -> float:
    """Full points for a check that ran to its end; a number it ended with is partial credit,
    capped to [0, points]. A number that is not finite scores 0, and says so in the verdict."""
    value = q.points if verdict["passed"] else 0.0
    number = verdict.get("value") if verdict["passed"] else None
    if number is not None and math.isfinite(float(number)):
        value = max(0.0, min(q.points, float(number)))
    elif number is not None:  # checked in the checker too: never a NaN's full marks
        value, verdict["error"] = 0.0, f"partial credit {number} is not finite"
    return value


def _write_executed(notebook, tests: dict, outputs: dict, private: Path) -> Path | None:
    """The executed notebook as the student sees it, each test with both halves as released
    and its check's outputs; written to ``private``. None when the run gave no notebook."""
    if notebook is None:
        return None
    notebook = nbformat.from_dict(notebook)
    for cell in notebook.cells:
        gid = cells.grade_id(cell)
        if gid in tests and cell.get("metadata", {}).get("grader_test"):
            cell.source = tests[gid]["released"]
            cell.outputs = list(cell.get("outputs", [])) + [
                nbformat.from_dict(o) for o in outputs.get(gid, [])
            ]
    # a lone surrogate (JSON may hold one in a student's text) cannot be UTF-8: written as the
    # \uXXXX escape it came as, which reads back the same
    text = nbformat.writes(notebook)
    (private / "executed.ipynb").write_text(text, encoding="utf-8", errors="backslashreplace")
    return private / "executed.ipynb"


class _Reader:
    """JSON lines from the runner's result pipe, read without blocking past a timeout.

    A line longer than MAX_LINE (the notebook's sources, its capped outputs and one probe's
    capped data fit well below it) is dropped as it streams, so the grader's memory stays
    bounded whatever comes down the pipe."""

    MAX_LINE = 128 * 2**20

    def __init__(self, fd: int):
        self.fd, self.buf, self.eof = fd, b"", False
        self.skipping, self.dropped = False, 0  # inside an over-long line; how many so far

    def next(self, timeout: float):
        import select

        while True:
            if b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                if self.skipping:  # the tail of a dropped line
                    self.skipping = False
                    continue
                if len(line) > self.MAX_LINE:  # whole in the buffer: one read completed it
                    self.dropped += 1
                    continue
                try:
                    return json.loads(line)
                except ValueError:
                    return None
            if self.eof or not select.select([self.fd], [], [], timeout)[0]:
                return None
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                self.eof = True
            self.buf += chunk
            if b"\n" not in self.buf and len(self.buf) > self.MAX_LINE:
                self.buf, self.skipping, self.dropped = b"", True, self.dropped + 1

    def close(self) -> None:
        os.close(self.fd)
