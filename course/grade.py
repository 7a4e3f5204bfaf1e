"""`course grade LAB SUBMISSIONS [-j N]`: grade every submission, in parallel, in isolation.

For each submission (a notebook file, or a folder holding one):
  assemble   the graded notebook from the source: cells matched by grade_id, so inserted, moved
             or split cells do not matter; tests (with their hidden part) and locked cells come
             from the source, edited or deleted ones are restored and flagged;
  run        it in course.sandbox, isolated (own uid, no network, a bubblewrap file view built
             from an allowlist, private /tmp and PIDs, its slot's cores, cgroup limits,
             rlimits; refused without it), every cell even after failures,
             a per-cell timeout and a wall-clock budget, then kill everything it started;
  check      each test cell in two halves (course.cells): its probe runs in the sandboxed kernel
             and sends plain data out (course.plain); its check runs on that data in a fresh
             interpreter of the grader's (course.verdict), so nothing a submission does to its
             own kernel can make a test pass, and hidden checks never enter the sandbox;
  score      full points when the check runs to its end, a number it ends with is partial
             credit (capped), stderr never costs points; written answers wait for a human.
The gradebook (gradebook.csv) is rewritten atomically after every submission, so Ctrl-C keeps
every finished grade; a re-run skips submissions already graded and unchanged.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import html
import io
import json
import math
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import psutil

from course import cells
from course.release import student_version
from course.verdict import Checker

VERSION = "4"  # part of the resume key: bump when scoring or isolation changes
MAX_SUBMISSION = 64 * 2**20  # bytes of a submitted notebook, outputs included
# Grading slot k runs as uid base + k when the grader is root. Two graders on one machine must
# not share uids (each kills every process of its uids), so each takes a free block of UID_BLOCK
# uids from UID_BASE on, held by a lock for its lifetime; COURSE_GRADE_UID_BASE names one.
UID_BASE = int(os.environ.get("COURSE_GRADE_UID_BASE", "40000"))
UID_BLOCK = 64
UID_BLOCKS = 32
LOCK_DIR = Path(
    os.environ.get(
        "COURSE_GRADE_LOCK_DIR",
        "/run/lock" if os.path.isdir("/run/lock") else tempfile.gettempdir(),
    )
)


class UidsBusy(RuntimeError):
    """Every block of sandbox uids is held by another grader on this machine."""


@contextlib.contextmanager
def uid_block(jobs: int = 1):
    """Hold a block of uids no other grader on this machine uses; yields its first uid.

    A block is taken with an exclusive ``flock`` on a lock file, which the kernel releases when
    this process ends, however it ends: a crashed grader never leaves a block taken. With
    COURSE_GRADE_UID_BASE set, only that block is tried."""
    import fcntl

    if jobs > UID_BLOCK:
        raise ValueError(f"at most {UID_BLOCK} jobs at once (each runs as its own uid), not {jobs}")
    fixed = "COURSE_GRADE_UID_BASE" in os.environ
    bases = [UID_BASE] if fixed else [UID_BASE + k * UID_BLOCK for k in range(UID_BLOCKS)]
    for base in bases:
        # 0600: a sandboxed submission (another uid) cannot open it to hold a block hostage
        fd = os.open(LOCK_DIR / f"course-grade-uids-{base}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        handle = os.fdopen(fd, "r+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            continue
        try:
            yield base
        finally:
            handle.close()  # closing releases the lock
        return
    raise UidsBusy(
        f"uids {bases[0]}..{bases[-1] + UID_BLOCK - 1} are all in use by other graders on this "
        "machine: wait for one to finish"
        + (", or unset COURSE_GRADE_UID_BASE to let this one find a free block" if fixed else "")
    )


@dataclass
class Limits:
    cell_timeout: float = 120.0
    budget: float = 600.0  # wall-clock seconds per submission
    memory: int = 4 * 2**30  # bytes, the whole submission (kernel, ranks, children)
    processes: int = 128
    file_size: int = 100 * 2**20


@dataclass
class Question:
    grade_id: str
    points: float
    manual: bool  # a markdown answer: graded by a person


@dataclass
class Result:
    student: str
    status: str  # graded | invalid | timeout | memory | processes | error
    reason: str = ""
    scores: dict = field(default_factory=dict)  # grade_id -> points (None: manual)
    errors: dict = field(default_factory=dict)  # grade_id -> error text
    flags: list = field(default_factory=list)
    isolation: list = field(default_factory=list)
    seconds: float = 0.0
    key: str = ""

    @property
    def total(self) -> float:
        return round(sum(v for v in self.scores.values() if v is not None), 4)


# -- assembling the graded notebook ------------------------------------------------------------


def blank_scores(qs: list[Question]) -> dict:
    """0 for every automatic question, None (a person grades it) for written answers."""
    return {q.grade_id: (None if q.manual else 0.0) for q in qs}


def questions(source) -> list[Question]:
    return [
        Question(cells.grade_id(c), float(cells.info(c)["points"]), _is_answer(c))
        for c in source.cells
        if cells.is_graded(c)
    ]


def _is_answer(cell) -> bool:
    """A graded cell the student writes (markdown or code): a person grades it."""
    return cell.cell_type == "markdown" or bool(cells.info(cell).get("solution"))


def _notebooks_in(folder: Path) -> tuple[list[Path], str | None]:
    """The folder's notebooks, walking without following links; a reason if anything is unsafe.

    The grader may run as root: a link (or a hard link, or a device file) in a submission could
    make it read the solutions or a classmate's work and show them in the feedback.
    """
    found = []
    for root, dirs, files in os.walk(folder, followlinks=False):
        for name in dirs + files:
            p = Path(root, name)
            st = p.lstat()
            rel = p.relative_to(folder)
            if p.is_symlink():
                return [], f"{rel} is a symbolic link: links are not accepted in a submission"
            if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                return [], f"{rel} is not a regular file: submit only files and folders"
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                return [], f"{rel} is a hard link to another file: submit a copy"
        dirs[:] = [d for d in dirs if d != ".ipynb_checkpoints"]
        found += [Path(root, f) for f in files if f.endswith(".ipynb")]
    return sorted(found), None


def _read_regular(path: Path) -> tuple[bytes | None, str | None]:
    """The bytes of a regular file opened without following a link, or a reason."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        return None, f"{path.name} cannot be read safely ({exc.strerror})"
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return None, f"{path.name} is not a regular file"
        if st.st_nlink > 1:
            return None, f"{path.name} is a hard link to another file: submit a copy"
        raw = f.read(MAX_SUBMISSION + 1)
        if len(raw) > MAX_SUBMISSION:
            return None, (
                f"{path.name} is over {MAX_SUBMISSION // 2**20} MiB: clear its outputs "
                "(Edit > Clear Outputs of All Cells) and submit again"
            )
        return raw, None


