"""Options of the ``redis`` backend (see ``docs/backends/redis.md``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hicache_storage.config import redacting_repr, secret
from hicache_storage.errors import ConfigError
from hicache_storage.storekit.blobstore import BlobOptions

__all__ = ["RedisOptions"]


@redacting_repr
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
        max_concurrency: connections in the pool (the engine calls from a few threads);
            standalone servers only (a cluster client keeps a pool per node, unbounded).
        clear_batch: keys per ``SCAN`` step and per ``UNLINK`` of ``clear()``.
        cluster: the URL names one node of a Redis Cluster: batches are split by the
            owner of each key's slot (one pipeline per node), and ``clear()`` scans every
            primary. A cluster has one database: ``db`` must be 0.
        ssl_ca_certs: with a ``rediss://`` URL, the CA certificates (PEM file) the
            server's certificate must chain to (default: the system's).
        ssl_certfile, ssl_keyfile: a client certificate and its private key (PEM files),
            for a server that asks clients for one (``tls-auth-clients``).
        ssl_cert_reqs: ``required``, ``optional`` or ``none`` (no check of the server's
            certificate: only for tests); default: the URL's ``ssl_cert_reqs``, else
            ``required``.
        ssl_check_hostname: the server's certificate must name the host of the URL;
            default: the URL's, else yes (no with ``ssl_cert_reqs`` ``none``).
    """

    url: str = "redis://127.0.0.1:6379/0"
    username: str | None = None
    password: str | None = secret()
    db: int | None = None
    prefix: str = "hicache:"
    ttl: float = 0.0
    socket_timeout: float = 5.0
    connect_timeout: float = 2.0
    max_concurrency: int = 16
    clear_batch: int = 1000
    cluster: bool = False
    checksum: Literal["xxh3", "none"] = "xxh3"
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_cert_reqs: Literal["required", "optional", "none"] | None = None
    ssl_check_hostname: bool | None = None

    def __post_init__(self) -> None:
        if not self.url:
            raise ConfigError("url must not be empty")
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ConfigError("ssl_keyfile needs ssl_certfile (the certificate of that key)")
        if not (self.ttl == 0 or 0.001 <= self.ttl < float("inf")):
            raise ConfigError("ttl must be 0 (no expiry) or at least 0.001 seconds")
        if self.socket_timeout <= 0 or self.connect_timeout <= 0:
            raise ConfigError("socket_timeout and connect_timeout must be > 0")
        if self.max_concurrency < 1 or self.clear_batch < 1:
            raise ConfigError("max_concurrency and clear_batch must be >= 1")
        if self.db is not None and self.db < 0:
            raise ConfigError("db must be >= 0")
