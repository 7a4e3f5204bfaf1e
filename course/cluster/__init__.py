"""A two-node Slurm cluster on one machine, for real: `scripts/cluster.sh up|down|status|run`.

    up(state)          two network namespaces joined by a veth pair (node1, node2: each its own
                       address and host name), the cores split by cpuset, memory by cgroup, and
                       Debian's Slurm: munged, slurmctld on node1, a slurmd per node
    run(cmd, state)    a command on a node (default the head, node1), e.g. sbatch or squeue
    wait(job, state)   a job's end (every task of an array), or a clear error
    shape(rate, state) the link between the nodes limited to ``rate`` Mbit/s each way (tc tbf)
    lose(node, state)  a node fails: its slurmd and all it started killed at once (a test's
                       fault); restore(node, state) starts its slurmd again
    down(state)        everything above gone again: processes, cgroups, namespaces, files;
                       safe after a failed or half-made ``up`` and when nothing is up
    status(state)      what exists now

Everything it makes carries the cluster's names (``layout``) and its files live in the state
folder (default /var/lib/multigpu-course-cluster), outside any checkout. Needs root.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from course.cluster import cgroups, netns, slurm
from course.cluster.layout import DEFAULT_STATE, Node, hosts_file, nodes

__all__ = [
    "DEFAULT_STATE",
    "NodeLost",
    "command",
    "down",
    "lose",
    "restore",
    "run",
    "shape",
    "status",
    "up",
    "wait",
]


def _nodes_file(state: Path) -> Path:
    return state / "nodes.json"


def saved_nodes(state: Path = DEFAULT_STATE) -> list[Node]:
    """The nodes ``up`` made (as it saved them), else the default layout's names."""
    try:
        rows = json.loads(_nodes_file(state).read_text())
        return [Node(r["name"], r["address"], tuple(r["cpus"]), r["memory_mb"]) for r in rows]
    except FileNotFoundError:
        return nodes(cpus=[0, 1])  # only the names and addresses matter for tearing down


def _check_can_run() -> None:
    if os.geteuid() != 0:
        raise RuntimeError(
            "the cluster needs root (network namespaces, cgroups, Slurm's daemons): run "
            "`sudo scripts/cluster.sh up`"
        )
    slurm.check_installed()
    cgroups.check()


def _start(cmd: list[str], state: Path, log: str) -> None:
    """Run a daemon's command (it forks into the background) and wait for its first process;
    its stdout and stderr go to ``log`` in the state folder."""
    with open(state / "log" / log, "ab") as out:
        proc = subprocess.run(cmd, env=slurm.environment(state), stdout=out, stderr=out)
    if proc.returncode:
        tail = (state / "log" / log).read_text(errors="replace")[-1500:]
        raise RuntimeError(f"`{' '.join(cmd[-3:])}` failed ({proc.returncode}):\n{tail}")


def command(cmd: list[str], node: str = "node1", state: Path = DEFAULT_STATE) -> list[str]:
    """The argv that runs ``cmd`` on ``node`` (its network, host name and hosts file)."""
    found = {n.name: n for n in saved_nodes(state)}
    if node not in found or not netns.exists(found[node]):
        raise RuntimeError(
            f"no node {node!r} is up (nodes: {sorted(found)}): run `scripts/cluster.sh up`"
        )
    return netns.enter(found[node], state / "etc" / "hosts", [], cmd)


def run(cmd: list[str], node: str = "node1", state: Path = DEFAULT_STATE, env=None, **kw):
    """Run ``cmd`` on ``node`` with SLURM_CONF set (and ``env`` added to this process's
    environment, which sbatch passes on to the job); returns the CompletedProcess."""
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    environment = {**slurm.environment(state), **(env or {})}
    return subprocess.run(command(cmd, node, state), env=environment, **kw)


