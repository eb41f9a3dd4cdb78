"""Per-key and per-object costs as the store grows: 10k, 100k, 1M objects, one run.

Each backend is filled in steps up to every size in ``--sizes`` (the same store, grown);
at each size, on keys drawn at random from those stored:

* ``exists``: microseconds per key of ``batch_exists(128)``, beside the store's raw
  lookup of the same objects (``os.lstat`` of the backend's own files for ``file`` and
  ``shm``; a ``dict`` membership test over as many keys for ``mmap`` and ``memory``);
* ``get``: microseconds per object of ``batch_get(128)`` into preallocated targets,
  beside (``file``, ``shm``) a raw ``open`` + ``readinto`` of the same files;
* ``set``: objects per second of the fill up to this size (``batch_set`` of 128 new
  keys at a time);
* ``reopen``: seconds to build a second instance on the same store (``file`` and
  ``shm`` with ``max_size`` set, so capacity accounting has to know every object): a
  full scan; then the seconds its ``close()`` takes (it leaves a scan snapshot) and,
  for ``file`` and ``shm``, those of a third instance starting from that snapshot.

After the largest size, ``clear`` is timed (seconds until the call returns).

    .venv/bin/python benchmarks/scale.py [--sizes 10000,100000,1000000]
        [--backends file,shm,mmap,memory] [--object-bytes 512] [--json out.json]
        [--png out.png]

The PNG (cost per key against store size, log scale) needs matplotlib
(``pip install matplotlib``); without it the figures are still printed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from hicache_storage import HiCacheStorage, KVCacheNamespace, StorageConfig
from hicache_storage.backends import FileBackend, MemoryBackend, MmapBackend, ShmBackend

BATCH = 128
# The tmpfs directory of this run's shm stores and mmap arenas (removed at the end).
SHM_BASE = ["/dev/shm"]


def make(name: str, where: str, n_max: int, nbytes: int, tenant: str) -> HiCacheStorage:
    ns = KVCacheNamespace(model_id="scale", dtype="uint8", page_size=4, tenant=tenant)
    cfg = StorageConfig(namespace=ns)
    big = f"{4 * (n_max + 4 * BATCH) * (nbytes + 4096) >> 20}MiB"  # never evicts
    if name == "file":
        return FileBackend(cfg, root=os.path.join(where, "file"), max_size=big)
    if name == "shm":
        return ShmBackend(cfg, root=os.path.join(SHM_BASE[0], "shm-" + tenant), max_size=big)
    if name == "mmap":
        slots = f"{(n_max + 4 * BATCH) * 4096 * 5 // 4 >> 20}MiB"
        return MmapBackend(cfg, path=os.path.join(SHM_BASE[0], "arena-" + tenant),
                           max_size=slots, slot_size="4KiB", prefault=False)  # fmt: skip
    return MemoryBackend(cfg, store="scale-" + tenant)


def median_us(fn: Callable[[], Any], calls: int, per: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / per * 1e6


def measure(
    name: str,
    b: HiCacheStorage,
    sample: list[str],
    keys: list[str],
    targets: list[torch.Tensor],
    calls: int,
) -> dict[str, float]:
    """The exists and get costs at the current size, and their raw baselines."""
    assert b.batch_exists(sample) == BATCH
    point = {"exists_us_per_key": median_us(lambda: b.batch_exists(sample), calls, BATCH)}

    def get_all() -> None:
        got = b.batch_get(sample, targets)
        if any(g is None for g in got):
            raise RuntimeError(f"{name}: a get missed")

    point["get_us_per_object"] = median_us(get_all, calls, BATCH)
    if name in ("file", "shm"):
        paths = [b._path(b.object_name(k)) for k in sample]  # type: ignore[attr-defined]
        lstat = os.lstat
        point["raw_exists_us_per_key"] = median_us(lambda: [lstat(p) for p in paths], calls, BATCH)
        views = [memoryview(t.numpy()) for t in targets]

        def raw_get() -> None:
            for p, v in zip(paths, views, strict=True):
                with open(p, "rb", buffering=0) as f:
                    f.seek(48)
                    f.readinto(v)

        point["raw_get_us_per_object"] = median_us(raw_get, calls, BATCH)
    else:
        index = dict.fromkeys(keys)
        point["raw_exists_us_per_key"] = median_us(
            lambda: [k in index for k in sample], calls, BATCH
        )
    return point


def run_backend(name: str, args: argparse.Namespace, where: str) -> dict[str, Any]:
    sizes = sorted(int(s) for s in args.sizes.split(","))
    tenant = secrets.token_hex(4)
    b = make(name, where, sizes[-1], args.object_bytes, tenant)
    value = [torch.full((args.object_bytes,), 7, dtype=torch.uint8)] * BATCH
    targets = [torch.empty(args.object_bytes, dtype=torch.uint8) for _ in range(BATCH)]
    rng = random.Random(1)
    keys: list[str] = []
    out: dict[str, Any] = {"backend": name, "points": []}
    for n in sizes:
        t0 = time.perf_counter()
        while len(keys) < n:
            new = [secrets.token_hex(32) for _ in range(min(BATCH, n - len(keys)))]
            if not all(b.batch_set(new, value[: len(new)])):
                raise RuntimeError(f"{name}: a set failed at {len(keys)} objects")
            keys.extend(new)
        fill = time.perf_counter() - t0
        point: dict[str, Any] = {
            "objects": n,
            "set_objects_per_s": (n - (out["points"][-1]["objects"] if out["points"] else 0))
            / fill,
        }
        sample = rng.sample(keys, BATCH)
        point.update(measure(name, b, sample, keys, targets, args.calls))
        if name != "memory":
            # A second instance on the same store: the first open scans (the directories
            # are quiet after a second), its close() leaves a snapshot, and the next open
            # starts from it (file, shm; mmap reads its index log).
            time.sleep(1.2)
            t0 = time.perf_counter()
            again = make(name, where, sizes[-1], args.object_bytes, tenant)
            point["reopen_s"] = time.perf_counter() - t0
            assert again.batch_exists(sample) == BATCH
            t0 = time.perf_counter()
            again.close()
            point["close_s"] = time.perf_counter() - t0
            if name in ("file", "shm"):
                t0 = time.perf_counter()
                again = make(name, where, sizes[-1], args.object_bytes, tenant)
                point["reopen_snapshot_s"] = time.perf_counter() - t0
                assert again.batch_exists(sample) == BATCH
                again.close()
        out["points"].append(point)
        print(f"  {name:6s} {n:>9,d} objects: exists {point['exists_us_per_key']:6.2f} us/key "
              f"(raw {point['raw_exists_us_per_key']:5.2f}), get {point['get_us_per_object']:6.2f} "
              f"us/object" + (f" (raw {point['raw_get_us_per_object']:5.2f})" if "raw_get_us_per_object" in point else "")
              + f", fill {point['set_objects_per_s']:8.0f} objects/s"
              + (f", reopen {point['reopen_s']:.3f} s" if "reopen_s" in point else "")
              + (f" (close {point['close_s']:.3f} s, from the snapshot {point['reopen_snapshot_s']:.3f} s)"
                 if "reopen_snapshot_s" in point else ""),
              flush=True)  # fmt: skip
    t0 = time.perf_counter()
    b.clear()
    out["clear_s"] = time.perf_counter() - t0
    assert b.batch_exists(keys[:BATCH]) == 0
    print(f"  {name:6s} clear() of {len(keys):,d} objects returned in {out['clear_s']:.3f} s")
    b.close()
    return out


def plot(results: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no PNG written: matplotlib is not installed (pip install matplotlib)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        xs = [p["objects"] for p in r["points"]]
        (line,) = axes[0].plot(
            xs, [p["exists_us_per_key"] for p in r["points"]], marker="o", label=r["backend"]
        )
        axes[0].plot(xs, [p["raw_exists_us_per_key"] for p in r["points"]], ls=":",
                     marker=".", color=line.get_color(), label=f"{r['backend']} raw")  # fmt: skip
        (line,) = axes[1].plot(
            xs, [p["get_us_per_object"] for p in r["points"]], marker="o", label=r["backend"]
        )
        if any("raw_get_us_per_object" in p for p in r["points"]):
            axes[1].plot(xs, [p["raw_get_us_per_object"] for p in r["points"]], ls=":",
                         marker=".", color=line.get_color(), label=f"{r['backend']} raw")  # fmt: skip
    for ax, title in zip(
        axes, ("batch_exists(128): us per key", "batch_get(128): us per object"), strict=True
    ):
        ax.set_xscale("log")
        ax.set_xlabel("objects in the store")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10000,100000,1000000")
    p.add_argument("--backends", default="file,shm,mmap,memory")
    p.add_argument("--object-bytes", type=int, default=512)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--dir", default="/tmp")
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    p.add_argument("--replot", default=None, help="only draw --png from this --json file")
    args = p.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f)["results"], args.png or "scale.png")
        return 0
    gc.freeze()  # the fill makes millions of objects: keep full collections out of timings
    where = tempfile.mkdtemp(prefix="hicache-scale-", dir=args.dir)
    SHM_BASE[0] = tempfile.mkdtemp(prefix="hicache-scale-", dir="/dev/shm")
    results = []
    try:
        for name in args.backends.split(","):
            print(f"{name}: filling to {args.sizes} objects of {args.object_bytes} B", flush=True)
            results.append(run_backend(name, args, where))
            gc.collect()
    finally:
        shutil.rmtree(where, ignore_errors=True)
        shutil.rmtree(SHM_BASE[0], ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"object_bytes": args.object_bytes, "results": results}, f, indent=1)
    if args.png:
        plot(results, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
