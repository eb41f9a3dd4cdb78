"""The layout of the ``mmap`` index log (``<arena>.index``): header, records, and their codecs.

Integers are little-endian. The log starts with a header naming the arena it describes,
so a log left by another arena is never applied to this one::

    offset size field
    0      8    magic         b"HCSMLOG1"
    8      4    version       2 (1: written before BULK and CLEAR records; still read)
    12     4    flags         0 (reserved)
    16     8    nonce         the nonce in the superblock of the arena it describes
    24     4    crc           CRC-32 of bytes 0..23

Records follow, appended one after the other (36 bytes, a body, a CRC)::

    offset  size  field
    0       4     magic       b"HIDX"
    4       1     kind        a RecordKind: 1 PUT, 2 DEL, 3 BULK, 4 CLEAR
    5       1     algorithm   payload checksum algorithm (0 none, 1 xxh3-64)
    6       2     name_len    bytes of the name
    8       4     slot        the slot holding the object (the unit it starts at)
    12      8     generation  the slot's generation when the object was written
    20      8     length      payload bytes
    28      8     checksum    payload checksum (0 without one)
    36      n     name        the object's name, UTF-8 (n = name_len)
    36+n    4     crc         CRC-32 of bytes 0..35+n

A PUT makes the name live at (slot, generation), replacing its earlier incarnation and
whatever other name that slot held; the slot's size class is not written, it follows from
the length (the arena's slab table says which class each slab is cut into). A DEL
removes the name only if it names the same (slot, generation). A CLEAR (``name`` a
namespace prefix, the other fields 0) removes every name with that prefix put before it.
A BULK record is many PUTs in columns, written by compaction so that a large index loads
in a few vectorized passes: its ``slot`` field holds the number of entries *c*,
``length`` the bytes of the body that follows (instead of a name; ``name_len``,
``generation``, ``checksum`` and ``algorithm`` are 0), and the CRC covers the 36 bytes
and the body. The body holds, column after column: ``slot`` (c x u32), ``generation``,
``length``, ``checksum`` (c x u64 each), ``algorithm`` (c x u8), then the c names,
UTF-8, joined by newlines (which object names never hold).

A record is applied only if it is intact: magic, CRC, and fields that fit the arena
(:func:`decode_record`). How the log is read, appended and compacted is
:class:`~hicache_storage.backends._mmap.index_log.IndexLog`.
"""

from __future__ import annotations

import struct
import zlib
from enum import IntEnum
from typing import Any, NamedTuple

from hicache_storage.backends._mmap.arena import CRC, Arena
from hicache_storage.storekit.header import ALGORITHMS

__all__ = [
    "ALGORITHM_IDS",
    "BULK",
    "BULK_CHUNK",
    "BULK_ROW",
    "CLEAR",
    "DEL",
    "LOG_HEAD",
    "LOG_MAGIC",
    "LOG_VERSION",
    "NO_ENTRY",
    "PUT",
    "READABLE",
    "REC",
    "REC_MAGIC",
    "SLOT_MASK",
    "Columns",
    "Entry",
    "Record",
    "RecordKind",
    "decode_columns",
    "decode_record",
    "encode_columns",
    "log_header",
    "log_nonce",
    "next_record",
    "pack",
    "unpack",
]

# magic, version, flags, arena nonce; a CRC-32 follows
LOG_HEAD = struct.Struct("<8sIIQ")
LOG_MAGIC = b"HCSMLOG1"
LOG_VERSION = 2
READABLE = (1, 2)  # version 1 logs hold PUT and DEL records only: a subset of version 2
# magic, kind, algorithm, name length, slot, generation, length, checksum
REC = struct.Struct("<4sBBHIQQQ")
REC_MAGIC = b"HIDX"
# Bytes per entry of a BULK body's columns: slot, generation, length, checksum, algorithm.
BULK_ROW = 4 + 8 + 8 + 8 + 1
BULK_CHUNK = 1 << 16  # entries per BULK record: a damaged one loses at most these
ALGORITHM_IDS = sorted(set(ALGORITHMS.values()))


class RecordKind(IntEnum):
    """The ``kind`` of a log record."""

    PUT = 1
    DEL = 2
    BULK = 3
    CLEAR = 4


# The kinds as plain ints, for the decoding loop (an enum lookup per record costs more
# than decoding it).
PUT, DEL, BULK, CLEAR = (int(k) for k in RecordKind)


class Entry(NamedTuple):
    """Where a live object is: slot, slot generation, length and payload checksum."""

    slot: int
    generation: int
    length: int
    checksum: int
    algorithm: int


NO_ENTRY = Entry(0, 0, 0, 0, 0)  # the fields of a CLEAR record
SLOT_MASK = 0xFFFFFFFF


def pack(slot: int, generation: int) -> int:
    """``(slot, generation)`` as one int: the value of a name in :attr:`IndexLog.index`."""
    return slot | generation << 32


def unpack(packed: int) -> tuple[int, int]:
    """The ``(slot, generation)`` of a packed index value."""
    return packed & SLOT_MASK, packed >> 32


Record = tuple[RecordKind, str, Entry]


