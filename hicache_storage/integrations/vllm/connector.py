"""The class vLLM loads: :class:`HiCacheKVConnector`, a thin facade over the two sides.

vLLM builds one connector per role: in the scheduler process it is the scheduler side
(:class:`~hicache_storage.integrations.vllm.scheduler.SchedulerSide`), in each worker
the worker side (:class:`~hicache_storage.integrations.vllm.worker.WorkerSide`). This
class checks the config, builds what both sides see (:class:`Settings`) and hands every
hook of vLLM's connector API to its side.
"""

from __future__ import annotations

import collections
import logging
import weakref
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from hicache_storage.errors import ConfigError
from hicache_storage.integrations.adapterkit import backend_name_of
from hicache_storage.integrations.vllm.events import HiCacheKVEvents, block_of
from hicache_storage.integrations.vllm.metadata import (
    HiCacheConnectorMetadata,
    HiCacheKVConnectorStats,
)
from hicache_storage.integrations.vllm.namespace import group_shapes, namespaces_for
from hicache_storage.integrations.vllm.options import ConnectorOptions
from hicache_storage.integrations.vllm.prom import HiCachePromMetrics
from hicache_storage.integrations.vllm.scheduler import SchedulerSide
from hicache_storage.integrations.vllm.side import ConnectorSide, Settings
from hicache_storage.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch

    from hicache_storage.integrations.kvblocks import KVBlockMover
    from hicache_storage.keys import KVCacheNamespace
    from hicache_storage.protocol import HiCacheStorage

__all__ = ["LIVE", "HiCacheKVConnector"]

logger = logging.getLogger("hicache_storage.integrations.vllm")

#: Stored-block events waiting for the other TP workers' at most (and published events
#: remembered, so that a block stored again is not published again).
MAX_REPORTED = 65536


def _events_on(vllm_config: Any, kv_cache_config: Any, block_size: int) -> bool:
    """Whether stored blocks are published.

    vLLM's KV events on, and its block hashes one per block of the connector
    (``hash_block_size`` the block size).
    """
    events = getattr(vllm_config, "kv_events_config", None)
    if not getattr(events, "enable_kv_cache_events", False):
        return False
    unit = getattr(kv_cache_config, "hash_block_size", None)
    if unit is not None and int(unit) != block_size:
        logger.warning(
            "HiCacheKVConnector: vLLM hashes blocks of %s tokens, the connector stores "
            "blocks of %d: its stored blocks are not published as KV events",
            unit,
            block_size,
        )
        return False
    return True


#: Every live connector of this process (tests and tools read their totals).
LIVE: weakref.WeakSet[HiCacheKVConnector] = weakref.WeakSet()


class HiCacheKVConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """vLLM's KV connector v1 over any hicache-storage backend (see the package docs).

    It supports vLLM's hybrid allocator (``SupportsHMA``): a model with sliding-window
    layers beside full ones keeps a KV cache group of each, and only each request's
    window of sliding-window blocks.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        name = backend_name_of(extra, "kv_connector_extra_config")
        options = ConnectorOptions.from_extra(extra)
        if kv_cache_config is None:
            raise ConfigError("HiCacheKVConnector needs vLLM's KV cache config (vLLM >= 0.32)")
        namespaces = namespaces_for(vllm_config, kv_cache_config, extra)
        shapes = group_shapes(kv_cache_config)
        self.settings = Settings(
            backend_name=name,
            extra_config=extra,
            options=options,
            namespace=namespaces[0],
            namespaces=namespaces,
            groups=shapes,
            events=_events_on(vllm_config, kv_cache_config, namespaces[0].page_size),
            tp_size=int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1),
            load_on=bool(getattr(ktc, "is_kv_consumer", True)),
            save_on=bool(getattr(ktc, "is_kv_producer", True)),
        )
        #: Stored-block events the workers reported ((hash, medium) -> the event and the
        #: ranks that did), until every writing rank has; the blocks published lately
        #: (not published again while they stay); and the events ready for vLLM.
        self._reported: dict[tuple[Any, Any], tuple[Any, set[int]]] = {}
        self._published: collections.OrderedDict[tuple[Any, Any], None] = collections.OrderedDict()
        self._outbox: list[Any] = []
        self.connector_scheduler: SchedulerSide | None = None
        self.connector_worker: WorkerSide | None = None
        self._side: ConnectorSide
        if role == KVConnectorRole.SCHEDULER:
            self._side = self.connector_scheduler = SchedulerSide(self.settings)
            self.connector_scheduler.connect_or_retry()
            policy = getattr(ktc, "kv_load_failure_policy", "fail")
            if policy != "recompute" and self.settings.load_on:
                logger.warning(
                    "HiCacheKVConnector: kv_load_failure_policy is %r: a block the store "
                    "fails to deliver (lost, damaged, unreachable) fails its request. Set "
                    "it to 'recompute' to have vLLM recompute such blocks instead.",
                    policy,
                )
        else:
            self._side = self.connector_worker = WorkerSide(
                self.settings,
                [list(shape.layer_names) for shape in shapes],
                int(kv_cache_config.num_blocks),
            )
        LIVE.add(self)

    # ------------------------------------------------------------------ what tools read

    @property
    def backend_name(self) -> str:
        """The backend's name (``backend_name``)."""
        return self.settings.backend_name

    @property
    def extra_config(self) -> dict[str, Any]:
        """``kv_connector_extra_config`` as given."""
        return self.settings.extra_config

    @property
    def options(self) -> ConnectorOptions:
        """The connector's own options."""
        return self.settings.options

    @property
    def namespace(self) -> KVCacheNamespace:
        """The namespace of this deployment's blocks."""
        return self.settings.namespace

    @property
    def block_size(self) -> int:
        """VLLM's block size, in tokens (a page)."""
        return self.settings.namespace.page_size

    @property
    def totals(self) -> dict[str, float]:
        """Counters since the connector started (never reset)."""
        return self._side.totals

    @property
    def backend(self) -> HiCacheStorage | None:
        """The worker's backend (None on the scheduler, or until attached)."""
        return self.connector_worker.backend if self.connector_worker is not None else None

    @property
    def mover(self) -> KVBlockMover | None:
        """The worker's block mover (None on the scheduler, or until attached)."""
        return self.connector_worker.mover if self.connector_worker is not None else None

    def keys_for(self, request: Any) -> list[str] | None:
        """The keys of the full blocks of ``request``'s prompt; None: not cacheable."""
        return SchedulerSide.keys_for(self._side, request)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ scheduler side

    def _scheduler(self) -> SchedulerSide:
        if self.connector_scheduler is None:
            raise RuntimeError("a scheduler hook called on a worker's HiCacheKVConnector")
        return self.connector_scheduler

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """See :meth:`SchedulerSide.get_num_new_matched_tokens`."""
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """See :meth:`SchedulerSide.update_state_after_alloc`."""
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> HiCacheConnectorMetadata:
        """See :meth:`SchedulerSide.build_connector_meta`."""
        return self._scheduler().build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """See :meth:`SchedulerSide.request_finished` (one KV cache group)."""
        return self._scheduler().request_finished(request, (list(block_ids),))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """See :meth:`SchedulerSide.request_finished` (a block list per KV cache group)."""
        return self._scheduler().request_finished(request, tuple(block_ids))

    # ------------------------------------------------------------------ worker side

    def _worker(self) -> WorkerSide:
        if self.connector_worker is None:
            raise RuntimeError("a worker hook called on the scheduler's HiCacheKVConnector")
        return self.connector_worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """See :meth:`WorkerSide.register_kv_caches`."""
        self._worker().register_kv_caches(kv_caches)

    def _meta(self) -> HiCacheConnectorMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, HiCacheConnectorMetadata) else None

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Take the step's metadata; then see :meth:`WorkerSide.before_step`.

        vLLM binds it before the forward pass in every step, with or without loads
        (``start_load_kv`` may come after the forward pass when nothing loads).
        """
        super().bind_connector_metadata(connector_metadata)
        meta = self._meta()
        if meta is not None and self.connector_worker is not None:
            self.connector_worker.before_step_safely(meta)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """See :meth:`WorkerSide.before_step`.

        VLLM calls this before it writes any block of the step (zeroing, copies),
        earlier than :meth:`bind_connector_metadata`.
        """
        meta = kv_connector_metadata
        if isinstance(meta, HiCacheConnectorMetadata) and self.connector_worker is not None:
            self.connector_worker.before_step_safely(meta)

    def get_kv_connector_kv_cache_events(self) -> HiCacheKVEvents | None:
        """This worker's stored-block events of the step (vLLM's KV events on).

        Each is passed as ``(rank, event)``: the scheduler side counts ranks, not
        reports (a rank storing a block twice is still one rank).
        """
        worker = self.connector_worker
        if not self.settings.events or worker is None:
            return None
        events = HiCacheKVEvents(1)  # (an empty one still counts this worker)
        events.add_events([(worker.rank, e) for e in worker.take_events()])
        return events

    def update_connector_output(self, connector_output: Any) -> None:
        """Note which ranks stored or removed which blocks (the scheduler's side).

        A stored block is ready once every writing rank reported it (MLA: rank 0
        alone writes); a removal of a published block is ready when any rank reports
        it (one shard gone and the block cannot load); each is published once.
        """
        events = getattr(connector_output, "kv_cache_events", None)
        if not isinstance(events, HiCacheKVEvents):
            return
        quorum = 1 if self.settings.namespace.rank_replicated else self.settings.tp_size
        for item in events.get_all_events():
            if not (isinstance(item, tuple) and len(item) == 2):
                continue
            rank, event = item
            block = block_of(event)
            if isinstance(event, BlockRemoved):
                self._reported.pop(block, None)  # (never published now)
                if block in self._published:
                    del self._published[block]
                    self._outbox.append(event)
                continue
            _, ranks = self._reported.setdefault(block, (event, set()))
            ranks.add(int(rank))
            if len(ranks) < quorum:
                continue
            del self._reported[block]
            if block in self._published:  # (stored again by a later request)
                self._published.move_to_end(block)
                continue
            self._published[block] = None
            self._outbox.append(event)
        if len(self._reported) > MAX_REPORTED:  # (a rank that never reports): oldest out
            for block in list(self._reported)[: len(self._reported) - MAX_REPORTED // 2]:
                del self._reported[block]
        while len(self._published) > MAX_REPORTED:
            self._published.popitem(last=False)
        del self._outbox[:-MAX_REPORTED]

    def take_events(self) -> Any:
        """The blocks' events ready since the last call, each once.

        ``BlockStored`` of blocks every writing rank stored, ``BlockRemoved`` of
        published blocks removed since.
        """
        out, self._outbox = self._outbox, []
        yield from out

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose stores are done (delayed frees) and whose background loads are."""
        results = self.get_transfer_results(finished_req_ids)
        return (results.finished_sending or None), (results.finished_recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """See :meth:`WorkerSide.get_finished` and :meth:`WorkerSide.finished_loads`.

        A background load that could not be planned is also in ``failed_recving``: vLLM
        recomputes its request as a whole.
        """
        worker = self._worker()
        sent = worker.get_finished_safely(self._meta(), set(finished_req_ids or ()))
        loaded, failed = worker.finished_loads_safely()
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=loaded, failed_recving=failed
        )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """See :meth:`WorkerSide.start_load_kv`."""
        meta = self._meta()
        if meta is not None:
            self._worker().start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: :meth:`start_load_kv` loads every layer before returning."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing per layer: a stored block holds every layer, stored in :meth:`wait_for_save`."""

    def wait_for_save(self) -> None:
        """See :meth:`WorkerSide.wait_for_save`."""
        meta = self._meta()
        if meta is not None:
            self._worker().wait_for_save(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """See :meth:`WorkerSide.get_block_ids_with_load_errors`."""
        return self._worker().get_block_ids_with_load_errors()

    # ------------------------------------------------------------------ both sides

    def get_kv_connector_stats(self) -> HiCacheKVConnectorStats | None:
        """The counters since the last call (then reset), or None when none moved."""
        stats = HiCacheKVConnectorStats(data=self._side.take_interval())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> HiCacheKVConnectorStats:
        """VLLM rebuilds the workers' stats from their dicts with this."""
        return HiCacheKVConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> HiCachePromMetrics:
        """The connector's series on vLLM's ``/metrics`` (see :mod:`.prom`)."""
        ktc = vllm_config.kv_transfer_config
        extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
        backend = str(extra.get("backend_name", "unknown"))
        return HiCachePromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues, backend
        )

    def shutdown(self) -> None:
        """Close the backends (and stop trying to reach an unreachable one)."""
        self._side.shutdown()
