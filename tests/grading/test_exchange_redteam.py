"""Red team of `course handout`, `collect` and `return` (course.exchange): what a student who
controls their home, and may leave processes running there, can try against the root process
that walks every home. Real local users (cxr-<random>), real homes, real signals, leases, mounts.

Each test names the attack and what must hold: nothing of another's taken, nothing written or
read as root outside OUT, and the rest of the class still collected."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import nbformat
import pytest
from grading_fixtures import (
    answer,
    exchange_lab,  # noqa: F401  (the fixture "lab")
    user_exists,
)
from test_exchange import course, plant

from course.exchange import ExchangeError, collect, handout, return_feedback
from course.grading.submission import MAX_SUBMISSION, NOT_COLLECTED

PYTHON = shutil.which("python3", path="/usr/bin:/bin") or sys.executable  # any user may run it

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("useradd"),
    reason="needs root and useradd: the tests make real local users",
)


@pytest.fixture(scope="module")
def users():
    """make(role, home=None): a new local user cxr-<random>-<role>, its home made by useradd or,
    given, ``home`` (a folder the test mounts or makes); every user deleted at the end."""
    made = []

    def make(role: str, home: Path | None = None) -> pwd.struct_passwd:
        name = f"cxr-{secrets.token_hex(3)}-{role}"
        where = ["-m"] if home is None else ["-M", "-d", str(home)]
        subprocess.run(
            ["useradd", *where, "-s", "/usr/sbin/nologin", name], check=True, capture_output=True
        )
        made.append(name)
        return pwd.getpwnam(name)

    try:
        yield make
    finally:
        for name in made:
            subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True)
            subprocess.run(["userdel", "-r", name], capture_output=True)
        left = [n for n in made if user_exists(n)]
        assert not left, f"test users outlived the tests: {left}"


@contextlib.contextmanager
def as_student(pw, script: str):
    """``script`` (Python) running as ``pw``'s user for the block: the process a student leaves
    behind; killed at the end."""
    proc = subprocess.Popen(
        [PYTHON, "-c", textwrap.dedent(script)],
        user=pw.pw_uid,
        group=pw.pw_gid,
        extra_groups=[],
        cwd=pw.pw_dir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def own(pw, path: Path) -> Path:
    os.lchown(path, pw.pw_uid, pw.pw_gid)
    return path


def answered(pw, student, **kw) -> bytes:
    """The student's answered notebook in ~/course/ps1.ipynb (handed out first); its bytes."""
    nb = course(pw, "ps1.ipynb")
    nbformat.write(answer(student, **kw), nb)
    return nb.read_bytes()


# --- (c) block the class ------------------------------------------------------------------------


def test_an_mtime_out_of_every_calendar_does_not_stop_the_collection(users, lab, tmp_path):
    """On a home file system that keeps 64-bit times (tmpfs here; btrfs, ZFS), a student sets
    their notebook's mtime to 1e15 s (year 31 million): the root process must still collect
    them, and everyone after them."""
    _, released, student = lab
    home = Path(f"/tmp/cxr-home-{secrets.token_hex(3)}")
    home.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(home)], check=True)
    try:
        odd = users("mtime", home)
        own(odd, home).chmod(0o700)
        after = users("after")
        handout(released, [odd.pw_name, after.pw_name])
        mine = answered(odd, student)
        os.utime(course(odd, "ps1.ipynb"), (1e15, 1e15))
        assert course(odd, "ps1.ipynb").stat().st_mtime == 1e15  # the fs kept it
        answered(after, student)

        moved = collect(released, tmp_path / "out", [odd.pw_name, after.pw_name])

        assert [m.status for m in moved] == ["collected", "collected"], moved
        assert (tmp_path / "out" / odd.pw_name / "ps1.ipynb").read_bytes() == mine
        entry = json.loads((tmp_path / "out" / "collected.json").read_text())[odd.pw_name]
        assert entry["mtime"]  # said as it is, not a crash
    finally:
        subprocess.run(["umount", "-l", str(home)], check=False)
        home.rmdir()


