"""What the reads and writes of :class:`~hicache_storage.storekit.filestore.FileTreeStore` share.

The options, the tree's directories (made and checked with
:mod:`hicache_storage.storekit.pathsafety`, recreated when they vanish), the trust rule for
what is found at an object's path, recency, eviction, and the I/O hook
:meth:`FileTreeCore.move_payloads` with the :class:`PayloadMove` it carries. The reads are in
:mod:`~hicache_storage.storekit.filereads`, the writes in
:mod:`~hicache_storage.storekit.filewrites`; :mod:`~hicache_storage.storekit.filestore`
puts them together.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import resource
import stat
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, TypeVar, cast

from hicache_storage.config import Size, StorageConfig, parse_options
from hicache_storage.errors import (
    BackendError,
    ConfigError,
    CorruptObjectError,
    from_os_error,
)
from hicache_storage.protocol import HiCacheStorage
from hicache_storage.ratelimit import RateLimitedLog
from hicache_storage.storekit.atomic import (
    fsync_dir,
    preadv_all,
    writev_all,
)
from hicache_storage.storekit.capacity import CapacityTracker
from hicache_storage.storekit.header import (
    HEADER_SIZE,
    algorithm_id,
)
from hicache_storage.storekit.iopool import IOPool
from hicache_storage.storekit.metacache import MetadataCache
from hicache_storage.storekit.pathsafety import (
    UnsafePathError,
    check_file,
    check_path,
    ensure_dir,
    is_trusted,
)
from hicache_storage.storekit.spacelock import SpaceLock
from hicache_storage.storekit.treescan import NAMESPACE_DIR, TreeScan

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from hicache_storage.buffers import (
        PageBuffer,
    )
    from hicache_storage.keys import ObjectName

__all__ = ["FileTreeCore", "FileTreeOptions", "O", "PayloadMove"]

# The store's logger keeps the name it had before the store was split into modules
# (filetree, filereads, filewrites): operators' logging settings name it.
logger = logging.getLogger("hicache_storage.storekit.filestore")

#: A read refreshes a file's mtime (its recency after a restart or a re-scan) only when the
#: mtime is older than this many seconds: one inode update per page per second at most.
RECENCY_STEP = 1.0
#: Writers check the free-space floor under the cross-process lock (and allocate their
#: file before releasing it) once the free space is within this many objects (of the size
#: being written) of the floor; above that, concurrent writers cannot reach the floor
#: unless more than this many writes of that size are in flight on the node at once.
FLOOR_SLACK_OBJECTS = 256


def holds_only_a_store(path: str) -> bool:
    """True if every entry of the directory ``path`` is one that a store makes.

    Stores make namespace directories ``ns<version>-<digest>`` and hidden lock, temporary
    and trash names.
    """
    try:
        with os.scandir(path) as entries:
            return all(e.name.startswith(".") or NAMESPACE_DIR.fullmatch(e.name) for e in entries)
    except OSError:
        return False


def bounded_batch(pages: int) -> int:
    """``pages`` per batched move, at most an eighth of the descriptor limit (0 stays 0)."""
    if pages <= 0:
        return 0
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    limit = soft // 8 if soft != resource.RLIM_INFINITY else pages
    return max(1, min(pages, limit))


def page_spans(pages: Sequence[PageBuffer]) -> list[list[tuple[int, int]]]:
    """The ``(address, bytes)`` of each page's non-empty segments."""
    return [[(s.ptr, s.nbytes) for s in p.segments if s.nbytes] for p in pages]


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return a.st_ino == b.st_ino and a.st_dev == b.st_dev


