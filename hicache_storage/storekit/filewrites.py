"""The writes of :class:`~hicache_storage.storekit.filestore.FileTreeStore`.

A new object is written to a temporary in its directory (room reserved first under the cap
and the free-space floor, with the root's :class:`~hicache_storage.storekit.spacelock.SpaceLock`
near the floor) and published atomically, first writer wins
(:mod:`hicache_storage.storekit.atomic`). A store that recycles files evicts by overwriting
an evicted object's file of the same size instead of allocating a new one.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from hicache_storage.buffers import (
    PageBuffer,
    source_views,
    total_nbytes,
)
from hicache_storage.errors import (
    BackendError,
    CapacityError,
    from_os_error,
)
from hicache_storage.storekit.atomic import (
    finish_temp,
    fsync_dir,
    open_temp,
    publish,
    temp_path,
)
from hicache_storage.storekit.filetree import (
    FLOOR_SLACK_OBJECTS,
    FileTreeCore,
    O,
    PayloadMove,
    page_spans,
)
from hicache_storage.storekit.header import (
    HEADER_SIZE,
    checksum,
    encode_header,
)
from hicache_storage.storekit.pathsafety import (
    NotRegularFileError,
    open_regular_stat,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from hicache_storage.keys import ObjectName
    from hicache_storage.storekit.capacity import Reservation

__all__ = ["FileTreeWrites", "WriteItem"]


class WriteItem(PayloadMove):
    """A new object on its way to the store: its open temporary and its reservation."""

    __slots__ = ("allocated", "final", "name", "reservation")

    def __init__(
        self,
        name: ObjectName,
        final: str,
        reservation: Reservation,
        tmp: str,
        fd: int,
        views: list[memoryview],
        payload: int,
        header: bytes,
        spans: list[tuple[int, int]] | None,
        allocated: int,
    ) -> None:
        super().__init__(fd, tmp, views, payload, header, spans)
        self.name, self.final, self.reservation = name, final, reservation
        self.allocated = allocated  # bytes open_temp allocated (finish_temp cuts the rest)


class FileTreeWrites(FileTreeCore[O]):
    """Writes: ``set``, ``batch_set`` and ``batch_set_pages``."""

    def _write(self, name: ObjectName, views: list[memoryview]) -> bool:
        path = self._path(name)
        if self._already_stored(name, path):
            return True
        header, nbytes = self._new_header(name, views)
        reservation: Reservation | None = None
        try:  # released on any exit unless committed (the reservation may be replaced)
            published = None
            reused = self._tracker.reserve_reusing(name.path, nbytes) if self.recycle else None
            if reused is not None:
                reservation, victim = reused
                try:
                    published = self._recycle(victim, name, path, views, header, nbytes)
                except FileNotFoundError:
                    published = None  # directories removed by a clear(): a new file
                if published is None:
                    # Not reused: a new file needs room like any other (cap and floor).
                    reservation.release()
                    reservation = None
            if published is None:
                reservation, published = self._write_file(name, path, views, header, nbytes)
            self._settle(name, path, reservation, published, nbytes)
        except OSError as exc:
            raise from_os_error(exc, f"write {path}") from exc
        finally:
            if reservation is not None:
                reservation.release()
        return True

    def _already_stored(self, name: ObjectName, path: str) -> bool:
        """True (and the object's use noted) if a good object is stored at ``path``.

        Anything else there (a planted FIFO, a link...) is removed: it must not block the key.
        """
        st = self._stored(path, remove=True)
        if st is None:
            return False
        self._meta.add(path)
        self._touch(name, path, st)
        return True

    def _new_header(self, name: ObjectName, views: Sequence[memoryview]) -> tuple[bytes, int]:
        """The header of a new object of ``views`` for ``name``, and the object's size."""
        self._tracker.refresh_if_due()  # a cap shared with other processes: catch up
        payload = total_nbytes(views)
        header = encode_header(
            payload, checksum(views, self._algorithm), self._algorithm, name.path, trailer=True
        )
        return header, HEADER_SIZE + payload

    def _settle(
        self,
        name: ObjectName,
        path: str,
        reservation: Reservation | None,
        published: bool,
        nbytes: int,
    ) -> None:
        """Account for a write that published ``path`` (or found it taken meanwhile)."""
        assert reservation is not None  # held by the recycled or the new file
        if published:
            if not reservation.commit() and self._on_disk(path):
                # clear() ran during the write and the object landed after it.
                self._tracker.add(name.path, nbytes)
            self._record(bytes_written=nbytes - HEADER_SIZE)
        elif self._stored(path) is None:
            # The name is taken, but not by a page (a non-empty directory, another
            # user's file): never report stored what a read would not return.
            raise BackendError(f"write {path}: the name is held by something else")
        else:
            self._touch(name, path)
        self._meta.add(path)

    def _write_file(
        self, name: ObjectName, path: str, views: list[memoryview], header: bytes, nbytes: int
    ) -> tuple[Reservation, bool]:
        """Reserve room for a new file, write it and publish it; (reservation, published).

        A directory that vanished meanwhile (clear() in another process, the root removed)
        is recreated and the write retried.
        """
        for attempt in (0, 1):
            reservation, tmp, fd, allocated = self._open_new(name, path, nbytes)
            try:
                try:
                    move = PayloadMove(fd, tmp, views, nbytes - HEADER_SIZE, header)
                    self.move_payloads("write", (move,))
                except BaseException:
                    os.close(fd)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)
                    raise
                published = finish_temp(
                    tmp, fd, path, nbytes, fsync=self.options.fsync, allocated=allocated
                )
            except FileNotFoundError:
                reservation.release()
                if attempt:
                    raise
                self._forget_dirs()
                continue
            except BaseException:
                reservation.release()
                raise
            return reservation, published
        raise AssertionError("unreachable")  # pragma: no cover

    def _open_new(
        self, name: ObjectName, path: str, nbytes: int
    ) -> tuple[Reservation, str, int, int]:
        """Reserve room for a new object of ``nbytes`` at ``path`` and open its temporary.

        Returns ``(reservation, temporary path, write descriptor, bytes allocated)``. The
        reservation (and, when :attr:`serialize_free_space`, the file's allocation) happens
        under the root's free-space lock. A directory that vanished meanwhile is recreated
        and the open retried. The caller writes the object, then publishes it (or releases
        the reservation, closes and removes the temporary).
        """
        for attempt in (0, 1):
            self._ensure_fanout(name)
            locked = self._serialize and self._near_floor(nbytes)
            allocate = nbytes if locked else 0
            try:
                with self._space_lock.hold() if locked else contextlib.nullcontext():
                    reservation = self._reserve(name, nbytes)
                    try:
                        tmp, fd = open_temp(
                            os.path.dirname(path),
                            mode=self.file_mode,
                            gid=self.group_id,
                            allocate=allocate,
                        )
                    except BaseException:
                        reservation.release()
                        raise
                    if allocate:
                        reservation.mark_allocated()
            except FileNotFoundError:  # the lock file or the fan-out directory is gone
                if attempt:
                    raise
                self._forget_dirs()
                continue
            return reservation, tmp, fd, allocate
        raise AssertionError("unreachable")  # pragma: no cover

    def _reserve(self, name: ObjectName, nbytes: int) -> Reservation:
        """Room for a new file of ``nbytes`` (evicting LRU objects), or CapacityError.

        When there is no room while a clear() is still deleting files (the space it frees
        is not free yet), the write waits for those deletions and tries once more.
        """
        reservation = self._tracker.reserve(name.path, nbytes)
        if reservation is None and self._wait_for_reclaims():
            reservation = self._tracker.reserve(name.path, nbytes)
        if reservation is None:
            raise CapacityError(f"no room for {nbytes} bytes under max_size/min_free_space")
        return reservation

    def _near_floor(self, nbytes: int) -> bool:
        """True unless the filesystem has so much room above the floor that no check is needed.

        So much room is :data:`FLOOR_SLACK_OBJECTS` objects of this size more than the floor
        and this object: concurrent unlocked writers cannot cross the floor then. Far from the
        floor, checking under the lock would only serialize the filesystem's page allocation
        of every writer.
        """
        tracker = self._tracker
        need = tracker._rounded(nbytes)
        slack = FLOOR_SLACK_OBJECTS * need
        return self._free_space() - tracker._pending() - need < tracker.min_free_bytes + slack

    def _recycle(
        self,
        victim_rel: str,
        name: ObjectName,
        path: str,
        views: list[memoryview],
        header: bytes,
        nbytes: int,
    ) -> bool | None:
        """Evict ``victim_rel`` by overwriting its file with ``views`` and ``header``, then publish.

        Rewriting pages the filesystem already holds is much cheaper than allocating new
        ones (tmpfs: about 1.5x for writes, and reads of the result are faster too). The
        file first leaves the namespace (``rename`` to a temporary: new readers miss it),
        then is overwritten only if no reader holds it (``flock`` exclusive, not waiting;
        see :meth:`_open_published` for the readers' side), then published like a new
        file. Returns True/False as :func:`~hicache_storage.storekit.atomic.publish`, or None when
        the file could not be reused (gone, another size, read by someone, not a regular
        file of this user): it is then removed, and the caller writes a new file.
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
        self._removed_names([victim_rel])
        try:
            try:
                fd, st = open_regular_stat(tmp, os.O_WRONLY)
            except (PermissionError, NotRegularFileError):
                return None  # another user's page (group sharing): evicted, not reused
            try:
                if st.st_size != nbytes or st.st_uid != os.geteuid():
                    return None
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return None  # a reader still copies the evicted object: leave it be
                self.move_payloads(
                    "write", (PayloadMove(fd, tmp, views, nbytes - HEADER_SIZE, header),)
                )
                if self.options.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)  # releases the lock before the object is visible
            self._ensure_fanout(name)
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
                self._log(
                    "fsync",
                    "published %s but fsync of its directory failed: %s",
                    path,
                    exc,
                    level=logging.ERROR,
                )
        return published

    @override
    def set(self, key: str, value: Any) -> bool:
        if self.payload_batch:
            return self._write_each("set", [key], [source_views(value)])[0]
        return self._write(self.object_name(key), source_views(value))

    @override
    def batch_set_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        spans = page_spans(pages) if self.payload_batch else None
        return self._write_each("batch_set_pages", keys, [p.views for p in pages], spans)

    @override
    def batch_set(self, keys: list[str], values: Sequence[Any]) -> list[bool]:
        # As batch_set_pages: the values' bytes straight to the files, on the I/O threads
        # (the default would write them one by one in the caller's thread). A value of
        # the wrong type raises before anything is written.
        return self._write_each("batch_set", keys, [source_views(v) for v in values])

    def _write_each(
        self,
        op: str,
        keys: list[str],
        views: list[list[memoryview]],
        spans: list[list[tuple[int, int]]] | None = None,
    ) -> list[bool]:
        """Write every item: one by one on the I/O threads, or in batched moves.

        A key twice in the batch is written once, with its first value (first writer
        wins, as in a serial loop). ``spans``: the views' ``(address, bytes)`` ranges, when
        the caller knows them (batched moves only).
        """
        first: dict[str, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        unique = list(first.values())
        names = self.object_names([keys[i] for i in unique])
        step = self.payload_batch
        if step:
            done: list[bool] = []
            for at in range(0, len(unique), step):
                part = unique[at : at + step]
                with self._parts:  # (bounds the files open at once)
                    done += self._write_part(
                        op,
                        names[at : at + step],
                        [views[i] for i in part],
                        None if spans is None else [spans[i] for i in part],
                    )
        else:
            # Small objects go faster in the caller's thread: a thread hand-off costs more
            # than their system calls (measured: 4 KiB objects, 1.6x faster serially).
            big = self.options.fsync or self._io.worth_threads(
                sum(total_nbytes(v) for v in views), len(views)
            )
            done = self._map_pages(
                op,
                len(unique),
                lambda j: self._write(names[j], views[unique[j]]),
                self._io.map if big else None,
            )
        if len(unique) == len(keys):
            return done
        by_key = {keys[i]: ok for i, ok in zip(unique, done, strict=True)}
        return [by_key[k] for k in keys]

    def _write_part(
        self,
        op: str,
        names: list[ObjectName],
        views: list[list[memoryview]],
        spans: list[list[tuple[int, int]]] | None,
    ) -> list[bool]:
        """Write one part of a batch: temporaries, one move, then publication."""
        n = len(names)
        items: list[WriteItem | None] = [None] * n

        def prepare(i: int) -> bool:
            name = names[i]
            path = self._path(name)
            if self._already_stored(name, path):
                return True
            header, nbytes = self._new_header(name, views[i])
            try:
                reservation, tmp, fd, allocated = self._open_new(name, path, nbytes)
            except OSError as exc:
                raise from_os_error(exc, f"write {path}") from exc
            payload = nbytes - HEADER_SIZE
            item_spans = None if spans is None else spans[i]
            items[i] = WriteItem(
                name, path, reservation, tmp, fd, views[i], payload, header, item_spans, allocated
            )
            return True

        big = self._io.worth_threads(sum(map(total_nbytes, views)), n)
        mapper = self._io.map if big else None
        try:
            ok = self._map_pages(op, n, prepare, mapper)
            todo = [i for i in range(n) if items[i] is not None]
            if not todo:
                return ok
            try:
                self.move_payloads("write", [item for item in items if item is not None])
            except (BackendError, OSError) as exc:
                for i in todo:
                    ok[i] = False
                self._log_failure(op, exc)
                self._add_item_errors(len(todo))
                return ok  # (the temporaries are removed below)

            def publish(j: int) -> bool:
                item, items[todo[j]] = items[todo[j]], None
                assert item is not None
                nbytes = item.payload + HEADER_SIZE
                try:  # (finish_temp closes the file and removes the temporary, always)
                    published = finish_temp(
                        item.path,
                        item.fd,
                        item.final,
                        nbytes,
                        fsync=self.options.fsync,
                        allocated=item.allocated,
                    )
                    self._settle(item.name, item.final, item.reservation, published, nbytes)
                except OSError as exc:
                    raise from_os_error(exc, f"write {item.final}") from exc
                finally:
                    item.reservation.release()
                return True

            for i, done in zip(todo, self._map_pages(op, len(todo), publish, mapper), strict=True):
                ok[i] = done
            return ok
        finally:
            for item in items:  # not published: a failed move, close(), an error
                if item is not None:
                    self._abandon(item)

    @staticmethod
    def _abandon(item: WriteItem) -> None:
        """A write that will not be published: close and remove its temporary, free its room."""
        with contextlib.suppress(OSError):
            os.close(item.fd)
        with contextlib.suppress(OSError):
            os.unlink(item.path)
        item.reservation.release()
