"""helpers.launch with real processes: results, output, failures, hangs, leaks, devices, bad input.

Numbers in comments refer to the points of the launcher issue.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, descendants, is_rank, is_rank_server, workers

import helpers
from helpers import LaunchError, LaunchTimeout, RankDied, RankError

pytestmark = pytest.mark.usefixtures("no_leftovers")


def rank_sum():
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return t.item()


# 3. results -------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_in_rank_order_and_match_the_formula(world_size):
    assert (
        helpers.launch(rank_sum, world_size=world_size)
        == [world_size * (world_size + 1) / 2] * world_size
    )
    assert helpers.launch(lambda: helpers.rank(), world_size=world_size) == list(range(world_size))


def test_any_picklable_value_returns_and_args_kwargs_arrive():
    def work(a, b, *, scale):
        r = dist.get_rank()
        return {
            "rank": r,
            "tensor": torch.arange(3) * r * scale,
            "args": (a, b),
            "nested": [{r: "x"}],
        }

    out = helpers.launch(work, [1, 2], "b", world_size=2, scale=10)
    assert [o["rank"] for o in out] == [0, 1]
    torch.testing.assert_close(out[1]["tensor"], torch.tensor([0, 10, 20]))
    assert out[0]["args"] == ([1, 2], "b") and out[1]["nested"] == [{1: "x"}]


def test_the_default_group_is_initialised_and_torchrun_variables_are_set():
    def info():
        return (
            dist.is_initialized(),
            dist.get_backend(),
            os.environ["RANK"],
            os.environ["LOCAL_RANK"],
            os.environ["WORLD_SIZE"],
            helpers.world_size(),
            helpers.is_main(),
            str(helpers.device()),
        )

    out = helpers.launch(info, world_size=2)
    assert out == [(True, "gloo", str(r), str(r), "2", 2, r == 0, "cpu") for r in range(2)]


# 1. functions by value ----------------------------------------------------------------------


def test_ranks_see_the_callers_cwd_argv_and_import_path(tmp_path, monkeypatch):
    (tmp_path / "local_mod.py").write_text("VALUE = 42\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["notebook", "--flag"])

    def where():
        import local_mod

        return os.getcwd(), sys.argv, local_mod.VALUE

    assert helpers.launch(where, world_size=2) == [(str(tmp_path), ["notebook", "--flag"], 42)] * 2


def test_closures_lambdas_and_globals_travel_by_value():
    factor = 7

    def closure():
        return factor * helpers.rank()

    assert helpers.launch(closure, world_size=2) == [0, 7]
    assert helpers.launch(lambda x: x + helpers.rank(), 5, world_size=2) == [5, 6]


# 4. output ----------------------------------------------------------------------------------


def test_live_output_is_prefixed_with_the_rank_and_never_broken_mid_line(capfd):
    def chatty():
        for i in range(200):
            print(f"{helpers.rank()}:{i}:" + "x" * 300)
        print("to stderr", file=sys.stderr)

    helpers.launch(chatty, world_size=4)
    out, err = capfd.readouterr()
    lines = [line for line in out.splitlines() if not line.startswith("helpers.launch:")]
    assert len(lines) == 800
    for line in lines:
        m = re.fullmatch(r"\[rank (\d)\] (\d):(\d+):x{300}", line)
        assert m and m.group(1) == m.group(2), line[:80]
    for r in range(4):  # each rank's own order is kept
        mine = [int(line.split(":")[1]) for line in lines if line.startswith(f"[rank {r}]")]
        assert mine == list(range(200))
    assert sorted(err.splitlines()) == [f"[rank {r}] to stderr" for r in range(4)]


def test_grouped_output_is_deterministic_and_rank0_shows_only_rank_0(capfd):
    def talk():
        time.sleep(0.05 * (3 - helpers.rank()))  # ranks finish in reverse order
        print(f"a{helpers.rank()}")
        print(f"b{helpers.rank()}", end="")  # no final newline: still a whole line

    helpers.launch(talk, world_size=4, output="grouped")
    out, _ = capfd.readouterr()
    out = "".join(line for line in out.splitlines(True) if not line.startswith("helpers.launch:"))
    assert out == "".join(f"[rank {r}] a{r}\n[rank {r}] b{r}\n" for r in range(4))
    helpers.launch(talk, world_size=4, output="rank0")
    out, _ = capfd.readouterr()
    assert out == "[rank 0] a0\n[rank 0] b0\n"
    helpers.launch(talk, world_size=4, output="none")
    assert capfd.readouterr() == ("", "")


def test_output_from_c_code_is_captured_too(capfd):
    def c_print():
        import ctypes

        ctypes.CDLL(None).printf(b"from C on rank %d\n", helpers.rank())

    helpers.launch(c_print, world_size=2, output="grouped")
    assert capfd.readouterr().out == "[rank 0] from C on rank 0\n[rank 1] from C on rank 1\n"


# 5. failures --------------------------------------------------------------------------------


def test_an_exception_names_the_rank_keeps_its_type_and_stops_blocked_ranks_fast():
    def fail_on_1():
        if dist.get_rank() == 1:
            raise ValueError("bad batch size 7")
        dist.all_reduce(torch.ones(1))  # the others wait for rank 1 forever

    helpers.launch(rank_sum, world_size=3)  # warm, so the timing below is the failure path only
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        helpers.launch(fail_on_1, world_size=3)
    assert time.monotonic() - start < 2.0  # blocked ranks were stopped, not waited for
    err = info.value
    assert isinstance(err, RankError) and err.rank == 1 and err.remote_type == "ValueError"
    assert str(err).startswith("rank 1 of 3 raised ValueError: bad batch size 7")
    assert 'raise ValueError("bad batch size 7")' in err.remote_traceback  # the source line
    assert not workers()  # the failed pool is gone ...
    assert helpers.launch(rank_sum, world_size=3) == [6.0] * 3  # ... and the next launch works


def test_the_same_error_on_every_rank_is_reported_once():
    with pytest.raises(NotImplementedError) as info:
        helpers.launch(
            lambda: (_ for _ in ()).throw(NotImplementedError("exercise 2")), world_size=2
        )
    assert "rank 0 of 2 raised NotImplementedError: exercise 2" in str(info.value)
    assert "ranks 1 raised the same error" in str(info.value)


def test_sys_exit_in_a_rank_is_a_failure_not_a_silent_success():
    with pytest.raises(RankError, match=r"sys.exit\(0\) was called"):
        helpers.launch(lambda: sys.exit(0), world_size=2)


@pytest.mark.parametrize(
    "how, expect",
    [
        ("os._exit(3)", "exit code 3"),
        ("os.kill(os.getpid(), signal.SIGKILL)", "signal SIGKILL"),
        ("ctypes.string_at(0)", "signal SIGSEGV"),
    ],
)
def test_a_rank_that_dies_hard_is_reported_by_rank_and_cause(how, expect):
    def die(how):
        import ctypes

        if dist.get_rank() == 1:
            exec(how, {"os": os, "signal": signal, "ctypes": ctypes})
        dist.barrier()

    with pytest.raises(RankDied) as info:
        helpers.launch(die, how, world_size=2)
    assert info.value.rank == 1 and expect in str(info.value)
    assert not workers()


# 6. hangs -----------------------------------------------------------------------------------


def test_a_skipped_collective_times_out_naming_ranks_op_shape_and_line():
    def skip():
        if dist.get_rank() != 0:
            dist.all_reduce(torch.ones(1))  # rank 0 never comes

    helpers.launch(rank_sum, world_size=3)
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        helpers.launch(skip, world_size=3, timeout=2)
    # the hang is reported at the launch's own 2 s timeout, with the diagnosis, not at the 300 s
    # default: 15 s for gathering every rank's state holds at a load of 4 on 2 cores
    assert time.monotonic() - start < 2 + 15
    msg = str(info.value)
    assert "rank 0 returned while ranks 1, 2 wait in all_reduce" in msg
    assert "rank 1: blocked in all_reduce(float32[1]) #0 on world" in msg
    assert "dist.all_reduce(torch.ones(1))  # rank 0 never comes" in msg  # the student's line
    assert not workers()


def test_a_long_silent_wait_says_halfway_that_it_is_still_waiting(monkeypatch, capfd):
    # A student's cell that launches with output="none" is silent; halfway to the timeout the
    # launcher says it is still waiting, and that the diagnosis comes at the deadline.
    from helpers.launcher import pool

    def skip():
        if dist.get_rank() != 0:
            dist.all_reduce(torch.ones(1))  # rank 0 never comes

    monkeypatch.setattr(pool, "WAIT_NOTICE_S", 1)
    with pytest.raises(LaunchTimeout):
        helpers.launch(skip, world_size=2, timeout=3, output="none")
    err = capfd.readouterr().err
    assert (
        len(re.findall(r"\[launch\] still waiting for rank 1 after \d+ s of the 3 s timeout", err))
        == 1
    ), err
    helpers.launch(rank_sum, world_size=2, timeout=3, output="none")  # a quick run: no notice
    assert "still waiting" not in capfd.readouterr().err


def test_different_shapes_on_different_ranks_are_named():
    def shapes():
        dist.all_reduce(torch.ones(2 + dist.get_rank()))

    with pytest.raises(LaunchTimeout) as info:
        helpers.launch(shapes, world_size=3, timeout=2)
    msg = str(info.value)
    assert "with different tensors" in msg and "float32[3]" in msg and "float32[4]" in msg


def test_different_collectives_at_the_same_point_are_named():
    def mixed():
        if dist.get_rank() == 0:
            dist.barrier()
        else:
            dist.all_reduce(torch.ones(1))

    with pytest.raises(LaunchTimeout) as info:
        helpers.launch(mixed, world_size=2, timeout=2)
    assert "disagree on collective #0 on world" in str(info.value)


def test_a_rank_waiting_on_an_asynchronous_collective_is_blocked_in_it():
    """Lab 02's bug: a broadcast inside ``if rank == 0`` while the other rank goes on to an
    async all-reduce. The rank is not running Python: it is blocked in that all-reduce's wait()."""

    def skip_then_async():
        t = torch.ones(2)
        if dist.get_rank() == 0:
            dist.broadcast(t, 0)  # rank 1 skips it
        dist.all_reduce(t, async_op=True).wait()

    with pytest.raises(LaunchTimeout) as info:
        helpers.launch(skip_then_async, world_size=2, timeout=2)
    msg = str(info.value)
    assert (
        "rank 1: blocked in all_reduce(float32[2]) #0 on world (its wait(), issued with "
        "async_op=True)" in msg
    ), msg
    assert "disagree on collective #0 on world" in msg and "rank 0: broadcast" in msg
    assert "in no torch.distributed call" not in msg


