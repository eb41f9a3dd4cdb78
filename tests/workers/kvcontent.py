"""Deterministic page content derived from the key, shared by tests and worker processes."""

from __future__ import annotations

import hashlib

import torch

from hicache_storage import HostKVPool, KVCacheNamespace, page_hashes
from hicache_storage.buffers import PageBuffer

KEY_UNIVERSE = page_hashes(list(range(64 * 4)), 4)  # 64 chained page hashes


def content(key: str, nbytes: int) -> bytes:
    """``nbytes`` bytes that only ``key`` produces."""
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def fill_page(page: PageBuffer | None, key: str, nbytes: int = 0) -> bytes:
    """Fill ``page`` with the key's content (or return it as bytes when page is None)."""
    data = content(key, page.nbytes if page is not None else nbytes)
    if page is not None:
        off = 0
        for seg in page.segments:
            seg.memoryview[:] = data[off : off + seg.nbytes]
            off += seg.nbytes
    return data


def page_pool(num_pages: int) -> HostKVPool:
    """A page_first MHA pool of 48 KiB pages."""
    return HostKVPool(
        num_pages=num_pages, page_size=4, layer_num=6, kv_heads=4, head_dim=64, dtype=torch.bfloat16
    )


def namespace(pool: HostKVPool) -> KVCacheNamespace:
    """The namespace of the worker pages."""
    return KVCacheNamespace(
        model_id="crash-test", dtype="bfloat16", page_size=pool.page_size, object_layout=pool.layout
    )
