"""The same lab function under torchrun (helpers.run): two agents on 127.0.0.1 make a world of 4."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import rankfns

import helpers
from helpers.tools import multinode

TESTS = Path(__file__).resolve().parents[1]  # tests/: rankfns lives there
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent))


def test_two_torchrun_agents_form_one_world_and_agree_with_launch(tmp_path):
    port = multinode.free_port()  # the launcher itself never picks a port
    agents = []
    for node, host in enumerate(("true", "false")):
        cmd = [
            TORCHRUN,
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "course-test",
            "--rdzv-conf",
            f"is_host={host}",
            "-m",
            "helpers.run",
            "rankfns:ring_sum",
            "2.5",
            "tag='multi node'",
            "--out",
            str(tmp_path / f"node{node}.pkl"),
        ]
        env = dict(os.environ, PYTHONPATH=str(TESTS))
        agents.append(
            subprocess.Popen(
                cmd, cwd=TESTS, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    logs = [a.communicate(timeout=240)[0] for a in agents]
    assert all(a.returncode == 0 for a in agents), "\n".join(logs)[-4000:]
    written = [p for p in tmp_path.glob("node*.pkl")]
    assert len(written) == 1  # only global rank 0 writes
    from_torchrun = pickle.loads(written[0].read_bytes())
    from_launch = helpers.launch(rankfns.ring_sum, 2.5, world_size=4, tag="multi node")
    helpers.shutdown()
    assert from_torchrun == from_launch
    assert [r["sum"] for r in from_launch] == [25.0] * 4 and [r["world"] for r in from_launch] == [
        4
    ] * 4
    assert "[rank 3] -> {'rank': 3, 'world': 4" in "".join(logs)


def test_helpers_run_outside_torchrun_says_how_to_start_it():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    }
    proc = subprocess.run(
        [sys.executable, "-m", "helpers.run", "rankfns:ring_sum"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "start it with torchrun" in proc.stderr


@pytest.mark.parametrize(
    "words, args, kwargs",
    [
        (
            ["3", "'adam'", "[1, 2]", "lr=0.1", "name=plain"],
            [3, "adam", [1, 2]],
            {"lr": 0.1, "name": "plain"},
        ),
        (["a=b=c"], [], {"a": "b=c"}),
    ],
)
def test_command_line_arguments_are_python_literals_or_strings(words, args, kwargs):
    from helpers.launcher.run import parse_call

    assert parse_call(words) == (args, kwargs)


def test_a_crash_in_the_runtimes_teardown_does_not_fail_a_finished_run(tmp_path):
    """Once the results are out, what the interpreter's teardown does cannot fail the job (in CI a
    gloo thread aborted a worker there, and torchrun reported the whole run failed)."""
    out = tmp_path / "results.pkl"
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "helpers.run"]
    proc = subprocess.run(
        [*cmd, "rankfns:aborts_in_teardown", "--out", str(out)],
        cwd=TESTS,
        env=dict(os.environ, PYTHONPATH=str(TESTS)),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert pickle.loads(out.read_bytes()) == [0, 1]
