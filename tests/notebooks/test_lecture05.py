"""Lecture 05 as committed: its exact checks tagged for nbval (the curvature bound on a quadratic,
the momentum correction, the loss normalised by the global batch), the data-parallel noise
estimate beside the per-example one, the critical-batch fit judged by findings, BatchNorm's
reduced statistics equal to one process's, and the exercise's answer collapsed.

(It runs under papermill and nbval with the whole syllabus in test_course_run and test_check;
the estimators and the sharpness are tested against theory in tests/parallel.)
"""

from __future__ import annotations

import nbformat

from course.syllabus import REPO

PATH = REPO / "lectures" / "05_large_batch.ipynb"


def _nb():
    return nbformat.read(PATH, as_version=4)


def _outputs(nb) -> str:
    return "\n".join(
        str(o.get("data", {}).get("text/plain", ""))
        + str(o.get("data", {}).get("text/markdown", ""))
        + str(o.get("text", ""))
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
    )


def test_lecture05_checks_its_exact_results_with_nbval_and_never_a_timing():
    code = [c for c in _nb().cells if c.cell_type == "code"]
    checked = [c for c in code if "nbval-check-output" in c.metadata.get("tags", [])]
    assert len(checked) >= 4
    assert not any("perf_counter" in c.source or "launch(norms" in c.source for c in checked)
    hidden = [c for c in code if c.metadata.get("jupyter", {}).get("source_hidden")]
    assert len(hidden) == 1  # the exercise's answer, collapsed


def test_lecture05_shows_the_bounds_and_the_equalities_it_claims():
    out = _outputs(_nb())
    # the curvature bound, on both sides, with and without momentum
    assert out.count("(converging)") == 2 and out.count("(diverging)") == 2
    assert "PyTorch SGD equals the corrected form: True" in out
    assert "PyTorch SGD equals the uncorrected form: False" in out
    assert "each rank's own mean" in out and ": equals one process on all 8 samples: False" in out
    assert ": equals one process on all 8 samples: True" in out
    assert out.count("one process's BatchNorm on all 16: True") == 2  # both ranks


def test_lecture05_measures_the_noise_scale_two_ways_and_fits_the_critical_batch():
    out = _outputs(_nb())
    assert "data parallel: 2 ranks x" in out and "per-example gradients, all" in out
    assert "the per-example value" in out and "that range" in out
    assert "S = S_min (1 + B_crit / B)" in out and "R² =" in out
    assert "B_simple at the last checkpoint / B_crit" in out
    assert "time to the target loss on one core" in out  # a findings sentence, not typed
