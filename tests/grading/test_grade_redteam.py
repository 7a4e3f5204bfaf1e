"""Attacks on `course grade` through the notebook's structure, the feedback and the files.

Each submission is built from the fixture assignment (tests/grading_fixtures.py) the way a
student who wants points without the work would build it, and graded for real. What is
asserted: the points it really earned, nothing more, and nothing hidden shown back to it.
Attacks that forge a test's verdict from inside the kernel (hooks, transformers, liars,
shadowed builtins, patched libraries) are at the end, on this assignment and on a small one
whose checks use torch, numpy and helpers.launch.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import textwrap
from pathlib import Path

import nbformat
import pytest
from grading_fixtures import answer, cell_index, release, write
from nbformat.v4 import new_code_cell, new_markdown_cell

from course.grade import grade
from course.grading import sandbox
from course.grading.results import Limits
from course.grading.submission import load_submission
from course.release import student_version

LIMITS = Limits(cell_timeout=30, budget=90)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the course


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("redteam")
    src, student = release(root)
    subs = {}

    # A "bonus" cell of the student's own, carrying grader metadata that claims points.
    bonus = answer(student)
    fake = new_code_cell("print('bonus')")
    fake.metadata = {
        "nbgrader": {"grade": True, "points": 50, "grade_id": "bonus", "solution": False},
        "grader_test": True,
    }
    bonus.cells.append(fake)
    subs["bonus_cell"] = bonus

    # The same, but claiming an existing test's grade_id and type: it must not replace the test.
    stolen = answer(student, square="return 0")
    steal = new_code_cell("pass")
    steal.metadata = {"nbgrader": {"grade": True, "points": 2, "grade_id": "test_square"}}
    stolen.cells.insert(0, steal)
    subs["stolen_grade_id"] = stolen

    # Metadata that would replace the source the feedback shows.
    disguised = answer(student, square="return 0")
    i = cell_index(disguised, "square")
    disguised.cells[i].metadata["grader_source"] = "def square(x):\n    return x * x"
    subs["disguised_source"] = disguised

    # The written answer turned into a code cell that runs cleanly.
    coded = nbformat.from_dict(student)
    j = cell_index(coded, "why")
    md = coded.cells[j]
    coded.cells[j] = new_code_cell("1 + 1", metadata=md.metadata)
    subs["markdown_to_code"] = coded

    # Script in an output and in markdown, aimed at the feedback page.
    script = answer(student)
    script.cells.append(
        new_code_cell(
            "from IPython.display import HTML, display\n"
            "display(HTML('<script>document.body.innerHTML=\"100 points\"</script><b id=x>hi</b>'))"
        )
    )
    script.cells.append(new_markdown_cell("<img src=x onerror=alert(1)><script>alert(2)</script>"))
    subs["script_in_feedback"] = script

    # Answers looked up in the course itself (its git history, tests, solutions, built notebooks),
    # in the instructor's folders, the grader's environment and processes; files planted in
    # /tmp, /var/tmp and /dev/shm for the next job, and the other job's plants looked for.
    looked_for = dict(
        course=ROOT, lab=str(src.parent), subs=str(root / "subs"), out=str(root / "out")
    )
    for who in ("a", "b"):
        look = answer(student)
        look.cells.append(
            new_code_cell(LOOK_AROUND.replace("WHO", who).replace("LOOKED_FOR", repr(looked_for)))
        )
        subs[f"looks_around_{who}"] = look

    # A wrong answer that fails only the hidden tests (square(-4) must be 16).
    subs["fails_hidden"] = answer(student, square="return abs(x) * x")

    out = root / "out"
    # The grader's temporary folders go where TMPDIR says: here a folder of this run's own, so
    # that what a grader or a suite beside this one leaves in /tmp is not counted against it.
    own = Path(tempfile.mkdtemp(prefix="redteam-tmp-"))
    own.chmod(0o755)  # as /tmp: the sandbox uids pass through it to their work folders
    saved = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir, os.environ["TMPDIR"] = str(own), str(own)
    try:
        results = grade(
            src,
            write(root / "subs", subs),
            out,
            jobs=2,
            progress=False,
            limits=LIMITS,
            keep_work=True,
        )
    finally:
        tempfile.tempdir = saved[0]
        os.environ.pop("TMPDIR") if saved[1] is None else os.environ.update(TMPDIR=saved[1])
    left_behind = set(os.listdir(own))
    # and nothing of this run's went to /tmp regardless of TMPDIR: a work folder is named after
    # its student, and these students' names are this test's own
    left_behind |= {
        n for n in os.listdir("/tmp") for who in subs if n.startswith(f"grade-{who[:20]}-")
    }
    shutil.rmtree(own)
    return results, out, left_behind


def test_nothing_is_left_behind_in_tmp(graded):
    leftovers = {
        name
        for name in graded[2]
        if name.startswith(("expose-", "graded-kernels-", "grade-", "torchinductor_"))
    }
    assert not leftovers


LOOK_AROUND = """
import json, os, subprocess
looked = LOOKED_FOR
seen = {"root": sorted(os.listdir("/")), "etc": sorted(os.listdir("/etc"))}
seen["course"] = sorted(os.listdir(looked["course"]))
for name in (".git", "tests", "solutions", "build", "labs", "lectures"):
    seen["course/" + name] = os.path.exists(os.path.join(looked["course"], name))
