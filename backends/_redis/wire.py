"""What the ``redis`` backend sends and how it reads the replies.

Pages go out as several buffers without being joined (:class:`PagePacker`, on every
connection of the backend's pools), and each reply of a pipeline is read into what
:class:`~hicache_storage.storekit.blobstore.BlobStore` expects: bytes, a miss, a foreign
value, or the exception that failed that command.
"""

from __future__ import annotations

import functools
from typing import Any, cast

from hicache_storage.errors import (
    BackendError,
)
from hicache_storage.storekit.blobstore import (
    FOREIGN,
    PRESENT,
    Foreign,
    Present,
    Segments,
)
from hicache_storage.storekit.header import HEADER_SIZE

#: A part of a value larger than this goes to the socket as a view, never copied (the
#: size above which redis-py itself stops joining the parts of a command).
INLINE_MAX = 6000


#: More bytes than any Redis value holds (512 MiB at most).
LONGEST = 2**40


def wrong_type(reply: object) -> bool:
    """True if ``reply`` is the server's error for a key of another type than a string."""
    from redis.exceptions import ResponseError

    return isinstance(reply, ResponseError) and str(reply).startswith("WRONGTYPE")


def read_reply(reply: object) -> bytes | Foreign | Exception | None:
    """A value read by ``GETRANGE`` or ``GET`` (an empty one is no page: a miss)."""
    if isinstance(reply, bytes):
        return reply or None  # (GETRANGE answers b"" for a missing key)
    if reply is None or isinstance(reply, Exception):
        return FOREIGN if wrong_type(reply) else reply
    return BackendError(f"unexpected reply to GETRANGE: {type(reply).__name__}")


def long_enough(reply: object) -> bool | Exception:
    """Whether a ``STRLEN`` answer is a value as long as a header at least."""
    if type(reply) is int:
        return reply >= HEADER_SIZE
    if isinstance(reply, Exception):
        return False if wrong_type(reply) else reply
    return BackendError(f"unexpected reply to STRLEN: {type(reply).__name__}")


def stored_reply(reply: object, length: object, nbytes: int) -> bool | Present | Exception | None:
    """The answer of one ``SET NX`` of ``nbytes`` and the ``STRLEN`` after it.

    Stored, already present (a value of the same length: another writer's copy of the
    page), the item's error, or None (taken by what is not this page).
    """
    if reply is True:
        return True
    if isinstance(reply, Exception):
        return reply
    if reply is not None:
        return BackendError(f"unexpected reply to SET: {type(reply).__name__}")
    if type(length) is int:
        return PRESENT if length == nbytes else None
    if isinstance(length, Exception):
        return None if wrong_type(length) else length
    return BackendError(f"unexpected reply to STRLEN: {type(length).__name__}")


def count_reply(reply: object) -> bool | Exception:
    """The answer of one ``UNLINK`` of a single key, or of :data:`_REMOVE_BAD`."""
    if isinstance(reply, Exception):
        return reply
    if type(reply) is int and reply in (0, 1):
        return bool(reply)
    return BackendError(f"unexpected reply: {type(reply).__name__}")


def queued(pipe: Any) -> list[Any] | None:
    """The commands queued in a redis-py cluster pipeline (None where it keeps them elsewhere)."""
    queue = getattr(getattr(pipe, "_execution_strategy", None), "command_queue", None)
    return queue if isinstance(queue, list) else None


class Value:
    """A value sent as one bulk string made of several buffers, never joined into one.

    Only :class:`PagePacker` knows it: a connection without that packer refuses it.
    """

    __slots__ = ("nbytes", "parts")

    def __init__(self, parts: Segments) -> None:
        views = [p if isinstance(p, memoryview) else memoryview(p) for p in parts]
        # (a strided view cannot go to a socket as it is: its bytes, in order, can)
        self.parts = [v if v.c_contiguous else memoryview(v.tobytes()) for v in views]
        self.nbytes = sum(v.nbytes for v in self.parts)


class PagePacker:
    """redis-py's command packer, plus :class:`Value` arguments sent without a copy.

    A command without a ``Value`` goes to the connection's own packer (hiredis's, when
    installed). One with it is packed here: the RESP framing and small parts are joined,
    and each part over :data:`INLINE_MAX` bytes is its own chunk, a view of the caller's
    buffer that the connection writes to the socket as it is (hiredis's packer would copy
    it into one string, after the caller had joined it into another).
    """

    __slots__ = ("_encode", "_inner")

    def __init__(self, inner: Any, encode: Any) -> None:
        self._inner = inner
        self._encode = encode

    def pack(self, *args: Any) -> list[bytes | memoryview]:
        if not any(type(a) is Value for a in args):
            return cast("list[bytes | memoryview]", self._inner.pack(*args))
        out: list[bytes | memoryview] = []
        buff = b"*%d\r\n" % len(args)
        for arg in args:
            if type(arg) is not Value:
                data = self._encode(arg)
                buff += b"$%d\r\n%b\r\n" % (len(data), data)
                continue
            buff += b"$%d\r\n" % arg.nbytes
            for view in arg.parts:
                if view.nbytes > INLINE_MAX:
                    out.append(buff)
                    out.append(view.cast("B") if view.format != "B" or view.ndim != 1 else view)
                    buff = b""
                else:
                    buff += view.tobytes()
            buff += b"\r\n"
        out.append(buff)
        return out


@functools.cache
def packing_pool() -> type:
    import redis

    class PackingPool(redis.ConnectionPool):
        """A cluster node's pool: its connections get the page packer."""

        def __init__(self, connection_class: type = redis.Connection, **kwargs: Any) -> None:
            super().__init__(connection_class=packing(connection_class), **kwargs)

    return PackingPool


@functools.cache
def packing(base: type) -> type:
    """``base`` (redis-py's TCP, TLS or unix-socket connection) with a :class:`PagePacker`."""

    class PagePacking(base):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            inner = self._command_packer  # type: ignore[has-type]
            self._command_packer = PagePacker(inner, self.encoder.encode)

    PagePacking.__name__ = PagePacking.__qualname__ = f"PagePacking{base.__name__}"
    return PagePacking
