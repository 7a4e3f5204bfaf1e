"""The course on a real JupyterHub, as a class uses it: two students in headless Chromium.

Starts the hub (course/hub: PAM logins, CourseSpawner's cgroups, the idle culler, the proxy
from .venv/node) on a free port, adds two local students with passwords, and then:
  1. both log in at the same time, each gets lab 01, opens it in JupyterLab and runs its cells up
     to the first `helpers.launch`: each one's CPU use, read from its cgroup's own accounting,
     stays inside its quota, its server's processes are all in its cgroup, and the printed
     worlds are marked oversubscribed exactly where they exceed the student's CPU limit;
  2. one student's fork storm and memory hog leave the other's kernel running;
  3. the idle culler stops a server left idle, and its cgroup goes with it.
The fixture stops the hub and deletes the students, their group and every cgroup, even on
failure. Screenshots go to build/screenshots/hub-*.png. Needs root (users, cgroups).
"""

from __future__ import annotations

import csv
import json
import os
import pwd
import secrets
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from course import exchange
from course.hub import accounts, cgroups, server

REPO = Path(__file__).resolve().parents[2]
SHOTS = REPO / "build" / "screenshots"
LAB = REPO / "labs" / "lab01_ddp_scaling.ipynb"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"]
ARGS += ["--disable-background-networking", "--disable-component-update", "--disable-sync"]

CPU_LIMIT = 1  # one CPU of quota: lab 01's 2- and 4-rank worlds must be marked
MEM_LIMIT = 3 * 2**30  # lab 01's launches (4 ranks) fit; the hog allocates past it
PIDS_LIMIT = 512
CULL_TIMEOUT = 20  # s; open pages poll the server every 10 s, so only a closed one goes idle
# slack over quota x wall: CFS lets a group run one period past its quota before throttling
CPU_SLACK_S = 0.3

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: local users and cgroups")


# --- the hub, its students, and their teardown ------------------------------------------------


def hand_out(student: str) -> Path:
    """Put lab 01 into the student's ~/course/ with `course handout`, as an instructor does."""
    moved = exchange.handout(LAB, [student])
    assert [m.ok for m in moved] == [True], moved
    return Path(pwd.getpwnam(student).pw_dir) / "course" / LAB.name


def _give(student: str, *paths: Path) -> None:
    pw = pwd.getpwnam(student)
    for p in paths:
        os.chown(p, pw.pw_uid, pw.pw_gid)


def lab_settings(student: str, home: Path) -> None:
    """What a student could set in JupyterLab themselves: render every cell (JupyterLab 4
    leaves offscreen cells out of the page), no news popup, and window.jupyterapp for the test."""
    files = {
        ".jupyter/lab/user-settings/@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {
            "windowingMode": "none"
        },
        ".jupyter/lab/user-settings/@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
            "fetchNews": "false",
            "checkForUpdates": False,
        },
        ".jupyter/jupyter_server_config.json": {"LabApp": {"expose_app_in_browser": True}},
    }
    for rel, content in files.items():
        path = home / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))
    for root, dirs, names in os.walk(home / ".jupyter"):
        _give(student, Path(root), *(Path(root) / n for n in dirs + names))


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    tag = secrets.token_hex(3)
    group = f"hubt{tag}"
    students = {f"hubt{tag}{who}": secrets.token_urlsafe(12) for who in ("a", "b")}
    state = tmp_path_factory.mktemp("hub") / "state"
    try:
        notebooks = {}
        for name, password in students.items():
            home = accounts.add_student(name, password, group)
            notebooks[name] = hand_out(name)
            lab_settings(name, home)
        settings = {
            "COURSE_HUB_GROUP": group,
            "COURSE_HUB_CPU_LIMIT": str(CPU_LIMIT),
            "COURSE_HUB_MEM_LIMIT": str(MEM_LIMIT),
            "COURSE_HUB_PIDS_LIMIT": str(PIDS_LIMIT),
            "COURSE_HUB_CULL_TIMEOUT": str(CULL_TIMEOUT),
            "COURSE_HUB_CULL_EVERY": "5",
            "COURSE_HUB_ACTIVITY_INTERVAL": "5",
        }
        info = server.start(state, port=server.free_port(), ip="127.0.0.1", settings=settings)
        tree = cgroups.Group.from_json((state / "cgroups.json").read_text())
        yield {**info, "students": students, "notebooks": notebooks, "tree": tree, "state": state}
    finally:
        server.stop(state)
        for name in students:
            accounts.remove_student(name)
        accounts.remove_group(group)


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"no Chromium at {CHROMIUM}: scripts/setup.sh installs Debian's chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield b
        b.close()


