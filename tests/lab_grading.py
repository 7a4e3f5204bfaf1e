"""Grading a lab like a class would hand it in: the untouched student version and submissions
built from plausible wrong answers, through `course grade`; every wrong answer against its test
cell in one kernel. Shared by the tests of every lab."""

from __future__ import annotations

import csv
import os
import re
import textwrap
import time
from pathlib import Path

import nbformat
import replay_attack

from course.grade import grade
from course.grading import cells, seeds
from course.grading.results import Limits
from course.syllabus import load_syllabus

VERDICT_SEED = 7  # the verdict kernel's hidden seed: not the public 0, so a plain run's table fails


def wrong_submissions(wrong: dict, halves: int = 1, graded: int = 1) -> dict[str, dict[str, str]]:
    """{name: {solution grade_id: wrong source}} from ``wrong`` = {grade_id: (test, [variants])},
    for the first ``graded`` variants of each question (the grader's own run of a class).

    Submission ``wrong{v}`` holds variant v of every question that has one. The first ``halves``
    variants are instead split in two submissions, ``wrong{v}a`` and ``wrong{v}b``, each wrong in
    every other question and right in the rest: between them every question is once wrong (it
    must lose its points) and once right beside wrong answers (it must keep them), which shows
    through the grader itself that a wrong answer costs its own points and only those.

    Every other variant is checked in one kernel by ``wrong_answer_verdicts``: its question's
    test cell, hidden parts included, must fail on it. A whole graded submission per variant
    cost a kernel, the imports and every graded cell for each (most of the suite's time); what
    the grader adds to a failing test cell (zero points for that question) the halves show."""
    subs = {}
    order = list(wrong)
    most = max(len(variants) for _, variants in wrong.values())
    for v in range(min(most, graded)):
        for parity in (0, 1) if v < halves else (None,):
            chosen = {
                gid: textwrap.dedent(wrong[gid][1][v]).strip()
                for i, gid in enumerate(order)
                if (parity is None or i % 2 == parity) and v < len(wrong[gid][1])
            }
            if chosen:
                subs[f"wrong{v}{'' if parity is None else 'ab'[parity]}"] = chosen
    return subs


def write_submission(lab: Path, path: Path, replace: dict[str, str]) -> None:
    nb = nbformat.read(lab, as_version=4)
    for cell in nb.cells:
        gid = cells.grade_id(cell)
        if gid in replace:
            cell.source = replace[gid]
    nbformat.write(nb, path)


def answers(lab: Path) -> dict[str, str]:
    """{grade_id: source} of the solution's answer cells (code a student writes), unmarked."""
    marks = re.compile(r"^[ \t]*### (BEGIN|END) SOLUTION[ \t]*\n?", re.M)
    return {
        cells.grade_id(c): marks.sub("", c.source)
        for c in nbformat.read(lab, as_version=4).cells
        if c.cell_type == "code" and cells.info(c).get("solution") and not cells.is_graded(c)
    }


def stubs(student: Path) -> dict[str, str]:
    """{grade_id: source} of the released lab's unfinished answer cells."""
    nb = nbformat.read(student, as_version=4)
    return {
        cells.grade_id(c): c.source
        for c in nb.cells
        if c.cell_type == "code" and "NotImplementedError" in c.source and cells.grade_id(c)
    }


def trimmed(path: Path, folder: Path, markers: tuple) -> Path:
    """A copy of notebook ``path`` in ``folder`` without the code cells that contain one of
    ``markers`` (ungraded timing, sweep and plot cells: grading a class is faster without them)."""
    nb = nbformat.read(path, as_version=4)
    keep = [
        c for c in nb.cells if not (c.cell_type == "code" and any(m in c.source for m in markers))
    ]
    assert len(nb.cells) - len(keep) == len(markers), "every ungraded cell named is found once"
    nb.cells = keep
    out = folder / path.name
    nbformat.write(nb, out)
    return out


