"""One object per file under a per-namespace directory: the machinery of file-like stores.

Shared by the ``file`` backend (any POSIX filesystem) and the ``shm`` backend (``/dev/shm``),
which differ only in their options and defaults. Layout:
``<root>/<namespace digest>/<fanout>/<key>[~<shard>]``; every file is
``header || payload`` (see :mod:`hicache_storage.header`), published atomically
(:mod:`hicache_storage.atomic`); capacity is tracked with
:class:`~hicache_storage.capacity.CapacityTracker`. Guarantees are documented in
``docs/backends/file.md`` and ``docs/backends/shm.md``.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import secrets
import shutil
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

from hicache_storage.atomic import (
    fsync_dir,
    preadv_all,
    publish,
    remove_stale_temporaries,
    temp_path,
    write_atomic,
    writev_all,
)
from hicache_storage.backend import HiCacheStorage
from hicache_storage.buffers import (
    PageBuffer,
    memoryview_at,
    source_views,
    target_views,
    total_nbytes,
)
from hicache_storage.capacity import CapacityTracker, Reservation
from hicache_storage.config import Size, StorageConfig, parse_options
from hicache_storage.errors import (
    CapacityError,
    ConfigError,
    CorruptObjectError,
    InvalidArgumentError,
    from_os_error,
)
from hicache_storage.header import (
    HEADER_SIZE,
    algorithm_id,
    checksum,
    decode_header,
    encode_header,
    verify_payload,
)
from hicache_storage.iopool import IOPool
from hicache_storage.keys import ObjectName
from hicache_storage.metacache import MetadataCache

__all__ = ["FileStore", "FileStoreOptions"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_TRASH_PREFIX = ".trash."


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return a.st_ino == b.st_ino and a.st_dev == b.st_dev


@dataclass(frozen=True)
class FileStoreOptions:
    """Options shared by file-like stores (each backend adds its location option).

    Attributes:
        fsync: fsync each file and its directory before publishing (crash durability).
        max_size: cap on this namespace's bytes (e.g. ``"200GiB"``); LRU eviction.
            ``None``: the backend's default (none for ``file``).
        min_free_space: keep at least this much free space on the filesystem.
            ``None``: the backend's default (0 for ``file``).
        eviction_ratio: once over ``max_size``, evict down to ``max_size * eviction_ratio``.
        io_threads: threads for batch reads and writes.
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
    io_threads: int = 4
    metadata_cache_ttl: float = 0.0
    checksum: Literal["xxh3", "none"] = "xxh3"
    verify_checksum: bool = True
    stale_temp_age: float = 3600.0

    def __post_init__(self) -> None:
        if self.io_threads < 1:
            raise ConfigError(f"io_threads must be >= 1, got {self.io_threads}")
        if self.metadata_cache_ttl < 0 or self.stale_temp_age < 0:
            raise ConfigError("metadata_cache_ttl and stale_temp_age must be >= 0")
        if not 0 < self.eviction_ratio <= 1:
            raise ConfigError(f"eviction_ratio must be in (0, 1], got {self.eviction_ratio}")


