"""Collective bandwidth on this machine, next to its memory-copy bandwidth.

Sweeps every op of helpers.bench over message sizes at world sizes 2 and 4, fits α-β per op and
world size, and compares the best all_reduce bus bandwidth with the memcpy bandwidth measured
the same way (on one host, every byte a collective moves goes through memory). Prints tables;
writes build/benchmarks/collectives.{md,json,png}.

    .venv/bin/python benchmarks/collectives_bench.py [--max-bytes 16777216] [--budget 40]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import helpers
from helpers.measure.bandwidth import fit_alpha_beta

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-bytes", type=int, default=16 * 2**20)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--budget", type=float, default=40.0, help="seconds of sweeping per world size"
    )
    args = parser.parse_args()

    start = time.perf_counter()
    sizes = helpers.bench.default_sizes(args.max_bytes)
    records = helpers.benchmark_collectives(
        sizes=sizes, world_sizes=args.world_sizes, budget_s=args.budget
    )
    memcpy = helpers.memcpy_bandwidth(sizes)
    helpers.shutdown()

    groups = defaultdict(list)
    for r in records:
        groups[(r["op"], r["world_size"])].append(r)
    fits = {
        k: fit_alpha_beta([r["bytes"] for r in v], [r["seconds"] for r in v], *k)
        for k, v in groups.items()
    }

    lines = [
        "| op | n | α (µs) | β (GB/s) | R² (log t) | best busbw (GB/s) | at size |",
        "|---|---|---|---|---|---|---|",
    ]
    for (op, n), fit in sorted(fits.items()):
        best = max(groups[(op, n)], key=lambda r: r["busbw_GBps"])
        lines.append(
            f"| {op} | {n} | {fit.alpha * 1e6:.1f} | {fit.beta_gbps:.3f} | {fit.r2:.3f} | {best['busbw_GBps']:.3f} | {best['bytes']:,} |"
        )
    best_ar = max((r for r in records if r["op"] == "all_reduce"), key=lambda r: r["busbw_GBps"])
    # Small copies stay in cache and look fast; compare at the size of the best all_reduce.
    mem = next(m for m in memcpy if m["bytes"] >= best_ar["bytes"])
    summary = (
        f"best all_reduce busbw: {best_ar['busbw_GBps']:.3f} GB/s (n={best_ar['world_size']}, "
        f"{best_ar['bytes']:,} bytes); memcpy at that size: {mem['busbw_GBps']:.2f} GB/s "
        f"(best over sizes {max(m['busbw_GBps'] for m in memcpy):.2f}); "
        f"ratio all_reduce busbw / memcpy = {best_ar['busbw_GBps'] / mem['busbw_GBps']:.3f}"
    )
    text = (
        "\n".join(lines) + "\n\n" + summary + f"\n\nwall time {time.perf_counter() - start:.0f} s\n"
    )
    print(text)

    out = REPO / "build" / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    (out / "collectives.md").write_text(text)
    (out / "collectives.json").write_text(
        json.dumps(
            {"records": records, "memcpy": memcpy, "fits": [f.as_dict() for f in fits.values()]},
            indent=1,
        )
    )
    import matplotlib

    matplotlib.use("Agg")
    ax = helpers.plots.busbw([r for r in records if r["op"] == "all_reduce"] + memcpy, fits)
    ax.figure.savefig(out / "collectives.png", dpi=120, bbox_inches="tight")
    print(f"wrote {out}/collectives.{{md,json,png}}")


if __name__ == "__main__":
    main()
