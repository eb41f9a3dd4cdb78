"""What both sides of the vLLM connector do alike.

The scheduler side (:mod:`.scheduler`) and the worker side (:mod:`.worker`) run in
different processes; each connects to the store (and, while it is unreachable, keeps
trying on a thread of its own), runs every store call from a vLLM thread within the
deadline, counts what it did and closes its backends within the deadline too. That is
:class:`ConnectorSide`; :class:`Settings` is the deployment as both see it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from hicache_storage.breaker import report_timeout
from hicache_storage.config import StorageConfig
from hicache_storage.errors import BackendError
from hicache_storage.integrations.adapterkit import failure_text
from hicache_storage.integrations.deadline import call_with_deadline
from hicache_storage.integrations.vllm.metadata import COUNTERS
from hicache_storage.integrations.vllm.namespace import GroupShape
from hicache_storage.integrations.vllm.options import ADAPTER_KEYS, ConnectorOptions
from hicache_storage.keys import KVCacheNamespace
from hicache_storage.ratelimit import RateLimitedLog

if TYPE_CHECKING:
    from collections.abc import Callable

    from hicache_storage.integrations.deadline import Job, Lane
    from hicache_storage.protocol import HiCacheStorage

__all__ = [
    "MAX_LATENCIES",
    "RETRY_FIRST_SECONDS",
    "RETRY_MAX_SECONDS",
    "ConnectorSide",
    "Settings",
]

logger = logging.getLogger("hicache_storage.integrations.vllm")

T = TypeVar("T")

#: Seconds before the first new try to reach a backend that was unreachable; the delay
#: doubles after each failed try, up to :data:`RETRY_MAX_SECONDS`.
RETRY_FIRST_SECONDS = 1.0
#: Call durations kept per operation and stats interval (vLLM sends an interval's stats
#: with each engine step; past it, calls are counted but not timed one by one).
MAX_LATENCIES = 1024
RETRY_MAX_SECONDS = 30.0


@dataclass(frozen=True)
class Settings:
    """The deployment as both sides see it, from vLLM's configs (see the connector)."""

    backend_name: str
    #: ``kv_connector_extra_config``: the backend's options and the connector's own
    #: (never in the repr: it holds the backend's secrets).
    extra_config: dict[str, Any] = field(repr=False)
    options: ConnectorOptions
    namespace: KVCacheNamespace
    tp_size: int
    #: Whether this deployment loads from the store (a KV consumer) and stores (a producer).
    load_on: bool
    save_on: bool
    #: Each KV cache group's namespace and shape (the first group's namespace is
    #: ``namespace``); one group unless vLLM's hybrid allocator made several.
    namespaces: tuple[KVCacheNamespace, ...] = ()
    groups: tuple[GroupShape, ...] = ()
    #: vLLM's KV events are on: stored blocks are published (see :mod:`.events`).
    events: bool = False

    @property
    def hybrid(self) -> bool:
        """More than one KV cache group (vLLM's hybrid allocator)."""
        return len(self.namespaces) > 1

    @property
    def whole_request_loads(self) -> bool:
        """A failed load must fail its request as a whole (loads in the background).

        With several groups vLLM takes no failed block ids (it raises); with a sliding
        window it would roll back to a length whose window it no longer holds (its
        blocks before the window are null) and compute over them.
        """
        return self.hybrid or any(g.window is not None for g in self.groups)

    def storage_config(self, tp_rank: int, group: int = 0) -> StorageConfig:
        """The backend's config for TP rank ``tp_rank`` and KV cache group ``group``.

        The connector's own keys are left out.
        """
        return StorageConfig(
            namespace=self.namespaces[group] if self.namespaces else self.namespace,
            tp_rank=tp_rank,
            tp_size=self.tp_size,
            extra_config={k: v for k, v in self.extra_config.items() if k not in ADAPTER_KEYS},
        )


