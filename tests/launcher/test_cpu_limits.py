"""The device model under a CPU quota: what a JupyterHub or Kubernetes server is given.

Real cgroups with real quotas (v1 here; v2 where its cpu controller is mounted) and real
processes moved into them: the count, the oversubscribed mark, the thread budget, the
grader's slots and the launch notice all follow the quota, and a measured run shows two ranks
under a 1-CPU quota not scaling, marked as such; a kernel in that quota marks its %%ranks world of
two oversubscribed. A made-up /proc and cgroup tree checks the
layouts this machine does not mount (cgroup v2's cpu.max, a container's mount root).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from helpers.launcher.limits import CpuLimit, Quota, cpu_limit, slurm_cpus, tightest_quota

REPO = Path(__file__).resolve().parents[2]
V1 = Path("/sys/fs/cgroup")
PERIOD = 100_000  # µs: the CFS period hub spawners use


def _v2_with_cpu() -> Path | None:
    for mount in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        if (
            "cpu" in (mount / "cgroup.controllers").read_text().split()
            if (mount / "cgroup.controllers").exists()
            else False
        ):
            return mount
    return None


def _v1_writable() -> bool:
    probe = V1 / "cpu" / f"course-probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
        probe.rmdir()
        return (V1 / "cpuacct").is_dir()
    except OSError:
        return False


needs_v1 = pytest.mark.skipif(
    not (os.geteuid() == 0 and _v1_writable()),
    reason="needs root and a writable cgroup v1 cpu hierarchy (these machines have one)",
)


class Cgroup:
    """A cgroup in the cpu and cpuacct hierarchies, with an optional quota; removed after."""

    def __init__(self, name: str, parent: Cgroup | None = None):
        base = {c: (parent.dirs[c] if parent else V1 / c) for c in ("cpu", "cpuacct")}
        self.dirs = {c: base[c] / name for c in base}
        for d in self.dirs.values():
            d.mkdir()

    def limit(self, cpus: float | None) -> None:
        if cpus is not None:
            (self.dirs["cpu"] / "cpu.cfs_period_us").write_text(str(PERIOD))
            (self.dirs["cpu"] / "cpu.cfs_quota_us").write_text(str(int(cpus * PERIOD)))

    def run(self, code: str, timeout: float = 180) -> subprocess.CompletedProcess:
        """Python ``code`` in a fresh process that joins this cgroup before it starts."""
        join = "; ".join(f"echo $$ > {d}/cgroup.procs" for d in self.dirs.values())
        return subprocess.run(
            ["sh", "-c", f'{join}; exec "$0" -c "$1"', sys.executable, textwrap.dedent(code)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"},
        )

    def usage_s(self) -> float:
        return int((self.dirs["cpuacct"] / "cpuacct.usage").read_text()) / 1e9

    def throttled(self) -> int:
        stat = dict(
            line.split() for line in (self.dirs["cpu"] / "cpu.stat").read_text().splitlines()
        )
        return int(stat["nr_throttled"])

    def remove(self) -> None:
        for d in sorted(self.dirs.values(), key=lambda p: -len(p.parts)):
            for pid in (d / "cgroup.procs").read_text().split() if d.exists() else []:
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
            for _ in range(50):  # a killed process leaves its cgroup a moment later
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)


@pytest.fixture
def cgroups():
    made = []

    def make(cpus, parent=None):
        made.append(Cgroup(f"course-test-{uuid.uuid4().hex[:8]}", parent))
        made[-1].limit(cpus)  # after it is known to the fixture, so a refused quota is removed
        return made[-1]

    yield make
    for g in reversed(made):  # children first
        g.remove()


PROBE = """
    import json, helpers, torch
    from helpers.launcher.limits import cpu_limit
    from course.grading.isolation import plan_slots, slot_cores
    limit = cpu_limit()
    print(json.dumps({
        "count": helpers.world.cpu_count(),
        "source": limit.source,
        "describe": limit.describe(),
        "over1": helpers.world.oversubscribed(1),
        "over2": helpers.world.oversubscribed(2),
        "over1x2": helpers.world.oversubscribed(1, helpers.world.thread_budget(1, 2)),
        "pin2": helpers.world.pinned_cores(0, 2, 1),
        "slots": plan_slots(2, 1),
        "slot0": slot_cores(0, 1),
        "cores": len(limit.cores),
        "torch_threads": torch.get_num_threads(),
    }))
