"""Any hicache-storage backend as an LMCache remote storage plugin.

LMCache (0.5.6) loads remote storage plugins by module path. In its config::

    remote_storage_plugins: ["hicache"]
    extra_config:
      remote_storage_plugin.hicache.module_path: hicache_storage.integrations.lmcache
      remote_storage_plugin.hicache.class_name: HiCacheConnectorAdapter
      remote_storage_plugin.hicache.backend_name: file
      remote_storage_plugin.hicache.backend_options: {"root": "/var/cache/kv"}

``hicache-storage lmcache-args`` prints this for any backend and its options. The
plugin's name must start with ``hicache`` (``hicache``, ``hicache.fast``...): LMCache asks
its own adapters first, and they claim names such as ``fs*`` and ``redis*``.

**What is stored.** One object per LMCache chunk: the bytes of its ``MemoryObj``, exactly,
under a key derived from LMCache's key (:func:`object_key`). Everything else that says
what those bytes are goes into the namespace, so two deployments that differ in any of
it never share objects: the model, the KV dtype, the chunk size (the namespace's page
size), the chunk format and the shape of a full chunk without its token dimension (the
object layout), and LMCache's world size and worker (the shard). ``tenant`` in the options
keeps otherwise identical deployments apart. The backend adds what it adds everywhere:
atomic publication, first writer wins, a header with a checksum verified on every read,
so a damaged, foreign or short object is a miss, never a wrong ``MemoryObj``.

**Calls.** LMCache calls a connector on one event loop thread shared by every remote
backend (``exists``, ``get``, ``put`` and their batched forms) and on its own threads
(``batched_contains``, ``exists_sync``). The SDK's calls block, so they run on this
plugin's threads; each query (``exists``, ``batched_contains``) is bounded by
``timeout`` seconds and a store past it is a miss, since LMCache bounds only its gets.
Puts finish before they return (LMCache reuses the buffer after), and gets read straight
into the ``MemoryObj`` LMCache allocates: no copy on either side where the backend
allows it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
from typing_extensions import override

from hicache_storage.config import StorageConfig, parse_options
from hicache_storage.errors import ConfigError
from hicache_storage.integrations.deadline import call_with_deadline
from hicache_storage.keys import KVCacheNamespace, normalize_dtype
from hicache_storage.ratelimit import RateLimitedLog
from hicache_storage.registry import create_backend
from hicache_storage.secrets import scrub, secret_values

if TYPE_CHECKING:
    from hicache_storage.protocol import HiCacheStorage

__all__ = [
    "PLUGIN_PREFIX",
    "HiCacheConnectorAdapter",
    "HiCacheRemoteConnector",
    "PluginOptions",
    "object_key",
]

logger = logging.getLogger(__name__)

#: Every plugin name this module serves starts with it (``hicache``, ``hicache.<any>``).
PLUGIN_PREFIX = "hicache"

#: The plugin's own keys under ``remote_storage_plugin.<name>.``; the rest of the
#: backend's options go in ``backend_options``.
OWN_KEYS = ("module_path", "class_name", "backend_name", "backend_options", "timeout",
            "tenant", "io_threads")  # fmt: skip


@dataclass(frozen=True)
class PluginOptions:
    """The plugin's options (``remote_storage_plugin.<name>.<option>``).

    Attributes:
        backend_name: the hicache-storage backend (any installed one, or ``module:Class``).
        backend_options: that backend's options: a mapping, or a JSON object as a string.
        timeout: seconds an existence query may take before it counts as a miss (LMCache
            bounds its gets by ``blocking_timeout_secs``, not its queries).
        tenant: kept apart from every other tenant's objects.
        io_threads: threads that run the backend's calls off LMCache's event loop.
    """

    backend_name: str = ""
    backend_options: Any = None
    timeout: float = 5.0
    tenant: str = ""
    io_threads: int = 4

    def __post_init__(self) -> None:
        """Refuse a missing backend name, a timeout <= 0 and fewer than one thread."""
        if not self.backend_name:
            raise ConfigError("backend_name is required (e.g. file, redis, s3)")
        if not self.timeout > 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {self.timeout!r}")
        if self.io_threads < 1:
            raise ConfigError(f"io_threads must be >= 1, got {self.io_threads}")

    def backend_kwargs(self) -> dict[str, Any]:
        """The backend's options as a dict."""
        given = self.backend_options
        if given is None or given == "":
            return {}
        if isinstance(given, str):
            try:
                given = json.loads(given)
            except ValueError as exc:
                raise ConfigError(f"backend_options is not a JSON object: {exc}") from None
        if not isinstance(given, dict):
            raise ConfigError(f"backend_options must be a mapping, got {type(given).__name__}")
        return dict(given)


