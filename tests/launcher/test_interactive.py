"""The interactive world (%ranks, %%ranks, pull, push) in a real kernel of the project.

One kernel and one world serve the whole file, in order (a world starts in seconds on 2 busy
cores): tests that must restart the world come after those that keep it, and the last one
kills the kernel and looks for orphans.
"""

from __future__ import annotations

import time

import psutil
import pytest
from conftest import Kernel, descendants, is_rank, is_rank_server

import helpers

SIZE = 3  # one more rank than this machine's 2 cores: the oversubscribed mark shows


@pytest.fixture(scope="module")
def k():
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="multigpu-course", cwd=str(helpers.__path__[0] + "/.."))
    try:
        yield Kernel(km, kc)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def text(r: dict, name: str = "stdout") -> str:
    return "".join(t for _, n, t in r["streams"] if n == name)


def shown(r: dict) -> str:
    return "\n".join(d.get("text/plain", "") for d in r["data"])


def ok(k: Kernel, code: str, **kw) -> dict:
    r = k.execute(code, **kw)
    assert r["status"] == "ok", r["error"]
    return r


def failed(k: Kernel, code: str, **kw) -> dict:
    """The error a cell ended with; IPython shows a UsageError on stderr, not as an error."""
    r = k.execute(code, **kw)
    assert r["status"] == "error", r
    if r["error"] is None:
        ename, _, evalue = text(r, "stderr").partition(": ")
        return {"ename": ename.strip(), "evalue": evalue}
    return r["error"]


def test_a_cell_before_a_world_says_how_to_start_one(k):
    ok(k, "import helpers\n%load_ext helpers.interactive")
    err = failed(k, "%%ranks\nx = 1")
    assert err["ename"] == "UsageError" and "%ranks start 4" in err["evalue"]
    assert "no world" in failed(k, "helpers.interactive.pull('x')")["evalue"]


def test_cells_keep_each_ranks_variables_and_show_values_side_by_side(k):
    r = ok(k, f"%ranks start {SIZE}")
    over = SIZE > helpers.world.cpu_count()
    assert ("OVERSUBSCRIBED" in text(r)) == over, text(r)
    r = ok(k, "%%ranks\nx = torch.full((2,), float(rank))\nprint('made', x.sum().item())\nx")
    assert sorted(text(r).splitlines()) == [f"[rank {i}] made {2.0 * i}" for i in range(SIZE)]
    table = shown(r).splitlines()
    assert table[0].split() == ["rank", "0", "rank", "1", "rank", "2"]
    assert table[1].split() == ["tensor([0.,", "0.])", "tensor([1.,", "1.])", "tensor([2.,", "2.])"]
    r = ok(k, "%%ranks\ndist.all_reduce(x)\nx")  # the next cell sees x: kept on each rank
    assert shown(r).splitlines()[1].split() == ["tensor([3.,", "3.])"] * SIZE
    r = ok(k, "%%ranks 0,2\nx * 10")
    assert shown(r).splitlines()[0].split() == ["rank", "0", "rank", "2"]
    status = text(ok(k, "%ranks status"))
    assert f"{SIZE} ranks" in status and ("OVERSUBSCRIBED" in status) == over


def test_pull_and_push(k):
    ok(k, "import torch\nhelpers.interactive.push('w', torch.arange(3.0))")
    ok(k, "%%ranks\nw = w * (rank + 1)")
    r = ok(k, "print([t.tolist() for t in helpers.interactive.pull('w')])")
    assert text(r).strip() == str([[0.0, 1.0, 2.0], [0.0, 2.0, 4.0], [0.0, 3.0, 6.0]])
    ok(k, "helpers.interactive.push('w', -1, ranks=[1])")
    r = ok(k, "print(helpers.interactive.pull('w', ranks=[1]))")
    assert text(r).strip() == "[-1]"


def test_bad_input_gets_a_message_that_says_what_to_do(k):
    err = failed(k, "%%ranks 1,5\nx")
    assert err["ename"] == "UsageError"
    assert "rank 5 is not in this world: it has ranks 0-2" in err["evalue"]
    assert "%ranks start 6" in err["evalue"]
    err = failed(k, "%%ranks one\nx")
    assert "%%ranks 0,2" in err["evalue"]
    assert "output is one of live" in failed(k, "%%ranks --output loud\nx")["evalue"]
    ok(k, "%%ranks 0\nonly_here = 1")
    err = failed(k, "helpers.interactive.pull('only_here')")
    assert err["ename"] == "NameError"
    assert "not defined on ranks 1, 2 (it is on rank 0)" in err["evalue"]
    err = failed(k, "helpers.interactive.push('g', (i for i in range(3)))")
    assert err["ename"] == "TypeError" and "generator" in err["evalue"]
    assert "cannot be sent to the ranks" in err["evalue"]
    ok(k, "%%ranks\nimport threading\nlock = threading.Lock()")
    err = failed(k, "helpers.interactive.pull('lock')")
    assert err["ename"] == "TypeError" and "cannot be sent to the notebook" in err["evalue"]
    assert "%ranks start N" in failed(k, "%ranks grow 3")["evalue"]


