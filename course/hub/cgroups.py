"""Per-student cgroups: a CPU quota, a memory limit and a process cap, as hub spawners set them.

SystemdSpawner gives each server CPUQuota = cpu_limit x 100 % and MemoryMax = mem_limit;
KubeSpawner gives the pod a CFS quota of cpu_limit CPUs and a memory limit. Here each student's
server gets a cgroup of its own with the same three knobs, read by the same kernel:

- cgroup v1: cpu.cfs_quota_us = cpu_limit x cpu.cfs_period_us, memory.limit_in_bytes (and
  memory.memsw.limit_in_bytes, so swap is no way around it), pids.max; cpuacct.usage is the
  cgroup's own count of the CPU time its processes used;
- cgroup v2: cpu.max, memory.max (memory.swap.max 0), pids.max; cpu.stat's usage_usec.

All of a hub's cgroups live in one tree below the cgroup the hub was started in (in each v1
hierarchy its own folder; v2 one folder): ``<tree>/hub`` holds the hub, its proxy and its
services, ``<tree>/user-<name>`` each student's server and everything it starts. Stopping the
hub kills what is left in the tree and removes it (``kill`` then ``remove``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

V1_CONTROLLERS = ("cpu", "cpuacct", "memory", "pids")
V2_CONTROLLERS = ("cpu", "memory", "pids")
USER_NAME = re.compile(r"^[a-z_][a-z0-9_.-]{0,31}$")


@dataclass(frozen=True)
class Limits:
    """What one student's server may use: CPUs of quota, bytes of memory, tasks (processes and
    threads: the kernel counts both against pids.max). None means no limit."""

    cpu: float | None = None
    memory: int | None = None
    pids: int | None = None


@dataclass(frozen=True)
class Group:
    """One cgroup: its folder in each controller's hierarchy (v1: cpu and cpuacct share one
    folder where they are mounted together), or the one folder of v2 under key ``"v2"``."""

    dirs: dict[str, str]

    @property
    def version(self) -> int:
        return 2 if "v2" in self.dirs else 1

    def folder(self, controller: str) -> Path:
        return Path(self.dirs["v2"] if self.version == 2 else self.dirs[controller])

    def folders(self) -> list[Path]:
        """Each distinct folder once (co-mounted controllers share theirs)."""
        return sorted({Path(d) for d in self.dirs.values()})

    def child(self, name: str) -> Group:
        return Group({c: str(Path(d) / name) for c, d in self.dirs.items()})

    def to_json(self) -> str:
        return json.dumps(self.dirs, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Group:
        return cls(json.loads(text))


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, filesystem type, super options) of each cgroup mount, from mountinfo."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _source, options = (right.split() + ["", "", ""])[:3]
        if fstype in ("cgroup", "cgroup2"):
            out.append((left.split()[4], fstype, set(options.split(","))))
    return out


def _own_paths() -> dict[str, str]:
    """This process's cgroup path in each hierarchy: controller name (or "" for v2) -> path."""
    out = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _id, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def here() -> Group:
    """The cgroup this process is in, in the hierarchies that carry cpu, memory and pids: the
    v1 ones where the cpu controller is mounted as v1 (hybrid machines such as this course's
    CI), else v2. Raises with what to do when neither has them."""
    mounts, own = _mounts(), _own_paths()
    v1 = {}
    for point, fstype, options in mounts:
        for c in V1_CONTROLLERS:
            if fstype == "cgroup" and c in options and c in own:
                v1[c] = str(Path(point) / own[c].lstrip("/"))
    if set(v1) == set(V1_CONTROLLERS):
        return Group(v1)
    for point, fstype, _ in mounts:
        if fstype == "cgroup2" and "" in own:
            folder = Path(point) / own[""].lstrip("/")
            root = Path(point) / "cgroup.controllers"
            if set(V2_CONTROLLERS) <= set(root.read_text().split()):
                return Group({"v2": str(folder)})
    raise RuntimeError(
        "no cgroup hierarchy here carries the cpu, memory and pids controllers (v1: "
        f"{sorted(v1)} mounted), so the hub cannot give students a CPU quota or a memory limit. "
        "Run it on a Linux host or container with cgroups mounted read-write (as root)."
    )


def _write(path: Path, value) -> None:
    path.write_text(f"{value}\n")


def _enable_v2_controllers(parent: Path) -> None:
    """Let ``parent``'s children have cpu, memory and pids (v2's subtree_control)."""
    try:
        _write(parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in V2_CONTROLLERS))
    except OSError as e:
        raise RuntimeError(
            f"cgroup v2: cannot enable cpu, memory and pids below {parent} ({e}). v2 lets a "
            "cgroup with processes in it have no controlled children: start the hub in a "
            "delegated cgroup of its own, e.g. `systemd-run --scope -p Delegate=yes "
            "scripts/hub.sh start`."
        ) from e


def make(group: Group, limits: Limits = Limits()) -> Group:
    """Create ``group`` (its parents must exist) and set ``limits``; returns it. An existing
    folder is reused, its limits set again."""
    for folder in group.folders():
        if group.version == 2:
            _enable_v2_controllers(folder.parent)
        folder.mkdir(exist_ok=True)
    if group.version == 1:
        _limit_v1(group, limits)
    else:
        _limit_v2(group.folder("v2"), limits)
    return group


