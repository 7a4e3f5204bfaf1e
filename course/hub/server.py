"""Start and stop the course's JupyterHub: one process in the background, everything it starts
kept in its state folder and its cgroup tree, so ``stop`` can take all of it down again.

``start`` picks free ports for the hub's internal API and the proxy's, runs `jupyterhub -f
course/hub/jupyterhub_config.py` as a session of its own, waits until it answers, and writes
``launch.json`` into the state folder. ``stop`` asks the hub to stop (it stops the students'
servers and its proxy), kills whatever is left in the hub's cgroup tree, removes the tree, and
takes back the folder permissions the hub granted.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from course.hub import accounts, cgroups

REPO = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).with_name("jupyterhub_config.py")
JUPYTERHUB = REPO / ".venv" / "bin" / "jupyterhub"
DEFAULT_STATE = Path("/var/lib/multigpu-course-hub")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process could take it before we bind)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def running(state: Path) -> dict | None:
    """What launch.json says about the hub started from ``state``, if that hub still runs."""
    launch = state / "launch.json"
    if not launch.exists():
        return None
    info = json.loads(launch.read_text())
    return info if psutil.pid_exists(info["pid"]) else None


def start(
    state: Path = DEFAULT_STATE,
    port: int = 8000,
    ip: str = "",
    settings: dict[str, str] | None = None,
    timeout: float = 90.0,
) -> dict:
    """Start the hub on ``ip``:``port`` with its state in ``state``; returns launch.json's
    content (pid, url, port, state, log). ``settings`` are COURSE_HUB_* variables for the
    config (limits, culling, group). Raises with the hub's log if it does not come up."""
    if os.geteuid() != 0:
        raise PermissionError("the hub runs as root: it logs students in and runs their servers")
    state = Path(state).resolve()
    if state == REPO or REPO in state.parents:
        raise ValueError(f"state folder {state} is inside the repository: choose one outside it")
    if info := running(state):
        raise RuntimeError(f"a hub from {state} runs already (pid {info['pid']}): stop it first")
    if not JUPYTERHUB.exists():
        raise FileNotFoundError(f"{JUPYTERHUB} is missing: run scripts/setup.sh")
    state.mkdir(parents=True, exist_ok=True)
    state.chmod(0o700)
    env = {
        **os.environ,
        **(settings or {}),
        "COURSE_HUB_STATE": str(state),
        "COURSE_HUB_IP": ip,
        "COURSE_HUB_PORT": str(port),
        "COURSE_HUB_HUB_PORT": str(free_port()),
        "COURSE_HUB_PROXY_API_PORT": str(free_port()),
    }
    log = state / "hub.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [str(JUPYTERHUB), "-f", str(CONFIG)],
            cwd=state,
            env=env,
            stdout=out,
            stderr=out,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # lives on after `hub.sh start` returns
        )
    url = f"http://{ip or '127.0.0.1'}:{port}"
    info = {"pid": proc.pid, "url": url, "port": port, "state": str(state), "log": str(log)}
    (state / "launch.json").write_text(json.dumps(info))
    try:
        _wait_until_up(url, proc, log, timeout)
    except BaseException:
        stop(state)
        raise
    return info


def _wait_until_up(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/hub/api/", timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            why = "exited" if proc.poll() is not None else f"did not answer in {timeout:.0f} s"
            raise RuntimeError(f"the hub {why}; the end of {log}:\n{log.read_text()[-4000:]}")
        time.sleep(0.3)


def stop(state: Path = DEFAULT_STATE, timeout: float = 60.0) -> None:
    """Stop the hub started from ``state`` and everything it started; safe to call again, and
    after a failed start. The hub gets SIGTERM and ``timeout`` seconds to stop the students'
    servers; then the cgroup tree is killed and removed and granted permissions revoked."""
    state = Path(state).resolve()
    launch = state / "launch.json"
    if launch.exists():
        _terminate(json.loads(launch.read_text())["pid"], timeout)
    tree_file = state / "cgroups.json"
    if tree_file.exists():
        tree = cgroups.Group.from_json(tree_file.read_text())
        if any(f.exists() for f in tree.folders()):
            cgroups.kill(tree)
            cgroups.remove(tree)
        tree_file.unlink()
    _stop_proxy(state)
    accounts.revoke_passage(state / "acl-grants.json")
    for name in ("launch.json", "jupyterhub.pid"):
        (state / name).unlink(missing_ok=True)


def _terminate(pid: int, timeout: float) -> None:
    """SIGTERM ``pid`` (the hub cleans up on it), SIGKILL after ``timeout``; reaps our child."""
    try:
        proc = psutil.Process(pid)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout)
    except psutil.NoSuchProcess:
        return
    except psutil.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _stop_proxy(state: Path) -> None:
    """Kill the proxy if it outlived the hub and its tree (a config that failed before the
    tree existed): only the pid in proxy.pid, and only if it is configurable-http-proxy."""
    pid_file = state / "proxy.pid"
    if not pid_file.exists():
        return
    with contextlib.suppress(psutil.NoSuchProcess, ValueError):
        proc = psutil.Process(int(pid_file.read_text()))
        if "configurable-http-proxy" in " ".join(proc.cmdline()):
            proc.kill()
            proc.wait(10)
    pid_file.unlink(missing_ok=True)


def api_token(state: Path = DEFAULT_STATE) -> str:
    """The token of the hub's "course" service (read users and servers), for course commands."""
    return (Path(state) / "api_token").read_text().strip()
