"""The options of the ``mmap`` backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hicache_storage.config import Size
from hicache_storage.errors import ConfigError

__all__ = ["DEFAULT_SLOT", "MmapOptions"]

#: The largest slot of an arena created with no ``slot_size`` and no host pool.
DEFAULT_SLOT = 4 * 2**20


@dataclass(frozen=True)
class MmapOptions:
    """Options of the ``mmap`` backend (environment: ``HICACHE_STORAGE_MMAP_<NAME>``).

    Attributes:
        path: the arena file (typically on local NVMe); its ``.index`` beside it.
            Default: ``/tmp/hicache-storage-mmap-<uid>/arena``, in a private (0700)
            directory of the user. An existing arena or index file must be a
            regular file owned by the user and writable by nobody else.
        max_size: the arena's size, fixed at creation (e.g. ``"512MiB"``): the most bytes
            of slots it holds. Reopening an arena keeps its original geometry.
        slot_size: the largest slot, hence the largest storable object: the size of a
            slab, rounded up to a whole number of units (4 KiB, or more for slabs over
            256 KiB: a slab has at most 64 units). Smaller objects take smaller slots (size
            classes). Default: the page size of the host pool registered before the first
            write, else 4 MiB (or the first object's size if larger). Fixed at creation.
        fsync: make every write durable (msync the slot and fsync the index) before it
            becomes visible; without it a write survives a process crash, not a power loss.
        checksum: payload checksum kept in the index: ``"xxh3"`` (default) or ``"none"``
            (no checksum written: the explicit opt-out).
        verify_checksum: verify the checksum of every read that has one. Default (None):
            on with ``checksum="xxh3"``, off with ``"none"``; ``True`` with ``"none"`` is a
            :class:`ConfigError`, ``False`` with ``"xxh3"`` keeps the checksums (for repairs
            after a power loss) without checking reads.
        reuse_delay: seconds an evicted slot rests before it is reused (readers also
            re-check a slot's generation after copying, so this only avoids wasted reads).
        low_free_slots: evict ahead when fewer than this fraction of the slots is free.
        max_concurrency: threads copying the pages of a batch.
        prefault: touch the whole arena at creation so it is resident in the page cache.
        namespace_max_size: cap on the payload bytes of this instance's namespace (a
            tenant's share of the arena): a write that would cross it evicts the
            namespace's own least-recently-used objects (down to nine tenths of it),
            never another's; objects of a batch beyond the quota itself fail. Counted
            from the shared index, so every process's objects count; writes in flight
            in other processes count once they commit. Default: none.
    """

    path: str | None = None
    max_size: Size = Size(512 * 2**20)  # noqa: RUF009 - an int constant
    slot_size: Size | None = None
    fsync: bool = False
    checksum: Literal["xxh3", "none"] = "xxh3"
    verify_checksum: bool | None = None
    reuse_delay: float = 0.05
    low_free_slots: float = 0.05
    max_concurrency: int = 2
    prefault: bool = True
    namespace_max_size: Size | None = None

    def __post_init__(self) -> None:
        if self.path is not None and not self.path:
            raise ConfigError("path must not be empty")
        if self.path is not None and "\0" in self.path:
            raise ConfigError("path must not contain a NUL byte")
        if self.max_size <= 0:
            raise ConfigError("max_size must be > 0")
        if self.slot_size is not None and self.slot_size <= 0:
            raise ConfigError("slot_size must be > 0")
        if self.reuse_delay < 0:
            raise ConfigError("reuse_delay must be >= 0")
        if not 0 <= self.low_free_slots < 1:
            raise ConfigError("low_free_slots must be in [0, 1)")
        if self.max_concurrency < 1:
            raise ConfigError("max_concurrency must be >= 1")
        if self.namespace_max_size is not None and self.namespace_max_size <= 0:
            raise ConfigError("namespace_max_size must be > 0")
        if self.verify_checksum and self.checksum == "none":
            raise ConfigError(
                'verify_checksum=true needs checksum="xxh3" (checksum="none" writes none to verify)'
            )

    @property
    def verify(self) -> bool:
        """Whether reads are verified: ``verify_checksum``, by default as ``checksum`` says."""
        if self.verify_checksum is None:
            return self.checksum != "none"
        return self.verify_checksum
