"""A two-node Slurm cluster on this machine (course/cluster/, scripts/cluster.sh): the README's
Slurm scripts (scripts/slurm/) run under it as written.

Needs root and Debian's slurm-wlm and munge (scripts/setup.sh installs them). Runs only where
COURSE_CLUSTER_TESTS=1 (it makes network namespaces and machine-wide cgroups, and the nodes'
cpusets pin its jobs to one core each): `COURSE_CLUSTER_TESTS=1 scripts/test.sh tests/cluster`.
"""

from __future__ import annotations

import csv
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import course.cluster as cluster
from course.cluster import cgroups, layout, netns, slurm

REPO = Path(__file__).resolve().parents[2]
VENV = {"VENV": str(REPO / ".venv")}  # the scripts run the course's venv; the jobs run elsewhere

pytestmark = [
    pytest.mark.skipif(
        os.environ.get("COURSE_CLUSTER_TESTS") != "1",
        reason="the cluster's tests run with COURSE_CLUSTER_TESTS=1 (README: tests/cluster)",
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="the cluster needs root"),
    pytest.mark.skipif(
        shutil.which("slurmd") is None and not Path("/usr/sbin/slurmd").exists(),
        reason="slurm-wlm is not installed: run scripts/setup.sh as root",
    ),
]


def leftovers(state: Path, made: list[layout.Node]) -> list[str]:
    """What of a cluster still exists: namespaces, cgroup folders, its state folder."""
    found = [n.netns for n in made if netns.exists(n)]
    found += [str(cgroups.folder(c)) for c in cgroups.CONTROLLERS if cgroups.folder(c).exists()]
    return found + ([str(state)] if state.exists() else [])


def test_a_failed_up_leaves_nothing_behind(tmp_path):
    """`up` that fails after every daemon started (here: the nodes are given no time to come
    idle) tears down all it made: no process, namespace, cgroup or file is left."""
    state = tmp_path / "state"
    with pytest.raises(RuntimeError, match="not idle after 0 s"):
        cluster.up(state, timeout=0)
    assert leftovers(state, layout.nodes()) == []


def test_missing_munge_or_slurm_says_how_to_install_them(tmp_path):
    (tmp_path / "slurmd").touch(mode=0o755)  # a PATH with Slurm's daemon but no munge
    with pytest.raises(RuntimeError, match="not installed: munged, mungekey, slurmctld.*setup.sh"):
        slurm.check_installed(path=str(tmp_path))


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    state = tmp_path_factory.mktemp("cluster") / "state"
    try:
        cluster.up(state)
        yield state
    finally:
        made = cluster.saved_nodes(state)
        cluster.down(state)
        assert leftovers(state, made) == []


