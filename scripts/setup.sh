#!/usr/bin/env bash
# Installs the project and what its tests need, on a fresh machine or a Neuron venv.
# torch: the CPU build 2.13.0 is installed only when no torch is importable; an
# installed torch (for example the one of a Neuron venv) is never replaced.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "setup: no torch found, installing the CPU build torch==2.13.0"
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet -e ".[test]"
