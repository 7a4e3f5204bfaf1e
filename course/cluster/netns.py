"""The nodes' network: a network namespace per node, joined by one veth pair.

Each node's end of the pair carries its address (``layout.SUBNET``.i/24) and nothing is added
to the host's own namespace, so the cluster is reachable only from inside its nodes, as a
cluster's private network is reachable only from its nodes. ``enter`` builds the command that
runs a program *on* a node: in its network namespace, with its host name (a UTS namespace) and
its /etc/hosts (a private mount namespace with the cluster's hosts file bound over /etc/hosts),
and in its cgroups. Unlike ``ip netns exec`` it leaves /sys as it is, so the cgroup hierarchies
(the device model's quotas, the grader's sandboxes) stay visible on the node.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from course.cluster.layout import Node

NETNS_DIR = Path("/run/netns")  # where `ip netns add` pins each namespace


def _ip(*args: str) -> None:
    """Run ``ip ARGS``; raise with its own message and the command when it fails."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")


def exists(node: Node) -> bool:
    return (NETNS_DIR / node.netns).exists()


def make(a: Node, b: Node) -> None:
    """Two namespaces, a veth pair between them, each end up with its node's address.

    Trusts that neither exists (``up`` removes leftovers first). Loopback is brought up too:
    torchrun's agent on the head node reaches its own rendezvous store through it.
    """
    for node in (a, b):
        _ip("netns", "add", node.netns)
    _ip(
        "link",
        "add",
        a.veth,
        "netns",
        a.netns,
        "type",
        "veth",
        "peer",
        "name",
        b.veth,
        "netns",
        b.netns,
    )
    for node in (a, b):
        _ip("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", node.veth)
        _ip("-n", node.netns, "link", "set", node.veth, "up")
        _ip("-n", node.netns, "link", "set", "lo", "up")


def pids(node: Node) -> list[int]:
    """Every process in ``node``'s network namespace (empty when it is gone)."""
    if not exists(node):
        return []
    proc = subprocess.run(["ip", "netns", "pids", node.netns], capture_output=True, text=True)
    return [int(p) for p in proc.stdout.split()]


def remove(node: Node) -> None:
    """Delete ``node``'s namespace (its end of the veth goes with it, and so does the peer).
    Trusts that no process is left in it: the caller kills them first."""
    if exists(node):
        _ip("netns", "delete", node.netns)


def enter(node: Node, hosts: Path, cgroup_procs: list[Path], command: list[str]) -> list[str]:
    """The command line that runs ``command`` on ``node`` (see the module's docstring).

    ``hosts`` is the cluster's hosts file (an empty ``resolv.conf`` beside it); ``cgroup_procs`` the ``cgroup.procs`` files of the
    node's cgroups, which the shell joins before it execs the command, so the command and
    everything it starts run on the node's cores and within its memory.
    """
    # no name server on the cluster's network: an empty resolv.conf makes a lookup that the
    # hosts file cannot answer fail at once (127.0.0.1:53 refuses) instead of timing out after
    # 5 s trying the host's server (torch's c10d asks for its peers' names that way)
    resolv = hosts.with_name("resolv.conf")
    join = "".join(f"echo $$ > {shlex.quote(str(p))} && " for p in cgroup_procs)
    script = (
        f"{join}mount --bind {shlex.quote(str(hosts))} /etc/hosts && "
        f"mount --bind {shlex.quote(str(resolv))} /etc/resolv.conf && "
        f'hostname {shlex.quote(node.name)} && exec "$@"'
    )
    return [
        "nsenter",
        f"--net={NETNS_DIR / node.netns}",
        "unshare",
        "--uts",
        "--mount",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        script,
        node.name,  # $0 of the script: its name in ps and in error messages
        *command,
    ]
