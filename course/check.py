"""`course check`: regression-check notebooks against their committed outputs with nbval.

Runs ``pytest --nbval-lax`` with the project kernel and course/nbval_sanitize.cfg: cells tagged
``nbval-check-output`` must reproduce their committed output exactly (after sanitizing); every
cell must run without an unexpected error. One more rule nbval lacks (nbval#108): a cell marked
``raises-exception`` (or ``# NBVAL_RAISES_EXCEPTION``) must really raise.

``course check --executed build/`` applies the same rules to the copies `course run` executed
(``compare``), so the main job and the check share one execution of each notebook. It adds
the rule of course/stale.py: a measured number typed in Markdown must be one that run printed
(or a parameter, theory, a citation), so a re-run cannot leave prose contradicting its outputs.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
from nbval.plugin import (
    IPyNbCell,
    coalesce_streams,
    find_comment_markers,
    find_metadata_tags,
    get_sanitize_patterns,
    nocolors,
)

from course.kernel import KERNEL_NAME
from course.stale import typed_measurements
from course.syllabus import REPO, load_syllabus

SANITIZE = Path(__file__).with_name("nbval_sanitize.cfg")


class MustRaise:
    """Fail a nbval cell that is marked to raise but ran without an error."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        options = getattr(item, "options", None)
        if (
            call.when != "call"
            or report.failed
            or not options
            or not options.get("check_exception")
        ):
            return
        outputs = getattr(item, "test_outputs", None) or []
        if not any(o.get("output_type") == "error" for o in outputs):
            report.outcome = "failed"
            report.longrepr = (
                "cell is marked to raise an exception (raises-exception) but raised nothing"
            )


def check(paths: list[str] | None = None, extra: list[str] | None = None) -> int:
    """Run nbval on ``paths`` (default: the lectures and labs of the syllabus, solutions side)."""
    if not paths:
        paths = [str(e.path) for e in load_syllabus()]
    args = [
        "--nbval-lax",
        "--nbval-kernel-name",
        KERNEL_NAME,
        "--nbval-sanitize-with",
        str(SANITIZE),
        "-p",
        "no:cacheprovider",
        "-q",
        *(extra or []),
        *paths,
    ]
    return int(pytest.main(args, plugins=[MustRaise()]))


# -- Checking a notebook that has already run ------------------------------------------------------
# `course run` (papermill) executes the syllabus for the main job; checking its committed outputs
# with nbval would execute every notebook a second time. `compare` applies nbval's own rules to
# an executed copy instead: the same cells (tagged nbval-check-output, or # NBVAL_CHECK_OUTPUT),
# the same sanitizer, nbval's own output comparison, and the must-raise rule above.

# nbval's IPyNbFile.skip_compare without nbdime: keys never compared (images differ run to run)
SKIP_COMPARE = (
    "metadata",
    "traceback",
    "prompt_number",
    "output_type",
    "name",
    "execution_count",
    "application/vnd.jupyter.widget-view+json",
    "image/png",
    "image/jpeg",
)


class _Comparison:
    """Just enough of an nbval cell for nbval's ``compare_outputs`` to run on stored outputs."""

    colors = nocolors
    compare_outputs = IPyNbCell.compare_outputs
    sanitize = IPyNbCell.sanitize

    def __init__(self, patterns: dict):
        self.parent = SimpleNamespace(skip_compare=SKIP_COMPARE, sanitize_patterns=patterns)

    def format_output_compare(self, key, left, right):  # nbval's own asks pytest for a diff
        self.comparison_traceback += [
            f"  mismatch in {key!r}:",
            f"  committed: {left!r}"[:3000],
            f"  this run:  {right!r}"[:3000],
        ]


def _options(cell) -> defaultdict:
    """nbval's options of one cell: tags first, then comment markers (as nbval merges them)."""
    options = defaultdict(bool, find_metadata_tags(cell.metadata))
    options.update(dict(find_comment_markers(cell.source)))
    return options


