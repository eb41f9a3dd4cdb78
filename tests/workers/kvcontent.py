"""The worker pages: a fixed namespace and pool shape that tests and worker processes agree on.

Content comes from :mod:`hicache_storage.conformance.data` (derived from the key, so any
reader can verify any page). The namespace is fixed, not the kit's per-run one, because a
worker is another process with another run id.
"""

from __future__ import annotations

import torch

from hicache_storage import HostKVPool, KVCacheNamespace, page_hashes
from hicache_storage.buffers import PageBuffer
from hicache_storage.conformance.data import content
from hicache_storage.conformance.data import fill_page as _fill_page

__all__ = ["KEY_UNIVERSE", "content", "fill_page", "namespace", "page_pool"]

KEY_UNIVERSE = page_hashes(list(range(64 * 4)), 4)  # 64 chained page hashes


def fill_page(page: PageBuffer | None, key: str, nbytes: int = 0) -> bytes:
    """Fill ``page`` with the key's content (or return it as bytes when page is None)."""
    return content(key, nbytes) if page is None else _fill_page(page, key)


def page_pool(num_pages: int) -> HostKVPool:
    """A page_first MHA pool of 48 KiB pages."""
    return HostKVPool(
        num_pages=num_pages, page_size=4, layer_num=6, kv_heads=4, head_dim=64, dtype=torch.bfloat16
    )


def namespace(pool: HostKVPool) -> KVCacheNamespace:
    """The namespace of the worker pages."""
    return KVCacheNamespace.for_pool(pool, model_id="crash-test")
