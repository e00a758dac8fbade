#!/usr/bin/env bash
# Creates or reuses .venv and installs the package with every extra, idempotently.
# A CUDA torch already importable by the chosen python is kept (venv sees system site-packages);
# otherwise the CPU build torch==2.13.0 is pinned so no CUDA wheels are pulled.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.installed
inputs_hash=$(cat setup.cfg constraints.txt tools/bootstrap_venv.sh | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$inputs_hash" ]; then
  exit 0
fi
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "[bootstrap] keeping the CUDA torch of $PY"
  [ -d "$VENV" ] || "$PY" -m venv --system-site-packages "$VENV"
  constraint=$(mktemp); "$PY" -c "import torch; print('torch==' + torch.__version__)" > "$constraint"
else
  [ -d "$VENV" ] || "$PY" -m venv "$VENV"
  constraint=constraints.txt
  "$VENV/bin/pip" install -q -c "$constraint" torch==2.13.0
fi
"$VENV/bin/pip" install -q --upgrade pip setuptools wheel >/dev/null
"$VENV/bin/pip" install -q -c "$constraint" -e ".[video,data,dev]"
echo "$inputs_hash" > "$STAMP"
echo "[bootstrap] environment ready in $VENV"