def api(hub, path: str):
    """GET the hub's REST API with the "course" service's token."""
    req = urllib.request.Request(
        f"{hub['url']}/hub/api{path}",
        headers={"Authorization": f"token {server.api_token(hub['state'])}"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


# --- JupyterLab in the page -------------------------------------------------------------------


def first_launch_cell(notebook: Path) -> int:
    """Index of the lab's first code cell that calls helpers.launch."""
    cells = json.loads(notebook.read_text())["cells"]
    return next(
        i
        for i, c in enumerate(cells)
        if c["cell_type"] == "code" and "helpers.launch(" in "".join(c["source"])
    )


KERNEL_IDLE = """() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    const s = w && w.sessionContext && w.sessionContext.session;
    return !!(s && s.kernel && s.kernel.status === 'idle'); }"""

CELL_DONE = """(k) => { const w = window.jupyterapp.shell.currentWidget; const kernel = w.sessionContext.session.kernel;
    const cells = [...w.content.model.cells];
    const failed = cells.slice(0, k + 1).some(c => c.type === 'code'
        && c.outputs.toJSON().some(o => o.output_type === 'error'));
    return kernel.status === 'idle' && (failed || cells[k].executionCount !== null); }"""

CELL_TEXT = """(k) => { const cells = [...window.jupyterapp.shell.currentWidget.content.model.cells];
    return cells.slice(k[0], k[1]).filter(c => c.type === 'code').map(c => c.outputs.toJSON()
        .map(o => (o.text || '') + (o.data && o.data['text/plain'] || '')
        + (o.ename ? o.ename + ': ' + o.evalue : '')).join('')).join('\\n'); }"""


def log_in(page, hub, name: str) -> None:
    """Fill the hub's login form and submit it; returns without waiting for the server."""
    page.goto(f"{hub['url']}/hub/login")
    page.fill("#username_input", name)
    page.fill("#password_input", hub["students"][name])
    page.click("#login_submit", no_wait_after=True)


def open_lab(page, hub, name: str) -> None:
    page.goto(f"{hub['url']}/user/{name}/lab/tree/course/{LAB.name}", timeout=120_000)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
    page.wait_for_function(KERNEL_IDLE, timeout=180_000)


def run_up_to(page, k: int) -> None:
    """Select the cell after ``k`` and run every cell above it (JupyterLab's 'Run All Above
    Selected Cell'), as a student would to reach cell k."""
    page.evaluate(
        """(k) => { const app = window.jupyterapp; const nb = app.shell.currentWidget.content;
            nb.activeCellIndex = k + 1; app.commands.execute('notebook:run-all-above'); }""",
        k,
    )


def add_cell_and_run(page, code: str) -> int:
    """Append a code cell with ``code`` and run it; returns its index."""
    return page.evaluate(
        """async (code) => { const app = window.jupyterapp; const nb = app.shell.currentWidget.content;
            nb.activeCellIndex = nb.widgets.length - 1;
            await app.commands.execute('notebook:insert-cell-below');
            nb.activeCell.model.sharedModel.setSource(code);
            app.commands.execute('notebook:run-cell'); return nb.activeCellIndex; }""",
        code,
    )


def output(page, k: int, timeout: float = 180_000) -> str:
    page.wait_for_function(CELL_DONE, arg=k, timeout=timeout)
    return page.evaluate(CELL_TEXT, [k, k + 1])


def uid_pids(name: str) -> set[int]:
    uid = pwd.getpwnam(name).pw_uid
    return {p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"].real == uid}


def describe(pids: set[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            out.append(f"{pid} {p.status()} ppid={p.ppid()} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            out.append(f"{pid} gone")
    return out


# --- the tests --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def side_by_side(hub, browser):
    """Both students log in at once, open lab 01 and run it to its first launch, at once; the
    CPU each one's cgroup used over that time, and what the cells printed."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    names = list(hub["students"])
    pages = {
        n: browser.new_context(viewport={"width": 1400, "height": 1000}).new_page() for n in names
    }
    for n in names:
        log_in(pages[n], hub, n)  # both submitted before either server is up
    for n in names:
        try:
            pages[n].wait_for_url(f"**/user/{n}/lab**", timeout=180_000)
        except Exception as e:
            pages[n].screenshot(path=str(SHOTS / f"hub-failed-login-{n}.png"))
            log = Path(hub["log"]).read_text()[-3000:]
            raise AssertionError(f"{n} never reached JupyterLab; the hub's log ends:\n{log}") from e
    for n in names:
        open_lab(pages[n], hub, n)
    pages[names[0]].screenshot(path=str(SHOTS / "hub-1-lab01-opened.png"))
    k = first_launch_cell(hub["notebooks"][names[0]])
    groups = {n: cgroups.user_group(hub["tree"], n) for n in names}
    start = {n: (time.monotonic(), cgroups.cpu_seconds(groups[n])) for n in names}
    for n in names:
        run_up_to(pages[n], k)
    done = {}
    deadline = time.monotonic() + 300
    while len(done) < len(names) and time.monotonic() < deadline:
        for n in names:
            if n not in done and pages[n].evaluate(CELL_DONE, k):
                done[n] = (time.monotonic(), cgroups.cpu_seconds(groups[n]))
        time.sleep(0.2)
    assert len(done) == len(names), (
        f"lab 01 did not reach cell {k} in 300 s for {set(names) - set(done)}"
    )
    pages[names[0]].screenshot(path=str(SHOTS / "hub-2-lab01-first-launch.png"))
    used = {n: (done[n][1] - start[n][1], done[n][0] - start[n][0]) for n in names}
    text = {n: pages[n].evaluate(CELL_TEXT, [0, k + 1]) for n in names}
    yield {"pages": pages, "names": names, "k": k, "groups": groups, "used": used, "text": text}
    for p in pages.values():
        if not p.is_closed():
            p.context.close()


def test_both_students_run_lab01_inside_their_own_quota(hub, side_by_side):
    for n in side_by_side["names"]:
        text = side_by_side["text"][n]
        assert "Error" not in text and "Traceback" not in text, f"{n}: {text[-2000:]}"
        cpu_s, wall_s = side_by_side["used"][n]
        print(f"{n}: lab 01 to its first launch used {cpu_s:.2f} CPU-s in {wall_s:.2f} s of wall")
        peak = cgroups.memory_peak(side_by_side["groups"][n])
        print(f"{n}: memory peak so far {peak / 2**30:.2f} GiB" if peak else f"{n}: no memory peak")
        assert cpu_s <= CPU_LIMIT * wall_s + CPU_SLACK_S, (n, cpu_s, wall_s)
        group = side_by_side["groups"][n]
        quota = group.folder("cpu") / "cpu.cfs_quota_us"
        if group.version == 1:
            period = int((group.folder("cpu") / "cpu.cfs_period_us").read_text())
            assert int(quota.read_text()) == CPU_LIMIT * period
        # every process of the student (server, kernel, launcher ranks) is in the student's cgroup
        mine = uid_pids(n)
        assert len(mine) >= 3, f"{n}: expected a server, a kernel and ranks, found {mine}"
        for folder in group.folders():
            procs = {int(p) for p in (folder / "cgroup.procs").read_text().split()}
            assert mine <= procs, f"{n}: {mine - procs} outside {folder}"


def test_the_worlds_past_the_quota_are_marked_oversubscribed(side_by_side):
    for n in side_by_side["names"]:
        lines = [ln for ln in side_by_side["text"][n].splitlines() if ln.startswith("world size ")]
        assert lines, f"{n}: lab 01's first launch printed no worlds:\n{side_by_side['text'][n]}"
        for line in lines:
            world = int(line.split()[2].rstrip(":"))
            assert ("(oversubscribed)" in line) == (world > CPU_LIMIT), (
                f"{n}, {CPU_LIMIT} CPU of quota: {line!r} (needs helpers.world.cpu_count to read "
                "the CFS quota)"
            )


PEEK = """from pathlib import Path
for name in {names!r}:
    try:
        found = sorted(p.name for p in Path({repo!r}, name).iterdir())
        print(name, "READABLE", found[:3])
    except PermissionError:
        print(name, "refused")"""


def test_a_student_cannot_read_the_solutions(side_by_side):
    """A student who could read solutions/ (or build/, or the objects in .git) could copy an
    answer into ~/course and have `course collect` take it as their own work."""
    page = side_by_side["pages"][side_by_side["names"][0]]
    cell = add_cell_and_run(page, PEEK.format(names=accounts.INSTRUCTOR_ONLY, repo=str(REPO)))
    text = output(page, cell)
    for name in accounts.INSTRUCTOR_ONLY:
        if (REPO / name).exists():
            assert f"{name} refused" in text, text


SAVE = """() => window.jupyterapp.commands.execute('docmanager:save')"""
SAVED = """() => !window.jupyterapp.shell.currentWidget.context.model.dirty"""


def course_cli(*args: str, token: str | None = None, timeout: float = 600):
    env = {**os.environ, "JUPYTERHUB_API_TOKEN": token} if token else None
    done = subprocess.run(
        [str(REPO / ".venv" / "bin" / "course"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=env,
    )
    assert done.returncode == 0, f"course {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done


def test_the_hub_collects_grades_and_returns(hub, side_by_side, tmp_path):
    """The instructor's round trip through the hub: each student saves lab 01 where the hub
    handed it out; `course collect --hub` takes the hub's users' notebooks, `course grade`
    grades them, `course return --hub` puts each feedback page in that student's home, and
    the student opens it in JupyterLab."""
    pages, names = side_by_side["pages"], side_by_side["names"]
    for n in names:
        pages[n].evaluate(SAVE)
        pages[n].wait_for_function(SAVED, timeout=30_000)
    token, url = server.api_token(hub["state"]), hub["url"]
    subs, grades = tmp_path / "subs", tmp_path / "grades"
    t0 = time.monotonic()
    course_cli("collect", "lab01", str(subs), "--hub", url, token=token)
    collected = json.loads((subs / "collected.json").read_text())
    print(f"collect: {time.monotonic() - t0:.1f} s")
    for n in names:  # each one's own saved notebook, with the outputs of the cells they ran
        taken = (subs / n / LAB.name).read_bytes()
        assert taken == hub["notebooks"][n].read_bytes(), n
        assert "world size " in taken.decode(), f"{n}: the saved notebook lacks its run"
    assert sorted(collected) == sorted(names), collected  # the hub's users, no admin
    t0 = time.monotonic()
    course_cli("grade", "lab01", str(subs), "--out", str(grades), "-j", "2")
    print(f"grade: {time.monotonic() - t0:.1f} s")
    with open(grades / "gradebook.csv") as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    assert sorted(rows) == sorted(names), rows
    for n in names:  # graded (the stubs score what stubs score), not refused
        assert rows[n]["status"] == "graded", rows[n]
    course_cli("return", str(grades), "--hub", url, token=token)
    for n in names:
        page = pages[n].context.new_page()  # the student's own browser, logged in
        page.goto(f"{url}/user/{n}/lab/tree/course/feedback/{LAB.stem}.html", timeout=120_000)
        page.wait_for_selector("iframe", timeout=60_000)
        frame = page.frame_locator("iframe").first
        frame.locator("body").wait_for(timeout=60_000)
        assert n in frame.locator("body").inner_text(), f"{n}'s feedback page does not name them"
        page.screenshot(path=str(SHOTS / f"hub-5-feedback-{names.index(n)}.png"))
        page.close()


SPIN = """import os, time, helpers
def spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return os.getpid()
print("spun", helpers.launch(spin, 3.0, world_size=2))"""


def test_two_busy_ranks_are_throttled_to_the_quota(side_by_side):
    """Two ranks spinning want two CPUs: the cgroup holds them to one. One student at a time
    (two students spinning at once would share the 2 cores fairly without any quota): the
    cgroup throttles, and its own accounting shows no more than the quota."""
    pages, groups = side_by_side["pages"], side_by_side["groups"]
    for n in side_by_side["names"]:
        t0, c0, th0 = time.monotonic(), cgroups.cpu_seconds(groups[n]), cgroups.throttled(groups[n])
        assert "spun [" in output(pages[n], add_cell_and_run(pages[n], SPIN)), n
        cpu_s, wall_s = cgroups.cpu_seconds(groups[n]) - c0, time.monotonic() - t0
        print(f"{n}: 2 spinning ranks used {cpu_s:.2f} CPU-s in {wall_s:.2f} s of wall")
        assert cpu_s <= CPU_LIMIT * wall_s + CPU_SLACK_S, (n, cpu_s, wall_s)
        assert cgroups.throttled(groups[n]) > th0, f"{n}: the quota never throttled 2 busy ranks"


STORM = """import os, time
kids = []
try:
    while len(kids) < {cap}:   # a cap, in case pids.max did not hold: this machine is shared
        pid = os.fork()
        if pid == 0:
            time.sleep(600)
            os._exit(0)
        kids.append(pid)
    print(f"fork storm: {{len(kids)}} processes, never refused", flush=True)
except BlockingIOError as e:
    print(f"fork storm: refused after {{len(kids)}} processes ({{e.strerror}})", flush=True)
time.sleep(600)
"""

STORM_CELL = """import subprocess, sys
storm = subprocess.Popen([sys.executable, "-c", {code!r}], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
print(storm.stdout.readline().strip())"""

HOG = """import numpy as np
chunks = []
for _ in range({chunks}):   # a cap, in case the limit did not hold
    chunks.append(np.ones(2**23))   # 64 MiB, every page written
print(f"allocated {{len(chunks) * 64}} MiB: the memory limit did not hold")"""

OTHER = """import os, helpers
print("still here", os.getpid(), helpers.launch(lambda: 6 * 7, world_size=2))"""


def test_one_students_fork_storm_and_memory_hog_leave_the_other_running(hub, side_by_side):
    pages, groups = side_by_side["pages"], side_by_side["groups"]
    hog, other = side_by_side["names"]
    other_pid = int(
        output(
            pages[other], add_cell_and_run(pages[other], "import os; print(os.getpid())")
        ).split()[-1]
    )

    # the fork storm: the student's own pids.max refuses it; the other launches two ranks
    refused = cgroups.fork_refusals(groups[hog])
    cell = add_cell_and_run(pages[hog], STORM_CELL.format(code=STORM.format(cap=2 * PIDS_LIMIT)))
    storm = output(pages[hog], cell)
    assert "refused after" in storm, storm
    assert cgroups.fork_refusals(groups[hog]) > refused
    reply = output(pages[other], add_cell_and_run(pages[other], OTHER))
    assert f"still here {other_pid} [42, 42]" in reply, reply
    pages[other].screenshot(path=str(SHOTS / "hub-3-other-student-during-fork-storm.png"))
    output(
        pages[hog],
        add_cell_and_run(
            pages[hog], "import os; os.killpg(storm.pid, 9); storm.wait(); print('calm')"
        ),
    )

    # the memory hog: the kernel is killed inside the student's own memory cgroup
    kills = cgroups.memory_events(groups[hog]).get("oom_kill", 0)
    hog_pid = int(
        output(pages[hog], add_cell_and_run(pages[hog], "import os; print(os.getpid())")).split()[
            -1
        ]
    )
    add_cell_and_run(pages[hog], HOG.format(chunks=2 * MEM_LIMIT // 2**26))
    deadline = time.monotonic() + 120
    while psutil.pid_exists(hog_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not psutil.pid_exists(hog_pid), "the memory hog's kernel outlived its memory limit"
    events = cgroups.memory_events(groups[hog])
    assert events["oom_kill"] > kills, events  # killed by its own cgroup's OOM killer
    pages[hog].wait_for_timeout(1000)
    pages[hog].screenshot(path=str(SHOTS / "hub-4-memory-hog-kernel-died.png"))
    reply = output(pages[other], add_cell_and_run(pages[other], OTHER))
    assert f"still here {other_pid} [42, 42]" in reply, reply


def test_the_idle_culler_stops_an_idle_server_and_its_cgroup_goes(hub, side_by_side):
    culler = [
        p
        for pid in cgroups.pids(hub["tree"].child("hub"))
        if "jupyterhub_idle_culler" in " ".join((p := psutil.Process(pid)).cmdline())
    ]
    assert culler, "no idle-culler service in the hub's cgroup"
    assert "idle-culler" in api(hub, "/services")
    name = side_by_side["names"][0]
    group = side_by_side["groups"][name]
    side_by_side["pages"][name].context.close()  # the student leaves: nothing polls any more
    deadline = time.monotonic() + CULL_TIMEOUT + 90
    while api(hub, f"/users/{name}")["servers"] and time.monotonic() < deadline:
        time.sleep(1)
    assert not api(hub, f"/users/{name}")["servers"], f"{name}'s idle server was not culled"
    assert not any(f.exists() for f in group.folders()), "the culled server's cgroup is left"
    deadline = time.monotonic() + 10  # the last ones killed may still be exiting
    while (left := uid_pids(name)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"{name} has processes left after the cull: {describe(left)}"
