"""Per-backend operation statistics, recorded by the protocol layer for every backend."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from hicache_storage import metrics

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["OpStats", "StatsRecorder", "StorageStats"]


@dataclass
class OpStats:
    """Counters of one operation (``get``, ``batch_set_v1``...).

    Attributes:
        calls: calls made.
        items: keys or pages asked for, summed over calls.
        ok: items that succeeded (hits for reads and ``exists``; stored for writes).
        errors: items that failed because the store failed (not misses).
        seconds: wall time spent in the calls.
    """

    calls: int = 0
    items: int = 0
    ok: int = 0
    errors: int = 0
    seconds: float = 0.0


@dataclass
class StorageStats:
    """A snapshot of a backend's statistics.

    Attributes:
        ops: counters per operation name.
        bytes_read: payload bytes delivered to callers.
        bytes_written: payload bytes stored.
        contract_violations: results of the wrong shape that the protocol layer replaced.
        corrupt_objects: objects that failed header or checksum verification.
        size_mismatches: reads refused because the stored size differs from the target.
        evictions: objects evicted to stay under the capacity limit.
        breaker_opens: times the circuit breaker opened (see :mod:`hicache_storage.breaker`).
        breaker_rejections: calls answered at once while it was open.
    """

    ops: dict[str, OpStats] = field(default_factory=dict)
    bytes_read: int = 0
    bytes_written: int = 0
    contract_violations: int = 0
    corrupt_objects: int = 0
    size_mismatches: int = 0
    evictions: int = 0
    breaker_opens: int = 0
    breaker_rejections: int = 0

    def op(self, name: str) -> OpStats:
        """Counters of ``name`` (zeros if never called)."""
        return self.ops.get(name, OpStats())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "ops": {k: vars(v).copy() for k, v in sorted(self.ops.items())},
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "contract_violations": self.contract_violations,
            "corrupt_objects": self.corrupt_objects,
            "size_mismatches": self.size_mismatches,
            "evictions": self.evictions,
            "breaker_opens": self.breaker_opens,
            "breaker_rejections": self.breaker_rejections,
        }


class StatsRecorder:
    """Thread-safe accumulator behind :meth:`HiCacheStorage.get_stats`.

    Once bound to a backend (:meth:`bind`), it also feeds :mod:`hicache_storage.metrics`
    when those are on.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = StorageStats()
        self._labels: tuple[str, str] | None = None
        self._usage: Callable[[], dict[str, int]] | None = None

    def bind(
        self, backend: str, namespace_digest: str, usage: Callable[[], dict[str, int]]
    ) -> None:
        """Name the backend in the metrics (its registry name and namespace)."""
        self._labels = (backend, namespace_digest[:12])
        self._usage = usage

    def refresh_usage(self) -> None:
        """Set the capacity gauges from the backend's ``usage()`` (the metrics' thread)."""
        m = metrics.current()
        usage = self._usage
        if m is not None and self._labels is not None and usage is not None:
            try:
                m.usage(self._labels, usage())
            except Exception:  # noqa: BLE001, S110 - a gauge left as it was
                pass

    def unbind(self) -> None:
        """The backend closed: its circuit gauges to 0, no more capacity refreshes."""
        m = metrics.current() if self._labels is not None else None
        if m is not None and self._labels is not None:
            for direction in ("read", "write"):
                m.circuit(self._labels, direction, "closed")
        self._usage = None

    def record(
        self, op: str, items: int, ok: int, errors: int, seconds: float, timed: bool = True
    ) -> None:
        """Add one call of ``op`` (``timed``: it reached the store, its time is a latency)."""
        m = metrics.current() if self._labels is not None else None
        if m is not None and self._labels is not None:
            m.op(self._labels, op, items, ok, errors, seconds if timed else None)
            if self._usage is not None:
                m.watch(self)
        with self._lock:
            s = self._stats.ops.get(op)
            if s is None:
                s = self._stats.ops[op] = OpStats()
            s.calls += 1
            s.items += items
            s.ok += ok
            s.errors += errors
            s.seconds += seconds

    def circuit(self, direction: str, state: str) -> None:
        """A circuit breaker of the backend (``read`` or ``write``) changed state."""
        m = metrics.current() if self._labels is not None else None
        if m is not None and self._labels is not None:
            m.circuit(self._labels, direction, state)

    def add(self, **counters: int) -> None:
        """Add to the scalar counters (``bytes_read=...``, ``corrupt_objects=...``)."""
        m = metrics.current() if self._labels is not None else None
        if m is not None and self._labels is not None:
            m.add(self._labels, counters)
        with self._lock:
            for name, value in counters.items():
                setattr(self._stats, name, getattr(self._stats, name) + value)

    def snapshot(self, reset: bool = False) -> StorageStats:
        """Return a copy of the counters; with ``reset``, start from zero afterwards."""
        with self._lock:
            snap = replace(self._stats, ops={k: replace(v) for k, v in self._stats.ops.items()})
            if reset:
                self._stats = StorageStats()
            return snap
