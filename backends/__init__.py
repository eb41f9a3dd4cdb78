"""Built-in storage backends, installed as ``hicache_storage.backends``.

Each backend lives in its own private module (or package) and imports the core, the
building blocks of :mod:`hicache_storage.storekit` and, lazily, its own client library;
never another backend. Classes are re-exported here lazily, so importing this package
imports no backend module (type checkers see the real classes).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache_storage.backends._file import FileBackend, FileOptions
    from hicache_storage.backends._memory import MemoryBackend, MemoryOptions
    from hicache_storage.backends._mmap import MmapBackend, MmapOptions
    from hicache_storage.backends._mooncake import MooncakeBackend, MooncakeOptions
    from hicache_storage.backends._nixl import NixlBackend, NixlOptions
    from hicache_storage.backends._redis import RedisBackend, RedisOptions
    from hicache_storage.backends._s3 import S3Backend, S3Options
    from hicache_storage.backends._shm import ShmBackend, ShmOptions

__all__ = [
    "FileBackend",
    "FileOptions",
    "MemoryBackend",
    "MemoryOptions",
    "MmapBackend",
    "MmapOptions",
    "MooncakeBackend",
    "MooncakeOptions",
    "NixlBackend",
    "NixlOptions",
    "RedisBackend",
    "RedisOptions",
    "S3Backend",
    "S3Options",
    "ShmBackend",
    "ShmOptions",
]

_LAZY = {
    "FileBackend": "hicache_storage.backends._file",
    "FileOptions": "hicache_storage.backends._file",
    "MemoryBackend": "hicache_storage.backends._memory",
    "MemoryOptions": "hicache_storage.backends._memory",
    "ShmBackend": "hicache_storage.backends._shm",
    "MmapBackend": "hicache_storage.backends._mmap",
    "MmapOptions": "hicache_storage.backends._mmap",
    "ShmOptions": "hicache_storage.backends._shm",
    "RedisBackend": "hicache_storage.backends._redis",
    "RedisOptions": "hicache_storage.backends._redis",
    "MooncakeBackend": "hicache_storage.backends._mooncake",
    "MooncakeOptions": "hicache_storage.backends._mooncake",
    "NixlBackend": "hicache_storage.backends._nixl",
    "NixlOptions": "hicache_storage.backends._nixl",
    "S3Backend": "hicache_storage.backends._s3",
    "S3Options": "hicache_storage.backends._s3",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
