"""The ``course`` command: parses arguments and calls the plain functions of this package."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="course", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    k = sub.add_parser("kernel", help="register this environment as the Jupyter kernel")
    k.add_argument("--user", action="store_true", help="register for every Jupyter of this user")
    k.add_argument("--quiet", action="store_true")

    r = sub.add_parser("run", help="execute notebooks headless into build/ with an HTML index")
    r.add_argument("notebooks", nargs="*", help="notebooks to run (default: the whole syllabus)")
    r.add_argument("--profile", default="quick", choices=("quick", "full"))
    r.add_argument("--out", default=None, help="output folder (default: build/)")

    args = parser.parse_args(argv)
    if args.command == "kernel":
        from course.kernel import install_kernel

        install_kernel(user=args.user, quiet=args.quiet)
        return 0
    if args.command == "run":
        from course.run import REPO, run_notebooks, summary

        results = run_notebooks(args.notebooks, args.profile, args.out or REPO / "build")
        print(summary(results))
        print(f"index: {(args.out or REPO / 'build')}/index.html", file=sys.stderr)
        return 0 if all(r.ok for r in results) else 1
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
