#!/usr/bin/env bash
# The main job: set up if needed, then execute the whole course headless (CPU, gloo, offline data,
# the "quick" profile) and write executed notebooks plus an HTML index into build/.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m course run --profile "${PROFILE:-quick}" "$@"