class PayloadMove:
    """One object's bytes on their way between memory and its open file.

    The file holds the payload from offset 0 and the header right after it, as a trailer
    of :data:`~hicache_storage.storekit.header.HEADER_SIZE` bytes. What
    :meth:`FileTreeStore.move_payloads` reads and sets:

    * ``fd``: the file, open for the move (a write's temporary, a read's object);
    * ``path``: its path, for messages;
    * ``views``: the payload's memory (a write's source, a read's target), ``payload``
      their bytes in all;
    * ``spans``: the views' ``(address, bytes)`` when the caller knew them, else None (a
      mover that needs addresses takes them from the views);
    * ``trailer``: the header a write puts after the payload, or the ``bytearray`` a read
      fills with the stored one; None on a read whose header the store has already read
      and checked (the batched reads: a damaged object is never moved into memory).
    """

    __slots__ = ("fd", "path", "payload", "spans", "trailer", "views")

    def __init__(
        self,
        fd: int,
        path: str,
        views: list[memoryview],
        payload: int,
        trailer: bytes | bytearray | None,
        spans: list[tuple[int, int]] | None = None,
    ) -> None:
        self.fd, self.path, self.views, self.payload = fd, path, views, payload
        self.trailer, self.spans = trailer, spans


@dataclass(frozen=True)
class FileTreeOptions:
    """Options shared by file-like stores (each backend adds its location option).

    Attributes:
        fsync: fsync each file and its directory before publishing (crash durability).
        max_size: cap on this namespace's bytes (e.g. ``"200GiB"``); LRU eviction.
            ``None``: the backend's default (none for ``file``).
        min_free_space: keep at least this much free space on the filesystem.
            ``None``: the backend's default (0 for ``file``).
        eviction_ratio: once over ``max_size``, evict down to ``max_size * eviction_ratio``.
        namespace_max_size: cap on the bytes of this instance's namespace (its tenant),
            every shard of it, within the store; a write that would cross it evicts the
            namespace's own least-recently-used objects, never another namespace's.
            Useful where ``max_size`` covers the whole root (``shm``); on ``file`` it
            caps each namespace and shard like ``max_size`` (the smaller applies).
        max_concurrency: threads for batch reads and writes.
        metadata_cache_ttl: seconds ``exists`` may answer from memory (0 = always stat).
        checksum: payload checksum, ``"xxh3"`` or ``"none"``.
        verify_checksum: verify the payload checksum on every read.
        stale_temp_age: temporaries older than this (seconds) are removed at start-up even
            when their writer cannot be identified as dead (other hosts).
    """

    fsync: bool = False
    max_size: Size | None = None
    min_free_space: Size | None = None
    eviction_ratio: float = 0.9
    namespace_max_size: Size | None = None
    max_concurrency: int = 4
    metadata_cache_ttl: float = 0.0
    checksum: Literal["xxh3", "none"] = "xxh3"
    verify_checksum: bool = True
    stale_temp_age: float = 3600.0

    def __post_init__(self) -> None:
        """Check the options; :class:`ConfigError` for a value out of range."""
        if self.max_concurrency < 1:
            raise ConfigError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.metadata_cache_ttl < 0 or self.stale_temp_age < 0:
            raise ConfigError("metadata_cache_ttl and stale_temp_age must be >= 0")
        if not 0 < self.eviction_ratio <= 1:
            raise ConfigError(f"eviction_ratio must be in (0, 1], got {self.eviction_ratio}")


O = TypeVar("O", bound=FileTreeOptions)


