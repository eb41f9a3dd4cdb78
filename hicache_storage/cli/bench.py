"""``hicache-storage bench``: v1 page throughput of any backend, every byte verified."""

from __future__ import annotations

import secrets
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hicache_storage.benchkit import BenchShape, fill_random, namespace_for, verify_pages
from hicache_storage.config import StorageConfig, redact_options
from hicache_storage.errors import HiCacheStorageError
from hicache_storage.keys import KVCacheNamespace, page_hashes
from hicache_storage.registry import create_backend

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from hicache_storage.protocol import HiCacheStorage

__all__ = ["PhaseResult", "build_backend", "run_bench", "timed_batches"]

STORAGE_BATCH_SIZE = 128  # the reference engine's largest batch


@dataclass
class PhaseResult:
    """Timing of one phase (set, exists or get) over all pages.

    ``page_bytes`` is what one successful page moves (0 for ``exists``). Every rate counts
    only the pages that succeeded: a phase where none did has no rate (``None``), so no
    figure is ever shown for work that did not happen.
    """

    name: str
    pages: int
    page_bytes: int
    seconds: float = 0.0
    ok: int = 0
    batch_seconds: list[float] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes of the pages that succeeded."""
        return self.ok * self.page_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary: GB/s (10^9 bytes per second), latencies in ms and us."""
        lat = sorted(self.batch_seconds)
        done = self.ok > 0 and self.seconds > 0
        return {
            "pages": self.pages,
            "ok": self.ok,
            "bytes": self.nbytes,
            "seconds": round(self.seconds, 6),
            "GBps": float(f"{self.nbytes / self.seconds / 1e9:.4g}")
            if done and self.nbytes
            else None,
            "pages_per_s": round(self.ok / self.seconds, 1) if done else None,
            "batch_ms_p50": round(statistics.median(lat) * 1e3, 3) if lat else None,
            "batch_ms_p99": round(lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))] * 1e3, 3)
            if lat
            else None,
            "page_us_mean": round(self.seconds / self.ok * 1e6, 1) if done else None,
        }


def build_backend(name: str, ns: KVCacheNamespace, options: dict[str, Any]) -> HiCacheStorage:
    """Build backend ``name`` in namespace ``ns`` with ``options``.

    Whatever its constructor raises becomes one :class:`HiCacheStorageError` (the message
    is the caller's to redact).
    """
    try:
        return create_backend(name, StorageConfig(namespace=ns), **options)
    except HiCacheStorageError:
        raise
    except Exception as exc:
        raise HiCacheStorageError(
            f"cannot create backend {name!r}: {type(exc).__name__}: {exc}"
        ) from exc


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
    result = PhaseResult(name, n, page_bytes if name != "exists" else 0)
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


def run_bench(
    backend_name: str,
    options: dict[str, Any],
    shape: BenchShape,
    *,
    progress: bool = True,
    keep: bool = False,
    backend: HiCacheStorage | None = None,
) -> dict[str, Any]:
    """Write ``shape.pages`` pages, check them, read them back and verify every byte.

    The pages are written with ``batch_set_v1``, checked with ``batch_exists`` and read
    back with ``batch_get_v1`` into other host pages.

    Everything that can be refused (the shape, the memory it needs, the backend and its
    options, the pool) is checked before the first page is written; the report's
    ``options`` has its secrets redacted.
    """
    from tqdm import tqdm

    shape.check_memory()  # before any allocation or I/O
    tenant = "bench-" + secrets.token_hex(4)
    ns = namespace_for(shape, tenant)
    b = backend if backend is not None else build_backend(backend_name, ns, options)
    try:
        pool = shape.pool(2 * shape.pages)
        src = pool.alloc(shape.pages * shape.page_size)
        dst = pool.alloc(shape.pages * shape.page_size)
        if src is None or dst is None:
            raise RuntimeError("benchmark pool too small")
        b.register_mem_pool_host(pool)
        fill_random(pool, seed=int.from_bytes(secrets.token_bytes(4), "little"))
        dst_pages = dst.view(-1, shape.page_size)
        src_pages = src.view(-1, shape.page_size)
        for page in pool.page_buffers(dst):  # zero the destination so stale bytes cannot pass
            for seg in page.segments:
                torch.frombuffer(seg.memoryview, dtype=torch.uint8).zero_()
        keys = page_hashes(
            torch.randint(0, 2**31 - 1, (shape.pages * shape.page_size,)).tolist(),
            shape.page_size,
        )
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
        "options": redact_options(options, getattr(type(b), "options_class", None)),
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
