"""The ``redis`` backend: pages as values of a Redis (or Valkey) server.

Built on :class:`~hicache_storage.storekit.blobstore.BlobStore`: every value is the core
header then the page, so a truncated, foreign, renamed or evicted value is a miss, never
wrong bytes. Keys are ``<prefix><namespace digest>/<fan-out>/<leaf>``; every batch is one
round trip (``MGET``, or a pipeline of ``SET NX`` / ``EXISTS`` / ``UNLINK``), and
``clear()`` removes this namespace's keys only, by ``SCAN`` and ``UNLINK`` in batches
(never ``KEYS`` or ``FLUSHDB``). Options and guarantees: ``docs/backends/redis.md``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, cast

from typing_extensions import override

from hicache_storage.config import scrub, secret
from hicache_storage.errors import (
    BackendError,
    BackendTimeoutError,
    BackendUnavailableError,
    ConfigError,
    ErrorMap,
)
from hicache_storage.protocol import Capabilities
from hicache_storage.storekit.blobstore import PRESENT, BlobOptions, BlobStore, Present, Segments

if TYPE_CHECKING:
    from collections.abc import Sequence

    from hicache_storage.config import StorageConfig
    from hicache_storage.keys import ObjectName

__all__ = ["RedisBackend", "RedisOptions"]

_GLOB = re.compile(r"([*?\[\]\\])")


@dataclass(frozen=True)
class RedisOptions(BlobOptions):
    """Options of the ``redis`` backend (environment: ``HICACHE_STORAGE_REDIS_<NAME>``).

    Attributes:
        url: the server, as ``redis://[user[:password]@]host:port[/db]``,
            ``rediss://...`` (TLS) or ``unix:///path/to/socket``. A password in the URL
            is a secret like ``password``: never logged or shown.
        username: ACL user (overrides the URL's).
        password: password (overrides the URL's); never logged or shown.
        db: database number (overrides the URL's).
        prefix: what every key of this backend starts with, before the object name.
        ttl: seconds a stored page lives (``SET ... PX``); 0 keeps it until deleted or
            evicted by the server's ``maxmemory`` policy.
        socket_timeout: seconds a command may take before the call fails.
        connect_timeout: seconds to connect before the call fails.
        max_connections: connections in the pool (the engine calls from a few threads).
        clear_batch: keys per ``SCAN`` step and per ``UNLINK`` of ``clear()``.
        cluster: the URL names one node of a Redis Cluster: batches are split by the
            owner of each key's slot (one pipeline per node), and ``clear()`` scans every
            primary. A cluster has one database: ``db`` must be 0.
    """

    url: str = "redis://127.0.0.1:6379/0"
    username: str | None = None
    password: str | None = secret()
    db: int | None = None
    prefix: str = "hicache:"
    ttl: float = 0.0
    socket_timeout: float = 5.0
    connect_timeout: float = 2.0
    max_connections: int = 16
    clear_batch: int = 1000
    cluster: bool = False
    checksum: Literal["xxh3", "none"] = "xxh3"

    def __post_init__(self) -> None:
        if not self.url:
            raise ConfigError("url must not be empty")
        if not (self.ttl == 0 or 0.001 <= self.ttl < float("inf")):
            raise ConfigError("ttl must be 0 (no expiry) or at least 0.001 seconds")
        if self.socket_timeout <= 0 or self.connect_timeout <= 0:
            raise ConfigError("socket_timeout and connect_timeout must be > 0")
        if self.max_connections < 1 or self.clear_batch < 1:
            raise ConfigError("max_connections and clear_batch must be >= 1")
        if self.db is not None and self.db < 0:
            raise ConfigError("db must be >= 0")


try:  # the client is an extra: without it the backend says how to install it
    from redis import exceptions as _rx
except ImportError:  # pragma: no cover - the tests install it
    _rx = None  # type: ignore[assignment]

#: redis-py's exceptions as store failures.
_ERRORS: ErrorMap = (
    {
        _rx.TimeoutError: BackendTimeoutError,
        _rx.ConnectionError: BackendUnavailableError,
        _rx.BusyLoadingError: BackendUnavailableError,
        _rx.RedisError: BackendError,
        _rx.RedisClusterException: BackendUnavailableError,  # not a RedisError
        OSError: BackendUnavailableError,
    }
    if _rx is not None
    else {}
)


class RedisBackend(BlobStore[RedisOptions]):
    """Pages in a Redis server: one value per page, one round trip per batch."""

    name = "redis"
    capabilities = Capabilities(delete=True, persistent=True, shared=True)
    options_class = RedisOptions
    error_map: ClassVar[ErrorMap] = _ERRORS

    def __init__(self, config: StorageConfig | None = None, **options: Any) -> None:
        super().__init__(config, **options)
        try:
            import redis
            from redis.connection import parse_url
        except ImportError as exc:
            raise ConfigError(
                "the redis backend needs the redis client: pip install 'hicache-storage[redis]'"
            ) from exc
        opts = self.options
        # The URL's parts, then the options over them (redis-py's from_url would let the
        # URL win). Messages name the server from these parts, never from the URL text
        # (a password with a '#' or a '/' in it would defeat any pattern).
        try:
            parts: dict[str, Any] = parse_url(opts.url)  # type: ignore[no-untyped-call]
        except (ValueError, TypeError):
            raise ConfigError(
                "bad redis url: expected redis://[user[:password]@]host[:port][/db], "
                "rediss://... or unix:///path"
            ) from None
        for name in ("username", "password", "db"):
            if getattr(opts, name) is not None:
                parts[name] = getattr(opts, name)
        self._where = (
            f"unix:{parts['path']}"
            if "path" in parts
            else f"{parts.get('host', 'localhost')}:{parts.get('port', 6379)}"
        ) + f" db {parts.get('db', 0)}"
        self._secrets = [v for v in (parts.get("password"), opts.password) if v]
        self._prefix = opts.prefix
        self._px = max(1, round(opts.ttl * 1000)) if opts.ttl else None
        self._client: Any = None
        try:
            # (a cluster client reads the slot map from the URL's node here already)
            self._client = self._cluster(parts) if opts.cluster else self._standalone(parts)
            self._client.ping()
            if not opts.cluster and self._is_cluster_node():
                raise ConfigError(
                    f"redis at {self._where} is a Redis Cluster node: set the redis option "
                    "cluster to true"
                )
        except ConfigError:
            self._shutdown()
            raise
        except redis.exceptions.AuthenticationError as exc:
            self._shutdown()
            raise ConfigError(
                f"redis at {self._where} refused the credentials: {self._why(exc)}"
            ) from None
        except redis.exceptions.ResponseError as exc:  # NOAUTH, WRONGPASS, ACL denials
            self._shutdown()
            raise ConfigError(
                f"redis at {self._where} refused the connection: {self._why(exc)}"
            ) from None
        except Exception as exc:  # noqa: BLE001 - no server, or one that is not Redis
            self._shutdown()
            raise BackendUnavailableError(
                f"no redis server answers at {self._where}: {self._why(exc)}"
            ) from None

    def _is_cluster_node(self) -> bool:
        """True if the server says it runs in cluster mode (False if it may not say)."""
        from redis.exceptions import ResponseError

        try:
            info = self._client.info("cluster")
        except ResponseError:  # an ACL user not allowed INFO: cannot tell
            return False
        return bool(info.get("cluster_enabled"))

    def _standalone(self, parts: dict[str, Any]) -> Any:
        """A client of one server.

        Its pool waits for a free connection (up to the socket timeout) rather than
        failing a call made while all are busy.
        """
        import redis

        opts = self.options
        pool = redis.BlockingConnectionPool(  # type: ignore[no-untyped-call]
            max_connections=opts.max_connections,
            timeout=opts.socket_timeout,
            socket_timeout=opts.socket_timeout,
            socket_connect_timeout=opts.connect_timeout,
            health_check_interval=30,
            **parts,
        )
        return redis.Redis(connection_pool=pool)

    def _cluster(self, parts: dict[str, Any]) -> Any:
        """A Redis Cluster client that starts from the node of the URL."""
        from redis.backoff import NoBackoff
        from redis.cluster import RedisCluster
        from redis.retry import Retry

        if parts.pop("db", 0) or "path" in parts:
            raise ConfigError("a Redis Cluster is reached over TCP and has only db 0")
        opts = self.options
        return RedisCluster(
            socket_timeout=opts.socket_timeout,
            socket_connect_timeout=opts.connect_timeout,
            # No retries: a dead node is a failure shape within the timeouts, not rounds
            # of them (the engine recomputes; the next call finds the node again).
            retry=Retry(NoBackoff(), 0),
            **parts,
        )

    def _pipeline(self) -> Any:
        """A pipeline without MULTI (a cluster's splits itself by the owner of each key)."""
        if self.options.cluster:
            return self._client.pipeline()
        return self._client.pipeline(transaction=False)

    def _why(self, exc: BaseException) -> str:
        """An error's text without secrets (the server or the client may echo them)."""
        return scrub(f"{type(exc).__name__}: {exc}", self._secrets)

    def _keys(self, names: list[ObjectName]) -> list[str]:
        prefix = self._prefix
        return [prefix + n.path for n in names]

    @override
    def _get_blobs(self, names: list[ObjectName]) -> Sequence[bytes | None]:
        # (no decode_responses: the client returns bytes, or None for a missing key)
        keys = self._keys(names)
        if self.options.cluster:  # one MGET per slot owner
            return cast("list[bytes | None]", self._client.mget_nonatomic(keys))
        return cast("list[bytes | None]", self._client.mget(keys))

    @override
    def _put_blobs_if_absent(
        self, names: list[ObjectName], blobs: list[Segments]
    ) -> list[bool | Present | Exception]:
        pipe = self._pipeline()
        for key, segments in zip(self._keys(names), blobs, strict=True):
            pipe.set(key, b"".join(segments), nx=True, px=self._px)
        # SET NX answers True when it stored the value, None when the key held one; an
        # error reply (out of memory under noeviction...) fails its item alone.
        return [_stored(r) for r in pipe.execute(raise_on_error=False)]

    @override
    def _exists_blobs(self, names: list[ObjectName]) -> list[bool | Exception]:
        # EXISTS k1 k2... answers a count: a pipeline gives one answer per key.
        return self._each_key("exists", names)

    @override
    def _delete_blobs(self, names: list[ObjectName]) -> list[bool | Exception]:
        return self._each_key("unlink", names)

    def _each_key(self, command: str, names: list[ObjectName]) -> list[bool | Exception]:
        """One ``EXISTS`` or ``UNLINK`` per key, in one pipeline: an answer (or error) each."""
        pipe = self._pipeline()
        send = getattr(pipe, command)
        for key in self._keys(names):
            send(key)
        return [_count(r) for r in pipe.execute(raise_on_error=False)]

    @override
    def _clear_namespace(self) -> None:
        """``SCAN`` this namespace's keys and ``UNLINK`` them, a batch at a time.

        The server never runs a command longer than one batch (``KEYS`` or ``FLUSHDB``
        would block it, or remove what is not ours).
        """
        pattern = _GLOB.sub(r"\\\1", self._prefix + self.namespace_prefix) + "*"
        batch: list[bytes] = []
        # (a cluster client scans every primary)
        for key in self._client.scan_iter(match=pattern, count=self.options.clear_batch):
            batch.append(key)
            if len(batch) >= self.options.clear_batch:
                self._unlink(batch)
                batch = []
        if batch:
            self._unlink(batch)

    def _unlink(self, keys: list[bytes]) -> None:
        if not self.options.cluster:
            self._client.unlink(*keys)
            return
        pipe = self._pipeline()  # keys of many slots: one command per key, split by node
        for key in keys:
            pipe.unlink(key)
        pipe.execute()

    @override
    def close(self) -> None:
        self._shutdown()

    def _shutdown(self) -> None:
        """Close the client and every connection of its pool (the client does not own it)."""
        if self._client is None:
            return
        self._client.close()
        if not self.options.cluster:
            self._client.connection_pool.disconnect()

    @override
    def __repr__(self) -> str:
        return (
            f"RedisBackend(server={self._where!r}, prefix={self._prefix!r}, "
            f"namespace={self.namespace.digest})"
        )


def _stored(reply: object) -> bool | Present | Exception:
    """The answer of one ``SET NX``: stored, already present, or the item's error."""
    if reply is True:
        return True
    if reply is None:
        return PRESENT
    if isinstance(reply, Exception):
        return reply
    return BackendError(f"unexpected reply to SET: {type(reply).__name__}")


def _count(reply: object) -> bool | Exception:
    """The answer of one ``EXISTS`` or ``UNLINK`` of a single key."""
    if isinstance(reply, Exception):
        return reply
    if type(reply) is int and reply in (0, 1):
        return bool(reply)
    return BackendError(f"unexpected reply: {type(reply).__name__}")