class FileTreeCore(HiCacheStorage, Generic[O]):
    """The state and the steps that reads and writes share (see the module)."""

    options_class: ClassVar[type[FileTreeOptions]] = FileTreeOptions
    #: The option that names the root (for error messages).
    location_option: ClassVar[str] = "root"
    #: Mode of stored files and of directories this store creates.
    file_mode: int = 0o600
    dir_mode: int = 0o700
    #: Group that owns what this store creates, and that it trusts (``None``: private).
    group_id: int | None = None
    #: Refresh a file's mtime when it is read (at most once per :data:`RECENCY_STEP`), so
    #: LRU order survives a restart and is seen by other processes' re-scans.
    persist_recency: bool = True
    #: Fewer objects than this and close() leaves no scan snapshot: scanning them at
    #: start-up is cheap (about 0.1 s), and the snapshot would only take room.
    snapshot_min_objects: int = 10_000
    #: Objects of this store may be evicted by overwriting their file in place with another
    #: object of the same size (see :meth:`_recycle`); readers then lock and re-check.
    #: Every instance of a store type must agree, so this is per class; whether an
    #: instance itself recycles is :attr:`recycle`.
    recycles_files: ClassVar[bool] = False
    reports_removals: ClassVar[frozenset[str]] = frozenset({"evict", "delete", "clear"})
    recycle: bool = False
    #: Capacity accounting covers the whole root (every namespace and shard: one LRU and
    #: one cap for every instance of the root) instead of this namespace and shard only.
    capacity_per_root: ClassVar[bool] = False
    #: Serialize free-space checks between processes (a lock file in the root) and
    #: allocate each new file's bytes before the lock is released, so that concurrent
    #: writers cannot all pass the check and then fill the filesystem together.
    serialize_free_space: ClassVar[bool] = False

    def __init__(self, config: StorageConfig | None = None, **options: Any) -> None:
        super().__init__(config)
        self.options: O = cast("O", parse_options(self.options_class, self.name, options))
        opts = self.options
        self._configure(opts)
        self.root = check_path(self._location(opts), self.location_option)
        self.directory = os.path.join(self.root, self.namespace.digest)
        self._root_prefix = os.path.join(self.root, "")  # root + "/" (the hot paths' paths)
        self._algorithm = algorithm_id(opts.checksum)
        self._meta = MetadataCache(opts.metadata_cache_ttl)
        self._log = RateLimitedLog(logger)
        self._dirs: set[str] = set()
        self._tree_ok = False  # root and namespace directory checked since the last forget
        self._dirs_lock = threading.Lock()
        self._reclaims: list[threading.Thread] = []  # clear()'s deletions in progress
        self._space_lock = SpaceLock(self.root, self.file_mode, self.group_id)
        #: Objects per call of :meth:`move_payloads` (0: one, in the thread that opened it).
        self.payload_batch = bounded_batch(self._payload_batch(opts))
        # Calls moving batches at once: each holds up to payload_batch files open.
        self._parts = threading.BoundedSemaphore(4)
        self._ensure_tree()  # ConfigError: refuse to start on an unsafe or unusable root
        self._io = IOPool(opts.max_concurrency, f"hicache-{self.name}")
        self._scanner = TreeScan(
            root=self.root,
            namespace=self.namespace.digest,
            shard=self.config.shard,
            per_root=self.capacity_per_root,
            group_id=self.group_id,
            file_mode=self.file_mode,
            stale_temp_age=opts.stale_temp_age,
            log=self._log,
        )
        try:
            max_size, min_free = self._limits(opts)
            # With a cap or a floor the start-up scan sweeps dead writers' temporaries,
            # directory by directory; without one, nothing scans: sweep them here.
            self._scanner.remove_leftovers(temporaries=max_size is None and not min_free)
            self._tracker = CapacityTracker(
                max_size,
                self._evict,
                eviction_ratio=opts.eviction_ratio,
                min_free_bytes=min_free,
                free_space=self._free_space,
                block_size=os.statvfs(self.root).f_frsize,
                refresh=self._scanner.scan,
                shared_cap=self.capacity_per_root,
                # (Per namespace and shard, every object is this namespace's: "".)
                quota_prefix=f"{self.namespace.digest}/" if self.capacity_per_root else "",
                quota_bytes=opts.namespace_max_size,
            )
            if self._tracker.enabled:
                self._scanner.load(self._tracker)
        except BaseException:
            self._io.close()
            raise
        self._serialize = self.serialize_free_space and self._tracker.min_free_bytes > 0

    # ------------------------------------------------------------------ subclass hooks

    def _location(self, opts: O) -> str:
        """The root directory named by the options."""
        raise NotImplementedError

    def _configure(self, opts: O) -> None:
        """Set modes and group from the options (default: private, 0600/0700)."""

    def _payload_batch(self, opts: O) -> int:
        """Objects per call of :meth:`move_payloads`; 0 (the default): one at a time.

        With 0, each object is opened, moved and published (or verified) on its own, on the
        I/O threads when the batch is large. A mover with a cost per call (a transfer
        engine) returns more: the store then opens a part of the batch (never more than an
        eighth of the descriptor limit of files), moves it in one call and finishes each.
        """
        return 0

    def _limits(self, opts: O) -> tuple[int | None, int]:
        """``(max_size, min_free_space)`` with the backend's defaults applied."""
        return opts.max_size, opts.min_free_space or 0

    # ------------------------------------------------------------------ directories

    def _ensure_tree(self, fanout: str | None = None) -> None:
        """Make the root, the namespace directory (and ``fanout`` in it) exist and be safe.

        Creates what is missing (the root with its parents: a cleaner or an operator may
        have removed it while the store runs) with this store's mode and group, and checks
        what exists (:func:`~hicache_storage.storekit.pathsafety.ensure_dir`). Raises ConfigError.
        """
        levels = (
            [] if self._tree_ok else [(self.root, "", True), (self.directory, self.root, False)]
        )
        if fanout is not None:
            levels.append((os.path.join(self.directory, fanout), self.directory, False))
        for path, parent, parents in levels:
            created = ensure_dir(
                path,
                self.dir_mode,
                self.group_id,
                parents=parents,
                check_ancestors=path == self.root,  # those below were just checked
                # Group mode: the store's own directories (or a root holding nothing but
                # a store) may be given to the group; any other directory is left alone.
                adopt=path != self.root or holds_only_a_store(path),
            )
            if created and parent and self.options.fsync:
                try:
                    fsync_dir(parent)
                except OSError as exc:
                    raise ConfigError(f"cannot fsync {parent}: {exc}") from exc
            if path == self.directory:
                self._tree_ok = True

    def _ensure_fanout(self, name: ObjectName) -> None:
        """The directories of ``name`` exist and are safe (checked once per fan-out)."""
        if name.fanout in self._dirs:
            return
        try:
            try:
                self._ensure_tree(name.fanout)
            except ConfigError:
                if not self._tree_ok:
                    raise
                self._forget_dirs()  # the namespace directory (or the root) went away
                self._ensure_tree(name.fanout)
        except ConfigError as exc:
            # Engine-facing calls never raise a ConfigError: the write fails, counted.
            raise BackendError(str(exc)) from exc
        with self._dirs_lock:
            self._dirs.add(name.fanout)

    def _forget_dirs(self) -> None:
        """A directory vanished (clear() elsewhere, a cleaner): check them all again."""
        with self._dirs_lock:
            self._dirs.clear()
            self._tree_ok = False

    # ------------------------------------------------------------------ helpers

    def _path(self, name: ObjectName) -> str:
        # = os.path.join(root, namespace, fanout, leaf): none of these starts with "/"
        return self._root_prefix + name.path

    @functools.cached_property
    def _root_prefix(self) -> str:
        return os.path.join(self.root, "")

    def _free_space(self) -> int:
        path = self.root
        while True:  # the root may have been removed: its filesystem is its parent's
            try:
                st = os.statvfs(path)
                return st.f_bavail * st.f_frsize
            except FileNotFoundError:
                up = os.path.dirname(path)
                if up == path:
                    raise
                path = up

    def _evict(self, rel: str) -> bool:
        path = os.path.join(self.root, rel)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._log("evict", "cannot evict %s: %s", path, exc)
            return False
        self._meta.discard(path)
        self._record(evictions=1)
        self._removed_names([rel])
        return True

    def _removed_names(self, rels: list[str]) -> None:
        """Tell removal listeners of objects of this namespace among ``rels`` (by key).

        Any shard's object counts (a block whose shard of another rank is gone can no
        longer be loaded); another namespace's (one budget per root) does not.
        """
        if not self.__dict__.get("_removal_listeners"):
            return
        prefix = self.namespace.digest + "/"
        keys = [rel.rsplit("/", 1)[-1].partition("~")[0] for rel in rels if rel.startswith(prefix)]
        if keys:
            self._removed(keys)

    # ------------------------------------------------------------------ reads

    def _untrusted(self, path: str, exc: Exception, remove: bool) -> None:
        """Handle something at ``path`` that is not a trustworthy object.

        It is counted (a miss) and logged (rate limited) and, with ``remove``, taken away so
        that the key can be stored.
        """
        self._record(corrupt_objects=1)
        self._log("untrusted", "ignoring %s (%s); the read is a miss", path, exc)
        self._meta.discard(path)
        if not remove:
            return
        try:
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode):
                os.rmdir(path)  # only if empty; anything else stays (and writes fail)
            else:
                os.unlink(path)  # a symlink itself, never its target
        except OSError:
            pass

    def _stored(self, path: str, remove: bool = False) -> os.stat_result | None:
        """``lstat`` of the object at ``path`` if a trustworthy one is there, else None.

        No metadata cache (writes must not trust it). Anything else at ``path`` (symlink,
        FIFO, directory, another user's file) is counted and, with ``remove``, removed.
        """
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise from_os_error(exc, f"stat {path}") from exc
        if stat.S_ISREG(st.st_mode) and is_trusted(st, self.group_id):
            return st
        try:
            check_file(path, st, self.group_id)
        except UnsafePathError as exc:
            self._untrusted(path, exc, remove)
        return None

    def _touch(
        self, name: ObjectName, path: str, st: os.stat_result | None = None, fd: int | None = None
    ) -> None:
        """Mark ``name`` as just used (LRU), and refresh its file's mtime when stale."""
        if self._tracker.enabled:
            self._tracker.touch(name.path)
        if not self.persist_recency:
            return
        if st is not None and time.time() - st.st_mtime < RECENCY_STEP:
            return
        try:  # recency survives a restart and shows in re-scans (they read mtimes)
            if fd is not None:
                os.utime(fd)
            else:
                os.utime(path, follow_symlinks=False)
        except OSError:
            pass  # another member's file (group sharing): not ours to touch

    @contextlib.contextmanager
    def _closing(self, items: Sequence[PayloadMove | None]) -> Iterator[None]:
        """Close the files of the items still in ``items`` on the way out."""
        try:
            yield
        finally:
            for item in items:
                if item is not None:
                    with contextlib.suppress(OSError):
                        os.close(item.fd)

    # ------------------------------------------------------------------ writes

    def _exists_at(self, path: str) -> bool:
        meta = self._meta
        if meta.enabled and meta.contains(path):
            return True
        if self._stored(path) is None:
            return False
        if meta.enabled:
            meta.add(path)
        return True

    def _on_disk(self, path: str) -> bool:
        """True if a trustworthy object is at ``path`` now (no metadata cache)."""
        return self._stored(path) is not None

    def _wait_for_reclaims(self) -> bool:
        """Wait for clear()'s background deletions; True if there were any."""
        with self._dirs_lock:
            reclaims, self._reclaims = self._reclaims, []
        for reclaim in reclaims:
            reclaim.join()
        return bool(reclaims)

    # ------------------------------------------------------------------ moving payloads

    def move_payloads(
        self, direction: Literal["read", "write"], moves: Sequence[PayloadMove]
    ) -> None:
        """Move the bytes of ``moves`` between memory and their files: the store's I/O hook.

        ``"write"``: each move's views go to its file from offset 0, then its ``trailer``
        right after them. ``"read"``: the file's payload fills the views and, unless
        ``trailer`` is None (already read), the next
        :data:`~hicache_storage.storekit.header.HEADER_SIZE` bytes fill ``trailer`` (left
        short, the header check then fails that object). Returns once every byte moved;
        raises when any did not (:class:`~hicache_storage.errors.BackendError` or
        ``OSError``; :class:`~hicache_storage.errors.CorruptObjectError` for a file shorter
        than it was), and then no object of the call counts as moved: the store removes
        the temporaries written, and reads are misses.

        Everything else stays the store's: names, trust, sizes, headers, checksums,
        capacity, publication. This implementation makes one ``pwritev``/``preadv`` per
        object; a subclass that moves bytes by other means (a transfer engine) overrides
        it, and returns a batch size from :meth:`_payload_batch` to get many objects per
        call. Called from the I/O threads as well as the caller's.
        """
        if direction == "write":
            for move in moves:
                assert move.trailer is not None
                writev_all(move.fd, [*move.views, move.trailer])
            return
        for move in moves:
            tail = [] if move.trailer is None else [memoryview(move.trailer)]
            want = move.payload + (HEADER_SIZE if tail else 0)
            got = preadv_all(move.fd, [*move.views, *tail], 0)
            if got != want:
                raise CorruptObjectError(f"short read: {got} of {want} bytes")
