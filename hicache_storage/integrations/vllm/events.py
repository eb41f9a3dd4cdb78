"""Storage-tier KV events: which of vLLM's blocks the store holds, for routers.

With vLLM's KV events on (``kv_events_config``), each block a worker stores is a
``BlockStored`` event with vLLM's own block hash (the one its prefix cache and a
router compute), the block's tokens, and a medium that names the store
(``hicache-<backend>``). The workers hand their events to vLLM with each step
(:meth:`~.connector.HiCacheKVConnector.get_kv_connector_kv_cache_events`); the
scheduler side publishes an event once every TP worker reported it (each stores its
shard of the block), through vLLM's own publisher (ZMQ, msgpack ``KVEventBatch``).

Each event carries the block's LoRA adapter as vLLM's own do (``lora_id``,
``lora_name``), not its other extra keys (multimodal inputs, salt): those are in the
hash already.

A block a worker stored and its backend later removed itself (evicted under its
capacity bound, deleted, or cleared: what the backend reports through
:meth:`~hicache_storage.protocol.HiCacheStorage.watch_removals`) is a ``BlockRemoved``
event, published once when any rank reports it: a block with one shard gone can no
longer be loaded. What other processes or the server remove is not known.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)

__all__ = ["HiCacheKVEvents", "block_of", "medium_of", "removed_event", "stored_event"]


def medium_of(backend_name: str) -> str:
    """The medium the events name: ``hicache-<backend>``."""
    return f"hicache-{backend_name}"


def stored_event(
    block_hash: Any,
    parent: Any,
    tokens: list[int],
    block_size: int,
    medium: str,
    lora: tuple[int | None, str | None] = (None, None),
) -> BlockStored:
    """One stored block as vLLM's event (its hash as vLLM publishes hashes)."""
    return BlockStored(
        block_hashes=[block_hash],
        parent_block_hash=parent,
        token_ids=list(tokens),
        block_size=block_size,
        lora_id=lora[0],
        medium=medium,
        lora_name=lora[1],
    )


def removed_event(block_hash: Any, medium: str) -> BlockRemoved:
    """One removed block as vLLM's event."""
    return BlockRemoved(block_hashes=[block_hash], medium=medium)


def block_of(event: Any) -> tuple[Any, Any]:
    """``(hash, medium)``: which block of which store an event names (its first hash)."""
    hashes = getattr(event, "block_hashes", None) or [None]
    return hashes[0], getattr(event, "medium", None)


class HiCacheKVEvents(KVConnectorKVEvents):  # type: ignore[misc]
    """The events of one step: each worker's, counted; published once all reported it.

    vLLM joins the workers' containers (``add_events`` and ``increment_workers``) and
    hands the joined one to the scheduler side, which counts the ranks per event
    (:meth:`~.connector.HiCacheKVConnector.update_connector_output`); :meth:`aggregate`
    keeps the events every worker's rank reported.
    """

    def __init__(self, num_workers: int = 1) -> None:
        #: Every event reported, in order (a block stored, removed and stored again in
        #: one step must reach the scheduler side in that order).
        self._seen: list[Any] = []
        self._workers = max(1, int(num_workers))

    def add_events(self, events: list[KVCacheEvent]) -> None:
        """Add ``events`` (one worker's), in their order."""
        self._seen.extend(events)

    def increment_workers(self, count: int = 1) -> None:
        """One more worker's events were added."""
        self._workers += int(count)

    def aggregate(self) -> HiCacheKVEvents:
        """Keep only the events every worker reported."""
        common = self.take_common()
        self._seen = list(common)
        self._workers = 1
        return self

    def take_common(self) -> list[KVCacheEvent]:
        """The events every worker reported, removed from the count.

        The connector's workers report ``(rank, event)`` pairs: an event counts once
        per rank however often that rank reported it.
        """
        ranks: dict[Any, set[Any]] = {}
        for item in self._seen:
            rank, event = item if isinstance(item, tuple) and len(item) == 2 else (item, item)
            ranks.setdefault(event, set()).add(rank)
        out = [e for e, r in ranks.items() if len(r) >= self._workers]
        keep = set(out)
        self._seen = [
            item
            for item in self._seen
            if (item[1] if isinstance(item, tuple) and len(item) == 2 else item) not in keep
        ]
        return out

    def get_all_events(self) -> list[KVCacheEvent]:
        """Every event reported, in order (repeated as often as reported)."""
        return list(self._seen)

    def get_number_of_workers(self) -> int:
        """The workers whose events were added."""
        return self._workers

    def clear_events(self) -> None:
        """Forget everything."""
        self._seen.clear()
        self._workers = 1