def load_submission(path: Path):
    """(notebook, None) or (None, reason) for anything that is not a readable notebook."""
    if path.is_symlink():
        return None, f"{path.name} is a symbolic link: submit the notebook itself"
    if path.is_dir():
        found, refused = _notebooks_in(path)
        if refused:
            return None, refused
        if not found:
            return None, "no .ipynb file in the submission folder"
        path = found[0]
    if path.suffix != ".ipynb":
        return None, f"not a notebook ({path.name})"
    raw, refused = _read_regular(path)
    if refused:
        return None, refused
    if not raw.strip():
        return None, "empty file"
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return None, f"not valid JSON ({str(exc)[:80]})"
    if not isinstance(data, dict) or "cells" not in data and "worksheets" not in data:
        return None, "JSON, but not a notebook (no cells)"
    try:
        nb = nbformat.reads(raw.decode("utf-8"), as_version=4)
    except Exception as exc:
        return None, f"unreadable notebook format ({type(exc).__name__}: {str(exc)[:80]})"
    return nb, None


def _student_cell(cell_type: str, text):
    """A fresh cell holding only the student's text: no metadata, outputs or attachments."""
    text = text if isinstance(text, str) else "".join(text or [])
    if cell_type == "code":
        return nbformat.v4.new_code_cell(text)
    if cell_type == "markdown":
        return nbformat.v4.new_markdown_cell(text)
    return nbformat.v4.new_raw_cell(text)


def assemble(source, submission, parameters: dict | None = None):
    """The notebook to run: the student's answers in the source's frame. Returns (nb, flags)."""
    released = {cells.grade_id(c): c for c in student_version(source).cells if cells.grade_id(c)}
    by_gid = {cells.grade_id(c): c for c in source.cells if cells.grade_id(c)}
    flags, used, out = [], set(), []
    for cell in submission.cells:
        gid = cells.grade_id(cell)
        if gid in used:
            flags.append(
                f"grade_id {gid!r} appears more than once: the copy was run as an ordinary cell"
            )
            gid = None
        src = by_gid.get(gid)
        if src is None:  # a cell the student added (or split off): its source, nothing else
            out.append(_student_cell(cell.cell_type, cell.source))
            if cell.cell_type == "code" and "parameters" in _tags(cell):
                out[-1].metadata["tags"] = ["parameters"]  # where the grading profile goes
            continue
        used.add(gid)
        if (
            cells.info(src).get("solution")
            and not cells.is_locked(src)
            or (cells.info(src).get("solution") and src.cell_type == "markdown")
        ):
            # The student's text in the source's frame: the source decides the cell's type
            # (a written answer turned into code stays text, it does not become a test) and
            # its metadata (nothing the submission wrote reaches the runner or the feedback).
            if cell.cell_type != src.cell_type:
                flags.append(
                    f"answer cell {gid!r} was changed to a {cell.cell_type} cell: "
                    f"graded as the {src.cell_type} cell it is"
                )
            new = _student_cell(src.cell_type, cell.source)
            new.metadata = nbformat.from_dict(src.metadata)
            out.append(new)
        else:
            if cell.cell_type != src.cell_type or cells.checksum(cell) != cells.checksum(
                released[gid]
            ):
                flags.append(f"locked cell {gid!r} was edited: restored from the source")
            out.append(nbformat.from_dict(src))
    # Cells of the source the student deleted: put them back after their predecessor.
    for i, src in enumerate(source.cells):
        gid = cells.grade_id(src)
        if gid is None or gid in used:
            continue
        prev = next(
            (cells.grade_id(c) for c in reversed(source.cells[:i]) if cells.grade_id(c) in used),
            None,
        )
        at = next((k + 1 for k, c in enumerate(out) if prev and cells.grade_id(c) == prev), 0)
        if cells.info(src).get("solution") and not cells.is_graded(src):
            flags.append(f"answer cell {gid!r} is missing: graded as unanswered")
            out.insert(at, nbformat.from_dict(released[gid]))
        else:
            flags.append(f"cell {gid!r} was deleted: restored from the source")
            out.insert(at, nbformat.from_dict(src))
        used.add(gid)
    nb = nbformat.v4.new_notebook(cells=out, metadata=source.metadata)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            if cells.is_graded(cell) and not _is_answer(cell):
                cell.metadata["grader_test"] = True
    if parameters:
        code = "# Parameters (grading profile)\n" + "\n".join(
            f"{k} = {v!r}" for k, v in parameters.items()
        )
        nb.cells.insert(
            _profile_at(nb),
            nbformat.v4.new_code_cell(code, metadata={"tags": ["injected-parameters"]}),
        )
    return nb, flags


