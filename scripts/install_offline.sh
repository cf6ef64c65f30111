#!/usr/bin/env bash
# Install sweeper on a GPU node that reaches no package registry, from a wheelhouse built on a connected machine by
# scripts/wheelhouse.py (issue 44). The node's own torch (and Transformer Engine) must be installed already: they are
# not in the wheelhouse and are never replaced.
#
#   scripts/install_offline.sh WHEELHOUSE      # PYTHON=... picks the interpreter (default: python)
set -euo pipefail
WHEELHOUSE=${1:?usage: scripts/install_offline.sh WHEELHOUSE}
PY=${PYTHON:-python}
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "install_offline: torch is not installed for $PY; install the node's torch first (the wheelhouse leaves it out)" >&2
    exit 2
fi
"$PY" -m pip install --disable-pip-version-check --no-index --find-links "$WHEELHOUSE" sweeper
"$PY" -c "import sweeper.cli, megatron.core, ray, optuna, mlflow; print('install_offline: sweeper imports offline')"
