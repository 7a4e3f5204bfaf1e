"""The nodes' share of the machine: a cgroup v1 cpuset (their cores) and memory limit each.

Layout, in each of the cpuset and memory hierarchies (v1, as on this course's machines):
``<root>/multigpu-course-cluster`` holds the cluster's shared services (munged) and a child per
node, ``.../node1``, ``.../node2``, which holds that node's daemons and every job they start
(Slurm is configured not to move processes itself: proctrack/linuxproc, task/none). Tearing
down kills what is in the tree, deepest first, then removes the folders.

Trusts that the v1 cpuset and memory controllers are mounted at /sys/fs/cgroup/<controller>
(``check`` says otherwise, with what to do).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from course.cluster.layout import CGROUP, Node

ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("cpuset", "memory")


def check() -> None:
    """Raise with what to do unless the v1 cpuset and memory hierarchies are writable here."""
    for c in CONTROLLERS:
        if not (ROOT / c / "cgroup.procs").exists():
            raise RuntimeError(
                f"no cgroup v1 {c} hierarchy at {ROOT / c}: the cluster splits cores by cpuset "
                "and memory by v1 memory cgroups. Run it as root on a host (or privileged "
                "container) with cgroup v1 cpuset and memory mounted."
            )


def folder(controller: str, node: Node | None = None) -> Path:
    """The cluster's folder in ``controller``'s hierarchy, or ``node``'s below it."""
    base = ROOT / controller / CGROUP
    return base / node.name if node else base


def procs_files(node: Node | None = None) -> list[Path]:
    """The ``cgroup.procs`` of the cluster's (or ``node``'s) cgroup in each hierarchy."""
    return [folder(c, node) / "cgroup.procs" for c in CONTROLLERS]


def _write(path: Path, value) -> None:
    path.write_text(f"{value}\n")


def make(nodes: list[Node]) -> None:
    """The cluster's cgroups: all its cores above, each node's run of cores and memory below."""
    parent_cpuset = ROOT / "cpuset"
    mems = (parent_cpuset / "cpuset.mems").read_text().strip()
    all_cpus = ",".join(str(c) for n in nodes for c in n.cpus)
    for c in CONTROLLERS:
        folder(c).mkdir(exist_ok=True)
    # a v1 cpuset takes no process until both its cpus and mems are set
    _write(folder("cpuset") / "cpuset.cpus", all_cpus)
    _write(folder("cpuset") / "cpuset.mems", mems)
    for node in nodes:
        for c in CONTROLLERS:
            folder(c, node).mkdir(exist_ok=True)
        _write(folder("cpuset", node) / "cpuset.cpus", ",".join(map(str, node.cpus)))
        _write(folder("cpuset", node) / "cpuset.mems", mems)
        memory = folder("memory", node)
        _write(memory / "memory.limit_in_bytes", node.memory_mb * 2**20)
        if (memory / "memory.memsw.limit_in_bytes").exists():  # swap is no way around it
            _write(memory / "memory.memsw.limit_in_bytes", node.memory_mb * 2**20)


def pids(node: Node | None = None) -> set[int]:
    """Processes in the cluster's (or ``node``'s) own cgroups, not their children's."""
    found = set()
    for path in procs_files(node):
        try:
            found |= {int(p) for p in path.read_text().split()}
        except FileNotFoundError:
            pass
    return found


def kill(pids_of, timeout: float = 10.0, grace: float = 3.0) -> None:
    """SIGTERM what ``pids_of()`` lists, then SIGKILL what is left after ``grace`` seconds
    (0: SIGKILL at once, as a machine that loses power), until none.

    ``pids_of`` is called again and again: a daemon may fork while it is being stopped.
    """
    deadline, sig = time.monotonic() + timeout, signal.SIGTERM
    grace = time.monotonic() + grace
    while found := pids_of():
        if time.monotonic() > grace:
            sig = signal.SIGKILL
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {sorted(found)} outlived SIGKILL for {timeout} s")
        for pid in found:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def remove(nodes: list[Node]) -> None:
    """Kill everything in the cluster's cgroups and remove them; nothing there is fine."""
    for node in nodes:
        kill(lambda node=node: pids(node))
    kill(pids)
    for c in CONTROLLERS:
        for node in nodes:
            _rmdir(folder(c, node))
        _rmdir(folder(c))


def _rmdir(path: Path) -> None:
    try:
        path.rmdir()
    except FileNotFoundError:
        pass
