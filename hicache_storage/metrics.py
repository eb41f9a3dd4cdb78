"""Prometheus metrics of every backend, for operators (optional: the ``metrics`` extra).

Off until :func:`enable` is called (or ``HICACHE_STORAGE_METRICS=1`` is set when the
first backend is built); the package works without ``prometheus_client``. Once on, the
protocol layer's counters of every backend of the process (what
:meth:`~hicache_storage.protocol.HiCacheStorage.get_stats` reports) are also
Prometheus series in ``prometheus_client``'s default registry:

``hicache_operations_total{backend,namespace,operation}``
    engine-facing calls made.
``hicache_pages_total{backend,namespace,operation,result}``
    keys or pages asked for, by result: ``ok`` (a hit, a page stored), ``miss``,
    ``failed`` (the store failed).
``hicache_operation_seconds{backend,namespace,operation}``
    a histogram of call durations, 25 us to 10 s.
``hicache_bytes_read_total``, ``hicache_bytes_written_total``, ``hicache_corrupt_objects_total``,
``hicache_size_mismatches_total``, ``hicache_evictions_total``,
``hicache_contract_violations_total`` ``{backend,namespace}``
    the backend's scalar counters.
``hicache_circuit_open{backend,namespace,direction}``
    1 while the backend's circuit breaker of reads (or writes) is open or half-open
    (:mod:`hicache_storage.breaker`); ``hicache_breaker_opens_total`` and
    ``hicache_breaker_rejections_total`` count its openings and the calls it answered.
``hicache_capacity_used_bytes``, ``hicache_capacity_limit_bytes``, ``hicache_objects``
    what :meth:`~hicache_storage.protocol.HiCacheStorage.usage` says, refreshed once a
    second on a thread of the metrics for every backend that made a call (a backend
    that cannot count is absent).

Labels are bounded: the backend's registry name, the first 12 characters of the
namespace digest (never a key, a tenant string or a URL) and the operation or result.

Processes: with ``PROMETHEUS_MULTIPROC_DIR`` set before ``prometheus_client`` is first
imported (SGLang sets it with ``--enable-metrics``; :func:`serve` reads it), every
process writes its values there and the serving process sums them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "LATENCY_BUCKETS",
    "MetricsUnavailableError",
    "current",
    "enable",
    "enabled",
    "registry",
    "serve",
]

#: Seconds: a call on a page-cache hit of a small page up to a remote store under load.
LATENCY_BUCKETS = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
    100e-3, 250e-3, 500e-3, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

#: Scalar counters of :class:`~hicache_storage.stats.StorageStats` with a series each.
SCALARS = (
    "bytes_read",
    "bytes_written",
    "corrupt_objects",
    "size_mismatches",
    "evictions",
    "contract_violations",
    "breaker_opens",
    "breaker_rejections",
)

#: Seconds between two refreshes of one backend's capacity gauges.
USAGE_EVERY = 1.0

_LOCK = threading.Lock()
_METRICS: _Metrics | None = None
_ENV_READ = False


class MetricsUnavailableError(ImportError):
    """``prometheus_client`` is not installed (``pip install 'hicache-storage[metrics]'``)."""


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise MetricsUnavailableError(
            "hicache-storage's metrics need prometheus_client: "
            "pip install 'hicache-storage[metrics]'"
        ) from exc
    return prometheus_client


class _Metrics:
    """The series (created once per process, in the default registry)."""

    def __init__(self) -> None:
        pc = _client()
        base = ["backend", "namespace"]
        self.ops = pc.Counter(
            "hicache_operations", "Engine-facing calls made.", [*base, "operation"]
        )
        self.pages = pc.Counter(
            "hicache_pages",
            "Keys or pages asked for, by result (ok: a hit or a page stored).",
            [*base, "operation", "result"],
        )
        self.seconds = pc.Histogram(
            "hicache_operation_seconds",
            "Duration of one engine-facing call.",
            [*base, "operation"],
            buckets=LATENCY_BUCKETS,
        )
        self.scalars = {
            name: pc.Counter(f"hicache_{name}", f"The backend's {name} counter.", base)
            for name in SCALARS
        }
        gauge = {"multiprocess_mode": "mostrecent"}
        self.used = pc.Gauge(
            "hicache_capacity_used_bytes", "Bytes the backend's objects take.", base, **gauge
        )
        self.limit = pc.Gauge(
            "hicache_capacity_limit_bytes", "The backend's capacity limit.", base, **gauge
        )
        self.objects = pc.Gauge("hicache_objects", "Objects the backend holds.", base, **gauge)
        self.ns_used = pc.Gauge(
            "hicache_namespace_used_bytes",
            "Bytes of this namespace's objects (where the backend counts them apart).",
            base,
            **gauge,
        )
        self.ns_limit = pc.Gauge(
            "hicache_namespace_limit_bytes",
            "This namespace's quota (namespace_max_size), 0 when none.",
            base,
            **gauge,
        )
        self.ns_objects = pc.Gauge(
            "hicache_namespace_objects", "Objects of this namespace.", base, **gauge
        )
        self.connections = pc.Gauge(
            "hicache_connections",
            "Open connections to the store (where the backend keeps them: redis).",
            base,
            **gauge,
        )
        self._children: dict[tuple[Any, ...], Any] = {}
        self._watched: weakref.WeakSet[Any] = weakref.WeakSet()
        self._refresher: threading.Thread | None = None
        self.circuit_open = pc.Gauge(
            "hicache_circuit_open",
            "1 while the backend's circuit breaker (of reads or writes) is open or half-open.",
            [*base, "direction"],
            **gauge,
        )

    def _child(self, metric: Any, *values: str) -> Any:
        key = (id(metric), *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def op(self, labels: tuple[str, str], op: str, items: int, ok: int, errors: int,
           seconds: float | None) -> None:  # fmt: skip
        """One call (``seconds`` None: answered without the store, not a latency)."""
        self._child(self.ops, *labels, op).inc()
        miss = max(0, items - ok - errors)
        for result, n in (("ok", ok), ("miss", miss), ("failed", errors)):
            if n:
                self._child(self.pages, *labels, op, result).inc(n)
        if seconds is not None:
            self._child(self.seconds, *labels, op).observe(seconds)

    def watch(self, recorder: Any) -> None:
        """Refresh ``recorder``'s capacity gauges on the metrics' thread (once a second)."""
        if recorder in self._watched:
            return
        with _LOCK:
            self._watched.add(recorder)
            if self._refresher is None:
                self._refresher = threading.Thread(
                    target=self._refresh, name="hicache-metrics-usage", daemon=True
                )
                self._refresher.start()

    def _refresh(self) -> None:
        while True:
            time.sleep(USAGE_EVERY)
            for recorder in list(self._watched):
                recorder.refresh_usage()

    def add(self, labels: tuple[str, str], counters: dict[str, int]) -> None:
        for name, value in counters.items():
            metric = self.scalars.get(name)
            if metric is not None and value > 0:
                metric.labels(*labels).inc(value)

    def circuit(self, labels: tuple[str, str], direction: str, state: str) -> None:
        self.circuit_open.labels(*labels, direction).set(0 if state == "closed" else 1)

    def usage(self, labels: tuple[str, str], usage: dict[str, int]) -> None:
        for metric, key in ((self.used, "used_bytes"), (self.limit, "limit_bytes"),
                            (self.objects, "objects"), (self.ns_used, "namespace_used_bytes"),
                            (self.ns_limit, "namespace_limit_bytes"),
                            (self.ns_objects, "namespace_objects"),
                            (self.connections, "connections")):  # fmt: skip
            value = usage.get(key, -1)
            if isinstance(value, int) and value >= 0:
                metric.labels(*labels).set(value)


def enable() -> None:
    """Turn the metrics on in this process (idempotent).

    Raises :class:`MetricsUnavailableError` without ``prometheus_client``.
    """
    global _METRICS
    with _LOCK:
        if _METRICS is None:
            _METRICS = _Metrics()


def enabled() -> bool:
    """True once :func:`enable` has run in this process."""
    return _METRICS is not None


def current() -> _Metrics | None:
    """The series when on (the protocol layer's hook); None when off.

    ``HICACHE_STORAGE_METRICS=1`` (read at the first call) turns them on.
    """
    global _ENV_READ
    if _METRICS is None and not _ENV_READ:
        _ENV_READ = True  # (read once: this runs on every call of every backend)
        if os.environ.get("HICACHE_STORAGE_METRICS", "") in ("1", "true"):
            try:
                enable()
            except MetricsUnavailableError as exc:  # a backend call must not fail for it
                logging.getLogger("hicache_storage").warning(
                    "HICACHE_STORAGE_METRICS is set, but %s; metrics stay off", exc
                )
    return _METRICS


def registry() -> Any:
    """The registry to serve.

    The default one, or the sum of every process's values when
    ``PROMETHEUS_MULTIPROC_DIR`` is set.
    """
    pc = _client()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        reg = pc.CollectorRegistry()
        multiprocess.MultiProcessCollector(reg)  # type: ignore[no-untyped-call]
        return reg
    return pc.REGISTRY


def serve(port: int, addr: str = "127.0.0.1") -> Callable[[], None]:
    """Serve ``/metrics`` on ``addr:port`` on a thread (metrics turned on); a stopper."""
    enable()
    pc = _client()
    server, thread = pc.start_http_server(port, addr=addr, registry=registry())

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return stop