def test_an_error_shows_rank_and_traceback_and_the_world_keeps_its_variables(k):
    err = failed(k, "%%ranks\nif rank == 1:\n    raise ValueError('bad shard')\ny = rank")
    assert err["ename"] == "ValueError"
    assert err["evalue"].startswith("rank 1 of 3 raised ValueError: bad shard")
    assert "raise ValueError('bad shard')" in err["evalue"]  # the cell's line, under its rank
    assert "interactive.py" not in "".join(err["traceback"])  # no machinery in the way
    r = ok(k, "%%ranks\nx")
    assert shown(r).splitlines()[1].split() == ["tensor([3.,", "3.])"] * SIZE


def test_an_interrupt_stops_every_rank_and_keeps_the_world(k):
    seen = {}

    def interrupt_when_sleeping(kern, streams):
        if text({"streams": streams}).count("sleeping") == SIZE and "at" not in seen:
            seen["at"] = time.monotonic()
            kern.km.interrupt_kernel()

    code = "%%ranks\nprint('sleeping', flush=True)\nimport time\ntime.sleep(600)"
    r = k.execute(code, on_output=interrupt_when_sleeping)
    assert r["status"] == "error" and r["error"]["ename"] == "KeyboardInterrupt"
    assert "kept its variables" in r["error"]["evalue"]
    assert time.monotonic() - seen["at"] < 15  # not the 600 s sleep
    assert shown(ok(k, "%%ranks\nx")).splitlines()[1].split() == ["tensor([3.,", "3.])"] * SIZE


def test_ranks_left_waiting_for_a_failed_rank_get_a_fresh_world(k):
    err = failed(k, "%%ranks\nif rank == 1:\n    1 / 0\ndist.barrier()")
    assert err["ename"] == "ZeroDivisionError" and "rank 1 of 3" in err["evalue"]
    assert "ranks 0; rank 2" not in err["evalue"]
    assert "rank 0 in barrier() #0 on world" in err["evalue"]
    assert "The world was restarted" in err["evalue"]
    err = failed(k, "%%ranks\nx")  # the restarted world is fresh
    assert err["ename"] == "NameError"
    assert ok(k, "%%ranks\nrank")["status"] == "ok"


def test_an_interrupt_that_cannot_reach_a_rank_in_a_collective_restarts_the_world(k):
    seen = {}

    def interrupt_when_blocked(kern, streams):
        if "blocked" in text({"streams": streams}) and "at" not in seen:
            time.sleep(0.5)  # ranks 1 and 2 are now inside gloo's C++ barrier
            seen["at"] = time.monotonic()
            kern.km.interrupt_kernel()

    code = (
        "%%ranks\nz = 1\nimport time\nprint('blocked', flush=True)\n"
        "if rank == 0:\n    time.sleep(600)\ndist.barrier()"
    )
    r = k.execute(code, on_output=interrupt_when_blocked)
    assert r["status"] == "error" and r["error"]["ename"] == "KeyboardInterrupt"
    assert "rank 1 in barrier() #0 on world" in r["error"]["evalue"]
    assert "The world was restarted: 3 fresh ranks" in r["error"]["evalue"]
    assert time.monotonic() - seen["at"] < 20
    assert failed(k, "%%ranks\nz")["ename"] == "NameError"


def test_a_hang_is_diagnosed_and_the_world_restarted(k):
    code = "%%ranks --timeout 3\nt = torch.ones(1)\nif rank == 0:\n    dist.all_reduce(t)"
    err = failed(k, code)
    assert err["ename"] == "LaunchTimeout"
    assert err["evalue"].startswith("the cell did not finish within 3 s")
    assert "ranks 1, 2 returned while rank 0 wait in all_reduce" in err["evalue"]
    assert "The world was restarted: 3 fresh ranks" in err["evalue"]
    assert ok(k, "%%ranks\nrank")["status"] == "ok"


def test_stop_resize_and_a_killed_kernel_leave_no_rank(k):
    ok(k, "%ranks start 2")
    ranks = [p for p in descendants(k.pid) if _is(is_rank, p)]
    assert len(ranks) == 2  # the world of 3 was stopped, not left behind
    servers = [p for p in descendants(k.pid) if _is(is_rank_server, p)]
    psutil.Process(k.pid).kill()  # no atexit, no finaliser: the ranks notice on their own
    gone, alive = psutil.wait_procs(ranks + servers, timeout=10)
    assert not alive, f"orphans: {[p.pid for p in alive]}"


def _is(pred, p) -> bool:
    try:
        return pred(p)
    except psutil.Error:
        return False
