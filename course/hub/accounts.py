"""Local students for the hub: a Unix group, users with a password and a home, and the right to
run the course's Python.

The hub logs students in with PAM, as the machine's own users, and runs each one's JupyterLab
under that user. Everything here calls the system's tools (groupadd, useradd, chpasswd,
userdel, setfacl) as root; a failure raises with the tool's own message.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

from course.hub.cgroups import USER_NAME

DEFAULT_GROUP = "course-students"


def _run(*cmd: str, stdin: str | None = None) -> None:
    done = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:2])} failed: {(done.stderr or done.stdout).strip()}")


def _require_root(what: str) -> None:
    if os.geteuid() != 0:
        raise PermissionError(f"{what} needs root (it changes the machine's users): use sudo")


def ensure_group(group: str = DEFAULT_GROUP) -> int:
    """The gid of ``group``, created if missing."""
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        _require_root(f"creating group {group}")
        _run("groupadd", group)
        return grp.getgrnam(group).gr_gid


def add_student(name: str, password: str, group: str = DEFAULT_GROUP) -> Path:
    """Create local user ``name`` with ``password``, a home, and membership of ``group``;
    returns the home. Refuses an existing user: re-using someone's account is not adding one."""
    if not USER_NAME.match(name):
        raise ValueError(f"{name!r} is not a valid user name: lower case, [a-z_][a-z0-9_.-]*")
    if not password:
        raise ValueError("a student needs a password: the hub logs in with it (PAM)")
    _require_root(f"adding user {name}")
    try:
        pwd.getpwnam(name)
    except KeyError:
        pass
    else:
        raise ValueError(f"user {name} exists already: pick another name or remove it first")
    ensure_group(group)
    _run("useradd", "--create-home", "--shell", "/bin/bash", "--groups", group, name)
    _run("chpasswd", stdin=f"{name}:{password}\n")
    return Path(pwd.getpwnam(name).pw_dir)


def remove_student(name: str) -> None:
    """Kill ``name``'s processes, then delete the user and its home. A missing user is fine."""
    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        return
    _require_root(f"removing user {name}")
    deadline = time.monotonic() + 10
    while (left := _processes_of(uid)) and time.monotonic() < deadline:
        for pid in left:  # the user's own processes, by id: userdel refuses a logged-in user
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    if _home_exists(name):
        _run("userdel", "--remove", name)
    else:
        _run("userdel", name)


def _home_exists(name: str) -> bool:
    return Path(pwd.getpwnam(name).pw_dir).is_dir()


