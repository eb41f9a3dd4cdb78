"""Side by side, in one run: ``shm`` and ``mmap`` v1 against a raw memcpy, and the ``file`` backend.

Every contender moves the same 2 MiB pages (bf16, ``page_first``: a K and a V segment of
1 MiB each) out of one host pool and back into other pages of it:

* **memcpy, per page**: ``torch.Tensor.copy_`` of each page's segments into the
  destination page's segments (preallocated, warm): the physical limit of moving these
  bytes on this machine, and the baseline of the ratios;
* **memcpy, bulk**: one ``copy_`` of all pages at once (the best case, for reference);
* **raw writev/preadv, new tmpfs files**: no backend, each page ``writev`` into a new file
  in ``/dev/shm`` (after a 48-byte gap, the shm store's file layout) and ``preadv`` back,
  on 4 threads: the kernel's ceiling for the *cold* shm case (a first fill, and the first
  reads of it);
* **shm v1**: ``batch_set_v1`` / ``batch_get_v1`` through :class:`ShmBackend` (tmpfs files
  in ``/dev/shm``, ``writev``/``preadv`` on 4 threads), three ways: *cold*, into an empty
  store (every page is a new tmpfs file); *full*, the steady state of a cache: the store
  is at its cap with other pages (filled untimed with twice its capacity, so it has
  turned over once), so every set evicts the least-recently-used page and, by default,
  rewrites its tmpfs file in place (``recycle``); and *full, recycle=false*, the same
  evicting by unlink and allocating new files;
* **mmap v1**: through :class:`MmapBackend` (a prefaulted arena, so page-cache resident;
  ``memmove`` on 2 threads);
* **file v1**: through :class:`FileBackend` on ``/tmp`` (checksummed).

Rounds alternate the contenders' order; medians are reported; every read is verified
byte for byte outside the timed part. The cyclic garbage collector is off while a
contender runs (as ``timeit`` does): a full collection of this process's ~170,000
objects takes about 50 ms and would land in whichever timing it happens to hit.

    .venv/bin/python benchmarks/memory_stores.py --pages 256 --rounds 5
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from hicache_storage import HiCacheStorage, StorageConfig, page_hashes
from hicache_storage.backends import FileBackend, MmapBackend, ShmBackend
from hicache_storage.benchkit import BenchShape, namespace_for, verify_pages
from hicache_storage.storekit.header import HEADER_SIZE

sys.path.insert(0, str(Path(__file__).parent))
from v1_pages import V1Pages


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pages", type=int, default=256)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    shape = BenchShape(pages=args.pages, batch=args.batch)
    pages = V1Pages(shape, seed=2)
    pool, src, dst, ps = pages.pool, pages.src, pages.dst, shape.page_size
    src_pages, dst_pages = pages.src_pages, pages.dst_pages
    seg_pairs = [
        (
            torch.frombuffer(a.memoryview, dtype=torch.uint8),
            torch.frombuffer(b.memoryview, dtype=torch.uint8),
        )
        for sp, dp in zip(src_pages, dst_pages, strict=True)
        for a, b in zip(sp.segments, dp.segments, strict=True)
    ]
    page_bytes = pool.page_bytes
    nbytes = shape.pages * page_bytes
    tmp = tempfile.mkdtemp(prefix="hicache-mem-bench-", dir="/tmp")
    shm_dir = f"/dev/shm/hicache-mem-bench-{secrets.token_hex(4)}"

    def zero_dst() -> None:
        for _, d in seg_pairs:
            d.zero_()

    def memcpy_pages() -> tuple[float, float]:
        t0 = time.perf_counter()
        for s, d in seg_pairs:
            d.copy_(s)
        t = time.perf_counter() - t0
        return t, t  # the same copy stands for "set" and "get"

    def memcpy_bulk() -> tuple[float, float]:
        kv = pool.kv_buffer  # (2, size, layers, heads, dim): copy the src token range into dst
        a, b = kv[:, : shape.pages * ps], kv[:, shape.pages * ps :]
        t0 = time.perf_counter()
        b.copy_(a)
        t = time.perf_counter() - t0
        return t, t

    def raw_tmpfs() -> tuple[float, float]:
        """No backend: each page ``writev`` into a new tmpfs file, then ``preadv`` back.

        The files have the shm store's layout (48 bytes of header, then the segments) and
        are read the same way (one ``preadv`` from offset 48), on 4 threads as the store
        runs: the kernel's ceiling for a first fill of new tmpfs files and the first reads
        of them.
        """
        gap = bytes(HEADER_SIZE)
        where = os.path.join(shm_dir, "raw-" + secrets.token_hex(4))
        os.makedirs(where, mode=0o700)
        paths = [os.path.join(where, str(i)) for i in range(shape.pages)]

        def write(i: int) -> None:
            fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.writev(fd, [gap, *(seg.memoryview for seg in src_pages[i].segments)])
            finally:
                os.close(fd)

        def read(i: int) -> None:
            fd = os.open(paths[i], os.O_RDONLY)
            try:
                os.preadv(fd, [seg.memoryview for seg in dst_pages[i].segments], HEADER_SIZE)
            finally:
                os.close(fd)

        with ThreadPoolExecutor(4) as pool_:
            t0 = time.perf_counter()
            list(pool_.map(write, range(shape.pages)))
            t_set = time.perf_counter() - t0
            zero_dst()
            t0 = time.perf_counter()
            list(pool_.map(read, range(shape.pages)))
            t_get = time.perf_counter() - t0
        shutil.rmtree(where)
        return t_set, t_get

    def through(
        make: Callable[[StorageConfig], HiCacheStorage], *, full: bool = False
    ) -> Callable[[], tuple[float, float]]:
        """Time v1 set then get of every page; ``full``: into a store already at its cap."""

        def run() -> tuple[float, float]:
            ns = namespace_for(shape, "bench-" + secrets.token_hex(4))
            b = make(StorageConfig(namespace=ns))
            b.register_mem_pool_host(pool)
            keys = page_hashes(torch.randint(0, 2**31 - 1, (shape.pages * ps,)).tolist(), ps)
            srows, drows = src.view(-1, ps), dst.view(-1, ps)
            if full:  # untimed: fill the store to its cap, twice over (it has turned over)
                n_old = 2 * full_pages
                old = page_hashes(torch.randint(0, 2**31 - 1, (n_old * ps,)).tolist(), ps)
                for i in range(0, n_old, shape.batch):
                    rows = srows[[j % shape.pages for j in range(i, min(i + shape.batch, n_old))]]
                    b.batch_set_v1(old[i : i + shape.batch], rows.reshape(-1))

            def batches(
                call: Callable[[list[str], torch.Tensor], list[bool]], rows: torch.Tensor
            ) -> None:
                for i in range(0, shape.pages, shape.batch):
                    if not all(
                        call(keys[i : i + shape.batch], rows[i : i + shape.batch].reshape(-1))
                    ):
                        raise RuntimeError(f"{type(b).__name__}: a page failed")

            t0 = time.perf_counter()
            batches(b.batch_set_v1, srows)
            t_set = time.perf_counter() - t0
            zero_dst()
            t0 = time.perf_counter()
            batches(b.batch_get_v1, drows)
            t_get = time.perf_counter() - t0
            b.clear()
            b.close()
            return t_set, t_get

        return run

    arena = os.path.join(tmp, "arena")
    # The cap of a "full" store: room for the timed pages even after an eviction down to
    # the default watermark (0.9 of the cap), so none of them is evicted by the others.
    full_pages = -(-shape.pages * 10 // 9) + 2
    full_cap = full_pages * (HEADER_SIZE + page_bytes)
    contenders: dict[str, Callable[[], tuple[float, float]]] = {
        "memcpy, per page (baseline)": memcpy_pages,
        "memcpy, bulk": memcpy_bulk,
        "raw writev/preadv, new tmpfs files": raw_tmpfs,
        "shm v1, cold (new pages)": through(
            lambda c: ShmBackend(c, root=shm_dir, max_concurrency=4)
        ),
        "shm v1, full (recycling)": through(
            lambda c: ShmBackend(c, root=shm_dir, max_concurrency=4, max_size=full_cap),
            full=True,
        ),
        "shm v1, full, recycle=false": through(
            lambda c: ShmBackend(
                c, root=shm_dir, max_concurrency=4, max_size=full_cap, recycle=False
            ),
            full=True,
        ),
        "mmap v1": through(
            lambda c: MmapBackend(
                c, path=arena, max_size=2 * nbytes + 2**24, slot_size=page_bytes, reuse_delay=0
            )
        ),
        "file v1 (/tmp)": through(lambda c: FileBackend(c, root=os.path.join(tmp, "file"))),
    }
    # Create and prefault the arena before timing anything.
    MmapBackend(
        StorageConfig(), path=arena, max_size=2 * nbytes + 2**24, slot_size=page_bytes
    ).close()
    results: dict[str, dict[str, list[float]]] = {n: {"set": [], "get": []} for n in contenders}
    bad = 0
    names = list(contenders)
    try:
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                zero_dst()
                gc.collect()
                gc.disable()  # as timeit does: no collection of our objects inside a timing
                try:
                    t_set, t_get = contenders[name]()
                finally:
                    gc.enable()
                bad += verify_pages(pool, src, dst)
                results[name]["set"].append(t_set)
                results[name]["get"].append(t_get)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)

    base = names[0]
    summary: dict[str, Any] = {
        "pages": shape.pages,
        "page_bytes": page_bytes,
        "rounds": args.rounds,
        "mismatched_pages": bad,
        "results": {},
    }
    for name in names:
        summary["results"][name] = {
            op: round(nbytes / statistics.median(results[name][op]) / 1e9, 3)
            for op in ("set", "get")
        }
    for name in names:
        for op in ("set", "get"):
            summary["results"][name][f"{op}_vs_memcpy"] = round(
                summary["results"][name][op] / summary["results"][base][op], 2
            )
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"{shape.pages} pages x {page_bytes / 2**20:.2f} MiB, {args.rounds} rounds, median; "
            f"every page verified: {'OK' if bad == 0 else f'{bad} MISMATCHED'}"
        )
        print(
            f"{'contender':<30}{'set GB/s':>10}{'get GB/s':>10}{'set/memcpy':>12}{'get/memcpy':>12}"
        )
        for name, res in summary["results"].items():
            print(
                f"{name:<30}{res['set']:>10.3f}{res['get']:>10.3f}{res['set_vs_memcpy']:>12.2f}{res['get_vs_memcpy']:>12.2f}"
            )
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