def up(state: Path = DEFAULT_STATE, memory_mb: int = 4096, timeout: float = 60.0) -> str:
    """Make the cluster (see the module's docstring); return ``sinfo``'s table once both nodes
    are idle. Refuses when one is up already; on any failure tears down what it made."""
    _check_can_run()
    made = nodes(memory_mb=memory_mb)
    if _nodes_file(state).exists() or any(netns.exists(n) for n in made):
        raise RuntimeError(
            f"a cluster is up already ({state}): `scripts/cluster.sh status`, or `down` first"
        )
    try:
        state.mkdir(parents=True, exist_ok=True)
        _nodes_file(state).write_text(json.dumps([n.__dict__ for n in made]))
        netns.make(*made)
        cgroups.make(made)
        slurm.write_files(state, made)
        hosts = state / "etc" / "hosts"
        hosts.write_text(hosts_file(made))
        hosts.with_name("resolv.conf").write_text("# no name server on the cluster's network\n")
        join = "".join(f"echo $$ > {p} && " for p in cgroups.procs_files())
        _start(
            ["sh", "-c", join + 'exec "$@"', "munged", *slurm.munged(state)], state, "munged.out"
        )
        head = made[0]
        ctld = netns.enter(head, hosts, cgroups.procs_files(head), ["slurmctld"])
        _start(ctld, state, "slurmctld.out")
        for node in made:
            _start_slurmd(node, state)
        return slurm.wait_until_idle(state, made, lambda c: run(c, head.name, state), timeout)
    except BaseException:
        down(state)
        raise


def _start_slurmd(node: Node, state: Path) -> None:
    slurmd = netns.enter(node, state / "etc" / "hosts", cgroups.procs_files(node), ["slurmd"])
    _start(slurmd, state, f"slurmd-{node.name}.out")


def lose(node: str, state: Path = DEFAULT_STATE) -> None:
    """Node ``node`` fails as a machine does: its slurmd and everything it started (the jobs'
    steps and workers, all in the node's cgroups) are killed at once."""
    found = {n.name: n for n in saved_nodes(state)}
    cgroups.kill(lambda: cgroups.pids(found[node]), timeout=20.0, grace=0.0)


def restore(node: str, state: Path = DEFAULT_STATE, timeout: float = 60.0) -> str:
    """Start ``node``'s slurmd again (after ``lose``); return sinfo once every node is idle
    (ReturnToService=2 puts it back without an administrator)."""
    made = saved_nodes(state)
    _start_slurmd({n.name: n for n in made}[node], state)
    return slurm.wait_until_idle(state, made, lambda c: run(c, made[0].name, state), timeout)


def shape(rate_mbit: float | None, state: Path = DEFAULT_STATE) -> list[str]:
    """Limit what each node sends over the link between them to ``rate_mbit`` Mbit/s (``tc``'s
    token bucket filter on each node's end of the veth pair, as lecture 07 does), or with None
    take the limit away; return the commands run. ``down`` removes it with the namespaces."""
    from helpers.tools.link_rank import shape_command

    done = []
    for node in saved_nodes(state):
        cmd = shape_command(node.veth, rate_mbit)
        proc = subprocess.run(["nsenter", f"--net={netns.NETNS_DIR / node.netns}", *cmd],
                              capture_output=True, text=True)  # fmt: skip
        if proc.returncode and rate_mbit is not None:  # removing no limit is fine
            raise RuntimeError(f"{node.name}: `{' '.join(cmd)}` failed: {proc.stderr.strip()}")
        done.append(f"{node.name}: {' '.join(cmd)}")
    return done


def down(state: Path = DEFAULT_STATE) -> None:
    """Tear everything down (see the module's docstring). Each step runs even when an earlier
    one failed; the first failure is raised at the end."""
    made, errors = saved_nodes(state), []
    steps = [
        # the network namespaces first: clients and daemons not in a cgroup of ours
        *[lambda n=n: cgroups.kill(lambda: set(netns.pids(n))) for n in made],
        lambda: cgroups.remove(made),
        *[lambda n=n: netns.remove(n) for n in made],
        lambda: shutil.rmtree(state) if state.exists() else None,
    ]
    for step in steps:
        try:
            step()
        except Exception as e:  # noqa: BLE001 - the remaining steps must still run
            errors.append(e)
    if errors:
        raise errors[0]