def test_a_student_stopping_the_process_that_acts_as_them_costs_only_their_timeout(
    users, lab, tmp_path
):
    """A process the student leaves running sends SIGSTOP to every process it may signal
    (kill(-1)), which includes the child that became them: that child is given up after the
    timeout, the next student is collected, and no one waits longer."""
    _, released, student = lab
    stopper, after = users("stop"), users("next")
    handout(released, [stopper.pw_name, after.pw_name])
    answered(stopper, student)
    theirs = answered(after, student)
    script = """
        import os, signal
        while True:  # kill(-1): every process this user may signal, but this one
            try:
                os.kill(-1, signal.SIGSTOP)
            except ProcessLookupError:
                pass
    """
    with as_student(stopper, script):
        for _ in range(5):  # the child may finish between two kills: until one is stopped
            start = time.monotonic()
            names = [stopper.pw_name, after.pw_name]
            moved = collect(released, tmp_path / "out", names, timeout=2)
            took = time.monotonic() - start
            if moved[0].status != "collected":
                break
    assert moved[0].status == "error" and "took over 2 s" in moved[0].detail, moved[0]
    assert moved[1].status == "collected", moved[1]
    assert (tmp_path / "out" / after.pw_name / "ps1.ipynb").read_bytes() == theirs
    assert took < 2 * 2 + 3, f"the class waited {took:.1f} s for one stopped student"
    note = (tmp_path / "out" / stopper.pw_name / NOT_COLLECTED).read_text()
    assert "took over" in note


