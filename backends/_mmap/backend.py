"""The ``mmap`` backend built on the arena, its index log and its slot table.

The pieces of :class:`MmapBackend`, in the order of the class: the lifecycle gate (no
call outlives ``close()``, none runs after ``fork()``), opening the arena and its log,
the writer lock (a ``flock`` on the arena for bookkeeping), the write pipeline (reserve
under the lock with :class:`~hicache_storage.backends._mmap.slots.Slots`, copy without
it, publish with one log append), reads, and the protocol methods.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from typing_extensions import override

from hicache_storage.backends._mmap.arena import (
    Arena,
    copy_in,
    copy_out,
    fence,
    pointers,
    slab_geometry,
)
from hicache_storage.backends._mmap.index_log import IndexLog
from hicache_storage.backends._mmap.log_format import NO_ENTRY, Entry, RecordKind
from hicache_storage.backends._mmap.options import DEFAULT_SLOT, MmapOptions
from hicache_storage.backends._mmap.slots import COMMITTED, Slots
from hicache_storage.breaker import Health
from hicache_storage.buffers import PageBuffer, source_views, target_views, total_nbytes
from hicache_storage.config import StorageConfig, parse_options
from hicache_storage.errors import (
    BackendError,
    BackendTimeoutError,
    CapacityError,
    ConfigError,
    NotSupportedError,
)
from hicache_storage.protocol import Capabilities, HiCacheStorage
from hicache_storage.storekit.atomic import is_temporary, writer_is_dead
from hicache_storage.storekit.header import algorithm_id, checksum
from hicache_storage.storekit.iopool import IOPool
from hicache_storage.storekit.pathsafety import ensure_dir, ensure_file_dir, user_dir

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

__all__ = ["MmapBackend", "MmapOptions"]


def _pool_page_bytes(pool: Any) -> int:
    """Bytes of one page of a host pool, or 0 if that cannot be told.

    Our pools say it (``page_bytes``); for SGLang's it comes from the buffer metadata of
    their first page.
    """
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


_CAPS = Capabilities(zero_copy=True, delete=True, persistent=True, shared=True)


class MmapBackend(HiCacheStorage):
    """A fixed-capacity slab of page slots in one memory-mapped file, with a crash-safe index."""

    name = "mmap"
    # The class's declaration (what the registry reads); an instance adds the arena's
    # slot size as max_object_bytes once it is known (_refine_capabilities).
    capabilities = _CAPS
    reports_removals = frozenset({"evict", "delete", "clear"})
    options_class = MmapOptions

    def __init__(self, config: StorageConfig | None = None, **options: Any) -> None:
        super().__init__(config)
        self.options = parse_options(MmapOptions, "mmap", options)
        default = self.options.path is None
        raw = os.path.join(user_dir("/tmp", "hicache-storage-mmap"), "arena") if default else ""
        self.path = os.path.abspath(os.path.expanduser(self.options.path or raw))
        self.index_path = self.path + ".index"
        self._algorithm = algorithm_id(self.options.checksum)
        self._verify = self.options.verify
        # The log's lock (self._log.lock) guards the in-memory index and the log position
        # (readers take it to catch up); _wlock orders this process's writers before they
        # take the flock. Neither is ever held while waiting for another process, but for
        # _wlock. The log detaches for good if the arena is removed or replaced under it.
        self._wlock = threading.Lock()
        self._open_lock = threading.Lock()  # one opener of the arena per instance
        self._arena: Arena | None = None
        self._log = IndexLog(
            self.index_path, self.options.fsync, self._drop_free_hint, self._on_log_damage
        )
        self._log.quota_prefix = self.namespace.digest + "/"  # (its usage, and its quota)
        self._pid = os.getpid()
        self._slots = Slots(
            log=self._log,
            options=self.options,
            path=self.path,
            algorithm=self._algorithm,
            pid=self._pid,
            token=int.from_bytes(secrets.token_bytes(8), "little") or 1,
            writer_lock=self._writer_lock,
            warn=self._warn,
            on_evict=self._evicted,
            refuse=self._refuse,
        )
        self._io = IOPool(self.options.max_concurrency, "hicache-mmap")
        self._gate = threading.Condition()
        self._inflight = 0
        self._closing = False
        directory = os.path.dirname(self.path) or "."
        if default:
            ensure_dir(directory, 0o700)
        else:
            ensure_file_dir(directory)
        self._remove_stale_creations(directory)
        self._refine_capabilities()
        if self.options.slot_size is not None or os.path.exists(self.path):
            self._open_arena(self.options.slot_size or DEFAULT_SLOT)

    def _refine_capabilities(self) -> None:
        """This instance's capabilities: the class's, limited to the largest slot once known."""
        self.capabilities = replace(type(self).capabilities, max_object_bytes=self._slot_limit())

    def _slot_limit(self) -> int | None:
        """The largest storable object: the largest slot (a slab), once known."""
        if self._arena is not None:
            return int(self._arena.slab_size)
        if self.options.slot_size is not None:
            return slab_geometry(self.options.slot_size)[1]
        return None

    @property
    def compactions(self) -> int:
        """How many times this instance compacted the index log."""
        return self._log.compactions

    @staticmethod
    def _remove_stale_creations(directory: str) -> None:
        """Temporaries of arena creators that died (this directory only, not recursive)."""
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
    def _in_flight(self) -> Iterator[None]:
        """Count an operation in flight, so close() never unmaps memory being copied."""
        if os.getpid() != self._pid:
            raise NotSupportedError(
                "an MmapBackend cannot be used across fork(): create a new one in the child"
            )
        detached = self._log.detached
        if detached is not None:
            raise BackendError(detached)
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

    # ------------------------------------------------------------------ arena, log and locks

    def _open_arena(self, slot_size: int, lazy: bool = False) -> Arena:
        """Open (or create, with slabs of ``slot_size``) the arena and load its index.

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
                arena = Arena(self.path, self.options.max_size, slot_size, self.options.prefault)
                try:
                    with self._writer_lock(arena):
                        self._arena = arena
                        self._log.open(arena)
                        self._slots.repair(arena)
                    self._refine_capabilities()
                except BaseException:
                    with self._log.lock:
                        self._arena = None
                        self._log.close()
                    arena.close()
                    raise
                return arena
        except ConfigError as exc:
            if lazy:
                raise BackendError(f"cannot open the mmap arena: {exc}") from exc
            raise

    def _arena_for(self, nbytes: int) -> Arena:
        """The arena, created on first write with the default (or the object's) slot size."""
        if self._arena is not None:
            return self._arena
        return self._open_arena(max(nbytes, DEFAULT_SLOT), lazy=True)

    @override
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Attach the host pool; the arena's largest slot must hold one of its pages.

        Creates the arena with the pool's page size as the largest slot (the slab size)
        when it does not exist yet (and ``slot_size`` is not set): the pool's pages then
        fill their slabs exactly. Raises :class:`ConfigError` when the pool's pages are
        larger than the largest slot of the arena (existing or configured).
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
                    f"{limit}-byte slots at most: set the mmap option slot_size to at least "
                    f"{page_bytes} (a new arena: delete {self.path} and {self.index_path}, "
                    "or choose another path)"
                )
        super().register_mem_pool_host(mem_pool_host)
        if self._arena is None and page_bytes and not os.path.exists(self.path):
            self._open_arena(page_bytes)

    @contextmanager
    def _writer_lock(self, arena: Arena | None = None, wait: bool = True) -> Iterator[None]:
        """Hold the writer lock: one writer of this process at a time, then one of all processes.

        The cross-process part is a ``flock`` on the arena file. ``wait=False``: raise
        :class:`BackendTimeoutError` at once if another thread or process holds it.
        """
        arena = arena or self._arena
        if arena is None:
            raise BackendError("the mmap arena is not open")
        deadline = time.monotonic() + (60.0 if wait else 0.0)
        if not self._wlock.acquire(blocking=wait):
            raise BackendTimeoutError(f"the writer lock of {self.path} is taken")
        try:
            while True:
                try:
                    fcntl.flock(arena.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise BackendTimeoutError(
                            f"another process has held the writer lock of {self.path}"
                            + (" for over 60 s" if wait else "")
                        ) from None
                    time.sleep(0.0005)
            try:
                with self._log.lock:
                    yield
            finally:
                fcntl.flock(arena.fd, fcntl.LOCK_UN)
        finally:
            self._wlock.release()

    def _warn(self, key: str, msg: str, *args: object) -> None:
        """A rate-limited warning (hot paths: reads, catch-up, writes)."""
        self._hicache_state().log("mmap:" + key, msg, *args)

    def _on_log_damage(self, nbytes: int, offset: int) -> None:
        """The index log skipped ``nbytes`` damaged bytes at ``offset``."""
        self._record(corrupt_objects=1)
        self._warn(
            "log", "skipped %d damaged bytes at offset %d of %s", nbytes, offset, self.index_path
        )

    def _drop_free_hint(self) -> None:
        """The index was reloaded: the free slots found from the old one are forgotten."""
        self._slots.free_hint = {}

    def _refuse(self, count: int, error: Exception) -> None:
        """``count`` items of a batch fail with ``error`` (counted, logged rate limited)."""
        self._add_item_errors(count)
        self._log_failure("batch_set", error)

    # ------------------------------------------------------------------ slot allocator

    def _find(self, name: str) -> Entry | None:
        """The live entry of ``name``, checked against the shared slot table."""
        arena = self._arena
        if arena is None:
            if not os.path.exists(self.path):
                return None
            arena = self._open_arena(DEFAULT_SLOT, lazy=True)
        entry = self._slots.committed(arena, name)
        if entry is None:
            self._log.catch_up()  # another process may have stored it
            entry = self._slots.committed(arena, name)
        return entry

    # ------------------------------------------------------------------ write pipeline

    def _write_many(self, items: Sequence[tuple[str, Any, list[memoryview]]]) -> list[bool]:
        """Store ``(key, value, views)`` items; one result per item.

        Slots for all the items are reserved under one lock, the copies run in parallel
        without it, and everything is published with one log append.

        A failure that hits the whole call (arena, log, no slot in time) raises.
        """
        if not items:
            return []
        sizes = [total_nbytes(v) for _, _, v in items]
        arena = self._arena_for(max(sizes))
        names = self.object_namer().paths([key for key, _, _ in items])
        results = [False] * len(items)
        fits = [n <= arena.slab_size for n in sizes]
        units = [arena.units_for(n) if ok else 0 for n, ok in zip(sizes, fits, strict=True)]
        first_of: dict[str, int] = {}
        for i, name in enumerate(names):
            if fits[i]:  # a key twice in a batch is stored once: its first value that fits
                first_of.setdefault(name, i)
        pending = [i for i, name in enumerate(names) if fits[i] and first_of[name] == i]
        oversized = len(items) - sum(fits)
        if oversized:
            if len(items) == 1:
                raise CapacityError(
                    f"{sizes[0]}-byte object exceeds the largest slot ({arena.slab_size} bytes)"
                )
            self._log_failure("set", CapacityError(f"{oversized} objects exceed the largest slot"))
            self._add_item_errors(oversized)
        held = [0]  # (bytes counted in flight against the namespace quota)
        try:
            slots = self._slots.reserve_batch(arena, names, pending, results, units, sizes, held)
        except BaseException:
            self._slots.quota_landed(held[0])
            raise
        order = list(slots)

        def copy(k: int) -> int:
            i = order[k]
            _, value, views = items[i]
            copy_in(arena, slots[i][0], views, pointers(value, views))
            if self.options.fsync:
                arena.flush(slots[i][0], sizes[i])
            return checksum(views, self._algorithm) if self._algorithm else 0

        try:
            # Small objects are copied in the caller's thread: handing a 4 KiB copy to a
            # worker costs more than the copy.
            if self._io.worth_threads(sum(sizes[i] for i in order), len(order)):
                sums = self._io.map(copy, len(order))
            else:
                sums = [copy(k) for k in range(len(order))]
            fence()
            with self._writer_lock():
                self._log.catch_up()
                records = self._slots.commit(arena, order, slots, names, sizes, sums, results)
                if records:
                    self._log.append(records)
                # (committed: the index counts them now; under the lock, so no check
                # in between counts them twice or not at all)
                self._slots.quota_landed(held[0])
                held[0] = 0
                for slot, _ in slots.values():
                    self._slots.slot_lock(arena, slot, take=False)
        except BaseException:
            self._slots.quota_landed(held[0])
            self._slots.release(arena, slots)
            raise
        self._record(bytes_written=sum(sizes[i] for i in order if results[i]))
        for i, name in enumerate(names):
            j = first_of.get(name)
            if fits[i] and j is not None and j != i:
                results[i] = results[j]
        return results

    def _read(self, key: str, views: list[memoryview] | None, target: Any) -> Any:
        name = self.object_path(key)
        entry = self._find(name)
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
        copy_out(arena, entry.slot, views, pointers(target, views) if views else None)
        fence()
        # Seqlock check: the slot must still hold this generation after the copy.
        row = arena.slots[entry.slot]
        if int(row["generation"]) != entry.generation or int(row["state"]) != COMMITTED:
            return None
        if self._verify and entry.algorithm and checksum(views, entry.algorithm) != entry.checksum:
            self._record(corrupt_objects=1)
            self._warn(
                "corrupt",
                "checksum mismatch in slot %d of %s; the read is a miss, the key deleted",
                entry.slot,
                self.path,
            )
            self._drop_damaged(name, entry)
            return None
        row["last_access"] = time.time()
        self._record(bytes_read=entry.length)
        return out

    def _drop_damaged(self, name: str, entry: Entry) -> None:
        """Delete a key whose bytes failed their checksum, if it is still that incarnation.

        Otherwise ``exists`` would count a page that never loads, and ``set`` would keep
        answering that it is stored. Only if the writer lock is free right now (a reader
        never waits for it): else a later read of the key tries again.
        """
        arena = self._arena
        try:
            with self._writer_lock(arena, wait=False):
                self._log.catch_up()
                if arena is not None and self._log.entry(name) == entry:
                    self._log.append([(RecordKind.DEL, name, entry)])
                    self._slots.retire(arena, [entry.slot])
        except (BackendError, ConfigError, OSError) as exc:
            self._warn("drop", "could not delete the damaged %s yet: %s", name, exc)

    # ------------------------------------------------------------------ protocol

    @override
    def get(self, key: str, target: Any = None) -> Any:
        with self._in_flight():
            return self._read(key, None if target is None else target_views(target), target)

    @override
    def set(self, key: str, value: Any) -> bool:
        with self._in_flight():
            return self._write_many([(key, value, source_views(value))])[0]

    @override
    def batch_set(self, keys: list[str], values: Sequence[Any]) -> list[bool]:
        # One reservation, one log append and one publication for the whole batch, as
        # batch_set_pages (the default would pay the writer lock and a log record per key).
        with self._in_flight():
            return self._write_many(
                [(k, v, source_views(v)) for k, v in zip(keys, values, strict=True)]
            )

    @override
    def exists(self, key: str) -> bool:
        with self._in_flight():
            return self._find(self.object_path(key)) is not None

    @override
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        with self._in_flight():
            n, start = len(keys), self._leading_committed(keys)
            # From the first key the in-memory index does not vouch for: _find, which
            # catches up with other processes' log records (and so may find it after all).
            # Once caught up, the rest is one vectorized pass again (a few times at most:
            # pages another process stored, asked about by one that never saw them).
            for _ in range(4):
                if start == n or self._find(self.object_path(keys[start])) is None:
                    return start
                start += 1 + self._leading_committed(keys[start + 1 :])
            for i in range(start, n):
                if self._find(self.object_path(keys[i])) is None:
                    return i
            return n

    def _leading_committed(self, keys: list[str]) -> int:
        """How many leading keys the index has, live in the shared slot table, at once.

        The check of :meth:`_find` (the slot still has the entry's generation and is
        committed), made for the whole run in one vectorized read of the slot table, with
        no catch-up: a key not found here is looked at again by :meth:`_find`.
        """
        arena = self._arena
        if arena is None or not keys:
            return 0
        import numpy as np

        get = self._log.index.get
        namer = self.object_namer()
        # Remembered paths and their index entries, each in one C-speed pass; keys named
        # for the first time are named (validated, hashed) a few at a time when reached:
        # a batch that misses early never pays for naming the rest.
        paths = namer.known_paths(keys)
        found: list[int | None] = list(map(get, paths))  # type: ignore[arg-type]  # (get(None))
        n = len(keys)
        i = found.index(None) if None in found else n
        while i < n:
            if found[i] is None:
                if paths[i] is None:
                    namer.fill(paths, keys, i)  # this key and a few after it
                entry = get(cast("str", paths[i]))
                if entry is None:
                    break
                found[i] = entry
            i += 1
        if i == 0:
            return 0
        packed = cast("list[int]", found[:i])  # slot | generation << 32 (63-bit generation)
        rows = arena.slots[np.array([f & 0xFFFFFFFF for f in packed], np.int64)]  # unpack()
        gens = np.array([f >> 32 for f in packed], np.uint64)
        bad = np.flatnonzero((rows["generation"] != gens) | (rows["state"] != COMMITTED))
        return i if bad.size == 0 else int(bad[0])

    @override
    def batch_get_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        big = self._io.worth_threads(sum(p.nbytes for p in pages), len(pages))
        with self._in_flight():
            return self._map_pages(
                "batch_get_pages",
                len(keys),
                lambda i: self._read(keys[i], pages[i].views, pages[i]),
                self._io.map if big else None,
            )

    @override
    def batch_set_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        with self._in_flight():
            return self._write_many([(k, p, p.views) for k, p in zip(keys, pages, strict=True)])

    def _evicted(self, names: list[str]) -> None:
        """Objects this instance evicted (its slots' LRU): counted, and told to listeners."""
        self._record(evictions=len(names))
        if self.__dict__.get("_removal_listeners"):
            prefix = self.namespace.digest + "/"
            keys = [n.rsplit("/", 1)[-1].partition("~")[0] for n in names if n.startswith(prefix)]
            if keys:
                self._removed(keys)

    @override
    def delete(self, key: str) -> bool:
        name = self.object_name(key).path
        with self._in_flight():
            if self._arena is None and not os.path.exists(self.path):
                return False
            arena = self._arena_for(0)
            with self._writer_lock():
                self._log.catch_up()
                entry = self._log.entry(name)
                if entry is None:
                    return False
                self._log.append([(RecordKind.DEL, name, entry)])
                self._slots.retire(arena, [entry.slot])
            self._removed([key])
            return True

    @override
    def clear(self) -> None:
        """Delete this namespace's objects (other namespaces in the arena stay)."""
        prefix = self.namespace.digest + "/"
        with self._in_flight():
            if self._arena is None and not os.path.exists(self.path):
                return
            arena = self._arena_for(0)
            with self._writer_lock():
                self._log.catch_up()
                if any(n.startswith(prefix) for n in self._log.index):
                    # One record clears the namespace (the commit point), then its slots
                    # are retired; a crash between the two leaves them committed in the
                    # slot table but in no index: orphans, reclaimed by later writers.
                    self._log.append([(RecordKind.CLEAR, prefix, NO_ENTRY)])
                    self._slots.retire(arena, self._log.dropped)
                    self._log.dropped = []
                    self._removed(None)

    @override
    def close(self) -> None:
        if os.getpid() != self._pid:
            self._close_in_child()
            return
        with self._gate:
            self._closing = True
            while self._inflight:
                self._gate.wait()
        self._io.close()
        if self._arena is not None and self._log.detached is None:
            self._compact_at_close()
        with self._log.lock:
            if self._arena is not None:
                self._arena.close()
                self._arena = None
            self._log.close()

    def _close_in_child(self) -> None:
        """close() in a child process after fork(): unmap and close, touch nothing shared.

        The child shares the parent's open files: taking the writer lock would succeed
        beside the parent's (and dropping it would drop the parent's), and rewriting the
        log would lose what the parent appends meanwhile. No lock of this instance is
        taken either: a parent thread may have held one at the fork.
        """
        arena, self._arena = self._arena, None
        self._closing = True
        if arena is not None:
            arena.close()
        self._log.close(lock=False)

    def _compact_at_close(self) -> None:
        """Rewrite the index log in its compact form if much was appended to it.

        The next process to open the arena then loads its index in a few vectorized
        passes instead of decoding a record per object. Best effort: a failure is logged.
        """
        try:
            with self._writer_lock():
                self._log.catch_up()
                if self._log.detached is None and self._log.worth_compacting():
                    self._log.compact()
        except Exception as exc:  # noqa: BLE001 - best effort: close() must still close
            self._warn("compact", "could not compact %s at close: %s", self.index_path, exc)

    # ------------------------------------------------------------------ introspection

    @override
    def health(self) -> Health:
        """Whether the arena is usable: a ``stat``, no I/O on the mapping.

        ``down`` when the arena's file is gone (unlinked under a live mapping) or its
        directory is not writable.
        """
        base = super().health()
        if not base.usable:
            return base
        folder = os.path.dirname(self.path) or "."
        if not os.access(folder, os.W_OK | os.X_OK):
            return Health("down", "the arena's directory is not writable")
        if self._arena is not None and not os.path.exists(self.path):
            return Health("down", "the arena's file is gone")
        return Health("ok")

    @override
    def usage(self) -> dict[str, int]:
        """The protocol's figures for the whole arena (every namespace in it), and its slots.

        ``used_bytes`` are the live objects' payloads; ``limit_bytes`` the bytes of its
        slabs. Extra keys: ``slabs``, ``slot_size`` (a slab's bytes: the largest slot),
        ``unit`` (the smallest slot), and this namespace's own objects, payload bytes and
        quota (``namespace_max_size``, 0: none). Before the arena exists (no write
        yet): zeros, and ``limit_bytes`` is ``max_size``.
        """
        arena = self._arena
        if arena is None:
            return {
                "objects": 0,
                "used_bytes": 0,
                "limit_bytes": int(self.options.max_size),
                "namespace_objects": 0,
                "namespace_used_bytes": 0,
                "namespace_limit_bytes": int(self.options.namespace_max_size or 0),
                "slabs": 0,
                "slot_size": 0,
                "unit": 0,
            }
        import numpy as np

        log = self._log
        with log.lock:  # (one pass in numpy: a million objects take milliseconds)
            log.catch_up()
            index = log.index
            slots = np.fromiter(
                (p & 0xFFFFFFFF for p in index.values()), dtype=np.int64, count=len(index)
            )  # (index_log.unpack's slot, inline)
            used = int(log.lengths[slots].sum()) if len(index) else 0
            objects = len(index)
            mine_objects, mine_bytes = log.prefix_count, log.prefix_bytes
        return {
            "objects": objects,
            "used_bytes": used,
            "limit_bytes": arena.nslabs * arena.slab_size,
            "namespace_objects": mine_objects,
            "namespace_used_bytes": mine_bytes,
            "namespace_limit_bytes": int(self.options.namespace_max_size or 0),
            "slabs": arena.nslabs,
            "slot_size": arena.slab_size,
            "unit": arena.unit,
        }

    def slots_for(self, nbytes: int) -> int:
        """How many objects of ``nbytes`` the arena holds when it holds nothing else.

        0 if they do not fit in a slot, or before the arena exists.
        """
        arena = self._arena
        if arena is None or nbytes > arena.slab_size:
            return 0
        return arena.nslabs * (arena.units // arena.units_for(nbytes))

    @override
    def __repr__(self) -> str:
        return f"MmapBackend(path={self.path!r}, namespace={self.namespace.digest}, shard={self.config.shard})"
