"""One object per file under a per-namespace directory: the machinery of file-like stores.

Shared by the ``file`` backend (any POSIX filesystem) and the ``shm`` backend (``/dev/shm``),
which differ only in their options and defaults. Layout:
``<root>/<namespace digest>/<fanout>/<key>[~<shard>]``; every file is
``payload || header`` (the header as a trailer, see :mod:`hicache_storage.storekit.header`;
an object with its header first is damage), published atomically
(:mod:`hicache_storage.storekit.atomic`); capacity is tracked with
:class:`~hicache_storage.storekit.capacity.CapacityTracker`. Every directory used and every file read
passes the trust rule of :mod:`hicache_storage.storekit.pathsafety` (owned by this user or, in group
mode, the group; not writable by others; never a symlink, FIFO or other special file), and
directories that vanish while the store runs are recreated on the next write. Guarantees
are documented in ``docs/backends/file.md`` and ``docs/backends/shm.md``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import resource
import secrets
import shutil
import stat
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, TypeVar, cast

from typing_extensions import override

from hicache_storage.buffers import (
    PageBuffer,
    memoryview_at,
    source_views,
    target_views,
    total_nbytes,
)
from hicache_storage.config import Size, StorageConfig, parse_options
from hicache_storage.errors import (
    BackendError,
    CapacityError,
    ConfigError,
    CorruptObjectError,
    UnsupportedFormatError,
    from_os_error,
)
from hicache_storage.protocol import HiCacheStorage
from hicache_storage.ratelimit import RateLimitedLog
from hicache_storage.storekit.atomic import (
    finish_temp,
    fsync_dir,
    open_temp,
    preadv_all,
    publish,
    temp_path,
    writev_all,
)
from hicache_storage.storekit.capacity import CapacityTracker, Reservation
from hicache_storage.storekit.header import (
    HEADER_SIZE,
    ObjectHeader,
    algorithm_id,
    checksum,
    decode_header,
    encode_header,
    verify_payload,
)
from hicache_storage.storekit.iopool import IOPool
from hicache_storage.storekit.metacache import MetadataCache
from hicache_storage.storekit.pathsafety import (
    NotRegularFileError,
    UnsafePathError,
    check_file,
    check_path,
    ensure_dir,
    is_trusted,
    open_regular_stat,
)
from hicache_storage.storekit.spacelock import SpaceLock
from hicache_storage.storekit.treescan import NAMESPACE_DIR, TRASH_PREFIX, TreeScan

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from hicache_storage.keys import ObjectName

__all__ = ["FileTreeOptions", "FileTreeStore", "PayloadMove"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Mean object size from which batched reads verify their checksums on the I/O threads.
_THREADED_VERIFY = 512 << 10

#: A read refreshes a file's mtime (its recency after a restart or a re-scan) only when the
#: mtime is older than this many seconds: one inode update per page per second at most.
RECENCY_STEP = 1.0
#: Writers check the free-space floor under the cross-process lock (and allocate their
#: file before releasing it) once the free space is within this many objects (of the size
#: being written) of the floor; above that, concurrent writers cannot reach the floor
#: unless more than this many writes of that size are in flight on the node at once.
FLOOR_SLACK_OBJECTS = 256


def _holds_only_a_store(path: str) -> bool:
    """True if every entry of the directory ``path`` is one that a store makes.

    Stores make namespace directories ``ns<version>-<digest>`` and hidden lock, temporary
    and trash names.
    """
    try:
        with os.scandir(path) as entries:
            return all(e.name.startswith(".") or NAMESPACE_DIR.fullmatch(e.name) for e in entries)
    except OSError:
        return False


def _bounded_batch(pages: int) -> int:
    """``pages`` per batched move, at most an eighth of the descriptor limit (0 stays 0)."""
    if pages <= 0:
        return 0
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    limit = soft // 8 if soft != resource.RLIM_INFINITY else pages
    return max(1, min(pages, limit))


def _page_spans(pages: Sequence[PageBuffer]) -> list[list[tuple[int, int]]]:
    """The ``(address, bytes)`` of each page's non-empty segments."""
    return [[(s.ptr, s.nbytes) for s in p.segments if s.nbytes] for p in pages]


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
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


