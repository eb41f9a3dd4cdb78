#!/usr/bin/env bash
# The main job on the embedded default backend (file): set up .venv, then write, check
# and read back KV pages through the zero-copy v1 path, verifying every byte.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/hicache-storage bench \
  --hicache-storage-backend file \
  --hicache-storage-backend-extra-config '{"root": ".hicache-work/file"}' "$@"
