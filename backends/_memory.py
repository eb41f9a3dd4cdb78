"""The ``memory`` backend: pages in a dict of this process (tests, tiering experiments).

Nothing survives the process and no other process sees the pages. Instances built with
the same ``store`` name (default ``"default"``) share one store, as a process-wide
registry of named stores: two instances of one namespace see each other's pages, as two
engine ranks on one host would with a shared backend; namespaces stay apart because
every page's name starts with its namespace digest. Options and guarantees:
``docs/backends/memory.md``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from hicache_storage.errors import ConfigError
from hicache_storage.protocol import Capabilities
from hicache_storage.storekit.blobstore import PRESENT, BlobOptions, BlobStore, Present, Segments

if TYPE_CHECKING:
    from collections.abc import Sequence

    from hicache_storage.config import StorageConfig
    from hicache_storage.keys import ObjectName

__all__ = ["MemoryBackend", "MemoryOptions"]

#: store name -> (lock, namespace digest -> object name -> stored value)
_STORES: dict[str, tuple[threading.Lock, dict[str, dict[str, bytes]]]] = {}
_STORES_LOCK = threading.Lock()


@dataclass(frozen=True)
class MemoryOptions(BlobOptions):
    """Options of the ``memory`` backend (environment: ``HICACHE_STORAGE_MEMORY_<NAME>``).

    Attributes:
        store: name of the process-wide store to use; instances with the same name share
            their pages, other names are separate stores.
        checksum: payload checksum, ``"xxh3"`` (default: flipped bytes read as a miss) or
            ``"none"`` (the explicit opt-out: lengths and names are still checked).
    """

    store: str = "default"

    def __post_init__(self) -> None:
        if not self.store:
            raise ConfigError("store must not be empty")


class MemoryBackend(BlobStore[MemoryOptions]):
    """Pages as ``bytes`` in a process-wide dict behind a lock (one copy in, one out)."""

    name = "memory"
    capabilities = Capabilities(delete=True)
    options_class = MemoryOptions

    def __init__(self, config: StorageConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        with _STORES_LOCK:
            self._lock, spaces = _STORES.setdefault(self.options.store, (threading.Lock(), {}))
            self._pages = spaces.setdefault(self.namespace.digest, {})

    @override
    def _get_blobs(self, names: list[ObjectName]) -> Sequence[bytes | None]:
        with self._lock:
            return [self._pages.get(n.path) for n in names]

    @override
    def _put_blobs_if_absent(
        self, names: list[ObjectName], blobs: list[Segments]
    ) -> list[bool | Present]:
        values = [b"".join(segments) for segments in blobs]  # the copy, outside the lock
        out: list[bool | Present] = []
        with self._lock:
            for n, value in zip(names, values, strict=True):
                out.append(True if self._pages.setdefault(n.path, value) is value else PRESENT)
        return out

    @override
    def _exists_blobs(self, names: list[ObjectName]) -> list[bool]:
        with self._lock:
            return [n.path in self._pages for n in names]

    @override
    def _delete_blobs(self, names: list[ObjectName]) -> list[bool]:
        with self._lock:
            return [self._pages.pop(n.path, None) is not None for n in names]

    @override
    def usage(self) -> dict[str, int]:
        """The protocol's figures for this namespace's values (headers included); no limit."""
        with self._lock:
            return {
                "objects": len(self._pages),
                "used_bytes": sum(map(len, self._pages.values())),
                "limit_bytes": 0,
            }

    @override
    def _clear_namespace(self) -> None:
        with self._lock:
            self._pages.clear()  # this namespace's pages: every name in it has the prefix
