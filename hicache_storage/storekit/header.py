r"""The stored-object header: truncation or corruption reads as a miss, never as garbage KV.

Every object a byte-oriented backend stores is ``header || payload``. The header is 48
bytes, little-endian::

    offset size field
    0      4    magic         b"HCS\x01"
    4      1    version       2
    5      1    algorithm     0 = no payload checksum, 1 = xxh3-64
    6      2    flags         bit 0: a trailer (the header follows its payload);
                                 the other bits are 0
    8      8    payload_len   bytes of payload
    16     8    checksum      payload checksum (0 when algorithm is 0)
    24     16   name_digest   BLAKE2b-128 of the object's name
    40     4    header_crc    CRC-32 of bytes 0..39
    44     4    reserved      0

Objects are ``header || payload`` (blob stores: one value), or ``payload || header``
with the trailer flag (file-like stores, since the header-first layout cost their reads
up to half their speed: a payload at offset 48 is copied out of the page cache
misaligned, and is never held in large folios). A reader asks for the header where it
expects it; one found in the other place is damage.

The name digest binds an object to the name it was stored under: a file renamed,
copied or linked to another key's name (another user swapping two of a victim's pages in
a directory they control, a confused copy between namespaces) reads as a miss, never as
that key's page. The payload checksum is xxh3-64, computed over the payload's segments in
order without joining them.

**Frozen across versions**: the magic at 0, the version byte at 4 and the CRC-32 of bytes
0..39 at 40. A reader checks the CRC before the version, so an object of a later version
that keeps them reads as :class:`~hicache_storage.errors.UnsupportedFormatError` (a miss
that stores keep, for the newer release sharing the store; for this reader that key stays
a miss, since first writer wins), while a damaged header is corruption (removed). A later
format that changed these bytes would look like damage to older readers.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from hicache_storage.errors import ConfigError, CorruptObjectError, UnsupportedFormatError

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "ALGORITHMS",
    "FLAG_TRAILER",
    "HEADER_SIZE",
    "ObjectHeader",
    "checksum",
    "decode_header",
    "encode_header",
    "name_digest",
    "verify_payload",
]

MAGIC = b"HCS\x01"
VERSION = 2
HEADER_SIZE = 48
_FMT = struct.Struct("<4sBBHQQ16s")  # 40 bytes, then header_crc and reserved
_TAIL = struct.Struct("<II")

#: ``flags`` bit: the header follows its payload (a trailer).
FLAG_TRAILER = 1

#: Checksum algorithms by option name.
ALGORITHMS = {"none": 0, "xxh3": 1}


@dataclass(frozen=True, slots=True)
class ObjectHeader:
    """A decoded header."""

    algorithm: int
    payload_len: int
    checksum: int


def algorithm_id(name: str) -> int:
    """Map an option value (``"xxh3"`` or ``"none"``) to its header id."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(
            f"unknown checksum {name!r}; choose one of {sorted(ALGORITHMS)}"
        ) from None


def checksum(views: Sequence[memoryview], algorithm: int) -> int:
    """Checksum of the concatenation of ``views`` under ``algorithm``."""
    if algorithm == 0:
        return 0
    if algorithm == 1:
        if len(views) == 1:
            return int(xxhash.xxh3_64_intdigest(views[0]))
        h = xxhash.xxh3_64()
        for v in views:
            h.update(v)
        return int(h.intdigest())
    raise CorruptObjectError(f"unknown checksum algorithm id {algorithm}")


def name_digest(name: str) -> bytes:
    """The 16-byte digest that binds an object to ``name`` (its stored object name)."""
    return hashlib.blake2b(name.encode("utf-8"), digest_size=16).digest()


def encode_header(
    payload_len: int, payload_checksum: int, algorithm: int, name: str, *, trailer: bool = False
) -> bytes:
    """Return the header for a payload stored under ``name`` (``trailer``: stored after it)."""
    flags = FLAG_TRAILER if trailer else 0
    digest = name_digest(name)
    head = _FMT.pack(MAGIC, VERSION, algorithm, flags, payload_len, payload_checksum, digest)
    return head + _TAIL.pack(zlib.crc32(head), 0)


def decode_header(
    raw: bytes | bytearray | memoryview, name: str | None = None, *, trailer: bool = False
) -> ObjectHeader:
    """Decode and check a header, read before its payload (or after it: ``trailer``).

    Raises :class:`CorruptObjectError` if it is not valid, if it belongs in the other
    place, or, with ``name``, if it was not stored under ``name``;
    :class:`UnsupportedFormatError` (a subclass) for a header version, flag or checksum
    algorithm this release does not know.
    """
    if len(raw) < HEADER_SIZE:
        raise CorruptObjectError(f"object shorter than its header ({len(raw)} bytes)")
    head = bytes(raw[: _FMT.size])
    if head[:4] != MAGIC:
        raise CorruptObjectError("bad magic: not a hicache-storage object")
    _magic, version, algorithm, flags, payload_len, csum, digest = _FMT.unpack(head)
    crc, _reserved = _TAIL.unpack(bytes(raw[_FMT.size : HEADER_SIZE]))
    # The header CRC first: a damaged version byte is damage, not a newer format.
    if zlib.crc32(head) != crc:
        raise CorruptObjectError("header checksum mismatch")
    if version != VERSION:
        raise UnsupportedFormatError(f"unsupported object version {version}")
    if algorithm not in ALGORITHMS.values():
        raise UnsupportedFormatError(f"unknown checksum algorithm id {algorithm}")
    if flags & ~FLAG_TRAILER:
        raise UnsupportedFormatError(f"unknown header flags {flags:#x}")
    if bool(flags & FLAG_TRAILER) != trailer:
        where = "after" if trailer else "before"
        raise CorruptObjectError(f"a header found {where} the payload belongs on the other side")
    if name is not None and digest != name_digest(name):
        raise CorruptObjectError("the object was stored under another name")
    return ObjectHeader(algorithm, payload_len, csum)


def verify_payload(header: ObjectHeader, views: Sequence[memoryview]) -> None:
    """Raise :class:`CorruptObjectError` if ``views`` do not match ``header``."""
    n = sum(v.nbytes for v in views)
    if n != header.payload_len:
        raise CorruptObjectError(f"payload is {n} bytes, header says {header.payload_len}")
    if header.algorithm and checksum(views, header.algorithm) != header.checksum:
        raise CorruptObjectError("payload checksum mismatch")
