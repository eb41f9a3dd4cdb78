"""What the scheduler side tells the workers each step, and the counters both report.

The only things the two sides (different processes) share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

__all__ = [
    "COUNTERS",
    "NULL_BLOCK",
    "HiCacheConnectorMetadata",
    "HiCacheKVConnectorStats",
    "LoadSpec",
    "SaveSpec",
    "held_blocks",
]

#: Call durations an aggregate keeps per operation (vLLM's logger joins many steps').
MAX_JOINED_LATENCIES = 8192

#: The connector's counters (sums over an interval, and since start in ``totals``).
COUNTERS = (
    "connect_errors",
    "lookups",
    "lookup_blocks",
    "lookup_hit_blocks",
    "lookup_errors",
    "lookup_seconds",
    "load_blocks",
    "load_failed_blocks",
    "load_bytes",
    "load_seconds",
    "background_loads",
    "save_blocks",
    "save_partial_blocks",
    "save_failed_blocks",
    "save_bytes",
    "save_seconds",
    "save_skipped_blocks",
    "save_cut_blocks",
    "save_not_admitted_blocks",
    "lookup_timeouts",
    "load_timeouts",
    "save_timeouts",
    "hook_errors",
    "lookup_calls",
    "load_calls",
    "save_calls",
)


#: vLLM's null block: the place of a block a request does not hold (a sliding-window
#: group's blocks before the window). Never loaded, stored or tainted.
NULL_BLOCK = 0


def held_blocks(groups: list[list[int]]) -> set[int]:
    """Every block of ``groups`` (one list per KV cache group) but the null block."""
    return {b for ids in groups for b in ids if b != NULL_BLOCK}


@dataclass
class LoadSpec:
    """Blocks of one request to read from the store.

    ``block_ids`` has one list per KV cache group, one block per key; a null block is a
    place the group does not hold (nothing to read). Before the forward pass, or with
    ``background`` while vLLM runs other requests (the request waits for it; the
    workers report it in ``get_finished``). ``failed``: a background load that could
    not be planned, reported as failed at once.
    """

    req_id: str
    keys: list[str]
    block_ids: list[list[int]]
    background: bool = False
    failed: bool = False


@dataclass
class SaveSpec:
    """Newly computed full blocks of one request to store after the forward pass.

    ``block_ids`` and ``prefix_block_ids`` have one list per KV cache group (a null
    block: a place the group does not hold, not stored). ``prefix_block_ids`` are the
    request's blocks from its first up to the last one stored here; those from ``computed_from`` on were computed by this request, the
    ones before it came from vLLM's prefix cache or from the store. The worker stores
    nothing computed over a block that failed to load (see
    :meth:`~hicache_storage.integrations.vllm.worker.WorkerSide.wait_for_save`).
    """

    req_id: str
    keys: list[str]
    block_ids: list[list[int]]
    prefix_block_ids: list[list[int]] = field(default_factory=list)
    computed_from: int = 0
    #: The last, partly computed block of a finished request (counted apart).
    partial: bool = False
    #: With vLLM's KV events on: per key, vLLM's block hash, its parent's, the block's
    #: tokens and its LoRA (id, name): a stored block is published as a ``BlockStored``.
    events: list[tuple[Any, Any, list[int], tuple[Any, Any]] | None] = field(default_factory=list)


@dataclass
class HiCacheConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler side tells the workers for one step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    #: Blocks handed to a request afresh in this step (their old taint is void, and a
    #: store still reading them is cut before the forward pass writes them).
    fresh_blocks: list[int] = field(default_factory=list)
    fresh_done: bool = False
    #: Set by the worker once ``wait_for_save`` has queued this step's saves.
    saves_queued: bool = False
    #: Finished requests whose blocks vLLM keeps until their stores have read them
    #: (``request_finished`` answered True): the workers report each in ``get_finished``.
    delayed_frees: list[str] = field(default_factory=list)


@dataclass
class HiCacheKVConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """The connector's counters over an interval (sums; see :data:`COUNTERS`)."""

    def reset(self) -> None:
        """Zero every counter."""
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> HiCacheKVConnectorStats:
        """Add ``other``'s counters to these (workers and scheduler sum).

        Call durations (``<op>_latencies``) are joined, up to :data:`MAX_JOINED_LATENCIES`.
        """
        for k, v in (other.data or {}).items():
            if isinstance(v, list):
                self.data[k] = [*self.data.get(k, []), *v][:MAX_JOINED_LATENCIES]
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's totals, with bandwidths in GB/s."""
        d = self.data
        out: dict[str, int | float] = {k: d[k] for k in COUNTERS if d.get(k)}
        for what in ("load", "save"):
            secs = d.get(f"{what}_seconds", 0.0)
            if secs > 0:
                out[f"{what}_gbps"] = round(d.get(f"{what}_bytes", 0) / secs / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        """True when no counter moved."""
        return not any(self.data.values())