class FileStore(HiCacheStorage):
    """Pages as files in a directory tree (zero-copy ``writev``/``preadv``).

    Subclasses set :attr:`options_class` (a :class:`FileStoreOptions` subclass) and
    implement :meth:`_location`; they may change :attr:`file_mode`, :attr:`dir_mode`,
    :attr:`group_id` (in ``_configure``) and the defaults of the capacity limits.
    """

    options_class: ClassVar[type[FileStoreOptions]] = FileStoreOptions
    #: Mode of stored files and of directories this store creates.
    file_mode: int = 0o600
    dir_mode: int = 0o700
    #: Group that owns what this store creates (``None``: the process's group).
    group_id: int | None = None
    #: Refresh a file's mtime when it is read, so LRU order survives a restart.
    persist_recency: bool = True
    #: Objects of this store may be evicted by overwriting their file in place with another
    #: object of the same size (see :meth:`_recycle`); readers then lock and re-check.
    #: Every instance of a store type must agree, so this is per class; whether an
    #: instance itself recycles is :attr:`recycle`.
    recycles_files: ClassVar[bool] = False
    recycle: bool = False

    def __init__(self, config: StorageConfig | None = None, **options: Any) -> None:
        super().__init__(config)
        self.options = parse_options(self.options_class, self.name, options)
        opts = self.options
        self._configure(opts)
        self.root = os.path.abspath(os.path.expanduser(self._location(opts)))
        self.directory = os.path.join(self.root, self.namespace.digest)
        self._algorithm = algorithm_id(opts.checksum)
        self._meta = MetadataCache(opts.metadata_cache_ttl)
        self._dirs: set[str] = set()
        self._dirs_lock = threading.Lock()
        self._io = IOPool(opts.io_threads, f"hicache-{self.name}")
        try:
            os.makedirs(self.root, mode=self.dir_mode, exist_ok=True)
            self._mkdir(self.directory)
        except OSError as exc:
            raise ConfigError(
                f"cannot create the {self.name} backend directory {self.directory}: {exc}"
            ) from exc
        self._remove_leftovers()
        max_size, min_free = self._limits(opts)
        self._tracker = CapacityTracker(
            max_size,
            self._evict,
            eviction_ratio=opts.eviction_ratio,
            min_free_bytes=min_free,
            free_space=self._free_space,
        )
        if self._tracker.enabled:
            self._tracker.load(self._scan())

    # ------------------------------------------------------------------ subclass hooks

    def _location(self, opts: Any) -> str:
        """The root directory named by the options."""
        raise NotImplementedError

    def _configure(self, opts: Any) -> None:
        """Set modes and group from the options (default: private, 0600/0700)."""

    def _limits(self, opts: FileStoreOptions) -> tuple[int | None, int]:
        """``(max_size, min_free_space)`` with the backend's defaults applied."""
        return opts.max_size, opts.min_free_space or 0

    # ------------------------------------------------------------------ helpers

    def _mkdir(self, path: str) -> bool:
        """Create one directory with this store's mode and group; False if it existed."""
        try:
            os.mkdir(path, self.dir_mode)
        except FileExistsError:
            return False
        if self.group_id is not None:
            os.chown(path, -1, self.group_id)
        os.chmod(path, self.dir_mode)  # mkdir masks the mode with the umask, and drops setgid
        return True

    def _path(self, name: ObjectName) -> str:
        return os.path.join(self.root, name.namespace, name.fanout, name.leaf)

    def _remove_leftovers(self) -> None:
        """Delete temporaries of dead writers and directories left by an interrupted clear()."""
        remove_stale_temporaries(self.directory, self.options.stale_temp_age)
        prefix = f"{_TRASH_PREFIX}{self.namespace.digest}."
        for entry in os.scandir(self.root):
            if entry.name.startswith(prefix):
                shutil.rmtree(entry.path, ignore_errors=True)

    def _owns(self, leaf: str) -> bool:
        """True for a stored object of this instance's shard (ranks share the directory)."""
        shard = self.config.shard
        _, sep, tail = leaf.partition("~")
        return tail == shard if shard is not None else not sep

    def _scan(self) -> list[tuple[str, int, float]]:
        """This shard's stored objects in this namespace as (relative name, bytes, mtime)."""
        found: list[tuple[str, int, float]] = []
        with os.scandir(self.directory) as fans:
            for fan in fans:
                if not fan.is_dir(follow_symlinks=False):
                    continue
                with os.scandir(fan.path) as files:
                    for f in files:
                        if f.name.startswith(".") or not self._owns(f.name):
                            continue
                        if not f.is_file(follow_symlinks=False):
                            continue
                        try:
                            st = f.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        rel = f"{self.namespace.digest}/{fan.name}/{f.name}"
                        found.append((rel, st.st_size, st.st_mtime))
        return found

    def _free_space(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def _evict(self, rel: str) -> bool:
        path = os.path.join(self.root, rel)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("cannot evict %s: %s", path, exc)
            return False
        self._meta.discard(path)
        self._record(evictions=1)
        return True

    def _ensure_dir(self, name: ObjectName) -> None:
        if name.fanout in self._dirs:
            return
        # Both levels with an explicit mode (makedirs applies it to the leaf only); the
        # namespace directory may have been removed by a clear() in another process.
        fan = os.path.join(self.directory, name.fanout)
        for path, parent in ((self.directory, self.root), (fan, self.directory)):
            if self._mkdir(path) and self.options.fsync:
                fsync_dir(parent)
        with self._dirs_lock:
            self._dirs.add(name.fanout)

    def _open_published(self, path: str) -> int | None:
        """Open the object at ``path`` for reading; None if there is none.

        In a store that recycles evicted files, the file is also locked shared (``flock``)
        and checked to be still the one published at ``path``: a recycler overwrites only
        a file it could lock exclusively *after* taking it out of the namespace, so once
        both hold, the bytes cannot change under this reader until it closes the file.
        """
        for _ in range(2):  # once more if the name was re-published meanwhile
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise from_os_error(exc, f"open {path}") from exc
            if not self.recycles_files:
                return fd
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                same = _same_file(os.fstat(fd), os.stat(path))
            except (BlockingIOError, FileNotFoundError):
                same = False  # being recycled, or evicted: no longer this key's object
            except OSError as exc:
                os.close(fd)
                raise from_os_error(exc, f"open {path}") from exc
            if same:
                return fd
            os.close(fd)
        return None

    def _read(self, name: ObjectName, views: list[memoryview] | None) -> Any:
        """Read an object into ``views`` (or a new tensor); None on miss, mismatch or corruption."""
        path = self._path(name)
        fd = self._open_published(path)
        if fd is None:
            self._meta.discard(path)
            return None
        out: Any = True
        try:
            st = os.fstat(fd)
            payload = st.st_size - HEADER_SIZE
            if payload < 0:
                raise CorruptObjectError(f"{st.st_size}-byte file is shorter than a header")
            if views is None:
                import torch

                out = torch.empty(payload, dtype=torch.uint8)
                views = [memoryview_at(int(out.data_ptr()), payload, out)]
            elif total_nbytes(views) != payload:
                self._record(size_mismatches=1)
                return None
            head = bytearray(HEADER_SIZE)
            got = preadv_all(fd, [memoryview(head), *views], 0)
            if got != st.st_size:
                raise CorruptObjectError(f"short read: {got} of {st.st_size} bytes")
            header = decode_header(head)
            if header.payload_len != payload:
                raise CorruptObjectError(
                    f"header says {header.payload_len} bytes, file holds {payload}"
                )
            if self.options.verify_checksum:
                verify_payload(header, views)
        except CorruptObjectError as exc:
            self._quarantine(path, fd, exc)
            return None
        except OSError as exc:
            raise from_os_error(exc, f"read {path}") from exc
        finally:
            os.close(fd)
        self._record(bytes_read=payload)
        self._touch(name, path)
        return out

    def _quarantine(self, path: str, fd: int, exc: CorruptObjectError) -> None:
        """Remove a corrupt object so the next ``set`` can store a good one."""
        self._record(corrupt_objects=1)
        logger.warning("corrupt object %s (%s): removing it; the read is a miss", path, exc)
        # Forget it first: a concurrent set of the same key can then only leave an entry
        # for a file that exists (never the reverse, which would let the cap be exceeded).
        self._meta.discard(path)
        self._tracker.discard(os.path.relpath(path, self.root))
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
        except OSError:
            pass

    def _touch(self, name: ObjectName, path: str) -> None:
        if self._tracker.enabled:
            self._tracker.touch(name.path)
            if self.persist_recency:
                try:
                    os.utime(path)  # recency survives a restart (the start-up scan reads mtime)
                except OSError:
                    pass

    def get(self, key: str, target: Any = None) -> Any:
        # docstring inherited
        views = None if target is None else target_views(target)
        out = self._read(self.object_name(key), views)
        if out is None:
            return None
        return out if target is None else target

    def _each_page(
        self,
        op: str,
        keys: list[str],
        pages: Sequence[PageBuffer],
        io: Callable[[ObjectName, list[memoryview]], Any],
    ) -> list[bool]:
        """Run ``io`` for every page on the thread pool; a failing page fails alone."""
        if len(pages) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(pages)} pages")
        names = [self.object_name(k) for k in keys]
        errors = [0]

        def one(i: int) -> bool:
            try:
                done = io(names[i], pages[i].views)
                return done is not None and done is not False
            except Exception as exc:  # noqa: BLE001 - one page fails, the batch goes on
                self._log_failure(op, exc)
                errors[0] += 1
                return False

        out = self._io.map(one, len(keys))
        self._add_item_errors(errors[0])
        return out

    def batch_get_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        # docstring inherited
        return self._each_page("batch_get_pages", keys, pages, self._read)

    # ------------------------------------------------------------------ writes

    def _exists(self, name: ObjectName, path: str) -> bool:
        if self._meta.contains(path):
            return True
        if not self._on_disk(path):
            return False
        self._meta.add(path)
        return True

    def _on_disk(self, path: str) -> bool:
        """True if ``path`` exists now (no metadata cache: writes must not trust it)."""
        try:
            os.stat(path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise from_os_error(exc, f"stat {path}") from exc
        return True

    def _write(self, name: ObjectName, views: list[memoryview]) -> bool:
        path = self._path(name)
        if self._on_disk(path):
            self._meta.add(path)
            self._touch(name, path)
            return True
        payload = total_nbytes(views)
        victim = None
        reused = (
            self._tracker.reserve_reusing(name.path, HEADER_SIZE + payload)
            if self.recycle
            else None
        )
        if reused is not None:
            reservation, victim = reused
        else:
            reservation = self._reserve(name, HEADER_SIZE + payload)
        try:  # released on any exit unless committed (the reservation may be replaced)
            header = encode_header(payload, checksum(views, self._algorithm), self._algorithm)
            write_new = functools.partial(
                write_atomic, fsync=self.options.fsync, mode=self.file_mode, gid=self.group_id
            )
            try:
                published = None
                if victim is not None:
                    try:
                        published = self._recycle(
                            victim, name, path, [header, *views], HEADER_SIZE + payload
                        )
                    except FileNotFoundError:
                        published = None  # directories removed by a clear(): a new file
                    if published is None:
                        # Not reused: a new file needs room like any other (cap and floor).
                        reservation.release()
                        reservation = self._reserve(name, HEADER_SIZE + payload)
                if published is None:
                    try:
                        self._ensure_dir(name)
                        published = write_new(path, [header, *views])
                    except FileNotFoundError:
                        # The fan-out directory vanished (clear() in another process).
                        with self._dirs_lock:
                            self._dirs.discard(name.fanout)
                        self._ensure_dir(name)
                        published = write_new(path, [header, *views])
            except OSError as exc:
                raise from_os_error(exc, f"write {path}") from exc
            if published:
                if not reservation.commit() and self._on_disk(path):
                    # clear() ran during the write and the object landed after it.
                    self._tracker.add(name.path, HEADER_SIZE + payload)
                self._record(bytes_written=payload)
            else:
                self._touch(name, path)
        finally:
            reservation.release()
        self._meta.add(path)
        return True

    def _reserve(self, name: ObjectName, nbytes: int) -> Reservation:
        """Room for a new file of ``nbytes`` (evicting LRU objects), or CapacityError."""
        reservation = self._tracker.reserve(name.path, nbytes)
        if reservation is None:
            raise CapacityError(f"no room for {nbytes} bytes under max_size/min_free_space")
        return reservation

    def _recycle(
        self,
        victim_rel: str,
        name: ObjectName,
        path: str,
        views: list[memoryview | bytes],
        nbytes: int,
    ) -> bool | None:
        """Evict ``victim_rel`` by overwriting its file with ``views`` (``nbytes``), then publish.

        Rewriting pages the filesystem already holds is much cheaper than allocating new
        ones (tmpfs: about 1.5x for writes, and reads of the result are faster too). The
        file first leaves the namespace (``rename`` to a temporary: new readers miss it),
        then is overwritten only if no reader holds it (``flock`` exclusive, not waiting;
        see :meth:`_open_published` for the readers' side), then published like a new
        file. Returns True/False as :func:`~hicache_storage.atomic.publish`, or None when
        the file could not be reused (gone, another size, read by someone): it is then
        removed, and the caller writes a new file.
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
                fd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC)
            except PermissionError:
                return None  # another user's page (group sharing): evicted, not reused
            try:
                if os.fstat(fd).st_size != nbytes:
                    return None
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return None  # a reader still copies the evicted object: leave it be
                writev_all(fd, views)
                if self.options.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)  # releases the lock before the object is visible
            self._ensure_dir(name)
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
                logger.error("published %s but fsync of its directory failed: %s", path, exc)
        return published

    def set(self, key: str, value: Any) -> bool:
        # docstring inherited
        return self._write(self.object_name(key), source_views(value))

    def batch_set_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        # docstring inherited
        return self._each_page("batch_set_pages", keys, pages, self._write)

    # ------------------------------------------------------------------ existence, delete

    def exists(self, key: str) -> bool:
        # docstring inherited
        name = self.object_name(key)
        return self._exists(name, self._path(name))

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        # docstring inherited
        for i, key in enumerate(keys):
            name = self.object_name(key)
            if not self._exists(name, self._path(name)):
                return i
        return len(keys)

    def delete(self, key: str) -> bool:
        # docstring inherited
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
                self._tracker.add(name.path, os.stat(path).st_size)
            raise from_os_error(exc, f"delete {path}") from exc
        return True

    def clear(self) -> None:
        """Remove this namespace's directory (and only it); the backend stays usable."""
        trash = os.path.join(
            self.root, f"{_TRASH_PREFIX}{self.namespace.digest}.{secrets.token_hex(6)}"
        )
        try:
            os.rename(self.directory, trash)
        except FileNotFoundError:
            trash = ""
        except OSError as exc:
            raise from_os_error(exc, f"clear {self.directory}") from exc
        with self._dirs_lock:
            self._dirs.clear()
        self._meta.clear()
        self._tracker.clear()
        self._mkdir(self.directory)
        if trash:
            shutil.rmtree(trash, ignore_errors=True)

    def close(self) -> None:
        # docstring inherited
        self._io.close()

    # ------------------------------------------------------------------ introspection

    def usage(self) -> dict[str, int]:
        """Bytes and objects tracked for capacity (zeros when no limit is set)."""
        return {
            "used_bytes": self._tracker.used_bytes,
            "reserved_bytes": self._tracker.reserved_bytes,
            "objects": len(self._tracker),
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}(root={self.root!r}, namespace={self.namespace.digest}, shard={self.config.shard})"
