"""The arena file of the ``mmap`` backend: a superblock, a slot table, then the slots.

The arena is one preallocated file that every process opening it maps shared. Integers
are little-endian. The superblock sits at offset 0 (the rest of its 4 KiB page is zero)::

    offset size field
    0      8    magic         b"HCSMMAP1"
    8      4    version       2
    12     4    flags         0 (reserved)
    16     8    slot_size     bytes per slot, a multiple of 4096
    24     8    nslots        number of slots (at least 1)
    32     8    table_off     offset of the slot table: 4096
    40     8    data_off      offset of slot 0: table_off + nslots * 64, rounded up to 4 KiB
    48     8    nonce         random, never 0: the arena's identity, named by its index log
    56     4    crc           CRC-32 of bytes 0..55

The slot table at ``table_off`` has one 64-byte row per slot (``_SLOT_DTYPE``, mapped as
a numpy structured array and shared by all processes)::

    offset size field
    0      8    generation    random 63-bit value, never 0; renewed when the slot is
                              reserved and when it is retired
    8      4    state         a SlotState: 0 free, 1 writing, 2 committed, 3 retired
    12     4    pid           pid of the writer that reserved it (informational only)
    16     8    length        payload bytes of the object it holds
    24     8    checksum      payload checksum (0 without one)
    32     8    last_access   time.time() of the last read or write (float64): the LRU clock
    40     8    since         time.time() the slot was reserved or retired (float64)
    48     8    token         random id of the backend instance that reserved it
    56     8    pad           0

Slot ``i`` holds its object's bytes at ``data_off + i * slot_size``. Writers lock the arena
file itself: a ``flock`` for their bookkeeping, and an open-file-description byte lock at
offset ``i`` while they copy into slot ``i`` (a lock range only: it says nothing about the
bytes there).
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
# magic, version, flags, slot_size, nslots, table_off, data_off, nonce; a CRC-32 follows
_SUPER = struct.Struct("<8sIIQQQQQ")
_MAGIC = b"HCSMMAP1"
_VERSION = 2
_CRC = struct.Struct("<I")
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


def _new_generations(old: Any) -> Any:
    """:func:`_new_generation` for a numpy array of generations (one new value each)."""
    import numpy as np

    n = len(old)
    gens = (np.frombuffer(secrets.token_bytes(8 * n), "<u8") >> np.uint64(1)) + np.uint64(1)
    clash = np.flatnonzero(gens == old)
    for i in clash.tolist():  # about never: one chance in 2**63 each
        gens[i] = _new_generation(int(old[i]))
    return gens


def _link_or_open(tmp: str, fd: int, path: str) -> int:
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


class _Arena:
    """The mapped arena file: superblock, slot table (a numpy view) and slot data."""

    def __init__(self, path: str, capacity: int, slot_size: int, prefault: bool) -> None:
        import numpy as np

        self.path = path
        self.row_size = int(np.dtype(_SLOT_DTYPE).itemsize)
        try:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
            except FileNotFoundError:
                fd = self._create(path, capacity, slot_size, prefault, self.row_size)
        except OSError as exc:
            raise ConfigError(f"cannot open the mmap arena {path}: {exc}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"{path} is not a regular file: choose another arena path")
            check_file(path, st)
            size = st.st_size
            self.ino, self.dev = st.st_ino, st.st_dev
            head = os.pread(fd, _SUPER.size + _CRC.size, 0)
            if len(head) < _SUPER.size + _CRC.size:
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
                or data_off < table_off + nslots * self.row_size
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
    def _create(path: str, capacity: int, slot_size: int, prefault: bool, row_size: int) -> int:
        """Build a complete arena under a temporary name, then link it into place.

        A creator killed half way leaves only a temporary (removed by the next opener),
        never a full-size file without a superblock. Returns an open descriptor.
        """
        slot_size = _round_up(slot_size, PAGE)
        nslots = 0
        for n in range(capacity // slot_size, 0, -1):
            if PAGE + _round_up(n * row_size, PAGE) + n * slot_size <= capacity:
                nslots = n
                break
        if nslots < 1:
            raise ConfigError(f"capacity {capacity} holds no slot of {slot_size} bytes")
        table_off = PAGE
        data_off = PAGE + _round_up(nslots * row_size, PAGE)
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

    def is_current(self) -> bool:
        """True if ``path`` still names the file this arena mapped."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return st.st_ino == self.ino and st.st_dev == self.dev

    def slot_addr(self, slot: int) -> int:
        return int(self.base + self.data_off + slot * self.slot_size)

    def slot_view(self, slot: int, length: int) -> memoryview:
        start = self.data_off + slot * self.slot_size
        return memoryview(self.map)[start : start + length]

    def _flush_range(self, start: int, length: int) -> None:
        aligned = start - start % mmap.PAGESIZE
        self.map.flush(aligned, _round_up(start + length - aligned, mmap.PAGESIZE))

    def flush(self, slot: int, length: int) -> None:
        """Flush a slot's data to the file (``msync``)."""
        self._flush_range(self.data_off + slot * self.slot_size, max(length, 1))

    def flush_row(self, slot: int) -> None:
        """Flush a slot's table row to the file (``msync``)."""
        self._flush_range(self.table_off + slot * self.row_size, self.row_size)

    def close(self) -> None:
        del self.slots
        del self._anchor
        self.map.close()
        os.close(self.fd)


# ---------------------------------------------------------------------- copies


_FENCE = threading.Lock()


def _fence() -> None:
    """A full memory barrier (a lock round trip), between a copy and its generation re-check."""
    with _FENCE:
        pass


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