def test_an_asynchronous_collective_waited_on_later_still_works_and_is_traced():
    def overlap():
        t = torch.ones(3) * (dist.get_rank() + 1)
        work = dist.all_reduce(t, async_op=True)
        x = torch.ones(2) * 5  # work while the all-reduce runs
        work.wait()
        work.wait()  # a second wait is harmless
        return t.tolist(), x.sum().item()

    assert helpers.launch(overlap, world_size=2) == [([3.0, 3.0, 3.0], 10.0)] * 2


def test_the_graders_cap_bounds_even_an_explicit_timeout():
    """Under `course grade` a launch must end, with its diagnosis, before the cell's time limit
    interrupts it: $HELPERS_LAUNCH_TIMEOUT_CAP bounds every launch, an explicit timeout too."""
    code = (
        "import helpers, time\n"
        "try:\n"
        "    helpers.launch(time.sleep, 60, world_size=1, timeout=600)\n"
        "except helpers.LaunchTimeout as exc:\n"
        "    print('TIMEOUT', str(exc).splitlines()[0])\n"
    )
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "HELPERS_LAUNCH_TIMEOUT_CAP": "2"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "TIMEOUT launch did not finish within 2 s" in out.stdout, out.stdout + out.stderr
    assert time.monotonic() - start < 60


