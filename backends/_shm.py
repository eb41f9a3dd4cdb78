"""The ``shm`` backend: pages in shared memory (``/dev/shm``), shared by every process on the node.

One tmpfs file per page under a per-namespace directory, published atomically like the
``file`` backend, so any process on the node that uses the same namespace reads what
another wrote: two engine processes reuse each other's KV without a network service.
Reads and writes are one copy each (``preadv``/``writev`` between the host pool and the
tmpfs pages, no intermediate buffer). A capacity bound is always on: by default half of
the tmpfs, and at least a tenth of it kept free, so the store never fills ``/dev/shm``.
Options and guarantees: ``docs/backends/shm.md``.
"""

from __future__ import annotations

import grp
import os
from dataclasses import dataclass
from typing import Any, Literal

from hicache_storage.backend import Capabilities
from hicache_storage.errors import ConfigError
from hicache_storage.filestore import FileStore, FileStoreOptions

__all__ = ["ShmBackend", "ShmOptions"]


@dataclass(frozen=True)
class ShmOptions(FileStoreOptions):
    """Options of the ``shm`` backend (environment: ``HICACHE_STORAGE_SHM_<NAME>``).

    Attributes:
        directory: a directory on a tmpfs (default ``/dev/shm/hicache-storage``).
        max_size: cap on this namespace's bytes; default half of the tmpfs.
        min_free_space: free space always left on the tmpfs; default a tenth of it.
        group: share with this group (name or gid): files 0640, directories 2770 owned by
            the group; default private (0600 / 0700).
        checksum: default ``"none"``: memory has no media errors, and torn objects are
            already impossible (atomic publish) and detected by length (header).
        recycle: when full, evict by overwriting the least-recently-used page's tmpfs
            file with the new page (when no reader holds it) instead of freeing it and
            allocating a new one: about 1.5x faster writes, and faster reads of the result.
        (and the other options of :class:`~hicache_storage.filestore.FileStoreOptions`.)
    """

    directory: str = "/dev/shm/hicache-storage"
    group: str | None = None
    recycle: bool = True
    checksum: Literal["xxh3", "none"] = "none"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.directory:
            raise ConfigError("directory must not be empty")


def _group_id(group: str) -> int:
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"unknown group {group!r}") from None


class ShmBackend(FileStore):
    """Pages as tmpfs files in ``/dev/shm``: node-local, shared by processes, memory speed."""

    name = "shm"
    capabilities = Capabilities(zero_copy=True, delete=True, persistent=True, shared=True)
    options_class = ShmOptions
    persist_recency = False  # a read costs no inode update; recency restarts with the node
    recycles_files = True  # readers lock and re-check (see FileStore._open_published)

    def _location(self, opts: Any) -> str:
        directory: str = opts.directory
        return directory

    def _configure(self, opts: Any) -> None:
        self.recycle = bool(opts.recycle)
        if opts.group is not None:
            self.group_id = _group_id(str(opts.group))
            self.file_mode = 0o640
            self.dir_mode = 0o2770

    def _limits(self, opts: FileStoreOptions) -> tuple[int | None, int]:
        os.makedirs(self._location(opts), mode=self.dir_mode, exist_ok=True)
        st = os.statvfs(self._location(opts))
        total = st.f_blocks * st.f_frsize
        max_size = opts.max_size if opts.max_size is not None else total // 2
        min_free = opts.min_free_space if opts.min_free_space is not None else total // 10
        return max_size, min_free
