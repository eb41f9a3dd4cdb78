"""A positive-only TTL cache of keys known to exist, for cheap ``exists`` answers.

Only positive answers are cached: a negative cache would hide a page another process
has just written. An entry can be stale for at most ``ttl`` seconds after another
process deletes or evicts the object; ``get`` then misses cleanly (it never returns wrong
bytes), so a stale entry costs a wasted prefetch, not correctness.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

__all__ = ["MetadataCache"]


class MetadataCache:
    """Thread-safe set of recently seen keys, each valid for ``ttl`` seconds.

    Args:
        ttl: seconds an entry stays valid; ``<= 0`` disables the cache entirely.
        max_entries: entries kept at most (oldest dropped first).
    """

    def __init__(self, ttl: float, max_entries: int = 1_000_000) -> None:
        self.ttl = float(ttl)
        self.max_entries = max_entries
        self._entries: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """False when ``ttl <= 0``."""
        return self.ttl > 0

    def add(self, key: str) -> None:
        """Record that ``key`` exists now."""
        if not self.enabled:
            return
        now = time.monotonic()
        with self._lock:
            self._entries[key] = now
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def contains(self, key: str) -> bool:
        """True if ``key`` was recorded less than ``ttl`` seconds ago."""
        if not self.enabled:
            return False
        with self._lock:
            seen = self._entries.get(key)
            if seen is None:
                return False
            if time.monotonic() - seen > self.ttl:
                del self._entries[key]
                return False
            return True

    def discard(self, key: str) -> None:
        """Forget ``key`` (after a delete or an eviction)."""
        with self._lock:
            self._entries.pop(key, None)

    def clear(self) -> None:
        """Forget every key."""
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        """The number of keys held, expired ones not yet dropped included."""
        with self._lock:
            return len(self._entries)