for name in ("lab", "subs", "out"):
    seen[name] = os.path.exists(looked[name])
seen["home"] = os.path.exists("/home") and sorted(os.listdir("/home"))
seen["git"] = subprocess.run(["git", "-C", looked["course"], "log", "-1"], capture_output=True,
                             text=True).returncode if os.path.exists("/usr/bin/git") else "no git"
seen["env"] = sorted(os.environ)
pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
seen["pids"] = len(pids)
seen["cmdlines"] = [open(f"/proc/{p}/cmdline", "rb").read().decode(errors="replace")
                    for p in pids if os.path.exists(f"/proc/{p}/cmdline")]
seen["cores"] = sorted(os.sched_getaffinity(0))
try:
    os.sched_setaffinity(0, range(os.cpu_count()))  # widen it to every core, if allowed
except OSError:
    pass
seen["widened"] = sorted(os.sched_getaffinity(0))
seen["uid"] = os.getuid()
seen["fds"] = []
for fd in os.listdir("/proc/self/fd"):
    try:
        seen["fds"].append(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        pass
seen["no_new_privs"] = [l.split()[1] for l in open("/proc/self/status") if l.startswith("NoNewPrivs")]
plants = {}
for folder in ("/tmp", "/var/tmp", "/dev/shm"):
    plants[folder] = sorted(n for n in os.listdir(folder) if n.startswith("planted-"))
    with open(os.path.join(folder, "planted-WHO"), "w") as f:
        f.write("for the next job")
seen["plants"] = plants
# matplotlib builds its font cache with fc-list: fontconfig must find its configuration and a
# writable cache, or it prints an error into every first plot's output
seen["fc_list"] = subprocess.run(["fc-list"], capture_output=True, text=True).stderr \
    if os.path.exists("/usr/bin/fc-list") else "no fc-list"
print("SEEN " + json.dumps(seen))
"""


def seen(results, name) -> dict:
    """What the looking-around cell printed, read from the executed notebook."""
    nb = nbformat.read(results[name].executed, as_version=4)
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            for line in out.get("text", "").splitlines():
                if line.startswith("SEEN "):
                    return json.loads(line[5:])
    raise AssertionError(f"{name}: the looking-around cell printed nothing")


ENV_ALLOWED = {"PATH", "LANG", "HOME", "TMPDIR", "USER", "LOGNAME", "MPLBACKEND", "PWD"}
ENV_ALLOWED |= {
    "HELPERS_LAUNCH_TIMEOUT",
    "HELPERS_LAUNCH_TIMEOUT_CAP",
    "COURSE_GRADE_JOB",
    "XDG_CACHE_HOME",
    "COURSE_HIDDEN_SEED",  # the submission's own, new each run: hidden cases, not a secret
}
# set by the kernel itself (ipykernel's shell, Python's locale coercion), not inherited
ENV_ALLOWED |= {
    "TERM",
    "CLICOLOR",
    "CLICOLOR_FORCE",
    "FORCE_COLOR",
    "PAGER",
    "GIT_PAGER",
    "LC_CTYPE",
}
ENV_ALLOWED |= {"PYDEVD_USE_FRAME_EVAL"}  # ipykernel's debugger


@pytest.mark.parametrize("who", ["a", "b"])
def test_a_submission_sees_only_its_file_view_environment_and_processes(graded, who):
    results, out, _ = graded
    name = f"looks_around_{who}"
    assert results[name].status == "graded" and results[name].total == 6.0
    s = seen(results, name)
    # Files: of the course only its code; nothing of the instructor's or the grader's folders.
    assert set(s["course"]) <= {"helpers", "course", ".venv"}, s["course"]
    for name_ in (".git", "tests", "solutions", "build", "labs", "lectures"):
        assert s["course/" + name_] is False, name_
    assert s["lab"] is s["subs"] is s["out"] is False
    assert not s["home"] and s["git"] != 0
    assert set(s["etc"]) <= set(sandbox.ETC), s["etc"]
    assert "shadow" not in s["etc"] and "ssh" not in s["etc"]
    # Environment: the allowlist, nothing of the grader's (pytest's, the runner's).
    assert set(s["env"]) <= ENV_ALLOWED, set(s["env"]) - ENV_ALLOWED
    # Processes: its own PID namespace; no grader, pytest or other job in sight.
    assert s["pids"] < 20, s["pids"]
    assert not any("pytest" in c or "course.grading.sandbox" in c for c in s["cmdlines"]), s[
        "cmdlines"
    ]
    assert s["uid"] >= 40000 and s["no_new_privs"] == ["1"]
    # No descriptor into the grader's folders (the runner's log was one, inherited).
    assert not [f for f in s["fds"] if "/out/" in f or f.endswith(".log")], s["fds"]
    # Its slot's share of the cores (two slots: one core each on two cores).
    assert s["cores"] == sandbox_cores(s["cores"]), s["cores"]
    assert s["widened"] == s["cores"], s  # a cpuset, not an affinity the kernel can undo
    # Private /tmp, /var/tmp, /dev/shm: no job sees what another planted.
    assert s["plants"] == {"/tmp": [], "/var/tmp": [], "/dev/shm": []}, s["plants"]
    assert "Fontconfig error" not in s["fc_list"], s["fc_list"]


def sandbox_cores(cores):
    from course.grading.isolation import slot_cores

    shares = [slot_cores(k, 2) for k in range(2)]
    assert cores in shares, (cores, shares)
    return cores


def test_the_plants_of_a_job_are_nowhere_on_the_host_after_it(graded):
    for folder in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not [n for n in os.listdir(folder) if n.startswith("planted-")], folder


def feedback(out, name):
    return (out / "feedback" / f"{name}.html").read_text()


def test_a_cell_claiming_grader_metadata_earns_nothing_and_breaks_nothing(graded):
    results, _, _ = graded
    r = results["bonus_cell"]
    assert r.status == "graded" and r.total == 6.0  # the genuine answers, no bonus
    assert "bonus" not in r.scores
    stolen = results["stolen_grade_id"]
    assert stolen.status == "graded" and stolen.scores["test_square"] == 0.0


def test_the_feedback_shows_what_ran_not_what_the_metadata_says(graded):
    results, out, _ = graded
    assert results["disguised_source"].scores["test_square"] == 0.0
    page = feedback(out, "disguised_source")
    assert "return 0" in page and "return x * x" not in page


def test_a_written_answer_turned_into_code_stays_a_written_answer(graded):
    results, out, _ = graded
    r = results["markdown_to_code"]
    assert r.scores["why"] is None and r.total == 0.0  # waits for a person, scores nothing
    assert any("'why' was changed to a code cell" in f for f in r.flags)


def test_feedback_pages_run_nothing_from_the_submission(graded):
    _, out, _ = graded
    page = feedback(out, "script_in_feedback")
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    assert "<script" not in page and "onerror=" not in page.replace("onerror=alert", "")
    assert "&lt;script&gt;" in page  # shown as text


def test_hidden_tests_never_reach_the_feedback_or_the_gradebook(graded):
    results, out, _ = graded
    r = results["fails_hidden"]
    assert r.scores["test_square"] == 0.0 and r.scores["test_mean"] == 3.0
    assert r.errors["test_square"] == "AssertionError: a hidden test failed"
    for name in ("fails_hidden", "bonus_cell"):
        page = feedback(out, name)
        assert "square(-4)" not in page and "square(0.5)" not in page and "HIDDEN" not in page
        assert "assert square_3 == 9" in page  # the visible test is shown
    assert "square(-4)" not in (out / "gradebook.csv").read_text()


def test_links_and_special_files_in_a_submission_are_refused(tmp_path):
    secret = tmp_path / "solution.ipynb"
    secret.write_text('{"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}')
    folder = tmp_path / "alice"
    folder.mkdir()
    (folder / "lab.ipynb").symlink_to(secret)
    assert load_submission(folder) == (
        None,
        "lab.ipynb is a symbolic link: links are not accepted in a submission",
    )
    (tmp_path / "bob.ipynb").symlink_to(secret)
    assert "symbolic link" in load_submission(tmp_path / "bob.ipynb")[1]
    carol = tmp_path / "carol"
    carol.mkdir()
    os.link(secret, carol / "lab.ipynb")
    assert "hard link" in load_submission(carol)[1]
    dave = tmp_path / "dave"
    (dave / "sub").mkdir(parents=True)
    os.symlink(tmp_path, dave / "sub" / "up")
    (dave / "lab.ipynb").write_text(secret.read_text())
    assert "sub/up is a symbolic link" in load_submission(dave)[1]
    erin = tmp_path / "erin"
    erin.mkdir()
    os.mkfifo(erin / "pipe.ipynb")
    assert "not a regular file" in load_submission(erin)[1]  # and no hang reading a FIFO


def test_grading_refuses_to_run_without_isolation(tmp_path, monkeypatch, capsys):
    from course import cli
    from course.grading import isolation as grading

    src, student = release(tmp_path)
    subs = write(tmp_path / "subs", {"alice": answer(student)})
    monkeypatch.setattr(grading.os, "geteuid", lambda: 1000)  # as an instructor without root
    with pytest.raises(grading.IsolationUnavailable, match="not running as root"):
        grade(src, subs, tmp_path / "out", progress=False, limits=LIMITS)
    assert not (tmp_path / "out" / "results" / "alice.json").exists()  # nothing ran
    code = cli.main(["grade", str(src), str(subs), "--out", str(tmp_path / "out")])
    assert code == 2 and "--unsafe-no-isolation" in capsys.readouterr().err


def test_unsafe_grading_is_said_on_every_page_and_in_the_gradebook(tmp_path):
    from course.grading.isolation import UNSAFE

    src, student = release(tmp_path)
    subs = write(tmp_path / "subs", {"alice": answer(student)})
    out = tmp_path / "out"
    results = grade(src, subs, out, progress=False, limits=LIMITS, isolation=UNSAFE)
    assert results["alice"].status == "graded" and results["alice"].total == 6.0
    assert "UNSAFE" in feedback(out, "alice") and "UNSAFE" in (out / "gradebook.csv").read_text()


# -- forging the verdict from inside the kernel (issue 11, item 1) -----------------------------
#
# Each submission leaves the exercises undone (or answers without doing the work) and tampers
# with its own kernel before the tests run. The checks run in the grader's own interpreter on
# plain data, so none of it may earn a point.


def code(*parts: str) -> str:
    """Snippets written indented or not, as one cell."""
    return "\n".join(textwrap.dedent(part).strip("\n") for part in parts) + "\n"


LIARS = """
class AlwaysEqual:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __sub__(self, other): return 0
    __rsub__ = __sub__
    def __abs__(self): return 0
    def __lt__(self, other): return True
    def __len__(self): return 4
class LyingFloat(float):
    __eq__ = lambda self, other: True
    __ne__ = lambda self, other: False
    __hash__ = float.__hash__
class LyingList(list):
    __eq__ = lambda self, other: True
    __ne__ = lambda self, other: False
    __len__ = lambda self: 4
"""

SWALLOW = """
import ast
class Swallow(ast.NodeTransformer):
    def visit_Module(self, node):
        node.body = [ast.Try(body=[s], handlers=[ast.ExceptHandler(body=[ast.Pass()])],
                             orelse=[], finalbody=[]) for s in node.body]
        return ast.fix_missing_locations(node)
get_ipython().ast_transformers.append(Swallow())
"""

FORGERIES = {
    # An AST transformer: every statement of every later cell wrapped in try/except: pass.
    "ast_swallows_errors": SWALLOW,
    # The same, but first the visible tests' answers are left lying in the namespace.
    "swallow_with_answers_preset": """
        import ast
        square_3, square_2, means = 9, 4, [2.0, 5.0, 0.0]
        class Swallow(ast.NodeTransformer):
            def visit_Module(self, node):
                node.body = [ast.Try(body=[s], handlers=[ast.ExceptHandler(body=[ast.Pass()])],
                                     orelse=[], finalbody=[]) for s in node.body]
                return ast.fix_missing_locations(node)
        get_ipython().ast_transformers.append(Swallow())
        """,
    # IPython's custom exception handler: errors print a success line instead of a traceback.
    "custom_exc": """
        def quiet(shell, etype, value, tb, tb_offset=None):
            print("All tests passed")
        get_ipython().set_custom_exc((BaseException,), quiet)
        """,
    # post_run_cell hooks: after every cell, put objects that agree with anything in the
    # probe's names, clear the output and announce success; errors swallowed as above.
    "post_run_hook_plants_liars": code(
        LIARS,
        SWALLOW,
        """
        from IPython.display import clear_output
        def plant(result):
            get_ipython().user_ns.update(square_3=AlwaysEqual(), square_more=LyingList(),
                                         means=LyingList([2.0, 5.0, 0.0, 5.0]), square_2=LyingFloat(4))
            clear_output()
            print("[hidden tests passed]")
        get_ipython().events.register("post_run_cell", plant)
        """,
    ),
    # The answers themselves return liars (see ANSWERS).
    "answers_always_equal": LIARS,
    "answers_lying_float_subclass": LIARS,
    # Builtins the checks use, shadowed in the kernel's namespace, and a library function
    # replaced; lazy answers (see ANSWERS).
    "shadowed_builtins_and_math": """
        import math
        isinstance = lambda *a: True
        abs = lambda x: 0
        len = lambda x: 4
        math.isclose = lambda *a, **k: True
        """,
    # The grader's own read-back of the probe's values, rewritten to send forged data:
    # objects by pickle, unknown tags, a bogus tensor; errors swallowed so the probe "passes".
    "forged_export": code(
        SWALLOW,
        """
        import base64, json, pickle
        forged = {"values": {
            "square_3": {"$": "pickle", "v": base64.b64encode(pickle.dumps(9)).decode()},
            "square_more": {"$": "object", "eq": "always"},
            "means": {"$": "tensor", "dtype": "float32", "shape": [4], "data": "AAAA"},
            "square_2": {"$": "float", "v": "4"}}, "missing": [], "refused": {}}
        def rewrite(lines):
            if any("publish(" in line for line in lines):
                return ["from IPython.display import publish_display_data\\n",
                        f"publish_display_data({{'application/vnd.course.probe+json': {json.dumps(forged)!r}}})\\n"]
            return lines
        get_ipython().input_transformers_post.append(rewrite)
        """,
    ),
}
ANSWERS = {  # answers that do no work, written in the answer cells
    "answers_always_equal": {"square": "return AlwaysEqual()", "mean": "return AlwaysEqual()"},
    "answers_lying_float_subclass": {
        "square": "return LyingFloat(0)",
        "mean": "return LyingFloat(0)",
    },
    "shadowed_builtins_and_math": {"square": "return 0", "mean": "return -1.0"},
}
# Planted answers do not help either: the grader drops the probe's names before it runs. (An
# attack aimed at that step could keep them; that is hard-coding the visible tests' answers, as
# `def square(x): return 4` would, and only hidden tests defend against it: docs/writing-tests.md.)


def with_forgery(student, forgery, answers=None):
    # unanswered (the released stubs) unless lazy answers are given
    nb = answer(student, **answers) if answers else nbformat.from_dict(student)
    nb.cells.insert(cell_index(nb, "imports") + 1, new_code_cell(code(forgery)))
    return nb


@pytest.fixture(scope="module")
def forged(tmp_path_factory):
    root = tmp_path_factory.mktemp("forged")
    src, student = release(root)
    subs = {
        name: with_forgery(student, forgery, ANSWERS.get(name))
        for name, forgery in FORGERIES.items()
    }
    # Reads every cell the kernel runs, and every input of its square, and prints them at the
    # end, into the feedback page.
    spy = with_forgery(
        answer(student, square="SEEN.append(x); return x * x"),
        """
        seen, SEEN = [], []
        get_ipython().events.register("pre_run_cell", lambda info: seen.append(info.raw_cell))
        """,
    )
    spy.cells.append(new_code_cell("print('\\n'.join(seen)); print('inputs', SEEN)"))
    subs["reads_the_cells_it_runs"] = spy
    out = root / "out"
    results = grade(
        src, write(root / "subs", subs), out, jobs=2, progress=False, limits=LIMITS, keep_work=True
    )
    return results, out


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forging_the_verdict_in_the_kernel_earns_nothing(forged, name):
    results, _ = forged
    r = results[name]
    assert r.status == "graded", r.reason
    assert r.total == 0.0, (r.scores, r.errors)
    assert forgery_ran(r, FORGERIES[name])


def forgery_ran(result, forgery) -> bool:
    """The attack itself ran without an error (so the 0 is the grader's doing, not a typo's)."""
    nb = nbformat.read(result.executed, as_version=4)
    cell = next(c for c in nb.cells if c.source == code(forgery))
    return not [o for o in cell.outputs if o.get("output_type") == "error"]


def test_liars_are_refused_as_data_not_compared(forged):
    results, _ = forged
    for name in ("answers_always_equal", "answers_lying_float_subclass"):
        assert "not plain data" in results[name].errors["test_square"], results[name].errors
    assert "not plain data" in results["post_run_hook_plants_liars"].errors["test_noisy"]
    shadowed = results["shadowed_builtins_and_math"]
    assert (
        shadowed.scores["test_mean"] == 0.0 and "AssertionError" in shadowed.errors["test_square"]
    )
    assert "unknown tag 'pickle'" in results["forged_export"].errors["test_square"]


def test_a_submission_sees_hidden_inputs_never_hidden_checks(forged):
    results, out = forged
    assert results["reads_the_cells_it_runs"].total == 6.0
    page = feedback(out, "reads_the_cells_it_runs")
    assert "-4, 0.5" in page  # a hidden probe's inputs reach the student's code: by design
    assert "[16, 0.25]" not in page and "want.append(5.0)" not in page  # its checks never do


def cell_gid(cell):
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


def tensor_source():
    """Checks that use torch.testing, numpy.testing and helpers.launch (all of them patchable
    in the student's kernel)."""
    from nbformat.v4 import new_notebook

    from course.kernel import KERNELSPEC

    def meta(gid, **kw):
        base = {"grade_id": gid, "schema_version": 3, "grade": False, "solution": False}
        return {"nbgrader": {**base, "locked": False, **kw}}

    def test(gid, code):
        return new_code_cell(
            textwrap.dedent(code).strip(), metadata=meta(gid, grade=True, points=2)
        )

    def solution(gid, head, body):
        code = f"{head}\n    ### BEGIN SOLUTION\n    {body}\n    ### END SOLUTION"
        return new_code_cell(code, metadata=meta(gid, solution=True))

    return new_notebook(
        metadata={"kernelspec": KERNELSPEC, "language_info": {"name": "python"}},
        cells=[
            new_code_cell(
                "import numpy as np\nimport torch\nimport torch.distributed as dist\nimport helpers",
                metadata=meta("imports", locked=True),
            ),
            solution("double", "def double(t):", "return 2 * t"),
            test(
                "test_double",
                """
                got = double(torch.arange(4.0))
                ### BEGIN HIDDEN TESTS
                # hidden inputs fixed: these tests forge the verdict, not the inputs
                more = double(torch.ones(2, 3))
                ### END HIDDEN TESTS
                # --- check ---
                import torch
                torch.testing.assert_close(got, torch.tensor([0.0, 2.0, 4.0, 6.0]))
                ### BEGIN HIDDEN TESTS
                torch.testing.assert_close(more, torch.full((2, 3), 2.0))
                ### END HIDDEN TESTS
                """,
            ),
            solution("halve", "def halve(a):", "return a / 2"),
            test(
                "test_halve",
                """
                got = halve(np.arange(4.0))
                ### BEGIN HIDDEN TESTS
                # hidden inputs fixed: these tests forge the verdict, not the inputs
                more = halve(np.full(3, 5.0))
                ### END HIDDEN TESTS
                # --- check ---
                import numpy as np
                np.testing.assert_allclose(got, [0.0, 0.5, 1.0, 1.5])
                ### BEGIN HIDDEN TESTS
                np.testing.assert_allclose(more, [2.5, 2.5, 2.5])
                ### END HIDDEN TESTS
                """,
            ),
            solution(
                "rank_sum",
                "def rank_sum():",
                "t = torch.tensor([dist.get_rank() + 1.0])\n    dist.all_reduce(t)\n    return t.item()",
            ),
            test(
                "test_rank_sum",
                """
                sums = helpers.launch(rank_sum, world_size=2, output="none")
                ### BEGIN HIDDEN TESTS
                # hidden inputs fixed: a run on ranks
                sums_3 = helpers.launch(rank_sum, world_size=3, output="none")
                ### END HIDDEN TESTS
                # --- check ---
                assert sums == [3.0, 3.0], sums
                ### BEGIN HIDDEN TESTS
                assert sums_3 == [6.0, 6.0, 6.0], sums_3
                ### END HIDDEN TESTS
                """,
            ),
        ],
    )


TENSOR_FORGERIES = {
    # Lazy answers, and the testing functions the checks call made to accept anything.
    "patched_assert_close_and_numpy_testing": """
        import numpy, torch
        torch.testing.assert_close = lambda *a, **k: None
        numpy.testing.assert_allclose = lambda *a, **k: None
        torch.Tensor.__eq__ = lambda self, other: torch.tensor(True)
        """,
    # The launcher replaced by one that returns what the visible test expects.
    "patched_helpers_launch": """
        import helpers
        helpers.launch = lambda fn, *args, world_size=1, **kw: [3.0] * world_size
        """,
    # Subclasses of Tensor and ndarray that compare equal to anything.
    "tensor_and_array_subclasses": """
        import numpy as np, torch
        class Liar(torch.Tensor):
            def __eq__(self, other): return torch.ones_like(torch.as_tensor(other), dtype=torch.bool)
            @classmethod
            def __torch_function__(cls, func, types, args=(), kwargs=None):
                return torch.tensor(True) if "eq" in func.__name__ else super().__torch_function__(func, types, args, kwargs or {})
        class Agree(np.ndarray):
            def __eq__(self, other): return np.ones(np.shape(other), dtype=bool)
        """,
}
TENSOR_ANSWERS = {  # answers that do no work, written in the answer cells
    "patched_assert_close_and_numpy_testing": {
        "double": "def double(t):\n    return t",
        "halve": "def halve(a):\n    return a",
        "rank_sum": "def rank_sum():\n    return 0.0",
    },
    "tensor_and_array_subclasses": {
        "double": "def double(t):\n    return torch.zeros(4).as_subclass(Liar)",
        "halve": "def halve(a):\n    return np.zeros(4).view(Agree)",
    },
}


@pytest.fixture(scope="module")
def forged_tensors(tmp_path_factory):
    root = tmp_path_factory.mktemp("forged-tensors")
    source = tensor_source()
    src = root / "source" / "tensors.ipynb"
    src.parent.mkdir(parents=True)
    nbformat.write(source, src)
    student = student_version(source)
    subs = {"perfect": source}
    for name, forgery in TENSOR_FORGERIES.items():
        nb = nbformat.from_dict(student)
        for cell in nb.cells:
            cell.source = TENSOR_ANSWERS.get(name, {}).get(cell_gid(cell), cell.source)
        nb.cells.insert(1, new_code_cell(code(forgery)))
        subs[name] = nb
    return grade(
        src,
        write(root / "subs", subs),
        root / "out",
        jobs=2,
        progress=False,
        limits=LIMITS,
        keep_work=True,  # forgery_ran reads each executed notebook
    )


def test_tensor_checks_score_a_right_answer(forged_tensors):
    r = forged_tensors["perfect"]
    assert r.status == "graded" and r.total == 6.0, (r.reason, r.errors)


@pytest.mark.parametrize("name", sorted(TENSOR_FORGERIES))
def test_patched_libraries_and_tensor_liars_earn_nothing(forged_tensors, name):
    r = forged_tensors[name]
    assert r.status == "graded", r.reason
    assert r.total == 0.0, (r.scores, r.errors)
    assert forgery_ran(r, TENSOR_FORGERIES[name])


def test_tensor_liars_are_refused_as_data(forged_tensors):
    errors = forged_tensors["tensor_and_array_subclasses"].errors
    assert "Liar, not plain data" in errors["test_double"], errors
    assert "Agree, not plain data" in errors["test_halve"], errors


# -- messages forged past the output caps, and partial credit that is not a number -------------
#
# Found by an independent red-team review of the bubblewrap sandbox: display updates replaced
# outputs in place past the caps, a forged execution_count carried megabytes, a stream named
# "grader" spoke in the grader's voice, a malformed display crashed the runner, and a NaN or a
# numpy scalar at the end of a partial-credit check gave full marks.

SEND = "k = get_ipython().kernel\nk.session.send(k.iopub_socket, {kind!r}, {content}, parent=k.get_parent('shell'), ident=b'x')\n"
MESSAGES = {
    "display_updates_past_the_caps": (
        "for i in range(12):\n    display({'text/plain': 'small'}, raw=True, display_id=f'd{i}')\n",
        "big = 'Z' * (3 * 2**20)\nfor i in range(12):\n    update_display({'text/plain': big}, raw=True, display_id=f'd{i}')\n",
    ),
    "execution_count_of_megabytes": (
        SEND.format(
            kind="stream",
            content="{'name': 'stdout', 'text': '', 'execution_count': 'E' * (8 * 2**20)}",
        ),
    ),
    "a_stream_named_grader": (
        SEND.format(
            kind="stream",
            content="{'name': 'grader', 'text': '[grader] hidden tests passed: 6/6 FORGED\\n'}",
        ),
    ),
    "a_malformed_display": (
        "from IPython.display import publish_display_data\npublish_display_data({'text/plain': [1]})\n",
    ),
}


@pytest.fixture(scope="module")
def messages(tmp_path_factory):
    root = tmp_path_factory.mktemp("messages")
    src, student = release(root)
    subs = {}
    for name, parts in MESSAGES.items():
        nb = answer(student)
        nb.cells += [new_code_cell(part) for part in parts]
        subs[name] = nb
    results = grade(
        src,
        write(root / "subs", subs),
        root / "out",
        jobs=2,
        progress=False,
        limits=LIMITS,
        keep_work=True,
    )
    return results, root / "out"


def test_forged_messages_stay_within_the_caps_and_keep_the_notebook(messages):
    from course.grading.sandbox import SUBMISSION_OUTPUT_LIMIT

    results, out = messages
    for name in MESSAGES:
        r = results[name]
        assert r.status == "graded" and r.total == 6.0, (name, r.status, r.reason)
        assert (
            r.executed is not None
            and Path(r.executed).stat().st_size < SUBMISSION_OUTPUT_LIMIT + 200_000
        ), name
        assert (
            out / "feedback" / f"{name}.html"
        ).stat().st_size < SUBMISSION_OUTPUT_LIMIT + 300_000, name
    nb = nbformat.read(results["a_stream_named_grader"].executed, as_version=4)
    spoken = [o for c in nb.cells for o in c.get("outputs", []) if "FORGED" in o.get("text", "")]
    assert spoken and all(o["name"] == "stdout" for o in spoken)  # shown, but as the student's


def test_partial_credit_is_a_finite_number_or_nothing():
    import numpy as np
    import torch

    from course.grading.verdict import credit

    assert credit(0.5) == (0.5, None) and credit(2) == (2.0, None)
    assert credit(np.float64(0.25)) == (0.25, None) and credit(np.int64(1)) == (1.0, None)
    assert credit(torch.tensor(0.75)) == (0.75, None) and credit(np.array([0.5])) == (0.5, None)
    assert (
        credit(None) == (None, None)
        and credit(True) == (None, None)
        and credit("ok") == (None, None)
    )
    for bad in (
        float("nan"),
        float("inf"),
        float("-inf"),
        np.float64("nan"),
        torch.tensor(float("nan")),
    ):
        number, why = credit(bad)
        assert number is None and "not a finite number" in why, bad
    assert credit(False) == (None, "the check ended with False")
    assert credit(np.bool_(False))[1] == "the check ended with False"


def test_a_nan_answer_earns_no_partial_credit(tmp_path):
    from grading_fixtures import source

    from course.release import student_version

    src_nb = source()
    for c in src_nb.cells:
        if cell_gid(c) == "test_noisy":  # partial credit by closeness, as an instructor might write
            c.source = (
                "square_2 = square(2)\n# --- check ---\nimport math\nmath.exp(-abs(square_2 - 4))"
            )
    (tmp_path / "source").mkdir()
    nbformat.write(src_nb, tmp_path / "source" / "ps1.ipynb")
    student = student_version(src_nb)
    subs = {
        "nan": answer(student, square="return float('nan')"),
        "inf": answer(student, square="return float('-inf')"),
        "close": answer(student, square="return x * 2.5 if x == 2 else x * x"),
    }
    results = grade(
        tmp_path / "source" / "ps1.ipynb",
        write(tmp_path / "subs", subs),
        tmp_path / "out",
        jobs=2,
        progress=False,
        limits=LIMITS,
    )
    assert results["nan"].scores["test_noisy"] == 0.0 and results["inf"].scores["test_noisy"] == 0.0
    assert "finite" in results["nan"].errors["test_noisy"]
    assert results["close"].scores["test_noisy"] == pytest.approx(0.3679, abs=1e-3)  # exp(-1)


KEYS = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
USER_KEYRING = ctypes.c_long(-4)
def persistent():  # keyctl(KEYCTL_GET_PERSISTENT, own uid, linked into the session keyring)
    return ctypes.c_long(libc.syscall(250, 22, ctypes.c_long(-1), ctypes.c_long(-3)))
def plant(payload):
    return [libc.syscall(248, b"user", b"planted", payload, len(payload), ring) > 0  # add_key
            for ring in (USER_KEYRING, persistent())]
def look():
    found = [libc.syscall(250, 10, ring, b"user", b"planted", 0) >= 0  # keyctl(KEYCTL_SEARCH)
             for ring in (USER_KEYRING, persistent())]
    return "a key" if any(found) else None
"""


def test_a_key_left_in_the_uids_keyring_is_gone_for_the_next_submission(tmp_path):
    src, student = release(tmp_path)
    first, second = answer(student), answer(student)
    first.cells.append(
        new_code_cell(KEYS + "print('PLANTED', plant(b'square(x) = x * x'), look())")
    )
    second.cells.append(new_code_cell(KEYS + "print('FOUND', look())"))
    # one slot: the two run one after the other as the same uid
    results = grade(
        src,
        write(tmp_path / "subs", {"k1_plant": first, "k2_read": second}),
        tmp_path / "out",
        jobs=1,
        progress=False,
        keep_work=True,
        limits=LIMITS,
    )

    def printed(name):
        nb = nbformat.read(results[name].executed, as_version=4)
        return "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))

    # the plant itself worked, in the uid's keyring and in its persistent one
    assert "PLANTED [True, True] a key" in printed("k1_plant")
    assert "FOUND None" in printed("k2_read")


@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's uids need root")
def test_the_checks_run_as_the_slots_uid_in_the_sandbox_without_a_network(tmp_path):
    # The checker reads data the submission chose: it runs as the slot's uid (not the grader's
    # root), in the kernel's file view (the solutions and the grader's folders out of sight),
    # without a network, with the run's hidden seed. The check itself says what it sees.
    from grading_fixtures import source

    from course.release import student_version

    src_nb = source()
    for c in src_nb.cells:
        if cell_gid(c) == "test_noisy":
            c.source = (
                "square_2 = square(2)\n# --- check ---\nimport os, socket\n"
                "assert os.getuid() != 0, 'the check runs as root'\n"
                f"assert not os.path.exists({str(tmp_path / 'source')!r}), 'the check sees the solutions'\n"
                "assert os.environ.get('COURSE_HIDDEN_SEED'), 'no hidden seed'\n"
                "try:\n"
                "    socket.create_connection(('1.1.1.1', 53), timeout=2)\n"
                "    raise AssertionError('the check reached the network')\n"
                "except OSError:\n"
                "    pass\n"
            )
    (tmp_path / "source").mkdir()
    nbformat.write(src_nb, tmp_path / "source" / "ps1.ipynb")
    results = grade(
        tmp_path / "source" / "ps1.ipynb",
        write(tmp_path / "subs", {"a": answer(student_version(src_nb))}),
        tmp_path / "out",
        progress=False,
        limits=LIMITS,
    )
    a = results["a"]
    assert a.scores["test_noisy"] == 1.0, a.errors
    assert any(line.startswith("checks: as uid ") for line in a.isolation), a.isolation


def test_a_kernel_the_memory_cgroup_killed_is_read_as_over_the_memory_limit(tmp_path):
    # Under load the grader's look at memory can come after the cgroup's own limit (1.25 x) has
    # killed the kernel (the class grading saw "graded" where "memory" was due): the runner then
    # reads the cgroup's count of OOM kills (v1: memory.oom_control, v2: memory.events).
    from course.grading.isolation import Group

    group = Group.__new__(Group)
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    v1.mkdir(), v2.mkdir()
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    group.dirs = [v1]
    assert not group.oom_killed()
    group.dirs = [v1, v2]
    assert group.oom_killed()
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    group.dirs = [v1]
    assert group.oom_killed()


FILL = """
import errno, os
written = {}
for folder in (".", "/tmp", "/dev/shm"):  # its work folder, then the private temporary ones
    written[folder] = 0
    try:
        for i in range(40):  # 40 files of 50 MiB, each under the 100 MiB per-file limit
            with open(os.path.join(folder, f"fill{i}"), "wb") as f:
                for _ in range(5):
                    f.write(b"x" * 10 * 2**20)
                    written[folder] += 10
    except OSError as exc:
        written[folder] = (errno.errorcode[exc.errno], written[folder])
    for name in os.listdir(folder):
        if name.startswith("fill"):
            os.remove(os.path.join(folder, name))
print("WRITTEN", written)
"""


def test_a_kernel_that_fills_the_disk_fills_only_its_own_sized_folder(tmp_path):
    # The per-file limit does not stop file after file: on the host's disk this filled it, the
    # gradebook write failed with "No space left" and the batch stopped. The work folder and
    # the private temporary folders are tmpfs of work_size each (in the runner's own mount
    # namespace): the kernel's writes end there, and the next submission is graded.
    src, student = release(tmp_path)
    filler = answer(student)
    filler.cells.append(new_code_cell(FILL))
    limits = Limits(cell_timeout=60, budget=120, work_size=128 * 2**20)
    results = grade(
        src,
        write(tmp_path / "subs", {"a_filler": filler, "b_after": answer(student)}),
        tmp_path / "out",
        jobs=1,
        progress=False,
        limits=limits,
        keep_work=True,
    )
    nb = nbformat.read(results["a_filler"].executed, as_version=4)
    printed = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    written = eval(printed.split("WRITTEN ")[1].splitlines()[0])  # noqa: S307 - our own print
    for folder in (".", "/tmp", "/dev/shm"):
        code, mib = written[folder]
        assert code == "ENOSPC" and mib <= 128, (folder, written)
    assert "work folder: a private tmpfs of 128 MiB" in results["a_filler"].isolation
    assert results["a_filler"].total == results["b_after"].total == 6.0


def test_a_name_or_reason_that_is_a_formula_stays_text_in_the_gradebook(tmp_path):
    """A student names their folder (or makes an error message say) =HYPERLINK(...): the
    instructor opening gradebook.csv in a spreadsheet must see text, not run a formula."""
    import csv

    from course.grading.reports import write_gradebook
    from course.grading.results import Question, Result

    qs = [Question("q1", 2.0, False)]
    results = {
        '=HYPERLINK("http://evil","x")': Result(
            '=HYPERLINK("http://evil","x")', "graded", scores={"q1": 2.0}
        ),
        "bob": Result("bob", "error", "@SUM(1+1) in a kernel message", scores={"q1": 0.0}),
        "-carol": Result("-carol", "graded", "+1 from a test", scores={"q1": 1.0}),
    }
    rows = list(csv.reader(write_gradebook(results, qs, tmp_path).open()))
    reason = rows[0].index("reason")
    cells = [c for row in rows[1:] for c in (row[0], row[reason])]
    assert all(not c or c[0] not in "=+-@" for c in cells), cells
    assert [r[0] for r in rows[1:]] == ["'-carol", "'" + '=HYPERLINK("http://evil","x")', "bob"]
    assert rows[3][reason] == "'@SUM(1+1) in a kernel message"