def test_recv_recv_deadlock_is_explained():
    def both_receive():
        dist.recv(torch.zeros(2), src=1 - dist.get_rank())

    with pytest.raises(LaunchTimeout) as info:
        helpers.launch(both_receive, world_size=2, timeout=2)
    assert "Deadlock: every unfinished rank waits to receive (0←1, 1←0)" in str(info.value)


def test_non_blocking_point_to_point_still_works_under_the_watch():
    def ring():
        r, n = dist.get_rank(), dist.get_world_size()
        out = torch.zeros(1)
        ops = [
            dist.P2POp(dist.isend, torch.tensor([float(r)]), (r + 1) % n),
            dist.P2POp(dist.irecv, out, (r - 1) % n),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        req = dist.isend(out * 0 + r, (r + 1) % n)
        got = torch.zeros(1)
        dist.irecv(got, (r - 1) % n).wait()
        req.wait()
        return out.item(), got.item()

    assert helpers.launch(ring, world_size=3) == [(2.0, 2.0), (0.0, 0.0), (1.0, 1.0)]


def test_a_busy_rank_is_shown_in_python_with_its_stack():
    def spin():
        if dist.get_rank() == 1:
            while True:
                pass
        dist.barrier()

    with pytest.raises(LaunchTimeout) as info:
        helpers.launch(spin, world_size=2, timeout=2)
    msg = str(info.value)
    assert "rank 1: running Python code, in no torch.distributed call" in msg
    assert "while True:" in msg or "pass" in msg
    assert "rank 0: blocked in barrier()" in msg


def test_there_is_a_default_timeout_and_it_can_be_set_by_the_environment():
    assert 0 < helpers.launch.__globals__["DEFAULT_TIMEOUT"] < float("inf")
    script = "import helpers, time\nhelpers.launch(lambda: time.sleep(60), world_size=1)"
    env = dict(os.environ, HELPERS_LAUNCH_TIMEOUT="2")
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=90
    )
    assert proc.returncode == 1 and "LaunchTimeout: launch did not finish within 2 s" in proc.stderr


