#!/usr/bin/env bash
# The test suite: set up if needed, lint the packages, then run every test (real processes,
# real kernels, real notebooks). Extra arguments go to pytest.
#
# Three pytest workers, each running whole test files (--dist loadfile: a module's fixtures, such
# as a lab's class grading or the syllabus's one run, are made once). Much of the suite waits: on
# kernels starting, ranks timing out, a budget running out. On 2 cores a third worker fills that
# time: pytest took 29 min 38 s with two, 27 min 06 s with three (vmstat: 98 % busy once tests run).
# `pytest -n 0 ...` (or plain `pytest tests/x.py`) runs in one process, as before.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check helpers course tests benchmarks
.venv/bin/ruff format --check helpers course tests benchmarks
# --no-loadscope-reorder: xdist would otherwise hand out the files with the most tests first,
# not the longest ones (tests/conftest.py LONGEST_FIRST), and the syllabus's one long run would
# start late and finish last.
exec .venv/bin/python -m pytest -n "${PYTEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder \
    --durations=25 "$@"
