"""`course check`: regression-check notebooks against their committed outputs with nbval.

Runs ``pytest --nbval-lax`` with the project kernel and course/nbval_sanitize.cfg: cells tagged
``nbval-check-output`` must reproduce their committed output exactly (after sanitizing); every
cell must run without an unexpected error. One more rule nbval lacks (nbval#108): a cell marked
``raises-exception`` (or ``# NBVAL_RAISES_EXCEPTION``) must really raise.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from course.kernel import KERNEL_NAME
from course.syllabus import load_syllabus

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