# 8. leaks and clashes -------------------------------------------------------------------------


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_fifty_launches_leak_no_process_fd_or_port():
    helpers.shutdown()
    before = _fds()
    helpers.launch(rank_sum, world_size=2)
    pids = {p.pid for p in workers()}
    after_first = _fds()
    for _ in range(50):
        assert helpers.launch(rank_sum, world_size=2) == [3.0, 3.0]
    assert _fds() == after_first and {p.pid for p in workers()} == pids  # warm pool, nothing grows
    with pytest.raises(RankError):  # a failure replaces the pool; the old one leaves nothing
        helpers.launch(lambda: 1 / 0, world_size=2)
    helpers.launch(rank_sum, world_size=2)
    assert _fds() == after_first
    helpers.shutdown()
    assert _fds() == before and not workers()


def test_concurrent_notebooks_on_one_machine_never_collide(tmp_path):
    script = textwrap.dedent(
        """
        import helpers, torch, torch.distributed as dist
        def work(i):
            t = torch.tensor([float(dist.get_rank() + i)]); dist.all_reduce(t); return t.item()
        for i in range(5):
            assert helpers.launch(work, i, world_size=2) == [2.0 * i + 1] * 2
        print("ok")
        """
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0 and "ok" in out, err[-2000:]


def test_no_fixed_port_anywhere_in_the_launcher():
    source = "".join(f.read_text() for f in sorted((REPO / "helpers" / "launcher").glob("*.py")))
    assert "29500" not in source and "MASTER_PORT" not in source


# 9. warm pools -------------------------------------------------------------------------------


def test_workers_persist_between_launches_and_a_dead_pool_is_replaced():
    first = helpers.launch(os.getpid, world_size=2)
    assert helpers.launch(os.getpid, world_size=2) == first  # the same warm processes
    os.kill(first[1], signal.SIGKILL)
    time.sleep(0.2)
    again = helpers.launch(os.getpid, world_size=2)
    assert again != first and len(set(again)) == 2


def test_each_launch_sees_the_random_state_of_a_fresh_process():
    draw = lambda: (torch.rand(2).tolist(), __import__("random").random())  # noqa: E731
    cold = helpers.launch(draw, world_size=2)
    warm = helpers.launch(draw, world_size=2)
    assert cold == warm


def test_a_function_that_destroys_the_group_retires_its_pool():
    first = helpers.launch(os.getpid, world_size=2)
    helpers.launch(dist.destroy_process_group, world_size=2)
    second = helpers.launch(os.getpid, world_size=2)
    assert set(first).isdisjoint(second)


def test_calling_init_process_group_inside_says_it_is_already_done():
    with pytest.raises(RuntimeError, match="already initialised the default process group"):
        helpers.launch(lambda: dist.init_process_group("gloo"), world_size=2)


# 10. devices and threads ---------------------------------------------------------------------


def test_a_cpu_rank_is_one_device_with_the_same_budget_at_every_world_size():
    # The 1-rank baseline gets what each rank of a larger world gets: one core, by default.
    for n in (1, 2):
        assert helpers.launch(torch.get_num_threads, world_size=n) == [1] * n
    assert helpers.launch(torch.get_num_threads, world_size=2, threads=3) == [3, 3]


def test_ranks_are_pinned_to_distinct_cores_unless_oversubscribed(capfd):
    cores = helpers.world.cpu_count()
    if cores < 2:
        pytest.skip("needs 2 cores")
    budgets = helpers.launch(helpers.world.budget, world_size=2)
    assert [len(b["cores"]) for b in budgets] == [1, 1]
    assert budgets[0]["cores"] != budgets[1]["cores"]
    assert not any(b["oversubscribed"] for b in budgets)
    assert "OVERSUBSCRIBED" not in capfd.readouterr().out

    n = cores + 1  # one rank more than there are cores
    helpers.shutdown()  # the notice comes when a pool starts
    budgets = helpers.launch(helpers.world.budget, world_size=n)
    assert all(b["oversubscribed"] and len(b["cores"]) == cores for b in budgets)
    out, err = capfd.readouterr()
    assert f"{n} ranks × 1 thread on {cores} devices is OVERSUBSCRIBED" in out and not err
    helpers.launch(helpers.world.budget, world_size=n)  # a warm pool says it once, not per launch
    assert "OVERSUBSCRIBED" not in capfd.readouterr().out


def test_timing_records_carry_the_oversubscribed_mark():
    def one_step():
        timer = helpers.StepTimer()
        timer.start()
        timer.mark("forward")
        return timer.stop()["oversubscribed"]

    n = helpers.world.cpu_count() + 1
    assert helpers.launch(one_step, world_size=n, output="none") == [True] * n
    assert helpers.launch(one_step, world_size=1) == [False]


def test_thread_budget_rejects_nonsense(monkeypatch):
    with pytest.raises(ValueError, match="threads must be a whole number of cores per rank"):
        helpers.world.thread_budget(1, 0)
    monkeypatch.setenv("HELPERS_THREADS", "two")
    with pytest.raises(ValueError, match=r"check \$HELPERS_THREADS"):
        helpers.world.thread_budget(1)
    monkeypatch.setenv("HELPERS_THREADS", "2")
    assert helpers.world.thread_budget(4) == 2


@pytest.mark.parametrize(
    "requested, gpus, ranks, chosen",
    [
        ("auto", 0, 2, "gloo"),
        ("auto", 1, 2, "gloo"),  # fewer GPUs than ranks: no NCCL
        ("auto", 2, 2, "cpu:gloo,cuda:nccl"),  # CPU tensors keep working beside NCCL
        ("auto", 8, 4, "cpu:gloo,cuda:nccl"),
        ("nccl", 2, 2, "nccl"),  # asked for explicitly: NCCL alone
        ("gloo", 8, 2, "gloo"),
    ],
)
def test_backend_selection_on_a_simulated_gpu_node(requested, gpus, ranks, chosen):
    if "nccl" in chosen and not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    assert helpers.world.choose_backend(requested, ranks, gpus=gpus) == chosen


@pytest.mark.skipif(
    torch.cuda.device_count() < 1, reason="NCCL needs a GPU (runs on a GPU node, not in CI)"
)
def test_auto_on_a_gpu_node_serves_cpu_and_cuda_tensors():
    # What a GPU node runs under backend="auto": CPU demos and CUDA tensors in one group.
    def both():
        t = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(t)  # gloo
        c = torch.ones(1, device=helpers.device())
        dist.all_reduce(c)  # nccl
        return dist.get_backend(), t.item(), c.item()

    n = torch.cuda.device_count()
    got = helpers.launch(both, world_size=n)
    assert all("nccl" in b and t == n * (n + 1) / 2 and c == n for b, t, c in got), got


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message of a machine without GPUs"
)
def test_nccl_without_gpus_is_a_clear_error():
    with pytest.raises(
        LaunchError,
        match="backend='nccl' needs one CUDA GPU per rank: 2 ranks on this node but 0 GPUs",
    ):
        helpers.launch(rank_sum, world_size=2, backend="nccl")
    assert helpers.launch(rank_sum, world_size=2, backend="auto") == [
        3.0,
        3.0,
    ]  # auto falls back to gloo


