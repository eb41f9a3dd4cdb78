"""The ``shm`` backend: pages in shared memory (``/dev/shm``), shared by every process on the node.

One tmpfs file per page under a per-namespace directory, published atomically like the
``file`` backend, so any process on the node that uses the same namespace reads what
another wrote: two engine processes reuse each other's KV without a network service.
Reads and writes are one copy each (``preadv``/``writev`` between the host pool and the
tmpfs pages, no intermediate buffer). A capacity bound is always on and covers the whole
store directory (every namespace): by default half of the tmpfs, and at least a tenth of
it kept free, checked under a lock shared by every process so that the store never fills
``/dev/shm``. Options and guarantees: ``docs/backends/shm.md``.
"""

from __future__ import annotations

import grp
import logging
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from hicache_storage.errors import ConfigError
from hicache_storage.protocol import Capabilities
from hicache_storage.storekit.filestore import FileTreeOptions, FileTreeStore
from hicache_storage.storekit.pathsafety import user_dir

if TYPE_CHECKING:
    from hicache_storage.config import StorageConfig

__all__ = ["ShmBackend", "ShmOptions"]

logger = logging.getLogger(__name__)

#: Filesystems that keep files in memory: what ``root`` is meant to be on.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})
_warned_not_in_memory: set[str] = set()
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class ShmOptions(FileTreeOptions):
    """Options of the ``shm`` backend (environment: ``HICACHE_STORAGE_SHM_<NAME>``).

    Attributes:
        root: the store's directory, on a tmpfs. Default ``/dev/shm/hicache-storage-<uid>``
            (private), or with ``group``, ``/dev/shm/hicache-storage-g<gid>`` (so every
            member finds the same store).
        max_size: cap on the bytes of the whole root (every namespace); default half
            of the tmpfs.
        min_free_space: free space always left on the tmpfs; default a tenth of it.
        namespace_max_size: cap on this namespace's bytes (a tenant's share of the
            root, every shard); a write that would cross it evicts the namespace's own
            least-recently-used pages, never another's. Each instance holds its own
            namespace to it. Default: none (only ``max_size`` for the whole root).
        group: share with this group (a name, or a gid as an int or a string of digits):
            files 0640, directories 2770 owned by the group; default private (0600 / 0700).
        checksum: payload checksum, ``"xxh3"`` (default: flipped bytes read as a miss) or
            ``"none"`` (the explicit opt-out: only lengths and headers are checked).
        recycle: when full, evict by overwriting the least-recently-used page's tmpfs
            file with the new page (when no reader holds it) instead of freeing it and
            allocating a new one: about 1.5x faster writes, and faster reads of the result.
        (and the other options of :class:`~hicache_storage.storekit.filestore.FileTreeOptions`.)
    """

    root: str | None = None
    # Any: a name or a gid (int); the option parser passes it through, checked below.
    group: Any = None
    recycle: bool = True

    @override
    def __post_init__(self) -> None:
        super().__post_init__()
        if self.root is not None and not self.root:
            raise ConfigError("root must not be empty")
        if self.group is not None:
            _group_id(self.group)


def _group_id(group: object) -> int:
    """The gid named by ``group``: an int, a string of digits, or a group name."""
    if isinstance(group, bool) or not isinstance(group, (int, str)):
        raise ConfigError(f"group must be a group name or a gid, got {group!r}")
    if isinstance(group, int) or (group.isascii() and group.isdigit()):
        gid = int(group)
        if not 0 <= gid < 2**32 - 1:
            raise ConfigError(f"group {group!r} is not a valid gid")
        return gid
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"unknown group {group!r}") from None


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem that holds ``path`` (``tmpfs``, ``ext4``...), or None.

    It is read from ``/proc/self/mountinfo`` (the last mount on the longest matching mount
    point); None when it cannot be told.
    """
    try:
        real = os.path.realpath(path)
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return None
    best, fstype = -1, None
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        point = _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best:
            best, fstype = len(point), right.split()[0]
    return fstype


class ShmBackend(FileTreeStore[ShmOptions]):
    """Pages as tmpfs files in ``/dev/shm``: node-local, shared by processes, memory speed."""

    name = "shm"
    capabilities = Capabilities(zero_copy=True, delete=True, persistent=True, shared=True)
    options_class = ShmOptions
    recycles_files = True  # readers lock and re-check (see FileTreeStore._open_published)
    capacity_per_root = True  # one LRU and one cap for every namespace: no writer starves
    serialize_free_space = True  # the floor holds with any number of writer processes

    def __init__(self, config: StorageConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        self._warn_unless_in_memory()

    def _warn_unless_in_memory(self) -> None:
        """Warn, once per directory and process, when ``root`` is not on a tmpfs.

        The store works there too, but its pages then go to a disk, and the defaults (half of
        the filesystem, a tenth kept free) were meant for memory.
        """
        fstype = filesystem_type(self.root)
        if fstype is None or fstype in MEMORY_FILESYSTEMS or self.root in _warned_not_in_memory:
            return
        _warned_not_in_memory.add(self.root)
        logger.warning(
            "shm directory %s is on a %s filesystem, not a tmpfs: pages go to that "
            "filesystem, and max_size/min_free_space default to half and a tenth of it; "
            "use a directory in /dev/shm (or another tmpfs), or the file backend",
            self.root,
            fstype,
        )

    @override
    def _location(self, opts: ShmOptions) -> str:
        if opts.root is not None:
            return opts.root
        if self.group_id is not None:
            return f"/dev/shm/hicache-storage-g{self.group_id}"
        return user_dir("/dev/shm", "hicache-storage")

    @override
    def _configure(self, opts: ShmOptions) -> None:
        self.recycle = bool(opts.recycle)
        if opts.group is not None:
            self.group_id = _group_id(opts.group)
            self.file_mode = 0o640
            self.dir_mode = 0o2770

    @override
    def _limits(self, opts: ShmOptions) -> tuple[int | None, int]:
        st = os.statvfs(self.root)
        total = st.f_blocks * st.f_frsize
        max_size = opts.max_size if opts.max_size is not None else total // 2
        min_free = opts.min_free_space if opts.min_free_space is not None else total // 10
        return max_size, min_free
