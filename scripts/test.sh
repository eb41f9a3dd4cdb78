#!/usr/bin/env bash
# The whole test suite, from nothing: set up .venv, lint, type-check, run pytest, the
# Mooncake tests in a private network namespace (unshare -n), then the SGLang integration
# tests (tests/integrations/sglang/) in .venv-sglang with the real SGLang (built by
# scripts/sglang_env.sh), the vLLM engine tests (tests/integrations/vllm/) in .venv-vllm
# with the real vLLM (built by scripts/vllm_env.sh), the LMCache engine tests
# (tests/integrations/lmcache/) in .venv-lmcache with the real LMCache (built by
# scripts/lmcache_env.sh), then the vendor smoke (the built wheel in a fresh venv passes
# the kit). The three engine venvs are built in the background while the main tests run;
# their logs are in build/, their sizes and build times in CONTRIBUTING.md.
# Extra arguments go to the main pytest run (e.g. scripts/test.sh -k file -x) and skip the
# engine tests and the smoke. The engine tests alone:
#   bash scripts/sglang_env.sh &&
#   unshare -n bash -c 'ip link set lo up && .venv-sglang/bin/python -m pytest tests/integrations/sglang'
#   bash scripts/vllm_env.sh &&
#   unshare -n bash -c 'ip link set lo up && .venv-vllm/bin/python -m pytest tests/integrations/vllm'
#   bash scripts/lmcache_env.sh &&
#   unshare -n bash -c 'ip link set lo up && .venv-lmcache/bin/python -m pytest tests/integrations/lmcache'
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
if [ $# -eq 0 ]; then
  mkdir -p build
  # (niced: they have the main suite's run time to finish, and the suite has the CPU)
  nice -n 19 bash scripts/sglang_env.sh > build/sglang_env.log 2>&1 &
  sglang_env=$!
  nice -n 19 bash scripts/vllm_env.sh > build/vllm_env.log 2>&1 &
  vllm_env=$!
  nice -n 19 bash scripts/lmcache_env.sh > build/lmcache_env.log 2>&1 &
  lmcache_env=$!
  trap 'kill "$sglang_env" "$vllm_env" "$lmcache_env" 2>/dev/null || true' EXIT
fi
# wait_env PID NAME: wait for a background venv build; on failure show its log and stop.
wait_env() {
  if ! wait "$1"; then
    echo "$2 failed:" >&2
    cat "build/$2.log" >&2
    exit 1
  fi
}
echo "== ruff" >&2
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy" >&2
bash scripts/typecheck.sh
echo "== pytest" >&2
# tests/conftest.py leaves tests/integrations/sglang and tests/integrations/vllm out as well; a path named in
# the arguments is still collected (pytest ignores --ignore for it), and its conftest then
# stops the run.
.venv/bin/python -m pytest --ignore=tests/integrations/sglang --ignore=tests/integrations/vllm "$@"
if [ $# -eq 0 ]; then
  # The Mooncake client binds wildcard addresses: its tests run in a private network
  # namespace, where those binds reach nothing but loopback.
  echo "== mooncake tests (private network namespace)" >&2
  unshare -n bash -c 'ip link set lo up &&
    exec .venv/bin/python -m pytest -p no:cacheprovider tests/backends/test_mooncake.py'
  echo "== integration tests (.venv-sglang)" >&2
  wait_env "$sglang_env" sglang_env
  # (in a private network namespace too: SGLang runs on mooncake there)
  unshare -n bash -c 'ip link set lo up &&
    exec .venv-sglang/bin/python -m pytest -p no:cacheprovider tests/integrations/sglang'
  echo "== vLLM engine tests (.venv-vllm)" >&2
  wait_env "$vllm_env" vllm_env
  # (in a private network namespace too: vLLM runs on mooncake there, and every
  # engine's addresses stay on loopback)
  unshare -n bash -c 'ip link set lo up &&
    exec .venv-vllm/bin/python -m pytest -p no:cacheprovider tests/integrations/vllm'
  echo "== LMCache engine tests (.venv-lmcache)" >&2
  wait_env "$lmcache_env" lmcache_env
  # (in a private network namespace too: the plugin runs on mooncake there)
  unshare -n bash -c 'ip link set lo up &&
    exec .venv-lmcache/bin/python -m pytest -p no:cacheprovider tests/integrations/lmcache'
  echo "== vendor smoke" >&2
  bash scripts/vendor_smoke.sh
fi
