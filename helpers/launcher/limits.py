"""How many devices this process has: every CPU limit a server can be given, the tightest wins.

A laptop limits nothing; a container or a Slurm job narrows the **affinity mask** (a cpuset);
a JupyterHub or Kubernetes server usually gets a **CFS quota** instead: "2 CPUs" of time per
period on a node of 64 cores, with every core in its mask. A quota is invisible to
``os.sched_getaffinity`` and to ``os.cpu_count``, so a reader of the mask alone calls 4 ranks
on that server 4 devices, and the kernel throttles them to 2 CPUs' worth: throttling shown as
scaling. So the device model reads the quota too: cgroup v2 ``cpu.max`` and cgroup v1
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, in this process's cgroup and every ancestor up to
the hierarchy's mount (a parent's quota caps its children).

A Slurm job names its cores on the node in ``SLURM_CPUS_ON_NODE``. Slurm's task plugins
(affinity, cgroup) also narrow the mask, but a cluster without them (``TaskPlugin=task/none``)
leaves every core of the node in it: the allocation is then the only limit the job can see.

A device is a whole core: a quota of 1.5 CPUs is 1 device (two ranks would share 1.5 CPUs and
take turns), a quota under 1 CPU is still 1 device, only a slow one.
Trusts: the files of /proc and of the mounted cgroup hierarchies; a file it cannot read is a
limit it cannot see (never an error).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/")


@dataclass(frozen=True)
class Quota:
    """A CFS quota: ``cpus`` CPUs of time per period, set by the file ``where``."""

    cpus: float
    where: str
    version: int  # cgroup version, 1 or 2


@dataclass(frozen=True)
class CpuLimit:
    """This process's CPUs: the affinity mask, the tightest quota, and the devices they allow."""

    cores: tuple[int, ...] | None  # the affinity mask (None: no affinity API, e.g. macOS)
    machine: int  # os.cpu_count(): the node's cores, for the message
    quota: Quota | None
    slurm: int | None = None  # SLURM_CPUS_ON_NODE: the job's cores on this node

    @property
    def count(self) -> int:
        """Whole devices: cores in the mask, capped by the quota rounded down and by the Slurm
        job's allocation, at least 1."""
        n = len(self.cores) if self.cores is not None else self.machine
        if self.quota is not None:
            n = min(n, self._quota_devices())
        if self.slurm is not None:
            n = min(n, self.slurm)
        return max(1, n)

    def _quota_devices(self) -> int:
        return max(1, math.floor(self.quota.cpus + 1e-9))

    @property
    def source(self) -> str:
        """Which limit set ``count``: "quota", "slurm", "affinity" or "machine"."""
        mask = len(self.cores) if self.cores is not None else None
        if self.count < (mask or self.machine):
            if self.quota is not None and self._quota_devices() == self.count:
                return "quota"
            return "slurm"
        return "affinity" if mask is not None and mask < self.machine else "machine"

    def describe(self) -> str:
        """One sentence: the count, the limit it came from, and why that limit."""
        n = self.count
        devices = f"{n} device{'s' if n != 1 else ''}"
        mask = len(self.cores) if self.cores is not None else self.machine
        if self.source == "quota":
            q = self.quota
            whole = "" if q.cpus == n else " rounded down to whole cores (at least 1),"
            return (
                f"{devices}: a CPU quota of {q.cpus:g} CPU{'s' if q.cpus != 1 else ''} "
                f"(cgroup v{q.version}, {q.where}),{whole} tighter than the {mask} core"
                f"{'s' if mask != 1 else ''} this process may run on; more ranks than that "
                "share the quota and take turns"
            )
        if self.source == "slurm":
            return (
                f"{devices}: the Slurm job's cores on this node (SLURM_CPUS_ON_NODE={self.slurm}), "
                f"fewer than the {mask} core{'s' if mask != 1 else ''} this process may run on"
                f"{self._no_tighter_quota()}"
            )
        if self.source == "affinity":
            return (
                f"{devices}: the affinity mask allows {mask} of the machine's {self.machine} "
                f"cores{self._no_tighter_quota()}"
            )
        return f"{devices}: every core of this machine{self._no_tighter_quota()}"

    def _no_tighter_quota(self) -> str:
        if self.quota is None:
            return " (no CPU quota in this process's cgroups)"
        return f" (the CPU quota of {self.quota.cpus:g} CPUs, {self.quota.where}, allows as many)"


