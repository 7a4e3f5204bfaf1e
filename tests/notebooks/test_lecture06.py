"""Lecture 06 as committed: the FLOP count of a step equal to torch's counter (nbval-checked),
the bytes DDP sent equal to the gradient's, every comparison printed by findings (the instrument
checked against itself), the slowest rank taken, a sweep's points each recorded, and the
exercise's answer collapsed.

(It runs under papermill and nbval with the whole syllabus in test_course_run and test_check;
busbw's factor and the findings rules are tested in tests/measure.)
"""

from __future__ import annotations

import nbformat
from recorded import outputs

from course.syllabus import REPO

PATH = REPO / "lectures" / "06_measuring.ipynb"


def _nb():
    return nbformat.read(PATH, as_version=4)


def test_lecture06_checks_only_what_is_exact():
    code = [c for c in _nb().cells if c.cell_type == "code"]
    checked = [c for c in code if "nbval-check-output" in c.metadata.get("tags", [])]
    assert checked and all("FlopCounterMode" in c.source for c in checked)
    assert not any("perf_counter" in c.source for c in checked)  # timings are never checked
    hidden = [c for c in code if c.metadata.get("jupyter", {}).get("source_hidden")]
    assert len(hidden) == 1  # the exercise's answer, collapsed


def test_lecture06_figures_stand_beside_their_theory():
    out = outputs(_nb())
    assert "equal to the count: True" in out  # 6ΨB less the first layer's input gradient
    assert "parameters: True)" in out  # bytes per step = 4 x parameters
    assert "busbw factor for all_reduce on 2 ranks: 1" in out
    assert "Lehr's rule" in out and "coefficient of variation" in out
    assert "slowest rank exceeded rank 0's own time" in out


def test_lecture06_prints_its_comparisons_from_the_data():
    out = outputs(_nb())
    # the instrument checked against itself, and each comparison a findings sentence
    assert "**A** and **A again**" in out or "**A again**" in out
    assert "(step time, strong scaling)" in out and "(step time, weak scaling)" in out
    assert "steps of one launch each" in out  # a sweep point is one launch: no verdict
    assert "squeezenet_1.ipynb" in out and "squeezenet_2.ipynb" in out
    assert "IPKernelApp" not in out  # the child kernels' chatter stays out of the lecture
