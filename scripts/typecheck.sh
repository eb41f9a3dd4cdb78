#!/usr/bin/env bash
# mypy over the package as it is installed: hicache_storage with backends/ and conformance/
# mapped into it, the way setuptools' package-dir maps them. Two passes, in the same tree:
# the package (strict), then tests/ against that package (the relaxed settings of the
# tests' [[tool.mypy.overrides]] in pyproject.toml). The second pass reuses the first's
# cache for the package's modules.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=build/typecheck/hicache_storage
rm -rf build/typecheck
mkdir -p "$tree"
for f in hicache_storage/*; do ln -s "$PWD/$f" "$tree/$(basename "$f")"; done
ln -s "$PWD/backends" "$tree/backends"
ln -s "$PWD/conformance" "$tree/conformance"
ln -s "$PWD/tests" build/typecheck/tests
cd build/typecheck
mypy=(../../.venv/bin/mypy --config-file ../../pyproject.toml)
"${mypy[@]}" -p hicache_storage
"${mypy[@]}" tests
