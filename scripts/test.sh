#!/usr/bin/env bash
# The test suite: set up if needed, lint the packages, then run every test (real processes,
# real kernels, real notebooks). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check helpers course tests benchmarks
.venv/bin/ruff format --check helpers course tests benchmarks
exec .venv/bin/python -m pytest "$@"
