"""The backend protocol: :class:`HiCacheStorage`.

This is the contract every store implements, built-in or vendor. It matches the method
names and argument order of SGLang's HiCache L3 interface, with its faults fixed.

**What an implementer writes.** Three abstract methods, ``get``, ``set`` and ``exists``.
Everything else has a correct default that loops over them; override a default when the
store has a faster native form (``batch_set_pages``/``batch_get_pages`` for zero-copy
page I/O, ``batch_exists`` for pipelined existence checks, ``delete``, ``clear``).

**What the engine gets, whatever the implementer wrote.** The methods below are
*engine-facing*; the class wraps every implementation of them (yours included, through
``__init_subclass__``) so that:

* keys are validated before your code runs (:func:`~hicache_storage.keys.validate_key`);
  invalid keys and other bad arguments raise :class:`~hicache_storage.errors.InvalidArgumentError`;
  :class:`~hicache_storage.errors.NotSupportedError` (an operation this backend or this
  process cannot do at all, e.g. an instance used after ``fork``) and
  :class:`~hicache_storage.errors.ContractViolationError` (strict mode) also reach the
  caller;
* any other exception, from the store or from a bug, becomes the call's *failure shape*
  (``None``, ``False``, ``0``, ``[False] * n``, ``[None] * n``), is logged (rate limited)
  and is counted in :meth:`get_stats`. The engine's prefetch and backup threads never die
  because of storage;
* results of the wrong shape (a list of the wrong length, ``None`` where a list is due,
  a bool from ``batch_set``) are replaced by a safe shape and counted as contract
  violations; in strict mode (``HICACHE_STORAGE_STRICT=1``) they raise
  :class:`~hicache_storage.errors.ContractViolationError` instead;
* after :meth:`close`, every engine-facing call returns its failure shape (``delete``
  and ``clear`` raise :class:`~hicache_storage.errors.BackendClosedError`).

=====================  ==========================================  ==================
method                 returns                                     failure shape
=====================  ==========================================  ==================
``get``                the filled target, a new uint8 tensor, or   ``None``
                       ``None`` (miss or stored-size mismatch)
``set``                ``True`` once stored (or already present)   ``False``
``exists``             ``bool``                                    ``False``
``batch_get``          ``list`` of ``get`` results, one per key    ``[None] * n``
``batch_set``          ``list[bool]``, one per key                 ``[False] * n``
``batch_exists``       number of *leading* keys present            ``0``
``batch_get_v1``       ``list[bool]``, one per page                ``[False] * n``
``batch_set_v1``       ``list[bool]``, one per page                ``[False] * n``
``batch_get_pages``    ``list[bool]``, one per page                ``[False] * n``
``batch_set_pages``    ``list[bool]``, one per page                ``[False] * n``
=====================  ==========================================  ==================

**Thread safety.** Every method may be called from several threads at once (the engine
runs one prefetch and one backup thread against one instance), and several processes
(ranks) may share one store.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self, TypeAlias, runtime_checkable

from typing_extensions import override

from hicache_storage._guard import ENGINE_OPS, InstanceState, active_calls, guard_class
from hicache_storage._guard import overrides as _overrides
from hicache_storage.breaker import OPEN, Breakers, Health, breaker_options
from hicache_storage.buffers import (
    HostIndices,
    PageBuffer,
    ReadTarget,
    WriteValue,
    copy_into,
    pages_from_meta,
    source_views,
)
from hicache_storage.config import StorageConfig
from hicache_storage.errors import (
    BackendError,
    HostIndicesError,
    InvalidArgumentError,
    NotSupportedError,
)
from hicache_storage.keys import (
    DEFAULT_NAMESPACE,
    ObjectName,
    ObjectNamer,
)
from hicache_storage.layouts import LAYOUTS
from hicache_storage.secrets import scrub, secret_values

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from types import TracebackType

    from hicache_storage.stats import StatsRecorder, StorageStats

__all__ = [
    "NAMESPACE_USAGE_KEYS",
    "USAGE_KEYS",
    "Capabilities",
    "EngineHostPool",
    "HiCacheStorage",
    "HostPool",
    "SDKHostPool",
]

logger = logging.getLogger(__name__)

#: The keys every backend's :meth:`HiCacheStorage.usage` returns.
USAGE_KEYS = ("objects", "used_bytes", "limit_bytes")
#: This namespace's share, from backends that count it apart (``file``, ``shm``, ``mmap``):
#: its objects, their bytes, and its own limit (``namespace_max_size``; 0: none).
NAMESPACE_USAGE_KEYS = ("namespace_objects", "namespace_used_bytes", "namespace_limit_bytes")


@runtime_checkable
class SDKHostPool(Protocol):
    """A host pool that hands out page buffers itself, as :class:`~hicache_storage.HostKVPool` does.

    ``page_buffers(indices, expected_pages)`` returns one :class:`PageBuffer` per page of
    ``indices`` (``page_size`` token indices per page, page aligned) and raises
    :class:`~hicache_storage.errors.HostIndicesError` for indices it cannot map.
    """

    @property
    def page_size(self) -> int:
        """Tokens per page."""

    @property
    def layout(self) -> str:
        """The pool's layout, one of :data:`~hicache_storage.layouts.LAYOUTS`."""

    def page_buffers(self, indices: HostIndices, expected_pages: int) -> list[PageBuffer]:
        """One :class:`PageBuffer` per page of ``indices`` (``expected_pages`` of them)."""