"""


def _probe(group: Cgroup) -> dict:
    done = group.run(PROBE)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_v1
def test_a_one_cpu_quota_is_one_device(cgroups):
    seen = _probe(cgroups(1.0))
    assert seen["count"] == 1 and seen["source"] == "quota", seen
    assert seen["over2"] and not seen["over1"]  # 2 ranks share 1 CPU: the mark
    assert seen["over1x2"]  # a budget of 2 threads for 1 rank is past the quota too
    assert seen["pin2"] is None  # an oversubscribed world is not pinned
    assert seen["torch_threads"] == 1  # the kernel's own torch: one thread, not one per core
    assert "CPU quota of 1 CPU (cgroup v1" in seen["describe"], seen["describe"]
    assert "cpu.cfs_quota_us" in seen["describe"]
    # the grader on such a server: one slot, narrowed to one core by its cpuset
    if seen["cores"] > 1:
        assert seen["slots"] == [1, 1] and len(seen["slot0"]) == 1


@needs_v1
def test_a_parents_quota_caps_its_children_rounded_down(cgroups):
    parent = cgroups(1.5)
    seen = _probe(cgroups(None, parent))  # the child sets no quota of its own
    assert seen["count"] == 1, seen  # 1.5 CPUs: one whole device
    assert "1.5 CPUs" in seen["describe"] and parent.dirs["cpu"].name in seen["describe"]
    assert "rounded down" in seen["describe"]


@needs_v1
def test_the_tightest_of_nested_quotas_wins(cgroups):
    # (v1 refuses a child a larger quota than its parent's; v2 allows it: the made-up tree below)
    parent = cgroups(2.0)
    seen = _probe(cgroups(0.5, parent))
    assert seen["count"] == 1 and "0.5 CPU" in seen["describe"], seen  # at least one device


@needs_v1
def test_a_quota_as_large_as_the_mask_changes_nothing(cgroups):
    cores = len(os.sched_getaffinity(0))
    seen = _probe(cgroups(float(cores)))
    assert seen["count"] == cores and seen["source"] != "quota", seen
    assert not seen["over2"] or cores < 2


@needs_v1
def test_no_quota_reads_the_mask(cgroups):
    seen = _probe(cgroups(None))
    assert seen["count"] == len(os.sched_getaffinity(0)), seen
    assert "no CPU quota" in seen["describe"]


WORK = """
    import json, time, helpers, torch

    def work(steps):
        a = torch.randn(192, 192)
        t0 = time.perf_counter()
        for _ in range(steps):
            a = torch.tanh(a @ a)
        return {"s": time.perf_counter() - t0, "over": helpers.world.budget()["oversubscribed"]}

    steps = 8000  # about 0.7 s of one core: several CFS periods of 100 ms
    helpers.launch(work, 40, world_size=2)  # start the pools and warm both sizes up
    helpers.launch(work, 40, world_size=1)
    rows = []
    for _ in range(3):  # interleaved repeats
        for n in (1, 2):
            ranks = helpers.launch(work, steps, world_size=n)
            rows.append({"n": n, "s": max(r["s"] for r in ranks), "over": ranks[0]["over"]})
    print(json.dumps(rows))
