#!/usr/bin/env bash
# The main job on the embedded default backend (file): set up .venv with what the job
# needs (torch and the package; no system packages), then replay the tiered-cache
# workload (a multi-turn trace through device and host pools and L3 on the file
# backend), checking every page that comes back from any tier byte for byte.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh main
exec "${HICACHE_VENV:-.venv}/bin/hicache-storage" run \
  --hicache-storage-backend file \
  --hicache-storage-backend-extra-config '{"root": ".hicache-work/file"}' "$@"
