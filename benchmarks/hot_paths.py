"""Per-key and per-object costs on the hot paths, beside the raw loops, in one run.

Two parts, each a median over ``--reps`` repetitions (contenders alternate order):

* **batch_exists(128)** of stored keys (the prefetch path asks about every page of a
  prompt): ``mmap`` (index in memory), ``memory``, ``shm`` and ``file``, against the raw
  lookups: a ``dict`` membership loop over the same keys (for the in-memory indexes) and
  an ``os.stat`` loop over 128 files named by key in one directory (for the file stores).
  Reported in microseconds per key; "SDK per key" is the backend's time minus the raw
  lookup's (what validation, naming and the guard add).
* **batch_exists(128) of keys this instance never named** (a new prompt's pages: a
  process that did not store them, or asks about them for the first time): ``mmap`` and
  ``file``, two cases: all 128 stored by another instance ("cold hits"), and the first
  key not stored ("cold, first misses", the usual answer for a new prompt). Each call uses
  keys it has not seen before; microseconds per call.
* **batch_set of 4 KiB objects** (small pages: page_size 1-16, MLA, per-layer objects),
  128 new keys per batch through the tensor path: ``file``, ``shm``, ``mmap`` and
  ``memory``, against a raw temp + write + link loop in one directory (what an atomic
  file store must at least do per object). Reported in objects per second.

    .venv/bin/python benchmarks/hot_paths.py [--reps 7] [--dir /tmp] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
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

N = 128
SMALL = 4096


SHM_DIRS: list[str] = []  # the shm stores' directories, removed at the end


def namespace() -> KVCacheNamespace:
    return KVCacheNamespace(model_id="hot-paths", dtype="bfloat16", page_size=16,
                            tenant="t" + secrets.token_hex(4))  # fmt: skip


def backends(base: str) -> dict[str, Callable[[], HiCacheStorage]]:
    def cfg() -> StorageConfig:
        return StorageConfig(namespace=namespace())

    def arena() -> str:
        return os.path.join(base, "arena-" + secrets.token_hex(3))

    def shm_dir() -> str:
        path = "/dev/shm/hot-" + secrets.token_hex(4)
        SHM_DIRS.append(path)
        return path

    return {
        "mmap": lambda: MmapBackend(
            cfg(), path=arena(), max_size="256MiB", slot_size="8KiB", prefault=False
        ),
        "memory": lambda: MemoryBackend(cfg(), store="hot-" + secrets.token_hex(4)),
        "shm": lambda: ShmBackend(cfg(), root=shm_dir()),
        "file": lambda: FileBackend(cfg(), root=os.path.join(base, "file-" + secrets.token_hex(3))),
    }


def timed(fn: Callable[[], Any]) -> float:
    gc.disable()
    try:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    finally:
        gc.enable()


def keys_of(n: int) -> list[str]:
    return [secrets.token_hex(32) for _ in range(n)]


def part_exists(base: str, reps: int, loops: int) -> dict[str, float]:
    """Microseconds per key of batch_exists(128) on stored keys, and of the raw lookups."""
    values = [torch.full((SMALL,), i % 251, dtype=torch.uint8) for i in range(N)]
    results: dict[str, list[float]] = {}
    made = {name: make() for name, make in backends(base).items()}
    keys = keys_of(N)
    for name, b in made.items():
        assert all(b.batch_set(keys, values)), name
        assert b.batch_exists(keys) == N, name
    raw_dir = tempfile.mkdtemp(prefix="raw-", dir=base)
    for k in keys:
        with open(os.path.join(raw_dir, k), "wb") as f:
            f.write(b"x" * SMALL)
    index = {k: object() for k in keys}

    def raw_dict() -> None:
        for k in keys:
            if k not in index:
                raise AssertionError

    def raw_stat() -> None:
        for k in keys:
            os.stat(raw_dir + "/" + k)

    contenders: dict[str, Callable[[], Any]] = {
        "raw dict lookup": raw_dict,
        "raw os.stat loop": raw_stat,
        **{name: (lambda b=b: b.batch_exists(keys)) for name, b in made.items()},
    }
    names = list(contenders)
    for r in range(reps):
        for name in names if r % 2 == 0 else names[::-1]:
            fn = contenders[name]
            t = timed(lambda fn=fn: [fn() for _ in range(loops)])
            results.setdefault(name, []).append(t / loops / N * 1e6)
    for b in made.values():
        b.clear()
        b.close()
    shutil.rmtree(raw_dir, ignore_errors=True)
    return {name: statistics.median(v) for name, v in results.items()}


def part_cold_exists(base: str, reps: int, loops: int) -> dict[str, float]:
    """Microseconds per batch_exists(128) call on keys the asking instance never named."""
    values = [torch.full((SMALL,), i % 251, dtype=torch.uint8) for i in range(N)]
    ns = namespace()
    arena = os.path.join(base, "cold-arena")
    root = os.path.join(base, "cold-file")

    def pair(kind: str) -> tuple[HiCacheStorage, HiCacheStorage]:
        cfg = StorageConfig(namespace=ns)
        if kind == "mmap":
            return tuple(  # type: ignore[return-value]
                MmapBackend(cfg, path=arena, max_size="256MiB", slot_size="8KiB", prefault=False)
                for _ in range(2)
            )
        return FileBackend(cfg, root=root), FileBackend(cfg, root=root)

    made = {kind: pair(kind) for kind in ("mmap", "file")}
    batches = {kind: [keys_of(N) for _ in range(reps * loops)] for kind in made}
    for kind, (writer, _) in made.items():
        for ks in batches[kind]:
            assert all(writer.batch_set(ks, values)), kind
        # A miss makes the mmap reader catch up with the writer's log records now (once
        # for all of them: not what is timed); it names no stored key.
        assert not made[kind][1].exists(keys_of(1)[0])
    results: dict[str, list[float]] = {}
    for r in range(reps):
        for kind in made if r % 2 == 0 else list(made)[::-1]:
            reader = made[kind][1]
            mine = batches[kind][r * loops : (r + 1) * loops]
            fresh = [keys_of(N) for _ in range(loops)]
            t = timed(lambda b=reader, m=mine: [b.batch_exists(ks) for ks in m])
            results.setdefault(f"{kind}, cold hits", []).append(t / loops * 1e6)
            t = timed(lambda b=reader, m=fresh: [b.batch_exists(ks) for ks in m])
            results.setdefault(f"{kind}, cold, first misses", []).append(t / loops * 1e6)
    for writer, reader in made.values():
        assert reader.batch_exists(batches["mmap"][0][:1] + keys_of(1)) <= 1
        writer.clear()
        writer.close()
        reader.close()
    return {name: statistics.median(v) for name, v in results.items()}


def part_small_sets(base: str, reps: int, batches: int) -> dict[str, float]:
    """Objects per second of batch_set of 4 KiB values (new keys), and of the raw loop.

    Steady state: each contender's store is built once and warmed with ``batches``
    batches first (a file store's fan-out directories exist, as in a store in use); the
    first fill of a new namespace, which creates 256 directories, is not what is timed.
    """
    values = [torch.full((SMALL,), i % 251, dtype=torch.uint8) for i in range(N)]
    raw_bytes = [bytes(v.numpy()) for v in values]
    raw_dir = tempfile.mkdtemp(prefix="rawset-", dir=base)

    def raw_batch(ks: list[str]) -> None:
        for k, data in zip(ks, raw_bytes, strict=True):
            final = os.path.join(raw_dir, k)
            tmp = final + ".tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            try:
                os.link(tmp, final)
            except FileExistsError:
                pass
            os.unlink(tmp)

    made = {name: make() for name, make in backends(base).items()}

    def ours(b: HiCacheStorage) -> Callable[[list[str]], None]:
        def run(ks: list[str]) -> None:
            if not all(b.batch_set(ks, values)):
                raise AssertionError("a set failed")

        return run

    contenders: dict[str, Callable[[list[str]], None]] = {
        "raw temp+write+link loop": raw_batch,
        **{name: ours(b) for name, b in made.items()},
    }
    for fn in contenders.values():  # warm up
        for _ in range(batches):
            fn(keys_of(N))
    results: dict[str, list[float]] = {}
    names = list(contenders)
    for r in range(reps):
        for name in names if r % 2 == 0 else names[::-1]:
            fn = contenders[name]
            all_keys = [keys_of(N) for _ in range(batches)]
            t = timed(lambda fn=fn, all_keys=all_keys: [fn(ks) for ks in all_keys])
            results.setdefault(name, []).append(batches * N / t)
    for name, b in made.items():
        assert b.batch_exists(keys_of(1)) == 0, name
        b.clear()
        b.close()
    shutil.rmtree(raw_dir, ignore_errors=True)
    return {name: statistics.median(v) for name, v in results.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--loops", type=int, default=50, help="batch_exists calls per repetition")
    p.add_argument("--batches", type=int, default=8, help="batches of 128 sets per repetition")
    p.add_argument("--dir", default="/tmp")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    base = tempfile.mkdtemp(prefix="hot-paths-", dir=args.dir)
    try:
        exists = part_exists(base, args.reps, args.loops)
        cold = part_cold_exists(base, args.reps, args.loops)
        sets = part_small_sets(base, args.reps, args.batches)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        for path in SHM_DIRS:
            shutil.rmtree(path, ignore_errors=True)
    out = {"exists_us_per_key": exists, "cold_exists_us_per_call": cold,
           "small_set_objects_per_s": sets,
           "reps": args.reps, "dir": args.dir}  # fmt: skip
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"batch_exists({N}) of stored keys, us per key, median of {args.reps} "
          f"(x {args.loops} calls); dir {args.dir}")  # fmt: skip
    for name, us in exists.items():
        raw = (
            exists["raw dict lookup"] if name in ("mmap", "memory") else exists["raw os.stat loop"]
        )
        extra = "" if name.startswith("raw") else (
            f"   {us / raw:5.2f}x raw, SDK per key {us - raw:+6.2f} us, "
            f"batch of {N}: {us * N:7.0f} us")  # fmt: skip
        print(f"  {name:22s} {us:7.2f}{extra}")
    print(f"batch_exists({N}) of keys this instance never named, us per call, median of "
          f"{args.reps} (x {args.loops} calls)")  # fmt: skip
    for name, us in cold.items():
        print(f"  {name:26s} {us:7.0f}")
    raw = sets["raw temp+write+link loop"]
    print(f"batch_set of {SMALL} B objects, new keys, objects/s, median of {args.reps} "
          f"({args.batches} x {N} per repetition)")  # fmt: skip
    for name, ops in sets.items():
        extra = "" if name.startswith("raw") else (
            f"   {ops / raw:5.2f}x raw, {ops / sets['file']:5.2f}x file")  # fmt: skip
        print(f"  {name:26s} {ops:9.0f}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
