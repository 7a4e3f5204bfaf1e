"""benchmarks/hub_capacity.py: students side by side in the hub's cgroups, checked by theory.

The benchmark's own run on lab 01 takes minutes (its figure is in docs/hub.md); here it runs
on lecture 00, one and two students at once, so its code path is the one that measured it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import hub_capacity  # noqa: E402


@pytest.mark.skipif(os.geteuid() != 0, reason="the hub's cgroups need root")
def test_two_students_side_by_side_stay_in_their_quota(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/hub_capacity.py",
            "--lab",
            "lectures/00_setup_check.ipynb",
            "--max",
            "2",
            "--cpu",
            "1",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]  # 1: a run past its quota (theory)
    report = (tmp_path / "hub_capacity.md").read_text()
    assert "cgroup of 1 CPUs" in report and "| 1 |" in report and "| 2 |" in report
    assert "Capacity: 2 students at once" in report
    leftover = [p.name for p in Path("/sys/fs/cgroup/cpu").iterdir() if "course-capacity" in p.name]
    assert not leftover  # the students' cgroups are gone


def _row(n, walls, cpus, oks=None):
    oks = oks or [True] * n
    runs = [{"wall": w, "cpu_s": c, "ok": ok} for w, c, ok in zip(walls, cpus, oks, strict=True)]
    return {"n": n, "runs": runs, "span": max(walls)}


def test_theory_catches_a_run_past_its_quota_or_past_the_cores():
    fine = _row(2, [100, 100], [95, 95])
    assert hub_capacity.check_against_theory(fine, cpu_limit=1, devices=2) == []
    over_quota = _row(1, [100], [150])
    assert "past its quota" in hub_capacity.check_against_theory(over_quota, 1, 2)[0]
    over_cores = _row(3, [100, 100, 100], [90, 90, 90])
    assert "on 2 devices" in hub_capacity.check_against_theory(over_cores, 1, 2)[-1]


def test_capacity_counts_from_one_without_gaps():
    budget = 180
    rows = [_row(1, [60], [60]), _row(2, [170, 175], [1, 1]), _row(3, [200, 190, 185], [1] * 3)]
    assert hub_capacity.capacity(rows, budget) == 2
    failed = [_row(1, [60], [60], oks=[False]), _row(2, [100, 100], [1, 1])]
    assert hub_capacity.capacity(failed, budget) == 0  # a failed run is not carried
