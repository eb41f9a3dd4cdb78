"""The tiered workload, small, on any backend: for the tests of backends that need a
server (their test files start it)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from hicache_storage import HostKVPool, KVCacheNamespace, StorageConfig, create_backend
from hicache_storage.tier import DevicePool, TierConfig, TieredCache
from hicache_storage.tier.workload import RunResult, Workload, replay

__all__ = ["SMALL", "replay_small"]

SMALL = Workload(sessions=4, turns=3, system_prompts=2, system_tokens=64, user_tokens=16,
                 answer_tokens=16)  # fmt: skip


def replay_small(
    name: str,
    options: dict[str, Any],
    wrap: Callable[[Any], Any] | None = None,
    prefetch_policy: str = "timeout",
) -> tuple[RunResult, TieredCache]:
    """Replay :data:`SMALL` through tiers over backend ``name`` (wrapped by ``wrap``, a
    fault injector say); returns the result and the (closed) cache.

    ``wait_complete``: every prefetch lands, however loaded the machine (the default's
    timeout can cut them all on a busy one).
    """
    host = HostKVPool(num_pages=48, page_size=8, layer_num=2, kv_heads=2, head_dim=16)
    ns = KVCacheNamespace.for_pool(host, model_id="wl", tenant=uuid.uuid4().hex[:8])
    backend = create_backend(name, StorageConfig(namespace=ns), **options)
    store = wrap(backend) if wrap is not None else backend
    cache = TieredCache(
        store,
        host,
        DevicePool(host, 32),
        TierConfig(prefetch_threshold=0, prefetch_policy=prefetch_policy),  # type: ignore[arg-type]
    )
    try:
        result = replay(cache, SMALL)
    finally:
        cache.close()
        backend.clear()
        backend.close()
    return result, cache
