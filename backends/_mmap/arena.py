"""The arena file of the ``mmap`` backend: a superblock, a slab table, a slot table, the slabs.

The arena is one preallocated file that every process opening it maps shared. Integers
are little-endian. The superblock sits at offset 0 (the rest of its 4 KiB page is zero)::

    offset size field
    0      8    magic         b"HCSMMAP1"
    8      4    version       3 (2: one slot size for the whole arena; refused)
    12     4    flags         0 (reserved)
    16     8    unit          bytes per unit: 4096 * 2**k, the smallest slot
    24     8    slab_size     bytes per slab, a multiple of unit: the largest slot
    32     8    table_off     offset of the slot table: after the slab table, 4 KiB aligned
    40     8    data_off      offset of slab 0: after the slot table, 4 KiB aligned
    48     8    nonce         random, never 0: the arena's identity, named by its index log
    56     8    nslabs        number of slabs (at least 1)
    64     8    slab_off      offset of the slab table: 4096
    72     4    crc           CRC-32 of bytes 0..71

(``table_off``, ``data_off`` and ``nonce`` sit where version 2 had them.)

The data is a grid of units; a slab is ``slab_size / unit`` of them (at most 64). The slab
table at ``slab_off`` holds one u32 per slab: the size, in units, of the slots the slab is
cut into (its size class), or 0 for a slab never used. Slot sizes are size classes: every
unit count up to 4, then four classes per doubling (5, 6, 7, 8, 10, 12, 14, 16, 20...),
and the slab size itself; an object goes into the smallest class that holds it, so a
class wastes at most a fifth of a slot. A slab of class ``c`` holds ``units // c`` slots,
starting at its units ``0, c, 2c...``.

The slot table at ``table_off`` has one 64-byte row per unit (``_SLOT_DTYPE``, mapped as a
numpy structured array and shared by all processes); slot ``i`` is the slot that starts
at unit ``i`` and its row is row ``i``. Rows of units where no slot of the slab's class
starts are always FREE::

    offset size field
    0      8    generation    random 63-bit value, never 0; renewed when the slot is
                              reserved and when it is retired, and when its slab changes class
    8      4    state         a SlotState: 0 free, 1 writing, 2 committed, 3 retired
    12     4    pid           pid of the writer that reserved it (informational only)
    16     8    length        payload bytes of the object it holds
    24     8    checksum      payload checksum (0 without one)
    32     8    last_access   time.time() of the last read or write (float64): the LRU clock
    40     8    since         time.time() the slot was reserved or retired (float64)
    48     8    token         random id of the backend instance that reserved it
    56     8    pad           0

Slot ``i`` holds its object's bytes at ``data_off + i * unit``. Writers lock the arena
file itself: a ``flock`` for their bookkeeping (the slab table and the slot table change
under it), and an open-file-description byte lock at offset ``i`` while they copy into
slot ``i`` (a lock range only: it says nothing about the bytes there).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import stat
import struct
import threading
import zlib
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from hicache_storage.buffers import PageBuffer, is_tensor
from hicache_storage.errors import CapacityError, ConfigError
from hicache_storage.storekit.atomic import fsync_dir, temp_path
from hicache_storage.storekit.pathsafety import check_file, open_regular

if TYPE_CHECKING:
    from collections.abc import Sequence

PAGE = 4096
# magic, version, flags, unit, slab_size, table_off, data_off, nonce, nslabs, slab_off;
# a CRC-32 follows
_SUPER = struct.Struct("<8sIIQQQQQQQ")
_MAGIC = b"HCSMMAP1"
_VERSION = 3
MAX_UNITS = 64  # units per slab at most: the unit grows with the slab size beyond that
_SLAB_DTYPE = "<u4"  # one entry of the slab table: its slots' size in units, 0 if unused
CRC = struct.Struct("<I")
# One row of the slot table (64 bytes; numpy is imported on first use, not with the module).
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


class SlotState(IntEnum):
    """The ``state`` of a slot-table row."""

    FREE = 0  # never used, or given back by a writer that did not commit
    WRITING = 1  # reserved by a writer (its token), which holds the slot's byte lock
    COMMITTED = 2  # holds an object (live once its PUT record is in the log)
    RETIRED = 3  # evicted or deleted; resting until reuse_delay has passed


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def size_class(units: int) -> int:
    """The slot size, in units, of an object of ``units`` units (before the slab's cap).

    Every count up to 4, then four classes per doubling: 5, 6, 7, 8, 10, 12, 14, 16, 20...
    """
    if units <= 4:
        return max(units, 1)
    step = 1 << (units.bit_length() - 3)
    return _round_up(units, step)


def slab_geometry(slab_size: int) -> tuple[int, int]:
    """``(unit, slab_size)`` for slabs of at least ``slab_size`` bytes.

    The unit is 4 KiB, doubled until a slab has at most :data:`MAX_UNITS` of them; the
    slab size is rounded up to a whole number of units.
    """
    unit = PAGE
    while slab_size > MAX_UNITS * unit:
        unit *= 2
    return unit, _round_up(max(slab_size, 1), unit)


def geometry(capacity: int, slab_size: int, row_size: int) -> tuple[int, int, int]:
    """``(unit, slab_size, nslabs)`` of a new arena of ``capacity`` bytes.

    Raises :class:`ConfigError` if not one slab fits.
    """
    unit, slab = slab_geometry(slab_size)
    # Per slab: its bytes, its slot-table rows and its slab-table entry; the superblock and
    # the rounding of both tables take at most three pages.
    n = max(0, (capacity - 3 * PAGE) // (slab + (slab // unit) * row_size + 4))
    if n < 1:
        raise ConfigError(f"capacity {capacity} holds no slab of {slab} bytes")
    return unit, slab, n


def _layout(nslabs: int, slab: int, unit: int, row_size: int) -> tuple[int, int, int]:
    """``(slab_off, table_off, data_off)`` of an arena of ``nslabs`` slabs."""
    slab_off = PAGE
    table_off = slab_off + _round_up(nslabs * 4, PAGE)
    data_off = table_off + _round_up(nslabs * (slab // unit) * row_size, PAGE)
    return slab_off, table_off, data_off


_GEN_BATCH = 512  # random generations drawn from the OS at a time
_gen_pool: list[int] = []
_gen_lock = threading.Lock()


def _new_generation(old: int) -> int:
    """A fresh random slot generation, never 0 and never ``old``.

    Random rather than ``old + 1``: a slot-table row rolled back (zeroed, restored from
    an older image) must not hand out again a (slot, generation) pair that a reader in
    another process may still hold for another key. Drawn from the OS 512 at a time (one
    ``getrandom`` call costs about as much as copying a 4 KiB page); a child process
    after ``fork()`` never reuses the parent's unused ones (the pool is emptied there).
    """
    while True:
        with _gen_lock:
            if not _gen_pool:
                raw = secrets.token_bytes(8 * _GEN_BATCH)
                _gen_pool.extend((x >> 1) + 1 for x in struct.unpack(f"<{_GEN_BATCH}Q", raw))
            gen = _gen_pool.pop()
        if gen != old:
            return gen


def _forget_generations() -> None:
    _gen_pool.clear()


os.register_at_fork(after_in_child=_forget_generations)


def new_generations(old: Any) -> Any:
    """:func:`_new_generation` for a numpy array of generations (one new value each)."""
    import numpy as np

    n = len(old)
    gens = (np.frombuffer(secrets.token_bytes(8 * n), "<u8") >> np.uint64(1)) + np.uint64(1)
    clash = np.flatnonzero(gens == old)
    for i in clash.tolist():  # about never: one chance in 2**63 each
        gens[i] = _new_generation(int(old[i]))
    return gens


def link_or_open(tmp: str, fd: int, path: str) -> int:
    """Publish the complete temporary ``tmp`` (open as ``fd``) as ``path``; first creator wins.

    Returns the descriptor to use: ``fd``, or, when another process won the race, one of
    the file that process put there (``fd`` is then closed).
    """
    try:
        os.link(tmp, path)
    except FileExistsError:
        theirs = open_regular(path, os.O_RDWR)
        os.close(fd)
        return theirs
    return fd


class Arena:
    """The mapped arena file: superblock, slab and slot tables (numpy views) and slot data."""

    def __init__(self, path: str, capacity: int, slab_size: int, prefault: bool) -> None:
        import numpy as np

        self.path = path
        self.row_size = int(np.dtype(_SLOT_DTYPE).itemsize)
        try:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
            except FileNotFoundError:
                fd = self._create(path, capacity, slab_size, prefault, self.row_size)
        except OSError as exc:
            raise ConfigError(f"cannot open the mmap arena {path}: {exc}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"{path} is not a regular file: choose another arena path")
            check_file(path, st)
            size = st.st_size
            self.ino, self.dev = st.st_ino, st.st_dev
            head = os.pread(fd, _SUPER.size + CRC.size, 0)
            if len(head) < _SUPER.size + CRC.size:
                raise ConfigError(f"{path} is not a hicache-storage mmap arena (too short)")
            magic, version = head[:8], int.from_bytes(head[8:12], "little")
            if magic == _MAGIC and version != _VERSION:
                raise ConfigError(
                    f"{path} is an mmap arena of format version {version}, this release reads "
                    f"version {_VERSION}: delete {path} and {path}.index (a cache: nothing "
                    "else is lost) or choose another path"
                )
            _m, _v, _flags, unit, slab, table_off, data_off, nonce, nslabs, slab_off = (
                _SUPER.unpack(head[: _SUPER.size])
            )
            (crc,) = CRC.unpack(head[_SUPER.size :])
            if magic != _MAGIC or zlib.crc32(head[: _SUPER.size]) != crc:
                raise ConfigError(f"{path} is not a hicache-storage mmap arena (or is damaged)")
            units = slab // unit if unit >= PAGE and unit % PAGE == 0 else 0
            if (
                not nslabs
                or not 0 < units <= MAX_UNITS
                or slab % unit
                or (slab_off, table_off, data_off) != _layout(nslabs, slab, unit, self.row_size)
                or size < data_off + nslabs * slab
            ):
                raise ConfigError(f"{path} is truncated or has a bad geometry ({size} bytes)")
            self.unit, self.slab_size, self.nslabs = int(unit), int(slab), int(nslabs)
            self.units = int(units)  # units per slab
            self.nslots = self.nslabs * self.units  # slot-table rows: one per unit
            self.slab_off, self.table_off, self.data_off = slab_off, table_off, data_off
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
        self.slabs = np.ndarray((self.nslabs,), dtype=_SLAB_DTYPE, buffer=self.map, offset=slab_off)
        self.slots = np.ndarray(
            (self.nslots,), dtype=_SLOT_DTYPE, buffer=self.map, offset=table_off
        )
        # The class of an object of n units (1 <= n <= units).
        self.class_of = [min(size_class(n), self.units) for n in range(self.units + 1)]

    @staticmethod
    def _create(path: str, capacity: int, slab_size: int, prefault: bool, row_size: int) -> int:
        """Build a complete arena under a temporary name, then link it into place.

        A creator killed half way leaves only a temporary (removed by the next opener),
        never a full-size file without a superblock. Returns an open descriptor.
        """
        unit, slab, nslabs = geometry(capacity, slab_size, row_size)
        slab_off, table_off, data_off = _layout(nslabs, slab, unit, row_size)
        total = data_off + nslabs * slab
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
            head = _SUPER.pack(
                _MAGIC, _VERSION, 0, unit, slab, table_off, data_off, nonce, nslabs, slab_off
            )
            os.pwrite(fd, head + CRC.pack(zlib.crc32(head)), 0)
            os.fsync(fd)
            fd = link_or_open(tmp, fd, path)
            fsync_dir(os.path.dirname(path) or ".")
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(tmp)
        return fd

    def is_current(self) -> bool:
        """True if ``path`` still names the file this arena mapped."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return st.st_ino == self.ino and st.st_dev == self.dev

    def units_for(self, nbytes: int) -> int:
        """The size class (slot size in units) of an object of ``nbytes`` (at most a slab)."""
        return self.class_of[max(1, -(-nbytes // self.unit))]

    def slot_rows(self, slabs: Any, units: int) -> Any:
        """The slots (rows) of the given slabs (a numpy array) cut into class ``units``."""
        import numpy as np

        first = np.asarray(slabs, np.int64) * self.units
        if units * 2 > self.units:  # one slot a slab
            return first
        return np.add.outer(first, np.arange(0, self.units - units + 1, units)).ravel()

    def slot_addr(self, slot: int) -> int:
        return int(self.base + self.data_off + slot * self.unit)

    def slot_view(self, slot: int, length: int) -> memoryview:
        start = self.data_off + slot * self.unit
        return memoryview(self.map)[start : start + length]

    def _flush_range(self, start: int, length: int) -> None:
        aligned = start - start % mmap.PAGESIZE
        self.map.flush(aligned, _round_up(start + length - aligned, mmap.PAGESIZE))

    def flush(self, slot: int, length: int) -> None:
        """Flush a slot's data to the file (``msync``)."""
        self._flush_range(self.data_off + slot * self.unit, max(length, 1))

    def flush_row(self, slot: int, count: int = 1) -> None:
        """Flush ``count`` slot-table rows from ``slot``'s to the file (``msync``)."""
        self._flush_range(self.table_off + slot * self.row_size, count * self.row_size)

    def flush_slab(self, slab: int, count: int = 1) -> None:
        """Flush ``count`` entries of the slab table from ``slab``'s to the file (``msync``)."""
        self._flush_range(self.slab_off + slab * 4, count * 4)

    def close(self) -> None:
        del self.slots
        del self.slabs
        del self._anchor
        self.map.close()
        os.close(self.fd)


# ---------------------------------------------------------------------- copies


_FENCE = threading.Lock()


def fence() -> None:
    """A full memory barrier (a lock round trip), between a copy and its generation re-check."""
    with _FENCE:
        pass


def _copy(
    arena: Arena,
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


def copy_in(
    arena: Arena, slot: int, views: Sequence[memoryview], ptrs: Sequence[int] | None
) -> None:
    """Copy a value's views into a slot."""
    _copy(arena, slot, views, ptrs, into_slot=True)


def copy_out(
    arena: Arena, slot: int, views: Sequence[memoryview], ptrs: Sequence[int] | None
) -> None:
    """Copy a slot into a target's views."""
    _copy(arena, slot, views, ptrs, into_slot=False)


def pointers(value: Any, views: Sequence[memoryview]) -> list[int] | None:
    """Raw addresses of a value's views when known without copying (page buffers, tensors)."""
    if isinstance(value, PageBuffer):
        return [s.ptr for s in value.segments]
    if is_tensor(value) and value.is_contiguous():
        return [int(value.data_ptr())]
    return None
