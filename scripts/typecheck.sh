#!/usr/bin/env bash
# mypy (strict) over the package as it is installed: hicache_storage with backends/ and
# conformance/ mapped into it, the way setuptools' package-dir maps them.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=build/typecheck/hicache_storage
rm -rf build/typecheck
mkdir -p "$tree"
for f in hicache_storage/*; do ln -s "$PWD/$f" "$tree/$(basename "$f")"; done
ln -s "$PWD/backends" "$tree/backends"
ln -s "$PWD/conformance" "$tree/conformance"
cd build/typecheck
../../.venv/bin/mypy --config-file ../../pyproject.toml -p hicache_storage
