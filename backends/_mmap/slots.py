"""The slot table's bookkeeping for the ``mmap`` backend: which slot holds what, and who may take it.

:class:`Slots` reserves slots for a batch (free slots of a size class first, then orphans
of dead writers, then slabs cut into the class), evicts the least recently used objects
within and across classes, retires slots (a new generation, then a rest before reuse),
commits the rows of copied slots, and repairs rows that disagree with the index log when
the arena is opened. Every step runs under the backend's writer lock (one writer in all
processes), with the index caught up; a slot being written is also held by an OFD byte
lock on the arena file, which the kernel drops when its writer dies.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
import time
from typing import TYPE_CHECKING, Any

from hicache_storage.backends._mmap.arena import SlotState, new_generations
from hicache_storage.backends._mmap.log_format import Entry, RecordKind
from hicache_storage.errors import BackendError, CapacityError
from hicache_storage.storekit.header import checksum

if TYPE_CHECKING:
    from collections.abc import Callable
    from contextlib import AbstractContextManager

    from hicache_storage.backends._mmap.arena import Arena
    from hicache_storage.backends._mmap.index_log import IndexLog
    from hicache_storage.backends._mmap.log_format import Record
    from hicache_storage.backends._mmap.options import MmapOptions

__all__ = ["COMMITTED", "FREE", "RETIRED", "WRITING", "Slots"]

# struct flock on 64-bit Linux (l_type, l_whence, start, len, pid)
_FLOCK = struct.Struct("hhqqi4x")
# The enums' values as plain ints: they are compared and stored once or twice per page on
# the hot path, where looking an enum member up costs more than the comparison.
FREE, WRITING, COMMITTED, RETIRED = (
    int(SlotState.FREE),
    int(SlotState.WRITING),
    int(SlotState.COMMITTED),
    int(SlotState.RETIRED),
)


class Slots:
    """The slot table of one backend instance's arena: reservation, eviction, commits, repair.

    ``token`` tells this instance's reservations from other processes' (the table's
    ``token`` column); ``writer_lock(arena)`` is the backend's writer lock; ``warn`` a
    rate-limited warning; ``on_evict(names)`` counts evictions; ``refuse(n, error)`` reports
    the items of a batch that cannot fit.
    """

    def __init__(
        self,
        *,
        log: IndexLog,
        options: MmapOptions,
        path: str,
        algorithm: int,
        pid: int,
        token: int,
        writer_lock: Callable[[Arena], AbstractContextManager[None]],
        warn: Callable[..., None],
        on_evict: Callable[[list[str]], None],
        refuse: Callable[[int, Exception], None],
    ) -> None:
        self.log, self.options, self.path, self.algorithm = log, options, path, algorithm
        self.pid, self.token = pid, token
        self.free_hint: dict[int, list[int]] = {}  # per size class, lowest slot last
        self._writer_lock, self._warn = writer_lock, warn
        self._on_evict, self._refuse = on_evict, refuse
        #: Bytes of this instance's batches past the quota check, not committed yet.
        self.quota_in_flight = 0
        self._quota_lock = threading.Lock()

    def slot_lock(self, arena: Arena, slot: int, take: bool) -> bool:
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

    def held_elsewhere(self, arena: Arena, slot: int) -> bool:
        """True if another open file description (a live writer) holds the slot's lock."""
        got = fcntl.fcntl(
            arena.fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, slot, 1, 0)
        )
        return int(_FLOCK.unpack(got)[0]) != fcntl.F_UNLCK

    def committed(self, arena: Arena, name: str) -> Entry | None:
        """The entry of ``name`` in the index as it is, if its slot still holds it."""
        entry = self.log.entry(name)
        if entry is None:
            return None
        row = arena.slots[entry.slot]
        if int(row["generation"]) != entry.generation or int(row["state"]) != COMMITTED:
            return None
        return entry

    def repair(self, arena: Arena) -> None:
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

        log = self.log
        if not log.by_slot:
            return
        live = self.live_slots()
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
            | (table["state"][live] != COMMITTED)
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
                and self.slot_lock(arena, entry.slot, take=True)
                and checksum([arena.slot_view(entry.slot, entry.length)], entry.algorithm)
                == entry.checksum
            ):
                row["generation"] = entry.generation
                row["length"] = entry.length
                row["checksum"] = entry.checksum
                row["state"] = COMMITTED
                row["token"] = 0
                self.slot_lock(arena, entry.slot, take=False)
                self._warn(
                    "repair", "repaired the slot-table row of slot %d of %s", entry.slot, self.path
                )
                continue
            self.slot_lock(arena, entry.slot, take=False)
            self.log.forget(name, entry)
            self._warn(
                "stale",
                "dropped %s: slot %d of %s no longer holds it (or cannot be verified)",
                name,
                entry.slot,
                self.path,
            )

    def reserve_batch(
        self,
        arena: Arena,
        names: list[str],
        pending: list[int],
        results: list[bool],
        units: list[int],
        sizes: list[int] | None = None,
        held: list[int] | None = None,
    ) -> dict[int, tuple[int, int]]:
        """Reserve a slot per pending item (distinct names); items already stored count as done.

        ``units[i]`` is the size class of item ``i``. A batch never takes more slots than
        the arena can give it (all slots but those live writers are filling, and those of
        keys it found stored): when free slots run short, the items beyond that fail at
        once (the leading ones are stored, as the engine reads leading runs), and only as
        many pages are evicted as the batch will use. With a namespace quota
        (``sizes`` given), the namespace's own oldest objects are evicted first to keep it
        under its quota, and items beyond the quota itself fail; the bytes the batch will
        add are then in flight (:attr:`quota_in_flight`) until :meth:`quota_landed` with
        ``held[0]``, which is set to them.
        """
        slots: dict[int, tuple[int, int]] = {}
        deadline = time.monotonic() + max(5.0, 20 * self.options.reuse_delay)
        first = True
        keep: set[int] = set()
        try:
            while pending:
                with self._writer_lock(arena):
                    self.log.catch_up()
                    waiting = []
                    for i in pending:
                        entry = self.committed(arena, names[i])  # caught up just above
                        if entry is not None:
                            results[i] = True  # stored already
                            arena.slots[entry.slot]["last_access"] = time.time()
                            keep.add(entry.slot)
                            continue
                        waiting.append(i)
                    if first and sizes is not None and self.options.namespace_max_size:
                        waiting = self._keep_quota(arena, waiting, sizes, names, frozenset(keep))
                        pending = waiting
                        if held is not None:
                            held[0] = sum(sizes[i] for i in waiting)
                            with self._quota_lock:
                                self.quota_in_flight += held[0]
                    by_class: dict[int, list[int]] = {}
                    for i in waiting:
                        by_class.setdefault(units[i], []).append(i)
                    for cls, items in by_class.items():
                        got = self.reserve(arena, cls, len(items), frozenset(keep))
                        slots.update(zip(items, got, strict=False))
                    pending = [i for i in waiting if i not in slots]
                    if pending and first:
                        # Short of free slots: does the batch fit at all? The items beyond
                        # what it can hold fail now (and give their slots back).
                        ours = [s for s, _ in slots.values()]
                        room = self.room(arena, [units[i] for i in waiting], keep, ours)
                        if len(waiting) > room:
                            refused = waiting[room:]
                            self.give_back(arena, {i: slots.pop(i) for i in refused if i in slots})
                            pending = [i for i in waiting[:room] if i not in slots]
                            self._refuse(
                                len(refused),
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
                        self.evict_for(arena, cls, need - self.spare(arena, cls), mine)
                if pending:
                    if time.monotonic() > deadline:
                        raise CapacityError("no slot became free in time (all busy or resting)")
                    time.sleep(max(0.001, self.options.reuse_delay / 5))
        except BaseException:
            self.release(arena, slots)
            raise
        return slots

    def room(self, arena: Arena, units: list[int], keep: set[int], ours: list[int]) -> int:
        """How many leading items of these classes the arena can hold at once (lock held).

        Every slot counts but those live writers other than this batch (its slots:
        ``ours``) are filling and those in ``keep``; a slab of a class the batch does not
        use counts as cut into the class that needs it, unless one of its slots is pinned.
        """
        import numpy as np

        pinned = self.slab_use(arena, frozenset(keep), live=False)[0]
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

    def spare(self, arena: Arena, units: int) -> int:
        """Slots of class ``units`` that will be free without evicting more (lock held).

        Resting slots of the class, those whose rest has just ended, and the slots of the
        slabs of other classes that will be empty once theirs have rested.
        """
        slots = self.class_slots(arena, units)
        state = arena.slots["state"][slots]
        resting = self.resting(arena, slots)
        usable = (state == FREE) | ((state == RETIRED) & ~resting)
        spare = int(resting.sum()) + int(usable.sum())
        if ((arena.slabs != 0) & (arena.slabs != units)).any():
            pinned, slab_resting, live = self.slab_use(arena, frozenset(), live=True)
            soon = (arena.slabs != units) & (pinned == 0) & slab_resting & ~live
            spare += int(soon.sum()) * (arena.units // units)
        return spare

    def reserve(
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
        by_slot = self.log.by_slot
        delay = self.options.reuse_delay
        taken: list[int] = []
        chosen: set[int] = set()
        hint = self.free_hint.setdefault(units, [])
        more = iter((self.refill_hint, self.claim_slabs))
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
                ((state == RETIRED) & (since > now - delay) & (since <= now))
                | ((state == WRITING) & (table["token"][idx] == self.token))  # ours, in flight
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
                if not self.slot_lock(arena, slot, take=True):
                    continue  # a live writer elsewhere holds it
                taken.append(slot)
                chosen.add(slot)
        if not taken:
            return []
        idx = np.array(taken, np.int64)
        gens = new_generations(table["generation"][idx])
        table["generation"][idx] = gens  # first: the slot's old generation is dead now
        table["state"][idx] = WRITING
        table["pid"][idx] = self.pid
        table["token"][idx] = self.token
        table["since"][idx] = time.time()
        per = arena.units // units
        unused = int((arena.slabs == 0).sum()) * per  # slabs never used: free for any class
        total = int((arena.slabs == units).sum()) * per + unused
        low = self.options.low_free_slots * total
        if len(hint) + unused + 1 < low:  # as if checked after taking the last one
            # Evict ahead, so the slots have rested by the time they are needed.
            states = table["state"][self.class_slots(arena, units)]
            if int(((states == FREE) | (states == RETIRED)).sum()) + unused < low:
                try:
                    self.evict_for(arena, units, max(1, total // 20), keep)
                except BaseException:
                    # The slots just taken are not the caller's yet: give them back here.
                    self.give_back(arena, dict(enumerate(zip(taken, gens.tolist(), strict=True))))
                    raise
        return list(zip(taken, gens.tolist(), strict=True))

    def refill_hint(self, arena: Arena, units: int, _count: int = 0) -> list[int]:
        """Find the reusable slots of class ``units`` (writer lock held, index caught up)."""
        import numpy as np

        slots = self.class_slots(arena, units)
        table = arena.slots
        state = table["state"][slots]
        usable = (state == FREE) | ((state == RETIRED) & ~self.resting(arena, slots))
        live = np.zeros(arena.nslots, dtype=bool)
        live[self.live_slots()] = True
        # Orphans: committed in the table but in no record (a crash between the two, or
        # between a CLEAR record and the retirement of its slots), or reserved by a writer
        # that died (its slot lock is gone; _reserve_slots skips those of live writers).
        # They are free slots too: counted in the hint, they keep the eviction ahead
        # from evicting live pages while they last.
        mine = table["token"][slots] == self.token
        orphans = ((state == COMMITTED) | ((state == WRITING) & ~mine)) & ~live[slots]
        hint: list[int] = slots[usable | orphans].tolist()
        hint.reverse()  # pop() from the end takes the lowest slot first
        self.free_hint[units] = hint
        return hint

    def claim_slabs(self, arena: Arena, units: int, count: int) -> list[int]:
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
            pinned, resting, live = self.slab_use(arena, frozenset(), live=True)
            empty = (arena.slabs != 0) & (arena.slabs != units) & (pinned == 0) & ~resting & ~live
            chosen += np.flatnonzero(empty)[: need - len(chosen)].tolist()
        if chosen:
            self.cut(arena, np.array(chosen, np.int64), units)
        hint: list[int] = arena.slot_rows(np.array(chosen, np.int64), units).tolist()
        hint.reverse()
        self.free_hint[units] = hint
        return hint

    def cut(self, arena: Arena, slabs: Any, units: int) -> None:
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
        table["state"][rows] = FREE
        table["token"][rows] = 0
        table["since"][rows] = 0.0
        low, high = int(slabs.min()), int(slabs.max()) + 1
        if self.options.fsync:
            arena.flush_row(low * arena.units, (high - low) * arena.units)
        arena.slabs[slabs] = units
        if self.options.fsync:
            arena.flush_slab(low, high - low)

    def class_slots(self, arena: Arena, units: int) -> Any:
        """The slots of every slab cut into class ``units`` (a numpy array)."""
        import numpy as np

        return arena.slot_rows(np.flatnonzero(arena.slabs == units), units)

    @staticmethod
    def classes_cut(arena: Arena) -> list[int]:
        """The classes some slab is cut into.

        A damaged entry larger than a slab is none: no slot of it is used, and the slab is
        cut again like an empty one.
        """
        import numpy as np

        counts = np.bincount(np.minimum(arena.slabs, arena.units + 1), minlength=arena.units + 2)
        return [int(u) for u in np.flatnonzero(counts[1 : arena.units + 1]) + 1]

    def live_slots(self) -> Any:
        """The slots holding live objects (the index as it is: caught up by the caller)."""
        import numpy as np

        by_slot = self.log.by_slot
        return np.fromiter(by_slot, np.int64, len(by_slot))

    def resting(self, arena: Arena, slots: Any) -> Any:
        """Mask of ``slots`` (a numpy array) that are retired and still resting.

        A rest that would end more than ``reuse_delay`` in the future (the clock stepped back)
        is over: it must not keep a slot out of use for as long as the clock is behind.
        """
        now = time.time()
        since = arena.slots["since"][slots]
        return (
            (arena.slots["state"][slots] == RETIRED)
            & (since > now - self.options.reuse_delay)
            & (since <= now)
        )

    def busy(self, arena: Arena, writing: Any) -> list[int]:
        """Those of the ``writing`` slots (state WRITING) that live writers are filling.

        This instance's, or locked elsewhere; a dead writer's slot is not busy: it is
        reclaimed as an orphan.
        """
        mine = (arena.slots["token"][writing] == self.token).tolist()
        return [
            s
            for s, ours in zip(writing.tolist(), mine, strict=True)
            if ours or self.held_elsewhere(arena, s)
        ]

    def slab_use(self, arena: Arena, keep: frozenset[int], live: bool) -> tuple[Any, Any, Any]:
        """Per slab (writer lock held, caught up): ``(pinned, resting, live)``.

        ``pinned`` counts its slots that live writers are filling or that are in ``keep``;
        ``resting`` says whether some of its slots still rest; ``live`` (only when asked:
        it costs a pass over the index) whether it holds live objects. One read of the
        state of every slot; the other columns only for the few writing or retired ones.
        """
        import numpy as np

        n = arena.nslabs
        taken, retired = [], []
        for units in self.classes_cut(arena):
            slots = self.class_slots(arena, units)
            state = arena.slots["state"][slots]
            taken += self.busy(arena, slots[state == WRITING])
            old = slots[state == RETIRED]
            retired.append(old[self.resting(arena, old)])
        taken += list(keep)
        pinned = np.bincount(np.array(taken, np.int64) // arena.units, minlength=n)
        resting = np.zeros(n, dtype=bool)
        if retired:
            resting[np.concatenate(retired) // arena.units] = True
        held = np.zeros(n, dtype=bool)
        if live:
            held[self.live_slots() // arena.units] = True
        return pinned, resting, held

    def evict_for(
        self, arena: Arena, units: int, count: int, keep: frozenset[int] = frozenset()
    ) -> None:
        """Make room for ``count`` objects of class ``units``: evict the least recently used.

        The candidates are the objects of that class, a slot each, and whole slabs of
        other classes, ranked by their most recently used object (a slab evicted is cut
        into the class once its slots have rested). Slots in ``keep`` are spared, and so
        are the slabs that hold one or a slot being written.
        """
        import numpy as np

        log = self.log
        if count <= 0 or not log.by_slot:
            return
        live = self.live_slots()
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
            pinned = self.slab_use(arena, keep, live=False)[0]
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
        self._evict_slots(arena, log, victims)

    def _keep_quota(
        self,
        arena: Arena,
        waiting: list[int],
        sizes: list[int],
        names: list[str],
        keep: frozenset[int],
    ) -> list[int]:
        """Keep this namespace under ``namespace_max_size`` for the items ``waiting``.

        The writer lock is held. Items past the quota itself fail (the leading ones are
        stored); then, if the namespace's bytes and the rest would cross the quota, its
        least-recently-used objects are evicted down to nine tenths of it (so that not
        every write scans). Returns the items still to store.
        """
        import numpy as np

        quota = int(self.options.namespace_max_size or 0)
        log = self.log
        # This process's writes in flight hold their room (they cannot be evicted).
        room = quota - self.quota_in_flight
        fit, total = [], 0
        for i in waiting:
            if total + sizes[i] > room:
                break
            fit.append(i)
            total += sizes[i]
        if len(fit) < len(waiting):
            self._refuse(
                len(waiting) - len(fit),
                CapacityError(
                    f"{len(waiting) - len(fit)} of {len(names)} objects refused: past the "
                    f"namespace quota (namespace_max_size {quota} bytes, of which "
                    f"{quota - room} held by this process's writes in flight)"
                ),
            )
        now = log.prefix_bytes + self.quota_in_flight  # (this process's writes count too)
        if now + total <= quota or log.quota_prefix is None:
            return fit
        need = now + total - int(quota * 0.9)
        prefix = log.quota_prefix
        mine = np.fromiter(
            (s for s, n in log.by_slot.items() if n.startswith(prefix) and s not in keep),
            np.int64,
        )
        if mine.size:
            order = np.argsort(arena.slots["last_access"][mine], kind="stable")
            mine = mine[order]
            upto = int(np.searchsorted(np.cumsum(log.lengths[mine].astype(np.int64)), need)) + 1
            self._evict_slots(arena, log, mine[:upto].tolist())
        return fit

    def _evict_slots(self, arena: Arena, log: IndexLog, victims: list[int]) -> None:
        """Delete the objects in slots ``victims``: DEL records, then retire the slots."""
        records: list[Record] = []
        for s in victims:
            entry = log.entry(log.by_slot[s])
            assert entry is not None
            records.append((RecordKind.DEL, log.by_slot[s], entry))
        log.append(records)  # logged first: a crash here leaves them deleted, never half
        self.retire(arena, victims)
        self._on_evict([name for _, name, _ in records])

    def quota_landed(self, nbytes: int) -> None:
        """A batch's bytes in flight were committed (the index counts them) or dropped."""
        if nbytes:
            with self._quota_lock:
                self.quota_in_flight -= nbytes

    @staticmethod
    def retire(arena: Arena, slots: list[int]) -> None:
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
        arena.slots["state"][idx] = RETIRED
        arena.slots["since"][idx] = now

    def still_mine(self, arena: Arena, slot: int, gen: int) -> bool:
        row = arena.slots[slot]
        return (
            int(row["generation"]) == gen
            and int(row["state"]) == WRITING
            and int(row["token"]) == self.token
        )

    def release(self, arena: Arena, reserved: dict[int, tuple[int, int]]) -> None:
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
                self.give_back(arena, reserved)
        except BackendError as exc:
            self._warn("release", "could not give back %d slots: %s", len(reserved), exc)

    def give_back(self, arena: Arena, reserved: dict[int, tuple[int, int]]) -> None:
        """Free the reserved slots still ours, and drop their slot locks (writer lock held)."""
        for slot, gen in reserved.values():
            if self.still_mine(arena, slot, gen):
                arena.slots[slot]["state"] = FREE
                self.slot_lock(arena, slot, take=False)

    def commit(
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
            & (table["state"][idx] == WRITING)
            & (table["token"][idx] == self.token)
        ).tolist()
        index = self.log.index
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
                table["state"][slot] = FREE  # another process stored the key meanwhile
                continue
            done.append(k)
            records.append(
                (RecordKind.PUT, names[i], Entry(slot, gen, sizes[i], csum, self.algorithm))
            )
        if done:
            rows = idx[done]
            table["length"][rows] = [sizes[order[k]] for k in done]
            table["checksum"][rows] = np.array([sums[k] for k in done], np.uint64)
            table["last_access"][rows] = time.time()
            table["state"][rows] = COMMITTED  # last: the row is whole when it says so
            if self.options.fsync:
                for slot in rows.tolist():
                    arena.flush_row(slot)
        return records
