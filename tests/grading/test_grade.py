"""`course grade` with real kernels and real hostile submissions built here."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from grading_fixtures import EXPECTED, answer, cell_index, plain_submissions, raw, release, write
from nbformat.v4 import new_code_cell

import course.grade as grading
from course.grade import grade
from course.grading import isolation
from course.grading.assemble import assemble
from course.grading.results import Limits
from course.grading.submission import load_submission


@pytest.fixture(scope="module")
def assignment(tmp_path_factory):
    root = tmp_path_factory.mktemp("ps1")
    src, student = release(root)
    return root, src, student


def with_cell(student, code, before="test_square", answered=True):
    """The correct answer (or none) plus an extra cell of the student's, placed before ``before``."""
    nb = answer(student) if answered else nbformat.from_dict(student)
    nb.cells.insert(cell_index(nb, before), new_code_cell(textwrap.dedent(code)))
    return nb


def flood(student, cells: int, each: int):
    """The correct answer, then ``cells`` cells printing ``each`` bytes: each under the
    per-cell cap, all together far over the notebook's."""
    nb = answer(student)
    nb.cells += [new_code_cell(f"print('y' * {each})") for _ in range(cells)]
    return nb


def scores(out):
    rows = list(csv.DictReader((out / "gradebook.csv").open()))
    return {r["student"]: r for r in rows}


def test_plain_submissions_get_their_expected_totals(assignment, tmp_path):
    root, src, student = assignment
    subs = write(tmp_path / "subs", plain_submissions(student))
    results = grade(
        src,
        subs,
        tmp_path / "out",
        jobs=2,
        progress=False,
        limits=Limits(cell_timeout=30, budget=90),
    )
    assert {k: r.total for k, r in results.items()} == EXPECTED
    book = scores(tmp_path / "out")
    assert book["partial_mean"]["test_mean (3)"] == "1.5" and book["correct"]["why (1)"] == "manual"
    assert book["correct"]["total"] == "6.0" and book["correct"]["max"] == "6.0"
    assert all(r["status"] == "graded" for r in book.values())
    feedback = (tmp_path / "out" / "feedback" / "wrong_square.html").read_text()
    assert "AssertionError" in feedback and "3 points" in feedback
    iso = results["correct"].isolation
    assert iso and any("resource limits" in line for line in iso)


def test_cells_are_matched_by_grade_id_not_position(assignment):
    _, src, student = assignment
    nb = answer(student)
    nb.cells.reverse()  # everything moved
    nb.cells.insert(0, new_code_cell("helper = 1"))  # something inserted
    source = nbformat.read(src, as_version=4)
    graded, flags = assemble(source, nb)
    ids = [c.metadata.get("nbgrader", {}).get("grade_id") for c in graded.cells]
    assert ids.count("test_square") == 1 and ids.count("square") == 1 and flags == []
    test = graded.cells[ids.index("test_square")].source
    assert "square(-4)" in test and "square_more == [16, 0.25]" in test  # hidden tests back


