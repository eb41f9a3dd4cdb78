"""Four deployments of one model, at TP 1, 2, 4 and 8 (gloo ranks in processes on
127.0.0.1), share one store through head-group pages: each writes its own prompt through
the tier, then every rank of every deployment prefetches every deployment's prompt and
gets its own heads of every page byte for byte."""

from __future__ import annotations

import multiprocessing
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_storage import HostKVPool, KVCacheNamespace, StorageConfig
from hicache_storage.registry import create_backend
from hicache_storage.tier import DevicePool, TierConfig, TieredCache
from hicache_storage.tier.device import host_page_layer

H, PS, LAYERS, DIM, PAGES = 8, 4, 2, 4, 5
SIZES = (1, 2, 4, 8)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tokens(tp: int) -> list[int]:
    return [tp * 1000 + t for t in range(PAGES * PS)]


def _kv(i: int, layer: int, half: int, heads: range, seed: int) -> torch.Tensor:
    """Page ``i``'s KV of ``heads`` in ``layer`` (what the deployment ``seed`` computes)."""
    t = torch.arange(PS).view(PS, 1, 1)
    h = torch.tensor(list(heads)).view(1, -1, 1)
    d = torch.arange(DIM).view(1, 1, DIM)
    value = (seed * 31 + i * 7 + layer * 3 + half * 5 + h * 11 + t * 13 + d) % 997
    return value.to(torch.float16)


def _rank(rank: int, tp: int, port: int, root: str, layout: str, barrier: Any, q: Any) -> None:
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    try:
        per = H // tp
        mine = range(rank * per, (rank + 1) * per)
        ns = KVCacheNamespace("tp-share", "float16", PS, layout, total_kv_heads=H)
        config = StorageConfig(
            namespace=ns, tp_rank=rank, tp_size=tp, extra_config={"head_groups": H}
        )
        backend = create_backend("file", config, root=root)

        def cache() -> tuple[TieredCache, HostKVPool]:
            host = HostKVPool(4 * PAGES, PS, LAYERS, per, DIM, dtype=torch.float16, layout=layout)
            device = DevicePool(host, 2 * PAGES)
            return TieredCache(backend, host, device, TierConfig(prefetch_threshold=0)), host

        writer, _ = cache()
        keys = writer.keys_of(_tokens(tp))

        def compute(i: int, page: int) -> None:
            for layer in range(LAYERS):
                for half, view in enumerate(writer.device.page_layer(page, layer)):
                    view.copy_(_kv(i, layer, half, mine, seed=tp))

        writer.release(writer.acquire(keys, compute))
        assert writer.flush(60)
        writer.close()
        barrier.wait(300)  # every deployment has written its prompt
        out = {}
        for other in SIZES:
            reader, host = cache()
            match = reader.match_prefix(reader.keys_of(_tokens(other)))
            op = reader.prefetch(match)
            taken = reader.finish_prefetch(op) if op is not None else 0
            exact = op is not None and all(
                torch.equal(view, _kv(i, layer, half, mine, seed=other))
                for i, hp in enumerate(op.host_pages[:taken])
                for layer in range(LAYERS)
                for half, view in enumerate(host_page_layer(host, hp, layer))
            )
            out[other] = (taken, exact)
            if op is not None:
                reader.release_prefetch(op)
            reader.close()
        q.put(((tp, rank), out))
        backend.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["page_head", "page_first"])
def test_tp_1_2_4_8_read_each_others_pages(tmp_path: Path, layout: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    barrier = ctx.Barrier(sum(SIZES))
    procs = []
    for tp in SIZES:
        port = _free_port()
        procs += [
            ctx.Process(
                target=_rank, args=(r, tp, port, str(tmp_path), layout, barrier, q), daemon=True
            )
            for r in range(tp)
        ]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert set(got) == {(tp, r) for tp in SIZES for r in range(tp)}
    for (tp, rank), reads in got.items():
        assert reads == dict.fromkeys(SIZES, (PAGES, True)), (tp, rank)
