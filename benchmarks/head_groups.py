"""What storing pages as head groups costs, beside whole-page objects, in one run.

A TP 1 rank of a Llama-8B-like model (8 KV heads of 128, bf16, 64-token pages, 8 layers
here to keep the pool small: 2 MiB pages) writes and reads ``--pages`` pages through the
``file`` backend, each layout in turn, two ways:

* **whole**: one object per page (what a deployment of one TP size stores);
* **groups**: ``--groups`` head-group objects per page (``head_groups``, what lets every
  TP size read the page), each with its 16-byte writer tag. ``page_head`` pages give each
  group's bytes as slices of the page (no copy); the other layouts gather a group's
  bytes into one buffer per page before a write and scatter them after a read.

Also timed alone: that gather and scatter (the copy the row layouts pay), in GB/s of
page bytes. Each figure is the median of ``--reps`` runs, contenders alternating; the
ratio is groups over whole (higher is better, 1.0 = free).

    .venv/bin/python benchmarks/head_groups.py [--pages 64] [--groups 8] [--reps 5]
        [--dir /tmp] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np
import torch

from hicache_storage import HostKVPool, KVCacheNamespace, StorageConfig
from hicache_storage.backends import FileBackend
from hicache_storage.headgroups import HeadGroupStore

HEADS, DIM, PS, LAYERS = 8, 128, 64, 8
LAYOUTS = ("page_head", "page_first", "page_first_direct", "layer_first")


def _store(root: str, layout: str, groups: int, tag: str) -> Any:
    ns = KVCacheNamespace("bench-hg", "bfloat16", PS, layout, total_kv_heads=HEADS, tenant=tag)
    config = StorageConfig(namespace=ns)
    if not groups:
        return FileBackend(config, root=root)
    return HeadGroupStore(config, lambda c: FileBackend(c, root=root), groups, writer_id="bench")


def run(pages: int, groups: int, reps: int, base: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for layout in LAYOUTS:
        pool = HostKVPool(pages, PS, LAYERS, HEADS, DIM, layout=layout)
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape))
        keys_base = [f"{i:064x}" for i in range(pages)]
        idx = torch.arange(pages * PS)
        nbytes = pages * pool.page_bytes
        times: dict[str, dict[str, list[float]]] = {
            "whole": {"set": [], "get": []}, "groups": {"set": [], "get": []},
        }  # fmt: skip
        copy: dict[str, list[float]] = {"gather": [], "scatter": []}
        for rep in range(reps):
            order = ("whole", "groups") if rep % 2 == 0 else ("groups", "whole")
            for how in order:
                root = tempfile.mkdtemp(dir=base)
                try:
                    store = _store(root, layout, groups if how == "groups" else 0, f"r{rep}")
                    store.register_mem_pool_host(pool)
                    keys = list(keys_base)
                    t = time.perf_counter()
                    store.batch_set_v1(keys, idx)
                    times[how]["set"].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    ok = store.batch_get_v1(keys, idx)
                    times[how]["get"].append(time.perf_counter() - t)
                    assert all(ok), f"{layout} {how}: a page did not come back"
                    if how == "groups" and layout != "page_head":
                        bufs = pool.page_buffers(idx, pages)
                        t = time.perf_counter()
                        staged = store._pages(bufs, None)[1]
                        copy["gather"].append(time.perf_counter() - t)
                        t = time.perf_counter()
                        for page, buf in zip(bufs, staged, strict=True):
                            store._scatter(page, buf)
                        copy["scatter"].append(time.perf_counter() - t)
                    store.close()
                finally:
                    shutil.rmtree(root, ignore_errors=True)
        row: dict[str, Any] = {"page_bytes": pool.page_bytes}
        for op in ("set", "get"):
            whole = nbytes / statistics.median(times["whole"][op]) / 1e9
            grouped = nbytes / statistics.median(times["groups"][op]) / 1e9
            row[op] = {"whole_gbps": round(whole, 2), "groups_gbps": round(grouped, 2),
                       "ratio": round(grouped / whole, 2)}  # fmt: skip
        for op, ts in copy.items():
            row[op + "_gbps"] = round(nbytes / statistics.median(ts) / 1e9, 2) if ts else None
        out[layout] = row
        del pool
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    res = run(a.pages, a.groups, a.reps, a.dir)
    if a.json:
        print(json.dumps(res, indent=2))
        return
    print(f"{a.pages} pages of {res[LAYOUTS[0]]['page_bytes'] >> 10} KiB, {a.groups} head "
          f"groups, file backend in {a.dir}, median of {a.reps}")  # fmt: skip
    print(f"{'layout':<18} {'op':<4} {'whole GB/s':>10} {'groups GB/s':>11} {'ratio':>6}"
          f" {'copy GB/s':>10}")  # fmt: skip
    for layout, row in res.items():
        for op, copy in (("set", "gather_gbps"), ("get", "scatter_gbps")):
            r = row[op]
            c = row[copy]
            print(f"{layout:<18} {op:<4} {r['whole_gbps']:>10} {r['groups_gbps']:>11} "
                  f"{r['ratio']:>6} {c if c is not None else '-':>10}")  # fmt: skip


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
