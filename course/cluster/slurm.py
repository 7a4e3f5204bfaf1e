"""Debian's Slurm and MUNGE on the cluster: the configuration, the daemons and the clients.

One ``munged`` serves both nodes (its socket is a file, which a network namespace does not
hide); ``slurmctld`` runs on the head node (node1, as on a small cluster whose head also
computes), and a ``slurmd`` on each node, which finds its node's name from its host name. All of
their files live in the state folder, and every command reads ``SLURM_CONF`` there, so nothing
under /etc/slurm or /etc/munge is used or changed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from course.cluster.layout import Node

PROGRAMS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol")


def check_installed(path: str | None = None) -> None:
    """Raise with what to do when a program the cluster runs is missing from ``path`` (default:
    this process's PATH with the admin folders, where Debian puts the daemons)."""
    path = path if path is not None else environment(Path("."))["PATH"]
    missing = [p for p in PROGRAMS if shutil.which(p, path=path) is None]
    if missing:
        raise RuntimeError(
            f"not installed: {', '.join(missing)}. The cluster runs Debian's slurm-wlm and "
            "munge: run scripts/setup.sh (as root it installs them with apt), or "
            "`apt-get install slurm-wlm munge`."
        )


def conf_path(state: Path) -> Path:
    return state / "etc" / "slurm.conf"


def munge_socket(state: Path) -> Path:
    return state / "munge" / "munge.socket"


def config(state: Path, nodes: list[Node]) -> str:
    """slurm.conf: munge through the cluster's own socket, the head node as controller, each
    node with its cores and memory, one partition. Slurm does not move processes between
    cgroups (proctrack/linuxproc, task/none): the node's own cpuset and memory cgroup, which
    slurmd and all it starts are in, are the limits, as on a node the size of its share."""
    head = nodes[0]
    lines = [
        "ClusterName=course",
        f"SlurmctldHost={head.name}({head.address})",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket(state)}",
        f"StateSaveLocation={state}/slurmctld",
        f"SlurmctldPidFile={state}/slurmctld/slurmctld.pid",
        f"SlurmctldLogFile={state}/log/slurmctld.log",
        f"SlurmdSpoolDir={state}/%n/spool",
        f"SlurmdPidFile={state}/%n/slurmd.pid",
        f"SlurmdLogFile={state}/log/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SwitchType=switch/none",
        "MpiDefault=none",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none",
        # a node whose slurmd stops answering is DOWN in 30 s (the tests wait for it; at 10 s a
        # slurmd on a machine loaded past 10 runnable tasks a core was marked DOWN while alive),
        # and one that comes back is usable again without an administrator
        "SlurmdTimeout=30",
        "ReturnToService=2",
        "KillWait=5",
        "MinJobAge=300",
        "InactiveLimit=0",
    ]
    for n in nodes:
        lines.append(
            f"NodeName={n.name} NodeAddr={n.address} CPUs={len(n.cpus)} "
            f"RealMemory={n.memory_mb} State=UNKNOWN"
        )
    names = ",".join(n.name for n in nodes)
    lines.append(f"PartitionName=course Nodes={names} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def environment(state: Path) -> dict[str, str]:
    """The environment a Slurm command needs to find this cluster (and the admin tools)."""
    path = os.environ.get("PATH", "/usr/bin:/bin")
    if "/usr/sbin" not in path.split(":"):
        path += ":/usr/sbin:/sbin"
    return {**os.environ, "SLURM_CONF": str(conf_path(state)), "PATH": path}


def write_files(state: Path, nodes: list[Node]) -> None:
    """The state folder: slurm.conf, a fresh munge key, and the daemons' folders."""
    for sub in ("etc", "munge", "log", "slurmctld", *(n.name + "/spool" for n in nodes)):
        (state / sub).mkdir(parents=True, exist_ok=True)
    (state / "munge").chmod(0o700)  # munged refuses a key or socket folder others may enter
    conf_path(state).write_text(config(state, nodes))
    key = state / "munge" / "munge.key"
    if not key.exists():
        _run(["mungekey", "--create", f"--keyfile={key}"])


def _run(cmd: list[str], env: dict | None = None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def munged(state: Path) -> list[str]:
    """munged's command line: every file of its own in the state folder. It runs as root
    (``--force``: munged would rather run as its own user; the daemons here are all root's)."""
    m = state / "munge"
    return [
        "munged",
        "--force",
        f"--key-file={m / 'munge.key'}",
        f"--socket={munge_socket(state)}",
        f"--pid-file={m / 'munged.pid'}",
        f"--log-file={state / 'log' / 'munged.log'}",
        f"--seed-file={m / 'munged.seed'}",
    ]


def wait_until_idle(state: Path, nodes: list[Node], run_on_head, timeout: float = 60.0) -> str:
    """Wait for every node to be idle in ``sinfo``; return its table. ``run_on_head(cmd)``
    runs a client on the head node. Raises with the daemons' log tails when time runs out."""
    deadline, states = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        proc = run_on_head(["sinfo", "-h", "-N", "-o", "%N %t"])
        states = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
        if proc.returncode == 0 and all(states.get(n.name) == "idle" for n in nodes):
            return run_on_head(["sinfo", "-N", "-l"]).stdout
        time.sleep(0.5)
    raise RuntimeError(
        f"the nodes were not idle after {timeout:.0f} s (sinfo: {states or 'no answer'}).\n"
        + log_tails(state)
    )


def log_tails(state: Path, chars: int = 1500) -> str:
    """The end of each daemon's log, for an error message."""
    out = []
    for log in sorted((state / "log").glob("*.log")):
        out.append(f"--- {log}:\n{log.read_text(errors='replace')[-chars:]}")
    return "\n".join(out)


# how a pending job's Reason begins when a node it needs is down: it will not start until an
# administrator acts (``wait`` also asks sinfo, as "reserved for jobs..." can pass by itself)
NEVER_STARTS = ("ReqNodeNotAvail", "NodeDown", "Nodes_required_for_job_are_DOWN")


def job_fields(text: str) -> list[dict]:
    """``scontrol show job -o`` (one line per job or array task) as a dict per line."""
    rows = []
    for line in text.splitlines():
        fields = {}
        for word in line.split():
            key, sep, value = word.partition("=")
            if sep:
                fields[key] = value
        if fields:
            rows.append(fields)
    return rows
