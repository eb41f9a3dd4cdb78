"""The index log of the ``mmap`` backend (``<arena>.index``) and the index it builds.

Integers are little-endian. The log starts with a header naming the arena it describes,
so a log left by another arena is never applied to this one::

    offset size field
    0      8    magic         b"HCSMLOG1"
    8      4    version       1
    12     4    flags         0 (reserved)
    16     8    nonce         the nonce in the superblock of the arena it describes
    24     4    crc           CRC-32 of bytes 0..23

Records follow, appended one after the other (36 bytes, the name, a CRC)::

    offset  size  field
    0       4     magic       b"HIDX"
    4       1     kind        a RecordKind: 1 PUT, 2 DEL
    5       1     algorithm   payload checksum algorithm (0 none, 1 xxh3-64)
    6       2     name_len    bytes of the name
    8       4     slot        the slot holding the object
    12      8     generation  the slot's generation when the object was written
    20      8     length      payload bytes
    28      8     checksum    payload checksum (0 without one)
    36      n     name        the object's name, UTF-8 (n = name_len)
    36+n    4     crc         CRC-32 of bytes 0..35+n

A PUT makes the name live at (slot, generation), replacing its earlier incarnation and
whatever other name that slot held; a DEL removes the name only if it names the same
(slot, generation). A record is applied only if it is intact: magic, CRC, and fields that
fit the arena. A damaged record costs only itself (reading resumes at the next intact
record); a bad record with no intact one after it is a torn or in-flight tail, left for a
later read and cut by the next writer. The log is compacted (live PUTs written to a
temporary, renamed over it) when it holds over four times the live records, and over
1024; other processes notice the new inode and read it from the start.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

from hicache_storage.backends._mmap.arena import _CRC, _Arena, _link_or_open
from hicache_storage.errors import BackendError, ConfigError
from hicache_storage.storekit.atomic import fsync_dir, temp_path, writev_all
from hicache_storage.storekit.header import ALGORITHMS
from hicache_storage.storekit.pathsafety import NotRegularFileError, check_file, open_regular

if TYPE_CHECKING:
    from collections.abc import Callable

logger = logging.getLogger(__name__)

# magic, version, flags, arena nonce; a CRC-32 follows
_LOG_HEAD = struct.Struct("<8sIIQ")
_LOG_MAGIC = b"HCSMLOG1"
_LOG_VERSION = 1
_ANCHOR = 8  # bytes before the read position re-checked on every read of the log
# magic, kind, algorithm, name length, slot, generation, length, checksum
_REC = struct.Struct("<4sBBHIQQQ")
_REC_MAGIC = b"HIDX"


class RecordKind(IntEnum):
    """The ``kind`` of a log record."""

    PUT = 1
    DEL = 2


@dataclass
class _Entry:
    """Where a live object is: slot, slot generation, length and payload checksum."""

    slot: int
    generation: int
    length: int
    checksum: int
    algorithm: int


Record = tuple[RecordKind, str, _Entry]


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


def _decode_record(
    data: bytes, off: int, arena: _Arena
) -> tuple[RecordKind, str, _Entry, int] | None:
    """The intact record at ``off``: (kind, name, entry, end offset), or None.

    Intact means: magic, CRC, and fields that make sense for this arena (a slot it has,
    a length that fits a slot, a known record kind and checksum algorithm).
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
    if kind not in (RecordKind.PUT, RecordKind.DEL) or slot >= arena.nslots:
        return None
    if length > arena.slot_size or algo not in ALGORITHMS.values():
        return None
    try:
        name = data[off + _REC.size : end].decode("utf-8")
    except UnicodeDecodeError:
        return None
    return RecordKind(kind), name, _Entry(slot, gen, length, csum, algo), end + _CRC.size


def _next_record(data: bytes, start: int, arena: _Arena) -> int:
    """Offset of the next intact record at or after ``start``, or -1."""
    pos = data.find(_REC_MAGIC, start)
    while pos >= 0:
        if _decode_record(data, pos, arena) is not None:
            return pos
        pos = data.find(_REC_MAGIC, pos + 1)
    return -1


