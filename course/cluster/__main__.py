"""`python -m course.cluster` (what scripts/cluster.sh runs): up, down, status, shape, run.

Only parses arguments and calls course.cluster's functions.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import course.cluster as cluster


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cluster.sh", description="A two-node Slurm cluster here.")
    p.add_argument("--state", type=Path, default=cluster.DEFAULT_STATE, help="its folder")
    sub = p.add_subparsers(dest="command", required=True)
    u = sub.add_parser("up", help="make the namespaces, cgroups and Slurm daemons")
    u.add_argument("--memory-mb", type=int, default=4096, help="memory of each node (MB)")
    sub.add_parser("down", help="tear it all down (also after a failed up)")
    sub.add_parser("status", help="what exists now")
    sh = sub.add_parser("shape", help="limit the link between the nodes (tc tbf), or `off`")
    sh.add_argument("rate", help="Mbit/s each node may send, e.g. 100, or off")
    r = sub.add_parser("run", help="run a command on a node, e.g. `run sbatch job.sh`")
    r.add_argument("--node", default="node1")
    r.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    try:
        if args.command == "up":
            print(cluster.up(args.state, memory_mb=args.memory_mb))
        elif args.command == "down":
            cluster.down(args.state)
            print("cluster down: its processes, cgroups, namespaces and files are gone")
        elif args.command == "shape":
            rate = None if args.rate == "off" else float(args.rate)
            print("\n".join(cluster.shape(rate, args.state)))
        elif args.command == "status":
            print(json.dumps(cluster.status(args.state), indent=1))
        elif args.command == "run":
            cmd = cluster.command(args.cmd, args.node, args.state)
            return subprocess.run(cmd, env=cluster.slurm.environment(args.state)).returncode
    except (OSError, RuntimeError, ValueError) as e:
        print(f"cluster: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
