"""Engine adapters: any hicache-storage backend inside an inference engine.

* :mod:`hicache_storage.integrations.sglang` -- ``SGLangStorage``, a subclass of SGLang's
  own ``HiCacheStorage``, loaded by SGLang's ``dynamic`` storage backend.
* :mod:`hicache_storage.integrations.vllm` -- ``HiCacheKVConnector``, a vLLM KV connector
  v1, loaded through ``kv_connector_module_path`` (a package: a facade over the
  scheduler side and the worker side, as vLLM's own connectors are laid out).
* :mod:`hicache_storage.integrations.adapterkit` -- what both adapters share: the
  ``backend_name`` check, the failsafe hook decorator, scrubbed failure texts (no engine
  import).
* (In the core, used by the SGLang adapter and checked by the kit:
  :mod:`hicache_storage.poolview`, SGLang-style host pools as the SDK's page protocol
  reads them, and :mod:`hicache_storage.sidepools`, a hybrid model's side pools in
  namespaces of their own and the hit rules over them.)
* :mod:`hicache_storage.integrations.kvblocks` -- a paged engine's KV tensors as a pool
  of whole-block pages (no engine import), which the vLLM connector moves.
* :mod:`hicache_storage.integrations.deadline` -- calls into a store that an engine
  thread waits for only until a deadline (no engine import).
* :mod:`hicache_storage.integrations.weights` -- a model's identity: its resolved
  location and a fingerprint of its weights (no engine import).

Each adapter imports its engine when it is imported, never before: ``import
hicache_storage`` imports no engine.
"""

#: Extra-config keys the SGLang adapter itself reads (never passed to the backend):
#: ``model_id`` when SGLang has no served model name; ``kv_cache_dtype`` when the host
#: pool stores the KV cache as raw bytes (SGLang keeps every fp8 format as uint8);
#: ``tenant`` and ``weights_fingerprint`` to keep apart deployments that share a model
#: name but not their bytes (another checkpoint, other numerics); ``engine_timeout``
#: (the longest SGLang's scheduler and prefetch threads wait for the store in one call).
#: See ``AdapterOptions`` there.
SGLANG_ADAPTER_KEYS = frozenset(
    {
        "model_id",
        "kv_cache_dtype",
        "tenant",
        "weights_fingerprint",
        "engine_timeout",
        "total_kv_heads",
    }
)

#: Extra-config keys the vLLM connector itself reads (never passed to the backend):
#: ``model_id`` to name the model when its path is not a stable identity; ``tenant`` and
#: ``weights_fingerprint`` as for SGLang; ``staging`` (force or forbid the host staging
#: buffer) and ``staging_blocks`` (its size in blocks); ``engine_timeout`` (the longest
#: a vLLM thread waits for the store in one call). See ``ConnectorOptions`` there.
VLLM_ADAPTER_KEYS = frozenset(
    {
        "model_id",
        "tenant",
        "weights_fingerprint",
        "staging",
        "staging_blocks",
        "engine_timeout",
        "store_output_tokens",
        "async_saves",
        "async_loads",
        "partial_blocks",
        "admit_after",
    }
)
