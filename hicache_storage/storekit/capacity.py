"""LRU capacity accounting shared by every backend that bounds its own size.

The tracker knows each committed object's size and recency. A writer first *reserves*
room (evicting least-recently-used objects if needed), writes, then *commits*; a failed
write *releases* its reservation, so no reservation ever leaks. Use the reservation as a
context manager and that happens by itself::

    with tracker.reserve(name, nbytes) as r:   # None-safe: see reserve()
        write(...)
        r.commit()
    # leaving the block without commit() releases the bytes

Eviction runs when a reservation would push the total over ``max_bytes``, and then goes
down to the watermark ``max_bytes * eviction_ratio`` so that it does not run on every
write. Objects being written are never evicted (they are reservations, not entries). A
free-space floor (``min_free_bytes``) is honoured the same way using ``free_space()``.

The tracker sees only what its owner told it (objects found at start-up, objects it
wrote). When other processes share the store, that view goes stale; a ``refresh``
callback (a re-scan of the store) lets it catch up when it cannot otherwise make room, so
a writer whose own objects were all evicted by others still finds something to evict.
With ``shared_cap`` (one cap for several processes), writers also re-scan on a schedule
(:meth:`CapacityTracker.refresh_if_due`: at most every :data:`CAP_REFRESH_MIN_INTERVAL`
seconds, and never more often than :data:`CAP_REFRESH_COST_FACTOR` times the last scan's
duration, so scanning takes at most 2% of the time), so that the cap applies to what
every process wrote, not to one process's share of it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from operator import itemgetter
from typing import TYPE_CHECKING, Self

from hicache_storage.errors import ConfigError
from hicache_storage.ratelimit import RateLimitedLog

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from types import TracebackType

__all__ = ["CAP_REFRESH_COST_FACTOR", "CAP_REFRESH_MIN_INTERVAL", "CapacityTracker", "Reservation"]

logger = logging.getLogger(__name__)

#: With a shared cap, a writer re-scans the store at most this often (seconds)...
CAP_REFRESH_MIN_INTERVAL = 0.01
#: ...and waits at least this many times the last scan's duration before the next one.
CAP_REFRESH_COST_FACTOR = 50
#: Uses (reads, writes) this recent (seconds) are remembered across a re-scan: the store's
#: mtimes, which a re-scan orders by, lag them by up to a second (they are refreshed at
#: most once a second per object).
RECENT_USE_MEMORY = 2.0


class Reservation:
    """Bytes held for one object being written. Commit it, or it is released on exit.

    Made by :meth:`CapacityTracker.reserve` and :meth:`CapacityTracker.reserve_reusing`.

    Args:
        tracker: the tracker that holds the bytes.
        name: the object's name.
        nbytes: the bytes held.
        generation: the tracker's generation when the bytes were reserved; a
            :meth:`CapacityTracker.clear` since then makes :meth:`commit` fail.
    """

    __slots__ = ("_done", "_tracker", "allocated", "generation", "name", "nbytes")

    def __init__(self, tracker: CapacityTracker, name: str, nbytes: int, generation: int) -> None:
        self._tracker = tracker
        self.name = name
        self.nbytes = nbytes
        self.generation = generation
        self.allocated = False
        self._done = False

    def mark_allocated(self) -> None:
        """Note that the bytes are allocated on the filesystem already (``fallocate``).

        The free-space floor must then no longer count them as still to come:
        ``free_space()`` shows them.
        """
        if not self._done and not self.allocated:
            self.allocated = True
            self._tracker._mark_allocated(self)

    def commit(self) -> bool:
        """The object is stored: account it as the most recently used entry.

        Returns False (and only releases the bytes) when the tracker was cleared since the
        reservation was made: the caller must then check whether its object survived
        the clear and :meth:`CapacityTracker.add` it if so.
        """
        if self._done:
            return False
        self._done = True
        return self._tracker._commit(self)

    def release(self) -> None:
        """The write failed or was not needed: give the bytes back."""
        if not self._done:
            self._done = True
            self._tracker._release(self)

    def __enter__(self) -> Self:
        """Hold the reservation for a ``with`` block."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Release the bytes, unless the reservation was committed or released already."""
        self.release()


