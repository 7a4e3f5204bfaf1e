"""The rank server: one fresh interpreter that imports torch once and forks ranks on request.

Every rank of ``helpers.launch`` used to be its own interpreter, and each spent about 2 s of CPU
importing torch before it could join its group: on a 2-core laptop a world of 4 waited 4 s, and
a grader paid it for every rank of every submission. The server pays it once per kernel. It is
started like a rank always was (a fresh interpreter, never a fork of the kernel, so CUDA in the
notebook does no harm) and it never touches CUDA or runs a torch op itself, so each fork starts
from the state a rank would have right after ``import torch``.

What a forked rank gets, so that it behaves as a fresh interpreter would:
  - its own session (killed as a unit with its children), stdout/stderr on the launcher's pipes;
  - the kernel's environment as it was when the server started, plus the rank's own variables
    (the launcher starts a new server when the kernel's environment has changed since);
  - fresh random state for ``random``, numpy and torch, each seeded from the OS as a new
    interpreter's is (a fork would share the server's).

Forking after ``import torch`` is safe on Linux. Elsewhere (macOS: system frameworks are not
fork-safe, the reason Python spawns there) or with HELPERS_RANK_START=spawn, the server starts
each rank as a fresh interpreter instead: slower, the same protocol, the same ranks.

Protocol, over one stream socket pair:
  launcher -> server: a 4-byte length, then {"cfg": ..., "env": {...}, "cwd": ...}, with four
                      fds attached (task socket, diag socket, stdout and stderr write ends)
  server -> launcher: one JSON line each: {"pid": p} per request, in order; {"exit": p,
                      "code": c} when a rank ends (c as Popen's returncode: -N for signal N).
                      End of file: the other side is gone (the server exits; the launcher
                      counts the server's ranks as ended).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time

SERVER_GONE = 70  # the code a rank reports when its server (or kernel) is gone: _worker.monitor
# What `top`, `ps -e` and psutil's name() show (a fork keeps the server's command line).
SERVER_NAME = "helpers-server"
RANK_NAME = "helpers-rank{rank}"
START = os.environ.get("HELPERS_RANK_START") or ("fork" if sys.platform == "linux" else "spawn")
_ENTRY = "import sys; from helpers.launcher import _rankserver as s; s.{}(*sys.argv[1:])"


def _set_name(name: str) -> None:
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass  # not Linux: only the name in process lists is lost


# -- the server --------------------------------------------------------------------------------


def _preload() -> None:
    """What every rank imports before it can do anything: paid once, here."""
    import cloudpickle  # noqa: F401
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    from helpers.launcher import world  # noqa: F401


def _send(sock: socket.socket, msg: dict) -> None:
    try:
        sock.sendall(json.dumps(msg).encode() + b"\n")
    except OSError:
        pass  # the launcher is gone; its ranks notice on their own


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _read_request(sock: socket.socket) -> tuple[dict, list[int]] | None:
    """One request and its fds, or None at end of file (the launcher is gone)."""
    try:
        head, fds, _, _ = socket.recv_fds(sock, 4, 4)
    except OSError:
        return None
    if len(head) < 4:
        for fd in fds:
            os.close(fd)
        return None
    (size,) = struct.unpack("!I", head)
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            return None
        body += chunk
    return json.loads(body), fds


def _become_rank(req: dict, fds: list[int]) -> None:
    """In the new process: become the rank the request describes. Never returns."""
    code = 1
    try:
        os.setsid()  # its own session: killed as a unit, with anything it starts
        _set_name(RANK_NAME.format(rank=req["cfg"]["rank"]))
        task_fd, diag_fd, out_fd, err_fd = fds
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.close(out_fd)
        os.close(err_fd)
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        import random

        import numpy
        import torch  # loaded already (by _preload, or a spawned rank's import helpers): a lookup

        # A fresh interpreter seeds these from the OS; a fork would share the server's state.
        random.seed()
        numpy.random.seed()
        torch.seed()
        from helpers.launcher import _worker

        _worker.main(dict(req["cfg"], task_fd=task_fd, diag_fd=diag_fd, parent_pid=os.getppid()))
        code = 0
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _start_rank(req: dict, fds: list[int], closing: list[int]) -> int:
    """Fork (or spawn) one rank; return its pid."""
    if START == "fork":
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in closing:
                os.close(fd)
            _become_rank(req, fds)
        return pid
    for fd in fds:
        os.set_inheritable(fd, True)
    argv = [sys.executable, "-c", _ENTRY.format("spawned"), json.dumps(req), json.dumps(fds)]
    return os.posix_spawn(sys.executable, argv, dict(os.environ))


def spawned(req: str, fds: str) -> None:
    """A rank started as a fresh interpreter (HELPERS_RANK_START=spawn, or not Linux)."""
    _become_rank(json.loads(req), json.loads(fds))


def serve(fd: str) -> None:
    """The server process: answer requests until the launcher closes its end."""
    sock = socket.socket(fileno=int(fd))
    os.set_inheritable(sock.fileno(), False)  # a spawned rank must not keep the launcher's line
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when ranks stop
    _set_name(SERVER_NAME)
    if START == "fork":
        _preload()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)  # a rank's exit wakes the select below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            try:
                while os.read(wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
            _reap(sock)
        if sock in ready:
            got = _read_request(sock)
            if got is None:
                break  # the launcher is gone: so are we (each rank notices its parent went)
            req, fds = got
            pid = _start_rank(req, fds, [sock.fileno(), wake_r, wake_w])
            for fd in fds:
                os.close(fd)
            _send(sock, {"pid": pid})
    os._exit(0)


# -- the launcher's side -------------------------------------------------------------------------


class RankProcess:
    """A rank, as the launcher sees it: the part of ``subprocess.Popen`` it uses."""

    def __init__(self, server: Server, pid: int, stdout, stderr):
        self.server, self.pid, self.stdout, self.stderr = server, pid, stdout, stderr

    @property
    def returncode(self) -> int | None:
        return self.server.codes.get(self.pid)

    def poll(self) -> int | None:
        self.server.collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
            self.server.collect(wait=0.05 if left is None else min(0.05, left))
        return self.returncode


class Server:
    """The kernel's handle on its rank server: start it, ask it for ranks, hear them end."""

    def __init__(self, env: dict, source: dict | None = None, start_timeout: float = 300):
        self.env = dict(env)  # the environment it started with: ranks inherit it
        self.source = source  # the caller's environment it was made from, to tell a change
        self.start_timeout = start_timeout  # its first answer waits for its import of torch
        self.owner = os.getpid()
        self.codes: dict[int, int] = {}
        self.ranks: set[int] = set()
        self.buf = b""
        ours, theirs = socket.socketpair()
        self.sock = ours
        self.proc = subprocess.Popen(
            # -c, not -m: helpers is imported first, so runpy would warn about this module
            [sys.executable, "-c", _ENTRY.format("serve"), str(theirs.fileno())],
            stdin=subprocess.DEVNULL,
            pass_fds=(theirs.fileno(),),
            start_new_session=True,  # a Ctrl-C in a terminal is the launcher's to handle
            env=env,
        )
        theirs.close()

    def alive(self) -> bool:
        return self.proc.poll() is None and self.sock.fileno() >= 0

    def spawn(self, cfg: dict, env: dict) -> RankProcess:
        from helpers.launcher.errors import LaunchError

        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            body = json.dumps({"cfg": cfg, "env": env, "cwd": os.getcwd()}).encode()
            fds = [cfg["task_fd"], cfg["diag_fd"], out_w, err_w]
            try:
                socket.send_fds(self.sock, [struct.pack("!I", len(body))], fds)
                self.sock.sendall(body)
            except OSError as exc:
                raise LaunchError(
                    f"the rank server is gone ({exc}); the next launch starts a new one"
                ) from None
            pid = self._await_pid()
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        self.ranks.add(pid)
        return RankProcess(self, pid, open(out_r, "rb", buffering=0), open(err_r, "rb", 0))

    def _await_pid(self) -> int:
        from helpers.launcher.errors import LaunchError

        while True:
            msg = self._recv(timeout=self.start_timeout)
            if msg is None:
                code = self.proc.poll()
                raise LaunchError(
                    f"the rank server did not start a rank within {self.start_timeout:g} s "
                    f"({'it is still running' if code is None else f'it exited with {code}'}); "
                    "its errors are in the terminal that started Jupyter (set "
                    "HELPERS_START_TIMEOUT to wait longer on a slow machine)"
                )
            if "pid" in msg:
                return msg["pid"]
            self.codes[msg["exit"]] = msg["code"]

    def _recv(self, timeout: float) -> dict | None:
        """One message, or None when the server is gone or says nothing within ``timeout``."""
        while b"\n" not in self.buf:
            if self.sock.fileno() < 0:
                return None
            ready, _, _ = select.select([self.sock], [], [], timeout)
            if not ready:
                return None
            try:
                data = self.sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                self._gone()
                return None
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def collect(self, wait: float = 0.0) -> None:
        """Take in the exits the server reported (waiting up to ``wait`` s for the first)."""
        timeout = wait
        while (msg := self._recv(timeout)) is not None:
            if "exit" in msg:
                self.codes[msg["exit"]] = msg["code"]
            timeout = 0.0

    def _gone(self) -> None:
        """The server is gone: its ranks end too (each watches its parent); count them ended."""
        self.sock.close()
        for pid in self.ranks:
            self.codes.setdefault(pid, SERVER_GONE)

    def close(self) -> None:
        """Stop the server (it exits at end of file); its ranks, if any are left, follow it."""
        if self.sock.fileno() >= 0:
            self._gone()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
