#!/usr/bin/env bash
# The two commands a new user runs (see README.md):
#   bash scripts/dev.sh demo   - a 3-node elastic job on an embedded etcd, one node killed, recovery shown
#   bash scripts/dev.sh test   - flake8 and mypy (setup.cfg), then the whole test suite
# Each first makes .venv (once) with the CPU build of torch and elastic-rt installed editable.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import torch, elastic_rt, pytest, s3fs, moto, mypy, flake8, lightning, accelerate, prometheus_client" 2>/dev/null; then
    "$venv/bin/pip" install --quiet --upgrade pip
    # The CPU build of torch; a plain "torch" would pull gigabytes of CUDA.
    "$venv/bin/pip" install --quiet torch==2.13.0
    "$venv/bin/pip" install --quiet -e ".[test]"
fi

case "${1:-}" in
    demo)
        shift
        exec "$venv/bin/python" scripts/demo.py "$@"
        ;;
    test)
        shift
        # Lint first, with setup.cfg's settings; any finding fails the run.
        "$venv/bin/python" -m flake8 elastic_rt agents tests scripts
        "$venv/bin/python" -m mypy
        # pytest's exit 5 means "no tests collected" (a filter matched none): not a failure.
        status=0
        "$venv/bin/python" -m pytest -q "$@" || status=$?
        if [ "$status" -eq 5 ]; then
            status=0
        fi
        exit "$status"
        ;;
    *)
        echo "usage: bash scripts/dev.sh demo|test [args]" >&2
        exit 2
        ;;
esac