class Columns(NamedTuple):
    """The entries of a BULK record: their names, and numpy columns of their fields."""

    names: list[str]
    slots: Any
    generations: Any
    lengths: Any
    checksums: Any
    algorithms: Any


def log_header(nonce: int) -> bytes:
    head = LOG_HEAD.pack(LOG_MAGIC, LOG_VERSION, 0, nonce)
    return head + CRC.pack(zlib.crc32(head))


def log_nonce(head: bytes) -> int | None:
    """The arena nonce of a log header, or None if it is not a valid header."""
    if len(head) < LOG_HEAD.size + CRC.size:
        return None
    magic, version, _flags, nonce = LOG_HEAD.unpack_from(head)
    (crc,) = CRC.unpack_from(head, LOG_HEAD.size)
    if magic != LOG_MAGIC or version not in READABLE or zlib.crc32(head[: LOG_HEAD.size]) != crc:
        return None
    return int(nonce)


def decode_record(
    data: bytes, off: int, arena: Arena
) -> tuple[int, str, Entry | Columns, int] | None:
    """The intact record at ``off``: (kind, name, entry or columns, end offset), or None.

    Intact means: magic, CRC, and fields that make sense for this arena (a slot it has,
    a length that fits in the slot's slab, a known record kind and checksum algorithm).
    """
    if off + REC.size + CRC.size > len(data):
        return None
    magic, kind, algo, name_len, slot, gen, length, csum = REC.unpack_from(data, off)
    if magic != REC_MAGIC:
        return None
    start = off + REC.size
    end = start + (length if kind == BULK else name_len)
    if end + CRC.size > len(data):
        return None
    (crc,) = CRC.unpack_from(data, end)
    if zlib.crc32(memoryview(data)[off:end]) != crc:
        return None
    if kind == BULK:
        if name_len or gen or csum or algo:
            return None
        cols = decode_columns(data, start, end, slot, arena)
        return None if cols is None else (kind, "", cols, end + CRC.size)
    try:
        name = data[start:end].decode("utf-8")
    except UnicodeDecodeError:
        return None
    if kind == CLEAR:
        if not name or slot or gen or length or csum or algo:
            return None
        return kind, name, NO_ENTRY, end + CRC.size
    if kind not in (PUT, DEL) or slot >= arena.nslots or algo not in ALGORITHM_IDS:
        return None
    if slot % arena.units * arena.unit + length > arena.slab_size:  # past its slab
        return None
    return kind, name, Entry(slot, gen, length, csum, algo), end + CRC.size


def decode_columns(data: bytes, start: int, end: int, count: int, arena: Arena) -> Columns | None:
    """The body of a BULK record of ``count`` entries at ``data[start:end]``, or None.

    None if the body does not make sense for this arena (the CRC was right: written by
    something else, or for another geometry).
    """
    import numpy as np

    if not 0 < count <= arena.nslots or end - start < count * BULK_ROW:
        return None
    off = start
    columns = []
    for dtype, width in (("<u4", 4), ("<u8", 8), ("<u8", 8), ("<u8", 8), ("u1", 1)):
        columns.append(np.frombuffer(data, dtype, count, off))
        off += count * width
    slots, gens, lengths, csums, algos = columns
    if int(slots.max()) >= arena.nslots:
        return None
    if int(((slots % arena.units) * arena.unit + lengths).max()) > arena.slab_size:
        return None
    if not np.isin(algos, ALGORITHM_IDS).all():
        return None
    try:
        names = data[off:end].decode("utf-8").split("\n")
    except UnicodeDecodeError:
        return None
    if len(names) != count:
        return None
    return Columns(names, slots, gens, lengths, csums, algos)


def encode_columns(names: list[str], slots: Any, log: Any) -> bytes:
    """BULK records holding the entries of ``names`` at ``slots`` (a numpy array).

    Object names never hold a newline (keys are checked); if one did, the reader would
    count one name too many and reject the record as damaged: misses, never wrong pages.
    """
    out = []
    for lo in range(0, len(names), BULK_CHUNK):
        chunk = slots[lo : lo + BULK_CHUNK]
        text = "\n".join(names[lo : lo + BULK_CHUNK])
        body = b"".join(
            [
                chunk.astype("<u4").tobytes(),
                log.generations[chunk].astype("<u8").tobytes(),
                log.lengths[chunk].astype("<u8").tobytes(),
                log.checksums[chunk].astype("<u8").tobytes(),
                log.algorithms[chunk].astype("u1").tobytes(),
                text.encode("utf-8"),
            ]
        )
        head = REC.pack(REC_MAGIC, BULK, 0, 0, len(chunk), 0, len(body), 0)
        out.append(head + body + CRC.pack(zlib.crc32(body, zlib.crc32(head))))
    return b"".join(out)


def next_record(data: bytes, start: int, arena: Arena) -> int:
    """Offset of the next intact record at or after ``start``, or -1."""
    pos = data.find(REC_MAGIC, start)
    while pos >= 0:
        if decode_record(data, pos, arena) is not None:
            return pos
        pos = data.find(REC_MAGIC, pos + 1)
    return -1