def sbatch(state, *args, cwd, env=VENV) -> str:
    """Submit on the head node; the job id (``--parsable``)."""
    proc = cluster.run(["sbatch", "--parsable", *map(str, args)], state=state, cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def torchrun_job(state, tmp_path, target: str, *args, env=None, options=()) -> str:
    """Submit scripts/slurm/torchrun.sbatch running ``target`` (module:function) with ``args``:
    one core and no GPU on each node, its log in tmp_path/<job id>.out, ``env`` (the script's
    RESTARTS, RDZV_ENDPOINT ...) over the venv's, ``options`` to sbatch first. The job id."""
    return sbatch(
        state,
        *options,
        "--gpus-per-node=0",
        "--cpus-per-task=1",
        f"--output={tmp_path}/%j.out",
        REPO / "scripts/slurm/torchrun.sbatch",
        target,
        *args,
        cwd=tmp_path,
        env={**VENV, **(env or {})},
    )


def job_log(tmp_path, job: str) -> str:
    """What a job of ``torchrun_job`` (or any with its ``--output``) wrote so far."""
    log = tmp_path / f"{job}.out"
    return log.read_text() if log.exists() else ""


def test_each_node_has_its_own_name_address_and_cores(state):
    probe = "echo $(hostname) $(getent hosts node1 | cut -d' ' -f1) $(taskset -cp $$ | cut -d: -f2)"
    proc = cluster.run(["srun", "-N2", "-n2", "-l", "bash", "-c", probe], state=state)
    assert proc.returncode == 0, proc.stderr
    made = cluster.saved_nodes(state)
    got = sorted(line.split(": ", 1)[1].split() for line in proc.stdout.splitlines())
    want = [[n.name, made[0].address, ",".join(map(str, n.cpus))] for n in made]
    assert got == want
    # the addresses exist only inside the cluster's namespaces, never on the host
    host = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    assert layout.SUBNET not in host


def test_the_torchrun_job_trains_lab01_to_the_weights_of_launch(state, tmp_path):
    import helpers
    from helpers.tools import multinode

    job = torchrun_job(
        state,
        tmp_path,
        "helpers.tools.multinode:train_digits",
        env={"LOGLEVEL": "INFO"},  # torchrun's agents then log their rendezvous
    )
    (task,) = cluster.wait(job, state)
    log = job_log(tmp_path, job)
    assert task["JobState"] == "COMPLETED", log[-3000:]
    assert task["NodeList"] == "node[1-2]"
    from_slurm = pickle.loads((tmp_path / f"results-{job}.pkl").read_bytes())
    here = helpers.launch(multinode.train_digits, world_size=2, output="none")
    helpers.shutdown()
    assert [r["node"] for r in from_slurm] == [0, 1]  # one rank on each node
    same = ("rank", "world", "test accuracy", "weights sum", "weights sha1")
    assert [{k: r[k] for k in same} for r in from_slurm] == [{k: r[k] for k in same} for r in here]
    # the agents met on the head node, and its name is the workers' master address
    assert "rdzv_endpoint            : node1:29400" in log and "master_addr=node1" in log


def test_an_elastic_restart_after_a_nodes_worker_dies(state, tmp_path):
    """Rank 1 (on node2) crashes on its first attempt; its agent restarts the group, which
    then finishes with both nodes."""
    job = torchrun_job(
        state, tmp_path, "helpers.tools.multinode:whoami", "1", env={"RESTARTS": "1"}
    )
    (task,) = cluster.wait(job, state)
    log = job_log(tmp_path, job)
    assert task["JobState"] == "COMPLETED", log[-3000:]
    ranks = pickle.loads((tmp_path / f"results-{job}.pkl").read_bytes())
    assert [(r["rank"], r["node"], r["sum of ranks"]) for r in ranks] == [(0, 0, 1.0), (1, 1, 1.0)]
    assert ranks[1]["restarts"] == 1  # node2's agent restarted its worker once


def test_the_grading_array_merges_into_the_gradebook_of_one_run(state, tmp_path):
    from grading_fixtures import plain_submissions, release, write

    src, student = release(tmp_path)
    subs = write(tmp_path / "subs", plain_submissions(student))
    array = sbatch(
        state,
        "--array=1-2",
        "--cpus-per-task=1",
        "--mem=1G",
        f"--output={tmp_path}/%A_%a.out",
        REPO / "scripts/slurm/grade-array.sbatch",
        src,
        subs,
        tmp_path / "grades/ps1",
        cwd=tmp_path,
    )
    course = [sys.executable, "-m", "course"]
    whole = subprocess.run(
        [*course, "grade", src, subs, "--out", tmp_path / "whole", "-j", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert whole.returncode == 0, whole.stderr
    tasks = cluster.wait(array, state)
    assert sorted(t["NodeList"] for t in tasks) == ["node1", "node2"]  # a slice per node
    logs = "".join(p.read_text() for p in tmp_path.glob("*.out"))
    assert [t["JobState"] for t in tasks] == ["COMPLETED"] * 2, logs[-3000:]
    slices = [tmp_path / f"grades/ps1-{k}" for k in (1, 2)]
    merged = subprocess.run(
        [*course, "grade-merge", src, tmp_path / "merged", *slices],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert merged.returncode == 0, merged.stderr

    def gradebook(out):
        return sorted(
            map(dict, csv.DictReader((out / "gradebook.csv").open())), key=lambda r: r["student"]
        )

    assert gradebook(tmp_path / "merged") == gradebook(tmp_path / "whole")
    assert len(gradebook(tmp_path / "whole")) == len(plain_submissions(student))
    assert "UNSAFE" not in logs  # each slice ran isolated, as root on its node


def test_a_job_asking_more_cores_than_a_node_has_is_refused_at_once(state, tmp_path):
    cores = max(len(n.cpus) for n in cluster.saved_nodes(state))
    proc = cluster.run(
        ["sbatch", f"--cpus-per-task={cores + 1}", "--wrap", "true"], state=state, cwd=tmp_path
    )
    assert proc.returncode != 0
    assert "Requested node configuration is not available" in proc.stderr


def jupyter_job(state, tmp_path) -> tuple[str, dict]:
    """Submit scripts/slurm/jupyter.sbatch on node2 (1 core) over a copy of lab 01; return the
    job id and its connection file once JupyterLab answers from node1 (the browser's node)."""
    import json
    import time

    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    shutil.copy(REPO / "labs/lab01_ddp_scaling.ipynb", nbs)
    settings = tmp_path / "jupyter" / "settings"  # every cell rendered, no news pop-up
    for plugin, text in {
        "@jupyterlab/notebook-extension/tracker": '{"windowingMode": "none"}',
        "@jupyterlab/apputils-extension/notification": '{"fetchNews": "false"}',
    }.items():
        (settings / f"{plugin}.jupyterlab-settings").parent.mkdir(parents=True, exist_ok=True)
        (settings / f"{plugin}.jupyterlab-settings").write_text(text)
    env = {
        **VENV,
        "JUPYTERLAB_SETTINGS_DIR": str(settings),
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "jupyter" / "workspaces"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "jupyter" / "runtime"),
    }
    job = sbatch(
        state,
        "-w",
        "node2",
        "--cpus-per-task=1",
        f"--output={tmp_path}/%j.out",
        REPO / "scripts/slurm/jupyter.sbatch",
        nbs,
        "--LabApp.expose_app_in_browser=True",  # the test reads the notebook's model
        cwd=tmp_path,
        env=env,
    )
    conn, deadline = tmp_path / f"connection-{job}.json", time.monotonic() + 180
    probe = "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=3)"
    while time.monotonic() < deadline:
        if conn.exists() and conn.stat().st_size:
            c = json.loads(conn.read_text())
            url = f"http://{c['host']}:{c['port']}/api/status?token={c['token']}"
            if cluster.run([sys.executable, "-c", probe, url], state=state).returncode == 0:
                return job, c
        time.sleep(1)
    log = job_log(tmp_path, job)
    raise AssertionError(f"JupyterLab of job {job} did not answer from node1:\n{log[-3000:]}")


def test_jupyterlab_in_a_job_runs_lab01_with_the_jobs_cores_as_devices(state, tmp_path):
    """As Open OnDemand's Jupyter app: a job serves JupyterLab on node2, a browser on node1
    opens lab 01 at node2's address and runs it to its first launch; the kernel's devices are
    the job's cores, and it sees the job's Slurm variables."""
    import json

    job, conn = jupyter_job(state, tmp_path)
    try:
        shot = REPO / "build" / "screenshots" / "cluster-jupyter-lab01.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        url = f"http://{conn['host']}:{conn['port']}"
        nb = tmp_path / "notebooks" / "lab01_ddp_scaling.ipynb"
        browse = [sys.executable, REPO / "tests/cluster/browse.py", url, conn["token"], nb, shot]
        proc = cluster.run(list(map(str, browse)), state=state, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        seen = json.loads(proc.stdout.strip().splitlines()[-1])
        (task,) = slurm.job_fields(
            cluster.run(["scontrol", "show", "job", "-o", job], state=state).stdout
        )
    finally:
        cluster.run(["scancel", job], state=state)
    assert conn["host"] == "node2" and task["NodeList"] == "node2"
    assert "world size 1: rank 0: 1 thread(s) on cores" in seen["launched"], seen["launched"]
    assert "Error" not in seen["launched"] and "Traceback" not in seen["launched"]
    probe = json.loads(seen["probe"])
    node2 = cluster.saved_nodes(state)[1]
    assert probe["host"] == "node2" and probe["cores"] == list(node2.cpus)
    assert probe["devices"] == int(task["NumCPUs"]) == int(probe["slurm"]["SLURM_CPUS_ON_NODE"])
    assert probe["slurm"]["SLURM_JOB_ID"] == job


def test_a_rendezvous_address_no_node_has_fails_in_seconds_naming_it(state, tmp_path):
    """The torchrun job with its rendezvous at an address on the cluster's network that no node
    has: each node's check fails after RDZV_TIMEOUT, naming the address, before any agent."""
    import time

    nobody = f"{layout.SUBNET}.99:29400"
    start = time.monotonic()
    job = torchrun_job(
        state,
        tmp_path,
        "helpers.tools.multinode:whoami",
        env={"RDZV_ENDPOINT": nobody, "RDZV_TIMEOUT": "5"},
    )
    (task,) = cluster.wait(job, state, timeout=120)
    log = job_log(tmp_path, job)
    assert task["JobState"] == "FAILED", log[-3000:]
    assert f"the rendezvous endpoint {nobody} cannot be reached from node" in log
    assert "torchrun" not in log  # no agent started to wait out torch's own timeout
    assert time.monotonic() - start < 90


def test_a_node_lost_while_its_job_runs_ends_the_job_with_a_clear_error(state, tmp_path):
    """node2 dies (its slurmd, the job's step and workers, all at once) while the torchrun job
    all-reduces across both nodes: the job ends, and ``wait`` names the lost node."""
    import time

    job = torchrun_job(
        state,
        tmp_path,
        "helpers.tools.multinode:all_reduce_for",
        "600",
        env={"LOGLEVEL": "INFO"},
        # else Slurm puts it back in the queue, to start again from the top
        options=("--no-requeue",),
    )
    deadline = time.monotonic() + 240  # both agents' workers started: they are all-reducing
    while time.monotonic() < deadline:
        log = job_log(tmp_path, job)
        if log.count("Starting worker group") >= 2:
            break
        time.sleep(0.5)
    assert log.count("Starting worker group") >= 2, log[-3000:]
    time.sleep(2)
    lost_at = time.monotonic()
    cluster.lose("node2", state)
    try:
        with pytest.raises(
            cluster.NodeLost, match="lost a node while it ran: node2 stopped answering"
        ) as lost:
            cluster.wait(job, state, timeout=150)
        print(lost.value)  # -rP shows what Slurm said
        assert time.monotonic() - lost_at < 150  # Slurm noticed (SlurmdTimeout=30 s): no hang
    finally:
        print(cluster.restore("node2", state))  # the next tests need both nodes


def test_the_link_between_the_nodes_is_shaped_and_unshaped(state):
    """`cluster.sh shape 100`: a token bucket of 100 Mbit/s on each node's end of the pair;
    `shape off` takes both away (lecture 07 measures such a link: tests/cluster/test_link.py)."""

    def qdiscs():
        return {
            n.name: cluster.run(["tc", "qdisc", "show", "dev", n.veth], n.name, state).stdout
            for n in cluster.saved_nodes(state)
        }

    cluster.shape(100, state)
    assert all("tbf" in q and "rate 100Mbit" in q for q in qdiscs().values()), qdiscs()
    cluster.shape(None, state)
    assert not any("tbf" in q for q in qdiscs().values()), qdiscs()


def test_up_refuses_while_a_cluster_is_up(state):
    with pytest.raises(RuntimeError, match="a cluster is up already"):
        cluster.up(state)


def test_zz_a_job_needing_a_node_whose_slurmd_died_fails_with_a_clear_error(state, tmp_path):
    """Last in the file: it leaves node2 down (the fixture's ``down`` removes it all)."""
    import time

    pid = int((state / "node2" / "slurmd.pid").read_text())
    os.kill(pid, 9)  # the node's daemon dies as on a crashed node
    deadline = time.monotonic() + 120  # Slurm marks it DOWN within SlurmdTimeout (30 s) + a ping
    while "node2" not in cluster._down_nodes(state) and time.monotonic() < deadline:
        time.sleep(0.5)
    job = sbatch(state, "-N2", "--wrap", "true", cwd=tmp_path)
    with pytest.raises(RuntimeError, match="node node2 is down or drained"):
        cluster.wait(job, state, timeout=60)
    (task,) = slurm.job_fields(
        cluster.run(["scontrol", "show", "job", "-o", job], state=state).stdout
    )
    assert task["JobState"] == "CANCELLED"
