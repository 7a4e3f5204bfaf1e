"""Lecture 05 as committed: its exact checks tagged for nbval (the curvature bound on a quadratic,
the momentum correction, the loss normalised by the global batch), the data-parallel noise
estimate beside the per-example one, the critical-batch fit judged by findings, BatchNorm's
reduced statistics equal to one process's, and the exercise's answer collapsed.

(It runs under papermill and nbval with the whole syllabus in test_course_run and test_check;
the estimators and the sharpness are tested against theory in tests/optimisation.)
"""

from __future__ import annotations

import nbformat
from recorded import outputs

from course.syllabus import REPO

PATH = REPO / "lectures" / "05_large_batch.ipynb"


def _nb():
    return nbformat.read(PATH, as_version=4)


def test_lecture05_checks_its_exact_results_with_nbval_and_never_a_timing():
    code = [c for c in _nb().cells if c.cell_type == "code"]
    checked = [c for c in code if "nbval-check-output" in c.metadata.get("tags", [])]
    assert len(checked) >= 4
    assert not any("perf_counter" in c.source or "launch(norms" in c.source for c in checked)
    hidden = [c for c in code if c.metadata.get("jupyter", {}).get("source_hidden")]
    assert len(hidden) == 1  # the exercise's answer, collapsed


def test_lecture05_shows_the_bounds_and_the_equalities_it_claims():
    out = outputs(_nb())
    # the curvature bound, on both sides, with and without momentum
    assert out.count("(converging)") == 2 and out.count("(diverging)") == 2
    assert "PyTorch SGD equals the corrected form: True" in out
    assert "PyTorch SGD equals the uncorrected form: False" in out
    assert "each rank's own mean" in out and ": equals one process on all 8 samples: False" in out
    assert ": equals one process on all 8 samples: True" in out
    assert out.count("one process's BatchNorm on all 16: True") == 2  # both ranks


def test_lecture05_measures_the_noise_scale_two_ways_and_fits_the_critical_batch():
    out = outputs(_nb())
    assert "data parallel: 2 ranks x" in out and "per-example gradients, all" in out
    assert "the per-example value" in out and "that range" in out
    assert "S = S_min (1 + B_crit / B)" in out and "R² =" in out
    assert "B_simple at the last checkpoint / B_crit" in out
    assert "time to the target loss on one core" in out  # a findings sentence, not typed


def test_plots_critical_batch_draws_the_points_their_seeds_range_and_the_model():
    import matplotlib

    matplotlib.use("Agg")
    import numpy as np

    from helpers import plots
    from helpers.optimisation import noise_scale as ns

    batches, steps = [8, 16, 32, 64], [150.0, 100.0, 75.0, 62.5]  # S = 50 (1 + 16 / B)
    fit = ns.fit_steps(batches, steps)
    left, right = plots.critical_batch(
        batches, steps, fit, lo=[140, 90, 70, 60], hi=[160, 105, 80, 65]
    )
    points = left.containers[0]  # the errorbar: the medians, with bars from lo to hi
    x, y = points.lines[0].get_data()
    assert list(x) == batches and list(y) == steps
    segments = points.lines[2][0].get_segments()
    assert [tuple(s[:, 1]) for s in segments] == [(140, 160), (90, 105), (70, 80), (60, 65)]
    curve = next(line for line in left.lines if line.get_label().startswith("S_min (1"))
    gx, gy = curve.get_data()
    assert np.allclose(gy, 50 * (1 + 16 / gx))
    _, ey = right.containers[0].lines[0].get_data()
    assert list(ey) == [b * s for b, s in zip(batches, steps, strict=True)]  # samples E = B S


def test_plots_sharpness_draws_the_bound_of_its_rate_and_momentum():
    import matplotlib

    matplotlib.use("Agg")
    from helpers import plots

    ax = plots.sharpness([0, 10, 20], [0.5, 3.0, 2.0], [2.3, 1.0, 0.5], lr=0.5, momentum=0.9)
    bound = next(line for line in ax.lines if "2(1+μ)/lr" in line.get_label())
    assert set(bound.get_ydata()) == {2 * 1.9 / 0.5}
    assert list(ax.lines[0].get_ydata()) == [0.5, 3.0, 2.0]