def override(path: Path, values: dict) -> None:
    """Set ``values`` in a cell after the notebook's parameters cell, as papermill injects them."""
    if not values:
        return
    nb = nbformat.read(path, as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    source = "\n".join(f"{name} = {value!r}" for name, value in values.items())
    nb.cells.insert(
        at + 1, nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    )
    nbformat.write(nb, path)


def grade_class(
    lab: Path,
    student: Path,
    wrong: dict,
    tmp: Path,
    overrides: dict | None = None,
    limits: Limits | None = None,
    entry: Path | None = None,
) -> dict:
    """Grade the two half-wrong submissions, in one round of the grader's two slots.

    Each is the released student version, every answer cell filled in as a student would: half
    the questions with a wrong answer, the others with the solution's. The untouched student
    version is not graded whole: each of its unfinished answers is a variant of the verdict
    kernel (``wrong_answer_verdicts``) that must fail its test, which with the halves (a failed
    test costs its question's points, only those) is what grading it showed, at a third of the
    class's cost. ``entry``: the syllabus path whose quick profile applies (default ``lab``; a
    trimmed copy of a lab in a temporary folder names its original)."""
    subs = tmp / "subs"
    subs.mkdir()
    right = answers(lab)
    unfinished = set(stubs(student))
    assert unfinished <= set(right), f"stubs without a solution cell: {unfinished - set(right)}"
    for name, replace in wrong_submissions(wrong).items():
        write_submission(student, subs / f"{name}.ipynb", {**right, **replace})
    quick = next(e for e in load_syllabus() if e.path == (entry or lab)).parameters("quick")
    return grade(
        lab,
        subs,
        tmp / "out",
        jobs=2,
        parameters={**quick, **(overrides or {})},
        progress=False,
        limits=limits or Limits(cell_timeout=120, budget=400),
    )


def grade_trimmed(
    lab: Path, student: Path, wrong: dict, ungraded: tuple, tmp: Path, **kwargs
) -> dict:
    """``grade_class`` on copies of the lab and its student version without the ``ungraded``
    cells (timing, sweeps, plots), with the quick profile of ``lab`` itself."""
    (tmp / "lab").mkdir(), (tmp / "student").mkdir()
    return grade_class(
        trimmed(lab, tmp / "lab", ungraded),
        trimmed(student, tmp / "student", ungraded),
        wrong,
        tmp,
        entry=lab,
        **kwargs,
    )


def assert_wrong_answers_lose_their_points(graded: dict, wrong: dict, auto: dict) -> None:
    """Graded by the grader: each question of ``wrong_submissions`` zero where it is wrong, full
    where it is right (in the same submission)."""
    for name, replace in wrong_submissions(wrong).items():
        result = graded[name]
        assert result.status == "graded", (name, result.reason)
        wrong_tests = {wrong[gid][0] for gid in replace}
        for test, points in auto.items():
            want = 0.0 if test in wrong_tests else float(points)
            assert result.scores[test] == want, (name, test, result.scores, result.errors)


MORE_SEEDS = (1, 2, 3, 4)  # besides the verdict kernel's own, 7
SPAN_LAUNCH_CAP = 30.0  # s: the longest launch of a test cell, about 6 s on 2 quiet cores, x5


def wrong_answer_verdicts(
    lab: Path,
    student: Path,
    wrong: dict,
    ungraded: tuple,
    tmp: Path,
    overrides: dict | None = None,
    record: Path | None = None,
) -> dict[tuple[str, int], str | None]:
    """{(question, v): None if its test cell passed on variant v, else the error}; (question, -1)
    is the solution, run after the question's variants; (question, "stub") the released
    ``student`` version's unfinished cell, the first variant of each question.

    One real kernel of the project runs the lab without the ``ungraded`` cells, with the quick
    profile (and ``overrides``) injected after its parameters cell and a hidden seed that is not
    the default (a table of a plain run's cases fails). Then for each question, each wrong
    answer replaces the answer cell and everything from it to the question's test cell runs
    again, probe and check and the hidden parts, as the grader runs them for a submission; then
    the solution and the same cells, which must pass again: a variant cannot leave behind state
    that failed the next one for it. Cells between an answer and its test (the helpers a test
    calls) run each time, so they see the wrong answer as they would in a submission. Last,
    the tests that draw their cases from the run's seed run again on the solution at each of
    MORE_SEEDS: {(question, "seed N"): error or None}.

    ``record``: where the first pass leaves what every locked function returned, call by call
    (tests/replay_attack.py), for ``grade_replays``."""
    from nbclient import NotebookClient

    folder = tmp / "verdicts"
    folder.mkdir()
    path = trimmed(lab, folder, ungraded)
    quick = next(e for e in load_syllabus() if e.path == lab).parameters("quick")
    override(path, {**quick, **(overrides or {})})
    nb = nbformat.read(path, as_version=4)
    at = {cells.grade_id(c): i for i, c in enumerate(nb.cells)}
    # allow_errors: a failing cell is read from its outputs. Raising instead asks the kernel to
    # stop on the error, and ipykernel then drops the next request too (the solution's cell
    # that should have put the right answer back).
    client = NotebookClient(nb, kernel_name="multigpu-course", timeout=300, allow_errors=True)
    env = {**os.environ, seeds.ENV: str(VERDICT_SEED)}

    # nbclient puts each cell it runs at its index in the notebook: a variant would replace the
    # solution there, so every run builds its cell anew from these sources.
    code = [c.source if c.cell_type == "code" else None for c in nb.cells]

    def run(index: int, source: str | None = None) -> str | None:
        if code[index] is None:
            return None
        cell = nbformat.v4.new_code_cell(code[index] if source is None else source)
        client.execute_cell(cell, index)
        errors = [o for o in cell.outputs if o.output_type == "error"]
        return f"cell {index}: {errors[0].ename}: {errors[0].evalue}"[:500] if errors else None

    verdicts, seconds = {}, {}
    with client.setup_kernel(cwd=str(lab.parent), env=env):
        recorder = replay_attack.Recorder(client, nb) if record else None
        for i, cell in enumerate(nb.cells):
            # a cell that reads what a left-out cell made fails here as it does in grading, and
            # is not run again; no graded cell may fail (answers, tests, the cells they rely on)
            if recorder:
                recorder.before(i)
            error = run(i)
            assert error is None or cells.grade_id(cell) is None, f"the solution fails: {error}"
            if error:
                code[i] = None
            if recorder:
                recorder.after(i, error)
        if recorder:
            recorder.save(record)
        # A wrong pipeline or collective can leave a rank waiting for ever: its launch is cut
        # at SPAN_LAUNCH_CAP (as the grader cuts one at its cell timeout), not at the lab's own
        # timeout of a minute or more. The test cells' own launches take seconds.
        cap = "import helpers.launcher.launch as _launch; _launch.TIMEOUT_CAP = {}"
        client.execute_cell(nbformat.v4.new_code_cell(cap.format(SPAN_LAUNCH_CAP)), 0)
        unfinished = stubs(student)
        assert set(unfinished) <= set(wrong), (
            f"stubs with no wrong answers: {set(unfinished) - set(wrong)}"
        )

        def elsewhere(index: int) -> set[str]:  # names another cell binds too (an import, ...)
            return {n for j, c in enumerate(code) if c and j != index for n in cells.bound_names(c)}

        for gid, (test, variants) in wrong.items():
            answer, check = at[gid], at[test]
            assert answer < check, (gid, test)
            tried = [("stub", unfinished[gid])] if gid in unfinished else []
            # what the solution's cell defined goes before each variant runs, as if it never
            # ran: a variant that leaves a name out (or a stub that raises first) meets a
            # NameError, not the solution's leftover
            forget = sorted(set(cells.bound_names(code[answer])) - elsewhere(answer))
            for v, source in [*tried, *enumerate(variants)]:
                client.execute_cell(
                    nbformat.v4.new_code_cell(f"for _n in {forget!r}: globals().pop(_n, None)"), 0
                )
                error = run(answer, textwrap.dedent(source).strip())
                # a released stub may raise in its own cell (one that is not a function's body)
                assert error is None or v == "stub", (
                    f"{gid} variant {v} does not even define itself: a wrong answer must fail "
                    f"its test, not its own cell: {error}"
                )
                start = time.monotonic()
                # every cell up to the test runs (as in grading, an error does not stop the
                # notebook); the verdict is the test cell's own: a helper cell that fails on
                # the wrong answer is not the test catching it
                verdicts[gid, v] = [run(i) for i in range(answer + 1, check + 1)][-1]
                seconds[gid, v] = time.monotonic() - start
            verdicts[gid, -1] = next(filter(None, (run(i) for i in range(answer, check + 1))), None)
        # A test that draws its cases from the run's seed: the solution passes at four more
        # seeds (five with the one above), as in five grading runs. Only those tests rerun.
        for seed in MORE_SEEDS:
            set_seed = f"import os; os.environ['{seeds.ENV}'] = '{seed}'"
            client.execute_cell(nbformat.v4.new_code_cell(set_seed), 0)
            for gid, (test, _) in wrong.items():
                if draws_from_the_seed(code[at[test]]):
                    verdicts[gid, f"seed {seed}"] = next(
                        filter(None, (run(i) for i in range(at[gid], at[test] + 1))), None
                    )
    slow = sorted(seconds.items(), key=lambda kv: -kv[1])[:5]
    print("slowest variants:", ", ".join(f"{g} {v}: {t:.1f} s" for (g, v), t in slow))
    return verdicts


def draws_from_the_seed(source: str) -> bool:
    """A test cell that draws cases from the run's seed: it names the variable, or reads it
    through ``helpers.labs.hidden_seed()``."""
    return seeds.ENV in source or "hidden_seed(" in source


def assert_each_wrong_answer_fails_its_test(verdicts: dict, wrong: dict) -> None:
    """Every wrong answer fails its test cell, and so does every unfinished cell of the released
    lab (what an untouched submission hands in: with the halves' grading, it scores nothing);
    the solution passes, at every seed."""
    stubbed = [gid for (gid, v) in verdicts if v == "stub"]
    assert stubbed, "the verdicts ran no stub of the released lab"
    for gid in stubbed:
        error = verdicts[gid, "stub"]
        assert error is not None, f"the unfinished {gid} passes {wrong[gid][0]}"
    for gid, (test, variants) in wrong.items():
        assert verdicts[gid, -1] is None, f"the solution of {gid} fails {test}: {verdicts[gid, -1]}"
        for seed in MORE_SEEDS:
            error = verdicts.get((gid, f"seed {seed}"))
            assert error is None, (
                f"the solution of {gid} fails {test} at hidden seed {seed}: {error}"
            )
        passed = [v for v in range(len(variants)) if verdicts[gid, v] is None]
        assert not passed, f"{test} passes wrong answers of {gid}: " + "\n---\n".join(
            textwrap.dedent(variants[v]) for v in passed
        )


def assert_right_answers_score_every_point(
    graded: dict, wrong: dict, auto: dict, manual: set
) -> None:
    """Between the two halves every question is right once: its full points there, all the
    automatic points in all (the solution needs no run of its own through the grader: its
    answers are the halves' right ones, and the syllabus run and the verdicts run it whole);
    written answers wait for a person. The untouched student version: its stubs in the
    verdicts (``assert_each_wrong_answer_fails_its_test``)."""
    halves = wrong_submissions(wrong)
    earned = {}
    for name, replace in halves.items():
        r = graded[name]
        assert r.status == "graded", (name, r.reason)
        right = {wrong[gid][0] for gid in wrong} - {wrong[gid][0] for gid in replace}
        earned.update({test: r.scores[test] for test in right})
        assert all(r.scores[g] is None for g in manual), (name, r.scores)  # for a person
    assert earned == {g: float(p) for g, p in auto.items()}, earned
    assert set(graded) == set(halves), f"graded {sorted(graded)}, expected {sorted(halves)}"


def assert_wrong_answers_are_wrong(lab: Path, wrong: dict, auto: dict) -> None:
    """Every automatic test has wrong answers; each replaces a solution cell and differs from it
    and from the other variants (a "wrong" answer equal to the solution tests nothing)."""
    solution = {cells.grade_id(c): c.source for c in nbformat.read(lab, as_version=4).cells}
    assert {test for test, _ in wrong.values()} == set(auto)
    for gid, (_, variants) in wrong.items():
        assert gid in solution, gid
        assert len({v.strip() for v in variants}) == len(variants), gid
        assert all(v.strip() != solution[gid].strip() for v in variants), gid


def assert_student_version_has_stubs(student: Path, stubs: int) -> None:
    """The released lab: ``stubs`` cells that raise NotImplementedError, no solution and no hidden
    test left in it."""
    nb = nbformat.read(student, as_version=4)
    assert sum("NotImplementedError" in c.source for c in nb.cells) == stubs
    assert not any("BEGIN HIDDEN" in c.source or "BEGIN SOLUTION" in c.source for c in nb.cells)


def grade_replays(
    lab: Path,
    student: Path,
    ungraded: tuple,
    notes: Path,
    tmp: Path,
    overrides: dict | None = None,
    limits: Limits | None = None,
) -> dict:
    """The replay attack (tests/replay_attack.py) through the grader: the blank ``student``
    version, every locked function replaced by the ``notes`` the verdict kernel's first pass
    recorded at VERDICT_SEED, handed in twice in one round of the grader's two slots:
    ``replay-same`` graded at VERDICT_SEED (the control), ``replay-other`` at the seed the run
    gives it, as any submission gets. Same cells left out as the verdicts, same profile."""
    from unittest import mock

    folder = tmp / "replay"
    (folder / "lab").mkdir(parents=True), (folder / "student").mkdir()
    lab_copy = trimmed(lab, folder / "lab", ungraded)
    blank = trimmed(student, folder / "student", ungraded)
    replay_attack.same_cell_order(nbformat.read(lab_copy, as_version=4), blank)
    subs = folder / "subs"
    subs.mkdir()
    attack = replay_attack.submission(blank, replay_attack.load_notes(notes))
    for name in (replay_attack.SAME, replay_attack.OTHER):
        nbformat.write(attack, subs / f"{name}.ipynb")
    quick = next(e for e in load_syllabus() if e.path == lab).parameters("quick")
    derive = seeds.for_submission
    given = {}

    def seed_of(run: bytes, name: str, content: str = "") -> int:
        given[name] = VERDICT_SEED if name == replay_attack.SAME else derive(run, name, content)
        return given[name]

    # The grader derives each submission's seed from the run's secret; the control is handed
    # the recording's seed instead, so only the seed differs between the two.
    with mock.patch.object(seeds, "for_submission", seed_of):
        graded = grade(
            lab_copy,
            subs,
            folder / "out",
            jobs=2,
            parameters={**quick, **(overrides or {})},
            progress=False,
            limits=limits or Limits(cell_timeout=120, budget=400),
        )
    assert given.get(replay_attack.OTHER) not in (None, VERDICT_SEED), given
    # whatever it scores, a person is told: each replaced helper is flagged in the gradebook
    with open(folder / "out" / "gradebook.csv", newline="", encoding="utf-8") as f:
        flagged = {row["student"]: row["flags"] for row in csv.DictReader(f)}
    if any(replay_attack.replaced(c) for c in nbformat.read(blank, as_version=4).cells):
        for name in (replay_attack.SAME, replay_attack.OTHER):  # (it binds through globals())
            assert "a person will read it" in flagged[name], (name, flagged[name])
    return graded


def assert_replays_score_nothing(graded: dict, lab: Path, auto: dict) -> None:
    """At another seed the replay earns no automatic point; at the recording's own seed it earns
    every test it could replay faithfully (``replay_attack.replayable_tests``): the control."""
    other, same = graded[replay_attack.OTHER], graded[replay_attack.SAME]
    assert other.status == "graded" and same.status == "graded", (other.reason, same.reason)
    scored = {t: other.scores[t] for t in auto if other.scores[t]}
    assert not scored, f"the replay of another seed's locked returns scores {scored}"
    control = replay_attack.replayable_tests(lab) & set(auto)
    missed = {t: (same.scores[t], same.errors.get(t)) for t in control if same.scores[t] != auto[t]}
    assert not missed, f"the replay at the recording's own seed is not faithful: {missed}"


def verdict_and_replay(
    lab: Path,
    student: Path,
    wrong: dict,
    ungraded: tuple,
    auto: dict,
    overrides: dict | None = None,
    checked: dict | None = None,
):
    """What each lab's test module binds, as ``verdict_run, test_replaying_... = ...``: the
    module fixture ``verdict_run`` (the verdict kernel's run of ``checked``, by default
    ``wrong``, its first pass noting every locked function's returns: (notes, verdicts)) and the
    replay attack graded from those notes (``grade_replays``), which must score nothing."""
    import pytest

    @pytest.fixture(scope="module")
    def verdict_run(tmp_path_factory):
        tmp = tmp_path_factory.mktemp(f"{lab.stem}-verdicts")
        notes = tmp / "replay-notes.pkl"
        run = wrong_answer_verdicts(
            lab, student, checked or wrong, ungraded, tmp, overrides, record=notes
        )
        return notes, run

    @pytest.mark.slow
    @pytest.mark.timeout(1200)  # it may be the first to need the fixture: its kernel runs here
    def test_replaying_the_locked_helpers_of_another_seed_scores_nothing(verdict_run, tmp_path):
        graded = grade_replays(lab, student, ungraded, verdict_run[0], tmp_path, overrides)
        assert_replays_score_nothing(graded, lab, auto)

    return verdict_run, test_replaying_the_locked_helpers_of_another_seed_scores_nothing
