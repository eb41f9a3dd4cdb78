#!/usr/bin/env bash
# mypy over the package as it is installed: hicache_storage with backends/ and conformance/
# mapped into it, the way setuptools' package-dir maps them. Two passes, in the same tree:
# the package (strict), then tests/ against that package (the relaxed settings of the
# tests' [[tool.mypy.overrides]] in pyproject.toml). The second pass reuses the first's
# cache for the package's modules.
set -euo pipefail
cd "$(dirname "$0")/.."
# (TYPECHECK_DIR=build/NAME: another tree, for checks that run side by side)
top=${TYPECHECK_DIR:-build/typecheck}
tree=$top/hicache_storage
rm -rf "$top"
mkdir -p "$tree"
for f in hicache_storage/*; do ln -s "$PWD/$f" "$tree/$(basename "$f")"; done
ln -s "$PWD/backends" "$tree/backends"
ln -s "$PWD/conformance" "$tree/conformance"
ln -s "$PWD/tests" "$top/tests"
cd "$top"
mypy=(../../.venv/bin/mypy --config-file ../../pyproject.toml)
"${mypy[@]}" -p hicache_storage
"${mypy[@]}" tests
