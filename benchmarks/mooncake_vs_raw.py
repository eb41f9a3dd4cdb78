"""Side by side, in one run, against one Mooncake Store: the ``mooncake`` backend's v1 path
and the raw Mooncake client doing the same work.

A master and a storage node (a client lending 1 GiB) are started here; the contenders
are pure clients (``global_segment_size`` 0), as an engine beside storage nodes is. For
1000 pages of 64 KiB and 200 pages of 2 MiB (bf16, ``page_first``, K and V segments), in
batches of 128:

* **ours**: ``batch_set_v1`` / ``batch_get_v1`` of the pages of a registered host pool
  (an existence check, then the header and the page's segments as one object; read
  back into the page's segments and checked: length, name, xxh3);
* **raw**: ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` of the
  same segments (no header, no check).

Rounds alternate the contenders' order; medians; every page read through the backend is
verified byte for byte (outside the timings). The Mooncake client binds wildcard
addresses, so run it in a private network namespace:

    unshare -n bash -c 'ip link set lo up && .venv/bin/python benchmarks/mooncake_vs_raw.py'
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "workers"))

from mooncake_master import require_private_network, running_store

sys.path.insert(0, str(Path(__file__).parent))
from hot_paths import timed  # one timer for the benchmarks: gc off while it runs
from v1_pages import V1Pages

from hicache_storage import StorageConfig
from hicache_storage.backends import MooncakeBackend
from hicache_storage.benchkit import BenchShape, namespace_for


def run_shape(master: str, shape: BenchShape, rounds: int) -> dict[str, Any]:
    from mooncake.store import MooncakeDistributedStore

    pages = V1Pages(shape)
    pool = pages.pool
    src_pages, dst_pages = pages.src_pages, pages.dst_pages
    b = MooncakeBackend(StorageConfig(namespace=namespace_for(shape, "bench")),
                        master_server_address=master, global_segment_size=0,
                        local_buffer_size="64MiB", prefix="ours/")  # fmt: skip
    b.register_mem_pool_host(pool)
    raw = MooncakeDistributedStore()
    if raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", master) != 0:
        raise RuntimeError("raw client setup failed")
    raw.register_buffer(int(pool.kv_buffer.data_ptr()), int(pool.kv_buffer.nbytes))
    out: dict[str, list[float]] = {"ours set": [], "ours get": [], "raw set": [], "raw get": []}
    bad = 0

    def ours() -> None:
        nonlocal bad
        bad += pages.ours(b, out)

    def raw_round() -> None:
        keys = [f"raw/{secrets.token_hex(16)}" for _ in range(shape.pages)]

        def go(call: Any, pages: list[Any]) -> None:
            for i in range(0, shape.pages, shape.batch):
                part = pages[i : i + shape.batch]
                got = call(keys[i : i + shape.batch], [[s.ptr for s in p.segments] for p in part],
                           [[s.nbytes for s in p.segments] for p in part])  # fmt: skip
                if any(r < 0 for r in got):
                    raise RuntimeError("a raw page failed")

        out["raw set"].append(timed(lambda: go(raw.batch_put_from_multi_buffers, src_pages)))
        out["raw get"].append(timed(lambda: go(raw.batch_get_into_multi_buffers, dst_pages)))
        raw.batch_remove(keys, True)

    for r in range(rounds):
        for fn in (ours, raw_round) if r % 2 == 0 else (raw_round, ours):
            fn()
    result: dict[str, Any] = {
        name: pages.nbytes / statistics.median(v) / 1e9 for name, v in out.items()
    }
    result["mismatched pages"] = bad
    b.close()
    raw.close()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    require_private_network()
    shapes = [
        ("1000 x 64 KiB", BenchShape(pages=1000, batch=128, layer_num=1)),
        ("200 x 2 MiB", BenchShape(pages=200, batch=128)),
    ]
    with running_store(1 << 30) as (master, _holder):
        print(f"mooncake_master on {master.address}, one storage node (1 GiB), "
              f"{args.rounds} rounds, medians")  # fmt: skip
        print(f"{'pages':14s} {'ours set':>9s} {'raw set':>9s} {'ratio':>6s} "
              f"{'ours get':>9s} {'raw get':>9s} {'ratio':>6s}   (GB/s)")  # fmt: skip
        for label, shape in shapes:
            r = run_shape(master.address, shape, args.rounds)
            print(f"{label:14s} {r['ours set']:9.3f} {r['raw set']:9.3f} "
                  f"{r['ours set'] / r['raw set']:6.2f} {r['ours get']:9.3f} {r['raw get']:9.3f} "
                  f"{r['ours get'] / r['raw get']:6.2f}   pages verified: "
                  f"{'OK' if r['mismatched pages'] == 0 else 'MISMATCH'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
