"""``hicache-storage bench``: v1 page throughput of any backend, every byte verified."""

from __future__ import annotations

import secrets
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache_storage.backend import HiCacheStorage
from hicache_storage.config import StorageConfig
from hicache_storage.host_pool import HostKVPool
from hicache_storage.keys import KVCacheNamespace, page_hashes
from hicache_storage.registry import create_backend

__all__ = [
    "BenchShape",
    "PhaseResult",
    "fill_random",
    "namespace_for",
    "run_bench",
    "timed_batches",
]

STORAGE_BATCH_SIZE = 128  # the reference engine's largest batch


@dataclass(frozen=True)
class BenchShape:
    """Geometry of the benchmark's KV pages (defaults: 2 MiB bf16 pages, Llama-3-8B-like)."""

    pages: int = 128
    batch: int = 128
    page_size: int = 16
    layer_num: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    layout: str = "page_first"
    mla: bool = False

    def pool(self, num_pages: int) -> HostKVPool:
        """A host pool of ``num_pages`` pages of this shape."""
        return HostKVPool(
            num_pages=num_pages,
            page_size=self.page_size,
            layer_num=self.layer_num,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            dtype=getattr(torch, self.dtype),
            layout=self.layout,
            mla=self.mla,
        )


@dataclass
class PhaseResult:
    """Timing of one phase (set, exists or get) over all pages."""

    name: str
    pages: int
    nbytes: int
    seconds: float = 0.0
    ok: int = 0
    batch_seconds: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary: GB/s (10^9 bytes per second), latencies in ms and us."""
        lat = sorted(self.batch_seconds) or [0.0]
        p99 = lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))]
        return {
            "pages": self.pages,
            "ok": self.ok,
            "bytes": self.nbytes,
            "seconds": round(self.seconds, 6),
            "GBps": float(f"{self.nbytes / self.seconds / 1e9:.4g}")
            if self.seconds and self.nbytes
            else None,
            "pages_per_s": round(self.pages / self.seconds, 1) if self.seconds else None,
            "batch_ms_p50": round(statistics.median(lat) * 1e3, 3),
            "batch_ms_p99": round(p99 * 1e3, 3),
            "page_us_mean": round(self.seconds / self.pages * 1e6, 1) if self.pages else None,
        }


def namespace_for(shape: BenchShape, tenant: str) -> KVCacheNamespace:
    """The namespace of a benchmark run (a fresh tenant keeps runs apart)."""
    return KVCacheNamespace(
        model_id="hicache-storage-bench",
        dtype=shape.dtype,
        page_size=shape.page_size,
        object_layout=shape.layout,
        rank_replicated=shape.mla,
        tenant=tenant,
    )


def fill_random(pool: HostKVPool, seed: int = 0) -> None:
    """Fill the whole pool with random bytes."""
    gen = torch.Generator().manual_seed(seed)
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))


def batches(n: int, size: int) -> Iterator[slice]:
    """Slices of ``range(n)`` of at most ``size``."""
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


def timed_batches(
    name: str,
    n: int,
    batch: int,
    page_bytes: int,
    call: Callable[[slice], Sequence[bool] | int],
    progress: Any = None,
) -> PhaseResult:
    """Run ``call`` on each batch slice, timing each; count successes."""
    result = PhaseResult(name, n, n * page_bytes if name != "exists" else 0)
    t_all = time.perf_counter()
    for sl in batches(n, batch):
        t0 = time.perf_counter()
        r = call(sl)
        result.batch_seconds.append(time.perf_counter() - t0)
        result.ok += r if isinstance(r, int) else sum(bool(x) for x in r)
        if progress is not None:
            progress.update(sl.stop - sl.start)
    result.seconds = time.perf_counter() - t_all
    return result


def verify_pages(pool: HostKVPool, src: torch.Tensor, dst: torch.Tensor) -> int:
    """Compare every byte of the pages at ``src`` and ``dst`` indices; return mismatching pages."""
    bad = 0
    for a, b in zip(pool.page_buffers(src), pool.page_buffers(dst), strict=False):
        for sa, sb in zip(a.segments, b.segments, strict=False):
            ta = torch.frombuffer(sa.memoryview, dtype=torch.uint8)
            tb = torch.frombuffer(sb.memoryview, dtype=torch.uint8)
            if not torch.equal(ta, tb):
                bad += 1
                break
    return bad


def run_bench(
    backend_name: str,
    options: dict[str, Any],
    shape: BenchShape,
    *,
    progress: bool = True,
    keep: bool = False,
    backend: HiCacheStorage | None = None,
) -> dict[str, Any]:
    """Write ``shape.pages`` pages with ``batch_set_v1``, check them with ``batch_exists``,
    read them back with ``batch_get_v1`` into other host pages, and verify every byte."""
    from tqdm import tqdm

    tenant = "bench-" + secrets.token_hex(4)
    ns = namespace_for(shape, tenant)
    pool = shape.pool(2 * shape.pages)
    fill_random(pool, seed=int.from_bytes(secrets.token_bytes(4), "little"))
    src = pool.alloc(shape.pages * shape.page_size)
    dst = pool.alloc(shape.pages * shape.page_size)
    if src is None or dst is None:
        raise RuntimeError("benchmark pool too small")
    dst_pages = dst.view(-1, shape.page_size)
    src_pages = src.view(-1, shape.page_size)
    for page in pool.page_buffers(dst):  # zero the destination so stale bytes cannot pass
        for seg in page.segments:
            torch.frombuffer(seg.memoryview, dtype=torch.uint8).zero_()
    keys = page_hashes(
        torch.randint(0, 2**31 - 1, (shape.pages * shape.page_size,)).tolist(), shape.page_size
    )
    b = (
        backend
        if backend is not None
        else create_backend(backend_name, StorageConfig(namespace=ns), **options)
    )
    try:
        b.register_mem_pool_host(pool)
        b.get_stats(reset=True)
        pb = pool.page_bytes

        def bar(desc: str) -> Any:
            return tqdm(
                total=shape.pages, desc=desc, unit="page", leave=False, disable=not progress
            )

        with bar("set") as p:
            set_r = timed_batches(
                "set", shape.pages, shape.batch, pb,
                lambda sl: b.batch_set_v1(keys[sl], src_pages[sl].reshape(-1)), p,
            )  # fmt: skip
        exists_r = timed_batches(
            "exists", shape.pages, STORAGE_BATCH_SIZE, pb, lambda sl: b.batch_exists(keys[sl])
        )
        with bar("get") as p:
            get_r = timed_batches(
                "get", shape.pages, shape.batch, pb,
                lambda sl: b.batch_get_v1(keys[sl], dst_pages[sl].reshape(-1)), p,
            )  # fmt: skip
        bad = verify_pages(pool, src, dst)
        stats = b.get_stats(reset=True).to_dict()
        if not keep and b.capabilities.delete:
            b.clear()
    finally:
        if backend is None:
            b.close()
    return {
        "backend": backend_name,
        "options": options,
        "namespace": ns.digest,
        "pool": pool.describe(),
        "pages": shape.pages,
        "batch": shape.batch,
        "page_bytes": pool.page_bytes,
        "set": set_r.to_dict(),
        "exists": exists_r.to_dict(),
        "get": get_r.to_dict(),
        "verified_pages": shape.pages - bad,
        "mismatched_pages": bad,
        "ok": set_r.ok == shape.pages
        and get_r.ok == shape.pages
        and exists_r.ok == shape.pages
        and bad == 0,
        "stats": stats,
    }