def test_mpi_without_an_mpi_build_is_a_clear_error():
    if dist.is_mpi_available():
        pytest.skip("this torch has MPI")
    with pytest.raises(LaunchError, match="backend='mpi' needs a torch built from source"):
        helpers.launch(rank_sum, world_size=1, backend="mpi")


# 12. bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("ws", [0, -1, 2.5, True, "2", None])
def test_a_bad_world_size_is_refused_before_anything_starts(ws):
    with pytest.raises(ValueError, match="world_size must be a whole number >= 1"):
        helpers.launch(rank_sum, world_size=ws)
    assert not workers()


def test_bad_arguments_are_refused_before_anything_starts():
    with pytest.raises(TypeError, match="needs a function to run on every rank, got 5"):
        helpers.launch(5, world_size=2)
    with pytest.raises(TypeError, match=r"argument 'lock' \(lock\) cannot be sent to the ranks"):
        helpers.launch(lambda lock: None, world_size=2, lock=threading.Lock())
    with pytest.raises(TypeError, match=r"positional argument 1 \(generator\) cannot be sent"):
        helpers.launch(lambda a, b: None, 1, (i for i in range(3)), world_size=2)
    with pytest.raises(ValueError, match="backend must be one of"):
        helpers.launch(rank_sum, world_size=2, backend="tcp")
    with pytest.raises(ValueError, match="output must be one of"):
        helpers.launch(rank_sum, world_size=2, output="loud")
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        helpers.launch(rank_sum, world_size=2, timeout=0)
    assert not workers()


