#!/usr/bin/env bash
# Set up this checkout from nothing, idempotently:
#   1. create .venv if it is missing (Python >= 3.10),
#   2. (re)install the project and its pinned dependencies when pyproject.toml changed,
#   3. register the Jupyter kernel "multigpu-course" inside .venv (papermill and nbval use it),
#   4. install JupyterHub's proxy (configurable-http-proxy, npm) into .venv/node for scripts/hub.sh.
# Re-running it on a set-up machine takes about a second.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi

# The stamp names the pyproject it was installed from, so editing dependencies triggers a reinstall.
stamp=".venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    echo "setup: installing the course into .venv (torch from the local mirror takes about a minute)"
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e ".[dev,hub]"
    rm -f .venv/.installed-*
    touch "$stamp"
fi

# jupyter-events asks for jsonschema[format-nongpl], which brings rfc3987-syntax: importing it
# compiles 38 lark grammars, 1.3 s of CPU in every process that imports nbformat or jsonschema
# (each grader, each sandboxed submission's runner, each papermill run, the notebook server):
# grading one more toy submission took 3.0 s with it and 1.6 s without. jsonschema imports it
# only where it is installed; without it the `iri` string formats go unchecked, which no schema
# here uses.
if compgen -G ".venv/lib/python3*/site-packages/rfc3987_syntax" >/dev/null; then
    .venv/bin/python -m pip uninstall --quiet --yes rfc3987-syntax
fi

.venv/bin/python -m course kernel --quiet

# Debian packages: chromium for the browser test (Playwright's own browser download is not
# used), bubblewrap for `course grade` (it builds each submission's file view), acl for
# scripts/hub.sh (students' servers run .venv's Python: where it sits below a folder they may not
# enter, such as /root, the hub grants its students' group just the right to pass through).
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
command -v setfacl >/dev/null 2>&1 || missing+=(acl)
# Debian's slurm-wlm and munge for scripts/cluster.sh (course/cluster/): a two-node Slurm cluster
# on this machine, on which tests/cluster runs the Slurm scripts. Only as root, and only when the
# cluster is asked for (scripts/cluster.sh, COURSE_CLUSTER_TESTS=1): the default suite does not
# run it, and a student's machine needs neither.
if [ "$(id -u)" -eq 0 ] && [ -n "${COURSE_CLUSTER_TESTS:-}${COURSE_SETUP_CLUSTER:-}" ]; then
    command -v slurmd >/dev/null 2>&1 || [ -x /usr/sbin/slurmd ] || missing+=(slurm-wlm)
    command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ] || missing+=(munge)
fi
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing Debian's ${missing[*]}"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 || {
        $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${missing[@]}"
    }
fi

# JupyterHub routes every request through configurable-http-proxy, a Node program that pip does
# not carry. It goes into .venv/node (not npm's global prefix): a checkout's hub uses its own
# pinned proxy, nothing outside the checkout changes, and deleting .venv removes it. The version
# check keeps a re-run on a set-up machine to one `node` call, not an npm install.
CHP_VERSION=5.3.0
chp=.venv/node/node_modules/configurable-http-proxy/package.json
if ! command -v npm >/dev/null 2>&1; then
    echo "setup: no npm: scripts/hub.sh needs Node's npm to install configurable-http-proxy" >&2
elif [ ! -f "$chp" ] || [ "$(node -p "require('./$chp').version" 2>/dev/null)" != "$CHP_VERSION" ]; then
    echo "setup: installing configurable-http-proxy $CHP_VERSION into .venv/node (npm)"
    npm install --silent --no-audit --no-fund --prefix .venv/node "configurable-http-proxy@$CHP_VERSION"
fi