@runtime_checkable
class EngineHostPool(Protocol):
    """A reference-engine host pool (SGLang's ``HostKVCache``).

    ``get_page_buffer_meta(indices)`` returns two equal-length sequences, the address and
    the byte length of every segment of every page, pages in order; ``kv_buffer`` owns
    that memory (it is kept alive by the views made over it).
    """

    @property
    def page_size(self) -> int:
        """Tokens per page."""

    def get_page_buffer_meta(self, indices: HostIndices) -> tuple[Sequence[int], Sequence[int]]:
        """Address and byte length of every segment of every page of ``indices``."""


#: What ``register_mem_pool_host`` accepts. Either shape may also expose ``dtype``,
#: ``layout`` and ``mla``/``is_mla``, which are checked against the namespace.
HostPool: TypeAlias = "SDKHostPool | EngineHostPool"


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports, declared (never guessed from method names).

    A backend class declares its capabilities as a class attribute, which the registry
    reads without creating an instance. An instance may refine them in ``__init__`` once
    its options are known (``self.capabilities = dataclasses.replace(...)``, e.g. a size
    limit that depends on the configured slot size, or a wrapper taking its inner
    backend's); code holding an instance reads the instance's.

    Attributes:
        zero_copy: ``batch_set_pages``/``batch_get_pages`` move bytes between host memory
            and the store without an intermediate copy.
        delete: ``delete(key)`` and ``clear()`` are supported.
        persistent: objects survive the process (and a restart of it).
        shared: other processes (ranks) see the same objects.
        max_object_bytes: largest object accepted, ``None`` if unbounded.
        layouts: host-pool layouts ``register_mem_pool_host`` accepts.
        mla: MLA (rank-replicated) pools are supported.
    """

    zero_copy: bool = field(default=False, metadata={"claim": True})
    delete: bool = field(default=False, metadata={"claim": True})
    persistent: bool = field(default=False, metadata={"claim": True})
    shared: bool = field(default=False, metadata={"claim": True})
    max_object_bytes: int | None = None
    layouts: frozenset[str] = field(default_factory=lambda: frozenset(LAYOUTS))
    mla: bool = True

    def claimed(self) -> list[str]:
        """Names of the optional features this backend claims (``zero_copy``, ``delete``...).

        These are the capabilities that gate the conformance kit's checks.
        """
        return [
            f.name
            for f in dataclasses.fields(self)
            if f.metadata.get("claim") and getattr(self, f.name)
        ]

    def to_dict(self) -> dict[str, Any]:
        """The capabilities as a JSON-ready dict (layouts sorted)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = sorted(value) if isinstance(value, frozenset) else value
        return out


# --------------------------------------------------------------------------- the ABC


class HiCacheStorage(abc.ABC):
    """Base class of every L3 backend (see the module docstring for the contract).

    Constructor convention: ``Backend(config: StorageConfig | None = None, **options)``.
    Subclasses call ``super().__init__(config)`` and parse their options (see
    :func:`hicache_storage.config.parse_options`).

    Helpers for implementers (protected: for subclasses, not for the engine):

    * :meth:`object_name` -- the stored name of a key in this namespace and shard; every
      backend files a page under it, so stores never disagree on names;
    * :meth:`_map_pages` -- run a per-item function over a batch (optionally on worker
      threads), one item's exception failing only that item, counted and logged;
    * :meth:`_add_item_errors` -- report items that failed inside the current call when
      the backend catches per-item failures itself;
    * :meth:`_log_failure` -- log a failure, rate limited, secrets scrubbed;
    * :meth:`_record` -- add to the scalar counters (``bytes_read``,
      ``corrupt_objects``...) that :meth:`get_stats` reports.

    Bases that do more of the work live in :mod:`hicache_storage.storekit`
    (``BlobStore`` for key/value services, ``FileTreeStore`` for file systems).

    Class attributes:
        name: registry name (``"file"``, ``"redis"``...).
        capabilities: what the backend supports (see :class:`Capabilities`); an instance
            may refine the class's declaration in ``__init__``.
    """

    name: str = ""
    capabilities: Capabilities = Capabilities()

    def __init__(self, config: StorageConfig | None = None, **options: Any) -> None:
        if options:
            raise InvalidArgumentError(
                f"{type(self).__name__} takes no options, got {sorted(options)}"
            )
        self.config = config if config is not None else StorageConfig()
        self.namespace = self.config.namespace
        self.mem_pool_host: HostPool | None = None
        state = self._hicache_state()
        label = self.name or type(self).__name__
        if not getattr(type(self), "wraps_backend", False):  # (wrappers: their inner's)
            state.stats.bind(label, self.namespace.digest, self.usage)
        failures, backoff, most = breaker_options(self.config.extra_config)
        if failures > 0 and state.breaker is None:

            def changed(direction: str, to: str, stats: StatsRecorder = state.stats) -> None:
                if to == OPEN:
                    stats.add(breaker_opens=1)
                stats.circuit(direction, to)

            state.breaker = Breakers(label, failures, backoff, most, self.health, changed)

    @override
    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        guard_class(cls)

    # ------------------------------------------------------------------ bookkeeping

    def _hicache_state(self) -> InstanceState:
        state: InstanceState | None = self.__dict__.get("_hicache")
        if state is None:
            state = self.__dict__.setdefault("_hicache", InstanceState())
        return state

    @property
    def strict_contract(self) -> bool:
        """Raise on contract violations instead of replacing the result."""
        return self._hicache_state().strict

    @strict_contract.setter
    def strict_contract(self, value: bool) -> None:
        self._hicache_state().strict = bool(value)

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._hicache_state().closed

    def _log_failure(self, op: str, exc: BaseException) -> None:
        """Log a failure of operation ``op`` (rate limited), scrubbed of secrets.

        The message and, for unexpected exceptions, the traceback are scrubbed of this
        backend's secret option values and URL passwords: a client's error may quote them.
        """
        unexpected = not isinstance(exc, (BackendError, OSError, TimeoutError, ConnectionError))
        secrets = self._secret_values()
        text = scrub(str(exc), secrets)
        if unexpected:
            import traceback

            text += "\n" + scrub("".join(traceback.format_exception(exc)), secrets).rstrip()
        self._hicache_state().log(
            "fail:" + op,
            "%s.%s failed (%s: %s); returning its failure result",
            type(self).__name__,
            op,
            type(exc).__name__,
            text,
        )

    def _secret_values(self) -> list[str]:
        """Values of this backend's secret options (its ``options`` dataclass, if any)."""
        state = self._hicache_state()
        if state.secrets is not None:
            return state.secrets
        opts = getattr(self, "options", None)
        if opts is None or not dataclasses.is_dataclass(opts) or isinstance(opts, type):
            return []  # not parsed yet (or none): look again next time
        state.secrets = sorted(secret_values(opts))
        return state.secrets

    def _record(self, **counters: int) -> None:
        """Add to this backend's scalar counters (``bytes_read``, ``corrupt_objects``...)."""
        self._hicache_state().stats.add(**counters)

    #: What :meth:`watch_removals` reports for this backend (empty: nothing). Words for
    #: the docs: ``"evict"`` (objects its own capacity bound evicts), ``"delete"``,
    #: ``"clear"`` (made through this instance).
    reports_removals: ClassVar[frozenset[str]] = frozenset()

    def watch_removals(self, listener: Callable[[list[str] | None], None]) -> bool:
        """Have ``listener`` told of this namespace's objects this instance removes.

        ``listener(keys)`` gets the keys of objects this instance evicted (its capacity
        bound) or deleted, or ``None`` when it cleared the namespace. It runs on the
        thread that removed them, perhaps with the backend's locks held: it must be
        quick and must not call the backend. What other processes or the server remove
        (another writer's eviction, a TTL, a server's own eviction) is never reported.
        Returns False when the backend reports nothing (:attr:`reports_removals`).
        """
        if not self.reports_removals:
            return False
        self.__dict__.setdefault("_removal_listeners", []).append(listener)
        return True

    def _removed(self, keys: list[str] | None) -> None:
        """Tell the :meth:`watch_removals` listeners (a listener's error is logged only)."""
        for listener in self.__dict__.get("_removal_listeners", ()):
            try:
                listener(keys)
            except Exception:  # noqa: BLE001 - the removal happened; a listener bug is logged
                self._hicache_state().log(
                    "removal-listener", "a removal listener failed", exc_info=True
                )

    def _add_item_errors(self, count: int) -> None:
        """Count ``count`` items that failed inside the current call (call from its thread).

        A backend that catches per-item failures itself (in worker threads, say) logs them
        with :meth:`_log_failure` and reports how many here, so the stats stay right.
        """
        active = active_calls()
        if id(self) in active:
            active[id(self)] += count

    def _map_pages(
        self,
        op: str,
        n: int,
        fn: Callable[[int], object],
        mapper: Callable[[Callable[[int], bool], int], list[bool]] | None = None,
    ) -> list[bool]:
        """Run ``fn(i)`` for each item ``i < n``; an item that raises fails alone.

        ``fn`` returns a true value (anything but ``None``/``False``) when item ``i``
        succeeded. ``mapper`` runs the items (``IOPool.map`` to spread them over worker
        threads; serial in the caller's thread when omitted). Each exception is logged with
        :meth:`_log_failure` and counted once as an item error of the current call, safely
        from any number of worker threads. Returns one bool per item, in order.
        """
        lock = threading.Lock()
        errors = 0

        def one(i: int) -> bool:
            nonlocal errors
            try:
                done = fn(i)
            except Exception as exc:  # noqa: BLE001 - one item fails, the batch goes on
                self._log_failure(op, exc)
                with lock:
                    errors += 1
                return False
            return done is not None and done is not False

        out = mapper(one, n) if mapper is not None else [one(i) for i in range(n)]
        self._add_item_errors(errors)
        return out

    def object_name(self, key: str) -> ObjectName:
        """The stored name of ``key`` for this backend's namespace and shard.

        :func:`~hicache_storage.keys.object_name`, with recent names remembered
        (:class:`~hicache_storage.keys.ObjectNamer`): an invalid key raises
        :class:`~hicache_storage.errors.InvalidKeyError` every time.
        """
        return self.object_namer().name(key)

    def object_names(self, keys: list[str]) -> list[ObjectName]:
        """:meth:`object_name` of every key, keys not seen before named as one batch."""
        return self.object_namer().names(keys)

    def object_namer(self) -> ObjectNamer:
        """The :class:`~hicache_storage.keys.ObjectNamer` of this namespace and shard.

        For a backend's batch loops: ``object_namer().paths(keys, prefix)`` names a whole
        batch in one call. (Rebuilt when ``namespace`` or ``config`` is replaced.)
        """
        cached = self.__dict__.get("_object_namer")
        namespace, config = self.namespace, self.config
        if cached is None or cached[0] is not namespace or cached[1] is not config:
            cached = (namespace, config, ObjectNamer(namespace.digest, config.shard))
            self.__dict__["_object_namer"] = cached
        namer: ObjectNamer = cached[2]
        return namer

    def object_path(self, key: str) -> str:
        """``object_name(key).path`` (remembered, like the name itself)."""
        return self.object_namer().path(key)

    @classmethod
    def overrides(cls, op: str) -> bool:
        """True if this class implements the engine-facing method ``op`` itself.

        False when ``op`` is the base class's default (the per-key loop for the batch
        forms). The conformance kit uses it to check that a ``zero_copy`` claim is backed
        by a native ``batch_get_pages``/``batch_set_pages``.
        """
        if op not in ENGINE_OPS:
            raise InvalidArgumentError(f"{op!r} is not an engine-facing method: {ENGINE_OPS}")
        return _overrides(cls, op, HiCacheStorage)

    def get_stats(self, reset: bool = True) -> StorageStats:
        """Return the counters since the last reset; by default reset them (reference semantics)."""
        return self._hicache_state().stats.snapshot(reset=reset)

    # ------------------------------------------------------------------ abstract core

    @abc.abstractmethod
    def get(self, key: str, target: ReadTarget | None = None) -> Any:
        """Read ``key``.

        Args:
            key: a valid key.
            target: where to put the bytes: a CPU tensor, a writable buffer, a
                :class:`~hicache_storage.buffers.PageBuffer`, or ``None``.

        Returns:
            ``target`` filled completely, or (``target=None``) a new 1-D uint8 tensor;
            ``None`` on a miss **and** when the stored size differs from the target's, in
            which case the target is left untouched. Never a partial fill.
        """

    @abc.abstractmethod
    def set(self, key: str, value: WriteValue) -> bool:
        """Store ``value`` under ``key``.

        ``value`` is a CPU tensor (its bytes), a bytes-like object or a PageBuffer. If
        ``key`` is already stored this is a no-op that returns True and refreshes its
        recency: the first writer wins and stored bytes are never replaced. No reader may
        ever observe a partially written value.
        """

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """True if ``key`` is stored (completely: a value being written does not exist)."""

    # ------------------------------------------------------------------ defaults

    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it was stored. Default: not supported."""
        raise NotSupportedError(f"{type(self).__name__} does not support delete")

    def clear(self) -> None:
        """Remove every object of this backend's namespace, and only those.

        The backend stays usable. Default: not supported.
        """
        raise NotSupportedError(f"{type(self).__name__} does not support clear")

    def batch_get(self, keys: list[str], targets: Sequence[ReadTarget] | None = None) -> list[Any]:
        """``get`` each key; one result per key, in order.

        Note for implementers: the default loops over :meth:`get`, one round trip per key.
        """
        if targets is None:
            return [self.get(k) for k in keys]
        return [self.get(k, t) for k, t in zip(keys, targets, strict=False)]

    def batch_set(self, keys: list[str], values: Sequence[WriteValue]) -> list[bool]:
        """``set`` each key; one bool per key, in order.

        Note for implementers: the default loops over :meth:`set` and is not atomic as a
        whole; each key is atomic on its own.
        """
        return [self.set(k, v) for k, v in zip(keys, values, strict=False)]

    def batch_exists(self, keys: list[str], extra_info: object = None) -> int:
        """Return the number of consecutive keys present, from the start.

        A gap at index ``i`` returns ``i`` even if later keys exist. Note for implementers:
        the default stops at the first miss.
        """
        for i, k in enumerate(keys):
            if not self.exists(k):
                return i
        return len(keys)

    def batch_exists_each(self, keys: list[str]) -> list[bool]:
        """Whether each key is present, one answer per key (a miss does not stop it).

        For stores whose pages are not leading runs: a hybrid model's Mamba or
        sliding-window states exist only where a prefix ended. Note for implementers:
        the default calls :meth:`exists` per key; a remote store should ask in one round.
        """
        return [self.exists(k) for k in keys]

    def batch_get_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        """Read each key into its page buffer; True where the page landed completely.

        Note for implementers: this is the native zero-copy path behind ``batch_get_v1``.
        The default calls :meth:`get` with each PageBuffer as target.
        """
        out: list[bool] = []
        for k, page in zip(keys, pages, strict=False):
            r = self.get(k, page)
            if r is None:
                out.append(False)
            elif r is page:
                out.append(True)
            else:
                out.append(copy_into(page.views, source_views(r)))
        return out

    def batch_set_pages(self, keys: list[str], pages: Sequence[PageBuffer]) -> list[bool]:
        """Store each page buffer under its key; True where the page is stored.

        Note for implementers: this is the native zero-copy path behind ``batch_set_v1``.
        The default calls :meth:`set` for each page.
        """
        return [self.set(k, p) for k, p in zip(keys, pages, strict=False)]

    # ------------------------------------------------------------------ zero-copy v1

    def register_mem_pool_host(self, mem_pool_host: HostPool) -> None:
        """Attach the host KV pool that v1 host indices refer to.

        Raises :class:`NotSupportedError` for a layout the backend does not support and
        :class:`NamespaceMismatchError` when the pool contradicts the namespace (page
        size, dtype, layout, MLA), so a mismatch fails at attach time, not as silent
        collisions later.
        """
        layout = getattr(mem_pool_host, "layout", None)
        caps = self.capabilities
        if layout is not None and layout not in caps.layouts:
            raise NotSupportedError(
                f"{type(self).__name__} does not support the {layout!r} host layout; "
                f"supported: {sorted(caps.layouts)}"
            )
        is_mla = bool(getattr(mem_pool_host, "mla", getattr(mem_pool_host, "is_mla", False)))
        if is_mla and not caps.mla:
            raise NotSupportedError(f"{type(self).__name__} does not support MLA host pools")
        if self.namespace != DEFAULT_NAMESPACE:
            self.namespace.check_pool(mem_pool_host)
        self.mem_pool_host = mem_pool_host

    def _resolve_pages(self, keys: list[str], host_indices: HostIndices) -> list[PageBuffer] | None:
        pool = self.mem_pool_host
        if pool is None:
            self._hicache_state().log(
                "v1:nopool",
                "%s: v1 call before register_mem_pool_host(); all pages fail",
                type(self).__name__,
            )
            return None
        try:
            if hasattr(pool, "page_buffers"):
                pages: list[PageBuffer] = pool.page_buffers(host_indices, expected_pages=len(keys))
                return pages
            return pages_from_meta(pool, host_indices, len(keys))
        except HostIndicesError as exc:
            self._hicache_state().log(
                "v1:indices", "%s: %s; all pages fail", type(self).__name__, exc
            )
            return None

    def batch_set_v1(
        self, keys: list[str], host_indices: HostIndices, extra_info: object = None
    ) -> list[bool]:
        """Store the host-pool pages at ``host_indices`` under ``keys`` (zero-copy).

        ``len(host_indices)`` must be ``len(keys) * page_size`` and page aligned; otherwise
        every page fails (logged). Returns one bool per page, never None, never 2N.
        """
        pages = self._resolve_pages(keys, host_indices)
        if pages is None:
            return [False] * len(keys)
        return self.batch_set_pages(keys, pages)

    def batch_get_v1(
        self, keys: list[str], host_indices: HostIndices, extra_info: object = None
    ) -> list[bool]:
        """Read ``keys`` into the host-pool pages at ``host_indices`` (zero-copy).

        Same index rules as :meth:`batch_set_v1`. The caller uses the leading run of True.
        """
        pages = self._resolve_pages(keys, host_indices)
        if pages is None:
            return [False] * len(keys)
        return self.batch_get_pages(keys, pages)

    # ------------------------------------------------------------------ introspection

    def health(self) -> Health:
        """Whether the store answers: ``ok``, ``degraded`` or ``down``, with a reason.

        A cheap probe (a ping, a stat, one existence check), safe to call from any
        thread at any time; it never raises. The circuit breaker calls it while open
        (:mod:`hicache_storage.breaker`). Default: ``down`` once closed; otherwise
        ``ok`` with "no probe" (the breaker then lets one call through as its trial).
        """
        if self._hicache_state().closed:
            return Health("down", "closed")
        return Health("ok", "no probe")

    @property
    def circuit(self) -> str:
        """The circuit breakers' state: ``closed``, ``open``, ``half_open`` or ``off``.

        The worse of the reads' and the writes' breakers.
        """
        breaker = self._hicache_state().breaker
        return breaker.state if breaker is not None else "off"

    def usage(self) -> dict[str, int]:
        """What the store holds, in one schema for every backend (:data:`USAGE_KEYS`).

        ``objects``: the objects this instance counts (its namespace, or its whole root
        for a store with one budget per root); ``used_bytes``: what they take, as the
        backend counts it against its limit; ``limit_bytes``: that limit (``max_size``,
        or the arena's size), 0 when none is set. -1 for a figure the backend cannot
        tell cheaply (a remote store, or a local one that does not count without a
        limit). Backends may add keys of their own (documented on their page); these
        three are always there, as ints. Default: all three -1.
        """
        return dict.fromkeys(USAGE_KEYS, -1)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Release resources. Idempotent.

        Afterwards every engine-facing call returns its failure shape, and ``delete`` and
        ``clear`` raise :class:`~hicache_storage.errors.BackendClosedError`.
        """

    def __enter__(self) -> Self:
        """Use the backend as a context manager; it is closed on exit."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the backend."""
        self.close()

    @override
    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(namespace={self.namespace.digest}, shard={self.config.shard})"
        )


guard_class(HiCacheStorage)
