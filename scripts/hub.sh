#!/usr/bin/env bash
# The course's JupyterHub on this machine (docs/hub.md), as root:
#   scripts/hub.sh adduser NAME        a local student with a password (asked, or from stdin)
#   scripts/hub.sh start [--port P]    the hub in the background; students log in at :P
#   scripts/hub.sh stop                the hub, every student's server and their cgroups, gone
#   scripts/hub.sh deluser NAME | cores
# --state DIR before the command picks the hub's folder (default /var/lib/multigpu-course-hub).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >&2  # quick when set up: the proxy and jupyterhub come from here
exec .venv/bin/python -m course.hub "$@"