def compare(
    reference: Path | str, executed: Path | str, parameters: dict | None = None
) -> list[str]:
    """Every way ``executed`` (`course run`'s papermill copy of the notebook ``reference``) breaks
    what nbval checks, one entry per cell, named as nbval names it (``path::Cell N``, code cells
    counted from 0); [] if none. Caught: a run that did not end well (a cell cut at its time
    limit, a dead kernel: `course run` records it), a cell that raised unexpectedly or never
    started (the check ends there, as the run did), a cell marked to raise that did not, a checked
    output that differs from the committed one after sanitizing, a copy that is not a papermill
    run of this code (or, given ``parameters``, was run with others), and a measured number
    typed in Markdown that this run did not print (course/stale.py). Only the
    ``raises-exception`` tag lets a cell raise: papermill stops at a cell marked by comment."""
    import nbformat

    from course.record import normalise

    if not Path(executed).exists():
        return [f"{reference}: no executed copy at {executed} (run it with `course run` first)"]
    ref = nbformat.read(reference, as_version=4)
    run = nbformat.read(executed, as_version=4)
    meta = run.metadata.get("papermill")
    if meta is None:
        return [f"{reference}: {executed} was not executed by `course run` (papermill)"]
    if parameters is not None and meta.get("parameters") != parameters:
        return [f"{reference}: {executed} ran with {meta.get('parameters')}, not {parameters}"]
    problems = []
    ended = run.metadata.get("course_run", {})
    if not ended.get("ok", True):
        problems.append(f"{reference}: its run failed: {ended.get('error') or 'no reason given'}")
    # what papermill recorded of each cell, before normalise drops it
    kept = [c for c in run.cells if "papermill-error-cell-tag" not in c.metadata.get("tags", [])]
    started = [
        c.metadata.get("papermill", {}).get("start_time") is not None
        for c in kept
        if c.cell_type == "code" and "injected-parameters" not in c.metadata.get("tags", [])
    ]
    run.cells = kept
    run = normalise(run)  # the injected parameters cell goes, paths as recorded
    want_cells = [c for c in ref.cells if c.cell_type == "code"]
    got_cells = [c for c in run.cells if c.cell_type == "code"]
    if [c.source for c in want_cells] != [c.source for c in got_cells]:
        return [f"{reference}: {executed} is a run of other code (run the notebook again)"]
    comparison = _Comparison(dict(get_sanitize_patterns(SANITIZE.read_text())))
    for num, (want, got, began) in enumerate(zip(want_cells, got_cells, started, strict=True)):
        where = f"{reference}::Cell {num}"
        options = _options(want)
        errors = [o for o in got.outputs if o.get("output_type") == "error"]
        if not began:
            problems.append(f"{where}: never started (the run stopped before it)")
            break
        if errors and not options["check_exception"]:
            problems.append(f"{where}: raised {errors[0].ename}: {errors[0].evalue}"[:3000])
            break  # papermill stopped here: the cells below never ran
        if options["skip"]:  # nbval would not run it; papermill did, and it ran cleanly
            continue
        if options["check_exception"] and not errors:
            problems.append(
                f"{where}: marked to raise an exception (raises-exception) but raised nothing"
            )
        unrun = want.get("execution_count") is None  # nbval does not compare an unrun reference
        if options["check"] and not unrun:
            if not comparison.compare_outputs(
                coalesce_streams(got.outputs), coalesce_streams(want.outputs)
            ):
                detail = "\n".join(comparison.comparison_traceback)
                problems.append(f"{where}: checked output differs\n{detail}")
    if not problems:  # a broken run's outputs are incomplete: its typed numbers can wait
        problems += [f"{reference}: {typed}" for typed in typed_measurements(run)]
    return problems


def check_executed(build: Path | str, paths: list[str] | None = None) -> int:
    """`course check --executed BUILD`: compare a `course run` output folder (quick profile) with
    the committed notebooks (default: the whole syllabus) without executing anything; 0 if all
    hold."""
    from course.run import output_path, select

    entries = select(load_syllabus(), paths)
    failed = 0
    for entry in entries:
        problems = compare(entry.path, output_path(entry.path, build), entry.parameters("quick"))
        failed += bool(problems)
        print(f"{'FAILED' if problems else 'ok':6}  {entry.path.relative_to(REPO)}")
        for problem in problems:
            print("        " + problem.replace("\n", "\n        "))
    print(f"{len(entries)} notebooks checked against {build}, {failed} failed")
    return int(failed > 0)