def cpu_limit(root: Path = ROOT) -> CpuLimit:
    """This process's CPU limit, read now (a process can be moved between cgroups).

    ``root`` prefixes every path read (/proc, the cgroup mounts): tests point it at a made-up
    tree to check a cgroup layout this machine does not mount.
    """
    try:
        cores = tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # macOS: no affinity API, and no cgroups either
        cores = None
    return CpuLimit(
        cores=cores, machine=os.cpu_count() or 1, quota=tightest_quota(root), slurm=slurm_cpus()
    )


def slurm_cpus() -> int | None:
    """The Slurm job's cores on this node (``SLURM_CPUS_ON_NODE``), or None outside a job; a
    value that is not a whole number above 0 is no limit (never an error)."""
    raw = os.environ.get("SLURM_CPUS_ON_NODE", "")
    return int(raw) if raw.strip().isdigit() and int(raw) > 0 else None


def tightest_quota(root: Path = ROOT) -> Quota | None:
    """The smallest CFS quota over this process's cgroups and their ancestors, or None."""
    quotas = [
        q
        for mount in _cgroup_mounts(root)
        for d in _own_and_ancestors(root, mount, _membership(root))
        if (q := _quota_in(d, mount.version)) is not None
    ]
    return min(quotas, key=lambda q: q.cpus, default=None)


@dataclass(frozen=True)
class _Mount:
    version: int
    controllers: frozenset[str]  # v1: the hierarchy's controllers; v2: empty (all in one)
    root: str  # the part of the hierarchy mounted here (mountinfo's 4th field)
    point: Path  # where it is mounted, under ``root`` of cpu_limit


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:  # gone, unreadable, or not there at all
        return ""


def _cgroup_mounts(root: Path) -> list[_Mount]:
    """The cgroup hierarchies that can hold a CPU quota: v1 with the cpu controller, and v2."""
    mounts = []
    for line in _read(root / "proc/self/mountinfo").splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if len(fields) < sep + 3 or len(fields) < 5:
            continue
        fstype, options = fields[sep + 1], fields[sep + 3].split(",")
        point = root / fields[4].lstrip("/")
        if fstype == "cgroup2":
            mounts.append(_Mount(2, frozenset(), fields[3], point))
        elif fstype == "cgroup" and "cpu" in options:
            mounts.append(_Mount(1, frozenset(options), fields[3], point))
    return mounts


def _membership(root: Path) -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under "" its v2 path."""
    paths = {}
    for line in _read(root / "proc/self/cgroup").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for c in controllers.split(",") if controllers else [""]:
            paths[c] = path
    return paths


def _own_and_ancestors(root: Path, mount: _Mount, membership: dict[str, str]) -> list[Path]:
    """This process's cgroup folder in ``mount`` and each parent up to the mount point."""
    path = membership.get("" if mount.version == 2 else "cpu")
    if path is None:
        return []
    # Inside a container the hierarchy is often mounted from the container's own cgroup
    # (mountinfo's root, e.g. /docker/abc) while /proc/self/cgroup names the full path.
    if mount.root not in ("/", "") and (path + "/").startswith(mount.root.rstrip("/") + "/"):
        path = path[len(mount.root.rstrip("/")) :]
    leaf = mount.point / path.lstrip("/")
    if not leaf.is_dir():  # a cgroup namespace we cannot map: the mount's own folder
        leaf = mount.point
    folders = [leaf]
    while folders[-1] != mount.point and mount.point in folders[-1].parents:
        folders.append(folders[-1].parent)
    return folders


def _quota_in(folder: Path, version: int) -> Quota | None:
    """The quota set in one cgroup folder, or None (none set, or no such files)."""
    if version == 2:
        text = _read(folder / "cpu.max").split()
        if len(text) != 2 or text[0] == "max":
            return None
        quota, period, where = text[0], text[1], folder / "cpu.max"
    else:
        quota = _read(folder / "cpu.cfs_quota_us").strip()
        period = _read(folder / "cpu.cfs_period_us").strip()
        where = folder / "cpu.cfs_quota_us"
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    if q <= 0 or p <= 0:  # -1: no quota (v1)
        return None
    return Quota(cpus=q / p, where=str(where), version=version)
