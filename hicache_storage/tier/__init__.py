"""Host/device tiering over any backend.

Device and host pools, the prefix index, prefetch (L3 -> L2), load (L2 -> L1), write
policies and backup (L2 -> L3).

Built on the protocol only: it never imports a backend or :mod:`hicache_storage.storekit`.
"""

from __future__ import annotations

from hicache_storage.tier.config import TierConfig, TierStats
from hicache_storage.tier.controller import Lease, PrefetchOp, TieredCache
from hicache_storage.tier.device import DevicePool, LayerProgress, host_page_layer
from hicache_storage.tier.index import PageEntry, PrefixIndex, PrefixMatch

__all__ = [
    "DevicePool",
    "LayerProgress",
    "Lease",
    "PageEntry",
    "PrefetchOp",
    "PrefixIndex",
    "PrefixMatch",
    "TierConfig",
    "TierStats",
    "TieredCache",
    "host_page_layer",
]