def _tags(cell) -> list:
    tags = cell.get("metadata", {}).get("tags", [])
    return tags if isinstance(tags, list) else []


def _profile_at(nb) -> int:
    """Where the grading profile goes: after the notebook's own parameters cell, as papermill
    puts it, so the notebook's defaults never override it. The parameters cell has no grade_id
    (the student's copy of it is theirs); without its tag, the profile goes before the first
    cell of the source, which comes after the defaults in every lab."""
    tagged = [k for k, c in enumerate(nb.cells) if "parameters" in _tags(c)]
    if tagged:
        return tagged[-1] + 1
    return next(
        (k for k, c in enumerate(nb.cells) if c.cell_type == "code" and cells.grade_id(c)), 0
    )


def split_tests(nb) -> dict:
    """Cut each test cell of ``nb`` to its probe (all the sandbox gets); keep the checks here.

    Returns {grade_id: {'check': [(code, hidden), ...], 'names': what the check reads,
    'released': the cell as released}}.
    """
    tests = {}
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.metadata.get("grader_test"):
            probe, check = cells.split_test(cell.source)
            tests[cells.grade_id(cell)] = {
                "check": cells.segments(check),
                "names": cells.exports(cell.source),
                "released": cells.without_hidden(cell.source).rstrip(),
            }
            cell.metadata["grader_test"] = {"exports": cells.exports(cell.source)}
            cell.source = probe
    return tests


# -- isolation --------------------------------------------------------------------------------


def _probe(cmd: list[str]) -> bool:
    try:
        # generous: on a loaded node starting an interpreter in bwrap takes seconds
        return subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


UNSAFE = "unsafe-no-isolation"
ISOLATION_MODES = ("auto", UNSAFE)
UNSAFE_NOTE = (
    "UNSAFE: graded without isolation (--unsafe-no-isolation): the submission ran as the "
    "grader's own user and could read or change anything that user can"
)


class IsolationUnavailable(RuntimeError):
    """Untrusted code would run without isolation: refused, with what to do instead."""


class Isolation:
    """What this machine allows, probed once: uid switching, namespaces, cgroups."""

    def __init__(self, mode: str = "auto", uid_base: int = UID_BASE):
        if mode not in ISOLATION_MODES:
            raise ValueError(f"isolation must be one of {', '.join(ISOLATION_MODES)}, not {mode!r}")
        self.mode = mode
        self.root = os.geteuid() == 0 and mode == "auto"
        self.namespaces = (
            self.root
            and shutil.which("unshare") is not None
            and _probe(["unshare", "--net", "--mount", "--fork", "true"])
        )
        # Can a kernel start as another uid inside bubblewrap's file view? (The probe starts
        # one and imports ipykernel and helpers there.)
        prefix = ["unshare", "--net", "--mount", "--fork", "--"] if self.namespaces else []
        command = [sys.executable, "-m", "course.sandbox", "--probe", str(uid_base)]
        self.bwrap = self.namespaces and shutil.which("bwrap") is not None
        self.uid = self.bwrap and _probe(prefix + command)
        self.cgroup_root = _cgroup_root() if self.root else None

    @property
    def strong(self) -> bool:
        """Own uid and private namespaces: what untrusted code needs before it runs."""
        return bool(self.uid and self.namespaces and self.bwrap)

    def missing(self) -> str:
        reasons = []
        if os.geteuid() != 0:
            reasons.append("the grader is not running as root (it needs to switch uids)")
        elif not self.namespaces:
            reasons.append("`unshare --net --mount` failed (no util-linux, or no namespaces here)")
        elif not self.bwrap:
            reasons.append(
                "bubblewrap is not installed (it builds the submission's file view): "
                "`apt-get install bubblewrap`, or run scripts/setup.sh"
            )
        elif not self.uid:
            reasons.append("a kernel could not start as an unprivileged uid inside bubblewrap")
        return "; ".join(reasons) or "unknown"

    def describe(self) -> list[str]:
        if self.mode == UNSAFE:
            return [UNSAFE_NOTE, "resource limits: CPU time, file size"]
        return [
            "resource limits: CPU time, file size, processes (per uid)",
            "own unprivileged uid, no new privileges",
            "files (bubblewrap): read-only interpreter, environment and the course's helpers; "
            "writable work folder; private /tmp, /var/tmp, /dev/shm; nothing else of the machine",
            "processes: private PID namespace and /proc; environment: an allowlist",
            f"cgroup limits: {self.cgroup_root}"
            if self.cgroup_root
            else "no cgroup: memory and processes watched by polling",
        ]


