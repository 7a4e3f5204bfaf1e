"""`course handout`, `collect` and `return` with real local users (useradd), real homes holding
what a student can plant there (links to /etc/shadow, to the solutions, to a classmate's folder;
a FIFO; a hard link; 100 MB), a real `course grade` of what was collected, and a real JupyterHub
for --hub."""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest
from grading_fixtures import (
    answer,
    exchange_lab,  # noqa: F401  (the fixture "lab")
    user_exists,
)

from course.exchange import ExchangeError, collect, handout, hub_users, return_feedback
from course.grading.submission import MAX_SUBMISSION, NOT_COLLECTED

REPO = Path(__file__).resolve().parents[2]
SOLUTION = REPO / "solutions" / "lab01_ddp_scaling.ipynb"  # readable by every user
CHP = REPO / ".venv" / "node" / "node_modules" / ".bin" / "configurable-http-proxy"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("useradd"),
    reason="needs root and useradd: the tests make real local users",
)


@pytest.fixture(scope="module")
def accounts():
    """make(role): a new local user cx-<random>-<role> with a home; all deleted at the end."""
    made = []

    def make(role: str) -> pwd.struct_passwd:
        name = f"cx-{secrets.token_hex(3)}-{role}"
        subprocess.run(
            ["useradd", "-m", "-s", "/usr/sbin/nologin", name], check=True, capture_output=True
        )
        made.append(name)
        return pwd.getpwnam(name)

    try:
        yield make
    finally:
        for name in made:
            subprocess.run(["userdel", "-r", name], capture_output=True)
        assert not [n for n in made if user_exists(n)], "a test user outlived the tests"


def course(pw, *names) -> Path:
    return Path(pw.pw_dir, "course", *names)


