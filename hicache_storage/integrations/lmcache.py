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
import queue
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
from typing_extensions import override

from hicache_storage.config import StorageConfig, parse_options
from hicache_storage.errors import ConfigError
from hicache_storage.integrations.deadline import Lane
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
#: The plugin names this module serves: ``hicache`` or ``hicache.<letters, digits, _ ->``.
PLUGIN_NAME = re.compile(r"hicache|hicache\.[A-Za-z0-9_-]+")

#: LMCache's health check writes and reads this key (model ``test``, chunk hash 0) with new
#: bytes each time: it gets an object of its own per write (first writer wins elsewhere).
HEALTH_CHECK_MODEL, HEALTH_CHECK_HASH = "test", 0

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
    # (only keys with no further dot: "hicache.b"'s keys are not "hicache"'s)
    mine = {
        k[len(prefix) :]: v
        for k, v in extra.items()
        if k.startswith(prefix) and "." not in k[len(prefix) :]
    }
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


class _Workers:
    """Daemon threads that run submitted calls; the process never waits for them at exit.

    ``pending`` counts calls queued or running; :meth:`close` refuses new ones, cancels
    the queued ones and waits for the running ones to return.
    """

    def __init__(self, n: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Any] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Condition()
        self.pending = 0
        self._closed = False
        self._threads = [
            threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True) for i in range(n)
        ]
        for t in self._threads:
            t.start()

    def submit(self, fn: Any, *args: Any) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                fut.set_exception(ConfigError("the LMCache plugin is closed"))
                return fut
            self.pending += 1
        self._jobs.put((fut, lambda: fn(*args)))
        return fut

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            fut, call = item
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(call())
                    except BaseException as exc:  # noqa: BLE001 - the caller's to see
                        fut.set_exception(exc)
            finally:
                with self._lock:
                    self.pending -= 1
                    self._lock.notify_all()

    def close(self, timeout: float) -> bool:
        """Refuse new calls, cancel the queued ones, wait for the running ones.

        Waits at most ``timeout`` seconds; False if a call was still running then.
        """
        with self._lock:
            self._closed = True
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
                with self._lock:
                    self.pending -= 1
        for _ in self._threads:
            self._jobs.put(None)
        end = time.monotonic() + timeout
        with self._lock:
            while self.pending > 0:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True


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
        serde = getattr(config, "remote_serde", "naive") or "naive"
        if serde != "naive":
            raise ConfigError(
                f"remote_serde {serde!r}: the hicache plugin stores LMCache's chunks as they "
                "are (remote_serde: naive); a compressed chunk would read back as a miss"
            )
        self._lock = threading.Lock()
        tag = f"hicache-lmcache-{self.plugin_name}"
        # Reads and writes on threads of their own (a hung store's writes never hold up
        # reads); queries on a lane that answers "busy" while its last query still hangs.
        self._reads = _Workers(self.options.io_threads, tag + "-read")
        self._writes = _Workers(self.options.io_threads, tag + "-write")
        self._queries = Lane(tag + "-query")
        self._health_name: str | None = None
        self.dropped_puts = 0  # puts refused because the store had too many in flight
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
        """Refuse an unknown backend, or options it does not take.

        LMCache only logs an error at start; every call would be a miss after it.
        """
        from hicache_storage.registry import load_backend_class

        try:
            cls = load_backend_class(self.options.backend_name)
            options_class = getattr(cls, "options_class", None)
            if options_class is not None:
                name = getattr(cls, "name", "") or self.options.backend_name
                parse_options(options_class, name, dict(self._backend_options))
        except Exception as exc:
            text = scrub(f"{type(exc).__name__}: {exc}", self._secrets)
            logger.error("hicache LMCache plugin %s: cannot start: %s", self.plugin_name, text)
            raise

    def _name(self, key: Any, write: bool = False) -> str:
        """The object name of ``key``; LMCache's health-check key gets a new one per write."""
        if str(key.model_name) == HEALTH_CHECK_MODEL and int(key.chunk_hash) == HEALTH_CHECK_HASH:
            if write:
                self._health_name = f"health-{uuid.uuid4().hex}"
            return self._health_name or "health-none"
        return object_key(key)

    def _groups(self, keys: list[Any]) -> dict[HiCacheStorage, list[int]]:
        """The positions of ``keys`` by the backend that holds them (in key order)."""
        out: dict[HiCacheStorage, list[int]] = {}
        for i, key in enumerate(keys):
            out.setdefault(self._backend(key), []).append(i)
        return out

    def _failed(self, what: str, exc: BaseException) -> None:
        text = scrub(f"{type(exc).__name__}: {exc}", self._secrets)
        self._log(what, "hicache LMCache plugin %s: %s failed (%s)", self.plugin_name, what, text)

    def _query(self, keys: list[Any]) -> int:
        """:meth:`_count` within ``timeout``, on the query lane.

        0 past the deadline, and 0 at once while the last query still hangs: one stuck
        thread at most, never one per call.
        """
        outcome, job = self._queries.run(lambda _job: self._count(keys), self.options.timeout)
        if outcome != "done":
            self._failed("contains", TimeoutError(f"{outcome}: past {self.options.timeout} s"))
            return 0
        return int(job.result or 0)

    async def _query_async(self, keys: list[Any]) -> int:
        """:meth:`_query` off LMCache's event loop (it waits at most ``timeout``)."""
        fut = self._reads.submit(self._query, keys)
        return int(await asyncio.wrap_future(fut))

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
            hits = int(backend.batch_exists([self._name(k) for k in keys[at:end]]))
            if hits < end - at:
                return at + max(0, hits)
            at = end
        return at

    @override
    async def exists(self, key: Any) -> bool:
        try:
            return bool(await self._query_async([key]))
        except Exception as exc:  # noqa: BLE001 - a miss
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
            return self._query(list(keys))
        except Exception as exc:  # noqa: BLE001 - a miss
            self._failed("batched_contains", exc)
            return 0

    @override
    async def batched_async_contains(
        self, lookup_id: str, keys: list[Any], pin: bool = False
    ) -> int:
        try:
            return await self._query_async(list(keys))
        except Exception as exc:  # noqa: BLE001 - a miss
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
            names = [self._name(keys[i]) for i in positions]
            targets = [objs[i].byte_array.cast("B") for i in positions]
            got = backend.batch_get(names, targets)
            for i, g in zip(positions, got, strict=True):
                out[i] = g is not None
        return out

    def _read_partial(self, key: Any) -> Any:
        """A chunk of fewer tokens than a full one (``save_unfull_chunk``), or None."""
        backend = self._backend(key)
        data = backend.get(self._name(key))
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
        try:
            for i, key in enumerate(keys):
                if i < len(objs) and landed[i]:
                    out.append(objs[i])
                    continue
                if i < len(objs):
                    obj, objs[i] = objs[i], None
                    obj.ref_count_down()
                missing = i >= len(objs)  # (no room in the buffer: no partial read either)
                out.append(
                    self._read_partial(key) if self._partial_chunks and not missing else None
                )
        except BaseException:
            for obj in [*out, *objs[len(out) :]]:
                if obj is not None:
                    obj.ref_count_down()
            raise
        return out

    @override
    async def get(self, key: Any) -> Any:
        return (await self.batched_get([key]))[0]

    @override
    def support_batched_get(self) -> bool:
        return True

    @override
    async def batched_get(self, keys: list[Any]) -> list[Any]:
        fut = self._reads.submit(self._get_many, list(keys))
        try:
            return list(await asyncio.wrap_future(fut))
        except asyncio.CancelledError:
            # LMCache gave up (blocking_timeout_secs): whatever the read still returns is
            # nobody's, so it is released when it does.
            fut.add_done_callback(_release_result)
            raise
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

    def _put_many(self, keys: list[Any], staged: list[bytearray]) -> None:
        for backend, positions in self._groups(keys).items():
            names = [self._name(keys[i], write=True) for i in positions]
            backend.batch_set(names, [staged[i] for i in positions])

    @override
    async def put(self, key: Any, memory_obj: Any) -> None:
        await self.batched_put([key], [memory_obj])

    @override
    def support_batched_put(self) -> bool:
        return True

    @override
    async def batched_put(self, keys: list[Any], memory_objs: list[Any]) -> None:
        # The chunks are copied out of LMCache's buffers first and written from the copy:
        # LMCache frees its buffers when an engine closes, before it closes its remote
        # backends (0.5.6), so a write in flight or queued must never read them. This returns once
        # the write did (a get right after it finds the chunk). A store with more puts in
        # flight than twice the threads (slow or hung) gets no more: the put is dropped at
        # once, and the copies held stay bounded.
        if self._writes.pending >= 2 * self.options.io_threads:
            self.dropped_puts += len(keys)
            self._failed("put", RuntimeError("too many puts in flight; this one is dropped"))
            return
        # (copied here, on LMCache's loop, while LMCache holds the buffers for this call:
        # a queued write thread could start after LMCache freed them)
        staged = [bytearray(obj.byte_array.cast("B")) for obj in memory_objs]
        fut = self._writes.submit(self._put_many, list(keys), staged)
        fut.add_done_callback(self._put_done)
        try:
            await asyncio.shield(asyncio.wrap_future(fut))
        except Exception:  # noqa: BLE001, S110 - logged by _put_done; a failed put is not stored
            pass

    def _put_done(self, fut: concurrent.futures.Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            self._failed("put", fut.exception())  # type: ignore[arg-type]

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
            fut = self._reads.submit(health)
            return int(await asyncio.wait_for(asyncio.wrap_future(fut), self.options.timeout))
        except (TimeoutError, Exception) as exc:  # noqa: BLE001
            self._failed("ping", exc)
            return 1

    @override
    def remove_sync(self, key: Any) -> bool:
        try:
            backend = self._backend(key)
            if not backend.capabilities.delete:
                return False
            return bool(backend.delete(self._name(key)))
        except Exception as exc:  # noqa: BLE001 - not removed
            self._failed("remove", exc)
            return False

    @override
    async def list(self) -> list[str]:
        return []  # (the store names objects by digest: LMCache's keys cannot be listed)

    @override
    async def close(self) -> None:
        # Off LMCache's event loop: waiting for the calls in flight (they read and write
        # LMCache's buffers, which it frees after this returns) and closing the backends.
        await asyncio.to_thread(self._close)

    def _close(self) -> None:
        with self._lock:
            self._closed = True
        self._queries.close()
        # Writes read only their own copies; reads write into chunks LMCache allocated,
        # which it frees after this returns: wait for both, within twice the timeout (a
        # store that hangs longer must not hang the engine's shutdown).
        bound = 2 * self.options.timeout
        for workers, what in ((self._writes, "writes"), (self._reads, "reads")):
            if not workers.close(bound):
                self._failed("close", TimeoutError(f"{what} still running after {bound} s"))
        with self._lock:
            backends, self._backends = list(self._backends.values()), {}
        for b in backends:
            try:
                b.close()
            except Exception as exc:  # noqa: BLE001
                self._failed("close", exc)


def _release_result(fut: concurrent.futures.Future[Any]) -> None:
    """Release the chunks a read returned after its caller left (see batched_get)."""
    if fut.cancelled() or fut.exception() is not None:
        return
    for obj in fut.result() or ():
        if obj is not None:
            obj.ref_count_down()


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
        return PLUGIN_NAME.fullmatch(url[len("plugin://") :]) is not None

    @override
    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        name = context.plugin_name or context.url[len("plugin://") :]
        return HiCacheRemoteConnector(
            context.loop, context.local_cpu_backend, context.config, name, context.metadata
        )
