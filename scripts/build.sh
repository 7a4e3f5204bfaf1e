#!/usr/bin/env bash
# The main job: set up if needed, execute the whole course headless (CPU, gloo, offline data,
# the "quick" profile) into build/ (executed notebooks and an HTML index), then make the book of
# that run, build/site/index.html (`course site`: nothing is executed again). A notebook that
# fails still gets its page, and the job still exits non-zero for it.
# Launch links on the book's pages: set COURSE_REPOSITORY (and COURSE_HUB_URL), docs/instructors.md.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
status=0
.venv/bin/python -m course run --profile "${PROFILE:-quick}" "$@" || status=$?
.venv/bin/python -m course site || status=$?
exit "$status"