class ConnectorSide:
    """The base of the scheduler and worker sides: connecting, deadlines, counters, closing.

    A subclass says when it is attached (:meth:`ready`), builds its backends
    (:meth:`_build`: :class:`BackendError` when the store cannot be reached), hands them
    over for closing (:meth:`_take_backends`) and names its lanes (:meth:`_lanes`).
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.block_size = settings.namespace.page_size
        self._log = RateLimitedLog(logger)
        self._lock = threading.Lock()
        self._interval: dict[str, Any] = {}
        #: Counters since the connector started (never reset); see :data:`COUNTERS`.
        self.totals: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        # An unreachable backend is tried again on a thread of its own (doubling delays).
        self._reconnecting = False
        self._closed = threading.Event()

    # ------------------------------------------------------------------ for subclasses

    def ready(self) -> bool:
        """True when this side's backend is attached (never blocks)."""
        raise NotImplementedError

    def _build(self) -> None:
        """Build and install this side's backends (unless closed meanwhile)."""
        raise NotImplementedError

    def _take_backends(self) -> list[HiCacheStorage]:
        """Detach every backend of this side, for closing."""
        raise NotImplementedError

    def _lanes(self) -> list[Lane]:
        raise NotImplementedError

    def _live_backends(self) -> list[HiCacheStorage]:
        """This side's backends now (not detached); none by default."""
        return []

    # ------------------------------------------------------------------ counting, logging

    def count(self, **counts: float) -> None:
        """Add to the counters (see :data:`COUNTERS`).

        Each ``<op>_seconds`` counted is one call of ``<op>``: counted in
        ``<op>_calls``, its duration kept in the interval's ``<op>_latencies`` (at most
        :data:`MAX_LATENCIES`: a sample, past it) for vLLM's Prometheus histograms.
        """
        with self._lock:
            for k, v in counts.items():
                self._interval[k] = self._interval.get(k, 0) + v
                self.totals[k] = self.totals.get(k, 0) + v
                if k.endswith("_seconds"):
                    op = k[: -len("seconds")]
                    self._interval[op + "calls"] = self._interval.get(op + "calls", 0) + 1
                    self.totals[op + "calls"] = self.totals.get(op + "calls", 0) + 1
                    kept = self._interval.setdefault(op + "latencies", [])
                    if len(kept) < MAX_LATENCIES:
                        kept.append(float(v))

    def take_interval(self) -> dict[str, Any]:
        """The counters since the last call, then zero."""
        with self._lock:
            data, self._interval = self._interval, {}
        return data

    def failure(self, exc: BaseException) -> str:
        """``exc`` as the connector logs it: without the options' secrets."""
        return failure_text(exc, self.settings.extra_config)

    def _hook_failed(self, hook: str, exc: Exception) -> None:
        """A vLLM hook raised (see :func:`~hicache_storage.integrations.adapterkit.failsafe`)."""
        self.count(hook_errors=1)
        self._log(
            "raise:" + hook,
            "HiCacheKVConnector.%s failed (%s); going on without the store",
            hook,
            self.failure(exc),
        )

    # ------------------------------------------------------------------ connecting

    def _connect(self) -> bool:
        """Build this side's backend(s); False (logged, counted) if the store is unreachable.

        Unreachable is :class:`BackendError` while the backend is built (no server, a
        refused connection, a timeout); anything else (a bad option) raises.
        """
        try:
            self._build()
        except BackendError as exc:
            self.count(connect_errors=1)
            self._log(
                "connect",
                "HiCacheKVConnector: the %s backend cannot be reached (%s); running "
                "without it (misses) and trying again",
                self.settings.backend_name,
                self.failure(exc),
                level=logging.ERROR,
            )
            return False
        return True

    def connect_or_retry(self) -> None:
        """Connect now; if the store is unreachable, keep trying on a background thread.

        vLLM starts (and runs: lookups miss, nothing is stored or loaded) without an
        unreachable store; the thread tries again after :data:`RETRY_FIRST_SECONDS`,
        doubling up to :data:`RETRY_MAX_SECONDS`, so no scheduler step or forward pass
        ever waits on a store that is down. A first try that hangs is waited for up to
        ``engine_timeout``, then left to finish (and be retried if it fails) on its own.
        A bad option raises here, as long as it is found within that time.
        """
        timeout = self.settings.options.engine_timeout
        late = threading.Event()
        if timeout <= 0:
            self._first_connect(late)
            return
        done, _ = call_with_deadline(
            lambda: self._first_connect(late), timeout, "hicache-vllm-connect"
        )
        if not done:
            late.set()
            self.count(connect_errors=1)
            self._log(
                "connect",
                "HiCacheKVConnector: the %s backend did not connect within %.1f s; running "
                "without it (misses) until it does",
                self.settings.backend_name,
                timeout,
                level=logging.ERROR,
            )

    def _first_connect(self, late: threading.Event) -> bool:
        try:
            ok = self._connect()
        except Exception as exc:
            if late.is_set():  # nobody waits to raise it: say it
                self._log(
                    "connect",
                    "HiCacheKVConnector: giving up on the backend: %s",
                    self.failure(exc),
                    level=logging.ERROR,
                )
            raise
        if not ok:
            with self._lock:
                if self._reconnecting:
                    return False
                self._reconnecting = True
            threading.Thread(target=self._retry, name="hicache-vllm-reconnect", daemon=True).start()
        return ok

    def _retry(self) -> None:
        delay = RETRY_FIRST_SECONDS
        try:
            while not self._closed.wait(delay):
                if self._connect():
                    if not self._closed.is_set():
                        logger.warning(
                            "HiCacheKVConnector: the %s backend is attached now",
                            self.settings.backend_name,
                        )
                    return
                delay = min(RETRY_MAX_SECONDS, delay * 2)
        except Exception as exc:  # noqa: BLE001 - a bad option now: stop trying, say why
            self._log(
                "connect", "HiCacheKVConnector: giving up on the backend: %s", self.failure(exc)
            )
        finally:
            self._reconnecting = False

    # ------------------------------------------------------------------ deadlines

    def on_lane(
        self, lane: Lane, fn: Callable[[Job[Any] | None], T], what: str
    ) -> tuple[bool, T | None]:
        """``(True, fn(job))``, run on ``lane`` within ``engine_timeout``; else ``(False, None)``.

        With no deadline (``engine_timeout`` 0) ``fn(None)`` runs on this thread. A call
        past its deadline, or refused because the lane's last one still runs, is counted
        (``<what>_timeouts``) and logged.
        """
        timeout = self.settings.options.engine_timeout
        if timeout <= 0:
            return True, fn(None)
        outcome, job = lane.run(fn, timeout)
        if outcome == "done":
            return True, job.result
        self.count(**{f"{what}_timeouts": 1})
        # A deadline passed: a failure for the backends' circuit breakers (a store that
        # hangs opens them, and later calls answer at once instead of queueing).
        for backend in self._live_backends():
            report_timeout(backend, write=what == "save")
        self._log(
            "deadline:" + what,
            "HiCacheKVConnector: %s; vLLM goes on without the store for it",
            f"a {what} took longer than engine_timeout ({timeout:g} s)"
            if outcome == "timeout"
            else f"the last {what} is still running past its deadline (the store hangs)",
        )
        return False, None

    # ------------------------------------------------------------------ closing

    def shutdown(self) -> None:
        """Close the backends (and stop trying to reach an unreachable one).

        Within ``engine_timeout`` in all: the backends of every shard close side by side,
        each on a daemon thread, and one that hangs is left to finish on its own.
        """
        self._closed.set()
        backends = self._take_backends()
        for lane in self._lanes():
            lane.close()
        timeout = self.settings.options.engine_timeout

        def close(b: HiCacheStorage) -> None:
            try:
                b.close()
            except Exception as exc:  # noqa: BLE001 - closing: log and go on
                self._log(
                    "close",
                    "HiCacheKVConnector: closing a backend failed: %s",
                    self.failure(exc),
                )

        if timeout <= 0:
            for b in backends:
                close(b)
            return
        threads = [
            threading.Thread(target=close, args=(b,), name="hicache-vllm-close", daemon=True)
            for b in backends
        ]
        for t in threads:
            t.start()
        end = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
        if any(t.is_alive() for t in threads):
            self._log(
                "close",
                "HiCacheKVConnector: closing the %s backend takes longer than %g s; "
                "left to finish on its own",
                self.settings.backend_name,
                timeout,
            )