def plant(path: Path, pw, make) -> None:
    """``make(path)`` with whatever was at ``path`` gone, owned by ``pw``: the student's doing."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    make(path)
    os.lchown(path, pw.pw_uid, pw.pw_gid)


def course_cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "course", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_handout_gives_each_user_their_own_copy_and_never_replaces_one(accounts, lab):
    _, released, _ = lab
    a, b, to_etc, dangling = (accounts(r) for r in ("a", "b", "etc", "dangle"))
    for pw in (to_etc, dangling):  # what these two planted before the lab came
        os.mkdir(course(pw))
        os.chown(course(pw), pw.pw_uid, pw.pw_gid)
    plant(course(to_etc), to_etc, lambda p: p.symlink_to("/etc"))
    ghost = Path("/root", f"cx-{secrets.token_hex(4)}")
    plant(course(dangling, "ps1.ipynb"), dangling, lambda p: p.symlink_to(ghost))
    nobody = f"cx-nobody-{secrets.token_hex(3)}"

    moved = {m.user: m for m in handout(released, [a.pw_name, nobody, b.pw_name, to_etc.pw_name])}
    for pw in (a, b):
        assert moved[pw.pw_name].status == "handed out", moved[pw.pw_name]
        st = course(pw, "ps1.ipynb").lstat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (pw.pw_uid, pw.pw_gid, 0o600)
        assert course(pw, "ps1.ipynb").read_bytes() == released.read_bytes()
        assert course(pw).stat().st_uid == pw.pw_uid
    assert moved[nobody].status == "error" and nobody in moved[nobody].detail
    assert moved[to_etc.pw_name].status == "refused" and not moved[to_etc.pw_name].ok
    assert "symbolic link" in moved[to_etc.pw_name].detail
    assert not Path("/etc/ps1.ipynb").exists()

    # the student's work is never lost: a second handout leaves every copy as it is
    course(a, "ps1.ipynb").write_text("my work")
    again = handout(released, [a.pw_name, dangling.pw_name])
    assert [m.status for m in again] == ["left as is", "left as is"], again
    assert course(a, "ps1.ipynb").read_text() == "my work"
    assert course(dangling, "ps1.ipynb").is_symlink() and not ghost.exists()

    with pytest.raises(ExchangeError, match="solution"):  # never the solutions
        handout(SOLUTION, [b.pw_name])


ROSTER = ("good", "nolab", "dirlink", "shadow", "solution", "fifo", "hard", "big")


@pytest.fixture(scope="module")
def graded(accounts, lab, tmp_path_factory):
    """A class handed the lab, then: one answers it, the others plant an attack each; collected
    with `course collect --roster`, graded with `course grade`."""
    src, released, student = lab
    users = {role: accounts(role) for role in ROSTER}
    assert all(
        m.status == "handed out" for m in handout(released, [u.pw_name for u in users.values()])
    )
    good = users["good"]
    nbformat.write(answer(student), course(good, "ps1.ipynb"))
    os.chmod(course(good), 0o755)  # readable by all: a link is refused by rule, not by mode
    os.chmod(course(good, "ps1.ipynb"), 0o644)
    course(users["nolab"], "ps1.ipynb").unlink()
    plant(course(users["dirlink"]), users["dirlink"], lambda p: p.symlink_to(course(good)))
    plant(
        course(users["shadow"], "ps1.ipynb"), users["shadow"], lambda p: p.symlink_to("/etc/shadow")
    )
    plant(
        course(users["solution"], "ps1.ipynb"), users["solution"], lambda p: p.symlink_to(SOLUTION)
    )
    plant(course(users["fifo"], "ps1.ipynb"), users["fifo"], os.mkfifo)
    draft = course(good, "draft.ipynb")  # a classmate's file, linked under the lab's name
    nbformat.write(answer(student), draft)
    os.chown(draft, good.pw_uid, good.pw_gid)
    plant(course(users["hard"], "ps1.ipynb"), users["hard"], lambda p: os.link(draft, p))
    with course(users["big"], "ps1.ipynb").open("r+b") as f:
        f.truncate(100 * 2**20)  # sparse: 100 MB that cost no disk

    root = tmp_path_factory.mktemp("exchange-class")
    nobody = f"cx-nobody-{secrets.token_hex(3)}"
    roster = root / "roster.txt"
    roster.write_text(
        "# the class\n" + "\n".join([*(u.pw_name for u in users.values()), nobody, ""])
    )
    subs, grades = root / "subs", root / "grades"
    collected = course_cli("collect", released, subs, "--roster", roster)
    grade = course_cli("grade", src, subs, "--out", grades, "--cell-timeout", 30, "--budget", 90)
    assert grade.returncode == 0, grade.stderr[-3000:]
    book = {r["student"]: r for r in csv.DictReader((grades / "gradebook.csv").open())}
    return users, nobody, collected, subs, grades, book


def test_collect_takes_the_notebook_and_refuses_every_planted_attack(graded):
    users, nobody, collected, subs, _, _ = graded
    assert collected.returncode == 1  # the unknown user, alone
    assert f"no local user named '{nobody}'" in collected.stderr and not (subs / nobody).exists()
    good = users["good"]
    assert (subs / good.pw_name / "ps1.ipynb").read_bytes() == course(
        good, "ps1.ipynb"
    ).read_bytes()
    manifest = json.loads((subs / "collected.json").read_text())
    entry = manifest[good.pw_name]
    assert entry["status"] == "collected" and entry["source"] == str(course(good, "ps1.ipynb"))
    assert entry["sha256"] == hashlib.sha256(course(good, "ps1.ipynb").read_bytes()).hexdigest()
    assert entry["size"] == course(good, "ps1.ipynb").stat().st_size and entry["mtime"]
    for role in ROSTER[1:]:  # nothing taken: a note says why, and the manifest too
        name = users[role].pw_name
        assert [p.name for p in (subs / name).iterdir()] == [NOT_COLLECTED], role
        assert manifest[name]["reason"] == (subs / name / NOT_COLLECTED).read_text().strip()
    shadow = Path("/etc/shadow").read_bytes()
    for f in subs.rglob("*"):  # neither the secrets nor the solutions nor a classmate's work
        if f.is_file():
            data = f.read_bytes()
            assert shadow not in data and b"BEGIN SOLUTION" not in data, f
            if f.parent.name != good.pw_name and f.name != "collected.json":
                assert b"mean(xs)" not in data, f


def test_grade_reads_the_collected_folder_with_each_reason(graded):
    users, _, _, _, grades, book = graded
    row = {role: book[users[role].pw_name] for role in ROSTER}
    assert row["good"]["status"] == "graded" and row["good"]["total"] == "6.0", row["good"]
    want = {
        "nolab": f"no submission: {course(users['nolab'], 'ps1.ipynb')} was not found",
        "dirlink": f"{course(users['dirlink'])} is a symbolic link",
        "shadow": "ps1.ipynb is a symbolic link",
        "solution": "ps1.ipynb is a symbolic link",
        "fifo": "is not a regular file",
        "hard": "is a hard link to another file",
        "big": f"is over {MAX_SUBMISSION // 2**20} MiB",
    }
    for role, reason in want.items():
        assert row[role]["status"] == "invalid" and reason in row[role]["reason"], row[role]
        page = (grades / "feedback" / f"{users[role].pw_name}.html").read_text()
        assert reason.split(": ")[0] in page  # the student reads it too


def test_return_puts_each_page_in_its_home_and_never_writes_through_a_link(graded):
    users, nobody, _, _, grades, _ = graded
    good, dirlink = users["good"], users["dirlink"]
    # planted for the return: ~/course/feedback a link to /etc; the page a link to /root/...
    to_etc, to_root = users["fifo"], users["hard"]
    plant(course(to_etc, "feedback"), to_etc, lambda p: p.symlink_to("/etc"))
    ghost = Path("/root", f"cx-{secrets.token_hex(4)}")
    course(to_root, "feedback").mkdir()
    os.chown(course(to_root, "feedback"), to_root.pw_uid, to_root.pw_gid)
    plant(course(to_root, "feedback", "ps1.html"), to_root, lambda p: p.symlink_to(ghost))

    order = [good, dirlink, to_etc, to_root, users["nolab"]]  # dirlink after good: its link
    names = ",".join([*(u.pw_name for u in order), nobody])  # leads into good's folder
    done = course_cli("return", grades, "--lab", "ps1", "--users", names)
    assert done.returncode == 1, done.stdout + done.stderr
    for pw in (good, to_root, users["nolab"]):
        page = course(pw, "feedback", "ps1.html")
        st = page.lstat()
        assert (st.st_uid, st.st_mode & 0o7777) == (pw.pw_uid, 0o600), pw.pw_name
        assert page.read_bytes() == (grades / "feedback" / f"{pw.pw_name}.html").read_bytes()
        assert f"{pw.pw_name}: returned" in done.stdout
    assert not ghost.exists() and not Path("/etc/ps1.html").exists()
    assert (
        f"{to_etc.pw_name}: refused: {course(to_etc, 'feedback')} is a symbolic link" in done.stderr
    )
    assert f"{dirlink.pw_name}: refused: {course(dirlink)} is a symbolic link" in done.stderr
    assert f"no local user named '{nobody}'" in done.stderr
    assert "no submission" in course(users["nolab"], "feedback", "ps1.html").read_text()
    with pytest.raises(ExchangeError, match="--lab"):  # ps1 is not in solutions/
        return_feedback(grades, [good.pw_name])


def test_collect_never_takes_what_is_swapped_in_while_it_reads(accounts, lab, tmp_path):
    """The notebook flips between the student's own file and a link to a classmate's readable
    one, as fast as it can, while it is collected again and again: only their own is taken."""
    _, released, student = lab
    mine, theirs = accounts("swap"), accounts("victim")
    handout(released, [mine.pw_name, theirs.pw_name])
    nbformat.write(answer(student, square="return x ** 2"), course(theirs, "ps1.ipynb"))
    os.chmod(course(theirs), 0o755)
    os.chmod(course(theirs, "ps1.ipynb"), 0o644)
    own = course(mine, "ps1.ipynb").read_bytes()
    stop = threading.Event()

    def flip():
        nb, n = course(mine, "ps1.ipynb"), 0
        while not stop.is_set():
            tmp = nb.with_name(f"flip{n}")
            if n % 2:
                tmp.write_bytes(own)
            else:
                tmp.symlink_to(course(theirs, "ps1.ipynb"))
            os.replace(tmp, nb)
            n += 1

    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        seen = set()
        for _ in range(60):
            (moved,) = collect(released, tmp_path / "out", [mine.pw_name])
            seen.add(moved.status)
            got = tmp_path / "out" / mine.pw_name / "ps1.ipynb"
            if moved.status == "collected":
                assert got.read_bytes() == own
            else:
                assert moved.status == "refused" and "symbolic link" in moved.detail, moved
                assert not got.exists()
    finally:
        stop.set()
        flipper.join()
    print(f"outcomes seen while flipping: {sorted(seen)}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def hub(accounts, tmp_path):
    """A real JupyterHub (its proxy too) whose users are two local users and an admin;
    (url, token, students)."""
    if not CHP.exists():
        pytest.skip("no configurable-http-proxy in .venv/node: run scripts/setup.sh")
    students = sorted(accounts(r).pw_name for r in ("hub1", "hub2"))
    token, port = secrets.token_hex(16), _free_port()
    config = tmp_path / "hub_config.py"
    config.write_text(
        f"""c = get_config()
