#!/usr/bin/env bash
# The course's GPU paths on a GPU node, with the node's own python3 (torch, numpy, matplotlib,
# scikit-learn, cloudpickle, pytest; no Jupyter needed): the GPU tests, then every lecture and
# lab solution run headless with its defaults (scripts/run_plain.py), several at a time.
#   scripts/gpu_check.sh [OUT_DIR]      # logs, and logs.tgz of them, land in OUT_DIR
# Not part of CI (CI has no GPU). NOTEBOOK_TIMEOUT (s) bounds each notebook (a hung cell prints
# its stacks shortly before), PARALLEL how many run at once (default: one per 4 cores).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-/tmp/gpu_check}"
mkdir -p "$out/logs"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
    date -u
    nvidia-smi -L
    python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0), 'nccl', torch.cuda.nccl.version())"
} 2>&1 | tee "$out/logs/00_env.log"
timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -o addopts= \
    tests/gpu tests/launcher/test_launch.py -k "gpu" -rs 2>&1 | tee "$out/logs/01_pytest.log"
# Side by side, each worker on cores of its own: the launcher pins rank k to the k-th core a
# notebook inherits, so notebooks sharing all cores pile their ranks onto the first few
# (scripts/run_plain.py says more). Cells tagged needs-jupyter (papermill sweeps) are skipped.
python3 scripts/run_plain.py --logs "$out/logs" --timeout "${NOTEBOOK_TIMEOUT:-300}" \
    ${PARALLEL:+--workers "$PARALLEL"} lectures/*.ipynb solutions/lab*.ipynb |
    tee "$out/logs/02_notebooks.log"
grep -h "^=== .*: \(ok\|FAILED\)" "$out"/logs/*.log
tar czf "$out/logs.tgz" -C "$out" logs
