"""hicache-storage: the L3 tier of an LLM KV cache.

Public API (engine- and vendor-facing)::

    from hicache_storage import (
        HiCacheStorage, Capabilities, StorageConfig, KVCacheNamespace, page_hashes,
        create_backend, available_backends, HostKVPool, PageBuffer, WrapperBackend,
    )

``HostKVPool`` needs torch and is imported lazily, so ``import hicache_storage`` stays
light (the conformance plugin imports it in every pytest session).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hicache_storage.buffers import PageBuffer, Segment
from hicache_storage.config import StorageConfig, load_extra_config, parse_size
from hicache_storage.keys import (
    KVCacheNamespace,
    ObjectName,
    object_name,
    page_hashes,
    storage_namespace_seed,
    validate_key,
)
from hicache_storage.protocol import Capabilities, HiCacheStorage
from hicache_storage.registry import available_backends, create_backend, load_backend_class
from hicache_storage.stats import StorageStats
from hicache_storage.wrapper import WrapperBackend

if TYPE_CHECKING:
    from hicache_storage.host_pool import HostKVPool

__version__ = "0.1.0"

__all__ = [
    "Capabilities",
    "HiCacheStorage",
    "HostKVPool",
    "KVCacheNamespace",
    "ObjectName",
    "PageBuffer",
    "Segment",
    "StorageConfig",
    "StorageStats",
    "WrapperBackend",
    "__version__",
    "available_backends",
    "create_backend",
    "load_backend_class",
    "load_extra_config",
    "object_name",
    "page_hashes",
    "parse_size",
    "storage_namespace_seed",
    "validate_key",
]


def __getattr__(name: str) -> Any:
    if name == "HostKVPool":
        from hicache_storage.host_pool import HostKVPool

        return HostKVPool
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
