"""The connector's counters as Prometheus metrics on vLLM's own ``/metrics``.

vLLM sends each step's connector stats (the workers' and the scheduler's, summed:
:class:`~hicache_storage.integrations.vllm.metadata.HiCacheKVConnectorStats`) to the
process that serves ``/metrics``, and records them through the metrics object the
connector class builds (:meth:`HiCacheKVConnector.build_prom_metrics`): this module's
:class:`HiCachePromMetrics`. So every process of the deployment (engine core, TP
workers) is counted, in the one process that serves them, with no multiprocess files.

Labels are bounded: vLLM's own (model name, engine index), the backend's registry name,
and the operation, result or error kind below; never a key, a tenant or a URL.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

__all__ = ["BLOCK_RESULTS", "ERRORS", "LATENCY_BUCKETS", "HiCachePromMetrics"]

#: Histogram buckets for one store call, in seconds: from a page-cache hit of a small
#: page (tens of microseconds) to a remote store under load (seconds).
LATENCY_BUCKETS = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
    100e-3, 250e-3, 500e-3, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

#: ``(operation, result)`` of ``vllm:hicache_blocks_total`` and the counter(s) each sums;
#: a lookup's misses are its blocks less its hits.
BLOCK_RESULTS: dict[tuple[str, str], tuple[str, ...]] = {
    ("lookup", "hit"): ("lookup_hit_blocks",),
    ("load", "ok"): ("load_blocks",),
    ("load", "failed"): ("load_failed_blocks",),
    ("save", "ok"): ("save_blocks",),
    ("save", "partial"): ("save_partial_blocks",),
    ("save", "failed"): ("save_failed_blocks",),
    ("save", "skipped"): ("save_skipped_blocks",),
    ("save", "cut"): ("save_cut_blocks",),
    ("save", "not_admitted"): ("save_not_admitted_blocks",),
}

#: ``kind`` of ``vllm:hicache_errors_total`` and its counter.
ERRORS = {
    "connect": "connect_errors",
    "lookup": "lookup_errors",
    "hook": "hook_errors",
    "lookup_timeout": "lookup_timeouts",
    "load_timeout": "load_timeouts",
    "save_timeout": "save_timeouts",
}


class HiCachePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """The connector's series, registered once per vLLM ``/metrics`` process."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        backend: str,
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._backend = backend
        base = [*labelnames, "backend"]
        self._blocks = self._counter_cls(
            name="vllm:hicache_blocks_total",
            documentation="KV blocks by operation (lookup, load, save) and result.",
            labelnames=[*base, "operation", "result"],
        )
        self._bytes = self._counter_cls(
            name="vllm:hicache_bytes_total",
            documentation="KV bytes loaded from and stored to the hicache-storage backend.",
            labelnames=[*base, "operation"],
        )
        self._calls = self._counter_cls(
            name="vllm:hicache_operations_total",
            documentation="Store calls by operation (a lookup, a step's load, a store).",
            labelnames=[*base, "operation"],
        )
        self._background = self._counter_cls(
            name="vllm:hicache_background_loads_total",
            documentation="Hits loaded while vLLM runs other requests.",
            labelnames=base,
        )
        self._errors = self._counter_cls(
            name="vllm:hicache_errors_total",
            documentation="Connector errors and deadlines passed, by kind.",
            labelnames=[*base, "kind"],
        )
        self._seconds = self._histogram_cls(
            name="vllm:hicache_operation_seconds",
            documentation="Duration of one store call, by operation.",
            labelnames=[*base, "operation"],
            buckets=list(LATENCY_BUCKETS),
        )
        self._bound: dict[tuple[Any, ...], Any] = {}

    def _series(self, metric: Any, engine_idx: int, *labels: str) -> Any:
        key = (id(metric), engine_idx, *labels)
        got = self._bound.get(key)
        if got is None:
            values = [*self.per_engine_labelvalues[engine_idx], self._backend, *labels]
            got = self._bound[key] = metric.labels(*values)
        return got

    def observe(self, transfer_stats_data: dict[str, Any] | None, engine_idx: int = 0) -> None:
        """Add one interval's stats (summed over the deployment's processes)."""
        data = transfer_stats_data or {}

        def n(key: str) -> float:
            v = data.get(key, 0)
            return float(v) if isinstance(v, (int, float)) else 0.0

        for (op, result), keys in BLOCK_RESULTS.items():
            v = sum(n(k) for k in keys)
            if v > 0:
                self._series(self._blocks, engine_idx, op, result).inc(v)
        misses = n("lookup_blocks") - n("lookup_hit_blocks")
        if misses > 0:
            self._series(self._blocks, engine_idx, "lookup", "miss").inc(misses)
        for op in ("load", "save"):
            if n(f"{op}_bytes") > 0:
                self._series(self._bytes, engine_idx, op).inc(n(f"{op}_bytes"))
        if n("background_loads") > 0:
            self._series(self._background, engine_idx).inc(n("background_loads"))
        for kind, key in ERRORS.items():
            if n(key) > 0:
                self._series(self._errors, engine_idx, kind).inc(n(key))
        for op in ("lookup", "load", "save"):
            if n(f"{op}_calls") > 0:
                self._series(self._calls, engine_idx, op).inc(n(f"{op}_calls"))
            times = data.get(f"{op}_latencies") or ()
            if not isinstance(times, list) or not times:
                continue
            # (At most 1024 durations per step and side: past it, a sample.)
            hist = self._series(self._seconds, engine_idx, op)
            for t in times:
                hist.observe(float(t))