"""


@needs_v1
def test_two_ranks_under_a_one_cpu_quota_do_not_scale_and_are_marked(cgroups):
    """Weak scaling: each rank does the same work, so n devices finish n times the work in the
    same time. Under a 1-CPU quota the 2 ranks take turns: the pair's throughput stays that of
    one rank (the quota's theory: at most 1 CPU-second per second), and the run says so."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores in the mask, so only the quota can hold 2 ranks back")
    group = cgroups(1.0)
    before, throttled_before, t0 = group.usage_s(), group.throttled(), time.monotonic()
    done = group.run(WORK)
    wall, used = time.monotonic() - t0, group.usage_s() - before
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    t1 = sorted(r["s"] for r in rows if r["n"] == 1)[1]
    t2 = sorted(r["s"] for r in rows if r["n"] == 2)[1]
    speedup = 2 * t1 / t2  # throughput of 2 ranks over that of 1, medians of 3
    print(
        f"2 ranks under a 1-CPU quota: throughput x{speedup:.2f} of one rank; "
        f"{used:.1f} CPU-s in {wall:.1f} s"
    )
    assert speedup < 1.5, rows  # 2 devices would give about 2
    assert all(r["over"] == (r["n"] == 2) for r in rows), rows  # the mark, from the ranks
    assert "2 ranks × 1 thread on 1 device is OVERSUBSCRIBED" in done.stdout
    assert "CPU quota of 1 CPU" in done.stdout  # the notice says which limit
    # the cgroup's own accounting: never more than the quota, and the kernel did throttle
    assert used <= 1.0 * wall * 1.05 + 0.2, (used, wall)
    assert group.throttled() > throttled_before


def _cell(kernel, code: str) -> tuple[str, str]:
    """Run ``code`` in ``kernel``; its stdout and its shown values (it must not fail)."""
    r = kernel.execute(code, timeout=180)
    assert r["status"] == "ok", (r["error"], r["streams"])
    out = "".join(t for _, n, t in r["streams"] if n == "stdout")
    return out, "\n".join(d.get("text/plain", "") for d in r["data"])


@needs_v1
def test_a_kernel_under_a_one_cpu_quota_marks_its_world_of_two_oversubscribed(cgroups):
    """The hub's case (issue 45): a student's kernel inside a server's 1-CPU quota. Its %%ranks
    world of 2 is marked oversubscribed where it starts and on every rank; a world of 1 is not.
    Without the quota this machine's 2 cores would hold 2 ranks, so the quota makes the mark."""
    from conftest import Kernel
    from jupyter_client.manager import start_new_kernel

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores in the mask, so only the quota can make 2 ranks too many")
    procs = [d / "cgroup.procs" for d in cgroups(1.0).dirs.values()]

    def join() -> None:  # in the kernel's process before it starts, as a hub's spawner does
        for f in procs:
            f.write_text(str(os.getpid()))

    km, kc = start_new_kernel(kernel_name="multigpu-course", cwd=str(REPO), preexec_fn=join)
    kernel = Kernel(km, kc)
    try:
        out, _ = _cell(
            kernel,
            "import helpers\n%load_ext helpers.interactive\nprint(helpers.world.cpu_count())",
        )
        assert out.strip() == "1", out  # the kernel is in the quota
        started, _ = _cell(kernel, "%ranks start 2")
        assert "2 ranks" in started and "on 1 device" in started, started
        assert "OVERSUBSCRIBED" in started, started
        _, marks = _cell(kernel, '%%ranks\nhelpers.world.budget()["oversubscribed"]')
        assert marks.splitlines()[1].split() == ["True", "True"], marks  # the ranks' own mark
        started, _ = _cell(kernel, "%ranks start 1")
        assert "1 rank " in started and "OVERSUBSCRIBED" not in started, started
        _, marks = _cell(kernel, '%%ranks\nhelpers.world.budget()["oversubscribed"]')
        assert marks.splitlines()[1].split() == ["False"], marks
        status, _ = _cell(kernel, "%ranks status\n%ranks stop")
        assert "1 rank " in status and "OVERSUBSCRIBED" not in status, status
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


# A made-up tree: /proc/self/{mountinfo,cgroup} and cgroup folders under tmp_path.


def _tree(tmp_path: Path, mountinfo: list[str], membership: str, files: dict[str, str]) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/mountinfo").write_text("\n".join(mountinfo) + "\n")
    (tmp_path / "proc/self/cgroup").write_text(membership)
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


V2_MOUNT = "30 24 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"


def test_v2_cpu_max_in_an_ancestor(tmp_path):
    root = _tree(
        tmp_path,
        [V2_MOUNT],
        "0::/user.slice/jupyter-alice.service\n",
        {
            "sys/fs/cgroup/cpu.max": "max 100000\n",
            "sys/fs/cgroup/user.slice/cpu.max": "150000 100000\n",
            "sys/fs/cgroup/user.slice/jupyter-alice.service/cpu.max": "max 100000\n",
        },
    )
    q = tightest_quota(root)
    assert q is not None and q.cpus == 1.5 and q.version == 2
    assert q.where.endswith("user.slice/cpu.max")
    limit = CpuLimit(cores=tuple(range(64)), machine=64, quota=q)
    assert limit.count == 1 and limit.source == "quota"
    assert "cgroup v2" in limit.describe() and "64 cores" in limit.describe()


def test_v2_no_quota_is_none(tmp_path):
    root = _tree(tmp_path, [V2_MOUNT], "0::/a\n", {"sys/fs/cgroup/a/cpu.max": "max 100000\n"})
    assert tightest_quota(root) is None


def test_a_containers_mount_root_maps_its_full_path(tmp_path):
    """Docker mounts the container's own cgroup at /sys/fs/cgroup/cpu while /proc/self/cgroup
    names the host's path: the quota is in the mount point's own folder."""
    root = _tree(
        tmp_path,
        ["40 30 0:35 /docker/abc /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct"],
        "4:cpu,cpuacct:/docker/abc\n",
        {
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "200000\n",
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        },
    )
    q = tightest_quota(root)
    assert q is not None and q.cpus == 2.0 and q.version == 1
    assert CpuLimit(cores=tuple(range(64)), machine=64, quota=q).count == 2


def test_unreadable_or_odd_files_are_no_limit(tmp_path):
    root = _tree(
        tmp_path,
        ["garbage", V2_MOUNT, "41 30 0:36 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu"],
        "1:cpu:/x\n0::/y\nnonsense\n",
        {
            "sys/fs/cgroup/cpu/x/cpu.cfs_quota_us": "-1\n",
            "sys/fs/cgroup/cpu/x/cpu.cfs_period_us": "100000\n",
            "sys/fs/cgroup/y/cpu.max": "half 100000\n",
        },
    )
    assert tightest_quota(root) is None
    assert tightest_quota(tmp_path / "nothing-here") is None


def test_this_machines_reading_has_the_mask():
    limit = cpu_limit()
    assert limit.cores is None or limit.count <= len(limit.cores)
    assert limit.count >= 1 and limit.describe().startswith(f"{limit.count} device")


@pytest.mark.skipif(_v2_with_cpu() is None, reason="no cgroup v2 with the cpu controller here")
def test_a_v2_quota_for_real():
    mount = _v2_with_cpu()
    d = mount / f"course-test-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    try:
        (d / "cpu.max").write_text(f"{PERIOD} {PERIOD}")
        code = "import helpers; print(helpers.world.cpu_count())"
        done = subprocess.run(
            ["sh", "-c", f'echo $$ > {d}/cgroup.procs; exec "$0" -c "$1"', sys.executable, code],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=120,
        )
        assert done.stdout.strip() == "1", done.stderr
    finally:
        d.rmdir()


def test_quota_dataclass_rounds_small_quotas_up_to_one_device():
    q = Quota(cpus=0.25, where="x", version=1)
    assert CpuLimit(cores=(0, 1), machine=2, quota=q).count == 1


def test_a_slurm_allocation_caps_the_devices(monkeypatch):
    """A job on a cluster without Slurm's task plugins keeps every core in its mask: the
    allocation, SLURM_CPUS_ON_NODE, is then what the device model reads."""
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "2")
    limit = CpuLimit(cores=tuple(range(64)), machine=64, quota=None, slurm=slurm_cpus())
    assert limit.count == 2 and limit.source == "slurm"
    assert "SLURM_CPUS_ON_NODE=2" in limit.describe() and "64 cores" in limit.describe()
    # the tightest wins: a quota under the allocation, and a mask under both
    q = Quota(cpus=1.0, where="cpu.max", version=2)
    assert CpuLimit(cores=tuple(range(64)), machine=64, quota=q, slurm=2).source == "quota"
    narrow = CpuLimit(cores=(0,), machine=64, quota=None, slurm=2)
    assert narrow.count == 1 and narrow.source == "affinity"
    for odd in ("", "0", "-3", "two", "1.5"):
        monkeypatch.setenv("SLURM_CPUS_ON_NODE", odd)
        assert slurm_cpus() is None, odd


def test_a_process_in_a_slurm_job_of_one_core_calls_two_ranks_oversubscribed():
    """A fresh process with SLURM_CPUS_ON_NODE=1: one device, and the launch notice says why."""
    code = (
        "from helpers.launcher import world, launch\n"
        "print(world.cpu_count(), world.oversubscribed(2), world.oversubscribed(1))\n"
        "print(launch.oversubscribed_notice(2, 1))\n"
    )
    env = {**os.environ, "SLURM_CPUS_ON_NODE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    first, notice = out.stdout.splitlines()[:2]
    assert first == "1 True False"
    assert "SLURM_CPUS_ON_NODE=1" in notice