def _cgroup_root() -> str | None:
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        base = "/sys/fs/cgroup"
    elif Path("/sys/fs/cgroup/pids").is_dir():
        base = "/sys/fs/cgroup/{controller}"
    else:
        return None
    probe = Path(base.format(controller="pids")) / f"course-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
        return base
    except OSError:
        return None


class Group:
    """The submission's processes: a cgroup when possible, plus uid and marker scans."""

    def __init__(self, iso: Isolation, marker: str, uid: int | None, limits: Limits, cpus=None):
        self.marker, self.uid, self.dirs = marker, uid, []
        self.cpuset = False  # the slot's cores enforced by a cpuset (affinity alone can be undone)
        if iso.cgroup_root:
            v2 = "{controller}" not in iso.cgroup_root
            controllers = [
                (
                    "memory",
                    {"memory.max" if v2 else "memory.limit_in_bytes": int(limits.memory * 1.25)},
                ),
                ("pids", {"pids.max": limits.processes}),
            ]
            if cpus:
                parent = Path(iso.cgroup_root.format(controller="cpuset"))
                mems = _read(parent / "cpuset.mems.effective") or _read(parent / "cpuset.mems")
                controllers.append(
                    (
                        "cpuset",
                        {"cpuset.mems": mems or "0", "cpuset.cpus": ",".join(map(str, cpus))},
                    )
                )
            for controller, files in controllers:
                d = Path(iso.cgroup_root.format(controller=controller)) / f"course-grade-{marker}"
                if v2 and self.dirs:
                    d = self.dirs[0]
                try:
                    d.mkdir(exist_ok=True)
                    for name, value in files.items():
                        (d / name).write_text(str(value))
                    if d not in self.dirs:
                        self.dirs.append(d)
                    self.cpuset = self.cpuset or controller == "cpuset"
                except OSError:
                    pass

    def memory(self) -> int | None:
        """Anonymous memory of the whole group from its cgroup (page cache not counted), if any."""
        for d in self.dirs:
            stat = d / "memory.stat"
            if stat.exists():
                values = dict(line.split() for line in stat.read_text().splitlines() if " " in line)
                for key in ("anon", "total_rss"):  # cgroup v2, v1
                    if key in values:
                        return int(values[key])
        return None

    def add(self, pid: int) -> None:
        for d in self.dirs:
            try:
                (d / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass

    def _cgroup_pids(self) -> set[int]:
        pids = set()
        for d in self.dirs:
            try:
                pids.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return pids

    def members(self) -> list[psutil.Process]:
        """Cheap, for polling: the cgroup's list when there is one (everything inherits it)."""
        if self.dirs:
            return _alive(self._cgroup_pids())
        return self.processes()

    def processes(self) -> list[psutil.Process]:
        """Thorough, for killing: cgroup, the job's uid, and the job's marker in the environment."""
        pids = self._cgroup_pids()
        for p in psutil.process_iter(["uids", "environ"]):
            try:
                if self.uid is not None and p.info["uids"] and p.info["uids"].real == self.uid:
                    pids.add(p.pid)
                elif (p.info["environ"] or {}).get("COURSE_GRADE_JOB") == self.marker:
                    pids.add(p.pid)
            except (psutil.Error, TypeError):
                pass
        pids.discard(os.getpid())
        return _alive(pids)

    def kill(self, extra: list[psutil.Process] = ()) -> None:
        """SIGKILL everything until nothing is left (a fork storm respawns for a while)."""
        for _ in range(50):
            procs = self.processes() + [p for p in extra if p.is_running()]
            if not procs:
                break
            for p in procs:
                try:
                    p.send_signal(signal.SIGKILL)
                except psutil.Error:
                    pass
            psutil.wait_procs(procs, timeout=0.2)
        for d in self.dirs:
            try:
                d.rmdir()
            except OSError:
                pass


def _alive(pids) -> list[psutil.Process]:
    """The processes of ``pids`` still there. A submission's process may end between any two
    calls (CI saw one go between pid_exists and Process: "grader error: NoSuchProcess")."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    return procs


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


# -- one submission -----------------------------------------------------------------------------


def _usage(procs) -> tuple[int, int]:
    """(bytes, processes) of a submission without a cgroup to ask: the sum of each process's
    unique memory (USS). Summing RSS would count the pages N ranks share (torch's libraries)
    N times and kill a correct multi-rank submission for memory it does not use."""
    used = 0
    for p in procs:
        try:
            used += p.memory_full_info().uss
        except psutil.Error:
            try:
                used += p.memory_info().rss  # no access to its page map: over-count, not under
            except psutil.Error:
                pass
    return used, len(procs)


def grade_one(
    path: Path,
    source,
    qs: list[Question],
    work: Path,
    limits: Limits,
    iso: Isolation,
    uid: int | None,
    parameters: dict,
    cpus: list[int] | None,
    stop: threading.Event,
) -> Result:
    student = path.stem if path.is_file() else path.name
    start = time.monotonic()
    nb, reason = load_submission(path)
    if nb is None:
        return Result(student, "invalid", reason, blank_scores(qs))
    graded_nb, flags = assemble(source, nb, parameters)
    tests = split_tests(graded_nb)
    marker = uuid.uuid4().hex
    private = Path(tempfile.mkdtemp(prefix="job-", dir=work))
    workdir = Path(tempfile.mkdtemp(prefix=f"grade-{student[:20]}-"))
    if uid is not None:
        os.chown(workdir, uid, uid)
    rlimits = {"RLIMIT_CPU": int(limits.budget) + 5, "RLIMIT_FSIZE": limits.file_size}
    if uid is not None:
        rlimits["RLIMIT_NPROC"] = limits.processes
    env = {  # all the kernel's environment under bwrap (it starts empty): nothing of the grader's
        "PATH": f"{sys.prefix}/bin:/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": str(workdir),
        "TMPDIR": str(workdir),  # caches (torch's inductor, matplotlib) go where rmtree goes
        "USER": "student",
        "LOGNAME": "student",
        "MPLBACKEND": "Agg",
        "HELPERS_LAUNCH_TIMEOUT": str(int(limits.cell_timeout)),
        "COURSE_GRADE_JOB": marker,
    }
    job = {
        "notebook": graded_nb,
        "cell_timeout": limits.cell_timeout,
        "workdir": str(workdir),
        "limits": {"uid": uid, "rlimits": rlimits, "env": env, "cpus": cpus},
        "netns": iso.namespaces,
        "bwrap": iso.strong,
        "isolation": iso.describe(),
    }
    group = Group(iso, marker, uid, limits, cpus)
    if cpus:
        how = "a cpuset" if group.cpuset else "affinity only: the submission could widen it"
        job["isolation"].append(f"cores: {', '.join(map(str, cpus))} ({how})")
    job["cgroups"] = [str(d) for d in group.dirs]
    (private / "job.json").write_text(json.dumps(job))
    os.chmod(private, 0o700)
    read_fd, write_fd = os.pipe()
    prefix = ["unshare", "--net", "--mount", "--fork", "--"] if iso.namespaces else []
    with open(private / "runner.log", "wb") as log:  # the child keeps its own copy of the fd
        runner = subprocess.Popen(
            prefix
            + [sys.executable, "-m", "course.sandbox", str(private / "job.json"), str(write_fd)],
            pass_fds=(write_fd,),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
            env={**os.environ, "COURSE_GRADE_JOB": marker},
        )
    os.close(write_fd)
    group.add(runner.pid)
    result = Result(student, "graded", flags=flags)
    lines = _Reader(read_fd)
    status, reason, notebook, probes = "graded", "", None, {}
    deadline = start + limits.budget
    try:
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
            if stop.is_set():
                status, reason = "interrupted", "grading was interrupted"
                break
            if time.monotonic() > deadline:
                status, reason = (
                    "timeout",
                    f"over the {limits.budget:g} s budget: stopped, later tests score 0",
                )
                break
            procs = group.members() or _alive([runner.pid])
            rss, count = _usage(procs)
            measured = group.memory()
            rss = measured if measured is not None else rss  # summed RSS counts shared pages twice
            if rss > limits.memory:
                status, reason = (
                    "memory",
                    f"used {rss / 2**30:.1f} GiB, over the {limits.memory / 2**30:.1f} GiB limit",
                )
                break
            if count > limits.processes:
                status, reason = (
                    "processes",
                    f"started {count} processes, over the limit of {limits.processes}",
                )
                break
    finally:
        group.kill(_alive([runner.pid]) if runner.poll() is None else [])
        runner.wait()
        lines.close()
        shutil.rmtree(workdir, ignore_errors=True)
    if notebook is None and status == "graded":
        status, reason = "error", reason or "the run ended without a result (see runner.log)"
    if lines.dropped:
        reason = "; ".join(filter(None, [reason, f"{lines.dropped} result(s) over the size cap"]))
    # The verdicts, now that nothing of the submission runs any more: each check on its data.
    outputs = {}
    with open(private / "checker.log", "wb") as log:
        checker = Checker(str(private), limits.cell_timeout, log)
        try:
            for q in qs:
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
                value = q.points if verdict["passed"] else 0.0
                number = verdict.get("value") if verdict["passed"] else None
                if number is not None and math.isfinite(float(number)):
                    value = max(0.0, min(q.points, float(number)))
                elif number is not None:  # checked in the checker too: never a NaN's full marks
                    value, verdict["error"] = 0.0, f"partial credit {number} is not finite"
                result.scores[q.grade_id] = value
                if verdict["error"]:
                    result.errors[q.grade_id] = verdict["error"]
                outputs[q.grade_id] = verdict["outputs"]
        finally:
            checker.close()
    result.scores = {**blank_scores(qs), **result.scores}
    result.status, result.reason, result.seconds = status, reason, time.monotonic() - start
    if iso.mode == UNSAFE:  # said wherever a grade is read: the gradebook and the feedback
        result.reason = "; ".join(filter(None, [reason, "UNSAFE: graded without isolation"]))
        result.flags.append(UNSAFE_NOTE)
    if notebook is not None:
        notebook = nbformat.from_dict(notebook)
        for cell in notebook.cells:  # as the student sees it: the released test, both halves
            gid = cells.grade_id(cell)
            if gid in tests and cell.get("metadata", {}).get("grader_test"):
                cell.source = tests[gid]["released"]
                cell.outputs = list(cell.get("outputs", [])) + [
                    nbformat.from_dict(o) for o in outputs.get(gid, [])
                ]
        nbformat.write(notebook, private / "executed.ipynb")
    result.executed = private / "executed.ipynb" if notebook is not None else None
    return result


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


# -- the batch ----------------------------------------------------------------------------------


def submission_key(
    path: Path, source_bytes: bytes, parameters: dict, limits: Limits, isolation: str = "auto"
) -> str:
    h = hashlib.sha256(
        VERSION.encode() + source_bytes + json.dumps(parameters, sort_keys=True).encode()
    )
    h.update(json.dumps(limits.__dict__, sort_keys=True).encode() + isolation.encode())
    if path.is_symlink():  # refused when graded; never read through here
        return h.hexdigest()
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    for f in files:
        if f.is_file() and not f.is_symlink():
            h.update(
                str(f.relative_to(path) if path.is_dir() else f.name).encode() + f.read_bytes()
            )
    return h.hexdigest()


def write_gradebook(results: dict[str, Result], qs: list[Question], out: Path) -> Path:
    """gradebook.csv, replaced atomically (a reader never sees half a file)."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(
        [
            "student",
            *[f"{q.grade_id} ({q.points:g})" for q in qs],
            "total",
            "max",
            "status",
            "reason",
        ]
    )
    auto_max = sum(q.points for q in qs if not q.manual)
    for name in sorted(results):
        r = results[name]
        row = [
            "manual"
            if r.scores.get(q.grade_id) is None and q.manual
            else r.scores.get(q.grade_id, 0)
            for q in qs
        ]
        w.writerow([name, *row, r.total, auto_max, r.status, r.reason])
    path = out / "gradebook.csv"
    tmp = out / ".gradebook.csv.tmp"
    tmp.write_text(buf.getvalue())
    os.replace(tmp, path)
    return path


CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
PNG = re.compile(r"[A-Za-z0-9+/=\s]+")


def notebook_as_text(nb) -> str:
    """Cells and outputs as escaped text (PNG figures as data images): no HTML of the student's."""
    out = []
    for cell in nb.cells:
        label = "In" if cell.cell_type == "code" else cell.cell_type
        out.append(f"<h4>{label}</h4><pre>{html.escape(cell.source)}</pre>")
        for o in cell.get("outputs", []):
            kind = o.get("output_type")
            if kind == "stream":
                out.append(f"<pre class='{o.get('name') == 'stderr' and 'err' or 'out'}'>")
                out.append(html.escape(ANSI.sub("", str(o.get("text", "")))) + "</pre>")
            elif kind == "error":
                text = "\n".join(o.get("traceback") or []) or f"{o.get('ename')}: {o.get('evalue')}"
                out.append(f"<pre class='err'>{html.escape(ANSI.sub('', text))}</pre>")
            elif kind in ("execute_result", "display_data"):
                data = o.get("data", {})
                png = data.get("image/png")
                if isinstance(png, str) and PNG.fullmatch(png):
                    out.append(f"<img alt='figure' src='data:image/png;base64,{png.strip()}'>")
                elif "text/plain" in data:
                    text = data["text/plain"]
                    text = text if isinstance(text, str) else "".join(text)
                    out.append(f"<pre>{html.escape(text)}</pre>")
    return "".join(out)


def write_feedback(r: Result, qs: list[Question], out: Path) -> Path:
    rows = "".join(
        f"<tr><td>{q.grade_id}</td><td>{'manual' if r.scores.get(q.grade_id) is None else r.scores[q.grade_id]}"
        f"</td><td>{q.points:g}</td><td>{html.escape(r.errors.get(q.grade_id, ''))}</td></tr>"
        for q in qs
    )
    parts = [
        # Nothing in this page may run: a submission's outputs and markdown are shown as text,
        # and the policy forbids scripts, frames and remote loads even if something slips by.
        "<!doctype html><meta charset='utf-8'>",
        f"<meta http-equiv='Content-Security-Policy' content=\"{CSP}\">",
        f"<title>Feedback: {html.escape(r.student)}</title>",
        f"<h1>{html.escape(r.student)}: {r.total:g} points</h1>",
        f"<p>Status: <b>{r.status}</b> {html.escape(r.reason)}</p>",
        "<table border=1 cellpadding=4><tr><th>question</th><th>points</th><th>of</th><th>error</th></tr>",
        rows,
        "</table>",
    ]
    if r.flags:
        parts.append(
            "<h2>Notes</h2><ul>" + "".join(f"<li>{html.escape(f)}</li>" for f in r.flags) + "</ul>"
        )
    parts.append(
        "<h2>Isolation</h2><ul>"
        + "".join(f"<li>{html.escape(f)}</li>" for f in r.isolation)
        + "</ul>"
    )
    executed = getattr(r, "executed", None)
    if executed and Path(executed).exists():
        parts.append(
            "<h2>Your notebook, as graded</h2>"
            + notebook_as_text(nbformat.read(executed, as_version=4))
        )
    path = out / "feedback" / f"{r.student}.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(parts), encoding="utf-8")
    return path


def grade(
    lab,
    submissions,
    out,
    jobs: int = 1,
    limits: Limits | None = None,
    parameters: dict | None = None,
    isolation: str = "auto",
    progress: bool = True,
    shard: tuple[int, int] | str | None = None,
) -> dict[str, Result]:
    """Grade every entry of ``submissions`` against the solution notebook ``lab``.

    ``shard=(k, n)`` or "k/n": only the k-th of n slices (1 ≤ k ≤ n; entry i in name order
    belongs to slice i mod n + 1), for n graders on n machines; ``merge`` joins their folders.

    As root each submission runs as its own uid, from a block of uids that no other grader on
    this machine holds (``uid_block``): graders started side by side never kill each other's
    kernels."""
    with uid_block(max(1, jobs)) as uid_base:
        return _grade(
            lab,
            submissions,
            out,
            jobs,
            limits,
            parameters,
            isolation,
            progress,
            uid_base,
            shard,
        )


def slot_cores(slot: int, jobs: int) -> list[int] | None:
    """The cores grading slot ``slot`` of ``jobs`` may use: an equal share, so a CPU-hungry
    submission slows only itself (None with one slot: all of them). With more slots than
    cores, slots share cores round-robin."""
    cores = sorted(os.sched_getaffinity(0))
    if jobs <= 1:
        return None
    if jobs > len(cores):
        return [cores[slot % len(cores)]]
    share = len(cores) // jobs
    return cores[slot * share : (slot + 1) * share]


def _grade(
    lab,
    submissions,
    out,
    jobs: int = 1,
    limits: Limits | None = None,
    parameters: dict | None = None,
    isolation: str = "auto",
    progress: bool = True,
    uid_base: int = UID_BASE,
    shard: tuple[int, int] | str | None = None,
) -> dict[str, Result]:
    from tqdm.auto import tqdm

    limits = limits or Limits()
    parameters = parameters or {}
    lab, submissions, out = Path(lab).resolve(), Path(submissions).resolve(), Path(out).resolve()
    source_bytes = lab.read_bytes()
    source = nbformat.reads(source_bytes.decode(), as_version=4)
    cells.validate(source)
    qs = questions(source)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results").mkdir(exist_ok=True)
    work = out / ".work"
    work.mkdir(exist_ok=True)
    os.chmod(work, 0o700)
    iso = Isolation(isolation, uid_base)
    if not iso.strong and iso.mode != UNSAFE:
        raise IsolationUnavailable(
            f"refusing to run submissions without isolation: {iso.missing()}. Run `course grade` "
            "as root on Linux (each submission then runs as its own uid in private namespaces), "
            "or, only for code you trust, pass --unsafe-no-isolation (every feedback page and "
            "the gradebook will say so)."
        )
    entries = sorted(p for p in submissions.iterdir() if not p.name.startswith("."))
    k, n = check_shard(shard or (1, 1))
    entries = [p for i, p in enumerate(entries) if i % n == k - 1]
    write_manifest(out, source_bytes, (k, n), entries)
    results: dict[str, Result] = {}
    todo = []
    for path in entries:
        name = path.stem if path.is_file() else path.name
        key = submission_key(path, source_bytes, parameters, limits, iso.mode)
        saved = out / "results" / f"{name}.json"
        if saved.exists():
            data = json.loads(saved.read_text())
            if data.get("key") == key:
                results[name] = Result(**data)
                continue
        todo.append((path, key))

    stop = threading.Event()
    slots = list(range(max(1, jobs)))
    slot_lock = threading.Lock()

    def task(path, key):
        with slot_lock:
            slot = slots.pop()
        try:
            uid = uid_base + slot if iso.uid else None
            cpus = slot_cores(slot, jobs)
            r = grade_one(path, source, qs, work, limits, iso, uid, parameters, cpus, stop)
        except Exception as exc:  # the grader's own bug must not sink the batch either
            r = Result(
                path.stem if path.is_file() else path.name,
                "error",
                f"grader error: {type(exc).__name__}: {exc}",
                blank_scores(qs),
            )
        finally:
            with slot_lock:
                slots.append(slot)
        r.key = key
        return r

    bar = tqdm(total=len(todo), desc=f"grading {lab.stem}", unit="sub", disable=not progress)
    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    futures = [pool.submit(task, p, k) for p, k in todo]
    try:
        for fut in as_completed(futures):
            r = fut.result()
            if r.status != "interrupted":
                write_feedback(r, qs, out)
                saved = {k: v for k, v in r.__dict__.items() if k != "executed"}
                (out / "results" / f"{r.student}.json").write_text(json.dumps(saved))
                results[r.student] = r
                write_gradebook(results, qs, out)
            bar.update(1)
    except KeyboardInterrupt:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        write_gradebook(results, qs, out)
        raise
    finally:
        pool.shutdown(wait=True)
        bar.close()
    write_gradebook(results, qs, out)
    return results


# -- grading on several machines: slices and their merge ----------------------------------------

MANIFEST = "shard.json"


def check_shard(shard) -> tuple[int, int]:
    """(k, n) from (k, n) or 'k/n', checked: 1 ≤ k ≤ n."""
    if isinstance(shard, str):
        parts = shard.split("/")
        if len(parts) != 2 or not all(x.strip().isdigit() for x in parts):
            raise ValueError(f"--shard takes K/N, e.g. 2/4 (the 2nd of 4 slices), not {shard!r}")
        shard = tuple(int(x) for x in parts)
    k, n = shard
    if not 1 <= k <= n:
        raise ValueError(f"shard {k}/{n}: K must be between 1 and N")
    return k, n


def write_manifest(out: Path, source_bytes: bytes, shard: tuple[int, int], entries) -> None:
    """What this folder grades: the lab (by hash), the slice, the students in it."""
    manifest = {
        "lab_sha256": hashlib.sha256(source_bytes).hexdigest(),
        "shard": list(shard),
        "students": [p.stem if p.is_file() else p.name for p in entries],
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))


