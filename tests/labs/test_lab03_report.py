"""helpers/labs/lab03_runs.py's part 1 and lab03_report.py's tables: what lab 03 shows of a run.

The device's peak (``step_peak``) is held to the checks' own (``helpers.labs.lab03.step_peak``);
the epoch times come from a real launched rank; the part-2 report reads runs shaped as
``fit_image`` returns them (one device out of memory where two fit, a PSNR that agrees or not),
and the part-4 table reads FSDP's real bytes on two gloo ranks. So a report that lost a setup, a
part or a verdict, or a run that stopped timing what it says, fails here.
"""

from __future__ import annotations

import contextlib
import io
import math

import matplotlib
import pytest
import torch

import helpers
from helpers.labs import lab03, lab03_report, lab03_runs
from helpers.launcher.launch import launch
from helpers.measure import findings

matplotlib.use("Agg")

SETUPS = {"one device": (1, None), "DDP": (2, "ddp"), "FSDP": (2, "fsdp")}
CONFIGS = [(2, 8), (2, 16)]  # a grid of depth 2 by widths 8 and 16


@pytest.fixture(scope="module")
def image() -> dict:
    inputs, pixels, size = helpers.data.image("china.jpg", [8, 12])
    return {"inputs": inputs, "pixels": pixels, "size": size, "budget": 10**6, "lr": 0.002}


@pytest.fixture
def family():
    findings.family()  # a family of its own: no other test's comparisons counted here
    yield
    findings.family()