class IndexLog:
    """The index log of one arena, and the in-memory index this process reads from it.

    ``index`` maps object names to their live entries and ``by_slot`` slots to names; a
    reload replaces both dicts, so read them through this object. ``lock`` guards them and
    the read position: readers take it to catch up, writers hold it (inside the arena's
    ``flock``) to append. ``detached`` is set, for good, when the arena at the path is no
    longer the one this log was opened for.

    The owner is told of a reload (``on_reload``, e.g. to drop hints derived from the old
    index) and of damaged bytes skipped while reading (``on_damage(nbytes, offset)``).
    """

    def __init__(
        self,
        path: str,
        fsync: bool,
        on_reload: Callable[[], None],
        on_damage: Callable[[int, int], None],
    ) -> None:
        self.path = path
        self.fsync = fsync
        self._on_reload = on_reload
        self._on_damage = on_damage
        self.lock = threading.RLock()
        self.arena: _Arena | None = None
        self.index: dict[str, _Entry] = {}
        self.by_slot: dict[int, str] = {}
        self.detached: str | None = None
        self.compactions = 0
        self._fd = -1
        self._ino = 0
        self._pos = 0
        self._records = 0
        # The log at path does not describe this arena (left by a deleted arena, or
        # damaged): nothing of it is applied, and the next writer replaces it.
        self._foreign = False
        # (size, mtime) of the log when its tail was last found torn or damaged: not
        # re-read on every miss until the log changes.
        self._bad_tail: tuple[int, int] | None = None
        # The last bytes read before _pos (see catch_up).
        self._anchor = b""

    def open(self, arena: _Arena) -> None:
        """Load the log of ``arena`` (its writer lock held), creating it if missing."""
        with self.lock:
            self.arena = arena
            self.reload()

    def close(self) -> None:
        """Close the log file; the index stays as it is until the next open."""
        with self.lock:
            self.arena = None
            if self._fd >= 0:
                os.close(self._fd)
            self._fd = -1

    def reload(self) -> None:
        """Read the whole log again (first open, or after another process replaced it).

        The log is applied only if its header names this arena. A log that names another
        arena while this arena is still the one at its path was left by a deleted arena
        (or is damaged): it is ignored and replaced by the next writer. If the arena's
        path itself no longer holds this arena (the cache was reset under this process),
        the log detaches: it never applies another arena's records to this mapping.
        """
        with self.lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            self.index = {}
            self.by_slot = {}
            self._on_reload()
            self._pos = 0
            self._records = 0
            self._foreign = False
            self._bad_tail = None
            arena = self.arena
            assert arena is not None
            try:
                try:
                    fd = open_regular(self.path, os.O_RDWR)
                except FileNotFoundError:
                    fd = self._create(arena)
            except NotRegularFileError as exc:
                raise ConfigError(f"{exc}: remove it or choose another arena path") from exc
            except OSError as exc:
                raise BackendError(f"cannot open {self.path}: {exc}") from exc
            try:
                st = os.fstat(fd)
                check_file(self.path, st)
            except BaseException:
                os.close(fd)  # _fd stays -1: the next call tries again
                raise
            self._fd = fd
            self._ino = st.st_ino
            head = os.pread(self._fd, _LOG_HEAD.size + _CRC.size, 0)
            if _log_nonce(head) != arena.nonce:
                if not arena.is_current():
                    self._detach(f"the arena {arena.path} was removed or replaced")
                    return
                self._foreign = True
                logger.warning(
                    "%s does not describe the arena %s (left by a deleted arena, or damaged): "
                    "ignored, and replaced at the next write",
                    self.path,
                    arena.path,
                )
                return
            self._pos = len(head)
            self._anchor = head[-_ANCHOR:]
            self.catch_up()

    def _detach(self, reason: str) -> None:
        """Stop serving: every later call fails (logged) instead of mixing two arenas."""
        if self.detached is None:
            logger.error("%s; this mmap backend no longer serves it (create a new backend)", reason)
        self.detached = reason
        self.index = {}
        self.by_slot = {}
        self._on_reload()

    def _create(self, arena: _Arena) -> int:
        """Create the log of ``arena``, or open the one another process created first.

        The new log (header only) is written under a temporary name and linked into place.
        Returns an open descriptor.
        """
        tmp = temp_path(os.path.dirname(self.path))
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            writev_all(fd, [_log_header(arena.nonce)])
            if self.fsync:
                os.fsync(fd)
            fd = _link_or_open(tmp, fd, self.path)
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(tmp)
        return fd

    def _replace(self, records: list[Record]) -> None:
        """Replace this arena's log by a new one holding ``records`` (writer lock held).

        The new log is renamed over the old one; other processes notice the new inode and
        reload.
        """
        arena = self.arena
        assert arena is not None
        tmp = temp_path(os.path.dirname(self.path))
        blob = _log_header(arena.nonce) + b"".join(self.encode(k, n, e) for k, n, e in records)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                writev_all(fd, [blob])
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        fsync_dir(os.path.dirname(self.path))
        self.reload()

    def catch_up(self) -> None:
        """Apply records appended since the last read; reload if the log was replaced.

        A damaged record costs only itself: reading resumes at the next intact record
        (found by its magic and CRC). A bad record with no intact one after it is a torn
        or in-flight tail: it is left for a later read (a writer cuts it before
        appending).
        """
        with self.lock:
            if self.detached is not None:
                return
            try:
                st = os.stat(self.path)
            except FileNotFoundError:
                st = None
            if self._fd < 0 or (st is not None and st.st_ino != self._ino):
                # Replaced (compaction, reset), or a reload failed before: read it anew.
                # (The inode cannot be reused while this instance holds it open.)
                self.reload()
                return
            if self._foreign:
                return
            fst = os.fstat(self._fd)
            size = fst.st_size
            if size < self._pos:
                self.reload()  # shortened in place (truncate, a copy over it)
                return
            if size <= self._pos or (size, fst.st_mtime_ns) == self._bad_tail:
                return  # nothing new, or only the bad tail read before, unchanged
            # Read from just before the position: if those bytes are not the ones last
            # read, the log was rewritten in place (a copy over it, a truncate and new
            # appends) and the position means nothing any more.
            start = self._pos - _ANCHOR
            raw = os.pread(self._fd, size - start, start)
            if raw[:_ANCHOR] != self._anchor:
                self.reload()
                return
            data = raw[_ANCHOR:]
            arena = self.arena
            assert arena is not None
            off = 0
            while off < len(data):
                rec = _decode_record(data, off, arena)
                if rec is None:
                    nxt = _next_record(data, off + 1, arena)
                    if nxt < 0:
                        break  # a torn or in-flight tail
                    self._on_damage(nxt - off, self._pos + off)
                    off = nxt
                    continue
                kind, name, entry, off = rec
                self.apply(kind, name, entry)
                self._records += 1
            self._pos += off
            self._anchor = raw[off : off + _ANCHOR]
            self._bad_tail = (size, fst.st_mtime_ns) if off < len(data) else None

    def apply(self, kind: RecordKind, name: str, entry: _Entry) -> None:
        """Apply one record to the in-memory index."""
        old = self.index.get(name)
        if kind == RecordKind.DEL and (
            old is None or (old.slot, old.generation) != (entry.slot, entry.generation)
        ):
            return  # deletes another incarnation of the key: not this one
        if old is not None:
            del self.index[name]
            self.by_slot.pop(old.slot, None)
        if kind == RecordKind.PUT:
            stale = self.by_slot.pop(entry.slot, None)
            if stale is not None:
                self.index.pop(stale, None)
            self.index[name] = entry
            self.by_slot[entry.slot] = name

    def forget(self, name: str, entry: _Entry) -> None:
        """Drop a key from the in-memory index only (nothing is logged)."""
        self.index.pop(name, None)
        self.by_slot.pop(entry.slot, None)

    @staticmethod
    def encode(kind: RecordKind, name: str, e: _Entry) -> bytes:
        """One record, CRC included."""
        raw = name.encode("utf-8")
        rec = _REC.pack(
            _REC_MAGIC, kind, e.algorithm, len(raw), e.slot, e.generation, e.length, e.checksum
        )
        return rec + raw + _CRC.pack(zlib.crc32(rec + raw))

    def append(self, records: list[Record]) -> None:
        """Append records to the log (writer lock held); they are the commit point."""
        if self.detached is not None:
            raise BackendError(self.detached)
        if self._foreign:
            self._replace([])  # a log that is not this arena's: start a new one
            if self.detached is not None:
                raise BackendError(self.detached)
        start = self._pos - _ANCHOR
        if os.pread(self._fd, _ANCHOR, start) != self._anchor:
            self.reload()  # rewritten in place: never cut what another process wrote
            if self.detached is not None:
                raise BackendError(self.detached)
            if self._foreign:
                self._replace([])
        if os.fstat(self._fd).st_size != self._pos:
            # A torn tail from a crashed writer: cut it, or new records would hide behind it.
            os.ftruncate(self._fd, self._pos)
        blob = b"".join(self.encode(kind, name, e) for kind, name, e in records)
        written = os.pwrite(self._fd, blob, self._pos)
        if written != len(blob):
            raise BackendError(f"short write to {self.path}")
        if self.fsync:
            os.fsync(self._fd)
        for kind, name, e in records:
            self.apply(kind, name, e)
        self._pos += len(blob)
        self._anchor = (self._anchor + blob)[-_ANCHOR:]
        self._records += len(records)
        if self._records > 4 * max(len(self.index), 256):
            self.compact()

    def compact(self) -> None:
        """Rewrite the log with the live records only: temporary, fsync, rename."""
        self._replace([(RecordKind.PUT, name, e) for name, e in self.index.items()])
        self.compactions += 1