def status(state: Path = DEFAULT_STATE) -> dict:
    """What exists now: each node's namespace and processes, and sinfo where the head is up."""
    made = saved_nodes(state)
    out = {
        "state": str(state),
        "up": _nodes_file(state).exists(),
        "nodes": {
            n.name: {
                "address": n.address,
                "cpus": list(n.cpus),
                "namespace": netns.exists(n),
                "processes": sorted(cgroups.pids(n)),
            }
            for n in made
        },
    }
    if netns.exists(made[0]) and _nodes_file(state).exists():
        out["sinfo"] = run(["sinfo", "-N", "-l"], made[0].name, state).stdout
    return out


class NodeLost(RuntimeError):
    """A job ended because a node it ran on stopped answering (Slurm's NODE_FAIL)."""


DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}


def wait(job: str, state: Path = DEFAULT_STATE, timeout: float = 300.0) -> list[dict]:
    """Wait for job ``job`` (every task of an array) to end; return each task's fields
    (JobId, ArrayTaskId, JobState, ExitCode, NodeList, ...) from ``scontrol show job``.

    Polls every 0.2 s (``sbatch --wait`` backs off to half a minute). A job that lost a node
    while it ran (Slurm ends it as NODE_FAIL, or is ending it: still running, its reason the
    down node) raises ``NodeLost``, naming the node. A job still pending because a node it
    needs is down, or still unfinished at ``timeout``, is cancelled and raised, with Slurm's
    reason: never a silent hang.
    """
    deadline, tasks, ran = time.monotonic() + timeout, [], False
    while time.monotonic() < deadline:
        tasks = slurm.job_fields(run(["scontrol", "show", "job", "-o", job], state=state).stdout)
        ran = ran or any(t.get("JobState") == "RUNNING" for t in tasks)
        _raise_if_a_node_failed(job, tasks, state, ran)
        if tasks and all(t.get("JobState") in DONE for t in tasks):
            return tasks
        time.sleep(0.2)
    run(["scancel", job], state=state)
    states = [(t.get("JobId"), t.get("JobState"), t.get("Reason")) for t in tasks]
    raise TimeoutError(f"job {job} did not end in {timeout:.0f} s ({states}); cancelled it")


def _raise_if_a_node_failed(job: str, tasks: list[dict], state: Path, ran: bool) -> None:
    """``NodeLost`` for a task that lost a node while it ran (``ran``: it was seen running;
    Slurm may have put it back in the queue), RuntimeError for one that cannot start because
    a node it needs is down (cancelled first); nothing otherwise."""
    down = [t for t in tasks if t.get("Reason", "").startswith(slurm.NEVER_STARTS)]
    lost = [t for t in tasks if t.get("JobState") == "NODE_FAIL"]
    lost += [t for t in down if ran or t.get("JobState") in ("RUNNING", "COMPLETING")]
    if lost:
        run(["scancel", job], state=state)  # Slurm is ending it already: make sure
        raise NodeLost(
            f"job {job} lost a node while it ran: {_down_nodes(state) or 'a node'} stopped "
            f"answering (Slurm: {lost[0].get('JobState')}, {lost[0].get('Reason')}). Its "
            "processes on the other nodes are stopped; "
            "resubmit it (from its last checkpoint) once `scripts/cluster.sh status` shows the "
            "node idle again."
        )
    pending = [t for t in down if t.get("JobState") == "PENDING"]
    if pending and _down_nodes(state):
        run(["scancel", job], state=state)
        raise RuntimeError(
            f"job {job} cannot start: node {_down_nodes(state)} is down or drained "
            f"(Slurm: {pending[0]['Reason']}). The job was cancelled; `scripts/cluster.sh "
            "status` shows the nodes, and `down` then `up` makes the cluster afresh."
        )


def _down_nodes(state: Path) -> str:
    """The nodes Slurm has marked down or drained (sinfo's node list), "" when none."""
    proc = run(["sinfo", "-h", "-t", "down,drain,fail", "-o", "%N"], state=state)
    return proc.stdout.strip()
