"""What the two-node cluster is made of: its nodes, their addresses, cores and memory, and where
its files live. Plain data, computed here and nowhere else, so every other module (and a test)
reads the same names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# Outside the checkout: the daemons' spools, logs, munge key and slurm.conf (root's, not a repo's).
DEFAULT_STATE = Path(os.environ.get("COURSE_CLUSTER_STATE", "/var/lib/multigpu-course-cluster"))
SUBNET = "10.237.43"  # a /24 private range used only inside the namespaces the cluster makes
PREFIX = "course-"  # network namespaces, veth ends and the cgroup folder all carry it
CGROUP = "multigpu-course-cluster"  # its folder in the v1 cpuset and memory hierarchies


@dataclass(frozen=True)
class Node:
    """One "node": a host name, an address on the veth link, its cores (a cpuset) and memory."""

    name: str
    address: str
    cpus: tuple[int, ...]
    memory_mb: int

    @property
    def netns(self) -> str:
        return PREFIX + self.name

    @property
    def veth(self) -> str:
        return PREFIX + self.name  # each namespace's end of the pair, named after its node


def split(items: list[int], parts: int) -> list[tuple[int, ...]]:
    """``items`` in ``parts`` contiguous runs, as equal as can be (the first ones longer)."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(tuple(items[start:end]))
        start = end
    return out


def nodes(count: int = 2, memory_mb: int = 4096, cpus: list[int] | None = None) -> list[Node]:
    """``count`` nodes sharing this machine's cores (the ones this process may use) in runs.

    Raises with what to do when there are fewer cores than nodes: a node with no core would
    be a node Slurm could never start a job on.
    """
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    if len(cpus) < count:
        raise RuntimeError(
            f"{count} nodes need a core each and this process may use {len(cpus)} ({cpus}): "
            "run on a machine (or container) with more cores, or make fewer nodes"
        )
    return [
        Node(f"node{i + 1}", f"{SUBNET}.{i + 1}", run, memory_mb)
        for i, run in enumerate(split(cpus, count))
    ]


def hosts_file(all_nodes: list[Node]) -> str:
    """The /etc/hosts every node sees: localhost and each node's name at its address."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    lines += [f"{n.address}\t{n.name}" for n in all_nodes]
    return "\n".join(lines) + "\n"
