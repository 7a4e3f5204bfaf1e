"""Lab 01's harness: the runs its cells time and the α–β prediction, kept out of the notebook.

``setting`` is the lab's parameters a run needs, a dict the lab's setup builds: the model
(``model_name``, ``in_shape``, ``hidden``, ``depth``), ``lr``, ``device`` ("auto", "cpu" or
"cuda"), ``bucket_cap_mb`` and ``memory_budget``; ``data`` is the training set's (inputs,
labels), handed to each rank with its function. Nothing here is graded: the lab's checks
compute their references in ``helpers.labs.lab01``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from helpers.labs import lab01
from helpers.launcher import world
from helpers.launcher.launch import launch
from helpers.measure import costmodel, findings, scaling, timing
from helpers.measure.bandwidth import fit_alpha_beta
from helpers.measure.comm import CommRecorder
from helpers.measure.memory import memory_limit
from helpers.measure.timing import StepTimer


def make_model(setting: dict):
    """The lab's model, the same initial weights wherever it is built (``lab01.make_model``)."""
    s = setting
    return lab01.make_model(s["model_name"], s["in_shape"], s["hidden"], s["depth"])


def make_optimizer(model, setting: dict):
    return torch.optim.SGD(model.parameters(), lr=setting["lr"], momentum=0.9)


def pick_device(setting: dict):
    from helpers.launcher.world import device

    return device() if setting["device"] == "auto" else torch.device(setting["device"])


# -- part 1: one device ---------------------------------------------------------------------------


def fits_one_device(setting: dict, data, batch_size: int) -> bool:
    """True if two training steps at this batch fit in ``memory_budget`` (a refusal says why)."""
    model = make_model(setting)
    opt, loss_fn = make_optimizer(model, setting), nn.CrossEntropyLoss()
    x_all, y_all = data
    try:
        with memory_limit(setting["memory_budget"], model, opt) as budget:
            for _ in range(2):  # the 2nd step also holds the momentum buffers
                x = x_all[:batch_size].clone()  # a copy: a view would count the whole dataset
                loss = loss_fn(model(x), y_all[:batch_size])
                opt.zero_grad()
                loss.backward()
                opt.step()
                budget.check()
    except torch.OutOfMemoryError as oom:
        print(f"batch {batch_size}: " + str(oom).split(". In use")[0])
        return False
    return True


def _timed_steps(model, opt, data, order, batch_size, steps, timer) -> None:
    """``steps`` steps over ``order``'s batches, each phase marked on ``timer``."""
    loss_fn = nn.CrossEntropyLoss()
    x_all, y_all = data
    for batch in scaling.shard_batches(order, batch_size, steps):
        timer.start()
        x, y = x_all[batch], y_all[batch]
        timer.mark("data")
        loss = loss_fn(model(x), y)
        timer.mark("forward")
        opt.zero_grad()
        loss.backward()
        timer.mark("backward")
        opt.step()
        timer.mark("optimizer")
        timer.stop()


def plain_run(setting: dict, data, batch_size, steps, warmup) -> dict:
    """One device, one process, no DDP, nothing communicated: the baseline T(1) of everything."""
    dev = pick_device(setting)
    model = make_model(setting).to(dev)
    data = tuple(t.to(dev) for t in data)
    timer = StepTimer(dev)
    order = torch.arange(len(data[1]), device=dev)
    _timed_steps(
        model, make_optimizer(model, setting), data, order, batch_size, warmup + steps, timer
    )
    return {"timing": timer.records, "comm": [], "buckets": []}


def ddp_run(setting: dict, data, batch_size, steps, warmup) -> dict:
    """One rank of DDP: its shard (PyTorch's sampler), timed by phase, its all-reduces counted,
    and the bucket sizes of its last step."""
    dev = pick_device(setting)
    model = DDP(make_model(setting).to(dev), bucket_cap_mb=setting["bucket_cap_mb"])
    recorder = CommRecorder().register(model)
    timer = StepTimer(dev, comm=recorder)
    data = tuple(t.to(dev) for t in data)
    sampler = DistributedSampler(range(len(data[1])), num_replicas=dist.get_world_size(),
                                 rank=dist.get_rank(), seed=0)  # fmt: skip
    order = torch.tensor(list(sampler), device=dev)
    _timed_steps(
        model, make_optimizer(model, setting), data, order, batch_size, warmup + steps, timer
    )
    recorder.close()
    buckets = [r["grad_bytes"] for r in recorder.records if r["step"] == recorder.step]
    return {"timing": timer.records, "comm": recorder.per_step(), "buckets": buckets}