def merge(lab, shards, out) -> dict[str, Result]:
    """Join the output folders of ``course grade --shard k/n`` (k = 1..n) into one gradebook and
    one feedback folder in ``out``. Refuses slices of another lab or of another n, missing or
    repeated slices, unfinished ones, and a student in two slices: a merged gradebook is whole."""
    lab, out = Path(lab).resolve(), Path(out).resolve()
    source_bytes = lab.read_bytes()
    qs = questions(nbformat.reads(source_bytes.decode(), as_version=4))
    digest = hashlib.sha256(source_bytes).hexdigest()
    seen: dict[int, Path] = {}
    results: dict[str, Result] = {}
    pages: dict[str, Path] = {}
    n = None
    for folder in map(Path, shards):
        path = folder / MANIFEST
        if not path.exists():
            raise ValueError(f"{folder} is not an output folder of `course grade` (no {MANIFEST})")
        manifest = json.loads(path.read_text())
        k, n_here = manifest["shard"]
        if manifest["lab_sha256"] != digest:
            raise ValueError(f"{folder} was graded with another version of {lab.name}: re-grade it")
        if n is not None and n_here != n:
            raise ValueError(f"{folder} is slice {k}/{n_here}; the others are slices of {n}")
        n = n_here
        if k in seen:
            raise ValueError(f"slice {k}/{n} is given twice: {seen[k]} and {folder}")
        seen[k] = folder
        for student in manifest["students"]:
            saved = folder / "results" / f"{student}.json"
            if not saved.exists():
                raise ValueError(
                    f"{folder}: {student} has no result (its grader was interrupted): run the same "
                    "`course grade --shard` again, it grades only what is missing"
                )
            if student in results:
                raise ValueError(f"{student} was graded in two slices, {folder} and another")
            results[student] = Result(**json.loads(saved.read_text()))
            pages[student] = folder / "feedback" / f"{student}.html"
    missing = sorted(set(range(1, (n or 0) + 1)) - set(seen))
    if missing:
        raise ValueError(f"slices {', '.join(f'{k}/{n}' for k in missing)} are missing")
    (out / "results").mkdir(parents=True, exist_ok=True)
    (out / "feedback").mkdir(exist_ok=True)
    for student, r in results.items():
        saved = {k: v for k, v in r.__dict__.items() if k != "executed"}
        (out / "results" / f"{student}.json").write_text(json.dumps(saved))
        if pages[student].exists():
            shutil.copy(pages[student], out / "feedback" / pages[student].name)
    write_gradebook(results, qs, out)
    return results


def summary(results: dict[str, Result]) -> str:
    if not results:
        return "no submissions"
    totals = [r.total for r in results.values()]
    reasons = Counter(r.status for r in results.values() if r.status != "graded")
    text = f"{len(results)} submissions, mean {sum(totals) / len(totals):.2f} points"
    if reasons:
        text += "; not fully run: " + ", ".join(f"{k} {v}" for k, v in reasons.most_common())
    return text
