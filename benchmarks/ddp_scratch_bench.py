"""DDP written by hand (Lab 02's ScratchDDP, taken from the solution notebook) against PyTorch's DDP.

Side by side in one run, on the same ranks, model, batches and bucket size: torch DDP (its C++
reducer), ScratchDDP (Python hooks, buckets by DDP's rule, asynchronous all-reduces), and
ScratchDDP with its hooks switched off, so that every bucket is sent after backward (what
overlap buys). Configurations are interleaved over the repeats; a step lasts as long as its
slower rank; each run's figure is the median of its timed steps. Prints a table and writes
build/benchmarks/ddp_scratch.{md,json}.

    .venv/bin/python benchmarks/ddp_scratch_bench.py [--repeats 5] [--steps 20] [--batch 256]

The solution stays in solutions/ (students cannot import it from helpers); this script reads
it from there, so it needs the instructor's checkout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SOLUTION = REPO / "solutions" / "lab02_build_ddp.ipynb"
IMPLS = ("torch DDP", "ScratchDDP", "ScratchDDP, no overlap")


def scratch_source() -> str:
    """The solution's ScratchDDP cell, as module source."""
    import nbformat

    nb = nbformat.read(SOLUTION, as_version=4)
    cell = next(
        c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "scratch_ddp"
    )
    header = "import torch\nimport torch.distributed as dist\nfrom torch import nn\n\n"
    return header + "\n".join(
        line
        for line in cell.source.splitlines()
        if "### BEGIN" not in line and "### END" not in line
    )


def run(
    impl: str,
    source: str,
    hidden: int,
    depth: int,
    batch: int,
    cap_mb: float,
    steps: int,
    warmup: int,
):
    """One rank: ``steps`` timed DDP steps (after ``warmup``) of ``impl``; its StepTimer records."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import helpers
    from helpers.parallel.dataparallel import AsyncRecorder

    namespace: dict = {}
    exec(compile(source, str(SOLUTION), "exec"), namespace)  # the solution's class, in this rank
    scratch = namespace["ScratchDDP"]
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    module = helpers.models.mlp(hidden=hidden, depth=depth)
    if impl == "torch DDP":
        model = DDP(module, bucket_cap_mb=cap_mb)
        recorder = helpers.CommRecorder().register(model)
    else:
        if impl.endswith("no overlap"):

            class NoOverlap(scratch):
                def _ready(self, p):  # the hooks do nothing: every bucket is sent by finish()
                    pass

            scratch = NoOverlap
        recorder = AsyncRecorder()
        model = scratch(module, bucket_cap_mb=cap_mb)
    timer = helpers.StepTimer(comm=recorder)
    opt, loss_fn = (
        torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9),
        nn.CrossEntropyLoss(),
    )
    x_all, y_all = helpers.data.load("digits").tensors
    for k in range(warmup + steps):
        idx = torch.randint(len(y_all), (n * batch,), generator=torch.Generator().manual_seed(k))
        x, y = x_all[idx].chunk(n)[rank], y_all[idx].chunk(n)[rank]
        timer.start()
        loss = loss_fn(model(x), y)
        timer.mark("forward")
        opt.zero_grad()
        loss.backward()
        if impl != "torch DDP":
            model.finish()
        timer.mark("backward")
        opt.step()
        timer.mark("optimizer")
        timer.stop()
    recorder.close()
    return timer.records[warmup:]


def main(argv=None) -> int:
    import helpers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=256, help="per rank")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--bucket-cap-mb", type=float, default=1.0)
    ap.add_argument("--world-size", type=int, default=2)
    args = ap.parse_args(argv)

    source = scratch_source()
    conf = (args.hidden, args.depth, args.batch, args.bucket_cap_mb, args.steps, args.warmup)
    runs = helpers.scaling.interleave(
        IMPLS,
        lambda impl: helpers.launch(
            run, impl, source, *conf, world_size=args.world_size, output="none"
        ),
        repeats=args.repeats,
    )
    over = helpers.world.oversubscribed(args.world_size)
    rows = []
    for impl in IMPLS:
        per_repeat = [helpers.scaling.step_seconds(r) for r in runs[impl]]
        s = helpers.timing.spread(per_repeat)
        rows.append(
            {
                "implementation": impl,
                "median_ms": 1e3 * s["median"],
                "min_ms": 1e3 * s["min"],
                "max_ms": 1e3 * s["max"],
                "buckets": len(runs[impl][0][0][-1].get("buckets", [])),
            }
        )
    base = rows[0]["median_ms"]
    head = (
        f"{args.world_size} ranks{' (OVERSUBSCRIBED)' if over else ''}, MLP {args.hidden}x{args.depth}, "
        f"batch {args.batch} per rank, bucket_cap_mb {args.bucket_cap_mb}, {args.steps} timed steps, "
        f"{args.repeats} interleaved repeats"
    )
    lines = [
        head,
        "",
        "| implementation | step, median (ms) | min–max of repeats (ms) | × torch DDP | buckets |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['implementation']} | {r['median_ms']:.2f} | {r['min_ms']:.2f}–{r['max_ms']:.2f} | "
            f"{r['median_ms'] / base:.2f} | {r['buckets']} |"
        )
    text = "\n".join(lines)
    print(text)
    out = REPO / "build" / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    (out / "ddp_scratch.md").write_text(text + "\n")
    (out / "ddp_scratch.json").write_text(
        json.dumps({"config": vars(args), "rows": rows}, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
