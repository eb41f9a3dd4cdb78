"""Admission to L3: store a page only once it has been seen ``min_seen`` times.

Most pages of a chat workload are used once (a user's own question, a one-off document);
writing each to storage costs bandwidth, disk wear and the room of pages that would be
reused. :class:`SeenCounter` counts how often each page key was seen, across evictions
from the upper tiers, in fixed memory, and says which keys have reached ``min_seen``. The
tier's backups (:class:`~hicache_storage.tier.controller.TieredCache`, ``admit_after``) and
the vLLM connector's stores (``admit_after`` in its extra config) ask it before writing.

The counts are a count-min sketch (``depth`` rows of ``width`` one-byte counters, a
conservative update, every counter halved each ``10 * width`` sightings so that old
popularity fades). A sketch never counts a key *less* often than it was seen (until a
halving), so a page seen ``min_seen`` times since the last halving is always admitted;
it may count a key more often (two keys sharing counters in every row), so a page can
now and then be admitted early. Nothing is ever refused that the rule admits; the cost of
a collision is one write the rule would have saved.

Counts live in one process (the scheduler, the tier): they are not shared between
processes or kept across restarts.
"""

from __future__ import annotations

import threading
from hashlib import blake2b
from typing import TYPE_CHECKING

import numpy as np

from hicache_storage.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["MAX_MIN_SEEN", "SeenCounter"]

#: The largest ``min_seen`` (the counters are bytes, halved as they age).
MAX_MIN_SEEN = 64

_MASK32 = (1 << 32) - 1


class SeenCounter:
    """How often each key was seen, and whether it reached ``min_seen`` (thread-safe).

    Args:
        min_seen: sightings a key needs before it is admitted (1: every key at once,
            and nothing is counted).
        width: counters per row (a power of two); memory is ``depth * width`` bytes.
        depth: rows (independent counters per key; more rows, fewer early admissions).
    """

    def __init__(self, min_seen: int, width: int = 1 << 20, depth: int = 4) -> None:
        if (
            not isinstance(min_seen, int)
            or isinstance(min_seen, bool)
            or not 1 <= min_seen <= MAX_MIN_SEEN
        ):
            raise ConfigError(
                f"admit_after={min_seen!r} must be a whole number of sightings from 1 "
                f"(store every page) to {MAX_MIN_SEEN}"
            )
        if width < 64 or width & (width - 1) or not 1 <= depth <= 8:
            raise ConfigError("width must be a power of two >= 64 and depth from 1 to 8")
        self.min_seen = int(min_seen)
        self.width, self.depth = width, depth
        self._counts = np.zeros((depth, width), dtype=np.uint8) if self.on else None
        self._rows = np.arange(depth, dtype=np.uint64)[:, None]
        self._lock = threading.Lock()
        self._added = 0
        self.halvings = 0
        #: Keys answered "not yet" and "admitted" by :meth:`see` (each sighting counts).
        self.refused = 0
        self.admitted_count = 0

    @property
    def on(self) -> bool:
        """True when keys must be seen more than once (a sketch is kept)."""
        return self.min_seen > 1

    def _slots(self, keys: Sequence[str]) -> np.ndarray:
        """Each key's counter in each row: a ``(depth, len(keys))`` array of columns.

        From a fixed hash of the key (blake2b), so that every process (the tier's TP
        ranks) counts the same collisions.
        """
        h = np.fromiter(
            (int.from_bytes(blake2b(k.encode(), digest_size=8).digest(), "little") for k in keys),
            dtype=np.uint64,
            count=len(keys),
        )
        h1 = h & np.uint64(_MASK32)
        h2 = (h >> np.uint64(32)) | np.uint64(1)  # odd: the rows' steps never coincide
        return ((h1[None, :] + self._rows * h2[None, :]) & np.uint64(self.width - 1)).astype(
            np.intp
        )

    def see(self, keys: Sequence[str]) -> list[bool]:
        """Count one sighting of each distinct key; which keys are admitted now.

        With ``min_seen`` 1, every key, and nothing is counted.
        """
        if not self.on:
            return [True] * len(keys)
        if not keys:
            return []
        unique = list(dict.fromkeys(keys))
        cols = self._slots(unique)
        rows = np.arange(self.depth)[:, None]
        with self._lock:
            counts = self._counts
            assert counts is not None
            now = counts[rows, cols].min(axis=0)
            new = np.minimum(now.astype(np.int32) + 1, 255).astype(np.uint8)
            # Conservative update: raise each row's counter only up to the new estimate.
            # (maximum.at: two keys of the batch may share a counter; the larger wins.)
            np.maximum.at(counts, (np.broadcast_to(rows, cols.shape), cols), new[None, :])
            self._added += len(unique)
            if self._added >= 10 * self.width:
                counts >>= 1
                self._added = 0
                self.halvings += 1
        ok = dict(zip(unique, (int(c) >= self.min_seen for c in new), strict=True))
        out = [ok[k] for k in keys]
        n = sum(out)
        self.admitted_count += n
        self.refused += len(out) - n
        return out

    def seen(self, keys: Sequence[str]) -> list[int]:
        """How often each key was seen (an upper bound; nothing is counted)."""
        if not self.on or not keys:
            return [self.min_seen if not self.on else 0] * len(keys)
        cols = self._slots(keys)
        with self._lock:
            assert self._counts is not None
            got = self._counts[np.arange(self.depth)[:, None], cols].min(axis=0)
        return [int(c) for c in got]

    def admitted(self, keys: Sequence[str]) -> list[bool]:
        """Which keys have been seen ``min_seen`` times (nothing is counted)."""
        if not self.on:
            return [True] * len(keys)
        return [c >= self.min_seen for c in self.seen(keys)]
