#!/usr/bin/env bash
# The whole test suite, from nothing: set up .venv, lint, type-check, run pytest, the
# Mooncake tests in a private network namespace (unshare -n), then the integration tests
# (tests/integrations/) in .venv-sglang with the real SGLang (built by
# scripts/sglang_env.sh, about 50 s and 2.3 GB the first time), then the vendor smoke (the
# built wheel in a fresh venv passes the kit, about 15 s).
# Extra arguments go to the main pytest run (e.g. scripts/test.sh -k file -x) and skip the
# integration tests and the smoke. The integration tests alone:
#   bash scripts/sglang_env.sh &&
#   unshare -n bash -c 'ip link set lo up && .venv-sglang/bin/python -m pytest tests/integrations'
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
echo "== ruff" >&2
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy" >&2
bash scripts/typecheck.sh
echo "== pytest" >&2
# tests/conftest.py leaves tests/integrations out as well; a path named in the arguments
# is still collected (pytest ignores --ignore for it), and its conftest then stops the run.
.venv/bin/python -m pytest --ignore=tests/integrations "$@"
if [ $# -eq 0 ]; then
  # The Mooncake client binds wildcard addresses: its tests run in a private network
  # namespace, where those binds reach nothing but loopback.
  echo "== mooncake tests (private network namespace)" >&2
  unshare -n bash -c 'ip link set lo up &&
    exec .venv/bin/python -m pytest -p no:cacheprovider tests/backends/test_mooncake.py'
  echo "== integration tests (.venv-sglang)" >&2
  bash scripts/sglang_env.sh
  # (in a private network namespace too: SGLang runs on mooncake there)
  unshare -n bash -c 'ip link set lo up &&
    exec .venv-sglang/bin/python -m pytest -p no:cacheprovider tests/integrations'
  echo "== vendor smoke" >&2
  bash scripts/vendor_smoke.sh
fi
