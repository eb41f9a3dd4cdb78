"""The index log of the ``mmap`` backend (``<arena>.index``) and the index it builds.

The layout of the log, its header and its records are in
:mod:`~hicache_storage.backends._mmap.log_format`. A record is applied only if it is intact: magic, CRC, and fields that fit the arena. A
damaged record costs only itself (reading resumes at the next intact record; a damaged
BULK record loses its entries); a bad record with no intact one after it is a torn or
in-flight tail, left for a later read and cut by the next writer. The log is compacted
(the live entries written as BULK records to a temporary, renamed over it) when it holds
over four times the live entries (and over 1024), when the records appended since the
last compaction reach a quarter of the live entries (and 65,536), and by ``close()``
when over 4,096 (and a sixteenth of the live entries) were appended; the writer carries
on from the new log's end, and other processes notice its new inode and read it from the
start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import zlib
from typing import TYPE_CHECKING, Any, NamedTuple

from hicache_storage.backends._mmap.arena import CRC, Arena, link_or_open
from hicache_storage.backends._mmap.log_format import (
    BULK,
    CLEAR,
    DEL,
    LOG_HEAD,
    PUT,
    REC,
    REC_MAGIC,
    SLOT_MASK,
    Columns,
    Entry,
    Record,
    RecordKind,
    decode_record,
    encode_columns,
    log_header,
    log_nonce,
    next_record,
    pack,
)
from hicache_storage.errors import BackendError, ConfigError
from hicache_storage.storekit.atomic import fsync_dir, temp_path, writev_all
from hicache_storage.storekit.pathsafety import NotRegularFileError, check_file, open_regular

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

logger = logging.getLogger(__name__)

_ANCHOR = 8  # bytes before the read position re-checked on every read of the log
_LOOSE_MIN = 1 << 16  # records not in BULK form that never cause a compaction by themselves


class _View(NamedTuple):
    """The index and the per-slot columns it goes with, read together by lock-free readers.

    A reload builds a new view; a reader that took a name's (slot, generation) from one
    view reads that slot's columns from the same one. Within a view the columns only
    move forward in time (a later incarnation of the slot), which the slot table then
    no longer holds: the reader's check fails, it never pairs a name with another
    incarnation's length or checksum.
    """

    names: dict[str, int]  # the index: name -> packed (slot, generation)
    generations: Any
    lengths: Any
    checksums: Any
    algorithms: Any


class IndexLog:
    """The index log of one arena, and the in-memory index this process reads from it.

    ``index`` maps object names to their packed ``(slot, generation)`` (:func:`pack`:
    one int, which unlike a tuple the garbage collector never scans), ``by_slot`` slots
    to names, and
    the columns ``generations``, ``lengths``, ``checksums`` and ``algorithms`` (numpy
    arrays, one row per slot) hold the rest of each live entry; :meth:`entry` puts one
    together. A reload replaces them all, so read them through this object. A name's
    packed pair is one immutable value: a reader that finds it checks it
    against the shared slot table, and the columns of that slot describe that generation
    or a later one (which the slot table then no longer has).

    ``lock`` guards them and the read position: readers take it to catch up, writers hold
    it (inside the arena's ``flock``) to append. ``detached`` is set, for good, when the
    arena at the path is no longer the one this log was opened for.

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
        self.arena: Arena | None = None
        self.index: dict[str, int] = {}
        self.by_slot: dict[int, str] = {}
        self.generations: Any = None
        self.lengths: Any = None
        self.checksums: Any = None
        self.algorithms: Any = None
        self._view = _View({}, None, None, None, None)
        self.detached: str | None = None
        self.dropped: list[int] = []  # the slots of the last CLEAR applied
        #: Names starting with this (a namespace's) are counted apart: their objects and
        #: payload bytes, kept up to date with the index (``None``: not counted).
        self.quota_prefix: str | None = None
        self.prefix_count = 0
        self.prefix_bytes = 0
        self.compactions = 0
        self._fd = -1
        self._ino = 0
        self._pos = 0
        self._records = 0  # entries read or appended since the log was last (re)written
        self._loose = 0  # of those, the ones not in BULK records
        # The log at path does not describe this arena (left by a deleted arena, or
        # damaged): nothing of it is applied, and the next writer replaces it.
        self._foreign = False
        # (size, mtime) of the log when its tail was last found torn or damaged: not
        # re-read on every miss until the log changes.
        self._bad_tail: tuple[int, int] | None = None
        # The last bytes read before _pos (see catch_up).
        self._anchor = b""

    def open(self, arena: Arena) -> None:
        """Load the log of ``arena`` (its writer lock held), creating it if missing."""
        with self.lock:
            self.arena = arena
            self.reload()

    def close(self, lock: bool = True) -> None:
        """Close the log file; the index stays as it is until the next open.

        ``lock=False``: without taking :attr:`lock` (a child after ``fork()``, where a
        parent thread may have held it at the fork).
        """
        with self.lock if lock else contextlib.nullcontext():
            self.arena = None
            if self._fd >= 0:
                os.close(self._fd)
            self._fd = -1

    def entry(self, name: str) -> Entry | None:
        """The live entry of ``name`` in this process's index (not checked), or None."""
        view = self._view  # one view: the name's pair and its slot's columns agree
        found = view.names.get(name)
        if found is None:
            return None
        slot, gen = found & SLOT_MASK, found >> 32
        return Entry(
            slot,
            gen,
            int(view.lengths[slot]),
            int(view.checksums[slot]),
            int(view.algorithms[slot]),
        )

    def _empty_index(self) -> None:
        """Forget every entry (new dicts and columns: readers may hold the old ones)."""
        import numpy as np

        self.by_slot = {}
        n = self.arena.nslots if self.arena is not None else 0
        self.generations = np.zeros(n, np.uint64)
        self.lengths = np.zeros(n, np.uint64)
        self.checksums = np.zeros(n, np.uint64)
        self.algorithms = np.zeros(n, np.uint8)
        self._set_index({})
        self.prefix_count = self.prefix_bytes = 0
        self._on_reload()

    def _set_index(self, index: dict[str, int]) -> None:
        """Make ``index`` (with the current columns) the one readers see."""
        self.index = index
        self._view = _View(index, self.generations, self.lengths, self.checksums, self.algorithms)

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
            self._empty_index()
            self._pos = 0
            self._records = 0
            self._loose = 0
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
            head = os.pread(self._fd, LOG_HEAD.size + CRC.size, 0)
            if log_nonce(head) != arena.nonce:
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
        self._empty_index()

    def _create(self, arena: Arena) -> int:
        """Create the log of ``arena``, or open the one another process created first.

        The new log (header only) is written under a temporary name and linked into place.
        Returns an open descriptor.
        """
        tmp = temp_path(os.path.dirname(self.path))
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            writev_all(fd, [log_header(arena.nonce)])
            if self.fsync:
                os.fsync(fd)
            fd = link_or_open(tmp, fd, self.path)
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(tmp)
        return fd

    def _replace(self, blob: bytes) -> None:
        """Replace this arena's log by a new one holding the records ``blob`` (writer lock held).

        ``blob`` holds exactly what the in-memory index holds (its entries, or nothing
        for an empty index), so this instance keeps its index and carries on from the
        new log's end; other processes notice the new inode and reload.
        """
        arena = self.arena
        assert arena is not None
        head = log_header(arena.nonce)
        tmp = temp_path(os.path.dirname(self.path))
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            writev_all(fd, [head, blob])
            os.fsync(fd)
            os.replace(tmp, self.path)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        fsync_dir(os.path.dirname(self.path))
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = fd
        self._ino = os.fstat(fd).st_ino
        self._pos = len(head) + len(blob)
        self._anchor = (head + blob[-_ANCHOR:])[-_ANCHOR:]
        self._records = len(self.index)
        self._loose = 0
        self._foreign = False
        self._bad_tail = None

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
                rec = decode_record(data, off, arena)
                if rec is None:
                    nxt = next_record(data, off + 1, arena)
                    if nxt < 0:
                        break  # a torn or in-flight tail
                    self._on_damage(nxt - off, self._pos + off)
                    off = nxt
                    continue
                kind, name, found, off = rec
                if kind == BULK:
                    assert isinstance(found, Columns)
                    self.apply_columns(found)
                    self._records += len(found.names)
                    continue
                assert isinstance(found, Entry)
                self._apply(kind, name, found)
                self._records += 1
                self._loose += 1
            self._pos += off
            self._anchor = raw[off : off + _ANCHOR]
            self._bad_tail = (size, fst.st_mtime_ns) if off < len(data) else None

    def _apply(self, kind: int, name: str, entry: Entry) -> None:
        if kind == CLEAR:
            self.drop_prefix(name)
            return
        old = self.index.get(name)
        if kind == DEL and old != pack(entry.slot, entry.generation):
            return  # deletes another incarnation of the key (or none): not this one
        prefix = self.quota_prefix
        if old is not None:
            del self.index[name]
            self.by_slot.pop(old & SLOT_MASK, None)
            if prefix is not None and name.startswith(prefix):
                self.prefix_count -= 1
                self.prefix_bytes -= int(self.lengths[old & SLOT_MASK])
        if kind == PUT:
            slot = entry.slot
            stale = self.by_slot.pop(slot, None)
            if stale is not None:
                self.index.pop(stale, None)
                if prefix is not None and stale.startswith(prefix):
                    self.prefix_count -= 1
                    self.prefix_bytes -= int(self.lengths[slot])
            if prefix is not None and name.startswith(prefix):
                self.prefix_count += 1
                self.prefix_bytes += entry.length
            # The columns first: a reader that finds the name finds them filled.
            self.generations[slot] = entry.generation
            self.lengths[slot] = entry.length
            self.checksums[slot] = entry.checksum
            self.algorithms[slot] = entry.algorithm
            self.index[name] = pack(slot, entry.generation)
            self.by_slot[slot] = name

    def apply_columns(self, cols: Columns) -> None:
        """Apply the PUTs of a BULK record, in a few vectorized passes when it can."""
        import numpy as np

        slots = cols.slots.tolist()
        gens = cols.generations.tolist()
        n = len(slots)
        if len(np.unique(cols.slots)) == n and self.by_slot.keys().isdisjoint(slots):
            # Distinct slots that no entry holds (what compaction writes): in bulk.
            self.generations[cols.slots] = cols.generations
            self.lengths[cols.slots] = cols.lengths
            self.checksums[cols.slots] = cols.checksums
            self.algorithms[cols.slots] = cols.algorithms
            before = len(self.index)
            self.index.update(
                zip(
                    cols.names, [s | g << 32 for s, g in zip(slots, gens, strict=True)], strict=True
                )
            )
            self.by_slot.update(zip(slots, cols.names, strict=True))
            if len(self.index) != before + n:
                # A name met twice (not what compaction writes): its later PUT won in
                # the index, and the slot of the earlier one must not stay live.
                self.by_slot = {p & SLOT_MASK: name for name, p in self.index.items()}
                self.recount()
            elif self.quota_prefix is not None:  # new names only: count this chunk's
                prefix = self.quota_prefix
                mine = np.fromiter((nm.startswith(prefix) for nm in cols.names), np.bool_, n)
                self.prefix_count += int(mine.sum())
                self.prefix_bytes += int(cols.lengths[mine].astype(np.int64).sum())
            return
        for i, name in enumerate(cols.names):  # one at a time, as PUT records
            entry = Entry(
                slots[i],
                gens[i],
                int(cols.lengths[i]),
                int(cols.checksums[i]),
                int(cols.algorithms[i]),
            )
            self._apply(PUT, name, entry)

    def drop_prefix(self, prefix: str) -> list[int]:
        """Remove every entry whose name starts with ``prefix`` (a CLEAR record).

        Returns the slots they held (also kept in ``dropped``, for the writer that
        appended the CLEAR record and retires them). One pass over the index builds what
        stays; the slots that went are found by numpy.
        """
        import numpy as np

        keep = {n: p for n, p in self.index.items() if not n.startswith(prefix)}
        if len(keep) == len(self.index):
            self.dropped = []
            return self.dropped
        live = np.fromiter(self.by_slot, np.int64, len(self.by_slot))
        kept = np.fromiter((p & SLOT_MASK for p in keep.values()), np.int64, len(keep))
        dropped: list[int] = np.setdiff1d(live, kept, assume_unique=True).tolist()
        by_slot = self.by_slot
        if len(keep) * 2 > len(self.index):
            by_slot = dict(by_slot)  # readers may iterate the old one
            for slot in dropped:
                del by_slot[slot]
        else:
            by_slot = {p & SLOT_MASK: n for n, p in keep.items()}
        self._set_index(keep)
        self.by_slot = by_slot
        self.dropped = dropped
        self.recount()
        return dropped

    def recount(self) -> None:
        """Count the names of ``quota_prefix`` again (after a change of the whole index)."""
        import numpy as np

        prefix = self.quota_prefix
        if prefix is None:
            return
        slots = [p & SLOT_MASK for n, p in self.index.items() if n.startswith(prefix)]
        self.prefix_count = len(slots)
        self.prefix_bytes = int(self.lengths[np.array(slots, dtype=np.int64)].sum()) if slots else 0

    def forget(self, name: str, entry: Entry) -> None:
        """Drop a key from the in-memory index only (nothing is logged)."""
        if self.index.pop(name, None) is not None:
            prefix = self.quota_prefix
            if prefix is not None and name.startswith(prefix):
                self.prefix_count -= 1
                self.prefix_bytes -= entry.length
        self.by_slot.pop(entry.slot, None)

    @staticmethod
    def encode(kind: RecordKind, name: str, e: Entry) -> bytes:
        """One PUT, DEL or CLEAR record, CRC included."""
        raw = name.encode("utf-8")
        rec = REC.pack(
            REC_MAGIC, kind, e.algorithm, len(raw), e.slot, e.generation, e.length, e.checksum
        )
        return rec + raw + CRC.pack(zlib.crc32(rec + raw))

    def append(self, records: Iterable[Record]) -> None:
        """Append records to the log (writer lock held); they are the commit point."""
        records = list(records)
        if self.detached is not None:
            raise BackendError(self.detached)
        if self._foreign:
            self._replace(b"")  # a log that is not this arena's: start a new one
            if self.detached is not None:
                raise BackendError(self.detached)
        start = self._pos - _ANCHOR
        if os.pread(self._fd, _ANCHOR, start) != self._anchor:
            self.reload()  # rewritten in place: never cut what another process wrote
            if self.detached is not None:
                raise BackendError(self.detached)
            if self._foreign:
                self._replace(b"")
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
            self._apply(int(kind), name, e)
        self._pos += len(blob)
        self._anchor = (self._anchor + blob)[-_ANCHOR:]
        self._records += len(records)
        self._loose += len(records)
        live = len(self.index)
        # Compact when the log holds mostly dead records, or when its records not in
        # BULK form (decoded one by one at start-up) reach a quarter of the live
        # entries: a store that grows is rewritten each time it grows by a third.
        if self._records > 4 * max(live, 256) or self._loose >= max(_LOOSE_MIN, live // 4):
            self.compact()

    def worth_compacting(self) -> bool:
        """Whether enough was appended since the last compaction to rewrite the log at close."""
        return self._loose > max(4096, len(self.index) // 16)

    def compact(self) -> None:
        """Rewrite the log with the live entries only (BULK records): temporary, fsync, rename."""
        import numpy as np

        names = list(self.index)
        slots = np.fromiter((p & SLOT_MASK for p in self.index.values()), np.int64, len(names))
        self._replace(encode_columns(names, slots, self))
        self.compactions += 1
