"""Several torchrun agents on this host, standing in for several nodes (lecture 07).

    res = multinode.agents("helpers.tools.multinode:whoami", nnodes=2, nproc_per_node=1)
    res["results"]      # what each rank returned, in rank order (as launch() returns)
    res["logs"]         # each agent's output: its rendezvous, its workers, restarts

Each agent is one ``torchrun`` process, as on a cluster one runs per node (Slurm's ``srun``
starts them); they find each other through a c10d rendezvous on a TCP endpoint of the first
"node". Ranks then run ``helpers.run``, the same entry point as on a real cluster. With
``max_restarts`` an agent whose worker dies restarts the whole group (elastic training): every
worker starts again from the top, so real training code resumes from a checkpoint.
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from helpers.tools.rendezvous import RendezvousUnreachable, reach  # noqa: F401 (re-exported)


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1, for the rendezvous endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun() -> str:
    """The torchrun of this interpreter's environment."""
    found = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which(
        "torchrun"
    )
    if found is None:
        raise FileNotFoundError(
            "torchrun not found: it comes with torch; activate the course's venv"
        )
    return found


def command(
    target: str,
    args=(),
    nnodes: int = 2,
    nproc_per_node: int = 1,
    node: int = 0,
    port: int = 29400,
    run_id: str = "course",
    max_restarts: int = 0,
    out: str | None = None,
    host: str = "127.0.0.1",
) -> list[str]:
    """The torchrun command line of agent ``node`` (what one types on each node); the
    rendezvous is at ``host``:``port``, hosted by node 0."""
    cmd = [
        torchrun(),
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{host}:{port}",
        "--rdzv-id",
        run_id,
        # node 0 hosts the rendezvous store; on a cluster it is the first host of the job
        "--rdzv-conf",
        f"is_host={'true' if node == 0 else 'false'}",
        "--max-restarts",
        str(max_restarts),
        "-m",
        "helpers.run",
        target,
        *map(str, args),
    ]
    return cmd + (["--out", out] if out else [])


def wait_all(procs: list, timeout: float, grace: float = 15.0) -> tuple[bool, list[str]]:
    """Wait for every process (a torchrun agent, a rank): (whether the time ran out, each one's
    output).

    Once one agent has failed, the others get ``grace`` seconds and are then stopped: torchrun
    would otherwise hold each of them in its exit barrier (5 minutes) waiting for the dead one.
    A reader thread per agent keeps its pipe from filling up while it runs.
    """
    outputs: list[list[str]] = [[] for _ in procs]
    readers = [
        threading.Thread(target=lambda p=p, out=out: out.append(p.stdout.read()), daemon=True)
        for p, out in zip(procs, outputs, strict=True)
    ]
    for t in readers:
        t.start()
    deadline, failed_at = time.monotonic() + timeout, None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.poll() for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + grace):
            break
        time.sleep(0.1)
    timed_out = failed_at is None and any(p.poll() is None for p in procs)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    for t in readers:
        t.join()
    return timed_out, ["".join(out) for out in outputs]


def agents(
    target: str,
    *args,
    nnodes: int = 2,
    nproc_per_node: int = 1,
    max_restarts: int = 0,
    timeout: float = 240,
    env: dict | None = None,
    endpoint: str | None = None,
) -> dict:
    """Start ``nnodes`` torchrun agents here, wait for them, return results, logs and commands.

    ``endpoint`` (HOST:PORT): the rendezvous, by default a free port on 127.0.0.1. One that
    cannot be reached raises ``RendezvousUnreachable`` (see ``reach``) before any agent starts.
    """
    if endpoint is None:
        host, port = "127.0.0.1", free_port()
    else:
        reach(endpoint, timeout=min(timeout, 30.0))
        host, _, port_text = endpoint.rpartition(":")
        port = int(port_text)
    folder = Path(tempfile.mkdtemp(prefix="agents-"))
    out = folder / "results.pkl"
    procs, commands = [], []
    for node in range(nnodes):
        cmd = command(
            target,
            args,
            nnodes,
            nproc_per_node,
            node,
            port,
            f"course-{port}",
            max_restarts,
            str(out),
            host,
        )
        commands.append(cmd)
        procs.append(
            subprocess.Popen(
                cmd,
                env={**os.environ, **(env or {})},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        timed_out, logs = wait_all(procs, timeout)
        if timed_out:
            tails = "\n".join(log[-1500:] for log in logs)
            raise TimeoutError(
                f"the torchrun agents did not finish in {timeout} s. The end of their output:\n{tails}"
            )
        codes = [p.returncode for p in procs]
        if any(codes):
            raise RuntimeError(f"torchrun agents exited with {codes}:\n" + "\n".join(logs)[-4000:])
        results = pickle.loads(out.read_bytes())
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # nothing left in /tmp, whatever happened
    return {"results": results, "logs": logs, "commands": commands, "codes": codes}


def whoami(fail_first_attempt_on: int | None = None) -> dict:
    """Where this rank runs: its ranks, its node, its process, its agent's restart count.

    ``fail_first_attempt_on``: that global rank dies on its agent's first attempt (before any
    collective), to show an elastic restart; the restarted group then succeeds. The count is
    per agent: with several agents only the one whose worker died counts a restart.
    """
    rank = dist.get_rank()
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank == fail_first_attempt_on and restarts == 0:
        os._exit(1)  # a crash, not an exception: the agent sees a dead worker
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {
        "rank": rank,
        "local rank": int(os.environ["LOCAL_RANK"]),
        "node": int(os.environ.get("GROUP_RANK", "0")),
        "world": dist.get_world_size(),
        "pid": os.getpid(),
        "restarts": restarts,
        "sum of ranks": t.item(),
    }


def train_digits(epochs: int = 1, batch: int = 32) -> dict:
    """Lab 01's MLP (512 x 4) on the shifted digits, DDP on this world at ``batch`` per rank:
    a module-level function, so torchrun's workers can import it by name (lecture 07)."""
    import hashlib

    from helpers.optimisation import large_batch
    from helpers.workloads import data, models

    train_set, test_set = data.load("digits-shifted"), data.load("digits-shifted", train=False)
    n = dist.get_world_size()
    sgd = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)  # noqa: E731
    recipe = large_batch.Recipe(n * batch, batch, 1, epochs, lambda step: 0.05, sgd, seed=0)
    r = large_batch.train(lambda: models.mlp(hidden=512, depth=4), train_set, test_set, recipe)
    return {
        "rank": dist.get_rank(),
        "node": int(os.environ.get("GROUP_RANK", "0")),
        "world": n,
        "test accuracy": r["epochs"][-1]["test accuracy"],
        "weights sum": float(sum(p.double().sum() for p in r["state"].values())),
        # every bit of every weight: two runs with the same digest trained the same model
        "weights sha1": hashlib.sha1(
            b"".join(p.detach().cpu().contiguous().numpy().tobytes() for p in r["state"].values())
        ).hexdigest()[:16],
    }


def all_reduce_for(seconds: float = 120.0) -> dict:
    """All-reduce one number again and again for ``seconds``: a job long enough to lose a node
    in (tests/cluster). Returns how many all-reduces this rank finished."""
    t, count, end = torch.ones(1), 0, time.monotonic() + seconds
    while time.monotonic() < end:
        dist.all_reduce(t)
        count += 1
    return {"rank": dist.get_rank(), "all-reduces": count}
