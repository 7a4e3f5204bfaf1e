"""`python -m course.hub` (what scripts/hub.sh runs): start, stop, adduser, deluser, cores.

Only parses arguments and calls course.hub's functions (docs/hub.md says what each does).
"""

from __future__ import annotations

import argparse
import getpass
import sys
from pathlib import Path

from course.hub import accounts, cores, server


def _password(args) -> str:
    if args.password_file:
        return Path(args.password_file).read_text().strip()
    if sys.stdin.isatty():
        first = getpass.getpass(f"password for {args.name}: ")
        if first != getpass.getpass("again: "):
            raise SystemExit("hub: the two passwords differ; nothing changed")
        return first
    return sys.stdin.readline().strip()  # `echo PASSWORD | hub.sh adduser NAME`


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hub.sh", description="The course's JupyterHub.")
    p.add_argument("--state", type=Path, default=server.DEFAULT_STATE, help="the hub's folder")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("start", help="start the hub in the background")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--ip", default="", help="address to listen on (default: all)")
    sub.add_parser("stop", help="stop the hub, every student's server, and remove its cgroups")
    a = sub.add_parser("adduser", help="add a local student (password from stdin or a prompt)")
    a.add_argument("name")
    a.add_argument("--password-file", help="read the password from this file")
    a.add_argument("--group", default=accounts.DEFAULT_GROUP)
    d = sub.add_parser("deluser", help="delete a local student and their home")
    d.add_argument("name")
    sub.add_parser("cores", help="the cores a student needs: the largest world of each lab")
    args = p.parse_args(argv)
    try:
        if args.command == "start":
            info = server.start(args.state, port=args.port, ip=args.ip)
            print(f"hub running at {info['url']} (pid {info['pid']}); log: {info['log']}")
        elif args.command == "stop":
            server.stop(args.state)
            print("hub stopped; its servers, proxy and cgroups are gone")
        elif args.command == "adduser":
            home = accounts.add_student(args.name, _password(args), args.group)
            print(f"added {args.name} (home {home}, group {args.group})")
        elif args.command == "deluser":
            accounts.remove_student(args.name)
            print(f"removed {args.name}")
        elif args.command == "cores":
            print(cores.report())
    except (OSError, RuntimeError, ValueError) as e:
        print(f"hub: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
