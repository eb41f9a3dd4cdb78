"""The namespace and forged pages of the file/shm safety tests, shared with the processes
those tests start as other users (a fixed tenant: they are other processes)."""

from __future__ import annotations

from hicache_storage.conformance.data import make_pool, pool_namespace
from hicache_storage.keys import object_name
from hicache_storage.storekit.header import algorithm_id, checksum, encode_header

__all__ = ["NS", "POOL", "page_file_bytes"]

POOL = make_pool(num_pages=8)
NS = pool_namespace(POOL, tenant="file-safety")


def page_file_bytes(payload: bytes, algorithm: str = "xxh3", key: str = "victim-key") -> bytes:
    """A well-formed stored object (header + payload) for ``key`` in NS, as an attacker
    would forge it (the name digest is public: forging it is easy)."""
    alg = algorithm_id(algorithm)
    name = object_name(NS.digest, key, None).path
    return encode_header(len(payload), checksum([memoryview(payload)], alg), alg, name) + payload
