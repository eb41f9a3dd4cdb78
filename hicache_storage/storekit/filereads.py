"""The reads of :class:`~hicache_storage.storekit.filestore.FileTreeStore`.

An object is opened without following links or blocking (a FIFO is refused), checked with
the trust rule, and in a store that recycles files locked shared and re-checked; its
trailer is checked against its name and size and its payload verified before a read
counts. Damage is a miss, and the object is removed so the key can be stored again.
Batched reads (a store with :meth:`~hicache_storage.storekit.filetree.FileTreeCore._payload_batch`)
read and check every header first, so a damaged object never reaches the caller's memory.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from hicache_storage.buffers import (
    PageBuffer,
    memoryview_at,
    target_views,
    total_nbytes,
)
from hicache_storage.errors import (
    BackendError,
    CorruptObjectError,
    UnsupportedFormatError,
    from_os_error,
)
from hicache_storage.storekit.filetree import FileTreeCore, O, PayloadMove, page_spans, same_file
from hicache_storage.storekit.header import (
    HEADER_SIZE,
    ObjectHeader,
    decode_header,
    verify_payload,
)
from hicache_storage.storekit.pathsafety import (
    NotRegularFileError,
    UnsafePathError,
    check_file,
    open_regular_stat,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from hicache_storage.keys import ObjectName

__all__ = ["FileTreeReads", "ReadItem"]

#: How :meth:`FileTreeReads._read_quick` opens an object: no link followed, no FIFO waited
#: on. (``O_NONBLOCK`` stays set: it changes nothing for a regular file.)
_QUICK_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY

#: Mean object size from which batched reads verify their checksums on the I/O threads.
THREADED_VERIFY = 512 << 10


class ReadItem(PayloadMove):
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


class FileTreeReads(FileTreeCore[O]):
    """Reads: ``get``, ``batch_get`` and ``batch_get_pages``."""

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
                same = same_file(st, os.lstat(path))
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
        A read into given views takes :meth:`_read_quick` first where the store allows it.
        """
        if views is not None and self._quick_reads:
            done = self._read_quick(name, views)
            if done is not None:
                return True if done else None
        item = self._open_for_read(name, views)
        if item is None:
            return None
        with self._reading(item):
            self.move_payloads("read", (item,))
            assert item.trailer is not None
            item.header = self._check_header(item, item.trailer)
            self._finish_read(item)
        return item.out if item.ok else None

    @functools.cached_property
    def _quick_reads(self) -> bool:
        """True if :meth:`_read_quick` may serve this store's reads.

        Not in a store that recycles files (a read must lock them), nor in one whose bytes
        move by other means than this class's ``move_payloads``.
        """
        own_move = type(self).move_payloads is FileTreeCore.move_payloads
        return own_move and not self.recycles_files

    def _read_quick(self, name: ObjectName, views: list[memoryview]) -> bool | None:
        """The common read, in the fewest steps: True once read and verified, False on a miss.

        ``open`` (no link followed, never blocking), ``fstat``, one ``preadv`` of payload and
        trailer, the trailer and checksum checks: the same rules as the careful path, with
        no objects, context managers or extra system calls between them. Anything else (a
        file not trusted or not regular, a size that differs, a short read, damage, an
        error) returns None, and the careful path reads the object again and decides.
        """
        path = self._path(name)
        try:
            fd = os.open(path, _QUICK_OPEN)
        except FileNotFoundError:
            self._meta.discard(path)
            return False
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            payload = st.st_size - HEADER_SIZE
            if payload != total_nbytes(views):
                return None
            check_file(path, st, self.group_id)
            trailer = bytearray(HEADER_SIZE)
            if os.preadv(fd, [*views, trailer], 0) != payload + HEADER_SIZE:
                return None
            header = decode_header(trailer, name.path, trailer=True)
            if header.payload_len != payload:
                return None
            if self.options.verify_checksum:
                verify_payload(header, views)
            self._record(bytes_read=payload)
            self._touch(name, path, st, fd)
            return True
        except (CorruptObjectError, UnsafePathError, OSError):
            return None
        finally:
            os.close(fd)

    def _open_for_read(self, name: ObjectName, views: list[memoryview] | None) -> ReadItem | None:
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
        item = ReadItem(name, path, fd, st, views or [], True)
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
    def _reading(self, item: ReadItem, close: bool = True) -> Iterator[None]:
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

    def _check_header(self, item: ReadItem, head: bytes | bytearray) -> ObjectHeader:
        """The object's trailer, checked against its name and size (CorruptObjectError)."""
        # (renamed or swapped: not this key's; a header first is not this store's layout)
        header = decode_header(head, item.name.path, trailer=True)
        payload = item.st.st_size - HEADER_SIZE
        if header.payload_len != payload:
            raise CorruptObjectError(
                f"header says {header.payload_len} bytes, file holds {payload}"
            )
        return header

    def _finish_read(self, item: ReadItem) -> None:
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
            if same_file(os.lstat(path), os.fstat(fd)):
                os.unlink(path)
        except OSError:
            pass

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
        views = [None] * len(keys) if targets is None else [target_views(t) for t in targets]
        if self.payload_batch:
            got = self._read_each("batch_get", keys, views)
        else:
            got = self._read_one_by_one("batch_get", keys, views)
        if targets is None:
            return got
        return [None if g is None else t for g, t in zip(got, targets, strict=True)]

    def _read_one_by_one(
        self, op: str, keys: list[str], views: Sequence[list[memoryview] | None]
    ) -> list[Any]:
        """Read each key into its views (None: a new tensor); None for each miss.

        On the I/O threads when the targets are large, as ``batch_get_pages``: the
        default loop would read them one by one in the caller's thread. A page that
        fails (an I/O error) is a None of its own; the others are still read.
        """
        names = self.object_names(keys)
        out: list[Any] = [None] * len(keys)

        def one(i: int) -> bool:
            out[i] = self._read(names[i], views[i])
            return out[i] is not None

        sized = [v for v in views if v is not None]
        big = len(sized) == len(views) and self._io.worth_threads(
            sum(total_nbytes(v) for v in sized), len(views)
        )
        self._map_pages(op, len(keys), one, self._io.map if big else None)
        return out

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
        names = self.object_names(keys)
        big = self._io.worth_threads(sum(p.nbytes for p in pages), len(pages))
        return self._map_pages(
            op, len(keys), lambda i: io(names[i], pages[i].views), self._io.map if big else None
        )

    @override
    def batch_get_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        if not self.payload_batch:
            return self._each_page("batch_get_pages", keys, pages, self._read)
        got = self._read_each("batch_get_pages", keys, [p.views for p in pages], page_spans(pages))
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
        names = self.object_names(keys)
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
        items: list[ReadItem | None] = [None] * n

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
            threads = self.options.verify_checksum and nbytes >= THREADED_VERIFY * len(opened)
            self._map_pages(op, len(live), finish, self._io.map if threads else None)
            return out
