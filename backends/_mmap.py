"""The ``mmap`` backend: a persistent slab store in one preallocated, memory-mapped file.

Files (``path`` is the arena):

``<path>``            superblock (4 KiB, with a random creation nonce), slot table (64 B
                      per slot), then the slots; writers lock this file (``flock``)
``<path>.index``      a header naming the arena's nonce, then an append-only log of PUT /
                      DEL records, each with a CRC-32

A page lives in one fixed-size slot. A write reserves a free slot (marking it *writing*
with its token in the shared slot table, under the lock), copies the page into the mapping
without the lock, then appends a PUT record (under the lock). A key is visible only once
its record is in the log, so a writer killed at any point leaves no visible torn page,
and a torn record at the end of the log (a crash mid-append) fails its CRC and is
ignored. Other processes learn new keys by reading the log's new records.

A writer holds an open-file-description lock (``F_OFD_SETLK``) on its slot's byte of the
arena file while it copies; the kernel drops it if the writer dies, which is how other
processes tell a crashed writer's slot (reclaimable) from a live one, whatever pid
namespace either runs in. Eviction is LRU over the slot table's last-access times
(updated by readers in every process). An evicted slot is logged (DEL), given a new
random generation, and *retired*: it
is reused only after ``reuse_delay`` seconds, so no reader can still be copying out of it;
readers also re-check the slot's generation after their copy and report a miss if it
changed. The log is compacted (live records to a temporary, then renamed over it) when it
grows to several times the live set; other processes notice the new inode and reload.

Options and guarantees: ``docs/backends/mmap.md``.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import secrets
import stat
import struct
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Literal

from hicache_storage.buffers import PageBuffer, is_tensor, source_views, target_views, total_nbytes
from hicache_storage.config import Size, StorageConfig, parse_options
from hicache_storage.errors import (
    BackendError,
    BackendTimeoutError,
    CapacityError,
    ConfigError,
    InvalidArgumentError,
    NotSupportedError,
)
from hicache_storage.protocol import Capabilities, HiCacheStorage
from hicache_storage.storekit.atomic import fsync_dir, temp_path, writev_all
from hicache_storage.storekit.header import ALGORITHMS, algorithm_id, checksum
from hicache_storage.storekit.iopool import IOPool
from hicache_storage.storekit.pathsafety import (
    NotRegularFileError,
    check_file,
    ensure_dir,
    open_regular,
    user_dir,
)

__all__ = ["MmapBackend", "MmapOptions"]

logger = logging.getLogger(__name__)

PAGE = 4096
# magic, version, flags, slot_size, nslots, table_off, data_off, nonce (the arena's identity)
_SUPER = struct.Struct("<8sIIQQQQQ")
_MAGIC = b"HCSMMAP1"
_VERSION = 2
# The index log starts with a header naming the arena it describes (magic, version, flags,
# arena nonce, then a CRC-32): a log that is not this arena's is never applied to it.
_LOG_HEAD = struct.Struct("<8sIIQ")
_LOG_MAGIC = b"HCSMLOG1"
_LOG_VERSION = 1
_ANCHOR = 8  # bytes before the read position re-checked on every read of the log
_SLOT_DTYPE = [
    ("generation", "<u8"),
    ("state", "<u4"),
    ("pid", "<u4"),
    ("length", "<u8"),
    ("checksum", "<u8"),
    ("last_access", "<f8"),
    ("since", "<f8"),
    ("token", "<u8"),
    ("pad", "<u8"),
]
FREE, WRITING, COMMITTED, RETIRED = 0, 1, 2, 3
_REC = struct.Struct(
    "<4sBBHIQQQ"
)  # magic, type, algorithm, name length, slot, generation, length, checksum
_REC_MAGIC = b"HIDX"
PUT, DEL = 1, 2
_CRC = struct.Struct("<I")


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class MmapOptions:
    """Options of the ``mmap`` backend (environment: ``HICACHE_STORAGE_MMAP_<NAME>``).

    Attributes:
        path: the arena file (typically on local NVMe); its ``.index`` beside it.
            Default: ``/tmp/hicache-storage-mmap-<uid>/arena``, in a private (0700)
            directory of the user. An existing arena, index or lock file must be a
            regular file owned by the user and writable by nobody else.
        capacity: arena size, fixed at creation (e.g. ``"512MiB"``); slots = capacity /
            slot_size. Reopening an arena keeps its original geometry.
        slot_size: bytes per slot (the largest storable object), rounded up to 4 KiB;
            default: the page size of the host pool registered before the first write,
            else 4 MiB (or the first object's size if larger). Fixed at creation.
        fsync: make every write durable (msync the slot and fsync the index) before it
            becomes visible; without it a write survives a process crash, not a power loss.
        checksum: payload checksum kept in the index: ``"none"`` or ``"xxh3"``.
        verify_checksum: verify the checksum on every read (needs ``checksum="xxh3"``).
        reuse_delay: seconds an evicted slot rests before it is reused (readers also
            re-check a slot's generation after copying, so this only avoids wasted reads).
        low_free_slots: evict ahead when fewer than this fraction of the slots is free.
        io_threads: threads copying the pages of a batch.
        prefault: touch the whole arena at creation so it is resident in the page cache.
    """

    path: str | None = None
    capacity: Size = Size(512 * 2**20)  # noqa: RUF009 - an int constant
    slot_size: Size | None = None
    fsync: bool = False
    checksum: Literal["xxh3", "none"] = "none"
    verify_checksum: bool = False
    reuse_delay: float = 0.05
    low_free_slots: float = 0.05
    io_threads: int = 2
    prefault: bool = True

    def __post_init__(self) -> None:
        if self.path is not None and not self.path:
            raise ConfigError("path must not be empty")
        if self.path is not None and "\0" in self.path:
            raise ConfigError("path must not contain a NUL byte")
        if self.capacity <= 0:
            raise ConfigError("capacity must be > 0")
        if self.slot_size is not None and self.slot_size <= 0:
            raise ConfigError("slot_size must be > 0")
        if self.reuse_delay < 0:
            raise ConfigError("reuse_delay must be >= 0")
        if not 0 <= self.low_free_slots < 1:
            raise ConfigError("low_free_slots must be in [0, 1)")
        if self.io_threads < 1:
            raise ConfigError("io_threads must be >= 1")
        if self.verify_checksum and self.checksum == "none":
            raise ConfigError('verify_checksum needs checksum="xxh3"')


@dataclass
class _Entry:
    slot: int
    generation: int
    length: int
    checksum: int
    algorithm: int


_FLOCK = struct.Struct(
    "hhqqi4x"
)  # struct flock on 64-bit Linux (l_type, l_whence, start, len, pid)
_FENCE = threading.Lock()


def _fence() -> None:
    """A full memory barrier (a lock round trip), between a copy and its generation re-check."""
    with _FENCE:
        pass


def _new_generation(old: int) -> int:
    """A fresh random slot generation, never 0 and never ``old``.

    Random rather than ``old + 1``: a slot-table row rolled back (zeroed, restored from
    an older image) must not hand out again a (slot, generation) pair that a reader in
    another process may still hold for another key.
    """
    while True:
        gen = secrets.randbits(63) + 1
        if gen != old:
            return gen


def _link_or_open(tmp: str, fd: int, path: str) -> int:
    """Publish the complete temporary ``tmp`` (open as ``fd``) as ``path``, first creator
    wins. Returns the descriptor to use: ``fd``, or, when another process won the race,
    one of the file it put there (``fd`` is then closed)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        theirs = open_regular(path, os.O_RDWR)
        os.close(fd)
        return theirs
    return fd


def _log_header(nonce: int) -> bytes:
    head = _LOG_HEAD.pack(_LOG_MAGIC, _LOG_VERSION, 0, nonce)
    return head + _CRC.pack(zlib.crc32(head))


def _log_nonce(head: bytes) -> int | None:
    """The arena nonce of a log header, or None if it is not a valid header."""
    if len(head) < _LOG_HEAD.size + _CRC.size:
        return None
    magic, version, _flags, nonce = _LOG_HEAD.unpack_from(head)
    (crc,) = _CRC.unpack_from(head, _LOG_HEAD.size)
    if magic != _LOG_MAGIC or version != _LOG_VERSION or zlib.crc32(head[: _LOG_HEAD.size]) != crc:
        return None
    return int(nonce)


def _decode_record(data: bytes, off: int, arena: _Arena) -> tuple[int, str, _Entry, int] | None:
    """The intact record at ``off``: (kind, name, entry, end offset), or None.

    Intact means: magic, CRC, and fields that make sense for this arena (a slot it has,
    a length that fits a slot, a known record type and checksum algorithm).
    """
    if off + _REC.size + _CRC.size > len(data):
        return None
    magic, kind, algo, name_len, slot, gen, length, csum = _REC.unpack_from(data, off)
    end = off + _REC.size + name_len
    if magic != _REC_MAGIC or end + _CRC.size > len(data):
        return None
    (crc,) = _CRC.unpack_from(data, end)
    if zlib.crc32(data[off:end]) != crc:
        return None
    if kind not in (PUT, DEL) or slot >= arena.nslots or length > arena.slot_size:
        return None
    if algo not in ALGORITHMS.values():
        return None
    try:
        name = data[off + _REC.size : end].decode("utf-8")
    except UnicodeDecodeError:
        return None
    return kind, name, _Entry(slot, gen, length, csum, algo), end + _CRC.size


def _next_record(data: bytes, start: int, arena: _Arena) -> int:
    """Offset of the next intact record at or after ``start``, or -1."""
    pos = data.find(_REC_MAGIC, start)
    while pos >= 0:
        if _decode_record(data, pos, arena) is not None:
            return pos
        pos = data.find(_REC_MAGIC, pos + 1)
    return -1


def _check_directory(directory: str) -> None:
    """The arena's directory: created if missing (0700); if it exists, a real directory
    owned by the user or root that no other user can replace files in (not writable by
    group or others, unless sticky like ``/tmp``)."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        st = os.lstat(directory)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot create the mmap arena directory {directory}: {exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{directory} is not a directory (a symlink?): choose another path")
    if st.st_uid not in (os.geteuid(), 0):
        raise ConfigError(
            f"{directory} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}): "
            "put the arena in a directory of your own"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(
            f"{directory} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}), "
            f"who could replace the arena's files: chmod go-w {directory}, or choose another path"
        )


class _Arena:
    """The mapped arena file: superblock, slot table (a numpy view) and slot data."""

    def __init__(self, path: str, capacity: int, slot_size: int, prefault: bool) -> None:
        import numpy as np

        self.path = path
        try:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
            except FileNotFoundError:
                fd = self._create(path, capacity, slot_size, prefault)
        except OSError as exc:
            raise ConfigError(f"cannot open the mmap arena {path}: {exc}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"{path} is not a regular file: choose another arena path")
            check_file(path, st)
            size = st.st_size
            self.ino, self.dev = st.st_ino, st.st_dev
            head = os.pread(fd, _SUPER.size + 4, 0)
            if len(head) < _SUPER.size + 4:
                raise ConfigError(f"{path} is not a hicache-storage mmap arena (too short)")
            magic, version, _flags, slot, nslots, table_off, data_off, nonce = _SUPER.unpack(
                head[: _SUPER.size]
            )
            (crc,) = _CRC.unpack(head[_SUPER.size :])
            if magic == _MAGIC and version != _VERSION:
                raise ConfigError(
                    f"{path} is an mmap arena of format version {version}, this release reads "
                    f"version {_VERSION}: delete {path} and {path}.index (a cache: nothing "
                    "else is lost) or choose another path"
                )
            if magic != _MAGIC or zlib.crc32(head[: _SUPER.size]) != crc:
                raise ConfigError(f"{path} is not a hicache-storage mmap arena (or is damaged)")
            if (
                not nslots
                or table_off < PAGE
                or data_off < table_off + nslots * 64
                or slot < PAGE
                or size < data_off + nslots * slot
            ):
                raise ConfigError(f"{path} is truncated or has a bad geometry ({size} bytes)")
            self.slot_size, self.nslots, self.data_off = int(slot), int(nslots), int(data_off)
            self.table_off = int(table_off)
            self.nonce = int(nonce)
            self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, OSError):
                raise ConfigError(f"cannot map the mmap arena {path}: {exc}") from exc
            raise
        # The open descriptor stays: writers lock it (flock for their bookkeeping, an OFD
        # byte lock per slot being written). Locks on the arena itself cannot be split
        # in two by a removed lock file, and vanish with the arena.
        self.fd = fd
        self._anchor = ctypes.c_char.from_buffer(self.map)
        self.base = ctypes.addressof(self._anchor)
        self.slots = np.ndarray(
            (self.nslots,), dtype=_SLOT_DTYPE, buffer=self.map, offset=table_off
        )

    @staticmethod
    def _create(path: str, capacity: int, slot_size: int, prefault: bool) -> int:
        """Build a complete arena under a temporary name, then link it into place.

        A creator killed half way leaves only a temporary (removed by the next opener),
        never a full-size file without a superblock. Returns an open descriptor.
        """
        slot_size = _round_up(slot_size, PAGE)
        nslots = 0
        for n in range(capacity // slot_size, 0, -1):
            if PAGE + _round_up(n * 64, PAGE) + n * slot_size <= capacity:
                nslots = n
                break
        if nslots < 1:
            raise ConfigError(f"capacity {capacity} holds no slot of {slot_size} bytes")
        table_off = PAGE
        data_off = PAGE + _round_up(nslots * 64, PAGE)
        total = data_off + nslots * slot_size
        tmp = temp_path(os.path.dirname(path) or ".")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError as exc:
                raise CapacityError(f"cannot allocate a {total}-byte arena: {exc}") from exc
            if prefault:
                chunk = bytes(1 << 22)
                for off in range(0, total, len(chunk)):
                    os.pwrite(fd, chunk[: min(len(chunk), total - off)], off)
            nonce = int.from_bytes(secrets.token_bytes(8), "little") or 1
            head = _SUPER.pack(_MAGIC, _VERSION, 0, slot_size, nslots, table_off, data_off, nonce)
            os.pwrite(fd, head + _CRC.pack(zlib.crc32(head)), 0)
            os.fsync(fd)
            fd = _link_or_open(tmp, fd, path)
            fsync_dir(os.path.dirname(path) or ".")
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(tmp)
        return fd

    def slot_addr(self, slot: int) -> int:
        return int(self.base + self.data_off + slot * self.slot_size)

    def slot_view(self, slot: int, length: int) -> memoryview:
        start = self.data_off + slot * self.slot_size
        return memoryview(self.map)[start : start + length]

    def _flush_range(self, start: int, length: int) -> None:
        aligned = start - start % mmap.PAGESIZE
        self.map.flush(aligned, _round_up(start + length - aligned, mmap.PAGESIZE))

    def flush(self, slot: int, length: int) -> None:
        """msync a slot's data."""
        self._flush_range(self.data_off + slot * self.slot_size, max(length, 1))

    def flush_row(self, slot: int) -> None:
        """msync a slot's table row."""
        self._flush_range(self.table_off + slot * 64, 64)

    def close(self) -> None:
        del self.slots
        del self._anchor
        self.map.close()
        os.close(self.fd)


def _copy(
    arena: _Arena,
    slot: int,
    views: Sequence[memoryview],
    ptrs: Sequence[int] | None,
    into_slot: bool,
) -> None:
    """Copy between a slot and a value's views, either way (memmove releases the GIL)."""
    addr = arena.slot_addr(slot)
    if ptrs is not None:
        for v, p in zip(views, ptrs, strict=True):
            if into_slot:
                ctypes.memmove(addr, p, v.nbytes)
            else:
                ctypes.memmove(p, addr, v.nbytes)
            addr += v.nbytes
        return
    region = arena.slot_view(slot, sum(v.nbytes for v in views))
    off = 0
    for v in views:
        if into_slot:
            region[off : off + v.nbytes] = v
        else:
            v[:] = region[off : off + v.nbytes]
        off += v.nbytes


def _copy_in(
    arena: _Arena, slot: int, views: Sequence[memoryview], ptrs: Sequence[int] | None
) -> None:
    """Copy a value's views into a slot."""
    _copy(arena, slot, views, ptrs, into_slot=True)


def _copy_out(
    arena: _Arena, slot: int, views: Sequence[memoryview], ptrs: Sequence[int] | None
) -> None:
    """Copy a slot into a target's views."""
    _copy(arena, slot, views, ptrs, into_slot=False)


def _pointers(value: Any, views: Sequence[memoryview]) -> list[int] | None:
    """Raw addresses of a value's views when known without copying (page buffers, tensors)."""
    if isinstance(value, PageBuffer):
        return [s.ptr for s in value.segments]
    if is_tensor(value) and value.is_contiguous():
        return [int(value.data_ptr())]
    return None


def _pool_page_bytes(pool: Any) -> int:
    """Bytes of one page of a host pool (ours: ``page_bytes``; SGLang's: from the
    buffer metadata of its first page), or 0 if it cannot be told."""
    nbytes = getattr(pool, "page_bytes", None)
    if nbytes:
        return int(nbytes)
    meta = getattr(pool, "get_page_buffer_meta", None)
    page_size = getattr(pool, "page_size", None)
    if meta is None or not page_size:
        return 0
    try:
        _ptrs, sizes = meta(list(range(int(page_size))))
        return int(sum(int(x) for x in sizes))
    except Exception:  # noqa: BLE001 - only a check; the v1 path reports its own errors
        return 0


DEFAULT_SLOT = 4 * 2**20
_CAPS = Capabilities(zero_copy=True, delete=True, persistent=True, shared=True)


class _MmapCapabilities:
    """Capabilities on the class; on an instance, with the arena's slot size as the limit."""

    def __get__(self, obj: MmapBackend | None, owner: type) -> Capabilities:
        if obj is None:
            return _CAPS
        return replace(_CAPS, max_object_bytes=obj._slot_limit())


class MmapBackend(HiCacheStorage):
    """A fixed-capacity slab of page slots in one memory-mapped file, with a crash-safe index."""

    name = "mmap"
    capabilities = _MmapCapabilities()

    def __init__(self, config: StorageConfig | None = None, **options: Any) -> None:
        super().__init__(config)
        self.options = parse_options(MmapOptions, "mmap", options)
        default = self.options.path is None
        raw = os.path.join(user_dir("/tmp", "hicache-storage-mmap"), "arena") if default else ""
        self.path = os.path.abspath(os.path.expanduser(self.options.path or raw))
        self.index_path = self.path + ".index"
        self._algorithm = algorithm_id(self.options.checksum)
        # _index_lock guards the in-memory index and the log position (readers take it to
        # catch up); _wlock orders this process's writers before they take the flock.
        # Neither is ever held while waiting for another process, but for _wlock.
        self._index_lock = threading.RLock()
        self._wlock = threading.Lock()
        self._open_lock = threading.Lock()  # one opener of the arena per instance
        self._arena: _Arena | None = None
        self._index: dict[str, _Entry] = {}
        self._by_slot: dict[int, str] = {}
        self._free_hint: list[int] = []
        self._log_fd = -1
        self._log_ino = 0
        self._log_pos = 0
        self._log_records = 0
        # The log at index_path does not describe this arena (left by a deleted arena, or
        # damaged): nothing of it is applied, and the next writer replaces it.
        self._log_foreign = False
        # (size, mtime) of the log when its tail was last found torn or damaged: not
        # re-read on every miss until the log changes.
        self._bad_tail: tuple[int, int] | None = None
        # The last bytes read before _log_pos (see _catch_up).
        self._anchor = b""
        # Why this instance stopped serving (its arena was removed or replaced under it).
        self._detached: str | None = None
        self.compactions = 0
        self._pid = os.getpid()
        self._token = int.from_bytes(secrets.token_bytes(8), "little") or 1
        self._io = IOPool(self.options.io_threads, "hicache-mmap")
        self._gate = threading.Condition()
        self._inflight = 0
        self._closing = False
        directory = os.path.dirname(self.path) or "."
        if default:
            ensure_dir(directory, 0o700)
        else:
            _check_directory(directory)
        self._remove_stale_creations(directory)
        if self.options.slot_size is not None or os.path.exists(self.path):
            self._open_arena(self.options.slot_size or DEFAULT_SLOT)

    def _slot_limit(self) -> int | None:
        """The largest storable object: the slot size, once known."""
        if self._arena is not None:
            return int(self._arena.slot_size)
        if self.options.slot_size is not None:
            return _round_up(self.options.slot_size, PAGE)
        return None

    @staticmethod
    def _remove_stale_creations(directory: str) -> None:
        """Temporaries of arena creators that died (this directory only, not recursive)."""
        from hicache_storage.storekit.atomic import is_temporary, writer_is_dead

        try:
            names = os.listdir(directory)
        except OSError:
            return
        for name in names:
            if is_temporary(name) and writer_is_dead(name):
                try:
                    os.unlink(os.path.join(directory, name))
                except OSError:
                    pass

    # ------------------------------------------------------------------ lifecycle gate

    @contextmanager
    def _op(self) -> Iterator[None]:
        """Count an operation in flight, so close() never unmaps memory being copied."""
        if os.getpid() != self._pid:
            raise NotSupportedError(
                "an MmapBackend cannot be used across fork(): create a new one in the child"
            )
        if self._detached is not None:
            raise BackendError(self._detached)
        with self._gate:
            if self._closing:
                raise BackendError("the mmap backend is closing")
            self._inflight += 1
        try:
            yield
        except ConfigError as exc:
            # A bad file met after construction (the index replaced by a FIFO, another
            # user's file...): engine-facing calls report it as a store failure.
            raise BackendError(str(exc)) from exc
        finally:
            with self._gate:
                self._inflight -= 1
                if not self._inflight:
                    self._gate.notify_all()

    # ------------------------------------------------------------------ arena and index

    def _open_arena(self, slot_size: int, lazy: bool = False) -> _Arena:
        """Open (or create) the arena and load its index.

        ``lazy``: opened by an engine-facing call, whose failures must be failure shapes,
        not exceptions: a bad arena is then a :class:`BackendError` (logged by the
        protocol layer, rate limited), not a :class:`ConfigError`.
        """
        try:
            with self._open_lock:
                if self._arena is not None:
                    return self._arena
                # Creation needs no lock (a complete arena is linked into place, first
                # creator wins); loading the index takes the arena's writer lock.
                arena = _Arena(self.path, self.options.capacity, slot_size, self.options.prefault)
                try:
                    with self._writer_lock(arena):
                        self._arena = arena
                        self._reload_index()
                        self._repair_rows(arena)
                except BaseException:
                    with self._index_lock:
                        self._arena = None
                        if self._log_fd >= 0:
                            os.close(self._log_fd)
                            self._log_fd = -1
                    arena.close()
                    raise
                return arena
        except ConfigError as exc:
            if lazy:
                raise BackendError(f"cannot open the mmap arena: {exc}") from exc
            raise

    def _repair_rows(self, arena: _Arena) -> None:
        """Make the slot table agree with the log (writer lock held).

        Under the lock a live key's row is always COMMITTED with the key's generation. A
        row that is not may have been reused after the record was written (the record
        that retired it was lost or damaged), restored from an older image, or lost in a
        power failure; only the slot's bytes can tell. The row is rebuilt from the record
        when the record has a checksum, the slot's bytes match it and no live writer
        holds the slot; otherwise the key is dropped (a miss), never served from bytes
        that may be another key's.
        """
        for name, entry in list(self._index.items()):
            row = arena.slots[entry.slot]
            if int(row["generation"]) == entry.generation and int(row["state"]) == COMMITTED:
                continue
            if (
                entry.algorithm
                and self._slot_lock(arena, entry.slot, take=True)
                and checksum([arena.slot_view(entry.slot, entry.length)], entry.algorithm)
                == entry.checksum
            ):
                row["generation"] = entry.generation
                row["length"] = entry.length
                row["checksum"] = entry.checksum
                row["state"] = COMMITTED
                row["token"] = 0
                self._slot_lock(arena, entry.slot, take=False)
                self._warn(
                    "repair", "repaired the slot-table row of slot %d of %s", entry.slot, self.path
                )
                continue
            self._slot_lock(arena, entry.slot, take=False)
            self._index.pop(name, None)
            self._by_slot.pop(entry.slot, None)
            self._warn(
                "stale",
                "dropped %s: slot %d of %s no longer holds it (or cannot be verified)",
                name,
                entry.slot,
                self.path,
            )

    def _arena_for(self, nbytes: int) -> _Arena:
        """The arena, created on first write with the default (or the object's) slot size."""
        if self._arena is not None:
            return self._arena
        return self._open_arena(max(nbytes, DEFAULT_SLOT), lazy=True)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Attach the host pool; the arena's slots must hold one of its pages.

        Creates the arena with the pool's page size as the slot size when it does not
        exist yet (and ``slot_size`` is not set). Raises :class:`ConfigError` when the
        pool's pages are larger than the slots of the arena (existing or configured).
        """
        page_bytes = _pool_page_bytes(mem_pool_host)
        if page_bytes:
            if self._arena is None and os.path.exists(self.path):
                self._open_arena(DEFAULT_SLOT)
            limit = self._slot_limit()
            if limit is not None and page_bytes > limit:
                where = "the arena" if self._arena is not None else "the configured slot_size"
                raise ConfigError(
                    f"host pool pages are {page_bytes} bytes but {where} at {self.path} has "
                    f"{limit}-byte slots: set the mmap option slot_size to at least "
                    f"{page_bytes} (a new arena: delete {self.path} and {self.index_path}, "
                    "or choose another path)"
                )
        super().register_mem_pool_host(mem_pool_host)
        if self._arena is None and page_bytes and not os.path.exists(self.path):
            self._open_arena(page_bytes)

    @contextmanager
    def _writer_lock(self, arena: _Arena | None = None) -> Iterator[None]:
        """Writers of this process one at a time, then writers of all processes (a
        ``flock`` on the arena file)."""
        arena = arena or self._arena
        if arena is None:
            raise BackendError("the mmap arena is not open")
        deadline = time.monotonic() + 60.0
        with self._wlock:
            while True:
                try:
                    fcntl.flock(arena.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise BackendTimeoutError(
                            f"another process has held the writer lock of {self.path} for over 60 s"
                        ) from None
                    time.sleep(0.0005)
            try:
                with self._index_lock:
                    yield
            finally:
                fcntl.flock(arena.fd, fcntl.LOCK_UN)

    def _slot_lock(self, arena: _Arena, slot: int, take: bool) -> bool:
        """Take (or release) this instance's OFD lock on the slot's byte of the arena file.

        Taking fails (returns False) when another open file description holds it: a live
        writer, in any process and any pid namespace. The kernel releases the lock when
        its holder dies.
        """
        kind = fcntl.F_WRLCK if take else fcntl.F_UNLCK
        try:
            fcntl.fcntl(arena.fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, slot, 1, 0))
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno in (11, 13):  # EAGAIN / EACCES: held elsewhere
                return False
            raise
        return True

    def _reload_index(self) -> None:
        """Read the whole log again (first open, or after another process replaced it).

        The log is applied only if its header names this arena. A log that names another
        arena while this arena is still the one at ``path`` was left by a deleted arena (or
        is damaged): it is ignored and replaced by the next writer. If ``path`` itself no
        longer holds this arena (the cache was reset under this process), the instance
        detaches: it never applies another arena's records to its mapping.
        """
        with self._index_lock:
            if self._log_fd >= 0:
                os.close(self._log_fd)
                self._log_fd = -1
            self._index = {}
            self._by_slot = {}
            self._free_hint = []
            self._log_pos = 0
            self._log_records = 0
            self._log_foreign = False
            self._bad_tail = None
            arena = self._arena
            assert arena is not None
            try:
                try:
                    fd = open_regular(self.index_path, os.O_RDWR)
                except FileNotFoundError:
                    fd = self._create_log(arena)
            except NotRegularFileError as exc:
                raise ConfigError(f"{exc}: remove it or choose another arena path") from exc
            except OSError as exc:
                raise BackendError(f"cannot open {self.index_path}: {exc}") from exc
            try:
                st = os.fstat(fd)
                check_file(self.index_path, st)
            except BaseException:
                os.close(fd)  # _log_fd stays -1: the next call tries again
                raise
            self._log_fd = fd
            self._log_ino = st.st_ino
            head = os.pread(self._log_fd, _LOG_HEAD.size + _CRC.size, 0)
            nonce = _log_nonce(head)
            if nonce != arena.nonce:
                if not self._arena_is_current(arena):
                    self._detach(f"the arena {self.path} was removed or replaced")
                    return
                self._log_foreign = True
                logger.warning(
                    "%s does not describe the arena %s (left by a deleted arena, or damaged): "
                    "ignored, and replaced at the next write",
                    self.index_path,
                    self.path,
                )
                return
            self._log_pos = len(head)
            self._anchor = head[-_ANCHOR:]
            self._catch_up()

    def _arena_is_current(self, arena: _Arena) -> bool:
        """True if ``path`` still names the file this instance mapped."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return st.st_ino == arena.ino and st.st_dev == arena.dev

    def _detach(self, reason: str) -> None:
        """Stop serving: every later call fails (logged) instead of mixing two arenas."""
        if self._detached is None:
            logger.error("%s; this mmap backend no longer serves it (create a new backend)", reason)
        self._detached = reason
        self._index = {}
        self._by_slot = {}
        self._free_hint = []

    def _create_log(self, arena: _Arena) -> int:
        """Create the log of ``arena`` (header only) under a temporary name and link it
        into place; if another process won, open theirs. Returns an open descriptor."""
        tmp = temp_path(os.path.dirname(self.index_path))
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            writev_all(fd, [_log_header(arena.nonce)])
            if self.options.fsync:
                os.fsync(fd)
            fd = _link_or_open(tmp, fd, self.index_path)
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(tmp)
        return fd

    def _replace_log(self, records: list[tuple[int, str, _Entry]]) -> None:
        """Write a new log for this arena holding ``records`` and rename it over the old
        one (writer lock held); other processes notice the new inode and reload."""
        arena = self._arena
        assert arena is not None
        tmp = temp_path(os.path.dirname(self.index_path))
        blob = _log_header(arena.nonce) + b"".join(self._encode(k, n, e) for k, n, e in records)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                writev_all(fd, [blob])
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.index_path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        fsync_dir(os.path.dirname(self.index_path))
        self._reload_index()

    def _catch_up(self) -> None:
        """Apply records appended since the last read; reload if the log was replaced.

        A damaged record costs only itself: reading resumes at the next intact record
        (found by its magic and CRC). A bad record with no intact one after it is a torn
        or in-flight tail: it is left for a later read (a writer cuts it before
        appending).
        """
        with self._index_lock:
            if self._detached is not None:
                return
            try:
                st = os.stat(self.index_path)
            except FileNotFoundError:
                st = None
            if self._log_fd < 0 or (st is not None and st.st_ino != self._log_ino):
                # Replaced (compaction, reset), or a reload failed before: read it anew.
                # (The inode cannot be reused while this instance holds it open.)
                self._reload_index()
                return
            if self._log_foreign:
                return
            fst = os.fstat(self._log_fd)
            size = fst.st_size
            if size < self._log_pos:
                self._reload_index()  # shortened in place (truncate, a copy over it)
                return
            if size <= self._log_pos or (size, fst.st_mtime_ns) == self._bad_tail:
                return  # nothing new, or only the bad tail read before, unchanged
            # Read from just before the position: if those bytes are not the ones last
            # read, the log was rewritten in place (a copy over it, a truncate and new
            # appends) and the position means nothing any more.
            start = self._log_pos - _ANCHOR
            raw = os.pread(self._log_fd, size - start, start)
            if raw[:_ANCHOR] != self._anchor:
                self._reload_index()
                return
            data = raw[_ANCHOR:]
            arena = self._arena
            assert arena is not None
            off = 0
            while off < len(data):
                rec = _decode_record(data, off, arena)
                if rec is None:
                    nxt = _next_record(data, off + 1, arena)
                    if nxt < 0:
                        break  # a torn or in-flight tail
                    self._record(corrupt_objects=1)
                    self._warn(
                        "log",
                        "skipped %d damaged bytes at offset %d of %s",
                        nxt - off,
                        self._log_pos + off,
                        self.index_path,
                    )
                    off = nxt
                    continue
                kind, name, entry, off = rec
                self._apply(kind, name, entry)
                self._log_records += 1
            self._log_pos += off
            self._anchor = raw[off : off + _ANCHOR]
            self._bad_tail = (size, fst.st_mtime_ns) if off < len(data) else None

    def _warn(self, key: str, msg: str, *args: object) -> None:
        """A rate-limited warning (hot paths: reads, catch-up, writes)."""
        self._hicache_state().log("mmap:" + key, msg, *args)

    def _apply(self, kind: int, name: str, entry: _Entry) -> None:
        old = self._index.get(name)
        if kind == DEL and (
            old is None or (old.slot, old.generation) != (entry.slot, entry.generation)
        ):
            return  # deletes another incarnation of the key: not this one
        if old is not None:
            del self._index[name]
            self._by_slot.pop(old.slot, None)
        if kind == PUT:
            stale = self._by_slot.pop(entry.slot, None)
            if stale is not None:
                self._index.pop(stale, None)
            self._index[name] = entry
            self._by_slot[entry.slot] = name

    @staticmethod
    def _encode(kind: int, name: str, e: _Entry) -> bytes:
        raw = name.encode("utf-8")
        rec = _REC.pack(
            _REC_MAGIC, kind, e.algorithm, len(raw), e.slot, e.generation, e.length, e.checksum
        )
        return rec + raw + _CRC.pack(zlib.crc32(rec + raw))

    def _append(self, records: list[tuple[int, str, _Entry]]) -> None:
        """Append records to the log (writer lock held); they are the commit point."""
        if self._detached is not None:
            raise BackendError(self._detached)
        if self._log_foreign:
            self._replace_log([])  # a log that is not this arena's: start a new one
            if self._detached is not None:
                raise BackendError(self._detached)
        start = self._log_pos - _ANCHOR
        if os.pread(self._log_fd, _ANCHOR, start) != self._anchor:
            self._reload_index()  # rewritten in place: never cut what another process wrote
            if self._detached is not None:
                raise BackendError(self._detached)
            if self._log_foreign:
                self._replace_log([])
        if os.fstat(self._log_fd).st_size != self._log_pos:
            # A torn tail from a crashed writer: cut it, or new records would hide behind it.
            os.ftruncate(self._log_fd, self._log_pos)
        blob = b"".join(self._encode(kind, name, e) for kind, name, e in records)
        written = os.pwrite(self._log_fd, blob, self._log_pos)
        if written != len(blob):
            raise BackendError(f"short write to {self.index_path}")
        if self.options.fsync:
            os.fsync(self._log_fd)
        for kind, name, e in records:
            self._apply(kind, name, e)
        self._log_pos += len(blob)
        self._anchor = (self._anchor + blob)[-_ANCHOR:]
        self._log_records += len(records)
        if self._log_records > 4 * max(len(self._index), 256):
            self._compact()

    def _compact(self) -> None:
        """Rewrite the log with the live records only: temporary, fsync, rename."""
        self._replace_log([(PUT, name, e) for name, e in self._index.items()])
        self.compactions += 1

    # ------------------------------------------------------------------ slots

    def _find(self, name: str) -> _Entry | None:
        """The live entry of ``name``, checked against the shared slot table."""
        arena = self._arena
        if arena is None:
            if not os.path.exists(self.path):
                return None
            arena = self._open_arena(DEFAULT_SLOT, lazy=True)
        entry = self._index.get(name)
        if entry is None or int(arena.slots[entry.slot]["generation"]) != entry.generation:
            self._catch_up()
            entry = self._index.get(name)
        if entry is None:
            return None
        row = arena.slots[entry.slot]
        if int(row["generation"]) != entry.generation or int(row["state"]) != COMMITTED:
            return None
        return entry

    def _refill_hint(self, arena: _Arena) -> None:
        """Find reusable slots (writer lock held, index caught up)."""
        import numpy as np

        slots = arena.slots
        state = slots["state"]
        resting = self._resting(arena)
        usable = (state == FREE) | ((state == RETIRED) & ~resting)
        hint = [int(i) for i in np.flatnonzero(usable)]
        if not hint:
            live = np.zeros(arena.nslots, dtype=bool)
            if self._by_slot:
                live[np.fromiter(self._by_slot, dtype=np.int64)] = True
            # Orphans: committed in the table but never logged (a crash between the two),
            # or reserved by a writer that died (its slot lock is gone).
            mine = slots["token"] == self._token
            orphans = ((state == COMMITTED) | ((state == WRITING) & ~mine)) & ~live
            hint = [int(i) for i in np.flatnonzero(orphans)]
        hint.reverse()  # pop() from the end takes the lowest slot first
        self._free_hint = hint

    def _resting(self, arena: _Arena) -> Any:
        """Mask of retired slots still resting. A rest that would end in the future by
        more than ``reuse_delay`` (the clock stepped back) is over: it must not keep a
        slot out of use for as long as the clock is behind."""
        now = time.time()
        since = arena.slots["since"]
        return (
            (arena.slots["state"] == RETIRED)
            & (since > now - self.options.reuse_delay)
            & (since <= now)
        )

    def _held_elsewhere(self, arena: _Arena, slot: int) -> bool:
        """True if another open file description (a live writer) holds the slot's lock."""
        got = fcntl.fcntl(
            arena.fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, slot, 1, 0)
        )
        return int(_FLOCK.unpack(got)[0]) != fcntl.F_UNLCK

    def _busy(self, arena: _Arena) -> int:
        """Slots being written by live writers (this instance's, or locked elsewhere); a
        dead writer's slot is not busy: it is reclaimed as an orphan."""
        import numpy as np

        slots = arena.slots
        busy = 0
        for s in np.flatnonzero(slots["state"] == WRITING):
            if int(slots[s]["token"]) == self._token or self._held_elsewhere(arena, int(s)):
                busy += 1
        return busy

    def _reserve_slot(
        self, arena: _Arena, keep: frozenset[int] = frozenset()
    ) -> tuple[int, int] | None:
        """A free slot for a new object (writer lock held): (slot, new generation), or
        None when none is usable now (the caller decides what to evict)."""
        slots = arena.slots
        refilled = False
        while True:
            if not self._free_hint:
                if not refilled:
                    self._refill_hint(arena)
                    refilled = True
                if not self._free_hint:
                    return None
            slot = self._free_hint.pop()
            row = slots[slot]
            state = int(row["state"])
            if slot in self._by_slot:
                continue
            since, now = float(row["since"]), time.time()
            if state == RETIRED and now - self.options.reuse_delay < since <= now:
                continue
            if state == WRITING and int(row["token"]) == self._token:
                continue  # ours, in flight
            if not self._slot_lock(arena, slot, take=True):
                continue  # a live writer elsewhere holds it
            break
        gen = _new_generation(int(row["generation"]))
        row["generation"] = gen
        row["state"] = WRITING
        row["pid"] = self._pid
        row["token"] = self._token
        row["since"] = time.time()
        if len(self._free_hint) + 1 < self.options.low_free_slots * arena.nslots:
            # Evict ahead, so the slots have rested by the time they are needed.
            usable = int(((slots["state"] == FREE) | (slots["state"] == RETIRED)).sum())
            if usable < self.options.low_free_slots * arena.nslots:
                self._evict_some(arena, max(1, arena.nslots // 20), keep)
        return slot, gen

    def _evict_some(self, arena: _Arena, count: int, keep: frozenset[int] = frozenset()) -> None:
        """Evict the ``count`` least recently used live objects, sparing slots in ``keep``."""
        import numpy as np

        candidates = [s for s in self._by_slot if s not in keep] if keep else list(self._by_slot)
        if not candidates or count <= 0:
            return
        live = np.fromiter(candidates, dtype=np.int64)
        count = min(len(live), count)
        access = arena.slots["last_access"][live]
        victims = [int(s) for s in live[np.argsort(access, kind="stable")[:count]]]
        records = [(DEL, self._by_slot[s], self._index[self._by_slot[s]]) for s in victims]
        self._append(records)  # logged first: a crash here leaves them deleted, never half
        self._retire(arena, victims)
        self._record(evictions=len(victims))

    @staticmethod
    def _retire(arena: _Arena, slots: list[int]) -> None:
        now = time.time()
        for slot in slots:
            row = arena.slots[slot]
            row["generation"] = _new_generation(int(row["generation"]))
            row["state"] = RETIRED
            row["since"] = now

    def _still_mine(self, arena: _Arena, slot: int, gen: int) -> bool:
        row = arena.slots[slot]
        return (
            int(row["generation"]) == gen
            and int(row["state"]) == WRITING
            and int(row["token"]) == self._token
        )

    def _release(self, arena: _Arena, reserved: dict[int, tuple[int, int]]) -> None:
        """Give back reserved slots that were not committed (only those still ours)."""
        for slot, gen in reserved.values():
            if self._still_mine(arena, slot, gen):
                arena.slots[slot]["state"] = FREE
            self._slot_lock(arena, slot, take=False)

    # ------------------------------------------------------------------ protocol

    def _reserve_all(
        self, arena: _Arena, names: list[str], pending: list[int], results: list[bool]
    ) -> dict[int, tuple[int, int]]:
        """Reserve a slot per pending item (distinct names); items already stored count
        as done.

        A batch never asks for more slots than the arena can give it (all slots but those
        live writers are filling, and those of keys it found stored): the items beyond
        that fail at once (the leading ones are stored, as the engine reads leading
        runs), and only as many pages are evicted as the batch will use.
        """
        slots: dict[int, tuple[int, int]] = {}
        deadline = time.monotonic() + max(5.0, 20 * self.options.reuse_delay)
        first = True
        keep: set[int] = set()
        try:
            while pending:
                with self._writer_lock():
                    self._catch_up()
                    waiting = []
                    for i in pending:
                        entry = self._find(names[i])
                        if entry is not None:
                            results[i] = True  # stored already
                            arena.slots[entry.slot]["last_access"] = time.time()
                            keep.add(entry.slot)
                            continue
                        waiting.append(i)
                    if first:
                        first = False
                        busy = self._busy(arena)
                        room = max(0, arena.nslots - busy - len(keep))
                        if len(waiting) > room:
                            refused = len(waiting) - room
                            waiting = waiting[:room]
                            self._add_item_errors(refused)
                            self._log_failure(
                                "batch_set",
                                CapacityError(
                                    f"{refused} of {len(names)} objects refused: the arena has "
                                    f"{arena.nslots} slots and {busy} are being written"
                                ),
                            )
                    pending = []
                    for i in waiting:
                        reserved = self._reserve_slot(arena, frozenset(keep))
                        if reserved is None:
                            pending.append(i)
                        else:
                            slots[i] = reserved
                    if pending:
                        # Evict what this batch will use, beyond the slots resting already.
                        resting = int(self._resting(arena).sum())
                        mine = {s for s, _ in slots.values()}
                        self._evict_some(arena, len(pending) - resting, frozenset(keep | mine))
                if pending:
                    if time.monotonic() > deadline:
                        raise CapacityError("no slot became free in time (all busy or resting)")
                    time.sleep(max(0.001, self.options.reuse_delay / 5))
        except BaseException:
            self._release(arena, slots)  # our own slots: no writer lock needed
            raise
        return slots

    def _write_many(self, items: Sequence[tuple[str, Any, list[memoryview]]]) -> list[bool]:
        """Store ``(key, value, views)`` items: reserve slots for all under one lock, copy
        them in parallel without the lock, then publish all with one log append.

        A failure that hits the whole call (arena, log, no slot in time) raises.
        """
        if not items:
            return []
        sizes = [total_nbytes(v) for _, _, v in items]
        arena = self._arena_for(max(sizes))
        names = [self.object_name(key).path for key, _, _ in items]
        results = [False] * len(items)
        first_of: dict[str, int] = {}
        for i, name in enumerate(names):
            first_of.setdefault(name, i)  # a key twice in a batch is stored once
        pending = [
            i for i, n in enumerate(sizes) if n <= arena.slot_size and first_of[names[i]] == i
        ]
        oversized = sum(n > arena.slot_size for n in sizes)
        if oversized:
            if len(items) == 1:
                raise CapacityError(
                    f"{sizes[0]}-byte object exceeds the slot size {arena.slot_size}"
                )
            self._log_failure("set", CapacityError(f"{oversized} objects exceed the slot size"))
            self._add_item_errors(oversized)
        slots = self._reserve_all(arena, names, pending, results)
        order = list(slots)

        def copy(k: int) -> int:
            i = order[k]
            _, value, views = items[i]
            _copy_in(arena, slots[i][0], views, _pointers(value, views))
            if self.options.fsync:
                arena.flush(slots[i][0], sizes[i])
            return checksum(views, self._algorithm) if self._algorithm else 0

        try:
            sums = self._io.map(copy, len(order))
            _fence()
            with self._writer_lock():
                self._catch_up()
                now = time.time()
                records = []
                for i, csum in zip(order, sums, strict=True):
                    slot, gen = slots[i]
                    if not self._still_mine(arena, slot, gen):
                        self._warn(
                            "taken",
                            "slot %d of %s was taken during a write; dropped",
                            slot,
                            self.path,
                        )
                        continue
                    row = arena.slots[slot]
                    if names[i] in self._index:
                        row["state"] = FREE  # another process stored the key meanwhile: it won
                        results[i] = True
                        continue
                    row["length"] = sizes[i]
                    row["checksum"] = csum
                    row["last_access"] = now
                    row["state"] = COMMITTED
                    if self.options.fsync:
                        arena.flush_row(slot)
                    records.append(
                        (PUT, names[i], _Entry(slot, gen, sizes[i], csum, self._algorithm))
                    )
                    results[i] = True
                if records:
                    self._append(records)
                for slot, _ in slots.values():
                    self._slot_lock(arena, slot, take=False)
        except BaseException:
            self._release(arena, slots)  # our own slots: no writer lock needed
            raise
        self._record(bytes_written=sum(sizes[i] for i in order if results[i]))
        for i, name in enumerate(names):
            j = first_of[name]
            if j != i:
                results[i] = results[j]
        return results

    def _read(self, key: str, views: list[memoryview] | None, target: Any) -> Any:
        entry = self._find(self.object_name(key).path)
        if entry is None:
            return None
        arena = self._arena
        if arena is None:
            return None
        out: Any = target
        if views is None:
            import torch

            out = target = torch.empty(entry.length, dtype=torch.uint8)
            views = target_views(out) if entry.length else []
        elif total_nbytes(views) != entry.length:
            self._record(size_mismatches=1)
            return None
        _copy_out(arena, entry.slot, views, _pointers(target, views) if views else None)
        _fence()
        # Seqlock check: the slot must still hold this generation after the copy.
        row = arena.slots[entry.slot]
        if int(row["generation"]) != entry.generation or int(row["state"]) != COMMITTED:
            return None
        if (
            self.options.verify_checksum
            and entry.algorithm
            and checksum(views, entry.algorithm) != entry.checksum
        ):
            self._record(corrupt_objects=1)
            self._warn(
                "corrupt",
                "checksum mismatch in slot %d of %s; the read is a miss",
                entry.slot,
                self.path,
            )
            return None
        row["last_access"] = time.time()
        self._record(bytes_read=entry.length)
        return out

    def get(self, key: str, target: Any = None) -> Any:
        # docstring inherited
        with self._op():
            return self._read(key, None if target is None else target_views(target), target)

    def set(self, key: str, value: Any) -> bool:
        # docstring inherited
        with self._op():
            return self._write_many([(key, value, source_views(value))])[0]

    def exists(self, key: str) -> bool:
        # docstring inherited
        with self._op():
            return self._find(self.object_name(key).path) is not None

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        # docstring inherited
        with self._op():
            for i, key in enumerate(keys):
                if self._find(self.object_name(key).path) is None:
                    return i
            return len(keys)

    def batch_get_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        # docstring inherited
        if len(pages) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(pages)} pages")
        with self._op():
            return self._map_pages(
                "batch_get_pages",
                len(keys),
                lambda i: self._read(keys[i], pages[i].views, pages[i]),
                self._io.map,
            )

    def batch_set_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        # docstring inherited
        if len(pages) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(pages)} pages")
        with self._op():
            return self._write_many([(k, p, p.views) for k, p in zip(keys, pages, strict=True)])

    def delete(self, key: str) -> bool:
        # docstring inherited
        name = self.object_name(key).path
        with self._op():
            if self._arena is None and not os.path.exists(self.path):
                return False
            arena = self._arena_for(0)
            with self._writer_lock():
                self._catch_up()
                entry = self._index.get(name)
                if entry is None:
                    return False
                self._append([(DEL, name, entry)])
                self._retire(arena, [entry.slot])
            return True

    def clear(self) -> None:
        """Delete this namespace's objects (other namespaces in the arena stay)."""
        prefix = self.namespace.digest + "/"
        with self._op():
            if self._arena is None and not os.path.exists(self.path):
                return
            arena = self._arena_for(0)
            with self._writer_lock():
                self._catch_up()
                mine = [(n, e) for n, e in self._index.items() if n.startswith(prefix)]
                if mine:
                    self._append([(DEL, n, e) for n, e in mine])
                    self._retire(arena, [e.slot for _, e in mine])

    def close(self) -> None:
        # docstring inherited
        with self._gate:
            self._closing = True
            while self._inflight:
                self._gate.wait()
        self._io.close()
        with self._index_lock:
            if self._arena is not None:
                self._arena.close()
                self._arena = None
            if self._log_fd >= 0:
                os.close(self._log_fd)
            self._log_fd = -1

    # ------------------------------------------------------------------ introspection

    def usage(self) -> dict[str, int]:
        """Slots of the arena and how many hold live objects (all namespaces)."""
        arena = self._arena
        if arena is None:
            return {"slots": 0, "slot_size": 0, "live": 0}
        self._catch_up()
        return {"slots": arena.nslots, "slot_size": arena.slot_size, "live": len(self._index)}

    def __repr__(self) -> str:
        return f"MmapBackend(path={self.path!r}, namespace={self.namespace.digest}, shard={self.config.shard})"
