"""The vLLM connector's own options (the keys of :data:`ADAPTER_KEYS`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from hicache_storage.admission import MAX_MIN_SEEN
from hicache_storage.config import parse_options
from hicache_storage.errors import ConfigError
from hicache_storage.integrations import VLLM_ADAPTER_KEYS

__all__ = ["ADAPTER_KEYS", "ConnectorOptions"]

#: The keys the connector reads itself (see :mod:`hicache_storage.integrations`).
ADAPTER_KEYS = VLLM_ADAPTER_KEYS


@dataclass(frozen=True)
class ConnectorOptions:
    """The connector's own keys of ``kv_connector_extra_config`` (see :data:`ADAPTER_KEYS`).

    Each may also come from ``HICACHE_STORAGE_VLLM_CONNECTOR_<NAME>``.

    Attributes:
        model_id: the model's name in the namespace, for deployments whose paths differ
            (default: the resolved model path, or hub id and revision).
        tenant: kept apart from every other tenant's pages.
        weights_fingerprint: added to the fingerprint the connector takes of the weights.
        staging: ``True`` forces the host staging buffer, ``False`` forbids it (then
            ``engine_timeout`` must be 0), unset: staged when vLLM's KV is not in CPU
            memory, or when ``engine_timeout`` is on.
        staging_blocks: blocks per staging lane (loads and stores each have one).
        engine_timeout: seconds a vLLM thread waits for the store in one call (a lookup,
            a step's loads, a step's stores); 0 waits as long as the store takes.
        store_output_tokens: the most generated tokens of one request whose full blocks
            are stored (so a chat's next turn, whose prompt holds this answer, hits
            through it); 0 stores prompt blocks only.
        async_saves: store off the critical path: the step does not wait for its
            stores, and a finished request's blocks are freed once its stores have read
            them (or ``engine_timeout`` after it finished); ``False`` stores within the
            step, before vLLM can free the blocks.
        async_loads: ``True``: a hit is loaded in the background while vLLM runs other
            requests (the request waits for it; vLLM's ``WAITING_FOR_REMOTE_KVS``);
            ``False``: loaded before the forward pass of its first step; unset: in the
            background while other requests run (so a large load never stalls their
            decoding), else before the forward pass (the lowest TTFT for a lone
            request), and always before it with tensor parallelism.
        partial_blocks: a finished request's last, partly computed block (the end of an
            answer) is stored with the tokens that have KV, and a lookup whose full
            blocks end right before such a block loads it too, so the next turn computes
            from where the answer's KV ends, not from that block's start (with
            ``async_saves``; one object per finished request, and per lookup that ends
            inside a block one batched existence query of up to ``block_size - 1`` keys
            per rank).
        admit_after: store a block only once this many requests have had it (counted in
            the scheduler across requests, in fixed memory:
            :mod:`hicache_storage.admission`); 1 stores every block computed. A block a
            request does not store is computed again by the next request that needs it
            after vLLM's own cache lost it.
    """

    model_id: str | None = None
    tenant: str = ""
    weights_fingerprint: str = ""
    staging: bool | None = None
    staging_blocks: int = 16
    engine_timeout: float = 5.0
    store_output_tokens: int = 8192
    async_saves: bool = True
    async_loads: bool | None = None
    partial_blocks: bool = True
    admit_after: int = 1

    def __post_init__(self) -> None:
        """Check the options; :class:`ConfigError` says what is allowed."""
        if not 1 <= self.staging_blocks <= 1 << 16:
            raise ConfigError(
                f"staging_blocks={self.staging_blocks} must be a whole number of blocks "
                "from 1 to 65536"
            )
        if not 0 <= self.engine_timeout <= threading.TIMEOUT_MAX:
            raise ConfigError(
                f"engine_timeout={self.engine_timeout} must be from 0 to "
                f"{threading.TIMEOUT_MAX:g} seconds (0: no deadline)"
            )
        if not 0 <= self.store_output_tokens <= 1 << 30:
            raise ConfigError(
                f"store_output_tokens={self.store_output_tokens} must be a whole number of "
                "tokens from 0 (prompt blocks only) to 2**30"
            )
        if isinstance(self.admit_after, bool) or not 1 <= self.admit_after <= MAX_MIN_SEEN:
            raise ConfigError(
                f"admit_after={self.admit_after} must be a whole number of requests from 1 "
                f"(store every block) to {MAX_MIN_SEEN}"
            )
        if self.staging is False and self.engine_timeout > 0:
            raise ConfigError(
                "staging=false needs engine_timeout=0: a call cut at its deadline must "
                "not touch vLLM's KV afterwards, so calls with a deadline go through the "
                "staging buffer"
            )

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorOptions:
        """The options in vLLM's extra config; :class:`ConfigError` says what is allowed."""
        # (a key given as null, or staging or async_loads as "", is unset: its default)
        given = {
            k: extra[k]
            for k in ADAPTER_KEYS
            if extra.get(k) is not None and not (k in ("staging", "async_loads") and extra[k] == "")
        }
        return parse_options(cls, "vllm-connector", given)
