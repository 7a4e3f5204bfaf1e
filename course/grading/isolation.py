"""Isolation: what this machine allows, the uids a grader holds, a submission's processes.

``Isolation`` probes once what untrusted code needs before it runs: root (to switch uids),
network and mount namespaces (``unshare``), bubblewrap (the file view; a kernel must start in
it as another uid: ``python -m course.grading.sandbox --probe``), and cgroups. Without them a
batch is refused (``require``), unless the instructor asks for UNSAFE grading of code they
trust, which every page then says. ``uid_block`` gives each grader on a machine its own block
of uids (slot k runs as base + k), held by a lock for its lifetime, so graders side by side
never kill each other's kernels. ``Group`` is one submission's processes (its cgroup, its uid,
a marker in its environment): their memory and count, measured for the runner's watch, and
their end, by SIGKILL until none is left. ``slot_cores`` gives each parallel slot its cores.
Trusts: this machine's tools and kernel interfaces (unshare, bwrap, /sys/fs/cgroup, /proc).
Does not trust: the submission's processes, which may fork, exit, change their affinity or
their environment at any moment (a process gone between two looks is skipped; the cgroup and
the uid find the ones that shed their marker).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

from course.grading.results import Limits

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
        command = [sys.executable, "-m", "course.grading.sandbox", "--probe", str(uid_base)]
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
            # cgroup v1's root is a template, a hierarchy per controller: named, not printed
            "cgroup limits: "
            + self.cgroup_root.replace("/{controller}", " (v1: memory, pids, cpuset)")
            if self.cgroup_root
            else "no cgroup: memory and processes watched by polling",
        ]


def require(iso: Isolation) -> None:
    """Refuse to run submissions without isolation, saying what to do instead (UNSAFE passes)."""
    if not iso.strong and iso.mode != UNSAFE:
        raise IsolationUnavailable(
            f"refusing to run submissions without isolation: {iso.missing()}. Run `course grade` "
            "as root on Linux (each submission then runs as its own uid in private namespaces), "
            "or, only for code you trust, pass --unsafe-no-isolation (every feedback page and "
            "the gradebook will say so)."
        )


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
        """Anonymous memory of the whole group from its cgroup, and what it wrote into its tmpfs
        folders (shared memory: those pages are RAM too); page cache not counted. None without
        a memory cgroup."""
        for d in self.dirs:
            stat = d / "memory.stat"
            if stat.exists():
                values = dict(line.split() for line in stat.read_text().splitlines() if " " in line)
                for anon, shmem in (("anon", "shmem"), ("total_rss", "total_shmem")):  # v2, v1
                    if anon in values:
                        return int(values[anon]) + int(values.get(shmem, 0))
        return None

    def oom_killed(self) -> bool:
        """Whether the memory cgroup killed a process of the group (its limit, 1.25 x the
        grader's, reached between two of the grader's looks: a busy machine can be that slow)."""
        for d in self.dirs:
            for name in ("memory.events", "memory.oom_control"):  # cgroup v2, v1
                for line in _read(d / name).splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and value.strip().isdigit() and int(value) > 0:
                        return True
        return False

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
            return alive(self._cgroup_pids())
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
        return alive(pids)

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


def alive(pids) -> list[psutil.Process]:
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


def usage(procs) -> tuple[int, int]:
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


def grader_devices() -> int:
    """The grader's devices by helpers' device model (imported here: importing helpers loads
    torch, a second the grader pays only when it sizes its slots)."""
    from helpers.launcher.world import cpu_count

    return cpu_count()


def slot_cores(slot: int, jobs: int) -> list[int] | None:
    """The cores grading slot ``slot`` of ``jobs`` may use: an equal share, so a CPU-hungry
    submission slows only itself (None with one slot: all of them). The shares are of the
    devices the grader has (helpers' device model: its cores, capped by its CPU quota, so a
    grader on a hub server with a 2-CPU quota shares 2 devices, not the node's 64 cores). With
    more slots than devices, slots share cores round-robin."""
    cores = sorted(os.sched_getaffinity(0))
    devices = min(len(cores), grader_devices())
    if jobs <= 1:  # one slot: every device; a cpuset says how many when a quota caps them,
        # since the sandbox cannot read the grader's cgroup files to count them itself
        return None if devices == len(cores) else cores[:devices]
    if jobs > devices:
        return [cores[slot % devices]]
    share = devices // jobs
    return cores[slot * share : (slot + 1) * share]


def plan_slots(jobs: int, world: int) -> tuple[int, int]:
    """(slots, cores per slot) for ``jobs`` asked and a lab whose runs start ``world`` ranks:
    a slot gets a device per rank where the grader has them (cores, capped by its CPU quota),
    and there are fewer slots rather than oversubscribed ones (a graded run then times what the
    student's own run timed)."""
    cores = grader_devices()
    per_slot = max(1, min(world, cores))
    return max(1, min(jobs, cores // per_slot)), per_slot


def sized_work_folder(workdir: str, size: int, uid: int | None) -> str:
    """Mount a tmpfs of ``size`` bytes on the work folder, in this runner's own mount namespace
    (`unshare --mount`: the host never sees it, and it is gone with the runner). The per-file
    limit (RLIMIT_FSIZE) does not stop a kernel that writes file after file until the host's
    disk is full, and then the grader's own writes fail for everyone; here the kernel's writes
    end with "No space left on device" in its own folder. The pages count in the submission's
    memory cgroup. Returns the isolation line for the feedback."""
    opts = f"size={size},mode=0700" + (f",uid={uid},gid={uid}" if uid is not None else "")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", opts, "course-work", workdir],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        return f"work folder: on the host's disk (no tmpfs: {done.stderr.strip()[:200]})"
    return f"work folder: a private tmpfs of {size / 2**20:.0f} MiB"


@functools.lru_cache(maxsize=1)
def bwrap_sizes() -> bool:
    """Whether this bubblewrap sizes a tmpfs (``--size``, from 0.7): an older one refuses the
    option, and every kernel would fail to start."""
    try:
        done = subprocess.run(["bwrap", "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return "--size" in done.stdout + done.stderr
