#!/usr/bin/env bash
# The whole test suite, from nothing: set up .venv, lint, type-check, run pytest, then
# the vendor smoke (the built wheel in a fresh venv passes the kit, about 15 s).
# Extra arguments go to pytest (e.g. scripts/test.sh -k file -x) and skip the smoke.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
echo "== ruff" >&2
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy" >&2
bash scripts/typecheck.sh
echo "== pytest" >&2
.venv/bin/python -m pytest "$@"
if [ $# -eq 0 ]; then
  echo "== vendor smoke" >&2
  bash scripts/vendor_smoke.sh
fi