class CapacityTracker:
    """Thread-safe LRU accounting of stored objects under a byte cap.

    Args:
        max_bytes: cap on committed plus reserved bytes; ``None`` for no cap.
        evict: callback that deletes one object by name; returns True when it is gone
            (also when it was already gone). It runs with the tracker's lock held.
        eviction_ratio: evict down to ``max_bytes * eviction_ratio`` once over the cap.
        min_free_bytes: keep at least this much free space (needs ``free_space``).
        free_space: callback returning the store's free bytes now.
        block_size: the filesystem's allocation unit: an object takes its size rounded up
            to it from the free space (the floor is checked with the rounded size).
        refresh: callback returning every object of the store now, as :meth:`load` takes
            them; called when the free-space floor cannot be met from what the tracker
            knows, and the tracker's view is then replaced by it. It runs with the
            tracker's lock held.
        refresh_interval: seconds to wait after a refresh that did not make room before
            the next one (a store filled by other programs is not re-scanned per write).
        shared_cap: ``max_bytes`` is one budget for several processes that each keep a
            tracker: re-scan on a schedule while writing (:meth:`refresh_if_due`) and
            evict whatever is least recently used in the store, so that the store comes
            back under the cap whoever wrote the excess.
        quota_prefix: the names of this instance's namespace (a tenant's): their
            objects and bytes are counted apart (:attr:`quota_used_bytes`), and with
            ``quota_bytes`` capped; ``None``: not counted.
        quota_bytes: cap on the bytes of names starting with ``quota_prefix``: a write
            that would cross it evicts that namespace's least-recently-used objects
            (down to ``quota_bytes * eviction_ratio``), never another's.
    """

    def __init__(
        self,
        max_bytes: int | None,
        evict: Callable[[str], bool],
        *,
        eviction_ratio: float = 0.9,
        min_free_bytes: int = 0,
        free_space: Callable[[], int] | None = None,
        block_size: int = 1,
        refresh: Callable[[], Iterable[tuple[str, int, float]]] | None = None,
        refresh_interval: float = 1.0,
        shared_cap: bool = False,
        quota_prefix: str | None = None,
        quota_bytes: int | None = None,
    ) -> None:
        if max_bytes is not None and max_bytes <= 0:
            raise ConfigError(f"max size must be > 0, got {max_bytes}")
        if not 0.0 < eviction_ratio <= 1.0:
            raise ConfigError(f"eviction_ratio must be in (0, 1], got {eviction_ratio}")
        if min_free_bytes < 0:
            raise ConfigError("min free space must be >= 0")
        if min_free_bytes and free_space is None:
            raise ConfigError("min_free_bytes needs a free_space callback")
        if quota_bytes is not None and (quota_bytes <= 0 or quota_prefix is None):
            raise ConfigError(f"a namespace quota must be > 0, got {quota_bytes}")
        self.max_bytes = max_bytes
        self.eviction_ratio = eviction_ratio
        self.min_free_bytes = min_free_bytes
        self._evict = evict
        self._free_space = free_space
        self.block_size = max(1, int(block_size))
        self._refresh = refresh
        self.refresh_interval = refresh_interval
        self._last_refresh = -float("inf")
        self.refreshes = 0
        self.shared_cap = shared_cap and max_bytes is not None and refresh is not None
        #: ``time.monotonic()`` from which the next scheduled re-scan may run (shared cap).
        self.next_cap_refresh = -float("inf")
        #: Wall-clock time of recent reads (shared cap), kept across re-scans.
        self._recent: dict[str, float] = {}
        self._log = RateLimitedLog(logger)
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, int] = OrderedDict()  # oldest first
        self._used = 0
        self._reserved = 0
        self._allocated = 0  # reserved bytes already allocated on the filesystem
        self._generation = 0
        self.evictions = 0
        self.quota_prefix = quota_prefix
        self.quota_bytes = quota_bytes
        self._q_used = 0  # committed bytes of the quota's names
        self._q_count = 0
        self._q_reserved = 0

    @property
    def enabled(self) -> bool:
        """True when a cap, a namespace quota or a free-space floor is set."""
        return self.max_bytes is not None or self.min_free_bytes > 0 or self.quota_bytes is not None

    @property
    def quota_used_bytes(self) -> int:
        """Committed bytes of names starting with ``quota_prefix`` (0 without a prefix)."""
        return self._q_used

    @property
    def quota_objects(self) -> int:
        """Committed objects whose names start with ``quota_prefix``."""
        return self._q_count

    def _in_quota(self, name: str) -> bool:
        prefix = self.quota_prefix
        return prefix is not None and name.startswith(prefix)

    def _counted(self, name: str, nbytes: int, sign: int) -> None:
        """Follow a committed object coming in (``sign`` 1) or going (-1) for the quota."""
        if self._in_quota(name):
            self._q_used += sign * nbytes
            self._q_count += sign

    def _recount(self) -> None:
        """Count the quota's names again (after the view was replaced as a whole)."""
        prefix = self.quota_prefix
        if prefix is None:
            return
        if not prefix:  # every name (a tracker of one namespace): no pass over them
            self._q_used, self._q_count = self._used, len(self._lru)
            return
        mine = [b for n, b in self._lru.items() if n.startswith(prefix)]
        self._q_used, self._q_count = sum(mine), len(mine)

    @property
    def used_bytes(self) -> int:
        """Bytes of committed objects."""
        return self._used

    @property
    def reserved_bytes(self) -> int:
        """Bytes held by writes in flight."""
        return self._reserved

    def __len__(self) -> int:
        """The number of committed objects tracked."""
        return len(self._lru)

    def __contains__(self, name: object) -> bool:
        """True if ``name`` is a committed object the tracker knows."""
        return name in self._lru

    def load(self, entries: Iterable[tuple[str, int, float]]) -> None:
        """Add existing objects ``(name, nbytes, last_use_time)``, oldest use first."""
        with self._lock:
            if not self._lru:  # the start-up load: build the order in one go
                ordered = sorted(entries, key=itemgetter(2))
                sizes = list(map(itemgetter(1), ordered))
                self._lru = OrderedDict(zip(map(itemgetter(0), ordered), sizes, strict=True))
                if len(self._lru) == len(sizes):
                    self._used = sum(sizes)
                    self._recount()
                    return
                # A name given twice: as the loop below does (its later entry wins).
                self._lru = OrderedDict()
                self._used = 0
                entries = ordered
            for name, nbytes, _ in sorted(entries, key=lambda e: e[2]):
                old = self._lru.pop(name, None)
                if old is not None:
                    self._used -= old
                self._lru[name] = nbytes
                self._used += nbytes
            self._recount()

    def load_ordered(self, names: list[str], sizes: list[int], *, strict: bool = True) -> None:
        """Start from the objects ``names`` of ``sizes`` bytes, least recently used first.

        The start-up load of a store whose objects come in LRU order already (a scan
        snapshot): one pass, no sort. A name given twice raises :class:`ValueError` when
        ``strict`` (a damaged snapshot: the caller scans instead); otherwise its later
        entry counts, as with :meth:`load`. Into a tracker that holds objects already,
        they are added as :meth:`load` would, newest last.
        """
        if len(names) != len(sizes):
            raise ValueError("names and sizes differ in length")
        with self._lock:
            if not self._lru:
                lru = OrderedDict(zip(names, sizes, strict=True))
                if len(lru) == len(names):
                    used = sum(sizes)
                elif strict:
                    raise ValueError("an object listed twice")
                else:
                    # The later entry counts, at its own place (as load()).
                    lru = OrderedDict()
                    for name, nbytes in zip(names, sizes, strict=True):
                        lru.pop(name, None)
                        lru[name] = nbytes
                    used = sum(lru.values())
                self._lru, self._used = lru, used
                self._recount()
                return
        self.load(zip(names, sizes, range(len(names)), strict=True))

    def items_oldest_first(self) -> list[tuple[str, int]]:
        """Committed ``(name, nbytes)``, least recently used first."""
        with self._lock:
            return list(self._lru.items())

    def names_oldest_first(self) -> list[str]:
        """Committed names, least recently used first."""
        with self._lock:
            return list(self._lru)

    def touch(self, name: str) -> None:
        """Mark ``name`` as just used."""
        with self._lock:
            if name in self._lru:
                self._lru.move_to_end(name)
                if self.shared_cap:
                    self._used_now(name)

    def _used_now(self, name: str) -> None:
        """Remember when ``name`` was read.

        A re-scan only knows the mtimes, which lag a read by up to a second; a write's mtime
        is its time.
        """
        recent = self._recent
        recent[name] = now = time.time()
        if len(recent) > 2 * len(self._lru) + 1024:  # no re-scan for a while: stay small
            cutoff = now - RECENT_USE_MEMORY
            lru = self._lru  # at most len(lru) are kept: the next prune is far away
            self._recent = {n: t for n, t in recent.items() if t > cutoff and n in lru}

    def discard(self, name: str) -> None:
        """Forget ``name`` (deleted by the caller)."""
        with self._lock:
            nbytes = self._lru.pop(name, None)
            if nbytes is not None:
                self._used -= nbytes
                self._counted(name, nbytes, -1)

    def add(self, name: str, nbytes: int) -> None:
        """Account an object that exists now, as the most recently used."""
        if not self.enabled:
            return
        with self._lock:
            old = self._lru.pop(name, None)
            if old is not None:
                self._used -= old
                self._counted(name, old, -1)
            self._lru[name] = nbytes
            self._used += nbytes
            self._counted(name, nbytes, 1)

    def clear(self, prefix: str | None = None) -> None:
        """Forget every committed object, or with ``prefix`` those whose name starts with it.

        Reservations made before stay, but they will not commit.
        """
        with self._lock:
            if prefix is None:
                self._lru.clear()
                self._used = 0
            else:
                # One pass builds what stays (popping a million names one by one from an
                # OrderedDict costs ten times more).
                self._lru = OrderedDict(
                    (n, b) for n, b in self._lru.items() if not n.startswith(prefix)
                )
                self._used = sum(self._lru.values())
            self._recount()
            self._generation += 1

    def reserve(self, name: str, nbytes: int) -> Reservation | None:
        """Hold ``nbytes`` for ``name``, evicting LRU objects if needed.

        Returns None when the object cannot fit: larger than the cap, held off by writes
        in flight, or no evictable objects left to make room. Nothing is evicted when
        evicting everything would still not make room.
        """
        if not self.enabled:
            return Reservation(self, name, 0, self._generation)
        with self._lock:
            self._cap_refresh_locked()
            mine = self._in_quota(name)
            if mine and self.quota_bytes is not None and not self._make_room_in_quota(name, nbytes):
                return None
            if self.max_bytes is not None and not self._make_room_under_cap(name, nbytes):
                return None
            if (
                self.min_free_bytes
                and self._free_space is not None
                and not self._keep_free_floor(name, nbytes)
            ):
                return None
            self._reserved += nbytes
            if mine:
                self._q_reserved += nbytes
            return Reservation(self, name, nbytes, self._generation)

    def reserve_reusing(self, name: str, nbytes: int) -> tuple[Reservation, str] | None:
        """Hand the least-recently-used object's bytes to ``name``, when the store is full.

        For stores that recycle an evicted object's storage instead of freeing it (``shm``
        overwrites the evicted tmpfs file): if ``name`` would not fit without evicting, and
        the oldest object has exactly ``nbytes``, that object leaves the accounting and
        its bytes become ``name``'s reservation, with no net change in usage. Returns the
        reservation and the evicted name (the caller must remove or reuse that object),
        or None when there is room, when the oldest object has another size, when the
        store is already over its limits (it must shrink), or without a cap or floor
        (then :meth:`reserve` applies).
        """
        if not self.enabled:
            return None
        with self._lock:
            self._cap_refresh_locked()
            if not self._lru:
                return None
            victim, size = next(iter(self._lru.items()))
            if size != nbytes or not self._reuse_fits(nbytes):
                return None
            mine = self._in_quota(name)
            if mine and self.quota_bytes is not None:
                held = self._q_used + self._q_reserved
                if held > self.quota_bytes or (
                    not self._in_quota(victim) and held + nbytes > self.quota_bytes
                ):
                    # Over its quota (it must shrink: a swap never would), or at it with
                    # another tenant's page oldest: it evicts its own (reserve).
                    return None
            del self._lru[victim]
            self._used -= size
            self._counted(victim, size, -1)
            self._reserved += nbytes
            if mine:
                self._q_reserved += nbytes
            self.evictions += 1
            return Reservation(self, name, nbytes, self._generation), victim

    def _reuse_fits(self, nbytes: int) -> bool:
        """True if a write of ``nbytes`` should take the place of an evicted object.

        That is when ``nbytes`` more would cross the cap or the floor while the store is not
        over them already. A store that is over them (a smaller cap after a restart, another
        program filling the filesystem) must shrink, which swapping objects would never do.
        """
        used = self._used + self._reserved
        cap = self.max_bytes
        if cap is not None and used > cap:
            return False
        full = cap is not None and used + nbytes > cap
        if self.min_free_bytes and self._free_space is not None:
            free = self._free_space() - self._pending()  # one statvfs per write
            if free < self.min_free_bytes:
                return False
            full = full or free - self._rounded(nbytes) < self.min_free_bytes
        return full

    def _make_room_under_cap(self, name: str, nbytes: int) -> bool:
        cap = self.max_bytes
        if cap is None:
            return True
        if nbytes > cap:
            self._log(
                "oversize", "object %s (%d B) is larger than max_size %d B", name, nbytes, cap
            )
            return False
        if self._reserved + nbytes > cap:
            return False  # writes in flight hold the room; evicting would not help
        if self._used + self._reserved + nbytes > cap:
            target = max(int(cap * self.eviction_ratio), self._reserved + nbytes)
            self._evict_until(lambda: self._used + self._reserved + nbytes <= target)
        return self._used + self._reserved + nbytes <= cap

    def _make_room_in_quota(self, name: str, nbytes: int) -> bool:
        """Keep the quota's names under ``quota_bytes``, evicting only them (lock held)."""
        quota = self.quota_bytes
        assert quota is not None
        assert self.quota_prefix is not None
        if nbytes > quota:
            self._log(
                "oversize", "object %s (%d B) is larger than the namespace quota %d B",
                name, nbytes, quota,
            )  # fmt: skip
            return False
        if self._q_reserved + nbytes > quota:
            return False  # its writes in flight hold the room
        if self._q_used + self._q_reserved + nbytes > quota:
            target = max(int(quota * self.eviction_ratio), self._q_reserved + nbytes)
            excess = self._q_used + self._q_reserved + nbytes - target
            prefix, victims = self.quota_prefix, []
            for victim, size in self._lru.items():  # oldest first
                if victim.startswith(prefix):
                    victims.append((victim, size))
                    excess -= size
                    if excess <= 0:
                        break
            for victim, size in victims:
                if not self._evict_one(victim, size):
                    break
        return self._q_used + self._q_reserved + nbytes <= quota

    def _pending(self) -> int:
        """Reserved bytes not allocated on the filesystem yet (``free_space()`` misses them)."""
        return self._reserved - self._allocated

    def _rounded(self, nbytes: int) -> int:
        """``nbytes`` as the filesystem takes them: rounded up to whole blocks."""
        b = self.block_size
        return -(-nbytes // b) * b

    def refresh_if_due(self) -> bool:
        """With ``shared_cap``, re-scan the store if the scheduled re-scan is due.

        Call it before a write, outside other locks. Returns True if it re-scanned.
        """
        if not self.shared_cap or time.monotonic() < self.next_cap_refresh:
            return False
        with self._lock:
            return self._cap_refresh_locked()

    def _cap_refresh_locked(self) -> bool:
        if not self.shared_cap or time.monotonic() < self.next_cap_refresh:
            return False
        return self._rescan()

    def _refresh_locked(self) -> bool:
        """Replace the view by the store's real content (``refresh``), if allowed now."""
        if self._refresh is None:
            return False
        now = time.monotonic()
        if now - self._last_refresh < self.refresh_interval:
            return False
        return self._rescan()

    def _rescan(self) -> bool:
        """Replace the tracker's view by the store's real content (``refresh``).

        Recent uses that the store's mtimes do not show yet keep their place; writes in flight
        stay reserved.
        """
        assert self._refresh is not None
        start = time.monotonic()
        try:
            entries = list(self._refresh())
        except Exception:
            logger.exception("re-scanning the store failed")
            entries = None
        end = time.monotonic()
        self._last_refresh = end
        self.next_cap_refresh = end + max(
            CAP_REFRESH_MIN_INTERVAL, CAP_REFRESH_COST_FACTOR * (end - start)
        )
        if entries is None:
            return False
        recent = self._recent
        if recent:
            entries = [(n, b, max(t, recent.get(n, t))) for n, b, t in entries]
            cutoff = time.time() - RECENT_USE_MEMORY
            self._recent = {n: t for n, t in recent.items() if t > cutoff}
        entries.sort(key=itemgetter(2))
        self._lru = OrderedDict(
            zip(map(itemgetter(0), entries), map(itemgetter(1), entries), strict=True)
        )
        self._used = sum(self._lru.values())
        self._recount()
        self.refreshes += 1
        return True

    def _keep_free_floor(self, name: str, nbytes: int) -> bool:
        free_space = self._free_space
        if free_space is None:
            return True
        need = self._rounded(nbytes)

        def short() -> int:
            # Bytes reserved by writes in flight are not on disk yet: count them as used.
            return self.min_free_bytes + self._pending() + need - free_space()

        if short() <= 0:
            return True
        refreshed = False
        while True:
            if short() <= self._used:  # evicting can make room (never evict in vain)
                self._evict_until(lambda: short() <= 0)
                if short() <= 0:
                    if refreshed:
                        self._last_refresh = -float("inf")  # it helped: no wait next time
                    return True
            # The store may hold more than this view knows of (other processes' objects).
            if refreshed or not self._refresh_locked():
                break
            refreshed = True
        self._log(
            "floor",
            "free-space floor %d B cannot be kept even by evicting all %d B known of this "
            "store; refusing %s",
            self.min_free_bytes,
            self._used,
            name,
        )
        return False

    def _evict_until(self, done: Callable[[], bool]) -> None:
        while self._lru and not done():
            name, nbytes = next(iter(self._lru.items()))
            if not self._evict_one(name, nbytes):
                break

    def _evict_one(self, name: str, nbytes: int) -> bool:
        """Evict ``name`` (lock held); False if it could not be removed."""
        try:
            gone = self._evict(name)
        except Exception:  # noqa: BLE001 - logged (rate limited) with its traceback
            self._log("evict", "evicting %s failed", name, exc_info=True)
            gone = False
        if not gone:
            # Keep the accounting honest (the bytes are still there); stop here rather
            # than loop on an object that cannot be removed.
            self._lru.move_to_end(name)
            return False
        del self._lru[name]
        self._used -= nbytes
        self._counted(name, nbytes, -1)
        self.evictions += 1
        return True

    def _mark_allocated(self, r: Reservation) -> None:
        with self._lock:
            self._allocated += r.nbytes

    def _commit(self, r: Reservation) -> bool:
        with self._lock:
            self._reserved -= r.nbytes
            if self._in_quota(r.name):
                self._q_reserved -= r.nbytes
            if r.allocated:
                self._allocated -= r.nbytes
            if not self.enabled:
                return True
            if r.generation != self._generation:
                return False
            old = self._lru.pop(r.name, None)
            if old is not None:
                self._used -= old
                self._counted(r.name, old, -1)
            self._lru[r.name] = r.nbytes
            self._used += r.nbytes
            self._counted(r.name, r.nbytes, 1)
            return True

    def _release(self, r: Reservation) -> None:
        with self._lock:
            self._reserved -= r.nbytes
            if self._in_quota(r.name):
                self._q_reserved -= r.nbytes
            if r.allocated:
                self._allocated -= r.nbytes
