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

import datetime
import hashlib
import json
import os
import pwd
import stat
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from course.asuser import COURSE, TIMEOUT, as_user, put_new, put_replacing, take
from course.grading.cells import MARKERS
from course.grading.submission import (
    COLLECTED,
    NOT_COLLECTED,
    TOOL_LITTER,
    read_regular,
    unnamable,
)

TOKEN_ENV = "JUPYTERHUB_API_TOKEN"


class ExchangeError(Exception):
    """Bad input the instructor can fix (an unknown user, a hub not reachable): says how."""


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
        reply = as_user(pw, lambda: put_new(pw.pw_dir, lab.name, data), timeout)
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
        reply = as_user(pw, lambda: take(pw.pw_dir, name), timeout)
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
        reply = as_user(pw, lambda: put_replacing(pw.pw_dir, name, data), timeout)
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