def _processes_of(uid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if p.stat().st_uid == uid:
                    out.append(int(p.name))
            except FileNotFoundError:
                pass
    return out


def remove_group(group: str) -> None:
    """Delete ``group`` (its members keep their accounts). A missing group is fine."""
    try:
        grp.getgrnam(group)
    except KeyError:
        return
    _run("groupdel", group)


# --- the right to run .venv's Python ------------------------------------------------------
# A venv's python is a link to the interpreter it was made from. Made from a Python under a
# private folder (pyenv in /root, mode 700), no student can run it, and each server fails
# with "Permission denied". The hub then grants its students' group the right to pass through
# (x, not read) each such folder with a POSIX ACL, and takes it back when it stops.


def blocked_folders(path: Path, gid: int) -> list[Path]:
    """The folders above ``path`` (its links resolved) that members of group ``gid`` may not
    pass through, judged from the mode bits (an ACL already granted counts as passable)."""
    out = []
    for folder in reversed(Path(os.path.realpath(path)).parents):
        st = folder.stat()
        if st.st_mode & stat.S_IXOTH or (st.st_gid == gid and st.st_mode & stat.S_IXGRP):
            continue
        if _acl_allows(folder, gid):
            continue
        out.append(folder)
    return out


def _acl_allows(folder: Path, gid: int) -> bool:
    done = subprocess.run(["getfacl", "-n", "-p", str(folder)], capture_output=True, text=True)
    return f"group:{gid}:--x" in done.stdout or f"group:{gid}:r-x" in done.stdout


def _extended_acl(folder: Path) -> bool:
    done = subprocess.run(
        ["getfacl", "--skip-base", "-p", str(folder)], capture_output=True, text=True
    )
    return bool(done.stdout.strip())


def _named_entries(folder: Path) -> list[str]:
    """The ACL's entries for named users and groups (user:NAME:..., group:NAME:...)."""
    done = subprocess.run(["getfacl", "-c", "-p", str(folder)], capture_output=True, text=True)
    return [
        e for e in done.stdout.split() if e.split(":")[0] in ("user", "group") and e.split(":")[1]
    ]


def grant_passage(paths: list[Path], group: str, record: Path) -> list[Path]:
    """Let ``group`` pass through every folder that keeps it from ``paths``; the group and each
    folder granted go into the JSON file ``record``, which revoke_passage reads."""
    gid = ensure_group(group)
    granted = json.loads(record.read_text())["folders"] if record.exists() else []
    for path in paths:
        for folder in blocked_folders(path, gid):
            plain = not _extended_acl(folder)  # then revoking removes the whole ACL again
            try:
                _run("setfacl", "--modify", f"group:{group}:--x", str(folder))
            except FileNotFoundError:
                raise RuntimeError(
                    f"{folder} keeps the students from {path}, and setfacl is missing: "
                    "scripts/setup.sh installs Debian's acl, or build .venv from a Python "
                    "outside private folders (PYTHON=/usr/bin/python3 scripts/setup.sh)"
                ) from None
            print(f"hub: granted group {group} passage (x) through {folder}", file=sys.stderr)
            granted.append({"folder": str(folder), "plain": plain})
            # the gid as well: revoking works even after the group is deleted
            record.write_text(json.dumps({"group": group, "gid": gid, "folders": granted}))
    return [Path(g["folder"]) for g in granted]


def revoke_passage(record: Path) -> None:
    """Take back what grant_passage recorded in ``record``, and delete the record."""
    if not record.exists():
        return
    data = json.loads(record.read_text())
    for grant in data["folders"]:
        if Path(grant["folder"]).exists():
            _run("setfacl", "--remove", f"group:{data['gid']}", grant["folder"])
            # It had mode bits only: drop the mask entry left behind too, unless another
            # hub (another group) holds a grant there now.
            if grant["plain"] and not _named_entries(Path(grant["folder"])):
                _run("setfacl", "--remove-all", grant["folder"])
    record.unlink()


def check_can_run(python: Path, group: str) -> None:
    """Run ``python`` as a member of ``group`` with no other rights (user nobody) and import
    what a student's server needs; raise with the error it met."""
    done = subprocess.run(
        [
            "runuser",
            "-u",
            "nobody",
            "-g",
            group,
            "--",
            str(python),
            "-c",
            "import helpers, jupyterhub",
        ],
        capture_output=True,
        text=True,
        cwd="/",
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"students (group {group}) cannot run {python}: {done.stderr.strip()[-500:]}. "
            "Every folder above .venv and the Python it was made from must be open to them."
        )


# What only the instructor may read: the solutions (hidden tests included), the executed course
# and the grades under build/, and .git, whose objects hold every solution ever committed.
# Students need .venv, helpers/ and labs/ (their kernels import helpers), nothing else.
INSTRUCTOR_ONLY = ("solutions", "build", ".git")


def hide_from_students(repo: Path, group: str) -> list[Path]:
    """Take every right of "others" off the instructor-only folders of ``repo`` (and the group's
    where the folder belongs to the students' group), so a student cannot copy the solutions
    into ~/course and have them collected as their own; then check it as a member of ``group``.
    Not undone by `hub.sh stop`: the students' accounts outlive the hub."""
    gid = ensure_group(group)
    hidden = []
    # build/ is made here if missing: the course run, the grades and the screenshots that go in
    # it later inherit nothing from a folder that does not exist yet, and would be readable
    (repo / "build").mkdir(mode=0o750, exist_ok=True)
    for name in INSTRUCTOR_ONLY:
        path = repo / name
        if not path.exists():
            continue
        st = path.stat()
        mode = st.st_mode & ~0o007
        if st.st_gid == gid:
            mode &= ~0o070
        if mode != st.st_mode:
            path.chmod(stat.S_IMODE(mode))
            print(f"hub: {path} is no longer readable by students (chmod o-rwx)", file=sys.stderr)
        hidden.append(path)
    check_cannot_read(hidden, group)
    return hidden


def check_cannot_read(paths: list[Path], group: str) -> None:
    """List each of ``paths`` as a member of ``group`` with no other rights (user nobody);
    raise if one can be read: an ACL or a parent's group can still open it."""
    probe = "import os, sys\nfor p in sys.argv[1:]:\n    try:\n        os.listdir(p)\n"
    probe += "        print(p)\n    except OSError:\n        pass\n"
    done = subprocess.run(
        ["runuser", "-u", "nobody", "-g", group, "--", sys.executable, "-c", probe]
        + [str(p) for p in paths],
        capture_output=True,
        text=True,
        cwd="/",
    )
    readable = done.stdout.split()
    if readable or done.returncode != 0:
        raise RuntimeError(
            f"students (group {group}) can still read {', '.join(readable) or done.stderr[-300:]}:"
            " remove the ACL or group right that opens it before starting the hub"
        )
