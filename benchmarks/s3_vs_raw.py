"""Side by side, in one run, against one moto S3 server: the ``s3`` backend's v1 path and
raw s3fs doing the same work at the same concurrency.

For 200 pages of 64 KiB (bf16, ``page_first``, one layer, K and V segments), in batches
of 128:

* **ours**: ``batch_set_v1`` / ``batch_get_v1`` of the pages of a host pool (header and
  xxh3 checksum written, conditional ``PutObject``, verified on every read), at most
  ``--concurrency`` requests in flight;
* **raw**: s3fs's own ``pipe`` (a dict of each page's bytes, joined from its segments)
  and ``cat`` (each value copied into the destination page's segments), with
  ``batch_size`` = ``--concurrency``. The raw filesystem is built with
  ``max_concurrency=1``, so that each ``cat`` is one ``GetObject``, as ours is (with
  s3fs's default of 10 it sends a ``HeadObject`` before each ``GetObject``).

Rounds alternate the contenders' order; medians; every page read through the backend is
verified byte for byte (outside the timings). The server (``moto_server``) is started
here on 127.0.0.1 and is the bottleneck: the ratio is what counts.

    .venv/bin/python benchmarks/s3_vs_raw.py --rounds 5
"""

from __future__ import annotations

import argparse
import logging
import secrets
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "workers"))

from moto_server import running_moto

sys.path.insert(0, str(Path(__file__).parent))
from hot_paths import timed  # one timer for the benchmarks: gc off while it runs
from v1_pages import V1Pages

from hicache_storage import StorageConfig, page_hashes
from hicache_storage.backends import S3Backend
from hicache_storage.benchkit import BenchShape, namespace_for

BUCKET = "hicache-bench"


def run_shape(endpoint: str, creds: tuple[str, str], shape: BenchShape, rounds: int,
              concurrency: int) -> dict[str, Any]:  # fmt: skip
    import s3fs

    pages = V1Pages(shape)
    pool, src, ps = pages.pool, pages.src, shape.page_size
    key, secret = creds
    fs = s3fs.S3FileSystem(key=key, secret=secret, skip_instance_cache=True, max_concurrency=1,
                           client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"})  # fmt: skip
    b = S3Backend(StorageConfig(namespace=namespace_for(shape, "bench")), bucket=BUCKET,
                  prefix="ours", endpoint_url=endpoint, region="us-east-1", key=key,
                  secret=secret, max_concurrency=concurrency)  # fmt: skip
    b.register_mem_pool_host(pool)
    out: dict[str, list[float]] = {"ours set": [], "ours get": [], "raw set": [], "raw get": []}
    bad = 0

    def ours() -> None:
        nonlocal bad
        bad += pages.ours(b, out)

    def raw() -> None:
        paths = [f"{BUCKET}/raw/{secrets.token_hex(16)}" for _ in range(shape.pages)]

        def set_all() -> None:
            for i in range(0, shape.pages, shape.batch):
                fs.pipe({p: b"".join(seg.memoryview for seg in page.segments)
                         for p, page in zip(paths[i : i + shape.batch],
                                            pages.src_pages[i : i + shape.batch], strict=True)},
                        batch_size=concurrency)  # fmt: skip

        def get_all() -> None:
            for i in range(0, shape.pages, shape.batch):
                part = paths[i : i + shape.batch]
                got = fs.cat(part, batch_size=concurrency)
                for j, p in enumerate(part):
                    pages.copy_into_destination(i + j, got[p])

        out["raw set"].append(timed(set_all))
        out["raw get"].append(timed(get_all))
        fs.rm(paths)

    for r in range(rounds):
        for fn in (ours, raw) if r % 2 == 0 else (raw, ours):
            fn()
    nbytes = shape.pages * pool.page_bytes
    result: dict[str, Any] = {
        name: nbytes / statistics.median(v) / 2**20 for name, v in out.items()
    }
    keys = page_hashes(list(range(128 * ps)), ps)
    b.batch_set_v1(keys, src[: 128 * ps])
    result["ours exists(128) ms"] = statistics.median(
        [timed(lambda: b.batch_exists(keys)) for _ in range(5)]
    ) * 1e3  # fmt: skip
    result["mismatched pages"] = bad
    b.clear()
    b.close()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=32)
    args = p.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    shape = BenchShape(pages=200, batch=128, layer_num=1)
    with running_moto() as srv:
        srv.make_bucket(BUCKET)
        print(f"moto_server on 127.0.0.1:{srv.port}, {args.rounds} rounds, "
              f"concurrency {args.concurrency}, medians")  # fmt: skip
        print(f"{'pages':14s} {'ours set':>9s} {'raw set':>9s} {'ratio':>6s} "
              f"{'ours get':>9s} {'raw get':>9s} {'ratio':>6s}   (MiB/s)")  # fmt: skip
        r = run_shape(srv.endpoint, (srv.key, srv.secret), shape, args.rounds, args.concurrency)
        print(f"{'200 x 64 KiB':14s} {r['ours set']:9.2f} {r['raw set']:9.2f} "
              f"{r['ours set'] / r['raw set']:6.2f} {r['ours get']:9.2f} {r['raw get']:9.2f} "
              f"{r['ours get'] / r['raw get']:6.2f}")  # fmt: skip
        print(f"{'':14s} batch_exists(128): ours {r['ours exists(128) ms']:.1f} ms; "
              f"pages verified: {'OK' if r['mismatched pages'] == 0 else 'MISMATCH'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
