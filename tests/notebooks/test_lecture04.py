"""Lecture 04 as committed: its deterministic cells tagged for nbval, the measured bubble beside
theory, tensor parallelism equal to one device, PyTorch's pipelining and tensor-parallel blocks
shown; and the plots it introduces (plots.pipeline, plots.strategies, plots.mesh) drawing what
they are given.

(It runs under papermill and nbval with the whole syllabus in test_course_run and test_check.)
"""

from __future__ import annotations

import matplotlib
import nbformat
import pytest
from recorded import outputs as recorded_outputs

from course.syllabus import REPO
from helpers import plots
from helpers.parallel import pipeline as pp

matplotlib.use("Agg")

PATH = REPO / "lectures" / "04_model_pipeline_tensor.ipynb"


def test_lecture04_checks_its_figures_with_nbval():
    code = [c for c in nbformat.read(PATH, as_version=4).cells if c.cell_type == "code"]
    checked = [c for c in code if "nbval-check-output" in c.metadata.get("tags", [])]
    # equal-to-one-process checks, bytes sent, schedules, formulas, in-flight counts, TP/DP bytes,
    # torch's pipelining and tensor parallel, the mesh, the exercise: deterministic
    assert len(checked) >= 10
    assert not any("measured (median)" in c.source for c in checked)  # timings are never checked
    hidden = [c for c in code if c.metadata.get("jupyter", {}).get("source_hidden")]
    assert len(hidden) == 1  # the exercise's answer, collapsed


def test_lecture04_measures_the_bubble_against_theory():
    outputs = recorded_outputs(nbformat.read(PATH, as_version=4))
    assert "theory (p-1)/(m+p-1)" in outputs and "measured (median)" in outputs
    assert "min" in outputs and "max" in outputs
    assert "idle share = (p-1)/(m+p-1) at all 18 settings: True" in outputs  # the simulation


def test_lecture04_shows_tensor_parallelism_equal_to_one_device_and_its_bytes():
    outputs = recorded_outputs(nbformat.read(PATH, as_version=4))
    assert outputs.count("output and gradients equal the dense MLP's: True") == 2  # both ranks
    assert "forward [('all_reduce', 32768)], backward [('all_reduce', 32768)]" in outputs
    assert "TP all-reduce bytes" in outputs and "DP all-reduce bytes" in outputs


def test_lecture04_shows_pytorchs_building_blocks():
    nb = nbformat.read(PATH, as_version=4)
    text = "\n".join(c.source for c in nb.cells)
    for name in (
        "PipelineStage",
        "ScheduleGPipe",
        "Schedule1F1B",
        "pipeline(",
        "parallelize_module",
        "ColwiseParallel",
        "RowwiseParallel",
        "init_device_mesh",
        "widgets.interactive",
    ):
        assert name in text, name
    outputs = recorded_outputs(nb)
    assert "PipelineStage + ScheduleGPipe: 4 micro-batch losses" in outputs
    assert "pipeline() + Schedule1F1B: 4 micro-batch losses" in outputs
    assert (
        outputs.count(
            "output and gradients equal helpers.tensor_parallel's (to float32 rounding): True"
        )
        == 2
    )
    assert "tp group [0, 1], dp group [0, 2]" in outputs  # the live 2 x 2 mesh


@pytest.mark.parametrize("kind,p,m", [("gpipe", 2, 1), ("1f1b", 3, 4), ("gpipe", 4, 8)])
def test_plots_pipeline_draws_one_box_per_event_and_the_idle_rows(kind, p, m):
    events = pp.simulate(pp.orders(kind, p, m))
    ax = plots.pipeline(events, title=kind, unit="forward passes")
    boxes = [b for b in ax.patches if b.get_gid() == "event"]
    idle = [b for b in ax.patches if b.get_gid() == "idle"]
    assert len(boxes) == len(events) and len(idle) == p
    for box, e in zip(boxes, events, strict=True):  # drawn in order, where the event says
        assert box.get_x() == pytest.approx(e["start"]) and box.get_width() == pytest.approx(
            e["end"] - e["start"]
        )
        assert box.get_y() + box.get_height() / 2 == pytest.approx(e["rank"])
    colors = {
        op: {tuple(b.get_facecolor()) for b, e in zip(boxes, events, strict=True) if e["op"] == op}
        for op in "FB"
    }
    assert (
        len(colors["F"]) == len(colors["B"]) == 1 and colors["F"] != colors["B"]
    )  # one colour each
    assert f"idle {pp.bubble_fraction(p, m):.0%}" in ax.get_title()
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"rank {r}" for r in range(p)]
    matplotlib.pyplot.close(ax.figure)


def test_plots_pipeline_takes_a_live_time_axis():
    events = [
        {**e, "start": 5 + e["start"] / 100, "end": 5 + e["end"] / 100}
        for e in pp.simulate(pp.orders("1f1b", 2, 3))
    ]
    ax = plots.pipeline(events)
    assert ax.get_xlim()[0] == pytest.approx(5.0)  # starts at the first event, not at zero
    assert ax.get_xlabel() == "time (s)"
    assert sum(t.get_text() in {"F0", "B2"} for t in ax.texts) == 4  # each box labelled
    matplotlib.pyplot.close(ax.figure)


def test_plots_strategies_draws_the_four_panels():
    axes = plots.strategies()
    assert [ax.get_title() for ax in axes] == [
        "Data parallel",
        "Model parallel (naive)",
        "Pipeline parallel",
        "Tensor parallel",
    ]
    for ax in axes:
        texts = " ".join(t.get_text() for t in ax.texts)
        assert "rank 0" in texts and "rank 1" in texts
    assert "micro-batch" in " ".join(t.get_text() for t in axes[2].texts)
    matplotlib.pyplot.close(axes[0].figure)


@pytest.mark.parametrize(
    "shape,names", [((2, 2), ("dp", "tp")), ((2, 2, 2), ("pp", "dp", "tp")), ((2, 4), ("dp", "tp"))]
)
def test_plots_mesh_numbers_the_ranks_as_init_device_mesh(shape, names):
    ax = plots.mesh(shape, names)
    n = 1
    for s in shape:
        n *= s
    assert sum(p.get_gid() == "rank" for p in ax.patches) == n
    ranks = sorted(
        int(t.get_text().split()[1]) for t in ax.texts if t.get_text().startswith("rank ")
    )
    assert ranks == list(range(n))
    assert str(shape) in ax.get_title()
    matplotlib.pyplot.close(ax.figure)
    with pytest.raises(ValueError, match="2 or 3 dimensions"):
        plots.mesh((4,), ("dp",))
