"""Side by side, in one run and one directory: the ``file`` backend's v1 path against raw I/O.

Raw baseline (what a user would write by hand, no SDK): per page, ``os.writev`` of the
page's segments to a temporary file then ``os.rename``; reads are ``open`` + ``readinto``
of each segment; a serial loop, and the same on 4 threads. Our side: ``batch_set_v1`` /
``batch_get_v1`` of the same pages through a :class:`FileBackend` (header, xxh3 checksum
written and verified on every read, first-writer-wins publish), with its default thread
pool and with ``max_concurrency=1``. Ratios are against the serial raw loop.

Every read is verified byte for byte against the source pages (outside the timed part,
for both sides). Rounds alternate the order of the contenders; the median is reported.

    .venv/bin/python benchmarks/file_vs_raw.py --pages 256 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from hicache_storage import StorageConfig, page_hashes
from hicache_storage.backends import FileBackend
from hicache_storage.benchkit import BenchShape, namespace_for, verify_pages

sys.path.insert(0, str(Path(__file__).parent))
from v1_pages import V1Pages

from hicache_storage.buffers import PageBuffer


def raw_set_one(directory: str, key: str, page: PageBuffer) -> None:
    final = os.path.join(directory, key)
    tmp = final + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.writev(fd, page.views)
    finally:
        os.close(fd)
    os.rename(tmp, final)


def raw_get_one(directory: str, key: str, page: PageBuffer) -> None:
    with open(os.path.join(directory, key), "rb", buffering=0) as f:
        for view in page.views:
            f.readinto(view)


def raw_loop(
    fn: Callable[[str, str, PageBuffer], None],
    directory: str,
    keys: list[str],
    pages: list[PageBuffer],
    pool: ThreadPoolExecutor | None,
) -> None:
    if pool is None:
        for key, page in zip(keys, pages, strict=True):
            fn(directory, key, page)
    else:
        list(pool.map(lambda kp: fn(directory, *kp), zip(keys, pages, strict=True)))


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pages", type=int, default=256)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--dir", default=None, help="directory to benchmark in (default: a new one under /tmp)"
    )
    p.add_argument("--layout", default="page_first")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    shape = BenchShape(pages=args.pages, batch=args.batch, layout=args.layout)
    pages = V1Pages(shape, seed=1)
    pool, src, dst, ps = pages.pool, pages.src, pages.dst, shape.page_size
    src_pages, dst_pages = pages.src_pages, pages.dst_pages
    base = args.dir or tempfile.mkdtemp(prefix="hicache-bench-", dir="/tmp")
    os.makedirs(base, exist_ok=True)

    def zero_dst() -> None:
        for page in dst_pages:
            for v in page.views:
                torch.frombuffer(v, dtype=torch.uint8).zero_()

    results: dict[str, dict[str, list[float]]] = {}
    bad_pages = 0

    def run_raw(threads: int) -> tuple[float, float]:
        d = os.path.join(base, "raw-" + secrets.token_hex(4))
        os.makedirs(d)
        keys = [secrets.token_hex(32) for _ in range(shape.pages)]
        pool_ = ThreadPoolExecutor(threads) if threads > 1 else None
        t_set = timed(lambda: raw_loop(raw_set_one, d, keys, src_pages, pool_))
        zero_dst()
        t_get = timed(lambda: raw_loop(raw_get_one, d, keys, dst_pages, pool_))
        if pool_ is not None:
            pool_.shutdown()
        shutil.rmtree(d)
        return t_set, t_get

    def run_ours(threads: int, checksum: str = "xxh3") -> tuple[float, float]:
        ns = namespace_for(shape, "bench-" + secrets.token_hex(4))
        b = FileBackend(
            StorageConfig(namespace=ns), root=base, max_concurrency=threads, checksum=checksum
        )
        b.register_mem_pool_host(pool)
        keys = page_hashes(torch.randint(0, 2**31 - 1, (shape.pages * ps,)).tolist(), ps)
        src_rows, dst_rows = src.view(-1, ps), dst.view(-1, ps)

        def batches(
            call: Callable[[list[str], torch.Tensor], list[bool]], rows: torch.Tensor
        ) -> None:
            for i in range(0, shape.pages, shape.batch):
                ok = call(keys[i : i + shape.batch], rows[i : i + shape.batch].reshape(-1))
                if not all(ok):
                    raise RuntimeError("a page failed")

        t_set = timed(lambda: batches(b.batch_set_v1, src_rows))
        zero_dst()
        t_get = timed(lambda: batches(b.batch_get_v1, dst_rows))
        b.clear()
        b.close()
        return t_set, t_get

    contenders: dict[str, Callable[[], tuple[float, float]]] = {
        "raw, serial (writev+rename/readinto)": lambda: run_raw(1),
        "file v1, max_concurrency=4 (default)": lambda: run_ours(4),
        "file v1, max_concurrency=1": lambda: run_ours(1),
        "raw, 4 threads": lambda: run_raw(4),
        "file v1, max_concurrency=4, checksum=none": lambda: run_ours(4, "none"),
    }
    names = list(contenders)
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            t_set, t_get = contenders[name]()
            bad_pages += verify_pages(pool, src, dst)
            entry = results.setdefault(name, {"set": [], "get": []})
            entry["set"].append(t_set)
            entry["get"].append(t_get)
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)

    nbytes = shape.pages * pool.page_bytes
    summary: dict[str, Any] = {
        "pages": shape.pages,
        "page_bytes": pool.page_bytes,
        "layout": shape.layout,
        "rounds": args.rounds,
        "mismatched_pages": bad_pages,
        "results": {},
    }
    raw = names[0]
    for name in names:
        gb = {op: nbytes / statistics.median(results[name][op]) / 1e9 for op in ("set", "get")}
        summary["results"][name] = {f"{op}_GBps": round(v, 3) for op, v in gb.items()}
    for name in names[1:]:
        for op in ("set", "get"):
            ratio = summary["results"][name][f"{op}_GBps"] / summary["results"][raw][f"{op}_GBps"]
            summary["results"][name][f"{op}_vs_raw"] = round(ratio, 2)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"{shape.pages} pages x {pool.page_bytes / 2**20:.2f} MiB ({shape.layout}), "
            f"{args.rounds} rounds, median; every page verified: "
            f"{'OK' if bad_pages == 0 else f'{bad_pages} MISMATCHED'}"
        )
        print(f"{'contender':<38}{'set GB/s':>10}{'get GB/s':>10}{'set/raw':>9}{'get/raw':>9}")
        for name, r in summary["results"].items():
            print(
                f"{name:<38}{r['set_GBps']:>10.3f}{r['get_GBps']:>10.3f}"
                f"{r.get('set_vs_raw', 1.0):>9.2f}{r.get('get_vs_raw', 1.0):>9.2f}"
            )
    return 0 if bad_pages == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
