"""The ``redis`` backend: pages as values of a Redis (or Valkey) server.

Built on :class:`~hicache_storage.storekit.blobstore.BlobStore`: every value is the core
header then the page, so a truncated, foreign, renamed or evicted value is a miss, never
wrong bytes. Keys are ``<prefix><namespace digest>/<fan-out>/<leaf>``; every batch is one
round trip (a pipeline of ``GETRANGE`` bounded by the page's size, ``SET NX`` with
``STRLEN``, ``STRLEN`` or ``UNLINK``; ``MGET`` for reads without a target), and
``clear()`` removes this namespace's keys only, by ``SCAN`` and ``UNLINK`` in batches
(never ``KEYS`` or ``FLUSHDB``). Options and guarantees: ``docs/backends/redis.md``.
"""

from __future__ import annotations

from hicache_storage.backends._redis.backend import RedisBackend
from hicache_storage.backends._redis.options import RedisOptions

__all__ = ["RedisBackend", "RedisOptions"]