def run_config(setting: dict, data, config, steps, warmup, backend) -> list[dict]:
    """One repeat of ``config`` (world size, per-rank batch): one device at world size 1, DDP
    on every rank above it."""
    ws, bs = config
    return launch(plain_run if ws == 1 else ddp_run, setting, data, bs, steps, warmup,
                  world_size=ws, backend=backend, output="none")  # fmt: skip


# -- part 3: the student's average_gradients beside DDP and one process ----------------------------


def train_three_ways(
    average_gradients, setting: dict, data, steps: int = 3, batch: int = 16
) -> dict:
    """On every rank: the lab's model trained from the same start with the student's
    ``average_gradients`` and with DDP, each on this rank's shard of each global batch, and by
    one process on the whole global batch; the three models' parameters."""
    rank, size = dist.get_rank(), dist.get_world_size()
    x_all, y_all = data
    manual, ddp_model, single = make_model(setting), DDP(make_model(setting)), make_model(setting)
    opts = [make_optimizer(m, setting) for m in (manual, ddp_model, single)]
    loss_fn = nn.CrossEntropyLoss()
    for step in range(steps):
        idx = torch.arange(step * batch * size, (step + 1) * batch * size)  # the global batch
        mine = idx[rank::size]  # this rank's shard
        for model, opt in zip((manual, ddp_model), opts, strict=False):
            opt.zero_grad()
            loss_fn(model(x_all[mine]), y_all[mine]).backward()
            if model is manual:
                average_gradients(model)
            opt.step()
        opts[2].zero_grad()
        loss_fn(single(x_all[idx]), y_all[idx]).backward()  # mean over the global batch
        opts[2].step()

    def params(m):
        return [p.detach().clone() for p in m.parameters()]

    return {
        "manual": params(manual),
        "ddp": params(ddp_model.module),
        "one_process": params(single),
    }


def largest_differences(per_rank: list[dict]) -> list[dict]:
    """Per rank: the largest |manual − DDP| and |manual − one process| over all parameters."""

    def diff(a, b):
        return max((p - q).abs().max().item() for p, q in zip(a, b, strict=True))

    return [{"vs_ddp": diff(r["manual"], r["ddp"]), "vs_one_process": diff(r["manual"], r["one_process"])}
            for r in per_rank]  # fmt: skip


# -- part 6: what the α–β model predicts ----------------------------------------------------------


def sweep_ends(bench: list[dict], multi) -> list[str]:
    """The smallest and largest message of the all_reduce sweep at each world size: bytes, time
    and S/t (question 3.2)."""
    lines = []
    for n in multi:
        ends = sorted((r for r in bench if r["world_size"] == n), key=lambda r: r["bytes"])
        mark = " (oversubscribed)" if world.oversubscribed(n) else ""
        for r in (ends[0], ends[-1]):
            lines.append(f"all_reduce, n = {n}{mark}: {r['bytes']:,} bytes in "
                         f"{r['seconds'] * 1e3:.3f} ms, S/t = {r['bytes'] / r['seconds'] / 1e9:.4f} GB/s")  # fmt: skip
    return lines


def _step_medians(runs: dict, config, warmup) -> list[dict]:
    """Rank 0's median step of each repeat of ``config``, by phase."""
    return [timing.median_step(run[0]["timing"], skip=warmup) for run in runs[config]]


