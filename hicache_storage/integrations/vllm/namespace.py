"""What keeps vLLM deployments apart: the namespace of their blocks and each request's seed.

The same on every role (the scheduler and the workers compute it from the configs they
all see), so a block stored by one process is found by the others of the deployment and
by no other deployment.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

from hicache_storage.errors import ConfigError
from hicache_storage.integrations.vllm.options import ConnectorOptions
from hicache_storage.integrations.weights import model_identity
from hicache_storage.keys import KVCacheNamespace, normalize_dtype, storage_namespace_seed

__all__ = [
    "GroupShape",
    "group_shapes",
    "kv_groups",
    "model_digest",
    "namespace_for",
    "namespaces_for",
    "request_seed",
]


@dataclass(frozen=True)
class GroupShape:
    """What the connector needs of one KV cache group beyond its namespace.

    ``window``: a sliding-window group's window in tokens (None: the group keeps every
    block); ``retained``: the tokens vLLM keeps before the window as well.
    """

    layer_names: tuple[str, ...]
    window: int | None = None
    retained: int = 0

    def first_held(self, tokens: int, block_size: int) -> int:
        """The first block this group holds once ``tokens`` tokens are computed.

        vLLM's rule for a sliding window: the blocks wholly before the window (and the
        retained tokens) are null; a full-attention group holds every block.
        """
        if self.window is None:
            return 0
        return max(0, tokens - self.window + 1 - self.retained) // block_size


def kv_groups(kv_cache_config: Any) -> list[Any]:
    """The KV cache groups the connector moves; :class:`ConfigError` for anything else.

    Full attention, MLA and sliding-window groups, of one block size. With vLLM's hybrid
    allocator (the connector supports it) a model with sliding-window layers beside
    full ones has a group of each; without it, vLLM files every layer as full attention.
    """
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if not groups:
        raise ConfigError("HiCacheKVConnector found no KV cache group in vLLM's config")
    sizes = set()
    for g in groups:
        spec = g.kv_cache_spec
        sizes.add(int(getattr(spec, "block_size", 0)))
        if type(spec) in _MOVED:
            continue
        raise ConfigError(
            f"HiCacheKVConnector moves full-attention, MLA and sliding-window KV blocks, "
            f"not {type(spec).__name__} (groups: "
            f"{[type(x.kv_cache_spec).__name__ for x in groups]}): a state or chunked "
            "group is not moved yet"
        )
    if len(sizes) != 1:
        raise ConfigError(f"HiCacheKVConnector needs one block size for every group, not {sizes}")
    return groups


#: The spec classes moved (subclasses such as sinks or MLA sliding windows are not).
_MOVED = (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec)


def group_shapes(kv_cache_config: Any) -> tuple[GroupShape, ...]:
    """Each group's layers and window (see :class:`GroupShape`)."""
    out = []
    for g in kv_groups(kv_cache_config):
        spec = g.kv_cache_spec
        window = int(spec.sliding_window) if isinstance(spec, SlidingWindowSpec) else None
        retained = int(getattr(spec, "extra_retained_tokens", 0) or 0)
        out.append(GroupShape(tuple(g.layer_names), window, retained if window else 0))
    return tuple(out)


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


def namespaces_for(
    vllm_config: Any, kv_cache_config: Any, extra: dict[str, Any]
) -> tuple[KVCacheNamespace, ...]:
    """The namespaces of this vLLM deployment's blocks, one per KV cache group.

    The same on every role: built from what both the scheduler and the workers see (the
    model config, the KV cache config and the connector's extra config). A model of one
    group has the one namespace it always had. With several groups (vLLM's hybrid
    allocator), each group's blocks are objects of their own namespace, named by the
    group's place, kind, window and layers: one group's block is never read as
    another's. Raises :class:`ConfigError` for a deployment the connector does not move.
    """
    pc = vllm_config.parallel_config
    for what, size in (
        ("pipeline parallelism", getattr(pc, "pipeline_parallel_size", 1)),
        ("decode context parallelism", getattr(pc, "decode_context_parallel_size", 1)),
        ("prefill context parallelism", getattr(pc, "prefill_context_parallel_size", 1)),
    ):
        if int(size or 1) > 1:
            raise ConfigError(f"HiCacheKVConnector does not support {what} (size {size}) yet")
    groups = kv_groups(kv_cache_config)
    out = []
    for i, group in enumerate(groups):
        tag = None
        if len(groups) > 1:
            spec = group.kv_cache_spec
            kind = (
                f"swa{int(spec.sliding_window)}" if isinstance(spec, SlidingWindowSpec) else "full"
            )
            names = hashlib.sha256("\0".join(group.layer_names).encode()).hexdigest()[:8]
            tag = f"g{i}of{len(groups)}-{kind}-{names}"
        out.append(_namespace(vllm_config, kv_cache_config, group, extra, tag))
    return tuple(out)


def namespace_for(
    vllm_config: Any, kv_cache_config: Any, extra: dict[str, Any]
) -> KVCacheNamespace:
    """The namespace of the first KV cache group's blocks (see :func:`namespaces_for`)."""
    return namespaces_for(vllm_config, kv_cache_config, extra)[0]


def _namespace(
    vllm_config: Any, kv_cache_config: Any, group: Any, extra: dict[str, Any], tag: str | None
) -> KVCacheNamespace:
    """The namespace of one group's blocks (``tag`` names the group among several)."""
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
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
    if tag is not None:
        layout.append(tag)
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
