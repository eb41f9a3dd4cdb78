#!/usr/bin/env bash
# Vendor smoke: what a vendor gets from `pip install hicache-storage`, checked end to end.
# Builds the wheel, installs it into a fresh virtual environment that cannot see this
# checkout, and runs `hicache-storage conformance` from an empty directory on a built-in
# backend (memory when the wheel registers it, else file). Fails unless the kit passes.
# About 13-21 s here (torch comes from .venv as hard links; with SMOKE_TORCH=pip, 30-75 s).
#
#   bash scripts/vendor_smoke.sh            # memory (or file)
#   SMOKE_BACKEND=shm bash scripts/vendor_smoke.sh
#   KEEP=1 bash scripts/vendor_smoke.sh     # keep the temporary directory
#   VERBOSE=1 bash scripts/vendor_smoke.sh  # show the kit's pytest output
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
start=$SECONDS
bash scripts/bootstrap.sh # .venv builds the wheel (setuptools, no build isolation)

work=$(mktemp -d -t hicache-vendor-smoke.XXXXXX)
cleanup() { if [ -z "${KEEP:-}" ]; then rm -rf "$work"; else echo "vendor smoke: kept $work" >&2; fi; }
trap cleanup EXIT
say() { echo "vendor smoke: $* ($((SECONDS - start)) s)" >&2; }

# 1. The wheel, built the way a release is (no extra downloads), from a copy of the
# files git knows (tracked, or new and not ignored): a build in the tree itself would
# reuse a stale build/lib and ship modules that no longer exist.
mkdir -p "$work/src"
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  [ -e "$f" ] && printf '%s\0' "$f"
done | tar --null -T - -cf - | tar -xf - -C "$work/src"
.venv/bin/pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation \
  "$work/src" -w "$work/dist" 2> >(grep -v "is ignored" >&2)
wheel=$(ls "$work"/dist/hicache_storage-*.whl)
say "built $(basename "$wheel")"

# 2. A fresh venv on the same interpreter as .venv. It gets .venv's torch (the CPU
# build bootstrap.sh installed from the machine's local wheel) and torch's own
# dependencies as hard links: the same files pip would unpack, in a few seconds instead
# of 25-60 s. Hard links are safe here: pip and Python replace or unlink files, never
# write into them, so nothing done in the smoke venv reaches .venv. Where linking fails
# (another file system) or with SMOKE_TORCH=pip, pip installs pinned torch instead,
# which takes the local CPU wheel and never a multi-GB CUDA build. pip then installs the
# wheel with its declared dependencies, and pytest beside it: the kit runs on pytest,
# which the package does not depend on (a vendor has it; `conformance` needs it).
base=$(.venv/bin/python -c 'import sys; print(sys._base_executable)')
"$base" -m venv "$work/venv"
site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
pip_q=("$work/venv/bin/pip" install --quiet --disable-pip-version-check -c "$repo/constraints.txt")
link_torch() {
  .venv/bin/python - "$site" <<'EOF'
import importlib.metadata as md
import os
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

dest = Path(sys.argv[1])
# What the new venv already has (pip, setuptools) stays its own.
seen = {canonicalize_name(d.metadata["Name"]) for d in md.distributions(path=[str(dest)])}
todo = ["torch"]
try:
    while todo:
        dist = md.distribution(todo.pop())
        name = canonicalize_name(dist.metadata["Name"])
        if name in seen:
            continue
        seen.add(name)
        todo += [
            r.name
            for r in map(Requirement, dist.requires or [])
            if r.marker is None or r.marker.evaluate({"extra": ""})
        ]
        for f in dist.files or []:
            src = Path(str(f.locate()))
            if f.parts[0] == ".." or not src.is_file():
                continue  # console scripts outside site-packages are not needed
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            os.link(src, dest / f)
except OSError as exc:
    sys.exit(f"vendor smoke: cannot link torch from .venv ({exc}); pip installs it")
EOF
}
if [ "${SMOKE_TORCH:-link}" = pip ] || ! link_torch; then
  rm -rf "$work/venv"
  "$base" -m venv "$work/venv"
  "${pip_q[@]}" torch==2.13.0 2> >(grep -v "is ignored" >&2)
fi
"${pip_q[@]}" "$wheel" pytest 2> >(grep -v "is ignored" >&2)
say "installed the wheel into a fresh venv"

# 3. From an empty directory, with nothing of this checkout or its environment in reach.
mkdir "$work/empty"
cd "$work/empty"
run() {
  env -u PYTHONPATH -u HICACHE_STORAGE_BACKEND -u HICACHE_STORAGE_BACKEND_EXTRA_CONFIG "$@"
}
where=$(run "$work/venv/bin/python" -c \
  'import hicache_storage, torch; print(hicache_storage.__file__, torch.__version__)')
case "$where" in
  "$work/venv/"*"+cpu") ;;
  *) echo "vendor smoke: wrong install (want the venv's copy and a CPU torch): $where" >&2; exit 1 ;;
esac
backends=$(run "$work/venv/bin/hicache-storage" backends)
backend=${SMOKE_BACKEND:-}
if [ -z "$backend" ]; then
  if grep -q '^memory ' <<<"$backends"; then backend=memory; else backend=file; fi
fi
case "$backend" in
  file | shm) options=(--hicache-storage-backend-extra-config "{\"root\": \"$work/store\"}") ;;
  mmap) options=(--hicache-storage-backend-extra-config "{\"path\": \"$work/store/arena\"}") ;;
  *) options=() ;;
esac
say "running the conformance kit on '$backend'"
# The kit's own pytest output goes to a log, shown on failure (or with VERBOSE=1), so
# that in scripts/test.sh the suite's pytest summary stays the last one printed.
if ! run "$work/venv/bin/hicache-storage" conformance --hicache-storage-backend "$backend" \
  "${options[@]}" --report "$work/report.json" >"$work/kit.log" 2>&1; then
  cat "$work/kit.log" >&2
  echo "vendor smoke: the conformance kit failed on '$backend'" >&2
  exit 1
fi
if [ -n "${VERBOSE:-}" ]; then cat "$work/kit.log" >&2; fi

# 4. The report agrees: something passed, nothing failed.
"$work/venv/bin/python" - "$work/report.json" <<'EOF'
import json, sys

summary = json.load(open(sys.argv[1]))["summary"]
if summary.get("failed", 1) != 0 or summary.get("passed", 0) == 0:
    sys.exit(f"vendor smoke: the report says {summary}")
print(f"vendor smoke: the report has {summary['passed']} checks passed and none failed,"
      f" {summary.get('not-claimed', 0)} not claimed", file=sys.stderr)
EOF
ls "$work/empty" | grep -q . && { echo "vendor smoke: the run wrote into its directory" >&2; exit 1; }
say "passed"
