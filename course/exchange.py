"""Labs between the instructor and the students' homes, on one machine whose hub users are local
users: `course handout`, `course collect`, `course return`.

  handout  labs/LAB.ipynb to ~USER/course/LAB.ipynb, never over a copy that is there;
  collect  ~USER/course/LAB.ipynb to OUT/USER/LAB.ipynb, the folder `course grade LAB OUT`
           reads, or instead a note (NOT_COLLECTED) saying why not, which grade gives as the
           row's reason; OUT/collected.json says what was taken, when, and its sha256;
  return   OUT/feedback/USER.html of `course grade` to ~USER/course/feedback/LAB.html.

These run as root, and a home is its student's to arrange: ~/course may be a link to a
classmate's home or to /etc, the notebook a link to /etc/shadow or to the solutions, a FIFO, a
hard link to someone else's file, 100 MB, or swapped for any of these between a check and a use.
So root touches nothing in a home: each user's part runs in a child process that has become that
user (groups, gid, uid: the kernel allows it what the student could do, nothing more) and walks
the home from descriptors, one name at a time, never through a link (O_NOFOLLOW on each). A
notebook is read by course.grading.submission.read_regular, grade's own rules; files are written
under a fresh name, then renamed into place, so nothing is ever written through a planted link.
Trusts: root's own files (the released lab, the feedback pages, OUT once no one else can
write it or a folder above it), the home folders pwd gives, the hub's list of users. Does not
trust: anything inside a home, nor the process that acts as its student (the student may
signal it, kill it mid-reply, or lower its limits: that student's part fails, alone).
"""

from __future__ import annotations

import ctypes
import datetime
import errno
import hashlib
import json
import os
import pwd
import secrets
import select
import signal
import stat
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from course.grading.cells import MARKERS
from course.grading.submission import (
    COLLECTED,
    MAX_SUBMISSION,
    NOT_COLLECTED,
    TOOL_LITTER,
    read_regular,
    unnamable,
)

COURSE = "course"  # ~USER/course: where a lab is handed out, and collected from
FEEDBACK = "feedback"  # ~USER/course/feedback/LAB.html: where its feedback page is returned
TIMEOUT = 60.0  # seconds one user's part may take: a home on a hung disk costs that, not the class
TOKEN_ENV = "JUPYTERHUB_API_TOKEN"
PR_SET_DUMPABLE, PR_GET_DUMPABLE = 4, 3  # prctl(2)
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class ExchangeError(Exception):
    """Bad input the instructor can fix (an unknown user, a hub not reachable): says how."""


class _Refused(Exception):
    """Something in a home these commands will not go through (a link, a FIFO): the reason."""


@dataclass
class Moved:
    """What one command did for one user: ``status`` (handed out, left as is, collected, no
    submission, refused, returned, error) and ``detail``; ``ok``: nothing for the instructor to
    fix (a refused notebook is the student's, and goes to the gradebook)."""

    user: str
    status: str
    detail: str = ""
    ok: bool = True

    def __str__(self) -> str:
        return f"{self.user}: {self.status}: {self.detail}"


# --- the three commands ---------------------------------------------------------------------


def handout(lab, users: list[str], timeout: float = TIMEOUT) -> list[Moved]:
    """Put the released notebook ``lab`` into each user's ~/course (made, 0o700, if missing) as
    that user's own file (0o600); a file of that name already there is left as is."""
    lab = Path(lab)
    data = lab.read_bytes()
    for begin, _ in MARKERS.values():  # a solution handed out cannot be taken back
        if begin.encode() in data:
            raise ExchangeError(
                f"{lab} holds {begin!r}: it is a solution, not a released lab. Hand out "
                f"labs/{lab.name}, which `course release` writes"
            )

    def one(pw):
        reply = as_user(pw, lambda: _put_new(pw.pw_dir, lab.name, data), timeout)
        ok = reply["status"] in ("handed out", "left as is")
        return Moved(pw.pw_name, reply["status"], reply["detail"], ok)

    return [_each(user, one) for user in users]


def collect(lab, out, users: list[str], timeout: float = TIMEOUT) -> list[Moved]:
    """Take ~USER/course/LAB.ipynb (``lab``'s file name) of each user into ``out``/USER/, the
    layout `course grade` reads, or there a note of why not (no notebook, or one refused by
    grade's rules); record each in ``out``/collected.json. Collecting again replaces both."""
    name, out = Path(lab).name, Path(out)
    if not name.endswith(".ipynb"):
        raise ExchangeError(f"{lab}: give the lab's notebook, e.g. labs/{name}.ipynb")
    _only_ours(out)  # before mkdir too: it would make folders where a student's link leads
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    out = _only_ours(out)
    manifest = _read_json(out / COLLECTED)

    def one(pw):
        reply = as_user(pw, lambda: _take(pw.pw_dir, name), timeout)
        source = f"{pw.pw_dir}/{COURSE}/{name}"
        manifest[pw.pw_name] = _file_away(out / pw.pw_name, name, source, reply)
        _write_atomic(out / COLLECTED, json.dumps(manifest, indent=1).encode())
        return Moved(pw.pw_name, reply["status"], reply["detail"], reply["status"] != "error")

    return [_each(user, one) for user in users]