c.JupyterHub.bind_url = "http://127.0.0.1:{port}"
c.JupyterHub.hub_port = {_free_port()}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{_free_port()}"
c.ConfigurableHTTPProxy.command = [{str(CHP)!r}]
c.ConfigurableHTTPProxy.pid_file = {str(tmp_path / "proxy.pid")!r}
c.JupyterHub.db_url = "sqlite:///{tmp_path / "hub.sqlite"}"
c.JupyterHub.cookie_secret_file = {str(tmp_path / "cookie_secret")!r}
c.JupyterHub.authenticator_class = "dummy"
c.Authenticator.allowed_users = {set(students)!r}
c.Authenticator.admin_users = {{"cx-instructor"}}
c.JupyterHub.services = [{{"name": "course-exchange", "api_token": {token!r}}}]
c.JupyterHub.load_roles = [{{"name": "course-exchange", "scopes": ["list:users", "read:users"],
                            "services": ["course-exchange"]}}]
c.JupyterHub.api_page_default_limit = 2  # three users: the list comes in two pages
c.JupyterHub.api_page_max_limit = 2
"""
    )
    log = (tmp_path / "hub.log").open("w")
    proc = subprocess.Popen(
        [str(REPO / ".venv" / "bin" / "jupyterhub"), "-f", str(config)],
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # the hub and its proxy: one group, ended together
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "hub.log").read_text()[-3000:]
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{url}/hub/api/", timeout=2)
                break
            assert time.monotonic() < deadline, "the hub did not start in 60 s"
            time.sleep(0.2)
        yield url, token, students
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        log.close()


def test_hub_lists_its_students_and_says_what_is_wrong(hub, lab, tmp_path):
    url, token, students = hub
    _, released, _ = lab
    assert sorted(hub_users(url, token)) == students  # two pages; the admin left out
    assert sorted(hub_users(f"{url}/hub/", token)) == students
    with pytest.raises(ExchangeError, match="refused the token"):
        hub_users(url, "not-a-token")
    with pytest.raises(ExchangeError, match="JUPYTERHUB_API_TOKEN"):
        hub_users(url, None)
    with pytest.raises(ExchangeError, match="cannot reach the hub"):
        hub_users(f"http://127.0.0.1:{_free_port()}", token)

    env = {**os.environ, "JUPYTERHUB_API_TOKEN": token}
    done = course_cli("handout", released, "--hub", url, env=env)
    assert done.returncode == 0, done.stderr
    assert "left out, as the hub's admins: cx-instructor" in done.stderr
    for name in students:
        assert f"{name}: handed out" in done.stdout
        assert Path(pwd.getpwnam(name).pw_dir, "course", "ps1.ipynb").exists()
    env.pop("JUPYTERHUB_API_TOKEN")
    done = course_cli("collect", released, tmp_path / "out", "--hub", url, env=env)
    assert done.returncode == 2 and "JUPYTERHUB_API_TOKEN" in done.stderr
    assert not (tmp_path / "out").exists()


def test_the_student_cannot_read_the_process_that_acts_as_them(accounts, monkeypatch):
    """The child that became the student holds what root's process held (here the hub's token,
    in its environment): the student may signal it, never read it (/proc/PID/environ, mem)."""
    from course.exchange import as_user

    pw = accounts("peek")
    secret = secrets.token_hex(16)
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", secret)
    pidfile, go = Path(pw.pw_dir, "pid"), Path(pw.pw_dir, "go")

    def work():  # in the child, as the student: says where it is, waits to be looked at
        Path(f"{pidfile}.new").write_text(str(os.getpid()))
        os.rename(f"{pidfile}.new", pidfile)  # whole: never an empty file read as a pid
        deadline = time.monotonic() + 20
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return {"status": "done", "detail": ""}

    replies = []
    child = threading.Thread(target=lambda: replies.append(as_user(pw, work)))
    child.start()
    own = subprocess.Popen(["sleep", "30"], user=pw.pw_name, env={"X": secret})
    try:
        # the sleep must have become the student and exec'd before it is looked at
        while not pidfile.exists() or not Path(f"/proc/{own.pid}/cmdline").read_bytes().startswith(
            b"sleep"
        ):
            time.sleep(0.02)
        peeks = {
            pid: [
                subprocess.run(
                    ["cat", f"/proc/{pid}/{f}"], user=pw.pw_name, capture_output=True, timeout=10
                )
                for f in ("environ", "mem")
            ]
            for pid in (int(pidfile.read_text()), own.pid)
        }
    finally:
        go.touch()
        child.join()
        own.kill()
        own.wait()
    assert replies == [{"status": "done", "detail": "", "data": b""}]
    acting, theirs = peeks.values()
    assert secret.encode() in theirs[0].stdout  # the peek works on the student's own process
    for peek in acting:
        assert peek.returncode != 0 and b"Permission denied" in peek.stderr, peek


def test_return_names_the_page_after_the_lab_the_folder_was_graded_with(accounts, tmp_path):
    """Without --lab, the lab is the notebook of solutions/ whose sha256 shard.json records."""
    pw = accounts("named")
    digest = hashlib.sha256(SOLUTION.read_bytes()).hexdigest()
    (tmp_path / "shard.json").write_text(json.dumps({"lab_sha256": digest}))
    (tmp_path / "feedback").mkdir()
    (tmp_path / "feedback" / f"{pw.pw_name}.html").write_text("<p>well done</p>")
    (moved,) = return_feedback(tmp_path, [pw.pw_name])
    assert moved.status == "returned", moved
    page = course(pw, "feedback", f"{SOLUTION.stem}.html")
    assert page.read_text() == "<p>well done</p>" and page.stat().st_uid == pw.pw_uid