def test_hostile_and_broken_submissions(assignment, tmp_path):
    root, src, student = assignment
    solution_path = str(src)
    tampered = answer(student, square="return 0")
    tampered.cells[cell_index(tampered, "test_square")].source = "pass  # tests? what tests"
    deleted = answer(student, square="return 0")
    del deleted.cells[cell_index(deleted, "test_square")]
    duplicated = answer(student)
    duplicated.cells.insert(
        cell_index(duplicated, "square") + 1,
        nbformat.from_dict(duplicated.cells[cell_index(duplicated, "square")]),
    )
    v3 = {"nbformat": 3, "nbformat_minor": 0, "metadata": {}, "worksheets": [{"cells": []}]}
    subs = {
        "fake_success": with_cell(student, "print('All tests passed! 6/6 points')", answered=False),
        "sys_exit": with_cell(student, "import sys; sys.exit(0)"),
        "os_exit": with_cell(student, "import os; os._exit(0)", before="test_mean"),
        "segfault": with_cell(student, "import ctypes; ctypes.string_at(0)", before="test_mean"),
        "tampered": tampered,
        "deleted_test": deleted,
        "duplicated": duplicated,
        "reads_hidden_tests": with_cell(
            student,
            f"""
            try:
                print('READ', len(open({solution_path!r}).read()))
            except Exception as exc:
                print('BLOCKED', type(exc).__name__)
            """,
        ),
        "network": with_cell(
            student,
            """
            import socket
            try:
                socket.create_connection(("1.1.1.1", 53), timeout=2); print("NET OPEN")
            except OSError as exc:
                print("NET CLOSED", exc.errno)
            """,
        ),
        "stray_daemon": with_cell(
            student,
            """
            import subprocess
            subprocess.Popen(["sleep", "4242"], start_new_session=True)
            """,
        ),
        "huge_output": with_cell(student, "print('x' * 10_000_000)"),
        "output_flood": flood(student, cells=200, each=99_000),
        "slow_cell": with_cell(student, "import time; time.sleep(600)", before="test_mean"),
        "fork_storm": with_cell(
            student,
            """
            import os, time
            for _ in range(400):
                try:
                    if os.fork() == 0:
                        time.sleep(60); os._exit(0)
                except OSError:
                    break
            time.sleep(30)
            """,
        ),
        "malformed": b'{"cells": [',
        "empty": b"",
        "not_a_notebook.txt": "hello",
        "json_list": raw([1, 2, 3]),
        "old_format": raw(v3),
        "future_format": raw({"nbformat": 99, "nbformat_minor": 0, "cells": [], "metadata": {}}),
    }
    subs = {
        (k if k.endswith(".txt") or isinstance(v, nbformat.NotebookNode) else f"{k}.ipynb"): v
        for k, v in subs.items()
    }
    folder = write(tmp_path / "subs", subs)
    # Folders that once stopped the whole batch before any grading (issue 30): a 1 TiB sparse
    # file beside the notebook (the resume key read it whole: MemoryError), and a folder nested
    # past the path limit (listing it raised ENAMETOOLONG).
    sparse = folder / "sparse_tib"
    sparse.mkdir()
    nbformat.write(answer(student), sparse / "lab.ipynb")
    with open(sparse / "data.bin", "wb") as f:
        f.truncate(2**40)
    deep = folder / "too_deep"
    deep.mkdir()
    nbformat.write(student, deep / "lab.ipynb")
    fd = os.open(deep, os.O_RDONLY)
    for _ in range(25):  # 25 × 201 characters: past PATH_MAX (4096)
        os.mkdir("d" * 200, dir_fd=fd)
        inner = os.open("d" * 200, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)
    limits = Limits(cell_timeout=8, budget=60, memory=1536 * 2**20, processes=64)
    results = grade(
        src, folder, tmp_path / "out", jobs=2, limits=limits, progress=False, keep_work=True
    )
    r = {k: (v.status, v.total, v.reason, v.flags, v.errors) for k, v in results.items()}
    assert len(results) == len(subs) + 2  # nobody aborted the batch
    assert r["sparse_tib"][:2] == ("graded", 6.0)  # only the notebook is read
    assert r["too_deep"][0] == "invalid" and "File name too long" in r["too_deep"][2]

    assert r["fake_success"][1] == 0.0
    assert r["sys_exit"][1] == 6.0  # SystemExit in a cell is an error of that cell; tests still run
    assert r["os_exit"][1] == 2.0 and "kernel died" in r["os_exit"][2]  # tests after the exit: 0
    assert r["segfault"][1] == 2.0 and "kernel died" in r["segfault"][2]
    assert r["tampered"][1] == 0.0 + 3 + 0 and any(
        "'test_square' was edited" in f for f in r["tampered"][3]
    )
    assert r["deleted_test"][1] == 3.0 and any(
        "'test_square' was deleted" in f for f in r["deleted_test"][3]
    )
    assert r["duplicated"][1] == 6.0 and any(
        "appears more than once" in f for f in r["duplicated"][3]
    )
    assert r["huge_output"][1] == 6.0
    assert r["slow_cell"][1] == 6.0  # the slow cell was interrupted, the rest ran
    # Contained: its forks hit the process limit (later cells may fail to start threads, or the
    # runner cannot start the checker: "error") or it was stopped; either way the batch went on
    # and nothing of it is left (checked below).
    assert r["fork_storm"][0] in ("graded", "processes", "memory", "error")
    assert r["fork_storm"][1] <= 6.0
    for name in ("malformed", "empty", "not_a_notebook", "json_list", "future_format"):
        assert r[name][0] == "invalid" and r[name][1] == 0.0 and r[name][2], name
    assert r["old_format"][0] == "graded" and r["old_format"][1] == 0.0  # converted, but no answers

    executed = {k: v for k, v in results.items() if getattr(v, "executed", None)}

    def printed(name):  # what the submission's cells printed (not their source)
        nb = nbformat.read(executed[name].executed, as_version=4)
        return "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))

    assert "BLOCKED" in printed("reads_hidden_tests") and "READ" not in printed(
        "reads_hidden_tests"
    )
    assert results["reads_hidden_tests"].total == 6.0
    assert "NET CLOSED" in printed("network")
    # Output is capped as it arrives: a cell keeps the start of a 10 MB print, a notebook at
    # most SUBMISSION_OUTPUT_LIMIT however many cells flood, and both still score.
    from course.grading.sandbox import OUTPUT_LIMIT, SUBMISSION_OUTPUT_LIMIT

    huge = printed("huge_output")
    assert huge.startswith("x" * 1000) and len(huge) < OUTPUT_LIMIT
    assert "[grader] output truncated" in huge
    flooded = printed("output_flood")
    assert SUBMISSION_OUTPUT_LIMIT / 2 < len(flooded) < SUBMISSION_OUTPUT_LIMIT
    assert "[grader] output dropped" in flooded and r["output_flood"][1] == 6.0
    assert not [
        p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "4242"]
    ]
    book = scores(tmp_path / "out")
    assert book["empty"]["reason"] == "empty file"


