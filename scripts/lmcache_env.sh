#!/usr/bin/env bash
# Set up .venv-lmcache, the virtual environment the LMCache tests (tests/integrations/lmcache/)
# and the LMCache benchmark run in: the real LMCache (lmcache 0.5.6) on the CPU torch wheel,
# this package (editable), pytest, and the redis, s3, mooncake and nixl backends' clients
# and servers. Idempotent: a stamp file records what was installed; a second run with
# nothing changed returns at once. Its size and build time: CONTRIBUTING.md.
#
# lmcache's declared requirements include a CUDA torch, cupy and cuda-python; its engine
# runs on the CPU without them (../shared/reference/lmcache-cpu.md in the project's
# notes; docs/lmcache.md). So torch is installed first (the local CPU wheel), then every
# other package at the exact version in constraints-lmcache.txt with --no-deps (nothing
# to resolve), then this package; `pip check` must then report nothing but lmcache's own
# requirements as missing.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${HICACHE_LMCACHE_VENV:-.venv-lmcache}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  echo "lmcache_env: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi

stamp="$VENV/.hicache-lmcache-env"
want=$(cat pyproject.toml constraints-lmcache.txt scripts/lmcache_env.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  echo "lmcache_env: installing packages into $VENV" >&2
  pip_q=("$VENV/bin/pip" install --quiet --disable-pip-version-check)
  quiet() {
    "$@" 2> >(grep -vE "is ignored|^lmcache [0-9.]+ requires|^ERROR: pip's dependency resolver" >&2)
  }
  quiet "${pip_q[@]}" torch==2.13.0
  quiet "${pip_q[@]}" --no-deps -r constraints-lmcache.txt
  quiet "${pip_q[@]}" --no-deps -e .
  "$VENV/bin/python" - <<'PY'
import sys
import torch
if torch.version.cuda is not None or not torch.__version__.startswith("2.13.0"):
    sys.exit(f"lmcache_env: wrong torch {torch.__version__} (cuda {torch.version.cuda})")
from lmcache.v1.cache_engine import LMCacheEngineBuilder  # noqa: F401  (it imports here)
PY
  broken=$("$VENV/bin/pip" check 2>&1 | grep -vE "^lmcache [0-9.]+ requires " || true)
  if [ -n "$broken" ] && [ "$broken" != "No broken requirements found." ]; then
    echo "lmcache_env: broken requirements in $VENV:" >&2
    echo "$broken" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi
