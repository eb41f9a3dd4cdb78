"""Two ranks (gloo, two processes on 127.0.0.1) agree on storage hits and on completed
prefetches by MIN all-reduce, including a rank that has no hits at all."""

from __future__ import annotations

import multiprocessing
import os
import socket
from pathlib import Path
from typing import Any

import torch

from hicache_storage import HostKVPool, KVCacheNamespace, StorageConfig
from hicache_storage.backends import FileBackend
from hicache_storage.tier import DevicePool, TierConfig, TieredCache

PS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, port: int, root: str, stored: int, q: Any) -> None:
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        host = HostKVPool(num_pages=32, page_size=PS, layer_num=2, kv_heads=2, head_dim=8)
        ns = KVCacheNamespace.for_pool(host, model_id="ranks", tenant=f"rank{rank}")
        backend = FileBackend(StorageConfig(namespace=ns), root=root)
        tokens = torch.arange(10 * PS).tolist()
        cache = TieredCache(backend, host, DevicePool(host, 16), TierConfig(prefetch_threshold=0))
        keys = cache.keys_of(tokens)
        # This rank's store holds the first `stored` pages (written by another instance).
        writer = TieredCache(
            backend, HostKVPool(num_pages=32, page_size=PS, layer_num=2, kv_heads=2, head_dim=8),
            DevicePool(host, 16),
        )  # fmt: skip
        if stored:
            lease = writer.acquire(keys[:stored], lambda i, page: None)
            writer.release(lease)
            writer.flush(30)
        writer.close()
        out = []
        for _ in range(2):  # twice: the second round agrees again, no stray reduce
            match = cache.match_prefix(keys)
            op = cache.prefetch(match)
            taken = cache.finish_prefetch(op) if op is not None else None
            if op is not None:
                cache.release_prefetch(op)
            out.append((match.logical_pages, op is None, taken))
            cache.index.entries.clear()  # forget, so the next round asks storage again
            if op is not None:
                for p in op.host_pages[:taken]:
                    host.free(torch.arange(p * PS, (p + 1) * PS))
        q.put((rank, out))
        cache.close()
        backend.close()
    finally:
        dist.destroy_process_group()


def _rank_reuse(rank: int, port: int, root: str, stored: int, q: Any) -> None:
    """Both stores hold the whole prompt; rank 0 also holds its first 3 pages on the host:
    both ranks must still reuse the same number of pages."""
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        host = HostKVPool(num_pages=32, page_size=PS, layer_num=2, kv_heads=2, head_dim=8)
        ns = KVCacheNamespace.for_pool(host, model_id="ranks", tenant=f"reuse{rank}")
        backend = FileBackend(StorageConfig(namespace=ns), root=root)
        keys = [f"{i:064x}" for i in range(10)]
        writer = TieredCache(
            backend, HostKVPool(num_pages=32, page_size=PS, layer_num=2, kv_heads=2, head_dim=8),
            DevicePool(host, 16),
        )  # fmt: skip
        writer.release(writer.acquire(keys, lambda i, page: None))
        writer.flush(30)
        writer.close()
        cache = TieredCache(backend, host, DevicePool(host, 16), TierConfig(prefetch_threshold=0))
        if rank == 0:
            cache.release(cache.acquire(keys[:3], lambda i, page: None))
        match = cache.match_prefix(keys)
        op = cache.prefetch(match)
        taken = cache.finish_prefetch(op) if op is not None else 0
        lease = cache.acquire(
            keys, lambda i, page: None, reuse_limit=match.host_pages + taken, prefetched=op
        )
        q.put((rank, (match.host_pages, taken, lease.reused)))
        cache.release(lease)
        cache.close()
        backend.close()
    finally:
        dist.destroy_process_group()


def run_ranks(tmp_path: Path, stored: tuple[int, int], target: Any = _rank) -> dict[int, Any]:
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=target, args=(r, port, str(tmp_path / f"r{r}"), stored[r], q))
        for r in (0, 1)
    ]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return results


def test_a_rank_with_zero_hits_makes_both_miss(tmp_path: Path) -> None:
    got = run_ranks(tmp_path, (10, 0))
    assert got[0] == got[1] == [(0, True, None)] * 2


def test_ranks_take_the_shorter_run(tmp_path: Path) -> None:
    got = run_ranks(tmp_path, (10, 6))
    assert got[0] == got[1] == [(6, False, 6)] * 2


def test_ranks_reuse_the_same_pages_when_one_holds_more_on_its_host(tmp_path: Path) -> None:
    got = run_ranks(tmp_path, (0, 0), _rank_reuse)
    assert got[0][2] == got[1][2] == 10
    assert got[0][:2] == got[1][:2] == (0, 10)  # the host prefix agreed: MIN(3, 0)