def shown(fn, *args):
    """What ``fn(*args)`` returns, and what it printed (IPython's display prints, outside one)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = fn(*args)
    return result, out.getvalue()


def test_the_device_peaks_where_the_checks_device_does_and_refuses_a_batch_past_the_image(image):
    for batch in (1, 7, 64, 96):
        assert lab03_runs.step_peak(batch, image, 2, 8) == lab03.step_peak(batch, 2, 8), batch
    fits = lab03.step_peak(64, 2, 8)
    assert lab03_runs.step_peak(64, image, 2, 8, fits) == fits
    peak, printed = shown(lab03_runs.step_peak, 64, image, 2, 8, fits - 1)
    assert peak is None and printed.startswith("batch 64: ")
    for batch in (0, 97):  # 8 × 12 pixels
        with pytest.raises(ValueError, match="the image has 96"):
            lab03_runs.step_peak(batch, image, 2, 8)


@pytest.mark.slow
def test_the_epochs_are_timed_in_a_rank_each_size_every_round_but_the_first(image):
    times = launch(lab03_runs.epoch_times, image, 2, 8, [16, 96], 2, world_size=1,
                   backend="gloo", output="none")[0]  # fmt: skip
    assert list(times) == [16, 96] and all(len(t) == 2 and min(t) > 0 for t in times.values())
    by_batch = lab03_report.epoch_table(times, 96)
    assert list(by_batch["steps"]) == [6, 1]
    assert list(by_batch["median"]) == [(t[0] + t[1]) / 2 for t in times.values()]
    assert lab03_report.plot_epochs(by_batch, "1MB", 96).axes[0].get_xscale() == "log"


def test_the_epoch_findings_compare_each_size_with_the_next_and_order_them(family):
    times = {16: [1.0, 1.1, 1.2], 32: [0.6, 0.65, 0.7], 64: [0.6, 0.7, 0.8]}
    by_batch = lab03_report.epoch_table(times, 96)
    _, printed = shown(lab03_report.epoch_findings, times, by_batch)
    assert printed.count("batch 16 → 32: epoch-time ratio 0.59") == 1
    assert printed.count("batch 32 → 64: epoch-time ratio 1.08") == 1
    assert printed.count("epoch time") >= 3  # two comparisons and the order
    assert len(findings.current().comparisons) == 2 + 3  # 2 compared, 3 pairs ordered


def run(psnr=30.0, seconds=(0.010,) * 10, peak=400_000) -> dict:
    parts = {"parameters": peak // 8, "gradients": peak // 8, "optimizer_state": peak // 4}
    parts.update(activations=peak - sum(parts.values()), total=peak)
    return {"psnr": psnr, "seconds": list(seconds), "peak": parts, "image": torch.zeros(8, 12, 3)}


def fits(psnr_fsdp=30.0) -> dict:
    """The big model out of memory on one device and under DDP, fitting under FSDP."""
    oom = {"peak": run(peak=2_000_000)["peak"], "oom": True}
    return {"one device": {CONFIGS[0]: run(), CONFIGS[1]: oom},
            "DDP": {CONFIGS[0]: run(seconds=(0.02,) * 10, peak=300_000), CONFIGS[1]: oom},
            "FSDP": {CONFIGS[0]: run(psnr=psnr_fsdp, peak=200_000), CONFIGS[1]: run(peak=900_000)}}  # fmt: skip


def test_the_report_of_the_fits_names_what_ran_out_and_judges_the_step_times(family):
    ran = fits()
    _, printed = shown(lab03_report.two_devices, ran, SETUPS, CONFIGS)
    assert (
        "Out of memory: one device: 2×16; DDP, 2 devices: 2×16; FSDP, 2 devices: none." in printed
    )
    assert "DDP, 2 devices, total at the peak / one device's: 0.75 (2×8) to 1.00 (2×16)" in printed
    assert "Step time, DDP against one device, 1 configurations: slower in 1" in printed
    table = lab03_report.by_part(ran, SETUPS, CONFIGS, "1MB")
    assert table.loc[(2, 16, "FSDP"), "total"] == 0.9 and table.loc[(2, 16, "FSDP"), "fits 1MB"]
    assert not table.loc[(2, 16, "DDP"), "fits 1MB"]
    fig = lab03_report.heatmaps(ran, SETUPS, [2], [8, 16], "1MB", 12, helpers.plots.heatmap)
    assert len(fig.axes) >= 9  # quality, time, memory for each of 3 setups (and their colour bars)
    assert (
        len(
            lab03_report.show_images(
                ran, CONFIGS, {"pixels": torch.zeros(96, 3), "size": (8, 12)}
            ).axes
        )
        == 3
    )


def test_the_results_refuse_a_psnr_that_differs_between_one_device_and_several():
    _, printed = shown(lab03_report.fit_results, fits(), SETUPS, CONFIGS)
    assert "between one device and FSDP, 2 devices where both ran: 0.0e+00 dB" in printed
    with (
        pytest.raises(AssertionError, match="the same image"),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        lab03_report.fit_results(fits(psnr_fsdp=30.5), SETUPS, CONFIGS)


@pytest.mark.slow
def test_the_state_table_shows_each_ranks_bytes_and_checks_fsdps_padding():
    model = {"depth": 2, "width": 8, "lr": 0.002}
    ddp, fsdp = (launch(lab03_runs.measured_state, stage, None, model, world_size=2, backend="gloo",
                        output="none") for stage in (0, 3))  # fmt: skip
    predicted = {stage: lab03.bytes_reference(lab03.coordinate_params(2, 8), 2, stage, 2)
                 for stage in range(4)}  # fmt: skip
    table = lab03_report.state_table(predicted, {0: ddp, 3: fsdp}, 2, 8)
    assert len(table) == 12 and list(table.columns[-2:]) == ["rank 0", "rank 1"]
    stage0 = table[table["stage"] == table["stage"].iloc[0]]
    assert list(stage0["rank 0"]) == list(stage0["predicted"])  # DDP keeps what stage 0 predicts
    assert table["rank 0"].isna().sum() == 6  # stages 1 and 2 not measured here
    wrong = [{**m, "gradients": m["gradients"] + 4} for m in fsdp]
    with pytest.raises(AssertionError):
        lab03_report.state_table(predicted, {0: ddp, 3: wrong}, 2, 8)
    assert math.isclose(table["predicted"].iloc[0], 4 * lab03.coordinate_params(2, 8))