def return_feedback(out, users: list[str], lab=None, timeout: float = TIMEOUT) -> list[Moved]:
    """Put each user's feedback page of `course grade`'s folder ``out`` (feedback/USER.html) into
    ~USER/course/feedback/LAB.html, replacing the one there. LAB: ``lab``'s stem (a name or a
    path), or the lab of solutions/ that ``out`` was graded with."""
    out = _only_ours(Path(out))  # a page planted there would be returned as the grader's
    name = f"{_graded_lab(out, lab)}.html"

    def one(pw):
        page = out / "feedback" / f"{pw.pw_name}.html"
        if not page.is_file():
            return Moved(pw.pw_name, "no feedback", f"{page} does not exist: graded?", False)
        data, why = read_regular(page)
        if data is None:
            return Moved(pw.pw_name, "error", f"{page}: {why}", False)
        reply = as_user(pw, lambda: _put_replacing(pw.pw_dir, name, data), timeout)
        return Moved(pw.pw_name, reply["status"], reply["detail"], reply["status"] == "returned")

    return [_each(user, one) for user in users]


def _each(user: str, one) -> Moved:
    """``one(pw)`` for the local account of ``user``; an unknown user is an error, alone."""
    try:
        return one(local_user(user))
    except ExchangeError as exc:
        return Moved(user, "error", str(exc), False)


# --- who -------------------------------------------------------------------------------------


def local_user(name: str) -> pwd.struct_passwd:
    """The local account ``name``, one these commands may act as; an ExchangeError otherwise."""
    if "/" in name or unnamable(name) or name in TOOL_LITTER:  # it becomes OUT/NAME
        raise ExchangeError(f"{name!r} cannot be a student's folder name: not collected")
    try:
        pw = pwd.getpwnam(name)
    except (KeyError, ValueError):
        raise ExchangeError(
            f"no local user named {name!r}: check the name (`getent passwd {name}`), or make "
            "the account (a hub's users must be users of this machine)"
        ) from None
    if pw.pw_uid == 0:  # acting as root, nothing would stop a link planted in its home
        raise ExchangeError(f"{name} is root, not a student: left out")
    if os.geteuid() not in (0, pw.pw_uid):
        raise ExchangeError(f"reaching {name}'s home needs root: run the command with sudo")
    return pw


def read_roster(path) -> list[str]:
    """The user names of a roster file: one a line; blank lines and # comments skipped."""
    lines = Path(path).read_text().splitlines()
    return [s for s in (line.split("#", 1)[0].strip() for line in lines) if s]


def hub_accounts(url: str, token: str | None, timeout: float = 30.0) -> list[dict]:
    """Every user model of the JupyterHub at ``url`` (GET URL/hub/api/users, a page at a time),
    read with ``token``; an ExchangeError says what to do when that fails."""
    if not token:
        raise ExchangeError(
            f"no hub token: set {TOKEN_ENV} to an API token of the hub that may list its users "
            f"(an admin's, from {url.rstrip('/')}/hub/token, or a service's with the scopes "
            "list:users and read:users)"
        )
    if not url.startswith(("http://", "https://")):
        raise ExchangeError(f"--hub {url}: give the hub's address, e.g. http://127.0.0.1:8000")
    base = url.rstrip("/").removesuffix("/hub") + "/hub/api/users"
    users, offset = [], 0
    while offset is not None:
        page = _hub_get(f"{base}?offset={offset}", token, timeout)
        if isinstance(page, list):  # a hub older than 2.0: every user at once
            return users + page
        if not isinstance(page, dict):
            raise ExchangeError(f"{base} did not answer a list of users: is that a JupyterHub?")
        users += page.get("items", [])
        offset = ((page.get("_pagination") or {}).get("next") or {}).get("offset")
    return users


def hub_users(url: str, token: str | None, timeout: float = 30.0) -> list[str]:
    """The names of the hub's users but its admins (on a course's hub, the instructors; a token
    without read:users does not see who is an admin, and then lists them too)."""
    return [u["name"] for u in hub_accounts(url, token, timeout) if not u.get("admin")]