def test_a_kernel_over_its_memory_limit_is_stopped_and_says_so(assignment, tmp_path):
    """1.75 GiB made resident and held, against a 1.5 GiB limit: only the grader's own look
    (every 0.25 s) can end it before its cell limit. Under the cgroup's hard limit (1.25 x), so
    no kernel OOM kill decides it. Its own grading, with a cell limit of 40 s: on a core shared
    with the suite's other worker the kernel took over 8 s just to make the pages resident (the
    hostile batch's 8 s limit cut it first, twice: CI and a local suite)."""
    _, src, student = assignment
    hog = with_cell(
        student,
        """
        import mmap, time
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
        hog = [mmap.mmap(-1, 256 * 2**20, flags=flags) for _ in range(7)]
        time.sleep(120)
        """,
        before="test_mean",
    )
    folder = write(tmp_path / "subs", {"memory_hog": hog})
    limits = Limits(cell_timeout=40, budget=90, memory=1536 * 2**20, processes=64)
    results = grade(src, folder, tmp_path / "out", jobs=1, limits=limits, progress=False)
    r = results["memory_hog"]
    # without the grader's look the cell would run to its 40 s limit and score 6.0, "graded"
    assert (r.status, r.total) == ("memory", 2.0), (r.status, r.total, r.reason)
    assert "over the 1.5 GiB limit" in r.reason
    assert scores(tmp_path / "out")["memory_hog"]["status"] == "memory"


def test_resume_skips_graded_and_unchanged_submissions(assignment, tmp_path):
    _, src, student = assignment
    subs = write(tmp_path / "subs", {"a": answer(student), "b": answer(student, square="return 1")})
    out = tmp_path / "out"
    first = grade(src, subs, out, progress=False)
    fds = len(os.listdir("/proc/self/fd"))
    stamp = (out / "results" / "a.json").stat().st_mtime_ns
    write(subs, {"b": answer(student)})  # b resubmits
    second = grade(src, subs, out, progress=False)
    assert len(os.listdir("/proc/self/fd")) == fds  # grading leaves no file descriptor open
    assert (out / "results" / "a.json").stat().st_mtime_ns == stamp  # a was not graded again
    assert first["b"].total == 3.0 and second["b"].total == 6.0 and second["a"].total == 6.0
    # A result the grader failed on ("error": its sandbox, its bug) is graded again, not kept.
    saved = json.loads((out / "results" / "a.json").read_text())
    saved.update(status="error", reason="grader error: the sandbox did not start", scores={})
    (out / "results" / "a.json").write_text(json.dumps(saved))
    third = grade(src, subs, out, progress=False)
    assert third["a"].status == "graded" and third["a"].total == 6.0


