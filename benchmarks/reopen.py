"""Start-up of a ``file`` or ``shm`` store of many objects, from its scan snapshot.

A store with ``max_size`` must know every object it holds to account its capacity. The
first instance scans; its ``close()`` leaves a scan snapshot, and later instances start
from that. This fills one store per backend with ``--objects`` objects of
``--object-bytes`` (``batch_set`` of 128 at a time; minutes for a million), opens it once
with a full scan, then ``--opens`` times from the snapshot, and prints each time and,
for the last open, where the time went (a profile of the opening call, top entries).

    .venv/bin/python benchmarks/reopen.py [--objects 1000000] [--backends file,shm]
        [--dir /tmp] [--opens 3]

The ``shm`` store lives in /dev/shm whatever ``--dir`` says (it is a tmpfs store).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from hicache_storage import HiCacheStorage, KVCacheNamespace, StorageConfig
from hicache_storage.backends import FileBackend, ShmBackend


def opener(backend: str, root: str) -> Callable[[], HiCacheStorage]:
    cfg = StorageConfig(
        namespace=KVCacheNamespace(model_id="reopen", dtype="uint8", page_size=4, tenant="t")
    )
    if backend == "file":
        return lambda: FileBackend(cfg, root=root, max_size="64GiB")
    return lambda: ShmBackend(cfg, root=root, max_size="64GiB")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--objects", type=int, default=1_000_000)
    p.add_argument("--object-bytes", type=int, default=512)
    p.add_argument("--backends", default="file,shm")
    p.add_argument("--dir", default="/tmp")
    p.add_argument("--opens", type=int, default=3)
    args = p.parse_args()
    values = [torch.full((args.object_bytes,), i % 251, dtype=torch.uint8) for i in range(128)]
    for backend in args.backends.split(","):
        base = "/dev/shm" if backend == "shm" else args.dir
        root = tempfile.mkdtemp(prefix=f"reopen-{backend}-", dir=base)
        try:
            make = opener(backend, root)
            store = make()
            t0 = time.perf_counter()
            for _ in range(args.objects // 128):
                keys = [secrets.token_hex(32) for _ in range(128)]
                assert all(store.batch_set(keys, values))
            fill = time.perf_counter() - t0
            store.close()
            time.sleep(1.2)  # the fan-out directories are quiet: the snapshot may list them
            t0 = time.perf_counter()
            store = make()
            scan = time.perf_counter() - t0
            objects = store.usage()["objects"]
            t0 = time.perf_counter()
            store.close()
            close = time.perf_counter() - t0
            print(f"{backend}: {objects} objects, fill {args.objects / fill:.0f} objects/s, "
                  f"open with a full scan {scan:.3f} s, close {close:.3f} s")  # fmt: skip
            assert objects == args.objects // 128 * 128
            for i in range(args.opens):
                profile = cProfile.Profile() if i == args.opens - 1 else None
                t0 = time.perf_counter()
                store = profile.runcall(make) if profile is not None else make()
                took = time.perf_counter() - t0
                assert store.usage()["objects"] == objects
                store.close()
                print(
                    f"  open from the snapshot: {took:.3f} s" + (" (profiled)" if profile else "")
                )
            if profile is not None:
                out = io.StringIO()
                pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(8)
                lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
                start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
                print("  where the profiled open went (tottime, top entries):")
                for ln in lines[start : start + 9]:
                    print("   ", ln.replace(os.getcwd() + "/", ""))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