def test_a_student_killing_the_child_mid_reply_never_gets_a_part_collected(users, lab, tmp_path):
    """The student's process SIGKILLs the child acting as them a moment after it appears, while
    it writes a big notebook back to root: what root keeps is the whole notebook or nothing,
    never its first part recorded as "collected"."""
    _, released, _ = lab
    killer = users("kill")
    handout(released, [killer.pw_name])
    nb = course(killer, "ps1.ipynb")
    big = {"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    big["metadata"]["pad"] = "x" * (MAX_SUBMISSION - 4096)  # a notebook just under the cap
    nb.write_text(json.dumps(big))
    whole = nb.read_bytes()
    script = """
        import os, random, signal, time
        me, uid = os.getpid(), str(os.getuid())

        def rss(pid):  # /proc/PID/status: readable even of an undumpable process
            try:
                with open(f"/proc/{pid}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
            except OSError:
                return None
            if fields["Uid"].split()[0] != uid:
                return None
            return int(fields.get("VmRSS", "0 kB").split()[0]) * 1024

        while True:
            pid = next((int(p) for p in os.listdir("/proc")
                        if p.isdigit() and int(p) != me and rss(p) is not None), None)
            if pid is None:
                continue
            base = rss(pid) or 0
            while (rss(pid) or 0) < base + 120 * 2**20 and rss(pid) is not None:
                pass  # until the notebook is read and its reply built: it is being written
            time.sleep(random.uniform(0, 0.03))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            while rss(pid) is not None:
                pass
    """
    outcomes = {}
    with as_student(killer, script):
        for _ in range(10):
            (moved,) = collect(released, tmp_path / "out", [killer.pw_name])
            got = tmp_path / "out" / killer.pw_name / "ps1.ipynb"
            if moved.status == "collected":
                size = got.stat().st_size
                outcomes["whole" if size == len(whole) else "part"] = size
                assert got.read_bytes() == whole, f"{size} of {len(whole)} bytes collected"
            else:
                outcomes[moved.status] = moved.detail
                assert moved.status == "error" and not got.exists(), moved
    print(f"outcomes while killed: {outcomes}")


def test_a_fifo_or_a_lease_in_the_home_never_hangs_a_command(users, lab, tmp_path):
    """~/course a FIFO (an open for reading would wait for a writer), ~/course/feedback a FIFO,
    and a write lease on the notebook (an open would wait the lease-break time, 45 s): each
    command answers at once, for that student alone."""
    _, released, student = lab
    fifo, fb_fifo, leased = users("fifo"), users("fbfifo"), users("lease")
    plant(course(fifo), fifo, os.mkfifo)
    handout(released, [fb_fifo.pw_name, leased.pw_name])
    plant(course(fb_fifo, "feedback"), fb_fifo, os.mkfifo)
    answered(leased, student)
    grades = tmp_path / "grades"
    (grades / "feedback").mkdir(parents=True)
    for pw in (fifo, fb_fifo, leased):
        (grades / "feedback" / f"{pw.pw_name}.html").write_text("<p>feedback</p>")
    ready = Path(leased.pw_dir, "leased")
    script = f"""
        import fcntl, os, time
        fd = os.open({str(course(leased, "ps1.ipynb"))!r}, os.O_RDONLY)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)  # any other open waits on it
        open({str(ready)!r}, "w").close()
        time.sleep(600)
    """
    with as_student(leased, script):
        deadline = time.monotonic() + 10
        while not ready.exists():
            assert time.monotonic() < deadline, "the student's lease was not taken"
            time.sleep(0.02)
        start = time.monotonic()
        out = tmp_path / "out"
        names = [fifo.pw_name, fb_fifo.pw_name, leased.pw_name]
        got = {m.user: m for m in collect(released, out, names, timeout=20)}
        back = {m.user: m for m in return_feedback(grades, names, "ps1", timeout=20)}
        again = {m.user: m for m in handout(released, [fifo.pw_name], timeout=20)}
        took = time.monotonic() - start
    assert took < 10, f"the commands waited {took:.1f} s"
    assert got[fifo.pw_name].status == "refused" and "not a folder" in got[fifo.pw_name].detail
    assert again[fifo.pw_name].status == "refused"
    assert back[fifo.pw_name].status == "refused"
    assert got[leased.pw_name].status == "refused", got[leased.pw_name]
    assert "cannot be read safely" in got[leased.pw_name].detail  # EWOULDBLOCK: not a wait
    assert back[fb_fifo.pw_name].status == "refused", back[fb_fifo.pw_name]
    assert back[leased.pw_name].status == "returned", back[leased.pw_name]


def test_an_account_that_locks_its_own_folder_is_reported_alone(users, lab, tmp_path):
    """~/course chmod 000, or the home itself: that student's row says so; the class goes on."""
    _, released, student = lab
    locked, home_locked, after = users("locked"), users("homelock"), users("after2")
    handout(released, [locked.pw_name, home_locked.pw_name, after.pw_name])
    theirs = answered(after, student)
    course(locked).chmod(0)
    Path(home_locked.pw_dir).chmod(0)
    names = [locked.pw_name, home_locked.pw_name, after.pw_name]
    moved = collect(released, tmp_path / "out", names)
    assert [m.status for m in moved] == ["error", "error", "collected"], moved
    assert all("Permission denied" in m.detail for m in moved[:2]), moved
    assert (tmp_path / "out" / after.pw_name / "ps1.ipynb").read_bytes() == theirs


# --- (b) root writing where a student chose ------------------------------------------------------


def test_an_out_folder_a_student_can_write_is_refused(users, lab, tmp_path, monkeypatch):
    """The instructor collects into a folder in a shared place (/tmp/ps1) that a student made
    first, or can write: their links there (OUT/CLASSMATE -> a root-only folder, the manifest's
    temporary file -> a root file) would have root write through them. Refused, nothing
    written."""
    _, released, student = lab
    planter, victim = users("planter"), users("victim")
    handout(released, [victim.pw_name])
    answered(victim, student)
    target = tmp_path / "root-only"
    target.mkdir(mode=0o700)
    keep = target / "keep"
    keep.write_text("root's own file")
    out = Path(f"/tmp/cxr-out-{secrets.token_hex(3)}")  # made by the student, before collect
    subprocess.run(["install", "-d", "-m", "0777", "-o", planter.pw_name, str(out)], check=True)
    try:
        plant(out / victim.pw_name, planter, lambda p: p.symlink_to(target))
        plant(out / ".collected.json.tmp", planter, lambda p: p.symlink_to(keep))
        mp = monkeypatch
        mp.delenv("SUDO_UID", raising=False)
        with pytest.raises(ExchangeError, match="others can write"):
            collect(released, out, [victim.pw_name])
        assert sorted(p.name for p in target.iterdir()) == ["keep"]
        assert keep.read_text() == "root's own file"

        shared = tmp_path / "shared"  # root's, writable by all and sticky, as /tmp is
        shared.mkdir()
        shared.chmod(0o1777)
        theirs = shared / "sub"  # a student's folder in it, on the way to OUT
        subprocess.run(["install", "-d", "-o", planter.pw_name, str(theirs)], check=True)
        for where in (shared, theirs / "out"):
            with pytest.raises(ExchangeError, match="others can write"):
                collect(released, where, [victim.pw_name])
            assert not (where / victim.pw_name).exists()
        (moved,) = collect(released, shared / "mine" / "out", [victim.pw_name])  # root's below
        assert moved.status == "collected", moved  # a sticky folder: no one else may rename it
        assert (shared / "mine" / "out").stat().st_mode & 0o777 == 0o700
        mp.setenv("SUDO_UID", str(victim.pw_uid))  # the instructor who ran sudo: trusted
        (moved,) = collect(released, Path(victim.pw_dir, "grading"), [victim.pw_name])
        assert moved.status == "collected", moved
        grades = out  # the same for the grades whose pages go into homes
        with pytest.raises(ExchangeError, match="others can write"):
            return_feedback(grades, [victim.pw_name], "ps1")
        assert not course(victim, "feedback").exists()
    finally:
        shutil.rmtree(out)


def test_a_sparse_notebook_does_not_fill_the_instructors_disk(users, lab, tmp_path):
    """A notebook just under the size cap that is all holes costs its student no disk, and would
    cost OUT its full size for each student who makes one: refused, as bytes no notebook holds."""
    _, released, _ = lab
    sparse = users("sparse")
    handout(released, [sparse.pw_name])
    with course(sparse, "ps1.ipynb").open("r+b") as f:
        f.seek(MAX_SUBMISSION - 2)
        f.write(b"}\n")  # '{' first, '}' last: holes between
        f.seek(0)
        f.write(b"{")
    assert course(sparse, "ps1.ipynb").stat().st_blocks * 512 < 2**20  # costs its owner nothing
    (moved,) = collect(released, tmp_path / "out", [sparse.pw_name])
    assert moved.status == "refused" and "NUL" in moved.detail, moved
    folder = tmp_path / "out" / sparse.pw_name
    assert [p.name for p in folder.iterdir()] == [NOT_COLLECTED]


# --- (d) hostile names ---------------------------------------------------------------------------

HOSTILE = ("", ".", "..", "../etc", "a/b", "collected.json", ".ipynb_checkpoints", "x\n", "\udcff")


def test_a_hostile_user_name_never_climbs_out_of_out_nor_takes_its_files(users, lab, tmp_path):
    """Names a hub or a roster may give: empty, dot-names, paths, the manifest's own name, a
    newline, bytes that are not UTF-8, root: each one an error of its own; OUT holds only the
    real student's folder and the manifest."""
    _, released, student = lab
    real = users("real")
    handout(released, [real.pw_name])
    answered(real, student)
    out = tmp_path / "class" / "out"
    names = [*HOSTILE, "root", "x" * 300, real.pw_name]
    moved = {m.user: m for m in collect(released, out, names)}
    for name in names[:-1]:
        assert moved[name].status == "error" and not moved[name].ok, moved[name]
    assert moved[real.pw_name].status == "collected"
    assert sorted(p.name for p in out.iterdir()) == sorted(["collected.json", real.pw_name])
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]
    manifest = json.loads((out / "collected.json").read_text())
    assert list(manifest) == [real.pw_name]
    back = {m.user: m for m in return_feedback(out, names[:-1], "ps1")}
    assert all(m.status == "error" for m in back.values()), back
