"""Hidden cases drawn from the grading run's seed (course.grading.seeds): a table of one run's
hidden inputs and answers, printed into its feedback and solved offline, scores 0 in the next
run, while a correct answer scores fully whatever the seed; and a run replays, with the key its
output folder keeps, to the same seeds and verdicts."""

from __future__ import annotations

import json
import random
import stat

import nbformat
import pytest
from grading_fixtures import KERNELSPEC, meta
from nbformat.v4 import new_code_cell, new_notebook

from course.grade import grade
from course.grading import cells, seeds
from course.grading.shards import content_key

# The probe and the check each draw the cases from COURSE_HIDDEN_SEED (0 outside grading); the
# check looks its own cases up in the probe's data, never loops over what the probe sent.
TEST = """\
digits_10 = digit_sum(10)
### BEGIN HIDDEN TESTS
import os, random
_rng = random.Random(int(os.environ.get("COURSE_HIDDEN_SEED", "0")))
swept = {n: digit_sum(n) for n in [_rng.randrange(10**6) for _ in range(6)]}
### END HIDDEN TESTS
# --- check ---
assert digits_10 == 1, digits_10
### BEGIN HIDDEN TESTS
import os, random
_rng = random.Random(int(os.environ.get("COURSE_HIDDEN_SEED", "0")))
for n in [_rng.randrange(10**6) for _ in range(6)]:
    assert swept.get(n) == sum(map(int, str(n))), n
### END HIDDEN TESTS
"""
SOLUTION = "def digit_sum(n):\n    ### BEGIN SOLUTION\n    return sum(map(int, str(n)))\n    ### END SOLUTION"


def source() -> nbformat.NotebookNode:
    return new_notebook(
        metadata={"kernelspec": KERNELSPEC, "language_info": {"name": "python"}},
        cells=[
            new_code_cell(SOLUTION, metadata=meta("digit_sum", solution=True)),
            new_code_cell(TEST, metadata=meta("test_digit_sum", grade=True, points=2)),
            new_code_cell(
                "### BEGIN SOLUTION\nnotes = None\n### END SOLUTION",
                metadata=meta("notes", solution=True),
            ),
        ],
    )


def submission(body: str, notes: str = "notes = None") -> nbformat.NotebookNode:
    nb = source()
    nb.cells[0].source = "def digit_sum(n):\n" + body
    nb.cells[2].source = notes
    return nb


# A test cell's own output is the check's, in the feedback; what the student's code saw during
# the probe it keeps, and prints in a later cell of its own.
SPY = """\
    SEEN.append(n)
    return 1 if n == 10 else 0
SEEN = []
"""
SPY_NOTES = "for n in SEEN:\n    print('ASKED', n)"


def graded(tmp_path, subs: dict, name: str, out=None, **options) -> dict:
    """``subs`` graded into out-NAME (or ``out``); ``options`` go to course.grade.grade."""
    lab = tmp_path / "lab.ipynb"
    if not lab.exists():  # one version of the lab for every run (cell ids are random)
        nbformat.write(source(), lab)
    folder = tmp_path / f"subs-{name}"
    folder.mkdir()
    for student, nb in subs.items():
        nbformat.write(nb, folder / f"{student}.ipynb")
    out = out or tmp_path / f"out-{name}"
    return grade(lab, folder, out, progress=False, keep_work=True, **options)


def table_of(result) -> nbformat.NotebookNode:
    """The submission a student makes offline from the inputs ``result``'s feedback printed:
    a table of their answers, right exactly where that run's seed asks."""
    table = {n: sum(map(int, str(n))) for n in asked(result)}
    return submission(
        f"    return {json.dumps({str(k): v for k, v in table.items()})}.get(str(n), 0)\n"
    )


def asked(result) -> list[int]:
    nb = nbformat.read(result.executed, as_version=4)
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    return [int(line.split()[1]) for line in text.splitlines() if line.startswith("ASKED ")]