def test_an_unpicklable_return_value_is_named():
    with pytest.raises(
        TypeError, match=r"return value \(lock\) cannot be pickled back to the notebook"
    ):
        helpers.launch(threading.Lock, world_size=2)


def test_launch_inside_a_launched_rank_is_refused():
    with pytest.raises(LaunchError, match="called inside a launched rank"):
        helpers.launch(lambda: helpers.launch(rank_sum, world_size=2), world_size=2)


def test_the_launcher_never_forks_this_process():
    helpers.launch(rank_sum, world_size=2)
    (server,) = [p for p in descendants() if p.ppid() == os.getpid()]
    # a fresh interpreter (not a fork of this process: its command line would be pytest's) ...
    assert server.cmdline()[1:2] == ["-c"] and "_rankserver" in server.cmdline()[2]
    assert is_rank_server(server)
    # ... and every rank is a fork of it
    ranks = server.children()
    assert sorted(p.name() for p in ranks) == ["helpers-rank0", "helpers-rank1"]
    assert [p for p in descendants() if p not in [server, *ranks]] == []


def test_a_new_world_starts_without_importing_torch_again():
    """The rank server imported torch once: a new world is forked from it, in well under the
    ~2 s of CPU a fresh interpreter spends on `import torch` (measured: ~0.1 s for 4 ranks)."""
    helpers.launch(rank_sum, world_size=2)  # the server is up
    helpers.shutdown()  # ... and gone: the next launch starts it again
    helpers.launch(rank_sum, world_size=2)
    (server,) = [p for p in descendants() if is_rank_server(p)]
    cpu = server.cpu_times()
    started = time.perf_counter()
    assert helpers.launch(rank_sum, world_size=3) == [6, 6, 6]
    assert helpers.launch(rank_sum, world_size=4) == [10, 10, 10, 10]
    new_worlds = time.perf_counter() - started
    ranks = [p for p in descendants() if is_rank(p)]
    assert all(p.ppid() == server.pid for p in ranks)
    # two new worlds (7 ranks, each importing torch would be ~14 s of CPU) cost the server only
    # forks; generous bound for a loaded machine, still far below one torch import per rank
    assert server.cpu_times().user - cpu.user < 1.0
    assert new_worlds < 7.0, f"two new worlds took {new_worlds:.1f} s"


