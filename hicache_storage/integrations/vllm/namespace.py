"""What keeps vLLM deployments apart: the namespace of their blocks and each request's seed.

The same on every role (the scheduler and the workers compute it from the configs they
all see), so a block stored by one process is found by the others of the deployment and
by no other deployment.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from hicache_storage.errors import ConfigError
from hicache_storage.integrations.vllm.options import ConnectorOptions
from hicache_storage.integrations.weights import model_identity
from hicache_storage.keys import KVCacheNamespace, normalize_dtype, storage_namespace_seed

__all__ = ["model_digest", "namespace_for", "request_seed", "the_group"]


def the_group(kv_cache_config: Any) -> Any:
    """The one KV cache group the connector moves; :class:`ConfigError` for anything else."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        raise ConfigError(
            f"HiCacheKVConnector moves models with one KV cache group; this one has "
            f"{len(groups)} ({[type(g.kv_cache_spec).__name__ for g in groups]})"
        )
    spec = groups[0].kv_cache_spec
    # A model with sliding-window or chunked layers beside full ones: vLLM (its hybrid
    # allocator off, as it turns it off for this connector) files every layer as full
    # attention, the window kept on the spec: every block of every layer stays, so the
    # blocks move as any full-attention block does.
    if not isinstance(spec, (FullAttentionSpec, MLAAttentionSpec)):
        local = "sliding-window" if getattr(spec, "sliding_window", None) else "local"
        raise ConfigError(
            f"HiCacheKVConnector moves full-attention KV blocks, not {type(spec).__name__}: "
            f"in a model whose every layer is {local}, vLLM keeps only each request's "
            "window of blocks, which the connector does not move yet"
        )
    return groups[0]


#: Keys of a model's resolved HF config that do not change what its KV holds.
_NEUTRAL_CONFIG_KEYS = frozenset(
    {"_name_or_path", "name_or_path", "transformers_version", "_commit_hash"}
)


def model_digest(model_config: Any) -> str:
    """A digest of what in vLLM's model config changes the KV of given tokens.

    The resolved HF config (after vLLM's ``hf_overrides``: RoPE theta and scaling, norms,
    heads...), the weight quantization and the model dtype. Two deployments of one model
    path that differ in any of them compute other KV for the same tokens: they must not
    share blocks. Deliberately broad: a config change that would not change the KV only
    costs a cold store.
    """
    try:
        hf = model_config.hf_config.to_dict()
    except Exception:  # noqa: BLE001 - no HF config object: its repr
        hf = {"repr": repr(getattr(model_config, "hf_config", None))}
    factors = {
        "hf_config": {k: v for k, v in hf.items() if k not in _NEUTRAL_CONFIG_KEYS},
        "quantization": getattr(model_config, "quantization", None),
        "dtype": str(getattr(model_config, "dtype", "")),
    }
    blob = json.dumps(factors, sort_keys=True, default=_stable_str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _stable_str(obj: object) -> str:
    """``str(obj)`` without memory addresses (every process must get the same digest)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", str(obj))


def namespace_for(
    vllm_config: Any, kv_cache_config: Any, extra: dict[str, Any]
) -> KVCacheNamespace:
    """The namespace of the blocks of this vLLM deployment (the same on every role).

    Built from what both the scheduler and the workers see: the model config, the KV
    cache config and the connector's extra config. Raises :class:`ConfigError` for a
    deployment the connector does not move (see the module's "Not supported").
    """
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    for what, size in (
        ("pipeline parallelism", getattr(pc, "pipeline_parallel_size", 1)),
        ("decode context parallelism", getattr(pc, "decode_context_parallel_size", 1)),
        ("prefill context parallelism", getattr(pc, "prefill_context_parallel_size", 1)),
    ):
        if int(size or 1) > 1:
            raise ConfigError(f"HiCacheKVConnector does not support {what} (size {size}) yet")
    group = the_group(kv_cache_config)
    spec = group.kv_cache_spec
    mla = isinstance(spec, MLAAttentionSpec) or bool(getattr(mc, "use_mla", False))
    # The weights' identity: a relative path or an unpinned name says nothing of them.
    load_format = str(getattr(getattr(vllm_config, "load_config", None), "load_format", ""))
    if load_format == "dummy":  # vLLM's seeded random weights: the same in every process
        resolved, weights = str(mc.model), "dummy"
    else:
        resolved, weights = model_identity(str(mc.model), getattr(mc, "revision", None))
    opts = ConnectorOptions.from_extra(extra)
    model_id = opts.model_id or resolved
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
    # With head groups a page is filed by its groups (the same at every TP size), not
    # by the rank's head count.
    grouped = bool(extra.get("head_groups")) and not mla
    layout = [
        "vllm",
        str(getattr(kv_cache_config, "kv_cache_layout", None) or "default"),
        "hg" if grouped else f"h{int(spec.num_kv_heads)}",
        f"d{int(spec.head_size)}",
        f"L{len(group.layer_names)}",
    ]
    head_size_v = getattr(spec, "head_size_v", None)
    if head_size_v is not None and int(head_size_v) != int(spec.head_size):
        layout.append(f"v{int(head_size_v)}")
    quant = getattr(spec, "kv_quant_mode", None)
    if quant is not None and str(getattr(quant, "name", quant)) != "NONE":
        layout.append(f"q{getattr(quant, 'name', quant)}")
    if cache_dtype != "auto":
        layout.append(cache_dtype)  # fp8 variants may share a torch dtype
    fingerprint = f"w-{weights}+vllm-cfg-{model_digest(mc)}"
    if opts.weights_fingerprint:
        fingerprint = f"{opts.weights_fingerprint}+{fingerprint}"
    fields: dict[str, Any] = {
        "model_id": str(model_id),
        "dtype": normalize_dtype(spec.dtype),
        "page_size": int(spec.block_size),
        "object_layout": "-".join(layout),
        "rank_replicated": mla,
        "weights_fingerprint": fingerprint,
        "tenant": opts.tenant,
    }
    if not mla:
        total = int(mc.get_total_num_kv_heads())
        per = int(spec.num_kv_heads)
        tp = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        if (tp > 1 or grouped) and total > 0 and per > 0 and total % per == 0:
            fields["total_kv_heads"] = total
            fields["kv_heads_per_shard"] = per
    return KVCacheNamespace(**fields)


def request_seed(request: Any) -> tuple[bool, str | None]:
    """``(usable, seed)`` of a vLLM request's block chain.

    Unusable: a prompt given as embeddings. The seed folds in what changes the KV of the
    same token ids: the LoRA adapter, multimodal inputs (by identifier and position) and
    ``cache_salt``; ``None`` when there is none of them.
    """
    if getattr(request, "prompt_embeds", None) is not None:
        return False, None
    parts = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        name = getattr(lora, "lora_name", "") or ""
        path = getattr(lora, "lora_path", "") or getattr(lora, "path", "") or ""
        parts.append(f"lora:{name}:{path}:{getattr(lora, 'lora_int_id', '')}")
    for f in getattr(request, "mm_features", None) or ():
        pos = getattr(f, "mm_position", None)
        offset = getattr(pos, "offset", "?")
        length = getattr(pos, "length", "?")
        parts.append(f"mm:{getattr(f, 'identifier', '?')}@{offset}+{length}")
    salt = getattr(request, "cache_salt", None)
    extra_key = "|".join(parts) if parts else None
    return True, storage_namespace_seed(extra_key, salt if salt else None)