def test_the_source_obeys_the_release_rules():
    cells.validate(source())  # the check loops over its own draws, not over the probe's data


def test_a_table_of_the_last_runs_hidden_cases_scores_nothing_in_the_next(tmp_path):
    # Run 1: the spy prints every input it is called with; its feedback shows them.
    spy = graded(tmp_path, {"student": submission(SPY, SPY_NOTES)}, "spy")["student"]
    inputs = [n for n in asked(spy) if n != 10]
    assert spy.scores["test_digit_sum"] == 0.0 and len(inputs) == 6, (spy.errors, inputs)
    content = content_key(tmp_path / "subs-spy" / "student.ipynb")
    assert spy.hidden_seed == seeds.stored(tmp_path / "out-spy").for_student("student", content)
    # Offline, the student solves those inputs and submits the answers as a table.
    subs = {"student": table_of(spy), "correct": source(), "forger": forger()}
    # The same seed again (what fixed hidden inputs amount to): the table passes...
    replay = graded(tmp_path, subs, "replay", hidden_seed=spy.hidden_seed)
    assert replay["student"].scores["test_digit_sum"] == 2.0, replay["student"].errors
    # ...a new run's seed draws new cases: the table scores 0, a correct answer 2.
    fresh = graded(tmp_path, subs, "fresh")
    assert fresh["student"].scores["test_digit_sum"] == 0.0
    assert fresh["student"].hidden_seed != replay["student"].hidden_seed
    assert fresh["correct"].scores["test_digit_sum"] == 2.0, fresh["correct"].errors
    # A kernel that sets the seed itself only asks itself the wrong questions: the check draws
    # from the grader's seed, and looks its own cases up.
    forged = fresh["forger"]
    assert forged.status == "graded" and forged.scores["test_digit_sum"] == 0.0, forged.reason
    assert "AssertionError" in forged.errors["test_digit_sum"]


def test_a_run_replays_from_its_output_folder_where_its_key_stays(tmp_path):
    """Issue 41: a default run's key was kept nowhere, so no run could be replayed, and
    --hidden-seed N derived seeds from N instead of using it."""
    from course import cli

    first = graded(tmp_path, {"student": submission(SPY, SPY_NOTES)}, "first")["student"]
    out = tmp_path / "out-first"
    # The key is in the output folder, the grader's user's alone, and nowhere else there.
    key = out / seeds.KEY_FILE
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    secret = json.loads(key.read_text())["key"].encode()
    others = [p for p in out.rglob("*") if p.is_file() and p != key]
    assert others and not [p for p in others if secret in p.read_bytes()]
    # `course grade --replay OUT` of the same files into a new folder: the same seed, the same
    # cases asked, the same verdicts.
    lab, again = str(tmp_path / "lab.ipynb"), tmp_path / "out-again"
    argv = ["grade", lab, str(tmp_path / "subs-first"), "--out", str(again), "--replay", str(out)]
    argv.append("--keep-work")  # its executed notebook: which cases it asked
    assert cli.main(argv) == 0
    replayed = grade(lab, tmp_path / "subs-first", again, progress=False, keep_work=True)
    replayed = replayed["student"]  # resumed: what the command saved
    assert replayed.hidden_seed == first.hidden_seed and asked(replayed) == asked(first)
    assert replayed.scores == first.scores
    # A resubmission graded into the first folder: its key, but new files, so new cases. The
    # table of the cases the first feedback showed scores 0 (red team of issue 41: with the
    # seed a function of the name alone, it scored 2).
    table = tmp_path / "subs-table"
    table.mkdir()
    nbformat.write(table_of(first), table / "student.ipynb")
    rerun = grade(lab, table, out, progress=False)["student"]
    assert rerun.hidden_seed != first.hidden_seed
    assert rerun.scores["test_digit_sum"] == 0.0, rerun.errors
    # --hidden-seed N is every submission's seed, exactly: a result's hidden_seed gives its
    # verdicts again, whatever the student's name.
    one = graded(tmp_path, {"renamed": table_of(first)}, "one", hidden_seed=first.hidden_seed)
    assert one["renamed"].hidden_seed == first.hidden_seed
    assert one["renamed"].scores["test_digit_sum"] == 2.0, one["renamed"].errors
    assert seeds.stored(tmp_path / "out-one") == seeds.Hidden(seed=first.hidden_seed)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"hidden_seed": 5}, "was graded with other hidden cases"),  # out holds another key
        ({"replay": "nowhere"}, "holds no hidden key"),
        ({"hidden_seed": 5, "replay": "out"}, "not both"),
        ({"hidden_seed": 0}, "0 is the public seed"),
    ],
)
def test_a_seed_that_would_mix_runs_or_means_nothing_is_refused(tmp_path, options, message):
    out = tmp_path / "out"
    seeds.for_run(out)  # a folder graded before, with its own key
    if options.get("replay"):
        options["replay"] = tmp_path / options["replay"]
    with pytest.raises(seeds.SeedError, match=message):
        seeds.for_run(out, **options)
    # said by the command as an error, not a traceback
    nbformat.write(source(), tmp_path / "lab.ipynb")
    (tmp_path / "subs").mkdir()
    argv = ["grade", str(tmp_path / "lab.ipynb"), str(tmp_path / "subs"), "--out", str(out)]
    for name, value in options.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    from course import cli

    assert cli.main(argv) == 2


