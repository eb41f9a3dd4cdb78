"""Any hicache-storage backend inside SGLang: :class:`SGLangStorage`.

SGLang (0.5.23) loads a third-party L3 backend through its ``dynamic`` storage backend::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "file",
        "module_path": "hicache_storage.integrations.sglang", "class_name": "SGLangStorage",
        "interface_v1": true, "root": "/var/cache/kv"}'

SGLang's factory imports this module and calls ``SGLangStorage(storage_config,
extra_config)``; the extra config holds the factory's and the controller's own keys mixed
with the backend's options. ``backend_name`` names the hicache-storage backend (any
installed one, built-in or a vendor's, found through the registry); the other keys that
are not SGLang's are that backend's options. ``interface_v1`` makes SGLang's controller
use the zero-copy ``batch_get_v1``/``batch_set_v1`` pair.

**Lifecycle.** The SDK backend is built when SGLang registers its host pool
(:meth:`SGLangStorage.register_mem_pool_host`): only the pool says what the pages are
(page size, KV dtype, layout, heads), and those are part of the namespace that keeps
different deployments' pages apart. The namespace holds the model name, the dtype, the
page size, the host layout, MLA (rank-replicated pages) and the heads per rank; the
shard holds the TP rank (or the KV heads it holds) and the pipeline stage; context
parallel ranks (``attn_cp``, ``dcp``) are kept apart in the namespace's tenant.

Tensor calls made before any pool is registered (``set``/``get``/``exists`` and their
batches, as SGLang's own storage tests make them on a backend its factory built without
a pool) are served by a backend of their own (:meth:`SGLangStorage.tensor_namespace`):
the bytes of each tensor under its key, in a namespace that no pool's pages share. The
other calls before the pool (the zero-copy pair, addresses into a pool) fail cleanly
(their failure shape, logged).

**Deadlines.** SGLang calls a backend from its scheduler thread when it attaches,
clears and detaches storage, and asks for hits from its prefetch thread: none of these
waits for the store longer than ``engine_timeout`` seconds (default 5; 0: no deadline).
An attach past it fails (SGLang runs without storage), a hit query past it is a miss,
and while it still hangs the next one is a miss at once; a clear or close past it is
left to finish on its own. The page transfers (``batch_get_v1`` / ``batch_set_v1`` and
the tensor forms) run on SGLang's I/O threads and are not cut: SGLang gives a
transfer's host pages back to its pool only when the call has returned, so a call cut
early would let late bytes land in pages already reused. A request never waits for
them: SGLang's own prefetch stop policy (``timeout``, its default) bounds that.

**What SGLang gets that its own backends do not give it**: ``batch_set`` returns one bool
that is True only when every page was stored (a list, SGLang's own default, is truthy
even when every page failed); the pointer form of ``get``/``set`` accepts only addresses
inside the registered host pool (anything else is a failed call, never a write to an
arbitrary address); every store failure is a failure result, never an exception on the
controller's threads.

Importing this module needs SGLang; ``import hicache_storage`` never imports it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Sized
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _SGLangHiCacheStorage
    from sglang.srt.mem_cache.hicache_storage import PoolName as _PoolName
    from sglang.srt.mem_cache.hicache_storage import PoolTransferResult as _PoolTransferResult
except ImportError as exc:  # pragma: no cover - exercised by the packaging test's light import
    raise ImportError(
        "hicache_storage.integrations.sglang runs inside SGLang, which is not importable "
        f"here ({exc}); install sglang (0.5.23 is the version tested) in this environment"
    ) from exc

from hicache_storage.breaker import report_timeout
from hicache_storage.buffers import memoryview_at, source_views, target_views
from hicache_storage.config import StorageConfig, parse_options
from hicache_storage.errors import (
    ConfigError,
    HiCacheStorageError,
    NamespaceMismatchError,
)
from hicache_storage.integrations import SGLANG_ADAPTER_KEYS
from hicache_storage.integrations.adapterkit import backend_name_of, failsafe, failure_text
from hicache_storage.integrations.deadline import Lane, call_with_deadline
from hicache_storage.keys import KVCacheNamespace, normalize_dtype
from hicache_storage.poolview import PoolView, buffer_ranges, pool_fact, pool_is_mla
from hicache_storage.ratelimit import RateLimitedLog
from hicache_storage.registry import create_backend
from hicache_storage.sidepools import SidePool, exists_fold, pool_name

if TYPE_CHECKING:
    from hicache_storage.protocol import HiCacheStorage

__all__ = ["ADAPTER_KEYS", "SGLangStorage", "StorageMetrics"]

#: The keys the adapter reads itself (see :mod:`hicache_storage.integrations`).
ADAPTER_KEYS = SGLANG_ADAPTER_KEYS

#: SGLang's ``--kv-cache-dtype`` names of the fp8 formats, as torch names them.
_FP8 = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class AdapterOptions:
    """The adapter's own keys of the extra config (see :data:`ADAPTER_KEYS`).

    Each may also come from ``HICACHE_STORAGE_SGLANG_ADAPTER_<NAME>``.

    Attributes:
        model_id: the model's name in the namespace when SGLang gives none.
        kv_cache_dtype: the fp8 format of a pool that stores its KV as bytes.
        tenant: kept apart from every other tenant's pages.
        weights_fingerprint: keeps apart checkpoints served under one name.
        engine_timeout: seconds SGLang's scheduler and prefetch threads wait for the
            store in one call (see "Deadlines" in the module docs); 0: no deadline.
        total_kv_heads: the model's KV heads, for pages shared across TP sizes when
            there are more TP ranks than KV heads (SGLang's pool then holds one head per
            rank, and the total cannot be read off it); default: the pool's heads times
            the TP size.
    """

    model_id: str | None = None
    kv_cache_dtype: str | None = None
    tenant: str = ""
    weights_fingerprint: str = ""
    engine_timeout: float = 5.0
    total_kv_heads: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.engine_timeout <= threading.TIMEOUT_MAX:
            raise ConfigError(
                f"engine_timeout={self.engine_timeout} must be from 0 to "
                f"{threading.TIMEOUT_MAX:g} seconds (0: no deadline)"
            )


@dataclass
class StorageMetrics:
    """The shape of SGLang's ``StorageMetrics``: one entry per call.

    Used when SGLang's own class cannot be imported (its module needs ``transformers``).
    """

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


def _server_kv_cache_dtype() -> str | None:
    """SGLang's ``--kv-cache-dtype`` in this server process, if it can be read."""
    try:
        from sglang.srt.runtime_context import get_server_args

        value = get_server_args().kv_cache_dtype
    except Exception:  # noqa: BLE001 - not in a server (tests, tools): unknown
        return None
    return str(value) if value else None