def plugin_options(config: Any, name: str) -> PluginOptions:
    """The options of plugin ``name`` in LMCache's ``extra_config``."""
    extra = getattr(config, "extra_config", None) or {}
    prefix = f"remote_storage_plugin.{name}."
    mine = {k[len(prefix) :]: v for k, v in extra.items() if k.startswith(prefix)}
    unknown = sorted(set(mine) - set(OWN_KEYS))
    if unknown:
        raise ConfigError(
            f"unknown options of LMCache plugin {name!r}: {', '.join(unknown)} (the backend's "
            f"own go in {prefix}backend_options)"
        )
    own = {k: v for k, v in mine.items() if k not in ("module_path", "class_name")}
    return parse_options(PluginOptions, f"lmcache plugin {name}", own)


def object_key(key: Any) -> str:
    """The object key of LMCache key ``key`` (a ``CacheEngineKey``).

    A digest of its whole string form (model, world size, worker, chunk hash, dtype and
    any request tags): the namespace holds the first four, and the digest keeps every
    tag apart without having to be a valid object name itself.
    """
    return hashlib.sha256(key.to_string().encode()).hexdigest()


def _fmt_name(fmt: Any) -> str:
    return str(getattr(fmt, "name", fmt))


class HiCacheRemoteConnector(RemoteConnector):  # type: ignore[misc]
    """An LMCache ``RemoteConnector`` over a hicache-storage backend.

    Built by :class:`HiCacheConnectorAdapter` (with the plugin's name), or by LMCache
    directly when ``class_name`` names this class (then the plugin is found by looking
    for the one plugin entry that names it).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: Any,
        config: Any,
        plugin_name: str | None = None,
        metadata: Any = None,
    ) -> None:
        metadata = metadata if metadata is not None else local_cpu_backend.metadata
        super().__init__(config, metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.metadata = metadata
        self.plugin_name = plugin_name or _own_plugin_name(config)
        self.options = plugin_options(config, self.plugin_name)
        self._backend_options = self.options.backend_kwargs()
        self._secrets = secret_values(self._backend_options)
        self._partial_chunks = bool(getattr(config, "save_unfull_chunk", False))
        self._backends: dict[tuple[str, int, int, str], HiCacheStorage] = {}
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self.options.io_threads, thread_name_prefix=f"hicache-lmcache-{self.plugin_name}"
        )
        self._log = RateLimitedLog(logger)
        self._closed = False
        # A full chunk's shape without its token dimension, and the format: the object
        # layout of the namespace (the chunk size is its page size).
        shapes = ";".join(
            "x".join(str(d) for i, d in enumerate(shape) if i != 2) for shape in self.meta_shapes
        )
        dtypes = ",".join(normalize_dtype(d) for d in self.meta_dtypes)
        self._layout = f"lmcache/{_fmt_name(self.meta_fmt)}/{shapes}/{dtypes}"
        # Fail at start on a name or options the backend refuses, not at the first put.
        self._check_backend()

    # ------------------------------------------------------------------ backends

    def namespace_for(self, key: Any) -> KVCacheNamespace:
        """The namespace of LMCache key ``key``'s objects (see the module's docstring)."""
        return KVCacheNamespace(
            model_id=str(key.model_name),
            dtype=normalize_dtype(key.dtype),
            page_size=int(self.metadata.chunk_size),
            object_layout=self._layout,
            tenant="-".join(t for t in ("lmcache", self.options.tenant) if t),
        )

    def _backend(self, key: Any) -> HiCacheStorage:
        ident = (str(key.model_name), int(key.world_size), int(key.worker_id), str(key.dtype))
        backend = self._backends.get(ident)
        if backend is not None:
            return backend
        with self._lock:
            backend = self._backends.get(ident)
            if backend is None:
                if self._closed:
                    raise ConfigError("the LMCache plugin is closed")
                config = StorageConfig(
                    namespace=self.namespace_for(key),
                    tp_rank=int(key.worker_id),
                    tp_size=max(1, int(key.world_size)),
                )
                backend = create_backend(self.options.backend_name, config, **self._backend_options)
                self._backends[ident] = backend
        return backend

    def _check_backend(self) -> None:
        from hicache_storage.registry import load_backend_class

        load_backend_class(self.options.backend_name)

    def _groups(self, keys: list[Any]) -> dict[HiCacheStorage, list[int]]:
        """The positions of ``keys`` by the backend that holds them (in key order)."""
        out: dict[HiCacheStorage, list[int]] = {}
        for i, key in enumerate(keys):
            out.setdefault(self._backend(key), []).append(i)
        return out

    def _failed(self, what: str, exc: BaseException) -> None:
        text = scrub(f"{type(exc).__name__}: {exc}", self._secrets)
        self._log(what, "hicache LMCache plugin %s: %s failed (%s)", self.plugin_name, what, text)

    async def _run(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on this plugin's threads (the SDK's calls block)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _bounded(self, fn: Any, *args: Any) -> Any:
        """As :meth:`_run`, within ``timeout`` seconds (``asyncio.TimeoutError`` past it)."""
        return await asyncio.wait_for(self._run(fn, *args), self.options.timeout)

    # ------------------------------------------------------------------ queries

    def _count(self, keys: list[Any]) -> int:
        """The leading run of ``keys`` that is stored.

        One query per run of keys that share a backend: one in all, for one deployment's.
        """
        at = 0
        while at < len(keys):
            backend = self._backend(keys[at])
            end = at + 1
            while end < len(keys) and self._backend(keys[end]) is backend:
                end += 1
            hits = int(backend.batch_exists([object_key(k) for k in keys[at:end]]))
            if hits < end - at:
                return at + max(0, hits)
            at = end
        return at

    @override
    async def exists(self, key: Any) -> bool:
        try:
            return bool(await self._bounded(self._count, [key]))
        except (TimeoutError, Exception) as exc:  # noqa: BLE001 - a miss
            self._failed("exists", exc)
            return False

    @override
    def exists_sync(self, key: Any) -> bool:
        return self.batched_contains([key]) == 1

    @override
    def support_batched_contains(self) -> bool:
        return True

    @override
    def batched_contains(self, keys: list[Any]) -> int:
        if not keys:
            return 0
        try:
            done, count = call_with_deadline(
                lambda: self._count(list(keys)), self.options.timeout, "hicache-lmcache-contains"
            )
        except Exception as exc:  # noqa: BLE001 - a miss
            self._failed("batched_contains", exc)
            return 0
        if not done:
            self._failed("batched_contains", TimeoutError(f"past {self.options.timeout} s"))
            return 0
        return int(count or 0)

    @override
    async def batched_async_contains(
        self, lookup_id: str, keys: list[Any], pin: bool = False
    ) -> int:
        try:
            return int(await self._bounded(self._count, list(keys)))
        except (TimeoutError, Exception) as exc:  # noqa: BLE001 - a miss
            self._failed("batched_async_contains", exc)
            return 0

    # ------------------------------------------------------------------ reads

    def _allocate(self) -> Any:
        return self.local_cpu_backend.allocate(
            self.meta_shapes, self.meta_dtypes, self.meta_fmt, busy_loop=False
        )

    def _read(self, keys: list[Any], objs: list[Any]) -> list[bool]:
        """Read each key into its allocated full-chunk object; True where it landed."""
        out = [False] * len(keys)
        for backend, positions in self._groups(keys).items():
            names = [object_key(keys[i]) for i in positions]
            targets = [objs[i].byte_array.cast("B") for i in positions]
            got = backend.batch_get(names, targets)
            for i, g in zip(positions, got, strict=True):
                out[i] = g is not None
        return out

    def _read_partial(self, key: Any) -> Any:
        """A chunk of fewer tokens than a full one (``save_unfull_chunk``), or None."""
        backend = self._backend(key)
        data = backend.get(object_key(key))
        if data is None:
            return None
        n = int(data.numel())
        if n == 0 or n >= self.full_chunk_size_bytes or n % self.single_token_size:
            return None  # (a full chunk would have been read; anything else is not ours)
        obj = self._allocate()
        if obj is None:
            return None
        try:
            view = obj.byte_array.cast("B")
            view[:n] = memoryview(data.numpy()).cast("B")
            return self.reshape_partial_chunk(obj, n)
        except Exception:
            obj.ref_count_down()
            raise

    def _get_many(self, keys: list[Any]) -> list[Any]:
        objs: list[Any] = []
        try:
            for _ in keys:
                obj = self._allocate()
                if obj is None:
                    break  # (no room in LMCache's buffer: the rest are misses)
                objs.append(obj)
            landed = self._read(keys[: len(objs)], objs)
        except BaseException:
            for obj in objs:
                obj.ref_count_down()
            raise
        out: list[Any] = []
        for i, key in enumerate(keys):
            if i < len(objs) and landed[i]:
                out.append(objs[i])
                continue
            if i < len(objs):
                objs[i].ref_count_down()
            out.append(self._read_partial(key) if self._partial_chunks else None)
        return out

    @override
    async def get(self, key: Any) -> Any:
        return (await self.batched_get([key]))[0]

    @override
    def support_batched_get(self) -> bool:
        return True

    @override
    async def batched_get(self, keys: list[Any]) -> list[Any]:
        try:
            return list(await self._run(self._get_many, list(keys)))
        except Exception as exc:  # noqa: BLE001 - misses
            self._failed("get", exc)
            return [None] * len(keys)

    @override
    def support_batched_get_non_blocking(self) -> bool:
        return True

    @override
    async def batched_get_non_blocking(self, lookup_id: str, keys: list[Any]) -> list[Any]:
        """The leading run of ``keys`` that is stored, read in one batch.

        The objects read after the first miss are released, as LMCache's contract asks.
        """
        got = await self.batched_get(keys)
        out: list[Any] = []
        for i, obj in enumerate(got):
            if obj is None:
                for rest in got[i + 1 :]:
                    if rest is not None:
                        rest.ref_count_down()
                break
            out.append(obj)
        return out

    # ------------------------------------------------------------------ writes

    def _put_many(self, keys: list[Any], objs: list[Any]) -> None:
        for backend, positions in self._groups(keys).items():
            names = [object_key(keys[i]) for i in positions]
            values = [objs[i].byte_array.cast("B") for i in positions]
            backend.batch_set(names, values)

    @override
    async def put(self, key: Any, memory_obj: Any) -> None:
        await self.batched_put([key], [memory_obj])

    @override
    def support_batched_put(self) -> bool:
        return True

    @override
    async def batched_put(self, keys: list[Any], memory_objs: list[Any]) -> None:
        # Done before returning: LMCache releases the buffers once this returns.
        try:
            await self._run(self._put_many, list(keys), list(memory_objs))
        except Exception as exc:  # noqa: BLE001 - a put that fails is not stored
            self._failed("put", exc)

    # ------------------------------------------------------------------ the rest

    @override
    def support_ping(self) -> bool:
        return True

    @override
    async def ping(self) -> int:
        def health() -> int:
            with self._lock:
                backends = list(self._backends.values())
            return 0 if all(b.health().usable for b in backends) else 1

        try:
            return int(await self._bounded(health))
        except (TimeoutError, Exception) as exc:  # noqa: BLE001
            self._failed("ping", exc)
            return 1

    @override
    def remove_sync(self, key: Any) -> bool:
        backend = self._backend(key)
        if not backend.capabilities.delete:
            return False
        return bool(backend.delete(object_key(key)))

    @override
    async def list(self) -> list[str]:
        return []  # (the store names objects by digest: LMCache's keys cannot be listed)

    @override
    async def close(self) -> None:
        with self._lock:
            self._closed = True
            backends, self._backends = list(self._backends.values()), {}
        for b in backends:
            try:
                b.close()
            except Exception as exc:  # noqa: BLE001
                self._failed("close", exc)
        self._pool.shutdown(wait=False)


def _own_plugin_name(config: Any) -> str:
    """The one plugin entry of ``config`` that names this module (direct loading)."""
    extra = getattr(config, "extra_config", None) or {}
    names = [
        k[len("remote_storage_plugin.") : -len(".module_path")]
        for k, v in extra.items()
        if k.startswith("remote_storage_plugin.") and k.endswith(".module_path") and v == __name__
    ]
    if len(names) != 1:
        raise ConfigError(
            f"cannot tell which plugin entry is this one ({names or 'none'} name {__name__}): "
            "load HiCacheConnectorAdapter, which is told its name"
        )
    return str(names[0])


class HiCacheConnectorAdapter(ConnectorAdapter):  # type: ignore[misc]
    """LMCache's entry point: a :class:`HiCacheRemoteConnector` per plugin ``hicache*``.

    It serves the plugins named ``hicache`` or ``hicache.<anything>``.
    """

    def __init__(self) -> None:
        super().__init__(f"plugin://{PLUGIN_PREFIX}")

    @override
    def can_parse(self, url: str) -> bool:
        if not url.startswith("plugin://"):
            return False
        name = url[len("plugin://") :]
        return name == PLUGIN_PREFIX or name.startswith(PLUGIN_PREFIX + ".")

    @override
    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        name = context.plugin_name or context.url[len("plugin://") :]
        return HiCacheRemoteConnector(
            context.loop, context.local_cpu_backend, context.config, name, context.metadata
        )
