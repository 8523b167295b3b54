#!/usr/bin/env bash
# Create .venv in the repository root (once) and install k31c into it, editable, with pytest.
# Safe to run again: it returns at once when nothing it depends on has changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
TRITON_VERSION=3.7.1  # the Triton that torch 2.13.0 pins (its CPU wheel pins none)

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi

# Reinstall only when the requirements (this script or pyproject.toml) changed since the last run.
stamp=.venv/.k31c-setup
want=$(cat scripts/setup.sh pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c "import k31c" 2>/dev/null; then
    exit 0
fi

# torch first and pinned: pip then takes the local CPU wheel where the machine has one
# (pip's find-links); a plain `torch` requirement would pull the multi-GB CUDA build from PyPI.
.venv/bin/python -m pip install --quiet "torch==${TORCH_VERSION}" "triton==${TRITON_VERSION}"
.venv/bin/python -m pip install --quiet -e ".[test]"
echo "$want" > "$stamp"
