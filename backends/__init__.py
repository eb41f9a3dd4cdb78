"""Built-in storage backends, installed as ``hicache_storage.backends``.

Each backend lives in its own private module and imports only the core
(``hicache_storage``) and, lazily, its own client library. Classes are re-exported here
lazily, so importing this package imports no backend module.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "FileBackend",
    "FileOptions",
    "MemoryBackend",
    "MemoryOptions",
    "MmapBackend",
    "MmapOptions",
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
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