def measured_compute(runs: dict, world_sizes, bs, warmup) -> dict:
    """Per world size, the compute of a step at per-rank batch ``bs`` (medians over the repeats):
    backward as measured under DDP, less the communication it exposed."""
    compute = {}
    for ws in world_sizes:
        m = _step_medians(runs, (ws, bs), warmup)

        def med(key, m=m):
            return timing.spread(x.get(key, 0.0) for x in m)["median"]

        compute[ws] = {"forward": med("data") + med("forward"),
                       "backward": med("backward") - med("exposed_comm_s"),
                       "optimizer": med("optimizer")}  # fmt: skip
    return compute


def alpha_beta(bench: list[dict], runs: dict, world_sizes, bs, warmup) -> dict:
    """The α–β fit of each world size's all_reduce sweep, the DDP step it predicts from the
    compute measured there and the buckets (``costmodel.predict_scaling``), and the verdict on
    each fit: unusable below the R² floor, and otherwise whether its prediction falls inside the
    measured steps' range (``findings.fit``). Keys: fits, predicted (every world size),
    measured (each repeat's step, seconds), verdicts."""
    multi = [ws for ws in world_sizes if ws > 1]
    fits = {n: fit_alpha_beta([r["bytes"] for r in bench if r["world_size"] == n],
                              [r["seconds"] for r in bench if r["world_size"] == n], n=n)
            for n in multi}  # fmt: skip
    buckets = runs[(max(world_sizes), bs)][0][0]["buckets"] if multi else []
    compute = measured_compute(runs, world_sizes, bs, warmup)
    predicted = costmodel.predict_scaling(compute, buckets, fits, world_sizes)
    measured = {
        ws: [m["total"] for m in _step_medians(runs, (ws, bs), warmup)] for ws in world_sizes
    }
    verdicts = {}
    for n in multi:
        step = next(p["step"] for p in predicted if p["world_size"] == n)
        mark = " (oversubscribed)" if world.oversubscribed(n) else ""
        verdicts[n] = findings.fit(f"t = a + S/β at n = {n}{mark}", fits[n].r2,
                                   predicted=step, measured=measured[n], unit="s")  # fmt: skip
    return {"fits": fits, "predicted": predicted, "measured": measured, "verdicts": verdicts}


def alpha_beta_rows(result: dict, world_sizes) -> list[dict]:
    """Part 6's table: per world size, the fit's latency term and bandwidth where the fit is
    usable (R² above the floor), its R², the predicted step (none from an unusable fit) and
    the median measured step."""
    fits, verdicts = result["fits"], result["verdicts"]
    measured_ok = {n for n in fits if verdicts[n].verdict != "unusable"}
    rows = []
    for n in world_sizes:
        p = next(p for p in result["predicted"] if p["world_size"] == n)
        shown = n == 1 or n in measured_ok

        def fitted(value, n=n):
            return "—" if n not in fits else value if n in measured_ok else "not measured"

        rows.append({
            "world_size": f"{n} (oversubscribed)" if world.oversubscribed(n) else str(n),
            "latency term 2(n-1)α (µs)": fitted(f"{fits[n].alpha * 1e6:.1f}" if n in fits else None),
            "β algbw (GB/s)": fitted(f"{fits[n].beta / 1e9:.4f}" if n in fits else None),
            "fit R² (log t)": fits[n].r2 if n in fits else None,
            "predicted step (s)": p["step"] if shown else None,
            "measured step (s)": timing.spread(result["measured"][n])["median"],
            "verdict": verdicts[n].verdict if n in verdicts else "—",
            "compute from": p["compute_from"] if shown else "no prediction: fit unusable",
        })  # fmt: skip
    return rows


def plotted(result: dict, world_sizes, oversubscribed: dict, bs) -> tuple[list, list]:
    """(predicted, measured) rows for ``plots.predicted_vs_measured``: no prediction from an
    unusable fit."""
    verdicts = result["verdicts"]
    predicted = [p for p in result["predicted"]
                 if p["world_size"] == 1 or verdicts[p["world_size"]].verdict != "unusable"]  # fmt: skip
    measured = [{"world_size": ws, "step": timing.spread(result["measured"][ws])["median"],
                 "oversubscribed": oversubscribed[(ws, bs)]} for ws in world_sizes]  # fmt: skip
    return predicted, measured
