"""The hicache plugin inside LMCache against LMCache's own stores, side by side in one run.

Run it in the LMCache venv (``bash scripts/lmcache_env.sh`` builds it)::

    .venv-lmcache/bin/python benchmarks/lmcache_plugin.py [--chunks 32] [--rounds 3] [--dir /tmp]

A real ``LMCacheEngine`` on the CPU (LMCache's mock GPU connector, filled with seeded
bytes) stores ``--chunks`` chunks of 256 tokens (16 layers, 4 KV heads of 128 dims,
bfloat16: 8 MiB a chunk) and retrieves them, with each contender as its only store:

* ``hicache file``: our plugin on the ``file`` backend (verification on, our default);
* ``lmcache fs``: LMCache's own ``fs`` connector (a remote storage plugin, as ours);
* ``lmcache local_disk``: LMCache's local-disk backend (not a connector; LMCache's
  first choice for a disk);
* ``hicache redis`` and ``lmcache redis``: our plugin on the ``redis`` backend, and
  LMCache's redis connector, on one redis-server this script starts.

Each contender's round runs in a process of its own (LMCache's redis connector never
closes, and an engine left running slows whoever runs next), with one engine, warmed up
by an untimed store and retrieve of other tokens. Store: from ``store()`` until ``lookup()`` reports every chunk (LMCache stores
in the background; ``lookup`` is polled every 10 ms). Retrieve: the median of three
``retrieve()`` calls of every chunk, in that engine, whose CPU cache is off
(``local_cpu=False``), so every chunk comes from the store under test (files are in the
page cache for every contender alike); every retrieved chunk is checked byte for byte. Each
round runs every contender once, in an order that rotates; medians are reported, as
chunks per second and GB/s, with the ratio to LMCache's own store of the same kind.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "workers"))

import lmcache_engine
from lmcache_engine import engine, mask, plugin_config
from redis_server import running

# 8 MiB chunks: 256 tokens x 16 layers x 4 heads x 128 dims x K/V x bf16.
lmcache_engine.LAYERS, lmcache_engine.HEADS, lmcache_engine.HEAD_DIM = 16, 4, 128
lmcache_engine.CHUNK = 256
_PATTERNS: dict[tuple[Any, ...], Any] = {}


def cheap_values(shape: Any, dtype: Any, start: int, seed: int) -> Any:
    """Chunk contents that cost a copy, not a random generator: one seeded random block
    per (shape, seed), rolled by the chunk's start so no two chunks are alike."""
    import torch

    key = (tuple(shape), dtype, seed)
    if key not in _PATTERNS:
        _PATTERNS[key] = lmcache_engine.seeded_values(shape, dtype, 0, seed)
    return torch.roll(_PATTERNS[key], shifts=start // lmcache_engine.CHUNK + 1)


lmcache_engine.FILL = cheap_values


def contenders(work: str, redis_url: str) -> dict[str, Callable[[str], dict[str, Any]]]:
    """Each contender's engine settings, for a fresh directory or key prefix ``tag``."""

    def hicache_file(tag: str) -> dict[str, Any]:
        return {"extra_config": plugin_config("file", {"root": f"{work}/{tag}"})}

    def lmcache_fs(tag: str) -> dict[str, Any]:
        os.makedirs(f"{work}/{tag}", exist_ok=True)
        return {"extra_config": {"remote_storage_plugin.fs.base_path": f"{work}/{tag}"},
                "plugins": ["fs"]}  # fmt: skip

    def lmcache_disk(tag: str) -> dict[str, Any]:
        os.makedirs(f"{work}/{tag}", exist_ok=True)
        return {"extra_config": {}, "plugins": [], "local_disk": f"{work}/{tag}/",
                "max_local_disk_size": 4.0}  # fmt: skip

    def hicache_redis(tag: str) -> dict[str, Any]:
        return {"extra_config": plugin_config("redis", {"url": redis_url, "prefix": tag})}

    def lmcache_redis(tag: str) -> dict[str, Any]:
        # (its engine is left open: LMCache's redis connector never returns from close)
        return {"extra_config": {"remote_storage_plugin.redis.redis_url": redis_url},
                "plugins": ["redis"], "model": f"bench-{tag}", "destroy": False}  # fmt: skip

    return {
        "hicache file": hicache_file,
        "lmcache fs": lmcache_fs,
        "lmcache local_disk": lmcache_disk,
        "hicache redis": hicache_redis,
        "lmcache redis": lmcache_redis,
    }


def run_one(settings: dict[str, Any], chunks: int, seed: int) -> tuple[float, float]:
    """Seconds to store ``chunks`` chunks, and to retrieve them (a median of 3).

    One engine: a first store and retrieve of other tokens warm it up (threads, the
    first touch of LMCache's buffer), untimed; then the timed store and retrieves.
    """
    import torch

    kw = dict(settings)
    extra = kw.pop("extra_config")
    with engine(extra, seed=seed, max_local_cpu_size=2.0, timeout=30.0, **kw) as (eng, gpu):
        results = []
        for offset in (1, 2):
            first = (seed * 10 + offset) * 10**6
            tokens = torch.arange(first, first + chunks * lmcache_engine.CHUNK)
            t0 = time.perf_counter()
            eng.store(tokens, mask=mask(tokens))
            while eng.lookup(tokens) < len(tokens):
                if time.perf_counter() - t0 > 120:
                    raise RuntimeError("store did not finish in 120 s")
                time.sleep(0.01)
            store_s = time.perf_counter() - t0
            gets = []
            for _ in range(3):
                gpu.retrieved.clear()
                t0 = time.perf_counter()
                got = eng.retrieve(tokens, mask=mask(tokens))
                gets.append(time.perf_counter() - t0)
                if int(got.sum()) != len(tokens) or gpu.wrong_chunks():
                    raise RuntimeError(f"retrieved {int(got.sum())} of {len(tokens)}, or wrong")
            results.append((store_s, statistics.median(gets)))
    return results[-1]


def run_child(name: str, tag: str, seed: str, redis_url: str, work: str, chunks: str) -> None:
    """One contender's round, in this process; prints ``[store_s, retrieve_s]``."""
    import logging

    logging.disable(logging.WARNING)
    settings = contenders(work, redis_url)[name](tag)
    print(json.dumps(run_one(settings, int(chunks), int(seed))))


def main() -> None:
    if len(sys.argv) == 8 and sys.argv[1] == "--child":
        run_child(*sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp")
    args = ap.parse_args()
    import logging

    logging.disable(logging.WARNING)  # (LMCache logs every store and retrieve at INFO)
    chunk_bytes = 2 * 16 * 256 * 4 * 128 * 2
    work = tempfile.mkdtemp(prefix="lmcache-bench-", dir=args.dir)
    results: dict[str, dict[str, list[float]]] = {}
    try:
        with running(Path(work) / "redis") as srv:
            makers = contenders(work, srv.url)
            names = list(makers)
            for r in range(args.rounds):
                order = names[r % len(names) :] + names[: r % len(names)]
                for name in order:
                    tag = f"{name.replace(' ', '-')}-{r}"
                    # (each in a process of its own: LMCache's redis connector never
                    # closes, and an engine left running slows whoever runs next)
                    child = subprocess.run(
                        [sys.executable, __file__, "--child", name, tag, str(r + 1), srv.url,
                         work, str(args.chunks)],
                        capture_output=True, text=True, timeout=600, check=False,
                    )  # fmt: skip
                    if child.returncode != 0:
                        raise SystemExit(f"{name}: {child.stderr[-2000:]}")
                    store_s, get_s = json.loads(child.stdout.strip().splitlines()[-1])
                    res = results.setdefault(name, {"store": [], "retrieve": []})
                    res["store"].append(store_s)
                    res["retrieve"].append(get_s)
                    shutil.rmtree(f"{work}/{tag}", ignore_errors=True)
                    srv_flush(srv.url)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    total = args.chunks * chunk_bytes
    print(f"{args.chunks} chunks of {chunk_bytes >> 20} MiB, {args.rounds} rounds, dir {args.dir}; "
          "medians [min-max]")  # fmt: skip
    peer = {"hicache file": "lmcache fs", "hicache redis": "lmcache redis"}
    for name, res in results.items():
        cells = []
        for what in ("store", "retrieve"):
            secs = statistics.median(res[what])
            ratio = ""
            if name in peer and peer[name] in results:
                ratio = (
                    f" ({statistics.median(results[peer[name]][what]) / secs:.2f}x {peer[name]})"
                )
            cells.append(
                f"{what} {args.chunks / secs:7.1f} chunks/s {total / secs / 1e9:5.2f} GB/s "
                f"[{total / max(res[what]) / 1e9:.2f}-{total / min(res[what]) / 1e9:.2f}]{ratio}"
            )
        print(f"{name:19s} " + " | ".join(cells))


def srv_flush(url: str) -> None:
    """Empty the redis-server between contenders (its memory is the test's, not theirs)."""
    import redis

    redis.Redis.from_url(url).flushall()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    # LMCache's redis connector never returns from close(), so its engines were left
    # open, and their threads would keep this process alive.
    os._exit(0)