def _draft_identity() -> str:
    """The speculative draft model's checkpoint in this server process ("" if unknown)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
        path = getattr(args, "speculative_draft_model_path", None)
        revision = getattr(args, "speculative_draft_model_revision", None)
    except Exception:  # noqa: BLE001 - not in a server (tests, tools): unknown
        return ""
    return f"{path}@{revision}" if path else ""


def _metrics_class() -> type:
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics as Real
    except Exception:  # noqa: BLE001 - any import failure: the same shape, ours
        return StorageMetrics
    return Real  # type: ignore[no-any-return]


#: Seconds before a failed build of the pool-less backend is tried again.
TENSOR_RETRY = 5.0


def _usable(views: Callable[[Any], object], obj: Any) -> bool:
    """True if the backend takes ``obj`` as a target or value (``views`` does not refuse it).

    Checked per item before a batch call, so one tensor the SDK refuses (not contiguous,
    not in CPU memory, of a type it does not read) fails alone, as in a loop of ``get``.
    """
    try:
        views(obj)
    except HiCacheStorageError as exc:
        logger.debug("SGLangStorage: a target or value refused: %s", exc)
        return False
    return True


def _is_tensor(obj: Any) -> bool:
    """True for a tensor (SGLang's tensor form), not an address or a buffer."""
    return hasattr(obj, "data_ptr")


def _n(args: tuple[Any, ...]) -> int:
    keys = args[0] if args else ()
    return len(keys) if isinstance(keys, Sized) else 0


def _v2_failure(args: tuple[Any, ...]) -> dict[Any, list[bool]]:
    """Every page of every transfer in ``args[0]`` failed (or ``{}`` if unreadable)."""
    try:
        return {t.name: [False] * len(t.keys or []) for t in args[0] or ()}
    except Exception:  # noqa: BLE001 - a malformed argument: nothing to report per pool
        return {}


class SGLangStorage(_SGLangHiCacheStorage):  # type: ignore[misc]
    """SGLang's ``HiCacheStorage``, backed by any hicache-storage backend.

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig`` for this rank.
        extra_config: options that override ``storage_config.extra_config`` (SGLang's
            ``dynamic`` factory passes its own keyword arguments here, empty when the
            controller builds the backend). Together they hold ``backend_name`` and the
            backend's options; SGLang's own keys are ignored.
    """

    def __init__(self, storage_config: Any, extra_config: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.storage_config = storage_config
        # SGLang's dynamic factory passes its own **kwargs here (empty from the controller):
        # the options are in storage_config.extra_config; explicit ones win.
        extra = {**(storage_config.extra_config or {}), **(extra_config or {})}
        self.backend_name = backend_name_of(extra, "the extra config")
        self.extra_config = extra
        # (a key given as null is unset: its default, as it was before options were checked)
        given = {k: extra[k] for k in ADAPTER_KEYS if extra.get(k) is not None}
        self.options = parse_options(AdapterOptions, "sglang-adapter", given)
        self.backend: HiCacheStorage | None = None
        self.mem_pool_host: Any = None
        self._lock = threading.Lock()
        self._attaches = 0  # (attaches begun, and closes: only the latest installs its backend)
        self._exists_lane = Lane("hicache-sglang-exists")
        #: the KV pool's namespace and config, for the side pools' (set at attach)
        self._kv_attach: tuple[KVCacheNamespace, StorageConfig] | None = None
        self._sides: dict[str, SidePool] = {}  # a hybrid model's other pools, by name
        #: the backend of tensor calls made before any pool (see tensor_namespace); none
        #: once a pool has been offered (even one the attach refused)
        self._tensors: HiCacheStorage | None = None
        self._tensors_retry_at = 0.0
        self._pool_seen = False
        self._metrics = StorageMetrics()
        self._log = RateLimitedLog(logger)

    def _hook_failed(self, hook: str, exc: Exception) -> None:
        """A hook raised (see :func:`~hicache_storage.integrations.adapterkit.failsafe`)."""
        self._log(
            "raise:" + hook,
            "SGLangStorage.%s failed (%s); returning its failure result",
            hook,
            failure_text(exc, self.extra_config),
        )

    # ------------------------------------------------------------------ attach

    def _kv_dtype(self, pool: Any) -> str:
        """The logical KV dtype of ``pool``'s pages.

        SGLang stores every fp8 KV cache as uint8, so the pool's dtype cannot tell
        fp8_e4m3 from fp8_e5m2: then the ``kv_cache_dtype`` option, else SGLang's own
        server arguments, say which; if neither does, the attach fails rather than mixing
        two formats' pages.
        """
        stored = normalize_dtype(pool_fact(pool, "dtype"))
        named = self.options.kv_cache_dtype or _server_kv_cache_dtype()
        if stored not in ("uint8", "int8"):
            return stored
        if not named or named == "auto":
            raise ConfigError(
                f"the host pool stores the KV cache as {stored}: set kv_cache_dtype in the "
                "extra config (e.g. fp8_e4m3 or fp8_e5m2), so formats never share pages"
            )
        return _FP8.get(str(named), normalize_dtype(named))

    def namespace_for(self, pool: Any) -> KVCacheNamespace:
        """The namespace of this rank's pages for SGLang host pool ``pool``."""
        cfg = self.storage_config
        mla = bool(cfg.is_mla_model)
        pool_mla = pool_is_mla(pool)
        if pool_mla is not None and pool_mla != mla:
            # An MHA pool filed as MLA would be one replicated namespace for every rank's
            # own heads (rank 1 loads rank 0's pages); MLA filed as MHA stores it per rank.
            raise NamespaceMismatchError(
                f"SGLang's config says is_mla_model={mla}, but the host pool "
                f"({type(pool).__name__}) holds {'MLA' if pool_mla else 'MHA'} pages; "
                "the pages are filed by what the pool holds, so the two must agree"
            )
        model_id = self.options.model_id or cfg.model_name
        if not model_id:
            raise ConfigError(
                "SGLang gives no served model name: set model_id in the extra config "
                "(pages of different models must never share a namespace)"
            )
        fields: dict[str, Any] = {
            "model_id": str(model_id),
            "dtype": self._kv_dtype(pool),
            "page_size": int(pool_fact(pool, "page_size")),
            "object_layout": str(pool_fact(pool, "layout")),
            "rank_replicated": mla,
            "weights_fingerprint": self.options.weights_fingerprint,
        }
        heads = getattr(pool, "head_num", None)
        if not mla and isinstance(heads, int) and heads > 0:
            total = self.options.total_kv_heads or heads * int(cfg.tp_size)
            if total != heads * int(cfg.tp_size) and not (heads == 1 and int(cfg.tp_size) > total):
                raise ConfigError(
                    f"total_kv_heads={total} contradicts the host pool: {heads} KV heads "
                    f"on each of {cfg.tp_size} TP ranks"
                )
            fields["total_kv_heads"] = total
            fields["kv_heads_per_shard"] = heads
        start, end = getattr(pool, "start_layer", None), getattr(pool, "end_layer", None)
        if isinstance(start, int) and isinstance(end, int) and 0 <= start < end:
            fields["layer_range"] = (start, end)  # a pipeline stage: the layers it holds
        # A pool that also holds a draft model's layers (speculative decoding) has pages
        # of more layers than its range: other bytes, so another namespace.
        layers = getattr(pool, "layer_num", None)
        drafts = ""
        if (
            isinstance(layers, int)
            and isinstance(start, int)
            and isinstance(end, int)
            and layers != end - start
        ):
            drafts = f"layers{layers}"
        # Context-parallel ranks hold different tokens of the same pages' positions: keep
        # them apart (the shard covers TP and PP only).
        apart = [self.options.tenant, drafts] + [
            f"{what}{rank}of{size}"
            for what, rank, size in (
                ("cp", getattr(cfg, "attn_cp_rank", 0), getattr(cfg, "attn_cp_size", 1)),
                ("dcp", getattr(cfg, "dcp_rank", 0), getattr(cfg, "dcp_size", 1)),
            )
            if int(size) > 1
        ]
        tenant = "-".join(a for a in apart if a)
        if tenant:
            fields["tenant"] = tenant
        return KVCacheNamespace(**fields)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Take one of a hybrid model's pools (SGLang registers the KV pool here too).

        Every pool but KV gets a backend of its own (see
        :mod:`~hicache_storage.sidepools`). A pool whose pages cannot be moved
        raises (the attach fails with the reason); a backend that does not attach within
        ``engine_timeout`` leaves that pool without one: its pages are misses.
        """
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = pool_name(host_pool_name)
        if name == "kv":
            return
        if self._kv_attach is None:
            raise ConfigError(
                f"SGLangStorage: pool {name!r} registered before the KV pool "
                "(register_mem_pool_host) or after close(); SGLang registers the KV pool first"
            )
        kv_namespace, config = self._kv_attach
        with self._lock:
            attempt = self._attaches

        identity = _draft_identity() if name.startswith("draft") else ""

        def attach() -> bool:
            side = SidePool.build(
                name, host_pool, kv_namespace, config, self.backend_name, identity
            )
            with self._lock:
                current = attempt == self._attaches  # (not closed or attached again since)
                old = self._sides.get(name) if current else side
                if current:
                    self._sides[name] = side
            if old is not None:
                self._with_deadline(old.backend.close, "close")
            return current

        done, _ = self._with_deadline(attach, "attach")
        if not done:
            logger.warning(
                "SGLangStorage: the %s backend of pool %r did not attach within "
                "engine_timeout (%g s); that pool's pages are misses until it does",
                self.backend_name,
                name,
                self.options.engine_timeout,
            )

    def on_host_pools_registered(self) -> None:
        """Every pool of the attach is registered: say which ones storage moves."""
        names = sorted(self._sides)
        if names:
            logger.info("SGLangStorage: moving the KV pool and pools %s", names)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Attach SGLang's host pool and build the backend for its pages.

        Raises (SGLang fails the attach) when the backend cannot take the pool: a layout
        it does not support names the layouts it does.
        """
        with self._lock:  # pool-less tensor calls end here, whatever the attach does
            self._pool_seen = True
            tensors, self._tensors = self._tensors, None
        if tensors is not None:
            self._with_deadline(tensors.close, "close")
        namespace = self.namespace_for(mem_pool_host)
        cfg = self.storage_config
        if int(getattr(cfg, "dcp_size", 1) or 1) > 1 and self.extra_config.get("interface_v1"):
            # With decode context parallelism SGLang's host pool holds page_size/dcp_size
            # tokens of each logical page, while the controller's host indices count the
            # logical page: SGLang's zero-copy metadata and those indices disagree.
            raise ConfigError(
                "decode context parallelism (dcp_size > 1) works through SGLang's tensor "
                "path only: set interface_v1 to false in the extra config"
            )
        options = {k: v for k, v in self.extra_config.items() if k not in ADAPTER_KEYS}
        # SGLang's tp_lcm_size (the least common multiple of the TP sizes that share a
        # store) is the number of head groups a page is stored as, in every layout.
        lcm = getattr(cfg, "tp_lcm_size", None)
        if lcm and not namespace.rank_replicated and "head_groups" not in options:
            # As many groups as every TP size up to the LCM needs, but never more than
            # there are heads (more ranks than heads share whole heads).
            options["head_groups"] = math.gcd(int(lcm), namespace.total_kv_heads or int(lcm))
        dp_rank = getattr(cfg, "dp_rank", None)
        if isinstance(dp_rank, int) and "writer_scope" not in options:
            # (data-parallel replicas of one torch.distributed world: separate writers)
            options["writer_scope"] = f"dp{dp_rank}"
        config = StorageConfig(
            namespace=namespace,
            tp_rank=int(cfg.tp_rank),
            tp_size=int(cfg.tp_size),
            pp_rank=int(cfg.pp_rank),
            pp_size=int(cfg.pp_size),
            extra_config=options,
        )
        pool = (
            mem_pool_host
            if hasattr(mem_pool_host, "page_buffers")
            else PoolView(mem_pool_host, namespace.rank_replicated, namespace.dtype)
        )
        self._kv_attach = (namespace, config)
        if self._exists_lane.closed:  # attached again after close()
            self._exists_lane = Lane("hicache-sglang-exists")
        with self._lock:
            self._attaches += 1
            attempt = self._attaches

        def attach() -> bool:
            """Build and register the backend; install it if this is still the attach."""
            backend = create_backend(self.backend_name, config)
            try:
                backend.register_mem_pool_host(pool)
            except BaseException:
                backend.close()
                raise
            with self._lock:  # (one decision, whichever side is late)
                current = attempt == self._attaches
                if current:
                    old, self.backend, self.mem_pool_host = self.backend, backend, mem_pool_host
            if not current:  # another attach or a close came since: nobody takes it
                backend.close()
                return False
            if old is not None:
                self._with_deadline(old.close, "close")
            return True

        done, _ = self._with_deadline(attach, "attach")
        if not done:
            # SGLang attaches on its scheduler thread, at start too, where any error stops
            # the server: it runs on, with misses, and the backend is installed when (if)
            # it attaches.
            logger.warning(
                "SGLangStorage: the %s backend did not attach within engine_timeout (%g s); "
                "SGLang runs without storage (every query a miss) until it does",
                self.backend_name,
                self.options.engine_timeout,
            )

    def _with_deadline(self, fn: Callable[[], T], what: str) -> tuple[bool, T | None]:
        """``call_with_deadline`` with ``engine_timeout`` (none: ``fn()`` on this thread)."""
        timeout = self.options.engine_timeout
        if timeout <= 0:
            return True, fn()
        done, result = call_with_deadline(fn, timeout, f"hicache-sglang-{what}")
        if not done:
            self._log(
                "deadline:" + what,
                "SGLangStorage: %s took longer than engine_timeout (%g s); left to finish "
                "on its own",
                what,
                timeout,
            )
        return done, result

    def _backend(self, op: str, tensors: bool = False) -> HiCacheStorage | None:
        """The backend for ``op``; None (logged) when there is none.

        ``tensors``: a call of the tensor form, which a backend without a host pool can
        serve (SGLang's own storage tests make them so): before any pool is registered it
        goes to :meth:`_tensor_backend`.
        """
        backend = self.backend
        if backend is None and tensors and not self._pool_seen:
            backend = self._tensor_backend()
        if backend is None:
            self._log(
                "nopool:" + op,
                "SGLangStorage.%s before register_mem_pool_host() or after close(): it fails",
                op,
            )
        return backend

    def tensor_namespace(self) -> KVCacheNamespace:
        """The namespace of tensor calls made before any host pool is registered.

        Without a pool nothing says what a page's bytes are (dtype, tokens per page), so
        these pages are bytes of their own namespace: the config's model, TP rank (MLA:
        shared by every rank), layout flag and tenant, dtype ``uint8``, one "token" per
        page, and the tenant part ``tensors``. They never mix with a pool's pages, and a
        read checks the stored size against the target's and its checksum, as always.
        """
        cfg = self.storage_config
        model_id = self.options.model_id or getattr(cfg, "model_name", None)
        if not model_id:
            raise ConfigError(
                "SGLang gives no served model name: set model_id in the extra config "
                "(pages of different models must never share a namespace)"
            )
        page_first = bool(getattr(cfg, "is_page_first_layout", True))
        apart = [self.options.tenant, "tensors"] + [
            f"{what}{rank}of{size}"
            for what, rank, size in (
                ("cp", getattr(cfg, "attn_cp_rank", 0), getattr(cfg, "attn_cp_size", 1)),
                ("dcp", getattr(cfg, "dcp_rank", 0), getattr(cfg, "dcp_size", 1)),
            )
            if int(size or 1) > 1
        ]
        return KVCacheNamespace(
            model_id=str(model_id),
            dtype="uint8",
            page_size=1,
            object_layout="page_first" if page_first else "layer_first",
            rank_replicated=bool(getattr(cfg, "is_mla_model", False)),
            weights_fingerprint=self.options.weights_fingerprint,
            tenant="-".join(a for a in apart if a),
        )

    def _tensor_backend(self) -> HiCacheStorage | None:
        """The backend of the tensor calls made before any pool (built on first use).

        Built outside the lock and within ``engine_timeout`` (a store that hangs at
        connect costs the calls misses, never a wait past the deadline, and never holds
        up ``close`` or the pool's attach); a failed build is tried again only after
        :data:`TENSOR_RETRY` seconds. Installed only while no pool has been offered.
        """
        with self._lock:
            if self._tensors is not None or self._pool_seen:
                return self._tensors
            if time.monotonic() < self._tensors_retry_at:
                return None
        cfg = self.storage_config
        options = {k: v for k, v in self.extra_config.items() if k not in ADAPTER_KEYS}
        config = StorageConfig(
            namespace=self.tensor_namespace(),
            tp_rank=int(getattr(cfg, "tp_rank", 0) or 0),
            tp_size=int(getattr(cfg, "tp_size", 1) or 1),
            pp_rank=int(getattr(cfg, "pp_rank", 0) or 0),
            pp_size=int(getattr(cfg, "pp_size", 1) or 1),
            extra_config=options,
        )

        def build() -> HiCacheStorage | None:
            backend = create_backend(self.backend_name, config)
            with self._lock:
                if self._tensors is None and not self._pool_seen:
                    self._tensors = backend
                    return backend
                current = self._tensors
            backend.close()  # another call built one first, or a pool came meanwhile
            return current

        try:
            done, backend = self._with_deadline(build, "tensor-attach")
        except Exception:
            with self._lock:
                self._tensors_retry_at = time.monotonic() + TENSOR_RETRY
            raise
        if not done:
            with self._lock:
                self._tensors_retry_at = time.monotonic() + TENSOR_RETRY
            return None
        return backend

    # ------------------------------------------------------------------ pointer form

    def _pointer_target(self, location: Any, size: Any) -> memoryview | None:
        """A view of ``size`` bytes at address ``location``, if they lie inside the pool."""
        try:
            start, nbytes = int(location), int(size)
        except (TypeError, ValueError):
            return None
        end = start + nbytes
        if nbytes <= 0 or self.mem_pool_host is None:
            return None  # (an empty "page" would be stored and block the key for good)
        for lo, hi in buffer_ranges(getattr(self.mem_pool_host, "kv_buffer", None)):
            if lo <= start and end <= hi:
                return memoryview_at(start, nbytes, self.mem_pool_host)
        self._log(
            "pointer",
            "SGLangStorage: %d bytes at %#x are outside the registered host pool; refused",
            nbytes,
            start,
        )
        return None

    def _target(self, location: Any, size: Any) -> Any:
        """The read target or write value SGLang passed: a tensor, or an address form."""
        if location is None or hasattr(location, "data_ptr") or size is None:
            return location
        return self._pointer_target(location, size)

    # ------------------------------------------------------------------ legacy calls

    @failsafe(lambda self, args: None)
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """The page of ``key`` (into ``target_location`` when given), or None."""
        tensors = target_location is None or _is_tensor(target_location)
        backend = self._backend("get", tensors=tensors)
        if backend is None:
            return None
        target = self._target(target_location, target_sizes)
        if target is None and target_location is not None:
            return None  # an address SGLang may not write through
        got = backend.get(key, target)
        if got is None:
            return None
        return target_location if target is not None and target_location is not None else got

    @failsafe(lambda self, args: [None] * _n(args))
    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[Any]:
        """``get`` of each key, one result per key.

        Targets given: one ``batch_get`` of the backend (its I/O threads read the pages
        in parallel); a target this adapter refuses (an address outside the host pool)
        is a None of its own.
        """
        if target_locations is None or any(t is None for t in target_locations):
            sizes = target_sizes if target_sizes is not None else [None] * len(keys)
            locations = target_locations if target_locations is not None else [None] * len(keys)
            return [self.get(k, t, s) for k, t, s in zip(keys, locations, sizes, strict=True)]
        backend = self._backend("batch_get", tensors=all(map(_is_tensor, target_locations)))
        if backend is None:
            return [None] * len(keys)
        sizes = target_sizes if target_sizes is not None else [None] * len(keys)
        targets = [self._target(t, s) for t, s in zip(target_locations, sizes, strict=True)]
        live = [i for i, t in enumerate(targets) if t is not None and _usable(target_views, t)]
        got = backend.batch_get([keys[i] for i in live], [targets[i] for i in live])
        out: list[Any] = [None] * len(keys)
        for i, g in zip(live, got, strict=True):
            if g is not None:
                out[i] = target_locations[i]
        return out

    @failsafe(lambda self, args: False)
    def set(
        self,
        key: str,
        value: Any = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store ``value`` (or the bytes at ``target_location``) under ``key``."""
        # (a value is data; a location is data only as a tensor: an address needs a pool)
        backend = self._backend("set", tensors=value is not None or _is_tensor(target_location))
        if backend is None:
            return False
        if value is None:
            value = self._target(target_location, target_sizes)
            if value is None:
                return False
        return bool(backend.set(key, value))

    @failsafe(lambda self, args: False)
    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store every value; True only if every one was stored (SGLang's contract)."""
        n = len(keys)
        t0 = time.perf_counter()
        tensors = values is not None or (
            target_locations is not None and all(map(_is_tensor, target_locations))
        )
        backend = self._backend("batch_set", tensors=tensors)
        if backend is None:
            return False
        if values is None:
            locations = target_locations if target_locations is not None else [None] * n
            sizes = target_sizes if target_sizes is not None else [None] * n
            values = [self._target(t, s) for t, s in zip(locations, sizes, strict=True)]
        # One batch_set of the backend (its I/O threads write in parallel); a value this
        # adapter refused (None) is not stored.
        if len(values) != n:
            raise ValueError(f"{n} keys but {len(values)} values")
        live = [i for i, v in enumerate(values) if v is not None and _usable(source_views, v)]
        stored = backend.batch_set([keys[i] for i in live], [values[i] for i in live])
        done = sum(bool(ok) for ok in stored)
        self._note("backup", done, 0, time.perf_counter() - t0)
        return done == n

    @failsafe(lambda self, args: False)
    def exists(self, key: str) -> bool:
        """True if ``key`` is stored (False past the deadline)."""
        return self.batch_exists([key]) == 1

    @failsafe(lambda self, args: 0)
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """The number of leading keys stored (0 past the deadline, or while a query hangs)."""
        backend = self._backend("batch_exists", tensors=True)
        if backend is None:
            return 0
        done, count = self._query(lambda: int(backend.batch_exists(keys)), "exists")
        return int(count or 0) if done else 0

    # ------------------------------------------------------------------ zero-copy v1

    @failsafe(lambda self, args: [False] * _n(args))
    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        """Read ``keys`` into the host pool at ``host_indices``; one bool per page."""
        return self._v1("batch_get_v1", "prefetch", keys, host_indices)

    @failsafe(lambda self, args: [False] * _n(args))
    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        """Store the host-pool pages at ``host_indices`` under ``keys``; one bool per page."""
        return self._v1("batch_set_v1", "backup", keys, host_indices)

    def _v1(self, op: str, kind: str, keys: list[str], host_indices: Any) -> list[bool]:
        """One v1 call on the backend, timed for the metrics."""
        backend = self._backend(op)
        if backend is None:
            return [False] * len(keys)
        t0 = time.perf_counter()
        out: list[bool] = getattr(backend, op)(keys, host_indices)
        self._note(kind, sum(out), self._page_bytes(), time.perf_counter() - t0)
        return out

    # ------------------------------------------------------------------ v2 (pool transfers)

    # SGLang's v2 calls move a hybrid model's pools (KV plus Mamba, SWA, indexer...): the
    # KV pool's pages through v1, every other pool's through the backend built for it
    # when it was registered (see hicache_storage.sidepools).

    @failsafe(lambda self, args: _PoolTransferResult(0, {}, []))
    def batch_exists_v2(
        self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None
    ) -> Any:
        """The usable prefix of ``keys``, as SGLang's own backends answer it.

        The KV pool's leading run, cut to where every other pool can restore it:
        ``restorable_prefix_pages`` lists each usable prefix length, ``kv_hit_pages``
        is the longest, ``extra_pool_hit_pages`` has each pool's own verdict. Within
        ``engine_timeout``, as a hit query is (past it: no hit).
        """
        transfers = list(pool_transfers or ())
        backend = self._backend("batch_exists_v2")
        if backend is None:
            return _PoolTransferResult(0, {}, [])
        sides = dict(self._sides)

        def query() -> tuple[int, dict[str, int], list[int]]:
            return exists_fold(int(backend.batch_exists(keys)), transfers, sides, keys)

        done, answer = self._query(query, "batch_exists_v2")
        if not done or answer is None:
            return _PoolTransferResult(0, {}, [])
        hit, verdicts, restorable = answer
        names = {pool_name(t.name): t.name for t in transfers}
        hits = {names.get(n, _PoolName.KV if n == "kv" else n): v for n, v in verdicts.items()}
        return _PoolTransferResult(hit, hits, restorable)

    def _query(self, fn: Callable[[], T], what: str) -> tuple[bool, T | None]:
        """``fn()`` on the hit-query lane within ``engine_timeout`` (a miss past it)."""
        timeout = self.options.engine_timeout
        if timeout <= 0:
            return True, fn()
        outcome, job = self._exists_lane.run(lambda job: fn(), timeout)
        if outcome == "done":
            return True, job.result
        if self.backend is not None:
            # A failure for the backend's read breaker (past the deadline, or refused
            # while the last query still hangs): a store that hangs opens it, and then
            # SGLang's prefetch reads answer at once too instead of blocking on it.
            report_timeout(self.backend)
        self._log(
            "deadline:" + what,
            "SGLangStorage: a hit query %s; answered as a miss",
            f"took longer than engine_timeout ({timeout:g} s)"
            if outcome == "timeout"
            else "came while the last one still hangs",
        )
        return False, None

    def _v2_io(self, op: str, transfers: Any) -> dict[Any, list[bool]]:
        out: dict[Any, list[bool]] = {}
        for t in transfers or ():
            keys = list(t.keys or [])
            name = pool_name(t.name)
            if name == "kv":
                ok = t.host_indices is not None
                out[t.name] = getattr(self, op)(keys, t.host_indices) if ok else [False] * len(keys)
                continue
            side = self._sides.get(name)
            indices = t.host_indices
            count = int(getattr(indices, "numel", lambda: -1)()) if indices is not None else -1
            if side is None or count != len(keys) * side.page_size:
                self._log(
                    f"v2:{op}:{name}",
                    "SGLangStorage.%s: pool %r %s; its pages fail",
                    op.replace("_v1", "_v2"),
                    name,
                    "has no backend (not registered, or not attached)"
                    if side is None
                    else f"got {count} host indices for {len(keys)} pages of {side.page_size}",
                )
                out[t.name] = [False] * len(keys)
                continue
            out[t.name] = list(getattr(side.backend, op)(keys, indices))  # (KV pages only
            # count in SGLang's storage metrics, as its own backends count them)
        return out

    @failsafe(lambda self, args: _v2_failure(args))
    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Read each transfer's pages into its pool; one bool per page, per pool."""
        return self._v2_io("batch_get_v1", transfers)

    @failsafe(lambda self, args: _v2_failure(args))
    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Store each transfer's pages from its pool; one bool per page, per pool."""
        return self._v2_io("batch_set_v1", transfers)

    # ------------------------------------------------------------------ the rest

    def clear(self) -> None:
        """Remove this deployment's pages (this namespace only), if the backend can."""
        backend = self._backend("clear", tensors=True)
        if backend is None:
            return
        if not backend.capabilities.delete:
            self._log(
                "clear",
                "SGLangStorage.clear: backend %r cannot delete; nothing removed",
                self.backend_name,
            )
            return
        # The side pools too: a state left behind would win over the one stored next.
        for b in [*(side.backend for side in list(self._sides.values())), backend]:
            self._with_deadline(b.clear, "clear")

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (then reset), as its backends do."""
        with self._lock:
            metrics, self._metrics = self._metrics, StorageMetrics()
        real = _metrics_class()
        if real is StorageMetrics:
            return metrics
        out = real()
        for f in dataclasses.fields(metrics):
            getattr(out, f.name).extend(getattr(metrics, f.name))
        return out

    def close(self) -> None:
        """Close the backend; later calls fail cleanly."""
        with self._lock:
            backend, self.backend = self.backend, None
            self._attaches += 1  # (an attach still running closes what it built)
            sides, self._sides = list(self._sides.values()), {}
            self._kv_attach = None  # (a pool registered after this gets no backend)
            tensors, self._tensors = self._tensors, None
            self._pool_seen = True  # (no pool-less backend after close either)
        self._exists_lane.close()
        for b in [backend, tensors, *(side.backend for side in sides)]:
            if b is not None:
                self._with_deadline(b.close, "close")

    def _page_bytes(self) -> int:
        pool = self.mem_pool_host
        per = getattr(pool, "page_bytes", None)
        if isinstance(per, int):
            return per
        size = getattr(pool, "get_size_per_token", None)
        try:
            return int(size()) * int(pool.page_size) if callable(size) else 0
        except Exception:  # noqa: BLE001 - a figure for the metrics only
            return 0

    def _note(self, kind: str, pages: int, page_bytes: int, seconds: float) -> None:
        if not getattr(self.storage_config, "enable_storage_metrics", False):
            return
        gbps = pages * page_bytes / seconds / 1e9 if seconds > 0 and page_bytes else 0.0
        with self._lock:
            if kind == "prefetch":
                self._metrics.prefetch_pgs.append(pages)
                self._metrics.prefetch_bandwidth.append(gbps)
            else:
                self._metrics.backup_pgs.append(pages)
                self._metrics.backup_bandwidth.append(gbps)