def test_load_submission_reasons(tmp_path):
    (tmp_path / "folder").mkdir()
    assert load_submission(tmp_path / "folder") == (None, "no .ipynb file in the submission folder")


def test_a_notebook_of_too_many_cells_or_too_much_source_is_refused_before_it_is_read(tmp_path):
    # A million empty markdown cells are 57 MiB on disk and took the grader to 7.2 GB; refused
    # from the parsed JSON's count, before nbformat, the assembly or the feedback see it.
    import tracemalloc

    from course.grading import submission

    cell = {"cell_type": "markdown", "metadata": {}, "source": ""}
    many = {"cells": [cell] * 400_000, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (tmp_path / "many.ipynb").write_text(json.dumps(many))
    tracemalloc.start()
    nb, reason = load_submission(tmp_path / "many.ipynb")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert nb is None and reason.startswith("400,000 cells, over the limit of 2,000"), reason
    assert peak < 1.5 * 2**30, peak  # the JSON alone, not nbformat's copies of it
    big = {**many, "cells": [{**cell, "source": "x" * 2**20}] * 5}
    (tmp_path / "big.ipynb").write_text(json.dumps(big))
    assert "characters of source, over the limit" in load_submission(tmp_path / "big.ipynb")[1]
    v3 = {"worksheets": [{"cells": [cell] * 3000}], "metadata": {}, "nbformat": 3}
    (tmp_path / "v3.ipynb").write_text(json.dumps(v3))  # the old format counts too
    assert load_submission(tmp_path / "v3.ipynb")[1].startswith("3,000 cells, over the limit")
    odd = {**many, "cells": [{**cell, "source": [1, 2]}]}  # not text: refused, not a crash
    (tmp_path / "odd.ipynb").write_text(json.dumps(odd))
    assert load_submission(tmp_path / "odd.ipynb")[0] is None
    fine = {**many, "cells": [cell] * submission.MAX_CELLS}  # at the limit: read
    (tmp_path / "fine.ipynb").write_text(json.dumps(fine))
    assert load_submission(tmp_path / "fine.ipynb")[1] is None


def grade_cli(src, subs, out, jobs):
    return [
        sys.executable,
        "-m",
        "course",
        "grade",
        str(src),
        str(subs),
        "--out",
        str(out),
        "-j",
        str(jobs),
    ]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (in its own namespace)")
def test_a_short_disk_costs_what_it_could_not_write_not_the_batch(assignment, tmp_path):
    # The output folder on a tmpfs of 48 KiB, in a mount namespace of this test's own: the
    # first submissions' files fit, then "No space left on device". Every submission is still
    # graded, the gradebook is never left half-written, the command says what to do and exits
    # 1; the same command with space again grades only what was not written.
    import shlex

    _, src, student = assignment
    subs = write(tmp_path / "subs", {f"s{i}": answer(student) for i in range(4)})
    out = tmp_path / "out"
    out.mkdir()
    cli = shlex.join(grade_cli(src, subs, out, 1))
    script = f"""
    mount -t tmpfs -o size=48k course-out {out} || exit 99
    {cli} > {tmp_path}/first.out 2> {tmp_path}/first.err; echo "FIRST $?"
    python3 -c "import csv,sys; rows=list(csv.reader(open(sys.argv[1]))); print('ROWS', len(rows) - 1, len({{len(r) for r in rows}}))" {out}/gradebook.csv
    ls -a {out} {out}/feedback | grep -c '[.]tmp$' | sed 's/^/TMP /'
    mount -o remount,size=10m {out}
    {cli} > {tmp_path}/second.out 2>&1; echo "SECOND $?"
    python3 -c "import csv,sys; rows=list(csv.reader(open(sys.argv[1]))); at=rows[0].index('status'); print('ROWS', len(rows) - 1, sorted(r[at] for r in rows[1:]))" {out}/gradebook.csv
    """
    done = subprocess.run(
        ["unshare", "--mount", "--", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
    )
    printed = done.stdout
    err = (tmp_path / "first.err").read_text()
    assert "FIRST 1" in printed, (printed, done.stderr, err)
    assert "No space left on device" in err and "run the same command again" in err, err
    rows = printed.split("ROWS ")[1].split()  # the gradebook after the first run: whole CSV
    assert 1 <= int(rows[0]) <= 4 and rows[1] == "1", printed
    assert "TMP 0" in printed  # no half-written copy left behind
    assert "SECOND 0" in printed, (printed, (tmp_path / "second.out").read_text())
    assert "ROWS 4 ['graded', 'graded', 'graded', 'graded']" in printed, printed


def test_cli_grades_and_interrupt_keeps_finished_grades(assignment, tmp_path):
    import time

    _, src, student = assignment
    subs = write(tmp_path / "subs", {f"s{i}": answer(student) for i in range(4)})
    out = tmp_path / "out"
    # A shell starts background jobs with SIGINT ignored, and Python keeps an inherited
    # SIG_IGN: restore the default so Ctrl-C reaches the grader however pytest was started.
    proc = subprocess.Popen(
        grade_cli(src, subs, out, 1),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while not any((out / "results").glob("*.json")) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(2)  # Ctrl-C after the first grade
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "finished grades kept" in err
    kept = scores(out)
    assert kept and all(row["total"] == "6.0" for row in kept.values())
    proc = subprocess.run(grade_cli(src, subs, out, 2), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "4 submissions, mean 6.00 points" in proc.stdout


def test_ranks_run_inside_the_sandbox_and_a_stuck_submission_hits_the_budget(
    assignment, tmp_path, monkeypatch
):
    _, src, student = assignment
    launches = with_cell(
        student,
        """
        import helpers, torch, torch.distributed as dist
        def work():
            t = torch.ones(1); dist.all_reduce(t); return t.item()
        print("RANKS", helpers.launch(work, world_size=2))
        """,
    )
    stuck = with_cell(
        student,
        """
        import signal, time
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the cell timeout's interrupt is ignored
        time.sleep(600)
        """,
        before="test_mean",
    )
    folder = write(tmp_path / "subs", {"launches": launches, "stuck": stuck})
    started = time.time()
    taken = []  # the block of uids this grading holds: a grader beside this test has another
    real_block = grading.uid_block

    @contextlib.contextmanager
    def recorded_block(jobs=1):
        with real_block(jobs) as base:
            taken.append(base)
            yield base

    monkeypatch.setattr(grading, "uid_block", recorded_block)
    results = grade(
        src,
        folder,
        tmp_path / "out",
        jobs=2,
        # a cell that imports torch and starts 2 ranks needs its 30 s on a busy 2-core machine;
        # the stuck one ignores the timeout's interrupt and is stopped by the budget
        limits=Limits(cell_timeout=30, budget=60),
        progress=False,
        keep_work=True,  # the executed notebook, read below
    )
    assert results["launches"].status == "graded" and results["launches"].total == 6.0
    nb = nbformat.read(results["launches"].executed, as_version=4)
    assert "RANKS [2.0, 2.0]" in "".join(
        o.get("text", "") for c in nb.cells for o in c.get("outputs", [])
    )
    assert (
        results["stuck"].status == "timeout" and "over the 60 s budget" in results["stuck"].reason
    )
    assert results["stuck"].scores["test_square"] == 2.0  # what finished before the budget counts
    # ranks the grading started, wherever they were reparented to; this test process's own warm
    # pool (an earlier test in this run launched in-process) is not the grader's to kill
    # (as root the submissions run as the uids of this grading's block, and no other's)
    ours = (
        range(taken[0], taken[0] + isolation.UID_BLOCK)
        if os.geteuid() == 0
        else range(os.getuid(), os.getuid() + 1)
    )
    leftovers = [
        p
        for p in psutil.process_iter(["name", "create_time", "ppid", "uids"])
        if (p.info["name"] or "").startswith(("helpers-rank", "helpers-server"))
        and p.info["create_time"] >= started - 1
        and p.info["ppid"] != os.getpid()
        and p.info["uids"].real in ours
    ]
    assert not leftovers


def test_totals_match_nbgrader_autograde_except_its_stderr_penalty(assignment, tmp_path):
    from grading_fixtures import ANSWERS, nbgrader_grade

    _, src, student = assignment
    subs = write(tmp_path / "subs", {name: make(student) for name, make in ANSWERS.items()})
    ours = grade(src, subs, tmp_path / "out", jobs=2, progress=False)
    theirs = nbgrader_grade(tmp_path, ANSWERS)
    for name in ANSWERS:
        for gid, points in theirs[name].items():
            if gid == "why":  # manual in both; nbgrader stores 0 until a person grades it
                assert ours[name].scores[gid] is None and points == 0
            elif gid == "test_noisy":
                # nbgrader gives 0 to a passing test that wrote to stderr (nbgrader#1904); we do not.
                assert points == 0 and ours[name].scores[gid] == (
                    1.0 if name in ("correct", "partial_mean") else 0.0
                )
            else:
                assert ours[name].scores[gid] == points, (name, gid)
    quiet = {n: sum(v for g, v in theirs[n].items() if g != "test_noisy") for n in ANSWERS}
    assert quiet == {n: ours[n].total - (ours[n].scores["test_noisy"] or 0) for n in ANSWERS}


def test_graders_side_by_side_take_different_blocks_of_uids(monkeypatch, tmp_path):
    from course.grading import isolation as g

    monkeypatch.setattr(g, "LOCK_DIR", tmp_path)
    monkeypatch.delenv("COURSE_GRADE_UID_BASE", raising=False)
    with g.uid_block(2) as first, g.uid_block(2) as second:
        assert first == g.UID_BASE and second == g.UID_BASE + g.UID_BLOCK
    with g.uid_block(2) as again:  # released when a grader is done
        assert again == g.UID_BASE
    monkeypatch.setenv("COURSE_GRADE_UID_BASE", str(g.UID_BASE))
    with g.uid_block(1), pytest.raises(g.UidsBusy, match="unset COURSE_GRADE_UID_BASE"):
        with g.uid_block(1):
            pass
    with pytest.raises(ValueError, match="at most 64 jobs"):
        with g.uid_block(65):
            pass
    assert (
        oct((tmp_path / f"course-grade-uids-{g.UID_BASE}.lock").stat().st_mode & 0o777) == "0o600"
    )


def test_a_blocks_lock_is_released_when_its_grader_dies(monkeypatch, tmp_path):
    from course.grading import isolation as g

    monkeypatch.setattr(g, "LOCK_DIR", tmp_path)
    monkeypatch.delenv("COURSE_GRADE_UID_BASE", raising=False)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; import course.grading.isolation as g; "
            f"g.LOCK_DIR = Path({str(tmp_path)!r}); b = g.uid_block(1); print(b.__enter__(), flush=True); "
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(g.__file__).parents[2],
    )
    try:
        assert int(holder.stdout.readline()) == g.UID_BASE
        with g.uid_block(1) as base:
            assert base == g.UID_BASE + g.UID_BLOCK  # the first block is another grader's
    finally:
        holder.kill()
        holder.wait()
    with g.uid_block(1) as base:  # killed, not closed: the kernel let go of its lock
        assert base == g.UID_BASE


def test_three_slices_graded_side_by_side_merge_into_the_gradebook_of_one_run(assignment, tmp_path):
    import json

    _, src, student = assignment
    subs = write(
        tmp_path / "subs",
        {
            "a": answer(student),
            "b": answer(student, square="return 0"),
            "d": nbformat.from_dict(student),
            "e": answer(student, mean="return 0"),
        },
    )
    whole = tmp_path / "whole"
    run = subprocess.run(
        grade_cli(src, subs, whole, 2), capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr
    # three graders at once on one machine (a Slurm array would put them on three): each takes
    # its own block of uids, so none kills another's kernels
    slices = [tmp_path / f"slice{k}" for k in (1, 2, 3)]
    procs = [
        subprocess.Popen(
            [*grade_cli(src, subs, out, 1), "--shard", f"{k}/3"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k, out in zip((1, 2, 3), slices, strict=True)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
    students = [json.loads((out / "shard.json").read_text())["students"] for out in slices]
    assert students == [["a", "e"], ["b"], ["d"]]  # entry i in name order to slice i mod 3

    def merge(out, *folders):
        command = [
            sys.executable,
            "-m",
            "course",
            "grade-merge",
            str(src),
            str(out),
            *map(str, folders),
        ]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    merged = tmp_path / "merged"
    done = merge(merged, slices[2], slices[0], slices[1])
    assert done.returncode == 0, done.stderr
    assert scores(merged) == scores(whole)
    assert scores(whole)["a"]["total"] == "6.0" and scores(whole)["d"]["total"] == "0.0"
    assert sorted(os.listdir(merged / "feedback")) == sorted(os.listdir(whole / "feedback"))
    # a gradebook with a slice missing, or one slice twice, is refused
    missing = merge(tmp_path / "m2", slices[0], slices[1])
    assert missing.returncode == 2 and "slices 3/3 are missing" in missing.stderr
    twice = merge(tmp_path / "m3", slices[0], slices[0], slices[1], slices[2])
    assert twice.returncode == 2 and "given twice" in twice.stderr
    bad = subprocess.run(
        [*grade_cli(src, subs, tmp_path / "x", 1), "--shard", "4/3"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "K must be between 1 and N" in bad.stderr


def test_the_result_reader_drops_an_over_long_line_and_keeps_the_rest(monkeypatch):
    """The grader's memory stays bounded: a line over MAX_LINE is skipped as it streams, and
    also when one read brings the whole of it (this once returned the line: CI saw it)."""
    import threading

    from course.grading.runner import _Reader

    monkeypatch.setattr(_Reader, "MAX_LINE", 10_000)
    lines = [b'{"a": 1}\n', b'{"flood": "' + b"x" * 100_000 + b'"}\n', b'{"b": 2}\n']

    def read_all(read_fd):
        reader, got = _Reader(read_fd), []
        while not (reader.eof and b"\n" not in reader.buf):
            msg = reader.next(timeout=2)
            if msg is not None:
                got.append(msg)
            assert len(reader.buf) <= _Reader.MAX_LINE + 2**20  # never more than a read past it
        reader.close()
        return got, reader.dropped

    read_fd, write_fd = os.pipe()  # streamed: the flood crosses several reads

    def feed():
        with os.fdopen(write_fd, "wb") as w:
            w.writelines(lines)

    threading.Thread(target=feed).start()
    assert read_all(read_fd) == ([{"a": 1}, {"b": 2}], 1)

    monkeypatch.setattr(_Reader, "MAX_LINE", 1_000)  # whole: all of it waits in the pipe
    read_fd, write_fd = os.pipe()
    os.write(write_fd, lines[0] + lines[1][:5_000] + b'"}\n' + lines[2])
    os.close(write_fd)
    assert read_all(read_fd) == ([{"a": 1}, {"b": 2}], 1)


def test_a_process_that_ends_while_the_grader_lists_the_group_is_skipped(tmp_path, monkeypatch):
    """A submission's process may exit between the grader's pid listing and its psutil lookup;
    grading goes on (CI once lost a perfect submission to "grader error: NoSuchProcess")."""
    import subprocess
    import sys

    import psutil

    from course.grading.isolation import Group

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "cgroup.procs").write_text(f"{gone.pid}\n{os.getpid()}\n")
    group = Group.__new__(Group)
    group.dirs, group.uid, group.marker = [tmp_path], None, "no-such-marker"
    monkeypatch.setattr(psutil, "pid_exists", lambda pid: True)  # the race: it existed a moment ago
    assert [p.pid for p in group.members()] == [os.getpid()]
    assert os.getpid() not in [p.pid for p in group.processes()]  # never the grader itself


@pytest.mark.parametrize("tag", [True, False], ids=["tagged", "tag-removed"])
def test_the_grading_profile_overrides_the_notebooks_own_parameters(tag):
    """The profile goes after the lab's parameters cell, whether the student's copy kept its tag
    or not: before, the tag was dropped with the rest of the student's metadata, the profile went
    first, and the notebook's defaults overrode it."""
    from grading_fixtures import source

    from course.release import student_version

    src = source()
    defaults = new_code_cell("n = 1\nsize = 'big'", metadata={"tags": ["parameters"]})
    src.cells.insert(1, defaults)
    submission = student_version(src)
    params = next(c for c in submission.cells if c.source.startswith("n = 1"))
    params.source = "n = 2\nsize = 'huge'"  # the student's edit of the defaults
    if not tag:
        params.metadata["tags"] = []
    graded, _ = assemble(src, submission, parameters={"n": 5, "size": "small"})
    namespace = {}
    for cell in graded.cells:  # the cells that set parameters, in the order the kernel runs them
        if cell.cell_type == "code" and ("n = " in cell.source or "size = " in cell.source):
            exec(cell.source, namespace)
    assert (namespace["n"], namespace["size"]) == (5, "small")
