"""The shape of a page benchmark and its checks, for the CLI's bench and ``benchmarks/``.

``hicache-storage bench`` and the scripts in ``benchmarks/`` share these.

:class:`BenchShape` is the geometry of the KV pages (a host pool of it, its page bytes,
whether it fits in memory); :func:`namespace_for` the namespace of one run;
:func:`fill_random` and :func:`verify_pages` fill a pool and compare pages byte for byte.
"""

from __future__ import annotations

import difflib
import os
import re
import warnings
from dataclasses import dataclass

import torch

from hicache_storage.errors import ConfigError
from hicache_storage.host_pool import HostKVPool
from hicache_storage.keys import KVCacheNamespace
from hicache_storage.layouts import LAYOUTS, MLA_LAYOUTS

__all__ = [
    "BenchShape",
    "available_memory",
    "dtype_name",
    "fill_random",
    "namespace_for",
    "verify_pages",
]


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


def fill_random(pool: HostKVPool, seed: int = 0) -> None:
    """Fill the whole pool with random bytes."""
    gen = torch.Generator().manual_seed(seed)
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))


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