def test_a_merged_run_replays_slice_by_slice_with_each_slices_key(tmp_path):
    subs = {"ann": submission(SPY, SPY_NOTES), "bob": submission(SPY, SPY_NOTES)}
    one = graded(tmp_path, subs, "one", shard=(1, 2))  # ann
    two = graded(tmp_path, subs, "two", shard=(2, 2))  # bob, with another key
    lab, merged = tmp_path / "lab.ipynb", tmp_path / "merged"
    from course.grading.shards import merge

    merge(lab, [tmp_path / "out-one", tmp_path / "out-two"], merged)
    with pytest.raises(seeds.SeedError, match="replay one slice at a time, with --shard K/N"):
        seeds.stored(merged)
    again = graded(tmp_path, subs, "again", shard=(2, 2), replay=merged)
    assert again["bob"].hidden_seed == two["bob"].hidden_seed
    bob = content_key(tmp_path / "subs-again" / "bob.ipynb")
    assert again["bob"].hidden_seed != seeds.stored(tmp_path / "out-one").for_student("bob", bob)
    assert asked(again["bob"]) == asked(two["bob"]) and "ann" in one


def forger() -> nbformat.NotebookNode:
    """A table of seed 0's cases (a plain run's, anyone's to see), with the kernel's seed set to
    0 so that the probe asks exactly those."""
    rng = random.Random(0)
    table = {n: sum(map(int, str(n))) for n in [10] + [rng.randrange(10**6) for _ in range(6)]}
    return submission(
        "    import os\n    os.environ['COURSE_HIDDEN_SEED'] = '0'\n"
        f"    return {json.dumps({str(k): v for k, v in table.items()})}.get(str(n), 0)\n"
    )


@pytest.mark.parametrize("run", [1, 2, 3, 4, 5])
def test_seeds_differ_by_student_and_run_and_are_never_the_public_zero(run):
    key = seeds.new_key()
    a, b = seeds.for_submission(key, "ann"), seeds.for_submission(key, "bob")
    assert a != b and a != seeds.for_submission(seeds.new_key(), "ann")
    # a resubmission (other files) is asked other cases; the same files, the same ones
    assert seeds.for_submission(key, "ann", "files 1") != seeds.for_submission(key, "ann", "2")
    assert seeds.for_submission(key, "ann", "files 1") == seeds.for_submission(
        key, "ann", "files 1"
    )
    assert 0 < a < 2**31 and 0 < b < 2**31
    assert len(key) == 16 and key != seeds.new_key()  # 128 bits, new each time
