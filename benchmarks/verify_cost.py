"""What verified reads cost: every backend's ``batch_get_v1`` with ``checksum="xxh3"`` (the
default) and with ``checksum="none"`` (the opt-out), side by side in one run.

For each backend, two instances (one per option, each in a namespace of its own) store
the same pages once, untimed, and read them all once, untimed. Each round then reads
every page with ``batch_get_v1`` in batches of 128, into zeroed destination pages of the
same host pool, the two instances taking turns batch by batch (who goes first
alternating), so a load that comes and goes hits both alike; medians of the rounds.
Reported: both throughputs, and what verifying added per page in wall time and in CPU
time of this process (its I/O threads included; less sensitive to other load on the
machine). Every page read is checked byte for byte outside the timings. Pages are bf16
``page_first`` with K and V segments: 1000 of 64 KiB and 200 of 2 MiB (``s3``: 200 and
20, moto being the bottleneck).

Where the pages are: ``file`` and ``nixl`` under ``--dir`` (default ``/tmp``, so the page
cache), ``shm`` in ``/dev/shm``, ``mmap`` in a prefaulted arena under ``--dir``, ``memory``
in this process; ``redis`` (a ``redis-server``), ``s3`` (a ``moto_server``) and
``mooncake`` (a master and one storage node, the benchmark a pure client) are started
here on 127.0.0.1. The Mooncake client binds wildcard addresses, so ``mooncake`` runs only
in a private network namespace; this runs all eight:

    unshare -n bash -c 'ip link set lo up && .venv/bin/python benchmarks/verify_cost.py'
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "workers"))
sys.path.insert(0, str(Path(__file__).parent))
from hot_paths import timed  # one timer for the benchmarks: gc off while it runs
from v1_pages import V1Pages

from hicache_storage import HiCacheStorage, StorageConfig, page_hashes
from hicache_storage.benchkit import BenchShape, namespace_for, verify_pages

BACKENDS = ("file", "shm", "mmap", "memory", "redis", "s3", "mooncake", "nixl")
SHAPES = {"64 KiB": BenchShape(pages=1000, batch=128, layer_num=1),
          "2 MiB": BenchShape(pages=200, batch=128)}  # fmt: skip
S3_PAGES = {"64 KiB": 200, "2 MiB": 20}


class Stores:
    """Builds each backend's instances, starting the server one needs once."""

    def __init__(self, stack: contextlib.ExitStack, work: str) -> None:
        self.stack, self.work = stack, work
        self.servers: dict[str, Any] = {}

    def server(self, name: str) -> Any:
        if name not in self.servers:
            if name == "redis":
                from redis_server import running

                self.servers[name] = self.stack.enter_context(running(Path(self.work)))
            elif name == "s3":
                from moto_server import running_moto

                logging.getLogger("werkzeug").setLevel(logging.ERROR)
                srv = self.stack.enter_context(running_moto())
                srv.make_bucket("hicache-verify")
                self.servers[name] = srv
            else:
                from mooncake_master import require_private_network, running_store

                require_private_network()
                self.servers[name] = self.stack.enter_context(running_store(1 << 30))[0]
        return self.servers[name]

    def build(self, name: str, config: StorageConfig, tag: str, nbytes: int, **opts: Any) -> Any:
        from hicache_storage import backends as b

        where = os.path.join(self.work, f"{name}-{tag}")
        if name == "file":
            return b.FileBackend(config, root=where, **opts)
        if name == "nixl":
            return b.NixlBackend(config, root=where, **opts)
        if name == "shm":
            shm = tempfile.mkdtemp(prefix="hicache-verify-", dir="/dev/shm")
            self.stack.callback(shutil.rmtree, shm, True)
            return b.ShmBackend(config, root=shm, **opts)
        if name == "mmap":
            return b.MmapBackend(config, path=where, max_size=nbytes * 3 // 2 + (64 << 20), **opts)
        if name == "memory":
            return b.MemoryBackend(config, store=f"verify-{tag}", **opts)
        if name == "redis":
            url = self.server(name).url
            return b.RedisBackend(config, url=url, prefix="verify:", max_concurrency=4, **opts)
        if name == "s3":
            srv = self.server(name)
            return b.S3Backend(config, bucket="hicache-verify", prefix="verify",
                               endpoint_url=srv.endpoint, region="us-east-1", key=srv.key,
                               secret=srv.secret, max_concurrency=32, **opts)  # fmt: skip
        return b.MooncakeBackend(config, master_server_address=self.server(name).address,
                                 global_segment_size=0, local_buffer_size="64MiB",
                                 prefix="verify/", **opts)  # fmt: skip


def run(stores: Stores, name: str, label: str, shape: BenchShape, rounds: int) -> dict[str, Any]:
    """Median seconds of ``batch_get_v1`` of every page, verified and not."""
    pages = V1Pages(shape)
    ps = shape.page_size
    keys = page_hashes(list(range(shape.pages * ps)), ps)
    contenders: dict[str, HiCacheStorage] = {}
    for checksum in ("xxh3", "none"):
        config = StorageConfig(namespace=namespace_for(shape, f"verify-{checksum}"))
        tag = f"{label.replace(' ', '')}-{checksum}"
        b = stores.build(name, config, tag, pages.nbytes, checksum=checksum)
        b.register_mem_pool_host(pages.pool)
        b.clear()
        for i in range(0, shape.pages, shape.batch):
            src = pages.src.view(-1, ps)[i : i + shape.batch].reshape(-1)
            if not all(b.batch_set_v1(keys[i : i + shape.batch], src)):
                raise RuntimeError(f"{name}: a page was not stored")
        contenders[checksum] = b
    batches = [(i, min(i + shape.batch, shape.pages)) for i in range(0, shape.pages, shape.batch)]
    src_rows, dst_rows = pages.src.view(-1, ps), pages.dst.view(-1, ps)

    def get(b: HiCacheStorage, lo: int, hi: int) -> None:
        if not all(b.batch_get_v1(keys[lo:hi], dst_rows[lo:hi].reshape(-1))):
            raise RuntimeError(f"{name}: a page did not read back")

    for b in contenders.values():  # untimed: first reads (faults, caches, connections)
        for lo, hi in batches:
            get(b, lo, hi)
    # The two take turns batch by batch, so a load that comes and goes hits both alike.
    times: dict[str, list[float]] = {c: [] for c in contenders}
    cpu: dict[str, list[float]] = {c: [] for c in contenders}
    bad = 0
    for r in range(rounds):
        spent, used = dict.fromkeys(contenders, 0.0), dict.fromkeys(contenders, 0.0)
        for n, (lo, hi) in enumerate(batches):
            for checksum in ("xxh3", "none") if (r + n) % 2 == 0 else ("none", "xxh3"):
                for segs in pages.dst_segments[lo:hi]:
                    for t in segs:
                        t.zero_()
                c0 = time.process_time()  # (this process's threads: the checksums' CPU)
                spent[checksum] += timed(functools.partial(get, contenders[checksum], lo, hi))
                used[checksum] += time.process_time() - c0
                bad += verify_pages(pages.pool, src_rows[lo:hi].reshape(-1),
                                    dst_rows[lo:hi].reshape(-1))  # fmt: skip
        for checksum in contenders:
            times[checksum].append(spent[checksum])
            cpu[checksum].append(used[checksum])
    for b in contenders.values():
        b.clear()
        b.close()
    xxh3, none = statistics.median(times["xxh3"]), statistics.median(times["none"])
    cpu_extra = statistics.median(cpu["xxh3"]) - statistics.median(cpu["none"])
    return {"backend": name, "pages": f"{shape.pages} x {label}",
            "xxh3 GB/s": pages.nbytes / xxh3 / 1e9, "none GB/s": pages.nbytes / none / 1e9,
            "time ratio": xxh3 / none, "us per page": (xxh3 - none) / shape.pages * 1e6,
            "cpu us per page": cpu_extra / shape.pages * 1e6,
            "mismatched pages": bad}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default="/tmp", help="where file, nixl and mmap keep their pages")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    names = [n for n in args.backends.split(",") if n]
    unknown = set(names) - set(BACKENDS)
    if unknown:
        p.error(f"unknown backends {sorted(unknown)}; choose from {', '.join(BACKENDS)}")
    results = []
    if not args.json:
        print(f"batch_get_v1, batches of 128, {args.rounds} rounds, medians; "
              "extra = (xxh3 - none) per page, wall and CPU time")  # fmt: skip
        print(f"{'backend':9s} {'pages':16s} {'xxh3 GB/s':>10s} {'none GB/s':>10s} "
              f"{'time x':>7s} {'extra us':>9s} {'CPU us':>7s}  verified")  # fmt: skip
    with contextlib.ExitStack() as stack:
        work = stack.enter_context(
            tempfile.TemporaryDirectory(prefix="hicache-verify-", dir=args.dir)
        )
        stores = Stores(stack, work)
        for name in names:
            for label, shape in SHAPES.items():
                if name == "s3":
                    shape = dataclasses.replace(shape, pages=S3_PAGES[label])
                r = run(stores, name, label, shape, args.rounds)
                results.append(r)
                if not args.json:
                    print(f"{name:9s} {r['pages']:16s} {r['xxh3 GB/s']:10.3f} "
                          f"{r['none GB/s']:10.3f} {r['time ratio']:7.2f} "
                          f"{r['us per page']:9.1f} {r['cpu us per page']:7.1f}  "
                          f"{'OK' if r['mismatched pages'] == 0 else 'MISMATCH'}", flush=True)  # fmt: skip
    if args.json:
        print(json.dumps(results, indent=2))
    return 0 if all(r["mismatched pages"] == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
