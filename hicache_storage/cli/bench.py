"""``hicache-storage bench``: v1 page throughput of any backend, every byte verified."""

from __future__ import annotations

import difflib
import os
import re
import secrets
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hicache_storage.config import StorageConfig, redact_options
from hicache_storage.errors import ConfigError, HiCacheStorageError
from hicache_storage.host_pool import HostKVPool
from hicache_storage.keys import KVCacheNamespace, page_hashes
from hicache_storage.layouts import LAYOUTS, MLA_LAYOUTS
from hicache_storage.registry import create_backend

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from hicache_storage.protocol import HiCacheStorage

__all__ = [
    "BenchShape",
    "PhaseResult",
    "available_memory",
    "build_backend",
    "dtype_name",
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

    def __post_init__(self) -> None:
        """Check every field and normalize ``dtype``; :class:`ConfigError` for a bad value."""
        for name in ("pages", "batch", "page_size", "layer_num", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.layout not in LAYOUTS:
            raise ConfigError(f"unknown layout {self.layout!r}; choose one of {list(LAYOUTS)}")
        if self.mla and self.layout not in MLA_LAYOUTS:
            raise ConfigError(
                f"an MLA pool has no {self.layout!r} layout; choose one of {list(MLA_LAYOUTS)}"
            )

    @property
    def page_bytes(self) -> int:
        """Bytes of one KV page of this shape."""
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        heads, halves = (1, 1) if self.mla else (self.kv_heads, 2)
        return halves * self.layer_num * self.page_size * heads * self.head_dim * itemsize

    @property
    def host_bytes(self) -> int:
        """Host memory the benchmark allocates: source and destination pages."""
        return 2 * self.pages * self.page_bytes

    def check_memory(self) -> None:
        """Raise :class:`ConfigError` when the pages do not fit in the available memory."""
        need, avail = self.host_bytes, available_memory()
        if avail is not None and need > avail:
            raise ConfigError(
                f"the benchmark needs {_gib(need)} of host memory (2 x {self.pages} pages of "
                f"{_gib(self.page_bytes)}) but {_gib(avail)} is available: lower --pages or "
                "the page geometry"
            )

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


def _gib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n < 2**30 else f"{n / 2**30:.1f} GiB"


def dtype_name(dtype: object) -> str:
    """The canonical torch dtype name of ``dtype``.

    ``dtype`` may be a name (``"bfloat16"``, ``"torch.half"``) or a dtype
    (``torch.float8_e4m3fn``). Raises :class:`ConfigError` if it is not a dtype that a KV
    pool can hold.
    """
    text = str(dtype).strip().removeprefix("torch.")
    obj = getattr(torch, text, None) if text and not text.startswith("_") else None
    if not isinstance(obj, torch.dtype):
        names = sorted(n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype))
        near = difflib.get_close_matches(text, names, n=3)
        hint = f"did you mean {' or '.join(map(repr, near))}? " if near else ""
        raise ConfigError(
            f"unknown dtype {str(dtype)!r}; {hint}use a torch dtype such as bfloat16, "
            "float16, float32 or float8_e4m3fn"
        )
    name = str(obj).removeprefix("torch.")
    integer = re.fullmatch(r"u?int(8|16|32|64)", name) is not None  # no sub-byte ints
    if not (obj.is_floating_point or integer) or obj.is_complex:
        raise ConfigError(
            f"dtype {text!r} cannot hold a KV pool; use a floating-point or integer dtype"
        )
    try:  # sub-byte and other exotic dtypes cannot back a byte-addressed pool
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.zeros(2, dtype=obj).view(torch.uint8)
    except (RuntimeError, TypeError):
        raise ConfigError(
            f"dtype {text!r} cannot hold a KV pool here (torch cannot allocate or view it)"
        ) from None
    return name


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (``MemAvailable``), if known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


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