def _limit_v1(group: Group, limits: Limits) -> None:
    if limits.cpu is not None:
        cpu = group.folder("cpu")
        period = int((cpu / "cpu.cfs_period_us").read_text())
        _write(cpu / "cpu.cfs_quota_us", max(1000, round(limits.cpu * period)))
    if limits.memory is not None:
        memory = group.folder("memory")
        _write(memory / "memory.limit_in_bytes", limits.memory)
        if (memory / "memory.memsw.limit_in_bytes").exists():  # swap accounting is on
            _write(memory / "memory.memsw.limit_in_bytes", limits.memory)
    if limits.pids is not None:
        _write(group.folder("pids") / "pids.max", limits.pids)


def _limit_v2(folder: Path, limits: Limits) -> None:
    if limits.cpu is not None:
        period = 100_000
        _write(folder / "cpu.max", f"{max(1000, round(limits.cpu * period))} {period}")
    if limits.memory is not None:
        _write(folder / "memory.max", limits.memory)
        if (folder / "memory.swap.max").exists():
            _write(folder / "memory.swap.max", 0)
    if limits.pids is not None:
        _write(folder / "pids.max", limits.pids)


def joiner(group: Group):
    """A function of no arguments that moves the calling process into ``group``: safe as a
    preexec_fn (it only opens and writes files whose names were built here, before the fork)."""
    procs = [str(folder / "cgroup.procs") for folder in group.folders()]

    def join() -> None:
        for path in procs:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, b"0")  # 0: the writing process itself
            finally:
                os.close(fd)

    return join


def join(group: Group, pid: int = 0) -> None:
    """Move process ``pid`` (0: this one) and all its threads into ``group``."""
    for folder in group.folders():
        _write(folder / "cgroup.procs", pid)


def pids(group: Group) -> set[int]:
    """The processes in ``group`` itself (not its children); empty if it is gone."""
    found = set()
    for folder in group.folders():
        try:
            found |= {int(p) for p in (folder / "cgroup.procs").read_text().split()}
        except FileNotFoundError:
            pass
    return found


def cpu_seconds(group: Group) -> float:
    """CPU time the group's processes used so far, from the cgroup's own accounting."""
    if group.version == 1:
        return int((group.folder("cpuacct") / "cpuacct.usage").read_text()) / 1e9
    stat = _stat(group.folder("v2") / "cpu.stat")
    return stat["usage_usec"] / 1e6


def throttled(group: Group) -> int:
    """How many CFS periods the group was throttled in: > 0 once it ran into its quota."""
    folder = group.folder("v2" if group.version == 2 else "cpu")
    return _stat(folder / "cpu.stat")["nr_throttled"]


def memory_events(group: Group) -> dict[str, int]:
    """The group's memory events: oom_kill counts processes its OOM killer killed (v1:
    memory.oom_control, with failcnt; v2: memory.events)."""
    if group.version == 2:
        return _stat(group.folder("v2") / "memory.events")
    memory = group.folder("memory")
    events = {"failcnt": int((memory / "memory.failcnt").read_text())}
    events.update(_stat(memory / "memory.oom_control"))
    return events


def memory_peak(group: Group) -> int | None:
    """The most memory the group used at once, in bytes (None where the kernel keeps no peak)."""
    name = "memory.peak" if group.version == 2 else "memory.max_usage_in_bytes"
    path = group.folder("v2" if group.version == 2 else "memory") / name
    return int(path.read_text()) if path.exists() else None


def fork_refusals(group: Group) -> int:
    """How many forks pids.max refused (pids.events: "max N")."""
    folder = group.folder("v2" if group.version == 2 else "pids")
    return _stat(folder / "pids.events").get("max", 0)


def _stat(path: Path) -> dict[str, int]:
    out = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    return out


def kill(group: Group, timeout: float = 10.0) -> None:
    """SIGKILL every process in ``group`` and its children until none is left (a process
    forking while we kill is killed in the next round). Raises if some survive ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        alive = set().union(*(pids(g) for g in walk(group)))
        alive.discard(os.getpid())
        if not alive:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {sorted(alive)} in {group.folders()} survived SIGKILL")
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def walk(group: Group) -> list[Group]:
    """``group`` and every cgroup below it, deepest first (the order rmdir needs)."""
    names = set()
    for folder in group.folders():
        if folder.is_dir():
            names |= {p.name for p in folder.iterdir() if p.is_dir()}
    out = []
    for name in sorted(names):
        out += walk(group.child(name))
    return out + [group]


def remove(group: Group, timeout: float = 10.0) -> None:
    """Remove ``group`` and its children once their processes are gone (kill first). The
    kernel frees a cgroup a moment after its last process exits, so rmdir is retried."""
    deadline = time.monotonic() + timeout
    for g in walk(group):
        for folder in g.folders():
            while folder.exists():
                try:
                    folder.rmdir()
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)


def user_group(tree: Group, user: str) -> Group:
    """The cgroup of ``user``'s server in ``tree``. Trusts nothing: the name must be a local
    user name, so it cannot climb out of the tree."""
    if not USER_NAME.match(user):
        raise ValueError(f"{user!r} is not a local user name ([a-z_][a-z0-9_.-]*)")
    return tree.child(f"user-{user}")
