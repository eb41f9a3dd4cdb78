"""The ``mmap`` backend: its options, and the backend built on the arena and its index log.

The pieces of :class:`MmapBackend`, in the order of the class: the lifecycle gate (no
call outlives ``close()``, none runs after ``fork()``), opening the arena and its log,
the writer locks (a ``flock`` on the arena for bookkeeping, an OFD byte lock per slot
being written), the slot allocator (free slots of a size class, orphans of dead
writers, slabs cut into a class, LRU eviction within and across classes, retirement),
the write pipeline (reserve under the lock, copy without it, publish with
one log append) and the protocol methods.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from typing_extensions import override

from hicache_storage.backends._mmap.arena import (
    Arena,
    SlotState,
    copy_in,
    copy_out,
    fence,
    new_generations,
    pointers,
    slab_geometry,
)
from hicache_storage.backends._mmap.index_log import (
    NO_ENTRY,
    Entry,
    IndexLog,
    Record,
    RecordKind,
)
from hicache_storage.buffers import PageBuffer, source_views, target_views, total_nbytes
from hicache_storage.config import Size, StorageConfig, parse_options
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


@dataclass(frozen=True)
class MmapOptions:
    """Options of the ``mmap`` backend (environment: ``HICACHE_STORAGE_MMAP_<NAME>``).

    Attributes:
        path: the arena file (typically on local NVMe); its ``.index`` beside it.
            Default: ``/tmp/hicache-storage-mmap-<uid>/arena``, in a private (0700)
            directory of the user. An existing arena or index file must be a
            regular file owned by the user and writable by nobody else.
        max_size: the arena's size, fixed at creation (e.g. ``"512MiB"``): the most bytes
            of slots it holds. Reopening an arena keeps its original geometry.
        slot_size: the largest slot, hence the largest storable object: the size of a
            slab, rounded up to a whole number of units (4 KiB, or more for slabs over
            256 KiB: a slab has at most 64 units). Smaller objects take smaller slots (size
            classes). Default: the page size of the host pool registered before the first
            write, else 4 MiB (or the first object's size if larger). Fixed at creation.
        fsync: make every write durable (msync the slot and fsync the index) before it
            becomes visible; without it a write survives a process crash, not a power loss.
        checksum: payload checksum kept in the index: ``"xxh3"`` (default) or ``"none"``
            (no checksum written: the explicit opt-out).
        verify_checksum: verify the checksum of every read that has one. Default (None):
            on with ``checksum="xxh3"``, off with ``"none"``; ``True`` with ``"none"`` is a
            :class:`ConfigError`, ``False`` with ``"xxh3"`` keeps the checksums (for repairs
            after a power loss) without checking reads.
        reuse_delay: seconds an evicted slot rests before it is reused (readers also
            re-check a slot's generation after copying, so this only avoids wasted reads).
        low_free_slots: evict ahead when fewer than this fraction of the slots is free.
        max_concurrency: threads copying the pages of a batch.
        prefault: touch the whole arena at creation so it is resident in the page cache.
    """

    path: str | None = None
    max_size: Size = Size(512 * 2**20)  # noqa: RUF009 - an int constant
    slot_size: Size | None = None
    fsync: bool = False
    checksum: Literal["xxh3", "none"] = "xxh3"
    verify_checksum: bool | None = None
    reuse_delay: float = 0.05
    low_free_slots: float = 0.05
    max_concurrency: int = 2
    prefault: bool = True

    def __post_init__(self) -> None:
        if self.path is not None and not self.path:
            raise ConfigError("path must not be empty")
        if self.path is not None and "\0" in self.path:
            raise ConfigError("path must not contain a NUL byte")
        if self.max_size <= 0:
            raise ConfigError("max_size must be > 0")
        if self.slot_size is not None and self.slot_size <= 0:
            raise ConfigError("slot_size must be > 0")
        if self.reuse_delay < 0:
            raise ConfigError("reuse_delay must be >= 0")
        if not 0 <= self.low_free_slots < 1:
            raise ConfigError("low_free_slots must be in [0, 1)")
        if self.max_concurrency < 1:
            raise ConfigError("max_concurrency must be >= 1")
        if self.verify_checksum and self.checksum == "none":
            raise ConfigError(
                'verify_checksum=true needs checksum="xxh3" (checksum="none" writes none to verify)'
            )

    @property
    def verify(self) -> bool:
        """Whether reads are verified: ``verify_checksum``, by default as ``checksum`` says."""
        if self.verify_checksum is None:
            return self.checksum != "none"
        return self.verify_checksum


# struct flock on 64-bit Linux (l_type, l_whence, start, len, pid)
_FLOCK = struct.Struct("hhqqi4x")


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


DEFAULT_SLOT = 4 * 2**20
# The enums' values as plain ints: they are compared and stored once or twice per page on
# the hot path, where looking an enum member up costs more than the comparison.
_FREE, _WRITING, _COMMITTED, _RETIRED = (
    int(SlotState.FREE),
    int(SlotState.WRITING),
    int(SlotState.COMMITTED),
    int(SlotState.RETIRED),
)
_CAPS = Capabilities(zero_copy=True, delete=True, persistent=True, shared=True)


class MmapBackend(HiCacheStorage):
    """A fixed-capacity slab of page slots in one memory-mapped file, with a crash-safe index."""

    name = "mmap"
    # The class's declaration (what the registry reads); an instance adds the arena's
    # slot size as max_object_bytes once it is known (_refine_capabilities).
    capabilities = _CAPS
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
        self._free_hint: dict[int, list[int]] = {}  # per size class, lowest slot last
        self._log = IndexLog(
            self.index_path, self.options.fsync, self._drop_free_hint, self._on_log_damage
        )
        self._pid = os.getpid()
        self._token = int.from_bytes(secrets.token_bytes(8), "little") or 1
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
                        self._repair_rows(arena)
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

    def _repair_rows(self, arena: Arena) -> None:
        """Make the slot table agree with the log (writer lock held).

        Under the lock a live key's row is always COMMITTED with the key's generation. A
        row that is not may have been reused after the record was written (the record
        that retired it was lost or damaged), restored from an older image, or lost in a
        power failure; only the slot's bytes can tell. The row is rebuilt from the record
        when the record has a checksum, the slot's bytes match it and no live writer
        holds the slot; otherwise the key is dropped (a miss), never served from bytes
        that may be another key's. A key whose slot is not a slot of its size class in the
        slab table (the table lost or rolled back) is dropped too: writers of the slab's
        class could overwrite part of it.
        """
        import numpy as np

        log = self._log
        if not log.by_slot:
            return
        live = self._live_slots()
        table = arena.slots
        lengths = log.lengths[live].astype(np.int64)
        units = np.array(arena.class_of, np.int64)[np.maximum(1, -(-lengths // arena.unit))]
        offset = live % arena.units
        misfit = (
            (arena.slabs[live // arena.units] != units)
            | (offset % units != 0)
            | (offset + units > arena.units)
        )
        bad = live[
            misfit
            | (table["generation"][live] != log.generations[live])
            | (table["state"][live] != _COMMITTED)
        ]
        misfits = set(live[misfit].tolist())
        for slot in bad.tolist():  # rows that disagree with the log: one at a time
            name = log.by_slot[slot]
            entry = log.entry(name)
            assert entry is not None
            row = arena.slots[slot]
            if (
                entry.algorithm
                and slot not in misfits
                and self._slot_lock(arena, entry.slot, take=True)
                and checksum([arena.slot_view(entry.slot, entry.length)], entry.algorithm)
                == entry.checksum
            ):
                row["generation"] = entry.generation
                row["length"] = entry.length
                row["checksum"] = entry.checksum
                row["state"] = _COMMITTED
                row["token"] = 0
                self._slot_lock(arena, entry.slot, take=False)
                self._warn(
                    "repair", "repaired the slot-table row of slot %d of %s", entry.slot, self.path
                )
                continue
            self._slot_lock(arena, entry.slot, take=False)
            self._log.forget(name, entry)
            self._warn(
                "stale",
                "dropped %s: slot %d of %s no longer holds it (or cannot be verified)",
                name,
                entry.slot,
                self.path,
            )

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

    def _slot_lock(self, arena: Arena, slot: int, take: bool) -> bool:
        """Take (or release) this instance's OFD lock on the slot's byte of the arena file.

        Taking fails (returns False) when another open file description holds it: a live
        writer, in any process and any pid namespace. The kernel releases the lock when
        its holder dies.
        """
        kind = fcntl.F_WRLCK if take else fcntl.F_UNLCK
        try:
            fcntl.fcntl(arena.fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, slot, 1, 0))
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):  # held elsewhere
                return False
            raise
        return True

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
        self._free_hint = {}

    # ------------------------------------------------------------------ slot allocator

    def _find(self, name: str) -> Entry | None:
        """The live entry of ``name``, checked against the shared slot table."""
        arena = self._arena
        if arena is None:
            if not os.path.exists(self.path):
                return None
            arena = self._open_arena(DEFAULT_SLOT, lazy=True)
        entry = self._committed(arena, name)
        if entry is None:
            self._log.catch_up()  # another process may have stored it
            entry = self._committed(arena, name)
        return entry

    def _committed(self, arena: Arena, name: str) -> Entry | None:
        """The entry of ``name`` in the index as it is, if its slot still holds it."""
        entry = self._log.entry(name)
        if entry is None:
            return None
        row = arena.slots[entry.slot]
        if int(row["generation"]) != entry.generation or int(row["state"]) != _COMMITTED:
            return None
        return entry

    def _class_slots(self, arena: Arena, units: int) -> Any:
        """The slots of every slab cut into class ``units`` (a numpy array)."""
        import numpy as np

        return arena.slot_rows(np.flatnonzero(arena.slabs == units), units)

    @staticmethod
    def _classes_cut(arena: Arena) -> list[int]:
        """The classes some slab is cut into.

        A damaged entry larger than a slab is none: no slot of it is used, and the slab is
        cut again like an empty one.
        """
        import numpy as np

        counts = np.bincount(np.minimum(arena.slabs, arena.units + 1), minlength=arena.units + 2)
        return [int(u) for u in np.flatnonzero(counts[1 : arena.units + 1]) + 1]

    def _live_slots(self) -> Any:
        """The slots holding live objects (the index as it is: caught up by the caller)."""
        import numpy as np

        by_slot = self._log.by_slot
        return np.fromiter(by_slot, np.int64, len(by_slot))

    def _refill_hint(self, arena: Arena, units: int, _count: int = 0) -> list[int]:
        """Find the reusable slots of class ``units`` (writer lock held, index caught up)."""
        import numpy as np

        slots = self._class_slots(arena, units)
        table = arena.slots
        state = table["state"][slots]
        usable = (state == _FREE) | ((state == _RETIRED) & ~self._resting(arena, slots))
        live = np.zeros(arena.nslots, dtype=bool)
        live[self._live_slots()] = True
        # Orphans: committed in the table but in no record (a crash between the two, or
        # between a CLEAR record and the retirement of its slots), or reserved by a writer
        # that died (its slot lock is gone; _reserve_slots skips those of live writers).
        # They are free slots too: counted in the hint, they keep the eviction ahead
        # from evicting live pages while they last.
        mine = table["token"][slots] == self._token
        orphans = ((state == _COMMITTED) | ((state == _WRITING) & ~mine)) & ~live[slots]
        hint: list[int] = slots[usable | orphans].tolist()
        hint.reverse()  # pop() from the end takes the lowest slot first
        self._free_hint[units] = hint
        return hint

    def _resting(self, arena: Arena, slots: Any) -> Any:
        """Mask of ``slots`` (a numpy array) that are retired and still resting.

        A rest that would end more than ``reuse_delay`` in the future (the clock stepped back)
        is over: it must not keep a slot out of use for as long as the clock is behind.
        """
        now = time.time()
        since = arena.slots["since"][slots]
        return (
            (arena.slots["state"][slots] == _RETIRED)
            & (since > now - self.options.reuse_delay)
            & (since <= now)
        )

    def _held_elsewhere(self, arena: Arena, slot: int) -> bool:
        """True if another open file description (a live writer) holds the slot's lock."""
        got = fcntl.fcntl(
            arena.fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, slot, 1, 0)
        )
        return int(_FLOCK.unpack(got)[0]) != fcntl.F_UNLCK

    def _busy(self, arena: Arena, writing: Any) -> list[int]:
        """Those of the ``writing`` slots (state WRITING) that live writers are filling.

        This instance's, or locked elsewhere; a dead writer's slot is not busy: it is
        reclaimed as an orphan.
        """
        mine = (arena.slots["token"][writing] == self._token).tolist()
        return [
            s
            for s, ours in zip(writing.tolist(), mine, strict=True)
            if ours or self._held_elsewhere(arena, s)
        ]

    def _slab_use(self, arena: Arena, keep: frozenset[int], live: bool) -> tuple[Any, Any, Any]:
        """Per slab (writer lock held, caught up): ``(pinned, resting, live)``.

        ``pinned`` counts its slots that live writers are filling or that are in ``keep``;
        ``resting`` says whether some of its slots still rest; ``live`` (only when asked:
        it costs a pass over the index) whether it holds live objects. One read of the
        state of every slot; the other columns only for the few writing or retired ones.
        """
        import numpy as np

        n = arena.nslabs
        taken, retired = [], []
        for units in self._classes_cut(arena):
            slots = self._class_slots(arena, units)
            state = arena.slots["state"][slots]
            taken += self._busy(arena, slots[state == _WRITING])
            old = slots[state == _RETIRED]
            retired.append(old[self._resting(arena, old)])
        taken += list(keep)
        pinned = np.bincount(np.array(taken, np.int64) // arena.units, minlength=n)
        resting = np.zeros(n, dtype=bool)
        if retired:
            resting[np.concatenate(retired) // arena.units] = True
        held = np.zeros(n, dtype=bool)
        if live:
            held[self._live_slots() // arena.units] = True
        return pinned, resting, held

    def _claim_slabs(self, arena: Arena, units: int, count: int) -> list[int]:
        """Cut empty slabs into class ``units`` for ``count`` more objects (writer lock held).

        Slabs never used come first (an eighth of those left at least, so that a class
        that grows claims them in a few rounds, not one per batch), then slabs of other
        classes that hold nothing (no live object, no slot being written or resting).
        Returns the hint of the new slots.
        """
        import numpy as np

        need = -(-count // (arena.units // units))
        unused = np.flatnonzero(arena.slabs == 0)
        chosen = unused[: max(need, len(unused) // 8)].tolist()
        if len(chosen) < need and ((arena.slabs != 0) & (arena.slabs != units)).any():
            pinned, resting, live = self._slab_use(arena, frozenset(), live=True)
            empty = (arena.slabs != 0) & (arena.slabs != units) & (pinned == 0) & ~resting & ~live
            chosen += np.flatnonzero(empty)[: need - len(chosen)].tolist()
        if chosen:
            self._cut(arena, np.array(chosen, np.int64), units)
        hint: list[int] = arena.slot_rows(np.array(chosen, np.int64), units).tolist()
        hint.reverse()
        self._free_hint[units] = hint
        return hint

    def _cut(self, arena: Arena, slabs: Any, units: int) -> None:
        """Cut empty slabs (a numpy array) into slots of class ``units`` (writer lock held).

        Every row of the slabs becomes free with a new generation first (a reader still
        copying out of an old slot there sees the change), then the slab table says the
        new class. A writer killed in between leaves a slab in its old class, with free
        slots.
        """
        import numpy as np

        table = arena.slots
        rows = np.add.outer(slabs * arena.units, np.arange(arena.units)).ravel()
        table["generation"][rows] = new_generations(table["generation"][rows])
        table["state"][rows] = _FREE
        table["token"][rows] = 0
        table["since"][rows] = 0.0
        low, high = int(slabs.min()), int(slabs.max()) + 1
        if self.options.fsync:
            arena.flush_row(low * arena.units, (high - low) * arena.units)
        arena.slabs[slabs] = units
        if self.options.fsync:
            arena.flush_slab(low, high - low)

    def _reserve_slots(
        self, arena: Arena, units: int, count: int, keep: frozenset[int] = frozenset()
    ) -> list[tuple[int, int]]:
        """Up to ``count`` free slots of class ``units``, as ``(slot, new generation)``.

        Writer lock held. Free slots of the class come first, then empty slabs cut into
        the class; fewer (maybe none) when no more are usable now: the caller decides what
        to evict. The candidates are checked, and the rows of the slots taken written, for
        the whole batch at once.
        """
        import numpy as np

        table = arena.slots
        by_slot = self._log.by_slot
        delay = self.options.reuse_delay
        taken: list[int] = []
        chosen: set[int] = set()
        hint = self._free_hint.setdefault(units, [])
        more = iter((self._refill_hint, self._claim_slabs))
        while len(taken) < count:
            if not hint:
                step = next(more, None)
                if step is None:
                    break
                hint = step(arena, units, count - len(taken))
                continue
            need = count - len(taken)
            candidates = hint[-need:]
            del hint[-need:]
            candidates.reverse()  # the hint is used from its end: lowest slots first
            idx = np.array(candidates, np.int64)
            state = table["state"][idx]
            since = table["since"][idx]
            now = time.time()
            skip = (
                ((state == _RETIRED) & (since > now - delay) & (since <= now))
                | ((state == _WRITING) & (table["token"][idx] == self._token))  # ours, in flight
                # no longer a slot of this class: its slab was cut again (by another process)
                | (arena.slabs[idx // arena.units] != units)
                | (idx % arena.units % units != 0)
                | (idx % arena.units + units > arena.units)
            )
            for slot, skipped in zip(candidates, skip.tolist(), strict=True):
                # (taken: a refill of the hint finds this batch's slots free again, as
                # their rows are written at the end)
                if skipped or slot in by_slot or slot in chosen:
                    continue
                if not self._slot_lock(arena, slot, take=True):
                    continue  # a live writer elsewhere holds it
                taken.append(slot)
                chosen.add(slot)
        if not taken:
            return []
        idx = np.array(taken, np.int64)
        gens = new_generations(table["generation"][idx])
        table["generation"][idx] = gens  # first: the slot's old generation is dead now
        table["state"][idx] = _WRITING
        table["pid"][idx] = self._pid
        table["token"][idx] = self._token
        table["since"][idx] = time.time()
        per = arena.units // units
        unused = int((arena.slabs == 0).sum()) * per  # slabs never used: free for any class
        total = int((arena.slabs == units).sum()) * per + unused
        low = self.options.low_free_slots * total
        if len(hint) + unused + 1 < low:  # as if checked after taking the last one
            # Evict ahead, so the slots have rested by the time they are needed.
            states = table["state"][self._class_slots(arena, units)]
            if int(((states == _FREE) | (states == _RETIRED)).sum()) + unused < low:
                try:
                    self._evict_for(arena, units, max(1, total // 20), keep)
                except BaseException:
                    # The slots just taken are not the caller's yet: give them back here.
                    self._give_back(arena, dict(enumerate(zip(taken, gens.tolist(), strict=True))))
                    raise
        return list(zip(taken, gens.tolist(), strict=True))

    def _evict_for(
        self, arena: Arena, units: int, count: int, keep: frozenset[int] = frozenset()
    ) -> None:
        """Make room for ``count`` objects of class ``units``: evict the least recently used.

        The candidates are the objects of that class, a slot each, and whole slabs of
        other classes, ranked by their most recently used object (a slab evicted is cut
        into the class once its slots have rested). Slots in ``keep`` are spared, and so
        are the slabs that hold one or a slot being written.
        """
        import numpy as np

        log = self._log
        if count <= 0 or not log.by_slot:
            return
        live = self._live_slots()
        if keep:
            live = live[~np.isin(live, np.fromiter(keep, np.int64, len(keep)))]
        access = arena.slots["last_access"][live]
        slab = live // arena.units
        own = arena.slabs[slab] == units
        order = np.argsort(access[own], kind="stable")
        objects, object_times = live[own][order], access[own][order]
        others = np.unique(slab[~own])
        newest = np.full(arena.nslabs, -np.inf)
        if others.size:
            np.maximum.at(newest, slab[~own], access[~own])
            pinned = self._slab_use(arena, keep, live=False)[0]
            others = others[pinned[others] == 0]
            others = others[np.argsort(newest[others], kind="stable")]
        per = arena.units // units
        n_objects, got = 0, 0
        slabs: list[int] = []
        while got < count and (n_objects < len(objects) or len(slabs) < len(others)):
            if len(slabs) == len(others) or (
                n_objects < len(objects) and object_times[n_objects] <= newest[others[len(slabs)]]
            ):
                n_objects += 1
                got += 1
            else:
                slabs.append(int(others[len(slabs)]))
                got += per
        victims = objects[:n_objects].tolist()
        if slabs:
            victims += live[~own][np.isin(slab[~own], slabs)].tolist()
        if not victims:
            return
        records: list[Record] = []
        for s in victims:
            entry = log.entry(log.by_slot[s])
            assert entry is not None
            records.append((RecordKind.DEL, log.by_slot[s], entry))
        log.append(records)  # logged first: a crash here leaves them deleted, never half
        self._retire(arena, victims)
        self._record(evictions=len(victims))

    @staticmethod
    def _retire(arena: Arena, slots: list[int]) -> None:
        """Retire slots: new generations, resting from now (one vectorized pass)."""
        import numpy as np

        if not len(slots):
            return
        now = time.time()

        idx = np.asarray(slots, dtype=np.int64)
        old = arena.slots["generation"][idx]
        gens = new_generations(old)
        # The generation first: a reader re-checking it after its copy sees the change.
        arena.slots["generation"][idx] = gens
        arena.slots["state"][idx] = _RETIRED
        arena.slots["since"][idx] = now

    def _still_mine(self, arena: Arena, slot: int, gen: int) -> bool:
        row = arena.slots[slot]
        return (
            int(row["generation"]) == gen
            and int(row["state"]) == _WRITING
            and int(row["token"]) == self._token
        )

    def _release(self, arena: Arena, reserved: dict[int, tuple[int, int]]) -> None:
        """Give back reserved slots that were not committed (after a failed batch).

        Under the writer lock: between marking a slot free and dropping its slot lock,
        another thread of this instance could reserve it and take the same lock (slot
        locks do not tell threads of one open file apart); its lock would then be
        dropped, and another process could take the slot from under its copy. If the
        writer lock cannot be had, the slots stay reserved until the process exits.
        """
        if not reserved:
            return
        try:
            with self._writer_lock(arena):
                self._give_back(arena, reserved)
        except BackendError as exc:
            self._warn("release", "could not give back %d slots: %s", len(reserved), exc)

    def _give_back(self, arena: Arena, reserved: dict[int, tuple[int, int]]) -> None:
        """Free the reserved slots still ours, and drop their slot locks (writer lock held)."""
        for slot, gen in reserved.values():
            if self._still_mine(arena, slot, gen):
                arena.slots[slot]["state"] = _FREE
                self._slot_lock(arena, slot, take=False)

    # ------------------------------------------------------------------ write pipeline

    def _reserve_all(
        self,
        arena: Arena,
        names: list[str],
        pending: list[int],
        results: list[bool],
        units: list[int],
    ) -> dict[int, tuple[int, int]]:
        """Reserve a slot per pending item (distinct names); items already stored count as done.

        ``units[i]`` is the size class of item ``i``. A batch never takes more slots than
        the arena can give it (all slots but those live writers are filling, and those of
        keys it found stored): when free slots run short, the items beyond that fail at
        once (the leading ones are stored, as the engine reads leading runs), and only as
        many pages are evicted as the batch will use.
        """
        slots: dict[int, tuple[int, int]] = {}
        deadline = time.monotonic() + max(5.0, 20 * self.options.reuse_delay)
        first = True
        keep: set[int] = set()
        try:
            while pending:
                with self._writer_lock():
                    self._log.catch_up()
                    waiting = []
                    for i in pending:
                        entry = self._committed(arena, names[i])  # caught up just above
                        if entry is not None:
                            results[i] = True  # stored already
                            arena.slots[entry.slot]["last_access"] = time.time()
                            keep.add(entry.slot)
                            continue
                        waiting.append(i)
                    by_class: dict[int, list[int]] = {}
                    for i in waiting:
                        by_class.setdefault(units[i], []).append(i)
                    for cls, items in by_class.items():
                        got = self._reserve_slots(arena, cls, len(items), frozenset(keep))
                        slots.update(zip(items, got, strict=False))
                    pending = [i for i in waiting if i not in slots]
                    if pending and first:
                        # Short of free slots: does the batch fit at all? The items beyond
                        # what it can hold fail now (and give their slots back).
                        ours = [s for s, _ in slots.values()]
                        room = self._room(arena, [units[i] for i in waiting], keep, ours)
                        if len(waiting) > room:
                            refused = waiting[room:]
                            self._give_back(arena, {i: slots.pop(i) for i in refused if i in slots})
                            pending = [i for i in waiting[:room] if i not in slots]
                            self._add_item_errors(len(refused))
                            self._log_failure(
                                "batch_set",
                                CapacityError(
                                    f"{len(refused)} of {len(names)} objects refused: the "
                                    f"arena has room for {room} (the slots other writers are "
                                    "filling and those of keys found stored excluded)"
                                ),
                            )
                    first = False
                    mine = frozenset(keep | {s for s, _ in slots.values()})
                    for cls in dict.fromkeys(units[i] for i in pending):
                        # Evict what this batch will use, beyond the slots resting already
                        # and those whose rest ended since the hint was filled (the next
                        # round takes them).
                        need = sum(units[i] == cls for i in pending)
                        self._evict_for(arena, cls, need - self._spare(arena, cls), mine)
                if pending:
                    if time.monotonic() > deadline:
                        raise CapacityError("no slot became free in time (all busy or resting)")
                    time.sleep(max(0.001, self.options.reuse_delay / 5))
        except BaseException:
            self._release(arena, slots)
            raise
        return slots

    def _room(self, arena: Arena, units: list[int], keep: set[int], ours: list[int]) -> int:
        """How many leading items of these classes the arena can hold at once (lock held).

        Every slot counts but those live writers other than this batch (its slots:
        ``ours``) are filling and those in ``keep``; a slab of a class the batch does not
        use counts as cut into the class that needs it, unless one of its slots is pinned.
        """
        import numpy as np

        pinned = self._slab_use(arena, frozenset(keep), live=False)[0]
        if ours:
            np.subtract.at(pinned, np.array(ours, np.int64) // arena.units, 1)
        classes = arena.slabs
        wanted = set(units)
        room = {
            u: int((classes == u).sum()) * (arena.units // u) - int(pinned[classes == u].sum())
            for u in wanted
        }
        spare = int(((classes == 0) | (~np.isin(classes, list(wanted)) & (pinned == 0))).sum())
        for n, u in enumerate(units):
            if room[u] <= 0:
                if not spare:
                    return n
                spare -= 1
                room[u] += arena.units // u
            room[u] -= 1
        return len(units)

    def _spare(self, arena: Arena, units: int) -> int:
        """Slots of class ``units`` that will be free without evicting more (lock held).

        Resting slots of the class, those whose rest has just ended, and the slots of the
        slabs of other classes that will be empty once theirs have rested.
        """
        slots = self._class_slots(arena, units)
        state = arena.slots["state"][slots]
        resting = self._resting(arena, slots)
        usable = (state == _FREE) | ((state == _RETIRED) & ~resting)
        spare = int(resting.sum()) + int(usable.sum())
        if ((arena.slabs != 0) & (arena.slabs != units)).any():
            pinned, slab_resting, live = self._slab_use(arena, frozenset(), live=True)
            soon = (arena.slabs != units) & (pinned == 0) & slab_resting & ~live
            spare += int(soon.sum()) * (arena.units // units)
        return spare

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
        names = [self.object_path(key) for key, _, _ in items]
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
        slots = self._reserve_all(arena, names, pending, results, units)
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
                records = self._commit_rows(arena, order, slots, names, sizes, sums, results)
                if records:
                    self._log.append(records)
                for slot, _ in slots.values():
                    self._slot_lock(arena, slot, take=False)
        except BaseException:
            self._release(arena, slots)
            raise
        self._record(bytes_written=sum(sizes[i] for i in order if results[i]))
        for i, name in enumerate(names):
            j = first_of.get(name)
            if fits[i] and j is not None and j != i:
                results[i] = results[j]
        return results

    def _commit_rows(
        self,
        arena: Arena,
        order: list[int],
        slots: dict[int, tuple[int, int]],
        names: list[str],
        sizes: list[int],
        sums: list[int],
        results: list[bool],
    ) -> list[Record]:
        """Mark the copied slots committed (writer lock held, caught up); their PUT records.

        Only slots still reserved by this instance are committed (checked for the whole
        batch at once); a key another process stored meanwhile keeps that one (it won),
        and this slot is given back.
        """
        import numpy as np

        table = arena.slots
        idx = np.array([slots[i][0] for i in order], np.int64)
        expected = np.array([slots[i][1] for i in order], np.uint64)
        mine = (
            (table["generation"][idx] == expected)
            & (table["state"][idx] == _WRITING)
            & (table["token"][idx] == self._token)
        ).tolist()
        index = self._log.index
        records: list[Record] = []
        done: list[int] = []
        for k, (i, csum) in enumerate(zip(order, sums, strict=True)):
            slot, gen = slots[i]
            if not mine[k]:
                self._warn(
                    "taken", "slot %d of %s was taken during a write; dropped", slot, self.path
                )
                continue
            results[i] = True
            if names[i] in index:
                table["state"][slot] = _FREE  # another process stored the key meanwhile
                continue
            done.append(k)
            records.append(
                (RecordKind.PUT, names[i], Entry(slot, gen, sizes[i], csum, self._algorithm))
            )
        if done:
            rows = idx[done]
            table["length"][rows] = [sizes[order[k]] for k in done]
            table["checksum"][rows] = np.array([sums[k] for k in done], np.uint64)
            table["last_access"][rows] = time.time()
            table["state"][rows] = _COMMITTED  # last: the row is whole when it says so
            if self.options.fsync:
                for slot in rows.tolist():
                    arena.flush_row(slot)
        return records

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
        if int(row["generation"]) != entry.generation or int(row["state"]) != _COMMITTED:
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
                    self._retire(arena, [entry.slot])
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
            start = self._leading_committed(keys)
            # From the first key the in-memory index does not vouch for: _find, which
            # catches up with other processes' log records (and so may find it after all).
            for i in range(start, len(keys)):
                if self._find(self.object_path(keys[i])) is None:
                    return i
            return len(keys)

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
        slots: list[int] = []
        gens_: list[int] = []
        for path in self.object_namer().paths(keys):
            found = get(path)
            if found is None:
                break
            slots.append(found & 0xFFFFFFFF)  # index_log.unpack, inline on the hot path
            gens_.append(found >> 32)
        if not slots:
            return 0
        n = len(slots)
        rows = arena.slots[np.array(slots, np.int64)]
        gens = np.array(gens_, np.uint64)
        bad = np.flatnonzero((rows["generation"] != gens) | (rows["state"] != _COMMITTED))
        return n if bad.size == 0 else int(bad[0])

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
                self._retire(arena, [entry.slot])
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
                    self._retire(arena, self._log.dropped)
                    self._log.dropped = []

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
        log = self._log
        log.arena = None
        if log._fd >= 0:
            os.close(log._fd)
            log._fd = -1

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
    def usage(self) -> dict[str, int]:
        """The protocol's figures for the whole arena (every namespace in it), and its slots.

        ``used_bytes`` are the live objects' payloads; ``limit_bytes`` the bytes of its
        slabs. Extra keys: ``slabs``, ``slot_size`` (a slab's bytes: the largest slot),
        ``unit`` (the smallest slot). Before the arena exists (no write yet): zeros, and
        ``limit_bytes`` is ``max_size``.
        """
        arena = self._arena
        if arena is None:
            return {
                "objects": 0,
                "used_bytes": 0,
                "limit_bytes": int(self.options.max_size),
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
        return {
            "objects": objects,
            "used_bytes": used,
            "limit_bytes": arena.nslabs * arena.slab_size,
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
