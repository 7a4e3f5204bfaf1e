"""Acting as one student in their home: a forked child that has become the user, and what it
does there (course.exchange's hand-out, collection and return).

Root touches nothing in a home. ``as_user`` forks a child that drops every right of root's
(groups, gid, uid, not dumpable) and keeps only the pipe back; the kernel then allows it what the
student could do, nothing more. In the child, ``put_new``, ``take`` and ``put_replacing`` walk
the home from descriptors, one name at a time, never through a link (O_NOFOLLOW on each), read a
notebook by course.grading.submission.read_regular (grade's own rules), and write under a fresh
name that is then linked or renamed into place, so nothing is written through a planted link.
Trusts: nothing in the home; the student may signal, kill or limit the child (that student's
part fails, alone).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import pwd
import secrets
import select
import signal
import stat
import time
from pathlib import Path

from course.grading.submission import MAX_SUBMISSION, read_regular

COURSE = "course"  # ~USER/course: where a lab is handed out, and collected from
FEEDBACK = "feedback"  # ~USER/course/feedback/LAB.html: where its feedback page is returned
TIMEOUT = 60.0  # seconds one user's part may take: a home on a hung disk costs that, not the class
PR_SET_DUMPABLE, PR_GET_DUMPABLE = 4, 3  # prctl(2)
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Refused(Exception):
    """Something in a home these commands will not go through (a link, a FIFO): the reason."""


# --- the child process that is the user -------------------------------------------------------


def as_user(pw: pwd.struct_passwd, work, timeout: float = TIMEOUT) -> dict:
    """``work()``'s reply, run in a forked child that has become ``pw``'s user, with nothing of
    this process open but the pipe back. The reply: a JSON-able dict with "status" and "detail",
    and its bytes as "data". A child that fails, or takes over ``timeout`` s, replies "error"."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        _child(pw, work, r, w)  # never returns
    os.close(w)
    try:
        raw, why = _read_reply(r, pid, timeout)
    finally:
        os.close(r)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    # exit status 0 only once the whole reply is written: the student may kill the child (it is
    # theirs) mid-reply, and the first part of a notebook is not what they handed in
    if raw and b"\n" in raw and code == 0:
        header, data = raw.split(b"\n", 1)
        return {**json.loads(header), "data": data}
    why = why or f"it ended with exit status {code} before its whole reply"
    return {"status": "error", "detail": f"the process acting as {pw.pw_name} failed: {why}"}


def _child(pw, work, r: int, w: int) -> None:
    """The forked child: drop to ``pw``, run ``work``, write its reply to ``w``, exit."""
    code = 70
    try:
        os.close(r)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # not root's terminal: a student's process could write to it
            os.dup2(null, fd)
        os.closerange(3, w)
        os.closerange(w + 1, os.sysconf("SC_OPEN_MAX"))
        try:
            _become(pw)
            reply = work()
        except Refused as exc:
            reply = {"status": "refused", "detail": str(exc)}
        except Exception as exc:  # told to the instructor, never the root process's crash
            reply = {"status": "error", "detail": f"{type(exc).__name__}: {exc}"}
        data = reply.pop("data", b"")
        view = memoryview(json.dumps(reply).encode() + b"\n" + data)
        while view:
            view = view[os.write(w, view) :]
        code = 0
    finally:
        os._exit(code)


def _become(pw) -> None:
    """This process as ``pw``'s user, for good: its groups, then gid, then uid (real, effective
    and saved). Then undumpable: a fork holds what root read before (the hub's token, other
    homes' notebooks), which the student must not read through ptrace or /proc/PID/mem. (The
    uid's change already resets the flag to fs.suid_dumpable, 0 unless a machine debugs.)"""
    if os.geteuid() == 0:
        os.setgroups(os.getgrouplist(pw.pw_name, pw.pw_gid))
        os.setgid(pw.pw_gid)
        os.setuid(pw.pw_uid)
    if os.geteuid() != pw.pw_uid or os.getuid() != pw.pw_uid:
        raise PermissionError(f"could not become {pw.pw_name}")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0 or libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0):
        raise PermissionError("could not make the process undumpable")
    os.umask(0o077)
    os.chdir("/")