class _ReadItem(PayloadMove):
    """One object being read: its name, open file, target views and result."""

    __slots__ = ("header", "name", "ok", "out", "st")

    def __init__(
        self,
        name: ObjectName,
        path: str,
        fd: int,
        st: os.stat_result,
        views: list[memoryview],
        out: Any,
    ) -> None:
        super().__init__(fd, path, views, st.st_size - HEADER_SIZE, bytearray(HEADER_SIZE))
        self.name, self.st = name, st
        self.out = out  # what a successful read returns (True, or a new tensor)
        self.header: ObjectHeader | None = None
        self.ok = True


class _WriteItem(PayloadMove):
    """A new object on its way to the store: its open temporary and its reservation."""

    __slots__ = ("allocated", "final", "name", "reservation")

    def __init__(
        self,
        name: ObjectName,
        final: str,
        reservation: Reservation,
        tmp: str,
        fd: int,
        views: list[memoryview],
        payload: int,
        header: bytes,
        spans: list[tuple[int, int]] | None,
        allocated: int,
    ) -> None:
        super().__init__(fd, tmp, views, payload, header, spans)
        self.name, self.final, self.reservation = name, final, reservation
        self.allocated = allocated  # bytes open_temp allocated (finish_temp cuts the rest)


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


class FileTreeStore(HiCacheStorage, Generic[O]):
    """Pages as files in a directory tree (zero-copy ``writev``/``preadv``).

    Generic in its options type: ``class FileBackend(FileTreeStore[FileOptions])``.
    Subclasses set :attr:`options_class` (that :class:`FileTreeOptions` subclass) and
    implement :meth:`_location`; they may change :attr:`file_mode`, :attr:`dir_mode`,
    :attr:`group_id` (in ``_configure``) and the defaults of the capacity limits.
    """

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
        self.payload_batch = _bounded_batch(self._payload_batch(opts))
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
                adopt=path != self.root or _holds_only_a_store(path),
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
        return os.path.join(self.root, name.namespace, name.fanout, name.leaf)

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
        return True

    def _near_floor(self, nbytes: int) -> bool:
        """True unless the filesystem has so much room above the floor that no check is needed.

        So much room is :data:`FLOOR_SLACK_OBJECTS` objects of this size more than the floor
        and this object: concurrent unlocked writers cannot cross the floor then. Far from the
        floor, checking under the lock would only serialize the filesystem's page allocation
        of every writer.
        """
        tracker = self._tracker
        need = tracker._rounded(nbytes)
        slack = FLOOR_SLACK_OBJECTS * need
        return self._free_space() - tracker._pending() - need < tracker.min_free_bytes + slack

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

    def _open_published(self, path: str) -> tuple[int, os.stat_result] | None:
        """Open the object at ``path`` for reading; None if there is none (or no good one).

        Never follows a symlink, never blocks (a FIFO is refused at once), and only a
        regular file that passes the trust rule is read; anything else is a miss,
        counted in ``corrupt_objects`` and removed.

        In a store that recycles evicted files, the file is also locked shared (``flock``)
        and checked to be still the one published at ``path``: a recycler overwrites only
        a file it could lock exclusively *after* taking it out of the namespace, so once
        both hold, the bytes cannot change under this reader until it closes the file.
        """
        for _ in range(2):  # once more if the name was re-published meanwhile
            try:
                fd, st = open_regular_stat(path, os.O_RDONLY)
            except FileNotFoundError:
                return None
            except NotRegularFileError as exc:
                self._untrusted(path, exc, remove=True)
                return None
            except OSError as exc:
                raise from_os_error(exc, f"open {path}") from exc
            try:
                check_file(path, st, self.group_id)
            except UnsafePathError as exc:
                os.close(fd)
                self._untrusted(path, exc, remove=True)
                return None
            if not self.recycles_files:
                return fd, st
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                st = os.fstat(fd)
                same = _same_file(st, os.lstat(path))
            except (BlockingIOError, FileNotFoundError):
                same = False  # being recycled, or evicted: no longer this key's object
            except OSError as exc:
                os.close(fd)
                raise from_os_error(exc, f"open {path}") from exc
            if same:
                return fd, st
            os.close(fd)
        return None

    def _read(self, name: ObjectName, views: list[memoryview] | None) -> Any:
        """Read an object into ``views`` (or a new tensor); None on miss, mismatch or corruption.

        The bytes come through :meth:`move_payloads` (one ``preadv`` of payload and trailer).
        """
        item = self._open_for_read(name, views)
        if item is None:
            return None
        with self._reading(item):
            self.move_payloads("read", (item,))
            assert item.trailer is not None
            item.header = self._check_header(item, item.trailer)
            self._finish_read(item)
        return item.out if item.ok else None

    def _open_for_read(self, name: ObjectName, views: list[memoryview] | None) -> _ReadItem | None:
        """Open ``name``'s object for a read into ``views``; None on a miss or a size mismatch.

        With ``views`` None, a new uint8 tensor of the stored size is the target (``out``).
        The caller reads the header and the payload, then :meth:`_finish_read`, inside
        :meth:`_reading` (which closes the file and turns damage into a miss).
        """
        path = self._path(name)
        opened = self._open_published(path)
        if opened is None:
            self._meta.discard(path)
            return None
        fd, st = opened
        item = _ReadItem(name, path, fd, st, views or [], True)
        with self._reading(item, close=False):
            payload = st.st_size - HEADER_SIZE
            if payload < 0:
                raise CorruptObjectError(f"{st.st_size}-byte file is shorter than a header")
            if views is None:
                import torch

                item.out = torch.empty(payload, dtype=torch.uint8)
                item.views = [memoryview_at(int(item.out.data_ptr()), payload, item.out)]
            elif total_nbytes(views) != payload:
                self._record(size_mismatches=1)
                item.ok = False
        return item if item.ok else None  # (a failed item's file is closed)

    @contextlib.contextmanager
    def _reading(self, item: _ReadItem, close: bool = True) -> Iterator[None]:
        """Around the steps of a read: damage makes it a miss.

        A damaged object (``item.ok`` becomes False) is quarantined; ``OSError`` is mapped
        to the SDK's errors; the file is closed at the end (``close``) or on any failure.
        """
        try:
            yield
        except UnsupportedFormatError as exc:
            # A newer release's object in a shared store: a miss here, not damage.
            self._log("newer", "object %s (%s): kept; the read is a miss", item.path, exc)
            item.ok = False
        except CorruptObjectError as exc:
            self._quarantine(item.path, item.fd, exc)
            item.ok = False
        except OSError as exc:
            os.close(item.fd)
            raise from_os_error(exc, f"read {item.path}") from exc
        except BaseException:
            os.close(item.fd)
            raise
        if close or not item.ok:
            os.close(item.fd)

    def _check_header(self, item: _ReadItem, head: bytes | bytearray) -> ObjectHeader:
        """The object's trailer, checked against its name and size (CorruptObjectError)."""
        # (renamed or swapped: not this key's; a header first is not this store's layout)
        header = decode_header(head, item.name.path, trailer=True)
        payload = item.st.st_size - HEADER_SIZE
        if header.payload_len != payload:
            raise CorruptObjectError(
                f"header says {header.payload_len} bytes, file holds {payload}"
            )
        return header

    def _finish_read(self, item: _ReadItem) -> None:
        """After the payload is in ``item.views``: verify it, count it, note the use."""
        assert item.header is not None
        if self.options.verify_checksum:
            verify_payload(item.header, item.views)
        self._record(bytes_read=item.header.payload_len)
        self._touch(item.name, item.path, item.st, item.fd)

    def _quarantine(self, path: str, fd: int, exc: CorruptObjectError) -> None:
        """Remove a corrupt object so the next ``set`` can store a good one."""
        self._record(corrupt_objects=1)
        self._log("corrupt", "corrupt object %s (%s): removing it; the read is a miss", path, exc)
        # Forget it first: a concurrent set of the same key can then only leave an entry
        # for a file that exists (never the reverse, which would let the cap be exceeded).
        self._meta.discard(path)
        self._tracker.discard(os.path.relpath(path, self.root))
        try:
            if _same_file(os.lstat(path), os.fstat(fd)):
                os.unlink(path)
        except OSError:
            pass

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

    @override
    def get(self, key: str, target: Any = None) -> Any:
        views = None if target is None else target_views(target)
        if self.payload_batch:
            out = self._read_each("get", [key], [views])[0]
        else:
            out = self._read(self.object_name(key), views)
        if out is None:
            return None
        return out if target is None else target

    @override
    def batch_get(self, keys: list[str], targets: Sequence[Any] | None = None) -> list[Any]:
        if not self.payload_batch:
            return super().batch_get(keys, targets)
        views = [None] * len(keys) if targets is None else [target_views(t) for t in targets]
        got = self._read_each("batch_get", keys, views)
        if targets is None:
            return got
        return [None if g is None else t for g, t in zip(got, targets, strict=True)]

    def _each_page(
        self,
        op: str,
        keys: list[str],
        pages: Sequence[PageBuffer],
        io: Callable[[ObjectName, list[memoryview]], Any],
    ) -> list[bool]:
        """Run ``io`` for every page; a failing page fails alone.

        On the I/O threads, unless the pages are small.
        """
        names = [self.object_name(k) for k in keys]
        big = self._io.worth_threads(sum(p.nbytes for p in pages), len(pages))
        return self._map_pages(
            op, len(keys), lambda i: io(names[i], pages[i].views), self._io.map if big else None
        )

    @override
    def batch_get_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        if not self.payload_batch:
            return self._each_page("batch_get_pages", keys, pages, self._read)
        got = self._read_each("batch_get_pages", keys, [p.views for p in pages], _page_spans(pages))
        return [g is not None for g in got]

    def _read_each(
        self,
        op: str,
        keys: list[str],
        views: Sequence[list[memoryview] | None],
        spans: list[list[tuple[int, int]]] | None = None,
    ) -> list[Any]:
        """Batched reads: every key into its views (None: a new tensor); None for each miss.

        ``spans``: the views' ``(address, bytes)`` ranges, when the caller knows them.
        """
        names = [self.object_name(k) for k in keys]
        step = self.payload_batch
        out: list[Any] = []
        for at in range(0, len(keys), step):
            part = None if spans is None else spans[at : at + step]
            with self._parts:  # (bounds the files open at once)
                out += self._read_part(op, names[at : at + step], views[at : at + step], part)
        return out

    def _read_part(
        self,
        op: str,
        names: list[ObjectName],
        views: Sequence[list[memoryview] | None],
        spans: list[list[tuple[int, int]]] | None,
    ) -> list[Any]:
        """Read one part of a batch: open each object, one move, check and verify each."""
        n = len(names)
        items: list[_ReadItem | None] = [None] * n

        def open_one(i: int) -> bool:
            # Each header is read and checked first: a damaged or foreign object is a
            # miss that never reaches the caller's memory, and fails alone.
            item = self._open_for_read(names[i], views[i])
            if item is None:
                return False
            with self._reading(item, close=False):
                head = os.pread(item.fd, HEADER_SIZE, item.payload)
                item.header = self._check_header(item, head)
            if not item.ok:
                return False
            item.trailer = None  # (read: the move takes the payload only)
            if spans is not None:
                item.spans = spans[i]
            items[i] = item
            return True

        out: list[Any] = [None] * n
        with self._closing(items):
            # Opens run in this thread: a few microseconds each, less than a hand-off.
            self._map_pages(op, n, open_one)
            live = [i for i in range(n) if items[i] is not None]
            opened = [item for item in items if item is not None]
            if not opened:
                return out
            try:
                self.move_payloads("read", opened)
            except (BackendError, OSError) as exc:
                self._log_failure(op, exc)
                self._add_item_errors(len(opened))
                return out

            def finish(j: int) -> bool:
                item, items[live[j]] = opened[j], None  # closed by _reading from here on
                with self._reading(item):
                    self._finish_read(item)
                if item.ok:
                    out[live[j]] = item.out
                return item.ok

            # The checksums of large pages are worth the I/O threads (xxhash lets go of
            # the GIL); small ones are not.
            nbytes = sum(item.payload for item in opened)
            threads = self.options.verify_checksum and nbytes >= _THREADED_VERIFY * len(opened)
            self._map_pages(op, len(live), finish, self._io.map if threads else None)
            return out

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

    def _write(self, name: ObjectName, views: list[memoryview]) -> bool:
        path = self._path(name)
        if self._already_stored(name, path):
            return True
        header, nbytes = self._new_header(name, views)
        reservation: Reservation | None = None
        try:  # released on any exit unless committed (the reservation may be replaced)
            published = None
            reused = self._tracker.reserve_reusing(name.path, nbytes) if self.recycle else None
            if reused is not None:
                reservation, victim = reused
                try:
                    published = self._recycle(victim, name, path, views, header, nbytes)
                except FileNotFoundError:
                    published = None  # directories removed by a clear(): a new file
                if published is None:
                    # Not reused: a new file needs room like any other (cap and floor).
                    reservation.release()
                    reservation = None
            if published is None:
                reservation, published = self._write_file(name, path, views, header, nbytes)
            self._settle(name, path, reservation, published, nbytes)
        except OSError as exc:
            raise from_os_error(exc, f"write {path}") from exc
        finally:
            if reservation is not None:
                reservation.release()
        return True

    def _already_stored(self, name: ObjectName, path: str) -> bool:
        """True (and the object's use noted) if a good object is stored at ``path``.

        Anything else there (a planted FIFO, a link...) is removed: it must not block the key.
        """
        st = self._stored(path, remove=True)
        if st is None:
            return False
        self._meta.add(path)
        self._touch(name, path, st)
        return True

    def _new_header(self, name: ObjectName, views: Sequence[memoryview]) -> tuple[bytes, int]:
        """The header of a new object of ``views`` for ``name``, and the object's size."""
        self._tracker.refresh_if_due()  # a cap shared with other processes: catch up
        payload = total_nbytes(views)
        header = encode_header(
            payload, checksum(views, self._algorithm), self._algorithm, name.path, trailer=True
        )
        return header, HEADER_SIZE + payload

    def _settle(
        self,
        name: ObjectName,
        path: str,
        reservation: Reservation | None,
        published: bool,
        nbytes: int,
    ) -> None:
        """Account for a write that published ``path`` (or found it taken meanwhile)."""
        assert reservation is not None  # held by the recycled or the new file
        if published:
            if not reservation.commit() and self._on_disk(path):
                # clear() ran during the write and the object landed after it.
                self._tracker.add(name.path, nbytes)
            self._record(bytes_written=nbytes - HEADER_SIZE)
        elif self._stored(path) is None:
            # The name is taken, but not by a page (a non-empty directory, another
            # user's file): never report stored what a read would not return.
            raise BackendError(f"write {path}: the name is held by something else")
        else:
            self._touch(name, path)
        self._meta.add(path)

    def _write_file(
        self, name: ObjectName, path: str, views: list[memoryview], header: bytes, nbytes: int
    ) -> tuple[Reservation, bool]:
        """Reserve room for a new file, write it and publish it; (reservation, published).

        A directory that vanished meanwhile (clear() in another process, the root removed)
        is recreated and the write retried.
        """
        for attempt in (0, 1):
            reservation, tmp, fd, allocated = self._open_new(name, path, nbytes)
            try:
                try:
                    move = PayloadMove(fd, tmp, views, nbytes - HEADER_SIZE, header)
                    self.move_payloads("write", (move,))
                except BaseException:
                    os.close(fd)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)
                    raise
                published = finish_temp(
                    tmp, fd, path, nbytes, fsync=self.options.fsync, allocated=allocated
                )
            except FileNotFoundError:
                reservation.release()
                if attempt:
                    raise
                self._forget_dirs()
                continue
            except BaseException:
                reservation.release()
                raise
            return reservation, published
        raise AssertionError("unreachable")  # pragma: no cover

    def _open_new(
        self, name: ObjectName, path: str, nbytes: int
    ) -> tuple[Reservation, str, int, int]:
        """Reserve room for a new object of ``nbytes`` at ``path`` and open its temporary.

        Returns ``(reservation, temporary path, write descriptor, bytes allocated)``. The
        reservation (and, when :attr:`serialize_free_space`, the file's allocation) happens
        under the root's free-space lock. A directory that vanished meanwhile is recreated
        and the open retried. The caller writes the object, then publishes it (or releases
        the reservation, closes and removes the temporary).
        """
        for attempt in (0, 1):
            self._ensure_fanout(name)
            locked = self._serialize and self._near_floor(nbytes)
            allocate = nbytes if locked else 0
            try:
                with self._space_lock.hold() if locked else contextlib.nullcontext():
                    reservation = self._reserve(name, nbytes)
                    try:
                        tmp, fd = open_temp(
                            os.path.dirname(path),
                            mode=self.file_mode,
                            gid=self.group_id,
                            allocate=allocate,
                        )
                    except BaseException:
                        reservation.release()
                        raise
                    if allocate:
                        reservation.mark_allocated()
            except FileNotFoundError:  # the lock file or the fan-out directory is gone
                if attempt:
                    raise
                self._forget_dirs()
                continue
            return reservation, tmp, fd, allocate
        raise AssertionError("unreachable")  # pragma: no cover

    def _reserve(self, name: ObjectName, nbytes: int) -> Reservation:
        """Room for a new file of ``nbytes`` (evicting LRU objects), or CapacityError.

        When there is no room while a clear() is still deleting files (the space it frees
        is not free yet), the write waits for those deletions and tries once more.
        """
        reservation = self._tracker.reserve(name.path, nbytes)
        if reservation is None and self._wait_for_reclaims():
            reservation = self._tracker.reserve(name.path, nbytes)
        if reservation is None:
            raise CapacityError(f"no room for {nbytes} bytes under max_size/min_free_space")
        return reservation

    def _wait_for_reclaims(self) -> bool:
        """Wait for clear()'s background deletions; True if there were any."""
        with self._dirs_lock:
            reclaims, self._reclaims = self._reclaims, []
        for reclaim in reclaims:
            reclaim.join()
        return bool(reclaims)

    def _recycle(
        self,
        victim_rel: str,
        name: ObjectName,
        path: str,
        views: list[memoryview],
        header: bytes,
        nbytes: int,
    ) -> bool | None:
        """Evict ``victim_rel`` by overwriting its file with ``views`` and ``header``, then publish.

        Rewriting pages the filesystem already holds is much cheaper than allocating new
        ones (tmpfs: about 1.5x for writes, and reads of the result are faster too). The
        file first leaves the namespace (``rename`` to a temporary: new readers miss it),
        then is overwritten only if no reader holds it (``flock`` exclusive, not waiting;
        see :meth:`_open_published` for the readers' side), then published like a new
        file. Returns True/False as :func:`~hicache_storage.storekit.atomic.publish`, or None when
        the file could not be reused (gone, another size, read by someone, not a regular
        file of this user): it is then removed, and the caller writes a new file.
        """
        victim = os.path.join(self.root, victim_rel)
        tmp = temp_path(os.path.dirname(victim))
        try:
            os.rename(victim, tmp)
        except FileNotFoundError:
            self._meta.discard(victim)
            return None  # deleted meanwhile: nothing to reuse, nothing to evict
        except OSError:
            if not self._evict(victim_rel):
                self._tracker.add(victim_rel, nbytes)  # still there: keep counting it
                raise
            return None
        self._meta.discard(victim)  # after the rename: exists() cannot bring it back
        self._record(evictions=1)
        try:
            try:
                fd, st = open_regular_stat(tmp, os.O_WRONLY)
            except (PermissionError, NotRegularFileError):
                return None  # another user's page (group sharing): evicted, not reused
            try:
                if st.st_size != nbytes or st.st_uid != os.geteuid():
                    return None
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return None  # a reader still copies the evicted object: leave it be
                self.move_payloads(
                    "write", (PayloadMove(fd, tmp, views, nbytes - HEADER_SIZE, header),)
                )
                if self.options.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)  # releases the lock before the object is visible
            self._ensure_fanout(name)
            published = publish(tmp, path)
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        if published and self.options.fsync:
            try:
                fsync_dir(os.path.dirname(path))
            except OSError as exc:  # visible and complete: as write_atomic, log it
                self._log(
                    "fsync",
                    "published %s but fsync of its directory failed: %s",
                    path,
                    exc,
                    level=logging.ERROR,
                )
        return published

    @override
    def set(self, key: str, value: Any) -> bool:
        if self.payload_batch:
            return self._write_each("set", [key], [source_views(value)])[0]
        return self._write(self.object_name(key), source_views(value))

    @override
    def batch_set_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        spans = _page_spans(pages) if self.payload_batch else None
        return self._write_each("batch_set_pages", keys, [p.views for p in pages], spans)

    @override
    def batch_set(self, keys: list[str], values: Sequence[Any]) -> list[bool]:
        # As batch_set_pages: the values' bytes straight to the files, on the I/O threads
        # (the default would write them one by one in the caller's thread). A value of
        # the wrong type raises before anything is written.
        return self._write_each("batch_set", keys, [source_views(v) for v in values])

    def _write_each(
        self,
        op: str,
        keys: list[str],
        views: list[list[memoryview]],
        spans: list[list[tuple[int, int]]] | None = None,
    ) -> list[bool]:
        """Write every item: one by one on the I/O threads, or in batched moves.

        A key twice in the batch is written once, with its first value (first writer
        wins, as in a serial loop). ``spans``: the views' ``(address, bytes)`` ranges, when
        the caller knows them (batched moves only).
        """
        first: dict[str, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        unique = list(first.values())
        names = [self.object_name(keys[i]) for i in unique]
        step = self.payload_batch
        if step:
            done: list[bool] = []
            for at in range(0, len(unique), step):
                part = unique[at : at + step]
                with self._parts:  # (bounds the files open at once)
                    done += self._write_part(
                        op,
                        names[at : at + step],
                        [views[i] for i in part],
                        None if spans is None else [spans[i] for i in part],
                    )
        else:
            # Small objects go faster in the caller's thread: a thread hand-off costs more
            # than their system calls (measured: 4 KiB objects, 1.6x faster serially).
            big = self.options.fsync or self._io.worth_threads(
                sum(total_nbytes(v) for v in views), len(views)
            )
            done = self._map_pages(
                op,
                len(unique),
                lambda j: self._write(names[j], views[unique[j]]),
                self._io.map if big else None,
            )
        if len(unique) == len(keys):
            return done
        by_key = {keys[i]: ok for i, ok in zip(unique, done, strict=True)}
        return [by_key[k] for k in keys]

    def _write_part(
        self,
        op: str,
        names: list[ObjectName],
        views: list[list[memoryview]],
        spans: list[list[tuple[int, int]]] | None,
    ) -> list[bool]:
        """Write one part of a batch: temporaries, one move, then publication."""
        n = len(names)
        items: list[_WriteItem | None] = [None] * n

        def prepare(i: int) -> bool:
            name = names[i]
            path = self._path(name)
            if self._already_stored(name, path):
                return True
            header, nbytes = self._new_header(name, views[i])
            try:
                reservation, tmp, fd, allocated = self._open_new(name, path, nbytes)
            except OSError as exc:
                raise from_os_error(exc, f"write {path}") from exc
            payload = nbytes - HEADER_SIZE
            item_spans = None if spans is None else spans[i]
            items[i] = _WriteItem(
                name, path, reservation, tmp, fd, views[i], payload, header, item_spans, allocated
            )
            return True

        big = self._io.worth_threads(sum(map(total_nbytes, views)), n)
        mapper = self._io.map if big else None
        try:
            ok = self._map_pages(op, n, prepare, mapper)
            todo = [i for i in range(n) if items[i] is not None]
            if not todo:
                return ok
            try:
                self.move_payloads("write", [item for item in items if item is not None])
            except (BackendError, OSError) as exc:
                for i in todo:
                    ok[i] = False
                self._log_failure(op, exc)
                self._add_item_errors(len(todo))
                return ok  # (the temporaries are removed below)

            def publish(j: int) -> bool:
                item, items[todo[j]] = items[todo[j]], None
                assert item is not None
                nbytes = item.payload + HEADER_SIZE
                try:  # (finish_temp closes the file and removes the temporary, always)
                    published = finish_temp(
                        item.path,
                        item.fd,
                        item.final,
                        nbytes,
                        fsync=self.options.fsync,
                        allocated=item.allocated,
                    )
                    self._settle(item.name, item.final, item.reservation, published, nbytes)
                except OSError as exc:
                    raise from_os_error(exc, f"write {item.final}") from exc
                finally:
                    item.reservation.release()
                return True

            for i, done in zip(todo, self._map_pages(op, len(todo), publish, mapper), strict=True):
                ok[i] = done
            return ok
        finally:
            for item in items:  # not published: a failed move, close(), an error
                if item is not None:
                    self._abandon(item)

    @staticmethod
    def _abandon(item: _WriteItem) -> None:
        """A write that will not be published: close and remove its temporary, free its room."""
        with contextlib.suppress(OSError):
            os.close(item.fd)
        with contextlib.suppress(OSError):
            os.unlink(item.path)
        item.reservation.release()

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

    # ------------------------------------------------------------------ existence, delete

    @override
    def exists(self, key: str) -> bool:
        return self._exists_at(self._root_prefix + self.object_path(key))

    @override
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        # The prefetch path's hot loop (every page of every prompt). The common case is
        # inline: the path from the remembered name, one lstat, a regular file of ours
        # that nobody else can write (the trust rule for a private store). Anything else
        # (a metadata cache, a shared group, an odd file, an error) takes _exists_at.
        paths, exists_at = self.object_namer().paths(keys, self._root_prefix), self._exists_at
        if self._meta.enabled or self.group_id is not None:
            for i, path in enumerate(paths):
                if not exists_at(path):
                    return i
            return len(keys)
        lstat, euid, is_reg = os.lstat, os.geteuid(), stat.S_ISREG
        foreign = stat.S_IWGRP | stat.S_IWOTH
        for i, path in enumerate(paths):
            try:
                st = lstat(path)
            except FileNotFoundError:
                return i
            except OSError:
                st = None
            if (
                st is None or not is_reg(st.st_mode) or st.st_uid != euid or st.st_mode & foreign
            ) and not exists_at(path):
                return i
        return len(keys)

    @override
    def delete(self, key: str) -> bool:
        name = self.object_name(key)
        path = self._path(name)
        # Forget before unlinking (see _quarantine): the accounting may briefly count a
        # deleted file, never miss a stored one.
        self._meta.discard(path)
        self._tracker.discard(name.path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            if self._on_disk(path):
                self._tracker.add(name.path, os.lstat(path).st_size)
            raise from_os_error(exc, f"delete {path}") from exc
        return True

    @override
    def clear(self) -> None:
        """Remove this namespace's directory (and only it); the backend stays usable."""
        trash = os.path.join(
            self.root, f"{TRASH_PREFIX}{self.namespace.digest}.{secrets.token_hex(6)}"
        )
        try:
            os.rename(self.directory, trash)
        except FileNotFoundError:
            trash = ""
        except OSError as exc:
            raise from_os_error(exc, f"clear {self.directory}") from exc
        self._forget_dirs()
        self._meta.clear()
        self._tracker.clear(prefix=f"{self.namespace.digest}/" if self.capacity_per_root else None)
        try:
            self._ensure_tree()
        except ConfigError as exc:
            raise BackendError(str(exc)) from exc
        if trash:
            # The namespace is gone for every reader once renamed; its files are deleted
            # in the background, so clear() returns at once however many it held. A
            # process that dies first leaves the trash directory to the next start-up.
            reclaim = threading.Thread(
                target=shutil.rmtree,
                args=(trash,),
                kwargs={"ignore_errors": True},
                name="hicache-storage-clear",
                daemon=True,
            )
            reclaim.start()
            with self._dirs_lock:
                self._reclaims = [t for t in self._reclaims if t.is_alive()] + [reclaim]

    @override
    def close(self) -> None:
        self._io.close()
        self._scanner.save(self._tracker, self.snapshot_min_objects)
        self._wait_for_reclaims()  # the files of cleared namespaces: gone when close returns

    # ------------------------------------------------------------------ introspection

    @override
    def usage(self) -> dict[str, int]:
        """The protocol's figures, from the capacity tracker; and ``reserved_bytes``.

        The tracker counts only with a cap or a floor set (objects and bytes are -1
        without), each object as its file's size (payload and header).
        """
        tracker = self._tracker
        counted = tracker.enabled
        return {
            "objects": len(tracker) if counted else -1,
            "used_bytes": tracker.used_bytes if counted else -1,
            "limit_bytes": tracker.max_bytes or 0,
            "reserved_bytes": tracker.reserved_bytes if counted else -1,
        }

    @override
    def __repr__(self) -> str:
        return f"{type(self).__name__}(root={self.root!r}, namespace={self.namespace.digest}, shard={self.config.shard})"