def _seeds():
    import random

    import numpy

    return torch.initial_seed(), random.random(), float(numpy.random.rand())


def test_forked_ranks_are_seeded_like_fresh_interpreters():
    # each rank of a fresh interpreter draws its own seeds from the OS; a fork of the server
    # must not share the server's (then every rank's "random" init would be the same)
    helpers.shutdown()
    first = helpers.launch(_seeds, world_size=3)
    helpers.shutdown()
    second = helpers.launch(_seeds, world_size=3)
    for i in range(3):
        values = [rank[i] for rank in first + second]
        assert len(set(values)) == 6, values


def test_ranks_see_the_environment_as_it_is_when_they_start(monkeypatch):
    def read():
        return os.environ.get("HELPERS_TEST_SETTING")

    monkeypatch.setenv("HELPERS_TEST_SETTING", "a")
    assert helpers.launch(read, world_size=2) == ["a", "a"]
    (server,) = [p for p in descendants() if is_rank_server(p)]
    monkeypatch.setenv("HELPERS_TEST_SETTING", "b")
    # a new world after a change: a new server (some libraries read the environment on import)
    assert helpers.launch(read, world_size=3) == ["b", "b", "b"]
    assert not server.is_running() or server.status() == "zombie"
    # the warm world of the old environment was retired with its server
    assert helpers.launch(read, world_size=2) == ["b", "b"]
    assert len([p for p in descendants() if is_rank_server(p)]) == 1


@pytest.mark.parametrize(
    "name, value",
    [
        ("PYTEST_CURRENT_TEST", "tests/x.py::another (call)"),
        ("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_someone"),  # torch's default, set late
    ],
)
def test_the_name_of_the_running_test_does_not_restart_the_server(monkeypatch, name, value):
    # pytest changes PYTEST_CURRENT_TEST for every test, and torch sets TORCHINDUCTOR_CACHE_DIR
    # on its first optimizer step: a server restarted for that alone cost each launch after it
    # a fresh import of torch
    assert helpers.launch(os.getpid, world_size=2)
    (server,) = [p for p in descendants() if is_rank_server(p)]
    monkeypatch.setenv(name, value)
    assert helpers.launch(os.getpid, world_size=3)  # a new world: the server is asked again
    assert [p.pid for p in descendants() if is_rank_server(p)] == [server.pid]


def test_without_fork_each_rank_is_a_fresh_interpreter(tmp_path):
    """HELPERS_RANK_START=spawn (the default off Linux, where forking after `import torch` is not
    safe): the same launcher, each rank started as a new interpreter by the server."""
    script = tmp_path / "spawned.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, psutil, torch, torch.distributed as dist
            import helpers
            from helpers import RankDied, RankError

            def info():
                t = torch.ones(1)
                dist.all_reduce(t)
                me = psutil.Process()
                return t.item(), torch.initial_seed(), me.name(), me.cmdline()[2]

            got = helpers.launch(info, world_size=3)
            assert [g[0] for g in got] == [3.0] * 3, got
            assert len({g[1] for g in got}) == 3, got  # seeded from the OS, each its own
            assert [g[2] for g in got] == ["helpers-rank0", "helpers-rank1", "helpers-rank2"]
            # a new interpreter (a fork would show the server's command line: s.serve(...))
            assert all("s.spawned(" in g[3] for g in got), got
            try:
                helpers.launch(lambda: 1 / 0, world_size=2)
            except RankError as exc:
                assert "ZeroDivisionError" in str(exc)
            try:
                helpers.launch(lambda: os._exit(3) if dist.get_rank() else 0, world_size=2)
            except RankDied as exc:
                assert "exit code 3" in str(exc), exc
            helpers.shutdown()
            assert psutil.Process().children(recursive=True) == []
            print("spawned ok")
            """
        )
    )
    env = dict(os.environ, HELPERS_RANK_START="spawn", PYTHONPATH=str(REPO))
    run = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 0 and "spawned ok" in run.stdout, run.stdout + run.stderr