def _read_reply(r: int, pid: int, timeout: float) -> tuple[bytes | None, str | None]:
    """What the child wrote to ``r`` up to its end, or None and why: past ``timeout``, or more
    than a notebook can be (the child is killed)."""
    chunks, size, deadline = [], 0, time.monotonic() + timeout
    poll = select.poll()
    poll.register(r, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not poll.poll(left * 1000):
            os.kill(pid, signal.SIGKILL)
            return None, f"it took over {timeout:g} s"
        chunk = os.read(r, 2**20)
        if not chunk:
            return b"".join(chunks), None
        size += len(chunk)
        if size > MAX_SUBMISSION + 2**16:
            os.kill(pid, signal.SIGKILL)
            return None, "it sent more than a notebook may be"
        chunks.append(chunk)


# --- what the child does, as the user ----------------------------------------------------------


def _walk(home: str, names: list[str], create: bool = False) -> int:
    """An open descriptor of home/names[0]/names[1]/..., each folder opened from the one before
    and never through a link; a missing one is made (0o700) where ``create``. FileNotFoundError
    where one is missing, Refused where one is a link or not a folder."""
    fd, shown = os.open(home, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), home
    for name in names:
        shown = f"{shown}/{name}"
        try:
            if create:
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass
            nxt = os.open(name, _DIR, dir_fd=fd)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):  # a link gives either
                raise
            if stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                raise Refused(
                    f"{shown} is a symbolic link: links are not followed; make it a folder"
                ) from None
            raise Refused(f"{shown} is not a folder") from None
        finally:
            os.close(fd)
        fd = nxt
    return fd


def put_new(home: str, name: str, data: bytes) -> dict:
    """``data`` as ~/course/``name``, unless something of that name is there."""
    path = f"{home}/{COURSE}/{name}"
    folder = _walk(home, [COURSE], create=True)
    left = {"status": "left as is", "detail": f"{path} exists: a student's work is never replaced"}
    if _exists(name, folder):
        return left
    tmp = _write_new(folder, name, data)
    try:  # a link fails where the name exists: never replaced, even if made just now
        os.link(tmp, name, src_dir_fd=folder, dst_dir_fd=folder, follow_symlinks=False)
    except FileExistsError:
        return left
    finally:
        os.unlink(tmp, dir_fd=folder)
    return {"status": "handed out", "detail": path}


def take(home: str, name: str) -> dict:
    """~/course/``name``'s bytes by grade's rules (read_regular), or why not."""
    path = f"{home}/{COURSE}/{name}"
    try:
        folder = _walk(home, [COURSE])
        st = os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return {"status": "no submission", "detail": f"no submission: {path} was not found"}
    except Refused as exc:
        return {"status": "refused", "detail": f"not collected from {path}: {exc}"}
    data, why = read_regular(Path(name), dir_fd=folder)
    if data is None:
        return {"status": "refused", "detail": f"not collected from {path}: {why}"}
    if b"\0" in data:  # a sparse file's holes: 64 MiB of OUT's disk that cost its student none
        why = f"{name} holds NUL bytes, which no notebook holds: save the lab in JupyterLab again"
        return {"status": "refused", "detail": f"not collected from {path}: {why}"}
    return {"status": "collected", "detail": path, "mtime": st.st_mtime, "data": data}


def put_replacing(home: str, name: str, data: bytes) -> dict:
    """``data`` as ~/course/feedback/``name``: renamed over what is there (a link planted there
    is replaced, never written through)."""
    folder = _walk(home, [COURSE, FEEDBACK], create=True)
    path = f"{home}/{COURSE}/{FEEDBACK}/{name}"
    tmp = _write_new(folder, name, data)
    try:
        os.rename(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
    except OSError as exc:
        os.unlink(tmp, dir_fd=folder)
        if exc.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
            raise Refused(f"{path} is a folder: remove it and return again") from None
        raise
    return {"status": "returned", "detail": path}


def _exists(name: str, folder: int) -> bool:
    try:
        os.stat(name, dir_fd=folder, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def _write_new(folder: int, name: str, data: bytes) -> str:
    """``data`` in a new file (0o600) of a fresh hidden name in ``folder``; that name."""
    tmp = f".{name}.{secrets.token_hex(6)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600, dir_fd=folder)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return tmp