def _hub_get(url: str, token: str, timeout: float):
    """The JSON at ``url`` of the hub, asked with ``token`` and paged by the hub's own media type."""
    req = urllib.request.Request(
        url,
        headers={
            "Authorization": f"token {token}",
            "Accept": "application/jupyterhub-pagination+json",
        },
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise ExchangeError(
                f"the hub refused the token (HTTP {exc.code} from {url}): {TOKEN_ENV} must be a "
                "token of this hub with the scopes list:users and read:users (an admin's works)"
            ) from None
        raise ExchangeError(
            f"the hub answered HTTP {exc.code} to {url}: is that the hub's address?"
        ) from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        why = getattr(exc, "reason", None) or exc
        raise ExchangeError(
            f"cannot reach the hub at {url} ({why}): is it running, and is that its address?"
        ) from None
    except ValueError:
        raise ExchangeError(f"{url} did not answer JSON: is that a JupyterHub?") from None


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
        except _Refused as exc:
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
    where one is missing, _Refused where one is a link or not a folder."""
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
                raise _Refused(
                    f"{shown} is a symbolic link: links are not followed; make it a folder"
                ) from None
            raise _Refused(f"{shown} is not a folder") from None
        finally:
            os.close(fd)
        fd = nxt
    return fd


def _put_new(home: str, name: str, data: bytes) -> dict:
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


def _take(home: str, name: str) -> dict:
    """~/course/``name``'s bytes by grade's rules (read_regular), or why not."""
    path = f"{home}/{COURSE}/{name}"
    try:
        folder = _walk(home, [COURSE])
        st = os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return {"status": "no submission", "detail": f"no submission: {path} was not found"}
    except _Refused as exc:
        return {"status": "refused", "detail": f"not collected from {path}: {exc}"}
    data, why = read_regular(Path(name), dir_fd=folder)
    if data is None:
        return {"status": "refused", "detail": f"not collected from {path}: {why}"}
    if b"\0" in data:  # a sparse file's holes: 64 MiB of OUT's disk that cost its student none
        why = f"{name} holds NUL bytes, which no notebook holds: save the lab in JupyterLab again"
        return {"status": "refused", "detail": f"not collected from {path}: {why}"}
    return {"status": "collected", "detail": path, "mtime": st.st_mtime, "data": data}


def _put_replacing(home: str, name: str, data: bytes) -> dict:
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
            raise _Refused(f"{path} is a folder: remove it and return again") from None
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


# --- the instructor's side: OUT ---------------------------------------------------------------


def _file_away(folder: Path, name: str, source: str, reply: dict) -> dict:
    """The notebook collected from ``source`` in ``folder`` (the student's in OUT), or the note
    saying why there is none; the other one goes, so grade never sees an earlier collection's.
    The entry of collected.json."""
    folder.mkdir(mode=0o700, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    entry = {"status": reply["status"], "taken": now, "source": source}
    if reply["status"] == "collected":
        data = reply["data"]
        _write_atomic(folder / name, data)
        (folder / NOT_COLLECTED).unlink(missing_ok=True)
        entry |= {
            "size": len(data),
            "mtime": _utc(reply["mtime"]),  # the student's to set (touch -d): "taken" is root's
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    else:
        _write_atomic(folder / NOT_COLLECTED, reply["detail"].encode() + b"\n")
        (folder / name).unlink(missing_ok=True)
        entry["reason"] = reply["detail"]
    return entry


def _utc(seconds: float) -> str:
    """``seconds`` since 1970 as UTC ISO 8601, or as the number where no calendar reaches it
    (tmpfs, btrfs and ZFS keep any 64-bit mtime a student sets)."""
    try:
        when = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    except (ValueError, OverflowError, OSError):
        return f"{seconds!r} s since 1970, out of the calendar"
    return when.isoformat(timespec="seconds")


def _only_ours(out: Path) -> Path:
    """``out`` resolved, where only root, this user or the one who ran sudo can write it or any
    folder above it that is not sticky; an ExchangeError otherwise. Root writes in it: a student
    who can write there (a /tmp/ps1 they made first) plants links that root's writes follow."""
    out = out.resolve()
    ours = {0, os.geteuid(), int(os.environ.get("SUDO_UID") or 0)}  # SUDO_UID: set by root
    for folder in (out, *out.parents):
        try:
            st = folder.stat()
        except FileNotFoundError:  # made by collect, as root's, 0o700
            continue
        open_to_all = st.st_mode & 0o022 and (folder == out or not st.st_mode & stat.S_ISVTX)
        if st.st_uid not in ours or open_to_all:
            raise ExchangeError(
                f"{out}: others can write {folder} (owner uid {st.st_uid}, mode "
                f"{stat.filemode(st.st_mode)}), and links they plant there would be followed: "
                "give a folder that only you can write, e.g. /root/grading/LAB"
            )
    return out


def _graded_lab(out: Path, lab) -> str:
    """The stem of the lab ``out`` was graded with: ``lab``'s, or the notebook of solutions/
    whose sha256 its shard.json records."""
    if lab is not None:
        return Path(lab).stem
    from course.grading.shards import MANIFEST
    from course.syllabus import REPO

    manifest = _read_json(out / MANIFEST)
    if not manifest:
        raise ExchangeError(f"{out} is not an output folder of `course grade` (no {MANIFEST})")
    for path in sorted((REPO / "solutions").rglob("*.ipynb")):
        if hashlib.sha256(path.read_bytes()).hexdigest() == manifest.get("lab_sha256"):
            return path.stem
    raise ExchangeError(
        f"{out} was graded with a lab that is not in solutions/ now: name it with --lab"
    )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
